#!/usr/bin/env bash
# The warm-up map's decisive part at a medium scale on one lent GPU (issue 42, item 7; the spec
# warmup-map-scale: 8 layers x 512, two seeds). Seed 0 runs first, alone, so that a call that runs
# out of time still brings back one whole seed; seed 1 gets what is left of SECONDS. Units that
# finished come back as one archive (units, results, logs, each model's metrics; no checkpoints).
#   scripts/gpu_scale.sh SECONDS [WORKERS]   (from the repository root, $OUT set)
set -u
LIMIT=${1:-480}
WORKERS=${2:-6}
. "$(dirname "$0")/gpu_common.sh"
gpu_python >"$OUT/gpu.txt"  # not in a pipe: its exports must reach this shell
cat "$OUT/gpu.txt"
gpu_mps_start
start=$(date +%s)
for seed in 0 1; do
  left=$(( LIMIT - ($(date +%s) - start) ))
  [ "$left" -lt 60 ] && { echo "seed $seed: ${left} s left, not started"; break; }
  echo "seed $seed: up to $left s"
  timeout "$left" python3 -m ntkscope experiment run warmup-map-scale --out runs/warmup-map-scale --seeds "$seed" \
    --workers "$WORKERS" --device cuda >>"$OUT/scale.log" 2>&1
  echo "seed $seed: rc $? after $(( $(date +%s) - start )) s"
done
gpu_mps_stop
python3 -m ntkscope experiment status runs/warmup-map-scale 2>&1 | tail -15
tar czf "$OUT/scale.tgz" --exclude='checkpoints' --exclude='tensorboard' runs/warmup-map-scale
ls -la "$OUT"
