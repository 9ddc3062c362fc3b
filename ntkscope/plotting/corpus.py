"""Figures of the corpus and a run: the largest categories (Figure 1(a)), the sentences' frequency
scores, perplexity against them (Figure 1(b)) and the training curve."""

from __future__ import annotations

import numpy as np

from ntkscope.plotting.base import DOMAIN_COLOURS, pyplot


def domain_sizes(table, *, top: int = 20):
    """Figure 1(a). ``table``: :func:`ntkscope.domain_table` (domain, source, category, percent)."""
    plt = pyplot()
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


def score_histogram_bars(histogram, *, title: str = ""):
    """The distribution of the sentences' frequency scores from their bins (``histogram``:
    :func:`ntkscope.score_histogram`: left, right, count): each bar's height is its count over
    its width, so equal-count bins (the GC bins) show the density rather than a flat row of
    bars; the bins' edges are marked, with each bin's count above it. A long tail at the low end."""
    plt = pyplot()
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


def perplexity_vs_frequency(sentences, by_bin, *, title: str = ""):
    """Figure 1(b). ``sentences``: per sentence (domain, score, perplexity); ``by_bin``: left,
    right, n, median_perplexity. Points per sentence (log scale), the binned median as a line."""
    plt = pyplot()
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


def training_curve(metrics, *, title: str = ""):
    """Training loss over steps (``metrics``: a run's ``metrics.csv``: step, loss, lr)."""
    plt = pyplot()
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
