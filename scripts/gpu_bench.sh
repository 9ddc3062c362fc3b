#!/usr/bin/env bash
# The GPU checks on one lent GPU, each step under its own time limit so that a slow one still
# leaves the others' results: in-run GC's overhead on GPT-2 small's shape (benchmarks/inrun.py),
# GC of the long tail by the structured method at 16 GB with its statistics timed on the host and
# on the device (benchmarks/gpu_gc.py --statistics, issue 61's GPU row), and the gpu-marked tests.
#   scripts/gpu_bench.sh   (from the repository root, $OUT set)
set -u
. "$(dirname "$0")/gpu_common.sh"
gpu_python >"$OUT/gpu.txt"  # not in a pipe: its exports must reach this shell
cat "$OUT/gpu.txt"
step() {  # step SECONDS NAME COMMAND...: its log in $OUT/NAME.log, its time and exit status printed
  local limit=$1 name=$2 start
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc $? in $(( $(date +%s) - start )) s"
  tail -4 "$OUT/$name.log"
}
step 120 inrun python3 benchmarks/inrun.py --model gpt2-small --device cuda --steps 40 --rounds 2 \
  --out "$OUT/inrun_gpu.csv"
step 260 gc16 python3 benchmarks/gpu_gc.py --out "$OUT/gc16" --methods structured --max-memory-gb 16 --statistics
step 90 tests python3 -m pytest -m gpu -q -p no:xdist -p no:cacheprovider
