"""The statistics of per-expert kernels (:func:`ntkscope.kernel.experts.expert_ntk`): how alike an
expert's gradients are (:func:`split_half_gc`, from its kernel alone), each label's GC inside an
expert (:func:`expert_gc`), and the per-expert view of ``ntkscope eval --expert-kernels N``
(:func:`expert_view`: each expert's split-half |GC| and its labels' GC among its units)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import InputError, entry, fail
from ntkscope.kernel.experts import ExpertKernel, expert_ntk
from ntkscope.kernel.nulls import Controls, NullBand
from ntkscope.kernel.objectives import is_causal
from ntkscope.kernel.replicates import direction, subset_abs_gcs
from ntkscope.kernel.uncertainty import Resampling, kernel_gc

#: the columns of :func:`expert_gc`
GC_COLUMNS = ["layer", "expert", "unit", "group", "n", "units", "gc", "gc_low", "gc_high", "abs_gc", "null_median",
              "homogeneous_median", "flags"]


def halves(m: int, draws: int, seed: int = 0, size: int | None = None) -> list:
    """``draws`` random subsets of ``size`` (default ``m // 2``) of ``range(m)``, each sorted: the
    same draws for every kernel over the same units, so that two kernels' |GC| pair draw by draw."""
    k = m // 2 if size is None else size
    if not 0 < k <= m:
        raise fail("halves", "size", f"must be in [1, {m}] (the units drawn from)", size)
    rng = np.random.default_rng([seed, 62, m])
    return [np.sort(rng.choice(m, size=k, replace=False)) for _ in range(draws)]


@entry("subset_abs_gc")
def subset_abs_gc(kernel, subsets: list, whole=None) -> np.ndarray:
    """``|GC|`` of each subset against the set ``whole`` (rows of the kernel; default all), from the
    kernel (m, m) alone: (len(subsets),). A subset indexes ``whole``'s rows (the kernel's when
    ``whole`` is None). NaN where a subset's kernel is 0 (no gradient)."""
    K = np.asarray(kernel.detach().cpu().double() if torch.is_tensor(kernel) else kernel, dtype=np.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1]:
        raise InputError("kernel", "must be a square (m, m) kernel", K.shape)
    rows = np.arange(K.shape[0]) if whole is None else np.asarray(whole)
    if rows.ndim != 1 or not len(rows) or rows.min() < 0 or rows.max() >= K.shape[0]:
        raise InputError("whole", f"must be row indices in [0, {K.shape[0]})", whole)
    bad = [list(idx) for idx in subsets if not len(idx) or min(idx) < 0 or max(idx) >= len(rows)][:1]
    if bad:
        raise InputError("subsets", f"must be non-empty index arrays into the {len(rows)} rows of the set", bad[0])
    block = K[np.ix_(rows, rows)]
    top = direction(block, np.arange(len(rows)), np.ones(len(rows)))
    along, norm = top.weights @ block, math.sqrt(max(top.eigenvalue, 0))
    return subset_abs_gcs(block, along, norm, [np.sort(np.asarray(idx)) for idx in subsets])


@entry("split_half_gc")
def split_half_gc(kernel, *, draws: int = 200, confidence: float = 0.9, seed: int = 0) -> NullBand:
    """How alike a set's gradients are: ``|GC|`` of random halves of its units against all of them,
    from its kernel (m, m), as a band over ``draws`` halves (median, and the ``confidence``
    quantiles). 1 when every gradient is parallel; well below when they share no direction (the
    top direction of a half of isotropic gradients is the whole set's by chance only). Two kernels
    over the same units pair draw by draw with :func:`halves` and :func:`subset_abs_gc`. A half
    whose gradients are all 0 has no |GC|: the band is over the other draws (``draws`` counts them)."""
    m = kernel.shape[0]
    if len(kernel.shape) != 2 or m < 4:
        raise InputError("kernel", "must be a square (m, m) kernel with m >= 4 units", tuple(kernel.shape))
    values = subset_abs_gc(kernel, halves(m, draws, seed))
    return band(values, confidence)


def band(values: np.ndarray, confidence: float = 0.9) -> NullBand:
    """The (1 - c)/2, 1/2, (1 + c)/2 quantiles of the finite ``values`` and their count (NaN, 0 when none)."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return NullBand(math.nan, math.nan, math.nan, 0)
    tail = (1 - confidence) / 2
    low, median, high = np.quantile(finite, [tail, 0.5, 1 - tail])
    return NullBand(float(low), float(median), float(high), int(finite.size))


@entry("expert_gc")
def expert_gc(kernels, labels, *, min_count: int = 2, resampling: Resampling | None = Resampling(),
              controls: Controls | None = None) -> pd.DataFrame:
    """GC of each label's units within each expert against all the expert's units, with intervals.

    Parameters
    ----------
    kernels : ExpertKernel or list of them (:func:`expert_ntk`).
    labels : (n,) a label per sample of the batch the kernels were computed on; a unit takes its
        sample's.
    min_count : groups with fewer units in an expert are left out.
    resampling, controls : as :func:`~ntkscope.kernel.uncertainty.kernel_gc`.

    Returns
    -------
    DataFrame of GC_COLUMNS: ``n`` the group's units, ``units`` the expert's.
    """
    kernels = [kernels] if isinstance(kernels, ExpertKernel) else list(kernels)
    labels = np.asarray(labels)
    rows = []
    for k in kernels:
        if labels.ndim != 1 or (len(k.rows) and k.samples().max() >= len(labels)):
            raise InputError("labels", "must give one label per sample of the kernels' batch", labels.shape)
        own = labels[k.samples()]
        names = [g for g in dict.fromkeys(own.tolist()) if (own == g).sum() >= min_count]
        if len(k.rows) < 2 or not names:
            continue
        subsets = [np.flatnonzero(own == g) for g in names]
        K = k.matrix.detach().double().cpu()
        K = (K + K.T) / 2  # symmetric to its own rounding (a float32 kernel summed by blocks)
        for g, idx, r in zip(names, subsets, kernel_gc(K, subsets, resampling=resampling, controls=controls)):
            homogeneous = r.controls.get("homogeneous")
            rows.append({"layer": k.layer, "expert": k.expert, "unit": k.unit, "group": g, "n": len(idx),
                         "units": len(k.rows), "gc": r.score, "gc_low": r.interval.low, "gc_high": r.interval.high,
                         "abs_gc": abs(r.score), "null_median": r.null.median,
                         "homogeneous_median": homogeneous.median if homogeneous else math.nan,
                         "flags": ";".join(r.flags)})
    return pd.DataFrame(rows, columns=GC_COLUMNS)


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
    :data:`GC_COLUMNS`). ``consistency`` is the median split-half |GC| of
    the expert's units, with the 5 and 95 % quantiles over ``draws`` halves; experts with fewer
    than 4 units are left out. A masked language model's experts are read by sequence (its value
    is over a seeded masked set, not one per token)."""
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
    unit = "auto" if is_causal(model) else "sequence"  # a masked LM has no per-token value to route
    kernels = expert_ntk(model, batch, min_units=4, unit=unit)
    summary = []
    for k in kernels:
        halves_band = split_half_gc(k.matrix, draws=draws, confidence=0.9, seed=seed)
        shares = pd.Series(own[k.samples()]).value_counts(normalize=True)
        summary.append({"layer": k.layer, "expert": k.expert, "unit": k.unit, "units": len(k.rows),
                        "params": k.n_params, "consistency": halves_band.median, "consistency_low": halves_band.low,
                        "consistency_high": halves_band.high, "top_label": shares.index[0],
                        "top_share": float(shares.iloc[0])})
    return pd.DataFrame(summary, columns=VIEW_COLUMNS), expert_gc(kernels, own)
