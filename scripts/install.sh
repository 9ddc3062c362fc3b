#!/usr/bin/env bash
# Install ntkscope (and cse_models) in editable mode.
# On a machine with no torch, first install the CPU wheel torch==2.13.0: an unpinned
# torch would pull several GB of CUDA packages. A machine that already has a torch
# in the supported range (e.g. a CUDA build) keeps it.
# Usage: scripts/install.sh [EXTRAS]   e.g. scripts/install.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet torch==2.13.0
fi
extras=${1:-}
target="."
[ -n "$extras" ] && target=".[$extras]"
"$PY" -m pip install --quiet --disable-pip-version-check -e "$target"
# The test suite also checks GPT-2's BPE (tiktoken) and a real HF checkpoint's tokenizer.
if [[ ",$extras," == *",dev,"* ]]; then
  PYTHON="$PY" scripts/fetch_sources.sh gpt2 minilm
fi
