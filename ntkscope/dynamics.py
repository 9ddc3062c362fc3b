"""Cluster dynamics per layer, over training (DESIGN §3; the CSE paper's Figures 3(b),
3(c) and 4(b)), and the gradient consistency of the long-tail subset over checkpoints.

Per layer: project the sequence embeddings (seeded Gaussian random projection), find
the elbow K of K-Means, and measure the clustering's inter-cluster distance, mean
radius and separation score. Over a run's checkpoints this gives one tidy table with a
row per (step, layer). Each checkpoint's result is cached in ``cache_dir`` (under a key
of the analysis options and the data), so an interrupted analysis resumes where it
stopped and a repeated one is free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope._checks import check_positive_int, fail
from ntkscope.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.clusters import ElbowKMeans, check_embeddings, cluster_geometry, jl_guidance, random_projection
from ntkscope.representations import layer_embeddings

log = logging.getLogger(__name__)

COLUMNS = ["step", "layer", "n", "k", "inter_distance", "mean_radius", "separation"]


def layer_separation(embeddings, *, k_max: int = 10, projection_dim: int | None = 64, seed: int = 0) -> pd.DataFrame:
    """One row per layer: layer, n, k (elbow), inter_distance, mean_radius, separation.

    ``embeddings``: a :class:`~ntkscope.representations.LayerEmbeddings` or {layer: (n, d)}.
    The table's ``attrs["jl_guidance"]`` gives the JL dimension for a few distortions.
    """
    func = "layer_separation"
    check_positive_int(func, "k_max", k_max)
    table = embeddings.embeddings if hasattr(embeddings, "embeddings") else dict(embeddings)
    if not table:
        raise fail(func, "embeddings", "must hold at least one layer", table)
    rows = []
    for layer in sorted(table):
        X = check_embeddings(func, table[layer])
        if k_max > X.shape[0]:
            raise fail(func, "k_max", f"must be at most the number of samples ({X.shape[0]})", k_max)
        Z = random_projection(X, projection_dim, seed=seed) if projection_dim else X
        elbow = ElbowKMeans(k_max, random_state=seed).fit(Z)
        geo = cluster_geometry(Z, elbow.labels_)
        rows.append((layer, X.shape[0], elbow.k_, geo.inter_distance, geo.mean_radius, geo.separation))
    frame = pd.DataFrame(rows, columns=COLUMNS[1:])
    frame.attrs["jl_guidance"] = jl_guidance(frame["n"].iloc[0])
    return frame


class _Progress:
    """Logs 'what i/n, ETA' over a loop of checkpoints (cached ones count as instant)."""

    def __init__(self, what: str, total: int):
        import time

        self.what, self.total, self.start, self.clock, self.done = what, total, time.perf_counter(), time.perf_counter, 0

    def step(self, label: str) -> None:
        self.done += 1
        elapsed = self.clock() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        log.info("%s: %d/%d (%s), %.0f s elapsed, ETA %dm%02ds", self.what, self.done, self.total, label, elapsed,
                 eta // 60, eta % 60)


def _key(options: dict, batch: dict) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for name in sorted(batch):
        h.update(name.encode())
        h.update(batch[name].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _cached(cache_dir: Path, step: int, key: str, compute) -> list[dict]:
    path = cache_dir / f"step-{step:06d}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    rows = compute()
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(rows))
    os.replace(tmp, path)
    return rows


def cluster_dynamics(run_dir, batch: dict, *, point: str = "block", layers=None, k_max: int = 10,
                     projection_dim: int | None = 64, seed: int = 0, steps=None, cache_dir=None) -> pd.DataFrame:
    """Per (step, layer) over a run's checkpoints: columns step, layer, n, k, inter_distance,
    mean_radius, separation. ``steps`` restricts to some checkpoints; results are cached per
    checkpoint in ``cache_dir`` (default ``RUN/analysis``)."""
    checkpoints = list_checkpoints(run_dir)
    if steps is not None:
        wanted = set(steps)
        missing = sorted(wanted - {s for s, _ in checkpoints})
        if missing:
            raise fail("cluster_dynamics", "steps", f"must be steps of the run's checkpoints "
                       f"{[s for s, _ in checkpoints]}", missing)
        checkpoints = [(s, p) for s, p in checkpoints if s in wanted]
    cache_dir = Path(cache_dir) if cache_dir else Path(run_dir) / "analysis"
    cache_dir.mkdir(parents=True, exist_ok=True)
    options = {"what": "clusters", "point": point, "layers": layers, "k_max": k_max,
               "projection_dim": projection_dim, "seed": seed}
    key = _key(options, batch)
    frames = []
    progress = _Progress("cluster_dynamics", len(checkpoints))
    for step, path in checkpoints:
        def compute(path=path, step=step):
            emb = layer_embeddings(load_checkpoint(path), batch, point=point, layers=layers)
            table = layer_separation(emb, k_max=k_max, projection_dim=projection_dim, seed=seed)
            table.insert(0, "step", step)
            return table.to_dict("records")
        frames.append(pd.DataFrame(_cached(cache_dir, step, key, compute)))
        progress.step(f"step {step}")
    return pd.concat(frames, ignore_index=True)[COLUMNS]


def gc_series(run_dir, batch: dict, subset, *, method: str = "auto", steps=None, cache_dir=None) -> pd.DataFrame:
    """Gradient consistency of ``subset`` (indices into the batch: the long tail) against the
    whole batch at each checkpoint: columns step, gc, eigengap, eigengap_subset. Cached like
    :func:`cluster_dynamics`."""
    from ntkscope.consistency import gradient_consistency

    checkpoints = list_checkpoints(run_dir)
    if steps is not None:
        checkpoints = [(s, p) for s, p in checkpoints if s in set(steps)]
    cache_dir = Path(cache_dir) if cache_dir else Path(run_dir) / "analysis"
    cache_dir.mkdir(parents=True, exist_ok=True)
    subset = [int(i) for i in subset]
    key = _key({"what": "gc", "subset": subset, "method": method}, batch)
    rows = []
    progress = _Progress("gc_series", len(checkpoints))
    for step, path in checkpoints:
        def compute(path=path, step=step):
            res = gradient_consistency(load_checkpoint(path), batch, subset, method=method)
            return [{"step": step, "gc": res.score, "eigengap": res.eigengap, "eigengap_subset": res.eigengap_subset}]
        rows.extend(_cached(cache_dir, step, key, compute))
        progress.step(f"step {step}")
    return pd.DataFrame(rows, columns=["step", "gc", "eigengap", "eigengap_subset"])


def cluster_snapshots(run_dir, batch: dict, layer: int, steps, *, labels: pd.DataFrame | None = None,
                      point: str = "block", k_max: int = 10, projection_dim: int | None = 64, seed: int = 0,
                      method: str = "pca") -> tuple[pd.DataFrame, pd.DataFrame]:
    """2-D views of one layer's embeddings at chosen steps, coloured by their elbow clusters.

    ``labels``: per-sequence annotations (e.g. columns domain, score) in batch order.
    Returns (points: step, x, y, cluster, + the label columns; clusters: step, cluster, size,
    + the share of each domain and the mean score when those columns are given).
    ``method``: "pca" (scikit-learn) or "tsne" (scikit-learn's TSNE, seeded).
    """
    from sklearn.decomposition import PCA
    from sklearn.manifold import TSNE

    if method not in ("pca", "tsne"):
        raise fail("cluster_snapshots", "method", "must be 'pca' or 'tsne'", method)
    chosen = {s: p for s, p in list_checkpoints(run_dir)}
    missing = [s for s in steps if s not in chosen]
    if missing:
        raise fail("cluster_snapshots", "steps", f"must be checkpoint steps {sorted(chosen)}", missing)
    points, clusters = [], []
    for step in steps:
        X = layer_embeddings(load_checkpoint(chosen[step]), batch, point=point, layers=[layer]).embeddings[layer]
        Z = random_projection(X, projection_dim, seed=seed) if projection_dim else X
        fit = ElbowKMeans(k_max, random_state=seed).fit(Z)
        xy = (PCA(2, random_state=seed) if method == "pca" else
              TSNE(2, random_state=seed, init="pca", perplexity=min(30, len(Z) - 1))).fit_transform(Z)
        frame = pd.DataFrame({"step": step, "x": xy[:, 0], "y": xy[:, 1], "cluster": fit.labels_})
        if labels is not None:
            frame = pd.concat([frame, labels.reset_index(drop=True)], axis=1)
        points.append(frame)
        summary = frame.groupby("cluster").size().rename("size").reset_index()
        if labels is not None and "domain" in labels:
            shares = pd.crosstab(frame["cluster"], frame["domain"], normalize="index").add_prefix("share ")
            summary = summary.merge(shares, left_on="cluster", right_index=True)
        if labels is not None and "score" in labels:
            summary = summary.merge(frame.groupby("cluster")["score"].mean().rename("mean score"),
                                    left_on="cluster", right_index=True)
        summary.insert(0, "step", step)
        clusters.append(summary)
    return pd.concat(points, ignore_index=True), pd.concat(clusters, ignore_index=True)


def long_tail_subset(scores, fraction: float = 1 / 3) -> np.ndarray:
    """Indices of the lowest-frequency ``fraction`` of the sentences (the long tail)."""
    scores = np.asarray(scores, dtype=np.float64)
    k = max(2, int(round(fraction * len(scores))))
    return np.sort(np.argsort(scores, kind="stable")[:k])


__all__ = ["cluster_dynamics", "cluster_snapshots", "gc_series", "layer_separation",
           "long_tail_subset"]
