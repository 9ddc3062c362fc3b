"""Which tokenizer a checkpoint goes with, read from the files around it (no model loaded)."""

from __future__ import annotations

import json
from pathlib import Path

from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.tokenization import TextTokenizer, load_tokenizer


def tokenizer_near(path: str | Path) -> TextTokenizer | None:
    """The checkpoint's ``tokenizer.json``, else (a ``cse_models`` run or one of its checkpoints)
    the tokenizer its ``train_config.json`` used (a named one, an HF ``init_from``'s for a run on a
    table, else its pack's BPE), else a ``tokenizer.json`` beside the checkpoint (a directory of
    ``stepN`` checkpoints); None when there is none of these."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    for parent in (path, path.parent, path.parent.parent):
        cfg = parent / "train_config.json"
        if cfg.is_file():
            train_config = json.loads(cfg.read_text())
            trained_on = train_config.get("data", {})
            if trained_on.get("tokenizer"):
                return load_tokenizer(trained_on["tokenizer"])
            if trained_on.get("table") and train_config.get("init_from"):  # the HF model's own tokenizer
                return tokenizer_near(train_config["init_from"])
            return load_pack(trained_on.get("pack")).tokenizer()
    if (path.parent / "tokenizer.json").is_file():
        return load_tokenizer(path.parent)
    return None
