"""Cluster dynamics per layer, over training (docs/design.md §3; the CSE paper's Figures 3(b),
3(c) and 4(b)), the CSE router's clusters over training (their number, purity and stability:
the warm-up's fallback rule), and the gradient consistency of the long-tail subset over checkpoints.

Per layer: project the sequence embeddings (seeded Gaussian random projection), find
the elbow K of K-Means, and measure the clustering's inter-cluster distance, mean
radius and separation score. Over a run's checkpoints this gives one tidy table with a
row per (step, layer). Each checkpoint's result is cached in ``cache_dir`` (under a key
of the analysis options and the data), so an interrupted analysis resumes where it
stopped and a repeated one is free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from sklearn.decomposition import PCA
from sklearn.metrics import adjusted_rand_score

from ntkscope.core.checks import UserError, fail
from ntkscope.core.files import JsonCache, digest
from ntkscope.core.paths import user_cache_dir
from ntkscope.core.progress import progress_bar
from ntkscope.kernel.consistency import gradient_consistency
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.representation.consensus import resampled_fits, structure_series
from ntkscope.representation.persistence import cluster_persistence, persistence_summary
from ntkscope.representation.clusters import LAYER_COLUMNS, ElbowKMeans, layer_separation, random_projection
from ntkscope.representation.router import fit_router
from ntkscope.representation.structure import cluster_purity, domain_silhouette, knn_lift
from ntkscope.runs.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.runs.embeddings import layer_embeddings
from ntkscope.gc.groups import MATCHES, analysis_controls

log = logging.getLogger(__name__)

COLUMNS = ["step", *LAYER_COLUMNS]


class _Progress:
    """A progress bar over a loop of checkpoints (cached ones count as instant), and a DEBUG
    log line 'what i/n, ETA' per checkpoint for log files."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.start, self.done = what, total, time.perf_counter(), 0
        self.bar = progress_bar(total, what, "checkpoint")

    def step(self, label: str) -> None:
        self.done += 1
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(1)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        log.debug("%s: %d/%d (%s), %.0f s elapsed, ETA %dm%02ds", self.what, self.done, self.total, label, elapsed,
                  eta // 60, eta % 60)
        if self.done == self.total:
            self.bar.close()


def _cache(run_dir, cache_dir, func: str = "walk") -> JsonCache:
    """``cache_dir``, else ``RUN/analysis``; a run directory that is not ours to write (read-only,
    someone else's) caches under ``~/.cache/ntkscope/runs/`` instead, keyed by its resolved path.
    A cache folder this user can neither make nor write is one line, before any checkpoint is analysed."""
    if cache_dir:
        return JsonCache(_writable(Path(cache_dir), func, "cache_dir (--cache-dir) must be a folder this user may "
                                                            "write or make"))
    run_dir = Path(run_dir)
    inside = run_dir / "analysis"
    writable = os.access(inside if inside.is_dir() else run_dir, os.W_OK | os.X_OK)
    if writable and run_dir.stat().st_uid == os.getuid():  # never into someone else's run, even when we may
        return JsonCache(inside)
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    elsewhere = user_cache_dir() / "runs" / f"{run_dir.name}-{key}"
    log.info("%s is not ours to write: caching its analyses in %s", run_dir, elsewhere)
    return JsonCache(_writable(elsewhere, func, f"run_dir {run_dir} is not ours to write, and its analyses cannot "
                                                "be cached in the user's cache either (give cache_dir, --cache-dir, or "
                                                "set NTKSCOPE_CACHE)"))


def _writable(folder: Path, func: str, says: str) -> Path:
    """``folder``, made, once a file could be made in it (and at once removed): the one test of
    writing that holds for every user, mount and ACL."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise UserError(f"{func}: {says}: {folder} cannot be written ({err.strerror or err})") from None
    return folder


@dataclasses.dataclass(frozen=True)
class Analysis:
    """One per-checkpoint analysis of a run for :func:`walk`: its cache ``key`` (the options and
    the data) and ``compute(model, step) -> JSON-able result``."""

    key: str
    compute: Callable


def select_checkpoints(run_dir, steps, func: str) -> list:
    """[(step, path)] of the run, or of ``steps`` only: a step the run has no checkpoint for is
    refused, by every analysis alike."""
    checkpoints = list_checkpoints(run_dir)
    if steps is None:
        return checkpoints
    wanted = {int(s) for s in steps}
    missing = sorted(wanted - {s for s, _ in checkpoints})
    if missing:
        raise fail(func, "steps", f"must be steps of the run's checkpoints {[s for s, _ in checkpoints]}", missing)
    return [(s, p) for s, p in checkpoints if s in wanted]


def walk(run_dir, analyses: dict, *, steps=None, cache_dir=None, models=None, func: str = "walk", device=None):
    """One pass over a run's checkpoints for several analyses ({name: :class:`Analysis`}): each
    checkpoint's result of each analysis is read from the cache, or computed, and a checkpoint
    is loaded at most once, only when some analysis has no cached result there (``models``:
    {path: model} already loaded by the caller, used as they are; ``device``: where a loaded
    checkpoint computes, default the CPU; the cache does not tell devices apart). Returns
    ([(step, path)], {name: [result per checkpoint]})."""
    checkpoints = select_checkpoints(run_dir, steps, func)
    cache = _cache(run_dir, cache_dir, func)
    models = {str(k): v for k, v in (models or {}).items()}
    results = {name: [] for name in analyses}
    progress = _Progress(func, len(checkpoints))
    for step, path in checkpoints:
        loaded = []

        def model(path=path):
            if not loaded:
                given = models.get(str(path))
                if given is None:
                    given = load_checkpoint(path)
                    given = given if device is None else given.to(device)
                loaded.append(given)
            return loaded[0]

        for name, analysis in analyses.items():
            results[name].append(cache.get(f"step-{step:06d}", analysis.key,
                                           lambda a=analysis, s=step: a.compute(model(), s)))
        progress.step(f"step {step}")
    return checkpoints, results


def clusters_analysis(batch: dict, *, point: str = "block", layers=None, k_max: int = 10,
                      projection_dim: int | None = 64, seed: int = 0) -> Analysis:
    """:func:`cluster_dynamics`' per-checkpoint analysis."""
    options = {"what": "clusters", "point": point, "layers": layers, "k_max": k_max,
               "projection_dim": projection_dim, "seed": seed}

    def compute(model, step):
        emb = layer_embeddings(model, batch, point=point, layers=layers)
        table = layer_separation(emb, k_max=k_max, projection_dim=projection_dim, seed=seed)
        table.insert(0, "step", step)
        return table.to_dict("records")
    return Analysis(digest(options, arrays=batch), compute)


def cluster_dynamics(run_dir, batch: dict, *, point: str = "block", layers=None, k_max: int = 10,
                     projection_dim: int | None = 64, seed: int = 0, steps=None, cache_dir=None) -> pd.DataFrame:
    """Per (step, layer) over a run's checkpoints: columns step, layer, n, k, inter_distance,
    mean_radius, separation. ``steps`` restricts to some checkpoints; results are cached per
    checkpoint in ``cache_dir`` (default ``RUN/analysis``)."""
    analysis = clusters_analysis(batch, point=point, layers=layers, k_max=k_max, projection_dim=projection_dim,
                                 seed=seed)
    _, results = walk(run_dir, {"clusters": analysis}, steps=steps, cache_dir=cache_dir, func="cluster_dynamics")
    return clusters_table(results["clusters"])


def clusters_table(results: list) -> pd.DataFrame:
    return pd.concat([pd.DataFrame(r) for r in results], ignore_index=True)[COLUMNS]


def gc_analysis(batch: dict, subset, *, resampling: Resampling | None = Resampling(), pools=None, match=MATCHES,
                options: KernelOptions | None = None, **fields) -> Analysis:
    """:func:`gc_series`' per-checkpoint analysis; ``options`` (:class:`~ntkscope.KernelOptions`,
    its fields replaced by ``fields``) is built once here and used at every checkpoint."""
    opts = KernelOptions.build(options, **fields)
    subset = [int(i) for i in subset]
    settings = None if resampling is None else dataclasses.asdict(resampling)
    pools = None if pools is None else [sorted(int(i) for i in pool) for pool in pools]
    key = {"what": "gc", "format": 3, "subset": subset, "method": opts.method, "output": str(opts.output),
           "resampling": settings, "pools": pools, "match": list(match)}
    changed = opts.changed(leave=("method", "output"))
    if changed:  # a key without them stays the key of the defaults, so earlier caches still serve
        key["fields"] = dict(sorted(changed.items()))

    def compute(model, step):
        controls = None if resampling is None else analysis_controls(model, batch, pools=pools, match=match,
                                                                     output=opts.output, loss_from="kernel")
        res = gradient_consistency(model, batch, subset, resampling=resampling, controls=controls, options=opts)
        return [{"step": step, **res.row()}]
    return Analysis(digest(key, arrays=batch), compute)


def gc_table(results: list) -> pd.DataFrame:
    return pd.DataFrame([row for rows in results for row in rows]).drop(columns="label")


def gc_series(run_dir, batch: dict, subset, *, resampling: Resampling | None = Resampling(), pools=None,
              match=MATCHES, steps=None, cache_dir=None, options: KernelOptions | None = None,
              **fields) -> pd.DataFrame:
    """Gradient consistency of ``subset`` (indices into the batch: the long tail) against the
    whole batch at each checkpoint: one :meth:`~ntkscope.GCResult.row` per step (step, gc and
    its interval, abs_gc and its interval, bias, the null bands and versus each, the excess over
    the random null's median and its standard error, sign_confidence, mean_gradient, flags,
    eigengaps, cos_ones, ...). The controls are :func:`~ntkscope.gc.groups.analysis_controls`'
    (``pools``: homogeneous index arrays; ``match``: covariates), measured at each checkpoint.
    ``options``/``fields``: :class:`~ntkscope.KernelOptions`, as for :func:`~ntkscope.gradient_consistency`
    (output, method, params, dtype, device, max_memory, ...). Cached like :func:`cluster_dynamics`."""
    analysis = gc_analysis(batch, subset, resampling=resampling, pools=pools, match=match, options=options, **fields)
    _, results = walk(run_dir, {"gc": analysis}, steps=steps, cache_dir=cache_dir, func="gc_series")
    return gc_table(results["gc"])


STABILITY_COLUMNS = ["step", "layer", "n_clusters", "n_noise", "largest_share", "overlap_next"]


@contextlib.contextmanager
def _said_at(where: str):
    """The router fit's log lines (a fallback to one cluster, ...) prefixed with ``where``."""
    logger = logging.getLogger("ntkscope.representation.router")

    def prefix(record):
        record.msg = f"{where}: {record.msg}"
        return True

    logger.addFilter(prefix)
    try:
        yield
    finally:
        logger.removeFilter(prefix)


def _router_layer(X, domains, tail, router: dict, where: str = "") -> dict:
    """One layer at one checkpoint: the router's labels and, with domains, what they hold."""
    with _said_at(where) if where else contextlib.nullcontext():
        fit = fit_router(X, **router)
    out = {"labels": fit.labels.tolist(), "n_clusters": fit.n_clusters, "n_noise": fit.n_noise,
           "largest_share": max(fit.sizes) / len(X)}
    if domains is not None:
        quality = cluster_purity(fit.labels, domains, tail=tail)
        z = fit.transform(X)  # the routing space
        out.update({k: v for k, v in quality.items() if k not in out})
        out.update({f"knn_lift {d}": float(v) for d, v in knn_lift(z, domains).items()})
        out.update({f"silhouette {d}": float(v) for d, v in domain_silhouette(z, domains).items()})
    return out


def router_analysis(batch: dict, layers=None, *, domains=None, tail=(), point: str = "ffn_input",
                    router: dict | None = None) -> Analysis:
    """The router fits that :func:`router_dynamics` and :func:`router_persistence` read."""
    router = dict(router or {})
    domains = None if domains is None else [str(d) for d in domains]
    options = {"what": "router", "format": 2, "point": point, "layers": layers, "router": router,
               "domains": domains, "tail": list(tail)}

    def compute(model, step):
        emb = layer_embeddings(model, batch, point=point, layers=layers).embeddings
        return {str(layer): _router_layer(X, domains, tail, router, where=f"the checkpoint of step {step}, layer "
                                          f"{layer}") for layer, X in emb.items()}
    return Analysis(digest(options, arrays=batch), compute)


def router_table(checkpoints: list, results: list) -> pd.DataFrame:
    """:func:`router_dynamics`' table from the router fits of each checkpoint."""
    rows = []
    for i, (step, _) in enumerate(checkpoints):
        for layer, found in results[i].items():
            after = results[i + 1][layer]["labels"] if i + 1 < len(checkpoints) else None
            rows.append({"step": step, "layer": int(layer), **{k: v for k, v in found.items() if k != "labels"},
                         "overlap_next": float(adjusted_rand_score(found["labels"], after)) if after
                         else float("nan")})
    frame = pd.DataFrame(rows)
    return frame[STABILITY_COLUMNS + [c for c in frame.columns if c not in STABILITY_COLUMNS]]


def persistence_tables(checkpoints: list, results: list, n: int, *, horizon: int = 2, threshold: float = 0.5) -> dict:
    """:func:`router_persistence`' {layer: table} from the router fits of each checkpoint."""
    out = {}
    for layer in results[0] if results else {}:
        labels = {step: np.asarray(found[layer]["labels"]) for (step, _), found in zip(checkpoints, results)}
        table = cluster_persistence(labels, horizon=horizon, threshold=threshold)
        out[int(layer)] = persistence_summary(table, n)
    return out


def router_dynamics(run_dir, batch: dict, layers=None, *, domains=None, tail=(), point: str = "ffn_input",
                    router: dict | None = None, steps=None, cache_dir=None, device=None) -> pd.DataFrame:
    """The CSE router's clusters of ``batch`` over a run: at each checkpoint and each of
    ``layers`` (default all), :func:`~ntkscope.fit_router` with ``router`` (its keyword
    arguments; default: its defaults) on the ``point`` embeddings, the router CSE would build there.

    Columns: step, layer, n_clusters, n_noise, largest_share, overlap_next (the adjusted Rand
    index, scikit-learn, of the labels against the next checkpoint's, noise as one more label;
    NaN at the last). With ``domains`` (n,) also :func:`~ntkscope.representation.structure.cluster_purity`'s
    n_pure, n_pure_tail, tail_share (and per ``tail`` domain), ari, and per domain the kNN lift
    and silhouette in the routing space. Cached per checkpoint like :func:`cluster_dynamics`;
    ``device``: where the checkpoints embed ``batch`` (:func:`walk`).
    """
    analysis = router_analysis(batch, layers, domains=domains, tail=tail, point=point, router=router)
    checkpoints, results = walk(run_dir, {"router": analysis}, steps=steps, cache_dir=cache_dir,
                                func="router_dynamics", device=device)
    return router_table(checkpoints, results["router"])


def router_persistence(run_dir, batch: dict, layers=None, *, domains=None, tail=(), point: str = "ffn_input",
                       router: dict | None = None, steps=None, cache_dir=None, horizon: int = 2,
                       threshold: float = 0.5, device=None) -> dict:
    """Per layer, :func:`~ntkscope.representation.persistence.persistence_summary` of the
    router's clusters of ``batch`` over a run: do its small clusters persist? The same fits (and
    cache) as :func:`router_dynamics` with the same arguments (``device`` too); ``horizon`` and ``threshold`` are
    :func:`~ntkscope.representation.persistence.cluster_persistence`'s. Returns {layer: table}."""
    analysis = router_analysis(batch, layers, domains=domains, tail=tail, point=point, router=router)
    checkpoints, results = walk(run_dir, {"router": analysis}, steps=steps, cache_dir=cache_dir,
                                func="router_persistence", device=device)
    return persistence_tables(checkpoints, results["router"], len(next(iter(batch.values()))), horizon=horizon,
                              threshold=threshold)



def structure_analysis(batch: dict, layers=None, *, point: str = "ffn_input", router: dict | None = None,
                       n_fits: int = 8, fraction: float = 0.8, seed: int = 0) -> Analysis:
    """The resampled router fits that :func:`router_structure` reads: per layer, (n_fits, n)
    labels (:func:`~ntkscope.representation.consensus.resampled_fits`, seed ``seed + layer``)."""
    router = {k: v for k, v in (router or {}).items() if k != "seed"}
    options = {"what": "structure", "format": 1, "point": point, "layers": layers, "router": router,
               "n_fits": n_fits, "fraction": fraction, "seed": seed}

    def compute(model, step):
        emb = layer_embeddings(model, batch, point=point, layers=layers).embeddings
        return {str(layer): resampled_fits(X, n_fits=n_fits, fraction=fraction, seed=seed + int(layer),
                                           router=router).tolist() for layer, X in emb.items()}
    return Analysis(digest(options, arrays=batch), compute)


def router_structure(run_dir, batch: dict, layers=None, *, point: str = "ffn_input", router: dict | None = None,
                     steps=None, cache_dir=None, n_fits: int = 8, fraction: float = 0.8, seed: int = 0,
                     horizon: int = 2, threshold: float = 0.5, level: float = 0.5, min_size: int = 10,
                     n_boot: int = 20, confidence: float = 0.9, device=None) -> tuple[dict, dict]:
    """The consensus structure of the router's clusters of ``batch`` over a run, per layer
    (:func:`~ntkscope.representation.consensus.structure_series`: structure, its bootstrap
    interval, ...), from ``n_fits`` resampled fits per checkpoint (cached per checkpoint; ``device``: where the checkpoints embed, :func:`walk`).
    Returns ({layer: series table}, {layer: {step: (n,) consensus labels}})."""
    analysis = structure_analysis(batch, layers, point=point, router=router, n_fits=n_fits, fraction=fraction,
                                  seed=seed)
    checkpoints, results = walk(run_dir, {"structure": analysis}, steps=steps, cache_dir=cache_dir,
                                func="router_structure", device=device)
    tables, labels = {}, {}
    for layer in results["structure"][0] if results["structure"] else {}:
        fits = {step: np.asarray(found[layer]) for (step, _), found in zip(checkpoints, results["structure"])}
        tables[int(layer)], labels[int(layer)] = structure_series(
            fits, horizon=horizon, threshold=threshold, level=level, min_size=min_size, n_boot=n_boot,
            confidence=confidence, seed=seed + int(layer))
    return tables, labels

def cluster_snapshots(run_dir, batch: dict, layer: int, steps, *, labels: pd.DataFrame | None = None,
                      point: str = "block", k_max: int = 10, projection_dim: int | None = 64, seed: int = 0,
                      method: str = "pca") -> tuple[pd.DataFrame, pd.DataFrame]:
    """2-D views of one layer's embeddings at chosen steps, coloured by their elbow clusters.

    ``labels``: per-sequence annotations (e.g. columns domain, score) in batch order.
    Returns (points: step, x, y, cluster, + the label columns; clusters: step, cluster, size,
    + the share of each domain and the mean score when those columns are given).
    ``method``: "pca" (scikit-learn) or "tsne" (scikit-learn's TSNE, seeded).
    """
    from sklearn.manifold import TSNE  # heavy; only for snapshots

    if method not in ("pca", "tsne"):
        raise fail("cluster_snapshots", "method", "must be 'pca' or 'tsne'", method)
    chosen = dict(select_checkpoints(run_dir, steps, "cluster_snapshots"))
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
