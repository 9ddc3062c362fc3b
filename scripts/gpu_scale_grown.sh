#!/usr/bin/env bash
# CSE where the model is not starved of data (issue 60; the spec scale-grown: 8 layers x 512 on the
# grown pack, 3 seeds, 24 units) on one lent GPU, every unit in one call under CUDA MPS, TF32 matrix
# products allowed (the build CRITERIA.md registers). The grown pack travels in packs/scale (carry
# it). Units that finished come back as one archive (units, results, each model's metrics and
# validation curve; no checkpoints), with device.json naming the build.
#   scripts/gpu_scale_grown.sh SECONDS [WORKERS]   (from the repository root, $OUT set)
set -u
LIMIT=${1:-480}
WORKERS=${2:-14}
. "$(dirname "$0")/gpu_common.sh"
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1  # every worker process inherits it
gpu_python >"$OUT/gpu.txt"  # not in a pipe: its exports must reach this shell
cat "$OUT/gpu.txt"
python3 -c "from ntkscope.text.corpus.pack import load_pack; print('pack', load_pack('packs/scale').manifest['version'])" || exit 1
start=$(date -u +%FT%TZ)
python3 - "$start" "$LIMIT" "$WORKERS" >"$OUT/device.json" <<'PY'
import json, subprocess, sys, torch
name, driver = subprocess.check_output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       text=True).splitlines()[0].split(", ")
print(json.dumps({"gpu": name, "driver": driver, "torch": torch.__version__,
                  "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                  "call": {"started": sys.argv[1], "limit_s": int(sys.argv[2]), "workers": int(sys.argv[3]),
                           "mps": "requested"}}, indent=2))
PY
cat "$OUT/device.json"
gpu_mps_start
t0=$(date +%s)
timeout -k 15 "$LIMIT" python3 -m ntkscope experiment run scale-grown --data packs/scale --out runs/scale-grown \
  --workers "$WORKERS" --device cuda >"$OUT/scale.log" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/scale.log"
# the archive first: on 2026-11-28 stopping MPS hung past the call's limit and nothing came back
tar czf "$OUT/scale-grown.tgz" --exclude='checkpoints' --exclude='tensorboard' --exclude='analysis' runs/scale-grown
gpu_mps_stop
ls -la "$OUT"
