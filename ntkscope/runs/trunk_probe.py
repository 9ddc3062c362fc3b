"""What a rule could read from a dense trunk at each kept checkpoint (docs/warmup-map.md, "The
trunks' logs"): a fixed probe of validation blocks, measured the same way at every step.

At each checkpoint, at each sparse layer, the router CSE's conversion would fit there
(:func:`~ntkscope.representation.router.fit_router` on the fitting sample's FFN inputs, as
``convert_to_cse`` fits it) routes every probe block to its expert
(:meth:`~ntkscope.representation.router.RouterFit.predict`: every block goes somewhere, as in
training). The groups are then

- ``domain``: the probe's blocks of each domain (labelled; the tail's purity needs them);
- ``expert``: the blocks routed to each expert, expert 0 the largest of the fit (the bulk);
- ``small``: every block routed to an expert other than the bulk (label-free: what the tail's
  experts would serve, when it has any), as one group.

and each group's row holds its mean validation loss, its gradient consistency against the whole
probe (:func:`~ntkscope.kernel.uncertainty.kernel_gc` on one empirical NTK of the probe per step,
``output``, with the jackknife interval and the random null), the share of its blocks from the
tail's domains (``tail_share``), and, for the layer, the expert count and the fitting sample's
noise share. One kernel per step serves every group, so the groups' GCs are comparable within a
step; the probe is the same blocks at every step, so a group's series is comparable over steps.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import torch

from ntkscope.core.lm import causal_pairs, lm_loss
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.kernel.objectives import call_model, primary_output
from ntkscope.kernel.uncertainty import Resampling, kernel_gc
from ntkscope.representation.router import fit_router
from ntkscope.runs.checkpoints import load_checkpoint
from ntkscope.runs.embeddings import layer_embeddings

log = logging.getLogger(__name__)

COLUMNS = ("step", "lr", "layer", "kind", "group", "n", "loss", "gc", "gc_low", "gc_high", "abs_gc", "null_median",
           "tail_share", "n_experts", "noise_share")


@torch.no_grad()
def block_losses(model, ids: torch.Tensor, batch_size: int = 64) -> np.ndarray:
    """Each block's mean next-token cross-entropy (n,), float64: every token real."""
    out = []
    for i in range(0, len(ids), batch_size):
        x = ids[i:i + batch_size]
        logits = primary_output(call_model(model, {"input_ids": x, "attention_mask": torch.ones_like(x)}))
        out.append(lm_loss(*causal_pairs(logits.double(), x), reduction="sequence"))
    return torch.cat(out).cpu().numpy()


def probe_step(model, fitting_ids: torch.Tensor, probe_ids: torch.Tensor, domains: list, *, layers, tail,
               router: dict, seed: int, output: str = "centred-true-logit",
               resampling: Resampling | None = Resampling(resamples=100, null_draws=100)) -> list[dict]:
    """The rows (:data:`COLUMNS` less step and lr) of one checkpoint's ``model``: ``fitting_ids``
    (N, T) the blocks the router is fitted on, ``probe_ids`` (n, T) the probe and ``domains`` (n,)
    their domain names; ``layers`` the sparse layers, ``tail`` the tail's domains, ``router`` the
    fit's options (the layer's seed is ``seed + layer``, as CSE's conversion seeds it)."""
    model = model.eval()
    domains = np.asarray(domains)
    losses = block_losses(model, probe_ids)
    kernel = empirical_ntk(model, {"input_ids": probe_ids, "attention_mask": torch.ones_like(probe_ids)},
                           output=output).matrix
    fit_emb = layer_embeddings(model, {"input_ids": fitting_ids}, point="ffn_input", layers=list(layers)).embeddings
    probe_emb = layer_embeddings(model, {"input_ids": probe_ids}, point="ffn_input", layers=list(layers)).embeddings
    is_tail = np.isin(domains, list(tail))
    groups = [(None, "domain", d, np.flatnonzero(domains == d), None, None) for d in dict.fromkeys(domains)]
    for layer in layers:
        fit = fit_router(fit_emb[layer], **router, seed=seed + layer)
        routed = fit.predict(probe_emb[layer])
        noise = fit.n_noise / len(fitting_ids)
        groups += [(layer, "expert", str(j), np.flatnonzero(routed == j), fit.n_clusters, noise)
                   for j in range(fit.n_clusters)]
        groups.append((layer, "small", "not expert 0", np.flatnonzero(routed != 0), fit.n_clusters, noise))
    measured = [i for i, g in enumerate(groups) if len(g[3]) >= 2]  # GC needs two blocks
    found = dict(zip(measured, kernel_gc(kernel, [groups[i][3] for i in measured], resampling=resampling)))
    rows = []
    for i, (layer, kind, name, idx, n_experts, noise) in enumerate(groups):
        gc = found.get(i)
        rows.append({"layer": layer, "kind": kind, "group": name, "n": len(idx),
                     "loss": float(losses[idx].mean()) if len(idx) else None,
                     "gc": None if gc is None else gc.score,
                     "gc_low": None if gc is None else gc.interval.low,
                     "gc_high": None if gc is None else gc.interval.high,
                     "abs_gc": None if gc is None else abs(gc.score),
                     "null_median": None if gc is None else gc.null.median,
                     "tail_share": float(is_tail[idx].mean()) if len(idx) else None,
                     "n_experts": n_experts, "noise_share": noise})
    return rows


def probe_trunk(checkpoints: list, fitting_ids: torch.Tensor, probe_ids: torch.Tensor, domains: list, *,
                lrs: dict | None = None, device: str = "cpu", **options) -> pd.DataFrame:
    """:func:`probe_step` at every ``(step, path)`` of ``checkpoints`` (a trunk's kept checkpoints),
    one table (:data:`COLUMNS`); ``lrs``: step -> the learning rate the trunk logged there."""
    rows = []
    for step, path in checkpoints:
        model = load_checkpoint(path).to(device)
        found = probe_step(model, fitting_ids.to(device), probe_ids.to(device), domains, **options)
        rows += [{"step": int(step), "lr": (lrs or {}).get(int(step)), **row} for row in found]
        log.info("trunk probe: step %d, %d groups", step, len(found))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def tail_expert_step(table: pd.DataFrame, layers, *, purity: float = 0.9, min_blocks: int = 5,
                     from_step: int = 100) -> int | None:
    """The earliest probed step, at or after ``from_step``, at which every one of ``layers`` has
    an expert other than the bulk (expert 0) that receives at least ``min_blocks`` probe blocks,
    at least ``purity`` of them from the tail's domains: the router CSE would fit there has a
    tail expert. None when no step has one. Labelled: it reads the domains (``tail_share``)."""
    experts = table[(table["kind"] == "expert") & (table["group"].astype(str) != "0") & (table["step"] >= from_step)]
    pure = experts[(experts["n"] >= min_blocks) & (experts["tail_share"] >= purity)]
    for step in sorted(set(table.loc[table["step"] >= from_step, "step"])):
        if {int(v) for v in pure.loc[pure["step"] == step, "layer"]} >= {int(v) for v in layers}:
            return int(step)
    return None
