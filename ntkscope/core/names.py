"""A model's module paths as a table and a reader say them: the block a module is in, and its part.

``transformer.h.2.mlp`` (``cse_models``' GPT), ``hf.gpt_neox.layers.2.mlp.layer`` (an HF model
inside :class:`cse_models.SparseHF`) and ``encoder.layer.2.output`` (BERT) are all block 2.
"""

from __future__ import annotations

import re

_BLOCK = re.compile(r"(?:^|\.)(?:h|layers?|blocks?)\.(\d+)(?:\.(\w+))?")


def block_of(path) -> tuple[int, str | None] | None:
    """(block index, the part after it or None) of the module path ``path``; None when it names no
    block. A bare index (2 or "2") is block 2."""
    text = str(path)
    if text.isdigit():
        return int(text), None
    found = _BLOCK.search(text)
    return None if found is None else (int(found[1]), found[2])
