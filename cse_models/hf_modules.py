"""The modules that stand in an HF block when its FFN or attention becomes sparse
(:class:`~cse_models.SparseHF`): the dense module as an expert, and the sparse layer in the
block's place, fed the call's padding mask and domain labels from the model's context.

An attention expert (MoA) runs the block's attention on the sequences routed to it, with their
rows of every argument of the call (mask, positions, rotary tables); the arguments of the call in
progress reach it through a thread-local, and a key-value cache is refused (experts that see part
of the batch cannot share one).
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn

from cse_models.experts import CSELayer, DEMixLayer
from ntkscope.core.checks import UserError


class HFExpert(nn.Module):
    """An HF MLP as an expert: ``forward(x, key_mask)`` ignores the mask (the MLP is per token).
    ``out``: the FFN's output projection where the family keeps it apart (:class:`Layout`'s
    ``ffn_out``), applied after ``mlp``."""

    def __init__(self, mlp: nn.Module, out: nn.Module | None = None):
        super().__init__()
        self.mlp = mlp
        self.out = out

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.mlp(x)
        return y if self.out is None else self.out(y)


_attention_call = threading.local()  # the arguments of the HF attention call in progress (MoA)
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")  # an HF attention's cache, by name


def _is_cache(value) -> bool:
    return type(value).__name__.endswith("Cache")


def _rows_of(value, rows: torch.Tensor, batch: int):
    """``value`` (an argument of an attention call) for the sequences ``rows``: tensors of two
    dimensions or more whose first is the batch (masks, positions, rotary tables) are indexed,
    tuples, lists and dicts entry by entry, anything else kept (a 1-D tensor is per position)."""
    if torch.is_tensor(value):
        return value[rows] if value.dim() >= 2 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_of(v, rows, batch) for v in value)
    if isinstance(value, dict):
        return {k: _rows_of(v, rows, batch) for k, v in value.items()}
    return value


class HFAttentionExpert(nn.Module):
    """An HF attention module as an expert (MoA): ``forward(x, key_mask, rows=)`` runs it on the
    sequences ``rows`` of the call in progress (their attention mask, rotary positions, ...: every
    argument of the block's call, indexed by ``rows``) and returns its output (B', T, d)."""

    takes_rows = True

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        if not hasattr(_attention_call, "value"):
            raise UserError("HFAttentionExpert: runs inside its block's attention call (HFSparseAttention), which "
                            "gives it the call's mask and positions")
        args, kwargs, batch = _attention_call.value
        if rows is not None:
            args, kwargs = _rows_of(args, rows, batch), _rows_of(kwargs, rows, batch)
        out = self.attn(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFSparseAttention(nn.Module):
    """Stands where a block's attention stood: the call's hidden states (B, T, d) and other
    arguments in, ``(output, None)`` out (no attention weights), routed by the sparse layer."""

    def __init__(self, layer: nn.Module, context: dict):
        super().__init__()
        self.layer = layer
        self.context = context

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        kwargs.pop("output_attentions", None)
        cached = [k for k, v in kwargs.items() if v is not None and (k in CACHE_ARGUMENTS or _is_cache(v))]
        if cached or any(_is_cache(a) for a in args):
            raise UserError(f"SparseHF: attention experts (MoA) run without a key-value cache (each expert sees its own "
                            f"sequences); call the model with use_cache=False (got {cached or 'a cache'})")
        _attention_call.value = (args, kwargs, hidden_states.shape[0])
        try:
            mask, domains = self.context.get("key_mask"), self.context.get("domains")
            return self.layer(hidden_states, mask, domains), None
        finally:
            del _attention_call.value


class HFSparseFFN(nn.Module):
    """Stands where a block's MLP stood: the hidden states (B, T, d) in, the sparse layer's output
    out, with the padding mask and domain labels of the call in progress from ``context``."""

    def __init__(self, layer: nn.Module, context: dict):
        super().__init__()
        self.layer = layer
        self.context = context

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        mask, domains = self.context.get("key_mask"), self.context.get("domains")
        if isinstance(self.layer, (CSELayer, DEMixLayer)):
            return self.layer(hidden_states, mask, domains)
        return self.layer(hidden_states, mask)
