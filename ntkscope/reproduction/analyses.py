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
from ntkscope.kernel.ntk import cosine_kernel, empirical_ntk
from ntkscope.kernel.objectives import sample_outputs, take
from ntkscope.representation.clusters import AutoDBSCAN
from ntkscope.reproduction.settings import ReproduceSettings
from ntkscope.runs.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.runs.dynamics import cluster_dynamics, cluster_snapshots, gc_series, router_stability
from ntkscope.runs.gc import gc_sensitivity
from ntkscope.text.frequency import bin_indices, domain_table, long_tail_subset, score_histogram

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


def gc_by_frequency(dense_last: Path, data, settings: ReproduceSettings) -> dict:
    """Figure 2(a): gc_outputs (every output of ``settings.gc_outputs`` side by side, one
    :meth:`~ntkscope.GCResult.row` per bin and output, by :func:`ntkscope.runs.gc.gc_sensitivity`),
    gc_by_bin (the rows of ``settings.gc_output``) and the histogram of the same bins."""
    outputs = list(dict.fromkeys([settings.gc_output, *settings.gc_outputs]))
    table, hist, _ = gc_sensitivity(load_checkpoint(dense_last), data, outputs=outputs, bins=settings.bins,
                                    binning=settings.binning, min_count=settings.min_count,
                                    resampling=settings.resampling(), seed=settings.seed)
    chosen = table[table["output"] == settings.gc_output].drop(columns="output").reset_index(drop=True)
    return {"gc_by_bin": chosen, "histogram": hist, "gc_outputs": table}


def training_dynamics(dense_dir: Path, data, settings: ReproduceSettings) -> dict:
    """Figure 3: gc_over_steps (a :func:`ntkscope.gc_series` table: step, |GC| and its interval,
    the null band, sign confidence, mean-gradient consistency, flags, ...) of the long tail (the
    lowest ``tail_fraction`` of frequency scores) for ``settings.gc_output``, and dynamics (step,
    layer, k, inter_distance, ...) over every dense checkpoint. Cached per checkpoint in the run."""
    tail = long_tail_subset(data.labels["score"], settings.tail_fraction)
    gc = gc_series(dense_dir, data.batch, tail, output=settings.gc_output, resampling=settings.resampling())
    dynamics = cluster_dynamics(dense_dir, data.batch, point="ffn_input", k_max=settings.k_max,
                                projection_dim=settings.projection_dim, seed=settings.seed)
    return {"gc_over_steps": gc, "dynamics": dynamics}


def stability(dense_dir: Path, data, layers: list, steps: list, settings: ReproduceSettings) -> pd.DataFrame:
    """The router's clusters of the analysis sentences at ``layers``' FFN input over the dense
    checkpoints at ``steps`` (:func:`ntkscope.router_stability`), for the warm-up's fallback rule."""
    return router_stability(dense_dir, data.batch, layers, point="ffn_input", proj_dim=settings.proj_dim,
                            min_samples=settings.min_samples, max_experts=settings.max_experts, seed=settings.seed,
                            steps=steps)


def snapshots(dense_dir: Path, data, layer: int, settings: ReproduceSettings) -> dict:
    """Figure 4(b): snapshot_points (step, x, y, cluster, domain, score) and snapshot_clusters
    of ``layer``'s FFN input at ``settings.snapshots`` evenly spaced checkpoints."""
    steps = [s for s, _ in list_checkpoints(dense_dir)]
    chosen = sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, settings.snapshots)})
    points, clusters = cluster_snapshots(dense_dir, data.batch, layer, chosen, labels=_labels(data),
                                         point="ffn_input", k_max=settings.k_max,
                                         projection_dim=settings.projection_dim, seed=settings.seed)
    return {"snapshot_points": points, "snapshot_clusters": clusters}


