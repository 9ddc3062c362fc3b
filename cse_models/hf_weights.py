"""A converted HF model's weights under the HF model's own tensor names (what ``Trainer`` writes
into ``checkpoint-N``), apart from :meth:`~cse_models.SparseHF.save_pretrained`'s format (the
wrapper's names, ``hf.`` first).

``save_pretrained`` renames some tensors for older readers (GPT-NeoX's ``lm_head`` is saved as
``embed_out``); :func:`renamed_key` applies transformers' own renaming rules to read them back,
and :func:`load_named` loads such a file into the HF model, strict up to those renames and to
tied weights.
"""

from __future__ import annotations

import re

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def renamed_key(key: str, model) -> str:
    """``key`` as transformers' loading renames it for ``model`` (its ``WeightRenaming`` rules:
    e.g. GPT-NeoX's ``embed_out.`` -> ``lm_head.``); the key itself where there are none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # optional: HF models only
        from transformers.core_model_loading import WeightRenaming  # as above
    except ImportError:
        return key
    for rule in get_model_conversion_mapping(model):
        if type(rule) is WeightRenaming and len(rule.source_patterns) == len(rule.target_patterns) == 1:
            key = re.sub(rule.source_patterns[0], rule.target_patterns[0], key)
    return key


def saved_names(path) -> list:
    """The tensor names of a safetensors file, read from its header."""
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def named_tensors(model, path) -> tuple[dict, dict]:
    """(the safetensors file ``path`` as saved, the same tensors under ``model``'s names): a key
    the model lacks is read back by :func:`renamed_key` where that names a tensor of the model
    the file does not hold itself; any other key stays as saved."""
    saved, own = load_file(str(path)), model.state_dict()
    named = {}
    for key, value in saved.items():
        target = key if key in own else renamed_key(key, model)
        named[target if target == key or (target in own and target not in saved) else key] = value
    return saved, named


@torch.no_grad()
def load_named(model, path) -> tuple[list, list]:
    """Load the safetensors file ``path``, saved under ``model``'s own tensor names (renamed ones
    read back by :func:`renamed_key`), into ``model``; returns (missing, unexpected) names. A
    tensor tied to a loaded one (the head to the embedding) is not missing."""
    own = model.state_dict()
    _, named = named_tensors(model, path)
    unexpected = sorted(k for k in named if k not in own)
    for key, value in named.items():
        if key in own:
            own[key].copy_(value)
    loaded = {own[k].data_ptr() for k in named if k in own}
    missing = sorted(k for k, t in own.items() if k not in named and t.data_ptr() not in loaded)
    return missing, unexpected
