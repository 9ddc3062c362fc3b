"""Sequence embeddings at named points of each layer (docs/design.md §3).

A sequence's embedding at layer l is the mean over its real (non-pad) tokens of the
hidden states at a named point of layer l:

- ``"block"`` (default): the block's output;
- ``"ffn_input"`` / ``"ffn_output"``: the input / output of the feed-forward module
  (CSE routes on the input of the module it replaces);
- ``"attn_input"``: the input of the attention module.

Works on the models of ``cse_models`` (GPT, BERT, with or without sparse layers) and on
the HF families with a layer layout (GPT-2, BERT e.g. the pretrained MiniLM, GPT-NeoX/Pythia,
Llama, Qwen2, OLMo; :mod:`ntkscope.runs.families`). Forward hooks pool each point as
it is computed, so no activation is kept beyond the (n, d) means that were asked for, and the
forward stops once the last asked-for point is pooled (the later blocks and the output head are
never run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ntkscope.core.checks import InputError, check_choice, check_positive_int, entry
from ntkscope.core.lm import masked_mean
from ntkscope.core.memory import training_thresholds
from ntkscope.core.progress import progress_bar
from ntkscope.runs.families import POINTS, layer_points


def _resolve(block: nn.Module, path: str | None) -> nn.Module:
    return block if path is None else block.get_submodule(path)


class _Pooled(Exception):
    """Raised by the hook of the last asked-for layer: the rest of the forward is not needed."""


@dataclass(frozen=True)
class LayerEmbeddings:
    """embeddings: {layer index: (n, d) float32}; point; n sequences."""

    embeddings: dict
    point: str
    n: int

    @property
    def layers(self) -> list:
        return sorted(self.embeddings)


@entry("layer_embeddings")
@torch.no_grad()
def layer_embeddings(model: nn.Module, batch: dict, *, point: str = "block", layers=None,
                     batch_size: int = 64) -> LayerEmbeddings:
    """Mean-pooled embeddings of every sequence at ``point`` of each of ``layers`` (default all).

    Parameters
    ----------
    batch : {"input_ids": (n, T), "attention_mask": (n, T)} (the mask may be omitted).
    point : one of :data:`POINTS`.
    layers : block indices (default: all blocks).
    batch_size : sequences per forward pass (a progress bar counts them).
    """
    check_choice("point", point, POINTS)
    check_positive_int("batch_size", batch_size)
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise InputError("batch", "must be a dict with input_ids (and attention_mask)", type(batch).__name__)
    blocks, path, use_input = layer_points(model, point)
    layers = list(range(len(blocks))) if layers is None else list(layers)
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < len(blocks)]
    if bad:
        raise InputError("layers", f"must be block indices in [0, {len(blocks)})", bad)
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    n = ids.shape[0]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    training_thresholds()  # forward passes, no budget: not under a kernel's 1 MiB malloc threshold
    out: dict[int, list] = {i: [] for i in layers}
    current: dict = {}
    last = max(layers) if layers else None

    def make_hook(i):
        def hook(_module, args, kwargs, output):
            h = (args[0] if args else kwargs["hidden_states"]) if use_input else output
            h = h[0] if isinstance(h, tuple) else h
            out[i].append(masked_mean(h.float(), current["mask"]).cpu())
            if i == last:
                raise _Pooled
        return hook

    hooks = [_resolve(blocks[i], path).register_forward_hook(make_hook(i), with_kwargs=True) for i in layers]
    bar = progress_bar(n, "layer embeddings", "sequence")
    try:
        for s in range(0, n, batch_size):
            chunk_ids, chunk_mask = ids[s:s + batch_size].to(device), mask[s:s + batch_size].to(device)
            current["mask"] = chunk_mask
            extra = {}
            sparse = getattr(getattr(model, "config", None), "sparse", None)
            if getattr(sparse, "kind", None) == "demix":  # DEMix needs a domain: embed through expert 0
                extra["domains"] = torch.zeros(len(chunk_ids), dtype=torch.long, device=device)
            try:
                model(input_ids=chunk_ids, attention_mask=chunk_mask, **extra)
            except _Pooled:
                pass
            bar.update(len(chunk_ids))
    finally:
        bar.close()
        for h in hooks:
            h.remove()
        model.train(was_training)
    return LayerEmbeddings({i: torch.cat(v).numpy() for i, v in out.items()}, point, n)
