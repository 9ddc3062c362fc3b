"""Figures of the analyses (the CSE paper's Figures 1-5, docs/design.md §5). Every function takes
tables that the library returns and gives back a matplotlib Figure; :func:`save_figure`
writes it (PNG, and PDF on request) under a temporary name and renames it.

- :func:`domain_sizes` — Figure 1(a): the largest categories of the corpus, a long tail.
- :func:`gc_vs_frequency` — Figure 2(a): GC per frequency bin over the histogram of sentences.
- :func:`gc_over_steps` — Figure 3(a): GC of the long tail over training.
- :func:`layer_dynamics` — Figure 3(b, c): elbow K and inter-cluster distance per layer over steps.
- :func:`cluster_view` — Figures 2(b), 4(b), 5(a): a 2-D view coloured by cluster or expert.
- :func:`ntk_heatmap` — a kernel with its samples ordered by label.
- :func:`perplexity_vs_frequency` — Figure 1(b): perplexity of each sentence against its score.
- :func:`cse_schematic` — Figure 4(a): the CSE layer, drawn.
- :func:`expert_kernels` — Figure 5(b, c): each CSE expert's NTK beside the dense baseline's.
"""

from __future__ import annotations

import re

from pathlib import Path

import numpy as np

from ntkscope.core.checks import fail
from ntkscope.core.files import atomic_path


def _pyplot():
    """matplotlib.pyplot, imported on first drawing (it costs half a second); the backend is the
    caller's: the command line chooses Agg, a notebook keeps its own."""
    import matplotlib.pyplot as plt

    return plt


DOMAIN_COLOURS = {"general": "#7f8c8d", "legal": "#c0392b", "biomedical": "#2e86c1"}


