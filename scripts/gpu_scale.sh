#!/usr/bin/env bash
# The warm-up map's decisive part at a medium scale on one lent GPU (issue 42, item 7; the spec
# warmup-map-scale: 8 layers x 512, two seeds). Seed 0 runs first, alone, so that a call that runs
# out of time still brings back one whole seed; seed 1 gets what is left of SECONDS. Units that
# finished come back as one archive (units, results, logs, each model's metrics; no checkpoints).
#   scripts/gpu_scale.sh SECONDS [WORKERS]   (from the repository root, $OUT set)
set -u
LIMIT=${1:-480}
WORKERS=${2:-6}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
mps=""
if command -v nvidia-cuda-mps-control >/dev/null; then  # the arms' kernels side by side, not in turns
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps-pipe /tmp/mps-log
  if nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
    mps=1; echo "CUDA MPS on"
  else
    echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
start=$(date +%s)
for seed in 0 1; do
  left=$(( LIMIT - ($(date +%s) - start) ))
  [ "$left" -lt 60 ] && { echo "seed $seed: ${left} s left, not started"; break; }
  echo "seed $seed: up to $left s"
  timeout "$left" python3 -m ntkscope experiment run warmup-map-scale --out runs/warmup-map-scale --seeds "$seed" \
    --workers "$WORKERS" --device cuda >>"$OUT/scale.log" 2>&1
  echo "seed $seed: rc $? after $(( $(date +%s) - start )) s"
done
[ -n "$mps" ] && echo quit | nvidia-cuda-mps-control
python3 -m ntkscope experiment status runs/warmup-map-scale 2>&1 | tail -15
tar czf "$OUT/scale.tgz" --exclude='checkpoints' --exclude='tensorboard' runs/warmup-map-scale
ls -la "$OUT"
