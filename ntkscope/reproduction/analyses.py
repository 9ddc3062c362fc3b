"""The measurements behind each figure, as named tables (DataFrames; kernels as arrays).

Every function takes trained checkpoints and analysis sentences
(:class:`~ntkscope.AnalysisData`) and calls the library's public functions; nothing here is
specific to a figure's look (that is :mod:`ntkscope.plotting`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.decomposition import PCA

from cse_models.evaluate import results_table
from ntkscope.gc.groups import gc_sensitivity
from ntkscope.gc.tracker import GCTracker, Probes
from ntkscope.kernel.ntk import cosine_kernel, empirical_ntk
from ntkscope.kernel.objectives import sample_outputs, take
from ntkscope.kernel.options import KernelOptions
from ntkscope.representation.router import fit_router
from ntkscope.reproduction.settings import ReproduceSettings
from ntkscope.runs.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.runs.dynamics import cluster_dynamics, gc_series, router_dynamics
from ntkscope.runs.embeddings import layer_embeddings
from ntkscope.text.frequency import bin_indices, domain_table, long_tail_subset, score_histogram
from ntkscope.text.corpus.text import split_sentences

log = logging.getLogger(__name__)


def _labels(data) -> pd.DataFrame:
    """The analysis sentences' domain and frequency score, in batch order."""
    return data.labels.rename(columns={"label": "domain"})[["domain", "score"]]


def long_tail(pack, dense_last: Path, data, settings: ReproduceSettings) -> dict:
    """Figure 1. domain_sizes: the 20 largest categories; perplexity: per sentence (domain,
    score, n_tokens, loss, perplexity); perplexity_by_bin: per frequency bin (bin, left,
    right, n, median_perplexity, mean_loss)."""
    sizes = domain_table(pack.records("all"), top=20)
    model = load_checkpoint(dense_last)
    loss = sample_outputs(model, data.batch).double().numpy()
    sentences = data.labels.rename(columns={"label": "domain"}).drop(columns="text")
    sentences["loss"], sentences["perplexity"] = loss, np.exp(loss)
    hist = score_histogram(sentences["score"], bins=2 * settings.bins)
    rows = []
    for b, idx in bin_indices(sentences["score"], bins=2 * settings.bins, min_count=settings.min_count,
                              cap=None).items():
        rows.append((b, hist.left[b], hist.right[b], len(idx), float(np.median(sentences["perplexity"].iloc[idx])),
                     float(sentences["loss"].iloc[idx].mean())))
    by_bin = pd.DataFrame(rows, columns=["bin", "left", "right", "n", "median_perplexity", "mean_loss"])
    return {"domain_sizes": sizes, "perplexity": sentences, "perplexity_by_bin": by_bin}


def source_pools(pack, data, settings: ReproduceSettings) -> list:
    """The homogeneous null's pools: per source of the ordinary domain (``settings.homogeneous_domain``:
    gcide, wordnet, ...), the indices of ``data``'s sentences from it (each source a single kind of
    text, stricter than the domain as a whole, which is most of any random subset)."""
    source = {}
    for r in pack.records("validation"):
        if r.domain == settings.homogeneous_domain:
            for sentence in split_sentences(r.text):
                source.setdefault(sentence, r.source)
    which = np.array([source.get(t, "") for t in data.labels["text"]])
    return [np.flatnonzero(which == s) for s in sorted(set(which) - {""}) if (which == s).sum() >= 2]


def gc_by_frequency(dense_last: Path, data, pools: list, settings: ReproduceSettings) -> dict:
    """Figure 2(a): gc_outputs (every output of ``settings.gc_outputs`` side by side, one
    :meth:`~ntkscope.GCResult.row` per bin and output, by :func:`ntkscope.gc.groups.gc_sensitivity`),
    gc_by_bin (the rows of ``settings.gc_output``) and the histogram of the same bins."""
    outputs = list(dict.fromkeys([settings.gc_output, *settings.gc_outputs]))
    table, hist, _ = gc_sensitivity(load_checkpoint(dense_last), data, outputs=outputs, gc=settings.gc_options(),
                                    resampling=settings.resampling(), seed=settings.seed, homogeneous=pools or None)
    chosen = table[table["output"] == settings.gc_output].drop(columns="output").reset_index(drop=True)
    return {"gc_by_bin": chosen, "histogram": hist, "gc_outputs": table}


