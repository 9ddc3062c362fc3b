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

from pathlib import Path

import numpy as np

from ntkscope.core.files import atomic_path
from ntkscope.kernel.ntk import cosine_kernel

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


def _gc_panel(ax, table, histogram):
    """Bars: % of sentences per bin; |GC| per bin with its interval against the null band;
    mean-gradient consistency with its interval. Hollow markers: a flagged direction."""
    centres = (histogram["left"] + histogram["right"]) / 2
    ax.bar(centres, histogram["percent"], width=(histogram["right"] - histogram["left"]) * 0.95, color="#e3e9f3",
           label="% of sentences")
    ax.set_ylabel("% of sentences")
    ax2 = ax.twinx()
    ax.set_zorder(ax2.get_zorder() - 1)
    ax.patch.set_visible(False)
    x = ((table["left"] + table["right"]) / 2).to_numpy()
    if table["null_high"].notna().any():
        ax2.bar(x, table["null_high"] - table["null_low"], bottom=table["null_low"],
                width=(table["right"] - table["left"]) * 0.95, color="#95a5a6", alpha=0.35,
                label="null: |GC| of random subsets")
    y = table["abs_gc"].to_numpy()
    err = [y - table["abs_gc_low"].fillna(table["abs_gc"]), table["abs_gc_high"].fillna(table["abs_gc"]) - y]
    ax2.errorbar(x, y, yerr=err, fmt="-", color="#c0392b", capsize=3, lw=1.2, label="|GC| of the bin, interval")
    flagged = _flagged(table).to_numpy()
    ax2.scatter(x[~flagged], y[~flagged], color="#c0392b", zorder=3, label="direction well defined")
    ax2.scatter(x[flagged], y[flagged], facecolor="white", edgecolor="#c0392b", zorder=3,
                label="direction flagged (eigengap, cos(u,1) or sign)")
    m = table["mean_gradient"].to_numpy()
    merr = [m - table["mean_gradient_low"].fillna(table["mean_gradient"]),
            table["mean_gradient_high"].fillna(table["mean_gradient"]) - m]
    ax2.errorbar(x, m, yerr=merr, fmt="^--", color="#2c3e50", ms=5, capsize=2, lw=1,
                 label="mean-gradient consistency")
    ax2.set_ylabel("consistency with the whole set")
    ax2.set_ylim(_lowest(table, ["abs_gc", "mean_gradient", "null_low"]), 1.02)
    ax.set_xlabel("sentence frequency score (mean count/max count of its tokens)")
    return ax2


