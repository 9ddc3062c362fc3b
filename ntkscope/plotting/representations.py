"""Figures of representations: cluster dynamics per layer (Figure 3(b, c)), a 2-D view coloured by
cluster or expert (Figures 2(b), 4(b), 5(a)) and a kernel ordered by label."""

from __future__ import annotations

import numpy as np

from ntkscope.plotting.base import pyplot


def layer_dynamics(table, router=None):
    """Figure 3(b, c), one line per layer over training steps. ``table``: :func:`ntkscope.cluster_dynamics`
    (the paper's elbow K, dotted, beside the silhouette K, which is 1 when no K reaches a
    silhouette of 0.25; the best silhouette; the inter-cluster distance, and the same distance
    over the mean cluster radius). ``router``: :func:`ntkscope.router_dynamics` with domains (the
    router's clusters, the pure tail clusters, the tail share in them, and the tail domains' kNN
    lift), drawn as a second row when given. K is an integer: integer ticks, the layers' lines
    nudged apart so that equal values do not hide each other."""
    from matplotlib.ticker import MaxNLocator  # matplotlib on the first figure

    plt = pyplot()
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
    plt = pyplot()
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
    plt = pyplot()
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
