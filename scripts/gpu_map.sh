#!/usr/bin/env bash
# The warm-up map on one lent GPU (issue 42): both specs at once, each stopped before the call's
# limit (units that finished are kept; the rest resume from their keys on any machine). The units
# committed from the same GPU kind (a build whose device.json names this GPU) count as done
# (--adopt), except the trunks: their checkpoints were never brought back, so they are re-made
# for the arms that branch from them, and the script says whether they came out bit for bit the
# committed ones (another GPU kind's trunks do not: its units are not adopted). What finished comes back as one archive: units, results,
# plans, tables, logs and each model's metrics and analysis caches (models.tgz); checkpoints stay
# behind (too large to bring back); each model's validation.csv (per-domain validation loss every 50
# steps, the sweep preset's eval_every) comes back in models.tgz.
#   scripts/gpu_map.sh SECONDS [MAP_WORKERS] [MIX_WORKERS]   (from the repository root, $OUT set)
# Many small units share one GPU: with CUDA MPS (started here when the driver has it, stopped at
# the end) their kernels run side by side instead of in turns.
set -u
LIMIT=${1:-480}
MAP_WORKERS=${2:-12}
MIX_WORKERS=${3:-3}
. "$(dirname "$0")/gpu_common.sh"
gpu_python
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
stage() {  # the committed results and plans of this GPU kind's builds under $1, less the trunks, as an --adopt directory
  mkdir -p "$2/results" "$2/trunks" "$2/plans"
  for build in "$1" "$1"/h100; do
    kind=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu'])" "$build/device.json" 2>/dev/null)
    case "$GPU" in "$kind"*) ;; *) continue ;; esac
    echo "adopting the units of $build ($kind)"
    cp "$build"/plans/*.json "$2/plans/" 2>/dev/null  # a plan walks every trunk checkpoint: minutes a unit
    for f in "$build"/results/*.json; do
      case "$(basename "$f")" in dense-seed*) cp "$f" "$2/trunks/" ;; *) cp "$f" "$2/results/" ;; esac
    done
  done
}
stage figures/warmup-map /tmp/adopt-map
stage figures/warmup-map/mix /tmp/adopt-mix
gpu_mps_start
start=$(date +%s)
timeout "$LIMIT" python3 -m ntkscope experiment run warmup-map --out runs/warmup-map --workers "$MAP_WORKERS" \
  --device cuda --adopt /tmp/adopt-map >"$OUT/map.log" 2>&1 &
timeout "$LIMIT" python3 -m ntkscope experiment run warmup-map-mix --data packs/tail-half --out runs/warmup-map-mix \
  --workers "$MIX_WORKERS" --device cuda --adopt /tmp/adopt-mix >"$OUT/mix.log" 2>&1 &
wait
echo "ran $(( $(date +%s) - start )) s"
gpu_mps_stop
for pair in map:warmup-map mix:warmup-map-mix; do  # adopted arms pair with these trunks only if they are the committed ones
  python3 - "/tmp/adopt-${pair%%:*}" "runs/${pair#*:}" <<'PY'
import json, pathlib, sys
staged, run = pathlib.Path(sys.argv[1]) / "trunks", pathlib.Path(sys.argv[2]) / "results"
for old in sorted(staged.glob("*.json")):
    new = run / old.name
    if new.is_file():
        same = json.loads(new.read_text())["blocks"] == json.loads(old.read_text())["blocks"]
        print(f"{run.parent.name} {old.stem}: re-made {'bit for bit' if same else 'DIFFERENT: its adopted arms do not pair'}")
PY
done
python3 -m ntkscope experiment status runs/warmup-map 2>&1 | tail -5
python3 -m ntkscope experiment status runs/warmup-map-mix 2>&1 | tail -5
tar czf "$OUT/map.tgz" --exclude='models' runs/warmup-map runs/warmup-map-mix
tar czf "$OUT/models.tgz" --exclude='checkpoints' --exclude='tensorboard' runs/warmup-map/models runs/warmup-map-mix/models
ls -la "$OUT"
