"""The per-expert view of a mixture (``ntkscope eval --expert-kernels N``): for each expert of each
mixture layer, over a sample of labelled texts, how alike its routed units' gradients are (the
split-half |GC| of its kernel, :func:`~ntkscope.kernel.experts.split_half_gc`) and each label's
GC among its units (:func:`~ntkscope.kernel.experts.expert_gc`), from the per-expert kernels of
:func:`~ntkscope.kernel.experts.expert_ntk`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import InputError, entry
from ntkscope.kernel.experts import expert_gc, expert_ntk, split_half_gc

#: the columns of the per-expert summary
VIEW_COLUMNS = ["layer", "expert", "unit", "units", "params", "consistency", "consistency_low", "consistency_high",
                "top_label", "top_share"]


def text_batch(token_ids: Sequence[Sequence[int]], rows: Sequence[int], context: int) -> dict:
    """The texts ``rows`` of ``token_ids`` as one right-padded batch of at most ``context`` tokens each."""
    chosen = [list(token_ids[i])[:context] for i in rows]
    T = max(len(t) for t in chosen)
    ids = torch.zeros(len(chosen), T, dtype=torch.long)
    mask = torch.zeros(len(chosen), T, dtype=torch.long)
    for r, t in enumerate(chosen):
        ids[r, :len(t)] = torch.tensor(t)
        mask[r, :len(t)] = 1
    return {"input_ids": ids, "attention_mask": mask}


@entry("expert_view")
def expert_view(model, token_ids: Sequence[Sequence[int]], labels: Sequence[str], *, texts: int, context: int,
                seed: int = 0, draws: int = 200) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each expert's consistency and its labels' GC on ``texts`` texts drawn (seeded) from those of
    two tokens or more, truncated to ``context`` tokens: (summary VIEW_COLUMNS, GC table of
    :data:`ntkscope.kernel.experts.GC_COLUMNS`). ``consistency`` is the median split-half |GC| of
    the expert's units, with the 5 and 95 % quantiles over ``draws`` halves; experts with fewer
    than 4 units are left out."""
    if len(token_ids) != len(labels):
        raise InputError("labels", "must give one label per text", f"{len(labels)} labels for {len(token_ids)} texts")
    usable = np.flatnonzero([len(t) > 1 for t in token_ids])
    if isinstance(texts, bool) or not isinstance(texts, int) or texts < 4:
        raise InputError("texts", "must be an integer of at least 4", texts)
    rows = np.sort(np.random.default_rng(seed).permutation(usable)[:texts])
    if len(rows) < 4:
        raise InputError("token_ids", "must hold at least 4 texts of two tokens or more", len(rows))
    batch = text_batch(token_ids, rows, context)
    own = np.asarray(labels, dtype=object)[rows]
    kernels = expert_ntk(model, batch, min_units=4)
    summary = []
    for k in kernels:
        band = split_half_gc(k.matrix, draws=draws, confidence=0.9, seed=seed)
        shares = pd.Series(own[k.samples()]).value_counts(normalize=True)
        summary.append({"layer": k.layer, "expert": k.expert, "unit": k.unit, "units": len(k.rows),
                        "params": k.n_params, "consistency": band.median, "consistency_low": band.low,
                        "consistency_high": band.high, "top_label": shares.index[0], "top_share": float(shares.iloc[0])})
    return pd.DataFrame(summary, columns=VIEW_COLUMNS), expert_gc(kernels, own)
