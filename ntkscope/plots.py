"""Figures of the analyses, with matplotlib (Agg): GC against frequency with the histogram
(the CSE paper's Figure 2(a)), GC over training steps (Figure 3(a)), NTK heatmaps
(Figure 5(b, c)). Each writes a PNG under a temporary name and renames it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def gc_vs_frequency(table, histogram, path, title: str = "") -> Path:
    """Bars: % of sentences per frequency bin; line: GC of each bin (table: left, right, gc)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    centres = (histogram["left"] + histogram["right"]) / 2
    width = float((histogram["right"] - histogram["left"]).iloc[0]) * 0.9
    ax.bar(centres, histogram["percent"], width=width, color="#c9d6ea", label="% of sentences")
    ax.set_xlabel("sentence frequency score")
    ax.set_ylabel("% of sentences")
    ax2 = ax.twinx()
    ax2.plot((table["left"] + table["right"]) / 2, table["gc"], "o-", color="#c0392b", label="GC")
    ax2.set_ylabel("gradient consistency")
    ax2.set_ylim(min(-0.05, float(table["gc"].min()) - 0.05), 1.05)
    ax.set_title(title or "GC against sentence frequency")
    fig.legend(loc="lower right", bbox_to_anchor=(0.88, 0.15))
    out = _save(fig, path)
    plt.close(fig)
    return out


def gc_over_steps(frame, path, title: str = "") -> Path:
    """GC of the long-tail subset against the whole set at each checkpoint (frame: step, gc)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.plot(frame["step"], frame["gc"], "o-", color="#2c3e50")
    peak = frame.loc[frame["gc"].idxmax()]
    ax.axvline(peak["step"], color="#c0392b", ls="--", lw=1, label=f"peak at step {int(peak['step'])}")
    ax.set_xlabel("training step")
    ax.set_ylabel("GC of the long tail")
    ax.set_title(title or "GC of the long-tail subset over training")
    ax.legend()
    out = _save(fig, path)
    plt.close(fig)
    return out


def ntk_heatmap(matrix, labels, path, title: str = "") -> Path:
    """The kernel with samples ordered by label (stable), label boundaries marked."""
    plt = _figure()
    labels = np.asarray(labels).astype(str)
    order = np.argsort(labels, kind="stable")
    fig, ax = plt.subplots(figsize=(5, 4.4))
    image = ax.imshow(np.asarray(matrix)[np.ix_(order, order)], cmap="viridis")
    fig.colorbar(image, ax=ax, shrink=0.8)
    sorted_labels = labels[order]
    edges = [i for i in range(1, len(order)) if sorted_labels[i] != sorted_labels[i - 1]]
    for e in edges:
        ax.axhline(e - 0.5, color="white", lw=0.8)
        ax.axvline(e - 0.5, color="white", lw=0.8)
    starts = [0, *edges]
    ends = [*edges, len(order)]
    ax.set_xticks([(a + b - 1) / 2 for a, b in zip(starts, ends)])
    ax.set_xticklabels([sorted_labels[a] for a in starts], rotation=45, ha="right", fontsize=8)
    ax.set_yticks([])
    ax.set_title(title or "empirical NTK, samples ordered by label")
    out = _save(fig, path)
    plt.close(fig)
    return out
