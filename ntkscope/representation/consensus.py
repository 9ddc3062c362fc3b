"""Cluster structure that does not flicker: consensus over resampled router fits, with its own
uncertainty, and the warm-up rule built on it.

One HDBSCAN fit per checkpoint flickers: on the sweep's trunks the number of small clusters
jumped between 1 and 4 from one checkpoint to the next, and most fitting blocks were noise.
Here each checkpoint is fitted ``n_fits`` times, each fit on a random ``fraction`` of the
sequences with its own projection seed, and the fits vote (evidence accumulation, Fred & Jain
2005, IEEE TPAMI 27(6); consensus clustering, Monti et al. 2003, Machine Learning 52):

- :func:`resampled_fits`: (n_fits, n) labels, -1 noise, -2 not drawn;
- :func:`coassociation`: C (n, n), the share of the fits that drew both sequences in which they
  share a cluster;
- :func:`consensus_labels`: average linkage on 1 - C, cut where a group's pairs sit together in
  at least ``level`` of the fits on average; groups under ``min_size`` are noise;
- :func:`structure_series`: per step, ``structure``, the share of the sequences that sit in a
  consensus cluster (other than one holding half of them or more: the bulk carries no routing
  information) whose best match at each of the next ``horizon`` checkpoints has Jaccard at least
  ``threshold``; ``structure_low`` / ``structure_high``: its bootstrap interval over the fits
  (the fits resampled with replacement, ``n_boot`` times), so its own uncertainty is known;
- :func:`structure_step`: the rule: the earliest step at which, at every layer, the interval's
  lower end is at least ``min_structure``.

Shapes: ``fits`` maps step -> (n_fits, n) labels of the same n sequences at every step.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from ntkscope.core.checks import entry, fail
from ntkscope.representation.persistence import cluster_persistence
from ntkscope.representation.router import NoClusterError, fit_router

log = logging.getLogger(__name__)

NOT_DRAWN = -2
SERIES_COLUMNS = ["step", "structure", "structure_low", "structure_high", "n_clusters", "n_persisting",
                  "bulk_share", "n_fits"]


@entry("resampled_fits")
def resampled_fits(X, *, n_fits: int = 8, fraction: float = 0.8, seed: int = 0, router: dict | None = None) -> np.ndarray:
    """``n_fits`` router fits (:func:`~ntkscope.fit_router` with ``router``) of X (n, d), each on
    a random ``fraction`` of the rows and with projection seed ``seed + b``: (n_fits, n) labels,
    -1 noise, -2 not drawn. A fit that finds no cluster labels its rows noise."""

    X = np.asarray(X, dtype=np.float64)
    if not 0 < fraction <= 1:
        raise fail("resampled_fits", "fraction", "must be in (0, 1]", fraction)
    if not isinstance(n_fits, int) or n_fits < 2:
        raise fail("resampled_fits", "n_fits", "must be an integer of at least 2", n_fits)
    n = len(X)
    router = {k: v for k, v in (router or {}).items() if k != "seed"}
    out = np.full((n_fits, n), NOT_DRAWN, dtype=np.int64)
    for b in range(n_fits):
        idx = np.sort(np.random.default_rng([seed, b]).choice(n, max(2, int(round(fraction * n))), replace=False))
        try:
            out[b, idx] = fit_router(X[idx], **router, seed=seed + b, on_no_cluster="error").labels
        except NoClusterError:
            out[b, idx] = -1
    return out


def coassociation(fits: np.ndarray, weights=None) -> np.ndarray:
    """C (n, n) from ``fits`` (B, n): per pair, the (weighted) share of the fits that drew both
    in which both sit in the same cluster (noise is in no cluster); 0 for pairs never drawn
    together. ``weights`` (B,): how many times each fit counts (a bootstrap's multiplicities)."""
    fits = np.asarray(fits)
    weights = np.ones(len(fits)) if weights is None else np.asarray(weights, dtype=np.float64)
    n = fits.shape[1]
    same = np.zeros((n, n))
    drawn = np.zeros((n, n))
    for labels, w in zip(fits, weights):
        if not w:
            continue
        member = labels >= 0
        same += w * ((labels[:, None] == labels[None, :]) & member[:, None] & member[None, :])
        drawn += w * np.outer(labels != NOT_DRAWN, labels != NOT_DRAWN)
    return np.divide(same, drawn, out=np.zeros_like(same), where=drawn > 0)


def consensus_labels(C: np.ndarray, *, level: float = 0.5, min_size: int = 10) -> np.ndarray:
    """(n,) labels from a co-association matrix C (n, n): average linkage on 1 - C cut at
    distance 1 - ``level``; groups of fewer than ``min_size`` are noise (-1); the rest are
    numbered by size, largest first."""
    D = 1.0 - C
    np.fill_diagonal(D, 0.0)
    groups = fcluster(linkage(squareform(D, checks=False), "average"), t=1.0 - level, criterion="distance")
    sizes = np.bincount(groups)
    keep = [g for g in np.argsort(-sizes, kind="stable") if sizes[g] >= min_size and g > 0]
    labels = np.full(len(C), -1, dtype=np.int64)
    for rank, g in enumerate(keep):
        labels[groups == g] = rank
    return labels


def _structure(labels: dict, *, horizon: int, threshold: float) -> pd.DataFrame:
    """Per step of ``labels`` ({step: (n,) consensus labels}): structure, n_clusters,
    n_persisting, bulk_share (0 without a bulk cluster)."""
    steps = sorted(labels)
    n = len(next(iter(labels.values())))
    table = cluster_persistence(labels, horizon=horizon, threshold=threshold)
    rows = []
    for step in steps:
        at = table[table["step"] == step]
        bulk = (at["size"] >= n / 2).astype(bool)
        tested = at[~bulk]
        persisting = tested[tested["persists"].astype(bool)]
        rows.append({"step": int(step), "structure": float(persisting["size"].sum() / n), "n_clusters": len(at),
                     "n_persisting": len(persisting), "bulk_share": float(at.loc[bulk, "size"].sum() / n)})
    return pd.DataFrame(rows)


@entry("structure_series")
def structure_series(fits: dict, *, horizon: int = 2, threshold: float = 0.5, level: float = 0.5, min_size: int = 10,
                     n_boot: int = 20, confidence: float = 0.9, seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """Per step of ``fits`` ({step: (n_fits, n) labels from :func:`resampled_fits`}): step,
    structure (module docstring), structure_low and structure_high (the central ``confidence``
    interval of ``n_boot`` bootstrap resamples of the fits), n_clusters, n_persisting (consensus
    clusters, and those that persist, bulk excluded), bulk_share, n_fits. The last ``horizon``
    steps cannot show persistence (structure 0). Also returns the consensus labels ({step: (n,)}).
    """
    if not fits:
        raise fail("structure_series", "fits", "must hold at least one step", fits)
    if not 0 < confidence < 1:
        raise fail("structure_series", "confidence", "must be in (0, 1)", confidence)
    steps = sorted(fits)
    shapes = {np.asarray(fits[s]).shape for s in steps}
    if len(shapes) > 1:
        raise fail("structure_series", "fits", "must have one shape (n_fits, n) at every step", sorted(shapes))
    n_fits = shapes.pop()[0]
    rng = np.random.default_rng(seed)
    draws = [np.bincount(rng.integers(n_fits, size=n_fits), minlength=n_fits) for _ in range(n_boot)]
    consensus = {s: consensus_labels(coassociation(fits[s]), level=level, min_size=min_size) for s in steps}
    table = _structure(consensus, horizon=horizon, threshold=threshold)
    boot = np.array([_structure({s: consensus_labels(coassociation(fits[s], w), level=level, min_size=min_size)
                                 for s in steps}, horizon=horizon, threshold=threshold)["structure"].to_numpy()
                     for w in draws]) if n_boot else np.empty((0, len(steps)))
    tail = (1 - confidence) / 2
    table["structure_low"] = np.quantile(boot, tail, axis=0) if n_boot else np.nan
    table["structure_high"] = np.quantile(boot, 1 - tail, axis=0) if n_boot else np.nan
    table["n_fits"] = n_fits
    return table[SERIES_COLUMNS], consensus


@entry("structure_step")
def structure_step(series: dict, *, min_structure: float = 0.05, window=None) -> int | None:
    """The earliest step (of ``window``, default every step) at which, for every layer of
    ``series`` ({layer: a :func:`structure_series` table}), the structure's interval has its
    lower end at least ``min_structure``; None when no step qualifies."""
    if not 0 < min_structure <= 1:
        raise fail("structure_step", "min_structure", "must be in (0, 1]", min_structure)
    if not series:
        raise fail("structure_step", "series", "must hold at least one layer's table", series)
    steps = sorted(set.intersection(*(set(t["step"]) for t in series.values())))
    for step in steps if window is None else [s for s in steps if s in set(window)]:
        if all(float(t.loc[t["step"] == step, "structure_low"].iloc[0]) >= min_structure for t in series.values()):
            return int(step)
    return None
