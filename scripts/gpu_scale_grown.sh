#!/usr/bin/env bash
# CSE where the model is not starved of data (issue 60; the spec scale-grown: 8 layers x 512 on the
# grown pack, 3 seeds, 24 units) on one lent GPU, every unit in one call under CUDA MPS, TF32 matrix
# products allowed (the build CRITERIA.md registers). The grown pack travels in packs/scale (carry
# it). Units that finished come back as one archive (units, results, each model's metrics and
# validation curve; no checkpoints), with device.json naming the build. Run again, it adopts the
# committed units of the same GPU kind and runs the rest (on 2026-11-28: DEMix seeds 0 and 2).
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
# the units committed from this GPU kind count as done (--adopt), except the trunks: their checkpoints
# were not brought back, so they are re-made for the arms still to run, and compared with the committed.
# Commit only the missing arms' results: the committed trunks stay the ones every committed arm
# branched from (a re-made trunk's results would pair the adopted arms with a trunk they did not branch from)
D=figures/warmup-map/scale-grown
mkdir -p /tmp/adopt/results /tmp/adopt-trunks
kind=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu'])" "$D/device.json" 2>/dev/null)
if [ -n "$kind" ] && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "^$kind"; then
  for f in "$D"/results/*.json; do
    case "$(basename "$f")" in dense-seed*) cp "$f" /tmp/adopt-trunks/ ;; *) cp "$f" /tmp/adopt/results/ ;; esac
  done
  echo "adopting $(ls /tmp/adopt/results | wc -l) units of $D ($kind)"
fi
gpu_mps_start
t0=$(date +%s)
timeout -k 15 "$LIMIT" python3 -m ntkscope experiment run scale-grown --data packs/scale --out runs/scale-grown \
  --workers "$WORKERS" --device cuda --adopt /tmp/adopt >"$OUT/scale.log" 2>&1
echo "rc $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/scale.log"
python3 - /tmp/adopt-trunks runs/scale-grown/results <<'PY' | tee -a "$OUT/scale.log"
import json, pathlib, sys
import numpy as np
for old in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    new = pathlib.Path(sys.argv[2]) / old.name
    if new.is_file():
        a, b = (np.asarray(json.loads(p.read_text())["blocks"]["loss"]) for p in (old, new))
        print(f"{old.stem} re-made: largest difference of a block's loss from the committed trunk {np.abs(a - b).max():.2e}")
PY
# the archive first: on 2026-11-28 stopping MPS hung past the call's limit and nothing came back
tar czf "$OUT/scale-grown.tgz" --exclude='checkpoints' --exclude='tensorboard' --exclude='analysis' runs/scale-grown
gpu_mps_stop
ls -la "$OUT"
