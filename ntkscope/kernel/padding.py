"""Trimming a chunk's padding before the structured kernel's forward and backward.

A causal language model's value at a real token never reads a later position, and the padding of
a right-padded batch comes after every real token, so the padded positions' outputs are not read:
their output cotangents are exactly zero, and every pair product over them adds zero. The
structured kernel (:mod:`ntkscope.kernel.structured`) therefore orders the samples by length
(longest first, so that each chunk holds samples of similar length), cuts each chunk at its longest
sample, runs the forward and backward on the shorter sequences, and keeps each chunk's factors at
its own length: stacked with other chunks' (a run of samples held together), a shorter chunk's go
in with zero rows after its length, up to the run's longest sample; runs of different lengths
meet in products that sum over each one's own positions. The kernel is the untrimmed one up to
the rounding of shorter products (tested against it, ``tests/test_structured.py``).

Trimmed: the causal language-model objectives (``"loss"``, ``"true-logit"``, ...) on a dict batch
whose inputs are ``(n, T)`` tensors and 4-D ``(n, 1, T, T)`` masks (transformers' expanded
attention mask) and whose real tokens form a prefix of every row. Anything else runs as it is.
"""

from __future__ import annotations

import numpy as np
import torch

from ntkscope.kernel.factors import Dense, Embed, Linear
from ntkscope.kernel.objectives import CausalLMLoss


def _real(data: dict) -> torch.Tensor | None:
    """The (n, T) real-token mask of prepared causal-LM data that can be trimmed, else None."""
    aux, inputs = data.get("aux"), data.get("inputs")
    if not isinstance(aux, dict) or not torch.is_tensor(aux.get("mask")) or aux["mask"].dim() != 2:
        return None
    mask = aux["mask"]
    T = mask.shape[1]
    if not isinstance(inputs, dict):
        return None
    for value in inputs.values():
        if not torch.is_tensor(value) or value.shape[0] != mask.shape[0]:
            return None
        if not ((value.dim() == 2 and value.shape[1] == T) or (value.dim() == 4 and value.shape[-2:] == (T, T))):
            return None
    prefix = bool((mask[:, 1:] <= mask[:, :-1]).all()) if T > 1 else True  # right padding only
    return mask if prefix else None


def length_order(objective, data: dict) -> np.ndarray | None:
    """Sample order by length, longest first (stable), when ``data`` (prepared by ``objective``)
    can be trimmed and has padding to trim; None otherwise."""
    if not isinstance(objective, CausalLMLoss):
        return None
    mask = _real(data)
    if mask is None:
        return None
    lengths = mask.sum(1).cpu().numpy()
    if lengths.max() == mask.shape[1] and lengths.min() == mask.shape[1]:
        return None
    return np.argsort(-lengths, kind="stable")


def trimmed(objective, data: dict) -> tuple[dict, int, int]:
    """(``data`` cut at its longest sample's length L, L, T): as it is (L = T) where it cannot be trimmed."""
    mask = _real(data) if isinstance(objective, CausalLMLoss) else None
    if mask is None:
        return data, -1, -1
    T = mask.shape[1]
    L = max(int(mask.sum(1).max()), 2)  # a causal value needs a token and its successor's position
    if L >= T:
        return data, T, T
    inputs = {k: v[:, :L] if v.dim() == 2 else v[..., :L, :L] for k, v in data["inputs"].items()}
    aux = {k: v[:, :L] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == T else v for k, v in data["aux"].items()}
    return {**data, "inputs": inputs, "aux": aux}, L, T


def longest(objective, data: dict, rows: slice) -> int | None:
    """The longest real length (at least 2) among ``rows`` of ``data`` where it can be trimmed, else None."""
    mask = _real(data) if isinstance(objective, CausalLMLoss) else None
    return None if mask is None else max(int(mask[rows].sum(1).max()), 2)


def positionwise(uses: dict, L: int) -> bool:
    """Whether every factor of a chunk cut at L has the chunk's L positions (or none: summed over
    them), so that it can stand beside other chunks' factors with zero rows after its L; False for
    a layer that does not act position by position (the chunk is then captured uncut)."""
    for parts in uses.values():
        for f in parts:
            if f is None or isinstance(f, Dense):
                continue
            if isinstance(f, Linear) and f.a.shape[1] == L and f.delta.shape[1] == L:
                continue
            if isinstance(f, Embed) and f.tokens.shape[1] == L and f.delta.shape[1] == L:
                continue
            return False
    return True