def gc_vs_frequency(table, histogram, *, title: str = ""):
    """Figure 2(a). Per frequency bin (``table``: a :func:`ntkscope.gc_by_bins` table; with an
    ``output`` column, one panel per output): |GC| with its bootstrap interval over the shaded
    null band of random subsets of the bin's size, and the mean-gradient consistency; bars:
    % of sentences per bin (``histogram``: :func:`ntkscope.score_histogram`, the same bins)."""
    plt = _pyplot()
    outputs = list(dict.fromkeys(table["output"])) if "output" in table else [None]
    fig, axes = plt.subplots(1, len(outputs), figsize=(6.4 * len(outputs), 4.2), squeeze=False)
    for ax, name in zip(axes[0], outputs):
        ax2 = _gc_panel(ax, table if name is None else table[table["output"] == name], histogram)
        ax.set_title(f"output: {name}" if name else "")
    fig.suptitle(title or "GC against sentence frequency")
    handles = [h for a in (axes[0][0], ax2) for h in a.get_legend_handles_labels()[0]]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=3, fontsize=7,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def gc_over_steps(frame, *, warmup: int | None = None, rule: str = "", title: str = ""):
    """Figure 3(a). ``frame``: a :func:`ntkscope.gc_series` table. |GC| of the long tail with its
    interval (band) over the null band; filled markers where the signed GC is confident (its
    value is printed beside), hollow where the direction is flagged; the mean-gradient
    consistency; the plan's warm-up (``warmup``, chosen by ``rule``) as a dashed line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 3.8))
    steps = frame["step"].to_numpy()
    if frame["null_high"].notna().any():
        ax.fill_between(steps, frame["null_low"], frame["null_high"], color="#95a5a6", alpha=0.3,
                        label="null: |GC| of random subsets")
    if frame["abs_gc_low"].notna().any():
        ax.fill_between(steps, frame["abs_gc_low"], frame["abs_gc_high"], color="#e6b0aa", alpha=0.6,
                        label="|GC| interval")
    ax.plot(steps, frame["abs_gc"], "-", color="#c0392b", lw=1.2, label="|GC| of the long tail")
    flagged = _flagged(frame).to_numpy()
    ax.scatter(steps[~flagged], frame["abs_gc"][~flagged], color="#c0392b", zorder=3, s=18,
               label="direction well defined")
    ax.scatter(steps[flagged], frame["abs_gc"][flagged], facecolor="white", edgecolor="#c0392b", zorder=3, s=18,
               label="direction flagged")
    ax.plot(steps, frame["mean_gradient"], "^--", color="#2c3e50", ms=3, lw=1, label="mean-gradient consistency")
    if warmup is not None:
        ax.axvline(warmup, color="#7d3c98", ls="--", lw=1, label=f"warm-up: step {warmup}" + (f" ({rule})" if rule
                                                                                              else ""))
    ax.set_xlabel("training step")
    ax.set_ylabel("consistency with the whole set")
    ax.set_ylim(_lowest(frame, ["abs_gc", "mean_gradient", "null_low"]), 1.02)
    ax.set_title(title or "GC of the long-tail subset over training")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def layer_dynamics(table, router=None):
    """Figure 3(b, c), one line per layer over training steps. ``table``: :func:`ntkscope.cluster_dynamics`
    (the paper's elbow K beside the silhouette K, which is 1 when no K reaches a silhouette of
    0.25; the best silhouette; the inter-cluster distance). ``router``: :func:`ntkscope.router_dynamics`
    with domains (the router's clusters, the pure tail clusters, the tail share in them, and the
    tail domains' kNN lift), drawn as a second row when given."""
    plt = _pyplot()
    rows_n = 2 if router is not None else 1
    fig, axes = plt.subplots(rows_n, 3, figsize=(13, 3.4 * rows_n), squeeze=False)
    for layer, rows in table.groupby("layer"):
        line, = axes[0, 0].plot(rows["step"], rows["k_silhouette"], "o-", ms=3, label=f"layer {layer}")
        axes[0, 0].plot(rows["step"], rows["k"], ":", color=line.get_color(), lw=1)
        axes[0, 1].plot(rows["step"], rows["silhouette"], "o-", ms=3, label=f"layer {layer}")
        axes[0, 2].plot(rows["step"], rows["inter_distance"], "o-", ms=3, label=f"layer {layer}")
    axes[0, 1].axhline(0.25, color="grey", lw=0.8, ls="--")
    panels = [(axes[0, 0], "K (solid: silhouette, 1 = none; dotted: elbow)", "(b) number of clusters"),
              (axes[0, 1], "best mean silhouette (K-Means)", "(b') silhouette; < 0.25: no structure"),
              (axes[0, 2], "inter-cluster distance (projected space)", "(c) distance between elbow centres")]
    if router is not None:
        tail = [c.split(" ", 1)[1] for c in router.columns if c.startswith("tail_share ")]
        for layer, rows in router.groupby("layer"):
            line, = axes[1, 0].plot(rows["step"], rows["n_clusters"], "o-", ms=3, label=f"layer {layer}")
            axes[1, 0].plot(rows["step"], rows["n_pure_tail"], "s--", ms=3, color=line.get_color(), lw=1)
            axes[1, 1].plot(rows["step"], rows["tail_share"], "o-", ms=3, label=f"layer {layer}")
            lift = rows[[f"knn_lift {d}" for d in tail]].mean(axis=1) if tail else rows["n_clusters"] * np.nan
            axes[1, 2].plot(rows["step"], lift, "o-", ms=3, label=f"layer {layer}")
        axes[1, 2].axhline(1.0, color="grey", lw=0.8, ls="--")
        panels += [(axes[1, 0], "clusters (solid); pure tail clusters (dashed)", "router's clusters"),
                   (axes[1, 1], "tail share in pure clusters of their domain", "the long tail in its own clusters"),
                   (axes[1, 2], f"kNN lift, mean of {', '.join(tail) or 'tail'} (1 = chance)",
                    "separability of the tail (routing space)")]
    for ax, ylabel, title in panels:
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0, 2].legend(fontsize=8)
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
    """Figure 4(a): the CSE layer (docs/design.md §4), drawn: sequence embedding, projection M,
    nearest scaled cluster centre, the chosen expert (a copy of the warmed-up FFN)."""
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
    box(2.1, 2.7, 1.7, 0.9, "sequence embedding\nv = mean over\nreal tokens")
    box(4.3, 2.7, 1.6, 0.9, "v' = M v\nM: d' x d random\nprojection")
    box(6.4, 2.7, 1.8, 0.9, "expert j = argmin\n||v' - c_j|| / r_j\n(DBSCAN centres)")
    arrow((1.6, 2.45), (2.1, 3.1))
    arrow((3.8, 3.15), (4.3, 3.15))
    arrow((5.9, 3.15), (6.4, 3.15))
    colours = ["#c9d6ea", "#f5cba7", "#d5f5e3"]
    for j, y in enumerate((0.2, 0.95, 1.7)):
        box(6.6, y, 1.4, 0.55, f"FFN expert {j}", colours[j])
    ax.text(7.3, 2.45, "...", ha="center", fontsize=10)
    arrow((1.6, 1.9), (6.6, 0.48), connectionstyle="arc3,rad=0.1")
    arrow((7.3, 2.7), (7.3, 2.25))
    box(8.6, 0.9, 1.3, 0.9, "output\n(B, T, d)")
    for y in (0.48, 1.22, 1.97):
        arrow((8.0, y), (8.6, 1.35))
    ax.text(5.0, 0.2, "after each step: c_j <- a c_j + (1 - a) v'  (no router parameters)", ha="center",
            fontsize=7.5, style="italic")
    ax.set_title("The CSE layer: each sequence goes to the expert of its nearest cluster", fontsize=10)
    return fig


