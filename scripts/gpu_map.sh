#!/usr/bin/env bash
# The warm-up map on one lent GPU (issue 42): both specs at once, each stopped before the call's
# limit (units that finished are kept; the rest resume from their keys on any machine). What
# finished comes back as one archive: units, results, plans, tables, logs and each model's
# metrics and analysis caches (models.tgz); checkpoints stay behind (too large to bring back).
#   scripts/gpu_map.sh SECONDS   (run from the repository root, with $OUT set)
set -u
LIMIT=${1:-480}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, sklearn, scipy; print('torch', torch.__version__, 'sklearn', sklearn.__version__, 'scipy', scipy.__version__, 'cuda', torch.cuda.is_available())"
start=$(date +%s)
timeout "$LIMIT" python3 -m ntkscope experiment run warmup-map --out runs/warmup-map --workers 11 --device cuda \
  >"$OUT/map.log" 2>&1 &
timeout "$LIMIT" python3 -m ntkscope experiment run warmup-map-mix --data packs/tail-half --out runs/warmup-map-mix \
  --workers 3 --device cuda >"$OUT/mix.log" 2>&1 &
wait
echo "ran $(( $(date +%s) - start )) s"
python3 -m ntkscope experiment status runs/warmup-map 2>&1 | tail -5
python3 -m ntkscope experiment status runs/warmup-map-mix 2>&1 | tail -5
tar czf "$OUT/map.tgz" --exclude='models' runs/warmup-map runs/warmup-map-mix
tar czf "$OUT/models.tgz" --exclude='checkpoints' --exclude='tensorboard' runs/warmup-map/models runs/warmup-map-mix/models
ls -la "$OUT"