def routing(cse_last: Path, data, layer: int, settings: ReproduceSettings) -> dict:
    """Figures 2(b) and 5(a): the analysis sentences at CSE ``layer``'s input, in the router's
    projected space (PCA to 2-D): routing (x, y, expert, cluster, domain, score), where
    expert is where the router sends each sentence and cluster is DBSCAN (automatic eps) on
    the same projected points; routing_summary (expert, n, share of each domain)."""
    model = load_checkpoint(cse_last).eval()
    router = model.sparse_layers()[f"transformer.h.{layer}.mlp"]
    with torch.no_grad():
        v = model.module_inputs(data.batch["input_ids"], data.batch["attention_mask"], [layer])[layer]  # (n, d)
        z, expert = router.route(v[:, None, :])  # a one-token sequence: its embedding is v itself
    z, expert = z.double().numpy(), expert.numpy()
    clusters = AutoDBSCAN(min_samples=settings.min_samples).fit(z)
    xy = PCA(2, random_state=settings.seed).fit_transform(z)
    frame = pd.DataFrame({"x": xy[:, 0], "y": xy[:, 1], "expert": expert, "cluster": clusters.labels_})
    frame = pd.concat([frame, _labels(data)], axis=1)
    summary = pd.crosstab(frame["expert"], frame["domain"]).add_prefix("n ")
    summary.insert(0, "n", summary.sum(axis=1))
    summary = summary.reset_index()
    summary.attrs["eps"] = clusters.eps_
    return {"routing": frame, "routing_summary": summary}


def _mean_off_diagonal(matrix: np.ndarray) -> float:
    n = len(matrix)
    return float((matrix.sum() - np.trace(matrix)) / (n * (n - 1))) if n > 1 else float("nan")


def expert_kernels(cse_last: Path, dense_last: Path, data, routing_frame: pd.DataFrame, layer: int) -> dict:
    """Figure 5(b, c): the empirical NTK (loss output, exact) of each CSE expert of ``layer``
    over its parameters, on the sentences routed to it; and of the dense model over its FFN
    at the same layer, on the whole batch. kernels: {"expert E": (n_E, n_E), "dense": (n, n)};
    expert_ntk: per expert, n and the mean off-diagonal cosine (Θ_ij / sqrt(Θ_ii Θ_jj)) of
    the expert's kernel and of the dense kernel on the same sentences."""
    dense = load_checkpoint(dense_last).eval()
    full = empirical_ntk(dense, data.batch, params=f"transformer.h.{layer}.mlp.*", method="exact")
    dense_k = full.matrix.double().numpy()
    cse = load_checkpoint(cse_last).eval()
    kernels, rows = {"dense": dense_k}, []
    for e in sorted(routing_frame["expert"].unique()):
        idx = np.flatnonzero(routing_frame["expert"].to_numpy() == e)
        if len(idx) < 2:
            continue
        sub = take(data.batch, torch.as_tensor(idx))
        k = empirical_ntk(cse, sub, params=f"transformer.h.{layer}.mlp.experts.{e}.*", method="exact")
        kernels[f"expert {e}"] = k.matrix.double().numpy()
        kernels[f"index {e}"] = idx
        rows.append((str(e), len(idx), _mean_off_diagonal(cosine_kernel(kernels[f"expert {e}"])),
                     _mean_off_diagonal(cosine_kernel(dense_k[np.ix_(idx, idx)]))))
    rows.append(("all", len(dense_k), np.nan, _mean_off_diagonal(cosine_kernel(dense_k))))
    summary = pd.DataFrame(rows, columns=["expert", "n", "cse_expert_cosine", "dense_cosine"])
    return {"expert_ntk": summary, "kernels": kernels}


def results(runs: dict, pack, settings: ReproduceSettings) -> dict:
    """Tables 1-2: :func:`cse_models.evaluate.results_table` over ``runs`` {name: checkpoint}."""
    return {"results": results_table(runs, pack, seq_len=settings.seq_len, seeds=tuple(range(settings.probe_seeds)))}
