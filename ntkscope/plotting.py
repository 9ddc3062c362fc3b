"""Figures of the analyses (the CSE paper's Figures 1-5, DESIGN §5). Every function takes
tables that the library returns and gives back a matplotlib Figure; :func:`save_figure`
writes it (PNG, and PDF on request) under a temporary name and renames it.

- :func:`domain_sizes` — Figure 1(a): the largest categories of the corpus, a long tail.
- :func:`gc_vs_frequency` — Figure 2(a): GC per frequency bin over the histogram of sentences.
- :func:`gc_over_steps` — Figure 3(a): GC of the long tail over training.
- :func:`layer_dynamics` — Figure 3(b, c): elbow K and inter-cluster distance per layer over steps.
- :func:`cluster_view` — Figures 2(b), 4(b), 5(a): a 2-D view coloured by cluster or expert.
- :func:`ntk_heatmap` — Figure 5(b, c): a kernel with its samples ordered by label.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

DOMAIN_COLOURS = {"general": "#7f8c8d", "legal": "#c0392b", "biomedical": "#2e86c1"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, *, formats=("png",), close: bool = True) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix in ``formats``, atomically; returns the paths."""
    path = Path(path)
    out = []
    for fmt in formats:
        target = path.with_suffix(f".{fmt}")
        tmp = target.with_name(f".{target.stem}.tmp-{os.getpid()}.{fmt}")
        fig.savefig(tmp, dpi=130, bbox_inches="tight")
        os.replace(tmp, target)
        out.append(target)
    if close:
        _plt().close(fig)
    return out


def domain_sizes(table, *, top: int = 20):
    """Figure 1(a). ``table``: :func:`ntkscope.domain_table` (domain, source, category, percent)."""
    plt = _plt()
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


def gc_vs_frequency(table, histogram, *, title: str = ""):
    """Figure 2(a). Bars: % of sentences per frequency bin; line: GC of each bin
    (``table``: left, right, gc; ``histogram``: :func:`ntkscope.score_histogram`)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    centres = (histogram["left"] + histogram["right"]) / 2
    width = float((histogram["right"] - histogram["left"]).iloc[0]) * 0.9
    ax.bar(centres, histogram["percent"], width=width, color="#c9d6ea", label="% of sentences")
    ax.set_xlabel("sentence frequency score (mean count/max count of its tokens)")
    ax.set_ylabel("% of sentences")
    ax2 = ax.twinx()
    ax2.plot((table["left"] + table["right"]) / 2, table["gc"], "o-", color="#c0392b", label="GC")
    ax2.set_ylabel("gradient consistency")
    ax2.set_ylim(min(-0.05, float(table["gc"].min()) - 0.05), 1.05)
    ax.set_title(title or "GC against sentence frequency")
    fig.legend(loc="lower right", bbox_to_anchor=(0.88, 0.15))
    return fig


def gc_over_steps(frame, *, title: str = ""):
    """Figure 3(a). ``frame``: :func:`ntkscope.gc_series` (step, gc)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(frame["step"], frame["gc"], "o-", color="#2c3e50", label="GC of the long tail")
    peak = frame.loc[frame["gc"].idxmax()]
    ax.axvline(peak["step"], color="#c0392b", ls="--", lw=1, label=f"peak at step {int(peak['step'])}")
    ax.set_xlabel("training step")
    ax.set_ylabel("gradient consistency")
    ax.set_title(title or "GC of the long-tail subset over training")
    ax.legend()
    return fig


def layer_dynamics(table):
    """Figure 3(b, c). ``table``: :func:`ntkscope.cluster_dynamics` (step, layer, k, inter_distance)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for layer, rows in table.groupby("layer"):
        axes[0].plot(rows["step"], rows["k"], "o-", ms=3, label=f"layer {layer}")
        axes[1].plot(rows["step"], rows["inter_distance"], "o-", ms=3, label=f"layer {layer}")
    axes[0].set_ylabel("elbow K")
    axes[1].set_ylabel("inter-cluster distance (projected space)")
    for ax, title in zip(axes, ("(b) number of clusters", "(c) distance between cluster centres")):
        ax.set_xlabel("training step")
        ax.set_title(title)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def cluster_view(points, *, colour_by: str = "cluster", title: str = ""):
    """Figures 2(b), 4(b), 5(a): a 2-D view (``points``: x, y, and ``colour_by``; one panel per
    ``step`` when there is a step column), each group annotated with its domain make-up."""
    plt = _plt()
    steps = sorted(points["step"].unique()) if "step" in points else [None]
    fig, axes = plt.subplots(1, len(steps), figsize=(4.2 * len(steps), 3.8), squeeze=False)
    for ax, step in zip(axes[0], steps):
        rows = points if step is None else points[points["step"] == step]
        for group, g in rows.groupby(colour_by):
            label = f"{colour_by} {group} (n={len(g)})"
            if "domain" in g:
                shares = g["domain"].value_counts(normalize=True)
                label += ": " + ", ".join(f"{d[:3]} {p:.0%}" for d, p in shares.items())
            ax.scatter(g["x"], g["y"], s=8, alpha=0.7, label=label)
        ax.set_xlabel("component 1")
        ax.set_ylabel("component 2")
        ax.set_title(title or (f"step {step}" if step is not None else "embedding space"))
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    return fig


def ntk_heatmap(matrix, labels, *, title: str = ""):
    """Figure 5(b, c): the kernel with samples ordered by label (stable), boundaries marked."""
    plt = _plt()
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