def router_options(settings: ReproduceSettings) -> dict:
    """The keyword arguments of :func:`ntkscope.fit_router` that CSE's conversion uses."""
    return {"rule": settings.router_rule, "representation": settings.router_representation,
            "proj_dim": settings.proj_dim, "min_cluster_size": settings.min_cluster_size,
            "min_samples": settings.min_samples, "max_experts": settings.max_experts, "seed": settings.seed}


def training_dynamics(dense_dir: Path, draws: list, pools: list, fitting, settings: ReproduceSettings) -> dict:
    """Figure 3: gc_over_steps (a :func:`ntkscope.gc_series` table per draw of analysis sentences
    in ``draws``, with the homogeneous null's ``pools`` of each (:func:`source_pools`), stacked
    with a ``draw`` column: step, |GC| and its interval, the null bands, the
    excess over the random null, sign confidence, mean-gradient consistency, flags, ...) of the
    long tail (the lowest ``tail_fraction`` of frequency scores) for ``settings.gc_output``;
    dynamics (step,
    layer, elbow k, knee strength, silhouette K, inter_distance, ...) of the analysis sentences
    over every dense checkpoint; and router_dynamics (:func:`ntkscope.router_dynamics`: the
    router's clusters of the fitting sample ``fitting`` at every layer, their purity, tail share,
    kNN lift and silhouette per domain, stability) at every ``checkpoint_every`` steps. Cached
    per checkpoint in the run."""
    series = []
    for d, (data, pool) in enumerate(zip(draws, pools)):
        tail = long_tail_subset(data.labels["score"], settings.tail_fraction)
        frame = gc_series(dense_dir, data.batch, tail, output=settings.gc_output, resampling=settings.resampling(),
                          pools=pool or None)
        frame.insert(0, "draw", d)
        series.append(frame)
    gc = pd.concat(series, ignore_index=True)
    data = draws[0]
    dynamics = cluster_dynamics(dense_dir, data.batch, point="ffn_input", k_max=settings.k_max,
                                projection_dim=settings.projection_dim, seed=settings.seed)
    steps = [s for s, _ in list_checkpoints(dense_dir) if s % settings.checkpoint_every == 0]
    router = router_dynamics(dense_dir, fitting["batch"], domains=fitting["domains"],
                             tail=settings.finetune_domains, router=router_options(settings), steps=steps)
    return {"gc_over_steps": gc, "dynamics": dynamics, "router_dynamics": router}


def tail_probes(data, pool: list, settings: ReproduceSettings) -> Probes:
    """Figure 3(a)'s probe set: the long tail (the lowest ``tail_fraction`` of frequency scores) of
    the analysis sentences ``data``, with the homogeneous null's ``pool`` (:func:`source_pools`)."""
    tail = long_tail_subset(data.labels["score"], settings.tail_fraction)
    return Probes(data.batch, {"tail": tail}, pools=pool or None, source=data.source)


def tracked_gc(train_dense, model_dir: Path, data, pool: list, settings: ReproduceSettings) -> dict:
    """Figure 3(a) measured inside training: ``train_dense(callbacks)`` trains the dense model again
    (into ``model_dir``) with a :class:`~ntkscope.GCTracker` every ``settings.track_every`` steps
    on draw 0's sentences, their long tail and pools, ``settings.gc_output`` and the statistics of
    :func:`training_dynamics`; gc_tracked is its table (the columns of gc_over_steps, plus
    kernel_cka and seconds), read back from ``model_dir/track`` when the run was already trained."""
    tracker = GCTracker(tail_probes(data, pool, settings), every=settings.track_every, out=model_dir / "track",
                        options=KernelOptions(output=settings.gc_output), resampling=settings.resampling())
    train_dense([tracker])  # a run already trained calls nothing: the tracker read its rows when it opened them
    return {"gc_tracked": tracker.series("tail")}


def _routing_view(z: np.ndarray, seed: int) -> np.ndarray:
    """2-D PCA of points in a routing space (n, d') -> (n, 2)."""
    return PCA(2, random_state=seed).fit_transform(z)