def save_figure(fig, path, *, formats=("png",), close: bool = True) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix in ``formats``, atomically; returns the paths."""
    plt = _pyplot()
    path = Path(path)
    out = []
    for fmt in formats:
        target = path.with_suffix(f".{fmt}")
        metadata = {"CreationDate": None} if fmt == "pdf" else None  # the same figure gives the same bytes
        with atomic_path(target) as tmp:
            fig.savefig(tmp, dpi=130, bbox_inches="tight", metadata=metadata)
        out.append(target)
    if close:
        plt.close(fig)
    return out


def domain_sizes(table, *, top: int = 20):
    """Figure 1(a). ``table``: :func:`ntkscope.domain_table` (domain, source, category, percent)."""
    plt = _pyplot()
    rows = table.head(top).iloc[::-1]
    fig, ax = plt.subplots(figsize=(6.4, 0.28 * len(rows) + 1.2))
    colours = [DOMAIN_COLOURS.get(d, "#95a5a6") for d in rows["domain"]]
    ax.barh([f"{s}: {c}" for s, c in zip(rows["source"], rows["category"])], rows["percent"], color=colours)
    ax.set_xlabel("share of the corpus (% of tokens)")
    ax.set_title(f"The {len(rows)} largest categories of the corpus")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in DOMAIN_COLOURS.values()]
    ax.legend(handles, list(DOMAIN_COLOURS), loc="lower right", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    return fig


def _lowest(table, columns) -> float:
    """A lower y limit that shows every value of ``columns`` (the scale zooms in where all are near 1)."""
    low = float(np.nanmin(table[columns].to_numpy(dtype=float)))
    return max(-1.02, low - 0.1 * (1.0 - low) - 0.02)


def _flagged(table):
    return table["flags"].fillna("").astype(str).str.len() > 0 if "flags" in table else table["gc"] != table["gc"]


#: the null bands drawn, in order: (name in a gc table's columns, label, colour)
_NULLS = (("", "random subsets", "#95a5a6"), ("homogeneous", "homogeneous subsets (ordinary text)", "#5dade2"))


def _band_columns(name: str) -> tuple:
    stem = f"null_{name}_" if name else "null_"
    return f"{stem}low", f"{stem}median", f"{stem}high"


def _gc_panel(ax, strip, table, histogram):
    """One output: per bin, each null band as a box (random, homogeneous), |GC| with its
    interval and the mean-gradient consistency with its interval, side by side; hollow markers:
    a flagged direction. ``strip``: a thin axis below with the share of sentences per bin."""
    x = np.arange(len(table))
    width = 0.16
    for k, (name, label, colour) in enumerate(_NULLS):
        low, _, high = _band_columns(name)
        if low in table and table[low].notna().any():
            ax.bar(x - 0.3 + k * width, table[high] - table[low], bottom=table[low], width=width, color=colour,
                   alpha=0.45, label=f"null: |GC| of {label}")
    y = table["abs_gc"].to_numpy()
    err = [y - table["abs_gc_low"].fillna(table["abs_gc"]), table["abs_gc_high"].fillna(table["abs_gc"]) - y]
    ax.errorbar(x + 0.05, y, yerr=err, fmt="none", ecolor="#c0392b", capsize=3, lw=1.2)
    flagged = _flagged(table).to_numpy()
    ax.scatter(x[~flagged] + 0.05, y[~flagged], color="#c0392b", zorder=3, s=22, label="|GC| of the bin, interval")
    ax.scatter(x[flagged] + 0.05, y[flagged], facecolor="white", edgecolor="#c0392b", zorder=3, s=22,
               label="|GC|, direction flagged")
    m = table["mean_gradient"].to_numpy()
    merr = [m - table["mean_gradient_low"].fillna(table["mean_gradient"]),
            table["mean_gradient_high"].fillna(table["mean_gradient"]) - m]
    ax.errorbar(x + 0.25, m, yerr=merr, fmt="^", color="#2c3e50", ms=4, capsize=2, lw=1,
                label="mean-gradient consistency")
    ax.set_ylabel("consistency with the whole set")
    columns = ["abs_gc_low", "mean_gradient_low"] + [_band_columns(n)[0] for n, _, _ in _NULLS]
    ax.set_ylim(_lowest(table, [c for c in columns if c in table]), 1.01)
    ax.set_xticks(x, [f"bin {k}" for k in x], fontsize=7)
    strip.bar(x, histogram["percent"].to_numpy()[: len(x)], width=0.6, color="#b8c5d9")
    strip.set_ylabel("%", fontsize=7)
    strip.set_xticks(x, [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(table["left"], table["right"])], fontsize=7)
    strip.tick_params(axis="y", labelsize=6)
    strip.set_xlabel("frequency score bin (rarest left); strip: % of sentences per bin")


def gc_vs_frequency(table, histogram, *, title: str = "", chosen: str | None = None):
    """Figure 2(a). Per frequency bin (``table``: a :func:`ntkscope.gc_by_bins` table; with an
    ``output`` column, one panel per output, ``chosen`` marked as the one the text reads): |GC|
    with its finite-n interval beside the null bands of random and of homogeneous subsets of
    the bin's size, and the mean-gradient consistency; a strip below: % of sentences per bin
    (``histogram``: :func:`ntkscope.score_histogram`, the same bins)."""
    plt = _pyplot()
    outputs = list(dict.fromkeys(table["output"])) if "output" in table else [None]
    fig, axes = plt.subplots(2, len(outputs), figsize=(5.2 * len(outputs), 4.6), squeeze=False,
                             gridspec_kw={"height_ratios": [5, 1]})
    for k, name in enumerate(outputs):
        rows = (table if name is None else table[table["output"] == name]).sort_values("left")
        _gc_panel(axes[0, k], axes[1, k], rows.reset_index(drop=True), histogram)
        axes[0, k].set_title(f"output: {name}" + (" (read in the text)" if name == chosen else "") if name else "",
                             fontsize=9)
    fig.suptitle(title or "GC against sentence frequency")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, bbox_to_anchor=(0.5, -0.01))
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def expert_layers(layers, *, title: str = ""):
    """Each sparse layer's routing purity and NMI against the labels, with their intervals
    (``layers``: :func:`cse_models.expert_report.expert_report`'s layer table: name, purity,
    purity_low/high, nmi, nmi_low/high)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.45 * len(layers) + 1.2))
    y = np.arange(len(layers))
    for offset, stat, colour in ((-0.15, "purity", "#2e86c1"), (0.15, "nmi", "#c0392b")):
        value = layers[stat].to_numpy(dtype=float)
        low, high = (layers[f"{stat}_{end}"].to_numpy(dtype=float) for end in ("low", "high"))
        err = np.clip([value - low, high - value], 0, None)  # a percentile interval may miss its point
        ax.errorbar(value, y + offset, xerr=err, fmt="o", color=colour, capsize=3, label=stat)
    ax.set_yticks(y, layers["name"].astype(str))
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("against the labels (intervals: bootstrap over texts)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "What the experts learned: routing purity and NMI per layer", fontsize=10)
    fig.tight_layout()
    return fig


_BLOCK = re.compile(r"(?:^|\.)(?:h|layers?|blocks?|layer)\.(\d+)(?:\.(\w+))?")


def layer_name(path) -> str:
    """A module path as a reader says it: ``hf.gpt_neox.layers.2.mlp.layer`` -> "layer 2 (mlp)",
    ``transformer.h.0`` -> "layer 0"; anything else as it is."""
    found = _BLOCK.search(str(path))
    if not found:
        return str(path)
    return f"layer {found[1]}" + (f" ({found[2]})" if found[2] else "")


def gc_per_layer(frame, *, title: str = ""):
    """|GC| of each subset over training, one panel per subset (``label``) and one line per layer
    (``frame``: a tracker's per-layer rows: step, label, layer, abs_gc)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(frame["label"].astype(str)))
    fig, axes = plt.subplots(1, len(labels), figsize=(3.2 * len(labels) + 0.8, 3.0), squeeze=False, sharey=True)
    for ax, label in zip(axes[0], labels):
        rows = frame[frame["label"].astype(str) == label]
        for layer, part in rows.groupby("layer", sort=False):
            part = part.sort_values("step")
            ax.plot(part["step"], part["abs_gc"], marker=".", lw=1, label=layer_name(layer))
        ax.set_title(f"|GC| of {label}, per layer", fontsize=9)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("|GC| (the layer's block of the kernel)")
    axes[0][-1].legend(fontsize=6, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def inrun_series(frame, *, title: str = ""):
    """In-run GC over training: each group's GC against its step's batch (``frame``: an
    ``InRunTracker``'s ``inrun.csv``: step, label, gc), one line per group."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for label, rows in frame.groupby("label", sort=False):
        rows = rows.sort_values("step")
        ax.plot(rows["step"], rows["gc"], marker=".", lw=1, label=str(label))
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("training step")
    ax.set_ylabel("GC against the step's batch")
    ax.set_title(title or "In-run GC of each group of the training batches", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def gc_over_steps(frame, *, warmup: int | None = None, rule: str = "", title: str = "",
                  subset: str = "the long tail"):
    """Figure 3(a). ``frame``: a :func:`ntkscope.gc_series` table (a ``draw`` column: several
    independent draws of analysis sentences). Top: |GC| of ``subset`` (default the long tail) and
    the random null band, per draw. Bottom: the excess |GC| - null median (mean over draws) with its
    +-1.645 standard-error band (:func:`ntkscope.representation.plan.excess_series`), the null
    bands in the same coordinates (random; homogeneous where measured); hollow: flagged steps
    (left out of the peak test); the plan's warm-up (``warmup``, chosen by ``rule``) dashed."""
    from ntkscope.representation.plan import excess_series

    plt = _pyplot()
    fig, (top, ax) = plt.subplots(2, 1, figsize=(7.2, 5.6), sharex=True, gridspec_kw={"height_ratios": [2, 3]})
    frame = frame if "draw" in frame else frame.assign(draw=0)
    for d, rows in frame.groupby("draw"):
        steps = rows["step"].to_numpy()
        top.fill_between(steps, rows["null_low"], rows["null_high"], color="#95a5a6", alpha=0.15,
                         label="random null band" if d == 0 else None)
        top.plot(steps, rows["abs_gc"], "-", color="#c0392b", lw=1, alpha=0.8,
                 label=f"|GC| of {subset}, per draw" if d == 0 else None)
    top.set_ylabel("|GC|")
    top.tick_params(labelbottom=True)
    top.set_ylim(_lowest(frame, ["abs_gc", "null_low"]), 1.01)
    top.legend(fontsize=7, loc="lower right")
    series = excess_series(frame)
    steps = series["step"].to_numpy()
    mean = frame.groupby("step")
    for name, label, colour in _NULLS:
        low, median, high = _band_columns(name)
        if low in frame and frame[low].notna().any():
            ax.fill_between(steps, (mean[low].mean() - mean["null_median"].mean()).to_numpy(),
                            (mean[high].mean() - mean["null_median"].mean()).to_numpy(), color=colour, alpha=0.25,
                            label=f"null band: {label}")
    ax.fill_between(steps, series["excess"] - 1.645 * series["excess_se"],
                    series["excess"] + 1.645 * series["excess_se"], color="#e6b0aa", alpha=0.7,
                    label="excess +- 1.645 SE" + (f" ({int(series['draws'].max())} draws)"
                                                  if series["draws"].max() > 1 else ""))
    ax.plot(steps, series["excess"], "-", color="#c0392b", lw=1.2)
    flagged = (series["flags"] != "").to_numpy()
    ax.scatter(steps[~flagged], series["excess"][~flagged], color="#c0392b", zorder=3, s=16,
               label="|GC| - random null median")
    ax.scatter(steps[flagged], series["excess"][flagged], facecolor="white", edgecolor="#c0392b", zorder=3, s=16,
               label="flagged (left out of the peak test)")
    ax.axhline(0, color="black", lw=0.6)
    for a in (top, ax):
        if warmup is not None:
            a.axvline(warmup, color="#7d3c98", ls="--", lw=1,
                      label=f"warm-up: step {warmup}" + (f" ({rule})" if rule else "") if a is ax else None)
    ax.set_xlabel("training step")
    ax.set_ylabel("excess over the random null")
    top.set_title(title or f"GC of {subset} over training", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def layer_dynamics(table, router=None):
    """Figure 3(b, c), one line per layer over training steps. ``table``: :func:`ntkscope.cluster_dynamics`
    (the paper's elbow K, dotted, beside the silhouette K, which is 1 when no K reaches a
    silhouette of 0.25; the best silhouette; the inter-cluster distance, and the same distance
    over the mean cluster radius). ``router``: :func:`ntkscope.router_dynamics` with domains (the
    router's clusters, the pure tail clusters, the tail share in them, and the tail domains' kNN
    lift), drawn as a second row when given. K is an integer: integer ticks, the layers' lines
    nudged apart so that equal values do not hide each other."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    rows_n = 2 if router is not None else 1
    fig, axes = plt.subplots(rows_n, 4, figsize=(16, 3.5 * rows_n), squeeze=False)
    layers = sorted(table["layer"].unique())
    nudge = {layer: 0.08 * (i - (len(layers) - 1) / 2) for i, layer in enumerate(layers)}
    for layer, rows in table.groupby("layer"):
        line, = axes[0, 0].plot(rows["step"], rows["k_silhouette"] + nudge[layer], "o-", ms=3, label=f"layer {layer}")
        axes[0, 0].plot(rows["step"], rows["k"] + nudge[layer], ":", color=line.get_color(), lw=1)
        axes[0, 1].plot(rows["step"], rows["silhouette"], "o-", ms=3, label=f"layer {layer}")
        axes[0, 2].plot(rows["step"], rows["inter_distance"], "o-", ms=3, label=f"layer {layer}")
        if "separation" in rows:
            axes[0, 3].plot(rows["step"], rows["separation"], "o-", ms=3, label=f"layer {layer}")
    axes[0, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].plot([], [], "k-", lw=1, label="silhouette K")
    axes[0, 0].plot([], [], "k:", lw=1, label="elbow K (paper)")
    axes[0, 1].axhline(0.25, color="grey", lw=0.8, ls="--")
    panels = [(axes[0, 0], "K (nudged per layer)", "(b) number of clusters"),
              (axes[0, 1], "best mean silhouette (K-Means)", "(b') silhouette; < 0.25: no structure"),
              (axes[0, 2], "inter-cluster distance (projected space)", "(c) distance between elbow centres"),
              (axes[0, 3], "distance / mean cluster radius", "(c') separation: distance over radius")]
    if router is not None:
        tail = [c.split(" ", 1)[1] for c in router.columns if c.startswith("tail_share ")]
        for layer, rows in router.groupby("layer"):
            line, = axes[1, 0].plot(rows["step"], rows["n_clusters"] + nudge.get(layer, 0), "o-", ms=3,
                                    label=f"layer {layer}")
            axes[1, 0].plot(rows["step"], rows["n_pure_tail"] + nudge.get(layer, 0), "s--", ms=3,
                            color=line.get_color(), lw=1)
            axes[1, 1].plot(rows["step"], rows["tail_share"], "o-", ms=3, label=f"layer {layer}")
            lift = rows[[f"knn_lift {d}" for d in tail]].mean(axis=1) if tail else rows["n_clusters"] * np.nan
            axes[1, 2].plot(rows["step"], lift, "o-", ms=3, label=f"layer {layer}")
        axes[1, 0].yaxis.set_major_locator(MaxNLocator(integer=True))
        axes[1, 0].plot([], [], "k-", lw=1, label="clusters")
        axes[1, 0].plot([], [], "ks--", ms=3, lw=1, label="pure tail clusters")
        axes[1, 2].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[1, 3].axis("off")
        panels += [(axes[1, 0], "count (nudged per layer)", "router's clusters"),
                   (axes[1, 1], "tail share in pure clusters of their domain", "the long tail in its own clusters"),
                   (axes[1, 2], f"kNN lift, mean of {', '.join(tail) or 'tail'} (1 = chance)",
                    "separability of the tail (routing space)")]
    for ax, ylabel, title in panels:
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def cluster_view(points, *, colour_by: str = "cluster", title: str = ""):
    """Figures 2(b), 4(b), 5(a): a 2-D view (``points``: x, y, and ``colour_by``; one panel per
    ``step`` when there is a step column, two per row), each group annotated with its domain
    make-up. Label -1 (DBSCAN's noise) is drawn grey as "noise"."""
    plt = _pyplot()
    steps = sorted(points["step"].unique()) if "step" in points else [None]
    cols = min(2, len(steps))
    rows_n = -(-len(steps) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 4.4 * rows_n), squeeze=False)
    for ax in axes.flat[len(steps):]:
        ax.axis("off")
    for ax, step in zip(axes.flat, steps):
        rows = points if step is None else points[points["step"] == step]
        for group, g in rows.groupby(colour_by):
            name = "noise" if group == -1 else f"{colour_by} {group}"
            label = f"{name} (n={len(g)})"
            if "domain" in g:
                shares = g["domain"].value_counts(normalize=True)
                label += ": " + ", ".join(f"{d[:3]} {p:.0%}" for d, p in shares.items())
            ax.scatter(g["x"], g["y"], s=9, alpha=0.7, label=label, **({"color": "#bdc3c7"} if group == -1 else {}))
        ax.set_xlabel("principal component 1")
        ax.set_ylabel("principal component 2")
        ax.set_title(f"step {step}" if step is not None else title or "embedding space")
        ax.legend(fontsize=7, loc="best")
    if title and steps != [None]:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def ntk_heatmap(matrix, labels, *, title: str = ""):
    """Figure 5(b, c): the kernel with samples ordered by label (stable), boundaries marked."""
    plt = _pyplot()
    labels = np.asarray(labels).astype(str)
    order = np.argsort(labels, kind="stable")
    fig, ax = plt.subplots(figsize=(5, 4.4))
    image = ax.imshow(np.asarray(matrix)[np.ix_(order, order)], cmap="viridis")
    fig.colorbar(image, ax=ax, shrink=0.8, label="Θ(x_i, x_j)")
    sorted_labels = labels[order]
    edges = [i for i in range(1, len(order)) if sorted_labels[i] != sorted_labels[i - 1]]
    for e in edges:
        ax.axhline(e - 0.5, color="white", lw=0.8)
        ax.axvline(e - 0.5, color="white", lw=0.8)
    starts, ends = [0, *edges], [*edges, len(order)]
    ax.set_xticks([(a + b - 1) / 2 for a, b in zip(starts, ends)])
    ax.set_xticklabels([sorted_labels[a] for a in starts], rotation=45, ha="right", fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("samples, ordered by label")
    ax.set_ylabel("samples (same order)")
    ax.set_title(title or "empirical NTK")
    return fig


def perplexity_vs_frequency(sentences, by_bin, *, title: str = ""):
    """Figure 1(b). ``sentences``: per sentence (domain, score, perplexity); ``by_bin``: left,
    right, n, median_perplexity. Points per sentence (log scale), the binned median as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for domain, rows in sentences.groupby("domain"):
        ax.scatter(rows["score"], rows["perplexity"], s=4, alpha=0.35, color=DOMAIN_COLOURS.get(domain, "#95a5a6"),
                   label=f"{domain} (n={len(rows)})")
    centres = (by_bin["left"] + by_bin["right"]) / 2
    ax.plot(centres, by_bin["median_perplexity"], "o-", color="black", label="median per frequency bin")
    ax.set_yscale("log")
    ax.set_xlabel("sentence frequency score (mean count/max count of its tokens)")
    ax.set_ylabel("perplexity per BPE token (log scale)")
    ax.set_title(title or "Perplexity of held-out sentences against their frequency score")
    ax.legend(fontsize=7, markerscale=2)
    return fig


def cse_schematic():
    """Figure 4(a): the CSE layer (docs/design.md §4), drawn as the router runs it: sequence
    embedding, centred and projected to the routing space ``z = normalise(M (v - mu))``, the
    nearest radius-scaled HDBSCAN cluster centre, the chosen expert (a copy of the warmed-up FFN)."""
    plt = _pyplot()
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 4.4)
    ax.axis("off")

    def box(x, y, w, h, text, colour="#ecf0f1"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#2c3e50", lw=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(a, b, **kw):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, color="#2c3e50", lw=1, **kw))

    box(0.1, 1.7, 1.5, 1.0, "token states\nx (B, T, d)\n(after LN)")
    box(2.1, 2.7, 1.7, 0.9, "sequence\nembedding v: mean\nover real tokens")
    box(4.05, 2.7, 2.05, 0.9, "z = normalise(M(v-mu))\nmu: fitting mean\nM: d' x d projection")
    box(6.4, 2.7, 1.8, 0.9, "expert j = argmin\n||z - c_j|| / r_j\n(HDBSCAN clusters)")
    arrow((1.6, 2.45), (2.1, 3.1))
    arrow((3.8, 3.15), (4.05, 3.15))
    arrow((6.1, 3.15), (6.4, 3.15))
    colours = ["#c9d6ea", "#f5cba7", "#d5f5e3"]
    for j, y in enumerate((0.2, 0.95, 1.7)):
        box(6.6, y, 1.4, 0.55, f"FFN expert {j}", colours[j])
    ax.text(7.3, 2.45, "...", ha="center", fontsize=10)
    arrow((1.6, 1.9), (6.6, 0.48), connectionstyle="arc3,rad=0.1")
    arrow((7.3, 2.7), (7.3, 2.25))
    box(8.6, 0.9, 1.3, 0.9, "output\n(B, T, d)")
    for y in (0.48, 1.22, 1.97):
        arrow((8.0, y), (8.6, 1.35))
    ax.text(5.0, 0.2, "after each step: winning c_j <- a c_j + (1 - a) z  (no router parameters)", ha="center",
            fontsize=7.5, style="italic")
    ax.set_title("The CSE layer: each sequence goes to the expert of its nearest cluster", fontsize=10)
    return fig


def expert_kernels(summary):
    """Figure 5(b, c) as a statistic. ``summary``: expert, n, output, cse_expert_cosine,
    dense_cosine and their ``_se`` (:func:`ntkscope.reproduction.analyses.expert_kernels`). Per
    expert: the mean off-diagonal cosine of the NTK of the expert's parameters on the sentences
    routed to it, beside the dense FFN's on the same sentences, each +- 1.645 jackknife standard
    errors; a dotted line: the dense FFN's on the whole batch."""
    plt = _pyplot()
    rows = summary[summary["expert"].astype(str) != "all"].reset_index(drop=True)
    whole = summary[summary["expert"].astype(str) == "all"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(rows) + 2), 3.6))
    x = np.arange(len(rows))
    for shift, column, colour, label in ((-0.12, "cse_expert_cosine", "#c0392b", "CSE expert's NTK"),
                                         (0.12, "dense_cosine", "#2c3e50", "dense FFN's NTK, same sentences")):
        se = rows[f"{column}_se"].fillna(0) if f"{column}_se" in rows else 0 * rows[column]  # older tables: none
        ax.errorbar(x + shift, rows[column], yerr=1.645 * se, fmt="o", color=colour, capsize=3, ms=5, label=label)
    if len(whole):
        ax.axhline(float(whole["dense_cosine"].iloc[0]), color="#2c3e50", ls=":", lw=1,
                   label="dense FFN's NTK, whole batch")
    ax.set_xticks(x, [f"expert {e}\nn={n}" for e, n in zip(rows["expert"], rows["n"])], fontsize=8)
    ax.set_ylabel("mean off-diagonal cosine Θ_ij / sqrt(Θ_ii Θ_jj)", fontsize=8)
    output = rows["output"].iloc[0] if "output" in rows and len(rows) else "loss"
    ax.set_title(f"(b, c) how alike each expert's sentences pull its parameters (output: {output})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def expert_loads(load, *, tail=("legal", "biomedical")):
    """The sweep's expert loads over training (``load``: sweep_tables.loads' table, columns arm,
    seed, step, layer, expert, n, share, ``n DOMAIN``): per CSE arm (rows) and layer (columns),
    the smallest expert's share of the layer's sequences in each 50-step window (starvation,
    solid, one line per seed) and, per ``tail`` domain, the share of its sequences that reach
    its most-used expert (dashed) and the domain's share of that expert's sequences (dotted):
    does the tail keep an expert of its own?"""
    plt = _pyplot()
    arms, layers = list(dict.fromkeys(load["arm"])), sorted(load["layer"].astype(str).unique())
    fig, axes = plt.subplots(len(arms), len(layers), figsize=(4.2 * len(layers), 2.6 * len(arms)), squeeze=False,
                             sharex=True, sharey=True)
    colours = {"min": "0.2", **{d: c for d, c in zip(tail, ("tab:red", "tab:green"))}}
    for i, arm in enumerate(arms):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            part = load[(load["arm"] == arm) & (load["layer"].astype(str) == layer)]
            for seed, g in part.groupby("seed"):
                per_step = g.groupby("step")
                ax.plot(per_step["share"].min().index, per_step["share"].min().values, color=colours["min"], lw=1,
                        label="smallest expert's share" if seed == part["seed"].min() else None)
                for d in tail:
                    if f"n {d}" not in g:
                        continue
                    top = per_step[f"n {d}"].max() / per_step[f"n {d}"].sum().clip(lower=1)
                    first = seed == part["seed"].min()
                    ax.plot(top.index, top.values, color=colours[d], lw=1, ls="--",
                            label=f"{d}: share at its top expert" if first else None)
                    at_top = g.loc[g.groupby("step")[f"n {d}"].idxmax()]  # that expert's window, per step
                    purity = at_top[f"n {d}"] / at_top["n"].clip(lower=1)
                    ax.plot(at_top["step"], purity.values, color=colours[d], lw=1, ls=":",
                            label=f"{d}: its share of that expert" if first else None)
            ax.set_title(f"{arm}, layer {layer.split('.')[-2] if '.' in layer else layer}", fontsize=9)
            ax.set_ylim(0, 1.02)
            if i == len(arms) - 1:
                ax.set_xlabel("training step")
    axes[0][0].legend(fontsize=7, loc="center left")
    fig.tight_layout()
    return fig


def routing_shares(routing, *, title: str = ""):
    """Where each domain is routed (``routing``: :func:`cse_models.domains.routing_table`'s rows,
    or ``ntkscope compare``'s routing.csv, the rows of several models with ``arm`` and ``seed``
    columns): one heatmap per sparse layer (columns) and per model (rows, named by arm and seed),
    domains (rows) x experts (columns), each cell the share of the domain's sequences (CSE) or
    tokens (Switch) sent to that expert, with the count."""
    from cse_models.expert_report import layer_label

    plt = _pyplot()
    by = [c for c in ("arm", "seed") if c in routing.columns]
    keys = ["layer", "expert", "domain", *by]
    repeated = int(routing.duplicated(keys).sum())
    if repeated:
        raise fail("routing_shares", "routing", f"must hold one row per ({', '.join(keys)}); the rows of several "
                   "models need arm and seed columns", f"{repeated} repeated rows")
    models = [(_model_name(by, key), rows) for key, rows in routing.groupby(by, sort=False)] if by else [("", routing)]
    layers = list(dict.fromkeys(routing["layer"]))
    domains = sorted(routing["domain"].unique())
    fig, axes = plt.subplots(len(models), len(layers), squeeze=False,
                             figsize=(1.2 + 0.55 * routing["expert"].nunique() * len(layers) + 1.5,
                                      (0.9 + 0.45 * len(domains)) * len(models)))
    for row, (name, model) in zip(axes, models):
        for ax, layer in zip(row, layers):
            part = model[model["layer"] == layer]
            if part.empty:  # this model has no such sparse layer
                ax.axis("off")
                continue
            _routing_panel(ax, part, domains)
            ax.set_title(layer_label(str(layer)), fontsize=8)
        if len(models) > 1:
            row[0].set_ylabel(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _model_name(by: list, key) -> str:
    """The name of one model's rows ("cse, seed 0"): its group ``key`` of a table grouped ``by`` arm and seed."""
    values = dict(zip(by, key if isinstance(key, tuple) else (key,)))
    return ", ".join([str(values["arm"])] * ("arm" in values) + [f"seed {values['seed']}"] * ("seed" in values))


def _routing_panel(ax, part, domains) -> None:
    """One model's one layer: the shares as a heatmap, the counts written in the cells."""
    share = part.pivot(index="domain", columns="expert", values="share_of_domain").reindex(domains)
    count = part.pivot(index="domain", columns="expert", values="count").reindex(domains).fillna(0)
    ax.imshow(share.fillna(0).values, vmin=0, vmax=1, cmap="Blues", aspect="auto")
    for (r, c), value in np.ndenumerate(count.values):
        ax.text(c, r, f"{int(value)}", ha="center", va="center", fontsize=7,
                color="white" if share.values[r, c] > 0.6 else "black")
    ax.set_xticks(range(share.shape[1]), [str(e) for e in share.columns])
    ax.set_yticks(range(len(domains)), domains)
    ax.set_xlabel(f"expert ({part['unit'].iloc[0]})")


def gc_by_label(table, *, title: str = ""):
    """GC of each labelled subset against the whole set (``table``: :func:`ntkscope.gc_by_bins`
    with ``by="label"``, or a :class:`ntkscope.GCTracker` step): |GC| with its interval, over
    the random null band (grey) and the homogeneous one (green) where measured."""
    plt = _pyplot()
    rows = table.reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(6.4, 0.42 * len(rows) + 1.3))
    y = np.arange(len(rows))
    for i, row in rows.iterrows():
        ax.plot([row["null_low"], row["null_high"]], [i, i], color="#95a5a6", lw=7, alpha=0.5, solid_capstyle="butt",
                label="random null band" if i == 0 else None)
        if "null_homogeneous_low" in rows and np.isfinite(row["null_homogeneous_low"]):
            ax.plot([row["null_homogeneous_low"], row["null_homogeneous_high"]], [i + 0.22, i + 0.22], color="#27ae60",
                    lw=3, alpha=0.6, label="homogeneous null band" if i == 0 else None)
    flagged = rows["flags"].fillna("").astype(str) != ""
    err = np.vstack([rows["abs_gc"] - rows["abs_gc_low"], rows["abs_gc_high"] - rows["abs_gc"]]).clip(min=0)
    ax.errorbar(rows["abs_gc"], y, xerr=err, fmt="none", ecolor="#c0392b", capsize=3)
    ax.scatter(rows["abs_gc"][~flagged], y[~flagged], color="#c0392b", zorder=3, label="|GC| and its interval")
    ax.scatter(rows["abs_gc"][flagged], y[flagged], facecolor="white", edgecolor="#c0392b", zorder=3,
               label="flagged: direction ill-defined")
    ax.set_yticks(y, [f"{label} (n={int(m)})" for label, m in zip(rows["label"], rows["n_subset"])])
    ax.set_xlabel("|GC| against the whole set")
    ax.set_xlim(_lowest(rows, ["abs_gc_low", "null_low"]), 1.01)
    ax.set_title(title or "GC of each subset against the whole set", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def training_curve(metrics, *, title: str = ""):
    """Training loss over steps (``metrics``: a run's ``metrics.csv``: step, loss, lr)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot(metrics["step"], metrics["loss"], color="#2c3e50", lw=1.2, label="training loss")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (nats per token)")
    if "lr" in metrics:
        other = ax.twinx()
        other.plot(metrics["step"], metrics["lr"], color="#95a5a6", lw=0.8, ls="--")
        other.set_ylabel("learning rate", color="#7f8c8d")
    ax.set_title(title or "Training", fontsize=10)
    fig.tight_layout()
    return fig


def score_histogram_bars(histogram, *, title: str = ""):
    """The distribution of the sentences' frequency scores from their bins (``histogram``:
    :func:`ntkscope.score_histogram`: left, right, count): each bar's height is its count over
    its width, so equal-count bins (the GC bins) show the density rather than a flat row of
    bars; the bins' edges are marked, with each bin's count above it. A long tail at the low end."""
    plt = _pyplot()
    width = (histogram["right"] - histogram["left"]).to_numpy(dtype=float)
    flat = not (width > 0).all()  # tied scores made a bin of no width: its density is undefined, so counts
    density = histogram["count"].to_numpy(dtype=float) / (1 if flat else histogram["count"].sum() * width)
    if flat:
        width = np.full_like(width, max(np.ptp(histogram[["left", "right"]].to_numpy(dtype=float)), 1e-9)
                             / (2 * len(width)))
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.bar(histogram["left"], density, width=width, align="edge", color="#5d6d7e", edgecolor="white")
    for left, w, d, n in zip(histogram["left"], width, density, histogram["count"]):
        ax.text(left + w / 2, d, f"{int(n)}", ha="center", va="bottom", fontsize=7, color="#333")
    for edge in [*histogram["left"], histogram["right"].iloc[-1]]:
        ax.axvline(edge, color="#c0392b", lw=0.6, ls=":")
    ax.set_xlabel("sentence frequency score (dotted: the bins' edges; above a bar: its sentences)")
    ax.set_ylabel("sentences (a bin has no width: tied scores)" if flat else "density")
    ax.set_title(title or "Sentence frequency", fontsize=10)
    fig.tight_layout()
    return fig