def expert_kernels(kernels: dict, summary, *, normalise: bool = True):
    """Figure 5(b, c). ``kernels``: {"expert E": (n_E, n_E), "index E": rows of the batch,
    "dense": (n, n)}; ``summary``: expert, n, cse_expert_cosine, dense_cosine. Left: each
    expert's kernel on its own sentences; right: the dense model's kernel on the whole
    batch, ordered by expert. ``normalise``: plot Θ_ij / sqrt(Θ_ii Θ_jj) (cosine)."""
    plt = _pyplot()

    def prep(k):
        return cosine_kernel(k) if normalise else np.asarray(k, dtype=np.float64)

    experts = sorted(int(name.split()[1]) for name in kernels if name.startswith("expert "))
    fig = plt.figure(figsize=(10, 4.2))
    grid = fig.add_gridspec(len(experts), 2, width_ratios=[1, 2.2])
    vmin, vmax = (-1, 1) if normalise else (None, None)
    stats = summary.set_index(summary["expert"].astype(str))
    for row, e in enumerate(experts):
        ax = fig.add_subplot(grid[row, 0])
        ax.imshow(prep(kernels[f"expert {e}"]), cmap="RdBu_r", vmin=vmin, vmax=vmax)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"expert {e}\nn={len(kernels[f'index {e}'])}", fontsize=7)
        if row == 0:
            ax.set_title("(b) each CSE expert's NTK\non its own sentences", fontsize=8)
    order = np.concatenate([np.asarray(kernels[f"index {e}"]) for e in experts])
    ax = fig.add_subplot(grid[:, 1])
    image = ax.imshow(prep(kernels["dense"])[np.ix_(order, order)], cmap="RdBu_r", vmin=vmin, vmax=vmax)
    edges = np.cumsum([len(kernels[f"index {e}"]) for e in experts])[:-1]
    for x in edges:
        ax.axhline(x - 0.5, color="black", lw=0.6)
        ax.axvline(x - 0.5, color="black", lw=0.6)
    ax.set_xlabel("sentences, ordered by CSE expert")
    ax.set_yticks([])
    within = ", ".join(f"e{e}: {stats.loc[str(e), 'cse_expert_cosine']:.2f} vs {stats.loc[str(e), 'dense_cosine']:.2f}"
                       for e in experts if str(e) in stats.index)
    ax.set_title(f"(c) dense baseline's NTK (same layer's FFN)\nmean cosine within expert, CSE vs dense: {within}",
                 fontsize=8)
    fig.colorbar(image, ax=ax, shrink=0.8, label="Θ_ij / sqrt(Θ_ii Θ_jj)" if normalise else "Θ(x_i, x_j)")
    return fig