def snapshots(dense_dir: Path, fitting, layer: int, settings: ReproduceSettings) -> dict:
    """Figure 4(b): snapshot_points (step, x, y, cluster, domain) and snapshot_clusters (step,
    cluster, size, share of each domain) of the fitting sample at ``layer``'s FFN input, at
    ``settings.snapshots`` evenly spaced checkpoints: the router's clusters (the rule CSE uses),
    drawn in the first two principal components of the routing space."""
    steps = [s for s, _ in list_checkpoints(dense_dir)]
    chosen = sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, settings.snapshots)})
    paths = dict(list_checkpoints(dense_dir))
    points, clusters = [], []
    for step in chosen:
        X = layer_embeddings(load_checkpoint(paths[step]), fitting["batch"], point="ffn_input",
                             layers=[layer]).embeddings[layer]
        fit = fit_router(X, **router_options(settings))
        xy = _routing_view(fit.transform(X), settings.seed)
        frame = pd.DataFrame({"step": step, "x": xy[:, 0], "y": xy[:, 1], "cluster": fit.labels,
                              "domain": fitting["domains"]})
        points.append(frame)
        summary = frame.groupby("cluster").size().rename("size").reset_index()
        shares = pd.crosstab(frame["cluster"], frame["domain"], normalize="index").add_prefix("share ")
        summary = summary.merge(shares, left_on="cluster", right_index=True)
        summary.insert(0, "step", step)
        clusters.append(summary)
    return {"snapshot_points": pd.concat(points, ignore_index=True),
            "snapshot_clusters": pd.concat(clusters, ignore_index=True)}


def _router_of(cse_last: Path, layer: int):
    model = load_checkpoint(cse_last).eval()
    return model, model.sparse_layers()[f"transformer.h.{layer}.mlp"]


def _route(model, router, batch: dict, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Where ``router`` (a CSE layer of ``model``) sends each sequence of ``batch``: its point in
    the routing space (n, d') and its expert (n,)."""
    with torch.no_grad():
        v = model.module_inputs(batch["input_ids"], batch.get("attention_mask"), [layer])[layer]  # (n, d)
        z, expert = router.route(v[:, None, :])  # a one-token sequence: its embedding is v itself
    return z.double().numpy(), expert.numpy()


def routing(cse_last: Path, warmup_checkpoint: Path, held_out, fitting, layer: int,
            settings: ReproduceSettings) -> dict:
    """Figures 2(b) and 5(a) and the routing table, at CSE ``layer``.

    fit_points (x, y, cluster, domain): the fitting sample at the warm-up checkpoint, with the
    clusters the router was built from (:func:`ntkscope.fit_router` again, same settings: the
    same clusters), in the routing space's first two principal components. routing (x, y,
    expert, domain): the held-out blocks ``held_out`` routed by the trained CSE model.
    routing_summary: per expert, the held-out blocks it receives, by domain (counts, and each
    domain's share of the expert), and per domain the share going to its most-used expert.
    """
    X = layer_embeddings(load_checkpoint(warmup_checkpoint), fitting["batch"], point="ffn_input",
                         layers=[layer]).embeddings[layer]
    fit = fit_router(X, **router_options(settings))
    xy = _routing_view(fit.transform(X), settings.seed)
    fit_points = pd.DataFrame({"x": xy[:, 0], "y": xy[:, 1], "cluster": fit.labels, "domain": fitting["domains"]})
    model, router = _router_of(cse_last, layer)
    z, expert = _route(model, router, held_out["batch"], layer)
    xy = _routing_view(z, settings.seed)
    frame = pd.DataFrame({"x": xy[:, 0], "y": xy[:, 1], "expert": expert, "domain": held_out["domains"]})
    counts = pd.crosstab(frame["expert"], frame["domain"])
    summary = counts.add_prefix("n ")
    summary.insert(0, "n", counts.sum(axis=1))
    for d in counts.columns:
        summary[f"share {d}"] = counts[d] / counts.sum(axis=1)
    return {"fit_points": fit_points, "routing": frame, "routing_summary": summary.reset_index()}


def mean_cosine(kernel: np.ndarray) -> tuple[float, float]:
    """(mean off-diagonal cosine ``Θ_ij / sqrt(Θ_ii Θ_jj)`` of ``kernel`` (n, n), its
    leave-one-sentence-out jackknife standard error); NaN below 2 (3 for the error) sentences."""
    C = cosine_kernel(kernel)
    n = len(C)
    if n < 2:
        return float("nan"), float("nan")
    total, trace = float(C.sum()), float(np.trace(C))
    point = (total - trace) / (n * (n - 1))
    if n < 3:
        return point, float("nan")
    left = (total - 2 * C.sum(1) + np.diag(C) - (trace - np.diag(C))) / ((n - 1) * (n - 2))
    return point, float(np.sqrt((n - 1) / n * ((left - left.mean()) ** 2).sum()))


def expert_kernels(cse_last: Path, dense_last: Path, data, layer: int, output: str) -> dict:
    """Figure 5(b, c): the empirical NTK (``output``, exact) of each CSE expert of ``layer`` over
    its parameters, on the analysis sentences routed to it; and of the dense model over its FFN at
    the same layer, on the whole batch. kernels: {"expert E": (n_E, n_E), "index E": rows,
    "dense": (n, n)}; expert_ntk: per expert, n, and the mean off-diagonal cosine of the expert's
    kernel and of the dense kernel on the same sentences, each with its jackknife standard
    error (:func:`mean_cosine`): do an expert's sentences pull its parameters more alike than
    the dense FFN's? The row "all": the dense kernel on the whole batch."""
    dense = load_checkpoint(dense_last).eval()
    full = empirical_ntk(dense, data.batch, params=f"transformer.h.{layer}.mlp.*", method="exact", output=output)
    dense_k = full.matrix.double().numpy()
    cse, router = _router_of(cse_last, layer)
    _, experts = _route(cse, router, data.batch, layer)
    kernels, rows = {"dense": dense_k}, []
    for e in sorted(set(experts.tolist())):
        idx = np.flatnonzero(experts == e)
        if len(idx) < 3:
            continue
        sub = take(data.batch, torch.as_tensor(idx))
        k = empirical_ntk(cse, sub, params=f"transformer.h.{layer}.mlp.experts.{e}.*", method="exact", output=output)
        kernels[f"expert {e}"] = k.matrix.double().numpy()
        kernels[f"index {e}"] = idx
        rows.append((str(e), len(idx), *mean_cosine(kernels[f"expert {e}"]),
                     *mean_cosine(dense_k[np.ix_(idx, idx)])))
    rows.append(("all", len(dense_k), np.nan, np.nan, *mean_cosine(dense_k)))
    summary = pd.DataFrame(rows, columns=["expert", "n", "cse_expert_cosine", "cse_expert_cosine_se", "dense_cosine",
                                          "dense_cosine_se"])
    summary.insert(2, "output", output)
    return {"expert_ntk": summary, "kernels": kernels}


def _probe_mean(cell) -> float:
    """A probe cell "0.612 ± 0.021" -> 0.612."""
    return float(str(cell).split("±")[0])


def results(runs: dict, seed_runs: dict, pack, settings: ReproduceSettings) -> dict:
    """Tables 1-2 and the seeds comparison, evaluated once by :func:`cse_models.evaluate.results_table`.

    results: one row per run of ``runs`` {name: checkpoint}. seeds: one row per (model, seed)
    of ``seed_runs`` {(model, seed): checkpoint}, and seeds_summary: per model, the mean and
    std over seeds of the test perplexity (all, per domain) and each probe's mean accuracy."""
    named = {**runs, **{f"{m} (seed {s})": path for (m, s), path in seed_runs.items() if path not in runs.values()}}
    table = results_table(named, pack, seq_len=settings.seq_len, seeds=tuple(range(settings.probe_seeds)),
                          max_blocks=settings.eval_max_blocks or None, max_items=settings.eval_max_items or None)
    by_path = dict(zip(named.values(), range(len(named))))
    rows = []
    for (model, seed), path in seed_runs.items():
        row = table.iloc[by_path[path]].drop(labels="model")
        rows.append({"model": model, "seed": seed, **row.to_dict()})
    seeds = pd.DataFrame(rows)
    numeric = seeds.drop(columns=["model", "seed"]).apply(lambda col: col.map(_probe_mean))
    numeric.insert(0, "model", seeds["model"])
    grouped = numeric.groupby("model", sort=False)
    summary = grouped.mean().add_suffix(" mean").join(grouped.std(ddof=1).add_suffix(" std"))
    summary = summary[[c for pair in zip(grouped.mean().columns + " mean", grouped.mean().columns + " std")
                       for c in pair]]
    summary.insert(0, "seeds", grouped.size())
    return {"results": table[table["model"].isin(list(runs))].reset_index(drop=True), "seeds": seeds,
            "seeds_summary": summary.reset_index()}
