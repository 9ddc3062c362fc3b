"""Figures of gradient consistency: per frequency bin (Figure 2(a)), per label, over training
(Figure 3(a)), per layer, and in-run against each step's batch."""

from __future__ import annotations

import numpy as np

from ntkscope.plotting.base import NULLS, band_columns, flagged_rows, layer_name, lowest, pyplot
from ntkscope.representation.plan import excess_series


def _gc_panel(ax, strip, table, histogram):
    """One output: per bin, each null band as a box (random, homogeneous), |GC| with its
    interval and the mean-gradient consistency with its interval, side by side; hollow markers:
    a flagged direction. ``strip``: a thin axis below with the share of sentences per bin."""
    x = np.arange(len(table))
    width = 0.16
    for k, (name, label, colour) in enumerate(NULLS):
        low, _, high = band_columns(name)
        if low in table and table[low].notna().any():
            ax.bar(x - 0.3 + k * width, table[high] - table[low], bottom=table[low], width=width, color=colour,
                   alpha=0.45, label=f"null: |GC| of {label}")
    y = table["abs_gc"].to_numpy()
    err = [y - table["abs_gc_low"].fillna(table["abs_gc"]), table["abs_gc_high"].fillna(table["abs_gc"]) - y]
    ax.errorbar(x + 0.05, y, yerr=err, fmt="none", ecolor="#c0392b", capsize=3, lw=1.2)
    flagged = flagged_rows(table).to_numpy()
    ax.scatter(x[~flagged] + 0.05, y[~flagged], color="#c0392b", zorder=3, s=22, label="|GC| of the bin, interval")
    ax.scatter(x[flagged] + 0.05, y[flagged], facecolor="white", edgecolor="#c0392b", zorder=3, s=22,
               label="|GC|, direction flagged")
    m = table["mean_gradient"].to_numpy()
    merr = [m - table["mean_gradient_low"].fillna(table["mean_gradient"]),
            table["mean_gradient_high"].fillna(table["mean_gradient"]) - m]
    ax.errorbar(x + 0.25, m, yerr=merr, fmt="^", color="#2c3e50", ms=4, capsize=2, lw=1,
                label="mean-gradient consistency")
    ax.set_ylabel("consistency with the whole set")
    columns = ["abs_gc_low", "mean_gradient_low"] + [band_columns(n)[0] for n, _, _ in NULLS]
    ax.set_ylim(lowest(table, [c for c in columns if c in table]), 1.01)
    ax.set_xticks(x, [f"bin {k}" for k in x], fontsize=7)
    strip.bar(x, histogram["percent"].to_numpy()[: len(x)], width=0.6, color="#b8c5d9")
    strip.set_ylabel("%", fontsize=7)
    strip.set_xticks(x, [f"{lo:.2f}-{hi:.2f}" for lo, hi in zip(table["left"], table["right"])], fontsize=7)
    strip.tick_params(axis="y", labelsize=6)
    strip.set_xlabel("frequency score bin (rarest left); strip: % of sentences per bin")


def gc_vs_frequency(table, histogram, *, title: str = "", chosen: str | None = None):
    """Figure 2(a). Per frequency bin (``table``: a :func:`ntkscope.gc_by_group` table; with an
    ``output`` column, one panel per output, ``chosen`` marked as the one the text reads): |GC|
    with its finite-n interval beside the null bands of random and of homogeneous subsets of
    the bin's size, and the mean-gradient consistency; a strip below: % of sentences per bin
    (``histogram``: :func:`ntkscope.score_histogram`, the same bins)."""
    plt = pyplot()
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


def gc_by_label(table, *, title: str = ""):
    """GC of each labelled subset against the whole set (``table``: :func:`ntkscope.gc_by_group`
    with ``by="label"``, or a :class:`ntkscope.GCTracker` step): |GC| with its interval, over
    the random null band (grey) and the homogeneous one (green) where measured."""
    plt = pyplot()
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
    ax.set_xlim(lowest(rows, ["abs_gc_low", "null_low"]), 1.01)
    ax.set_title(title or "GC of each subset against the whole set", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def gc_per_layer(frame, *, title: str = ""):
    """|GC| of each subset over training, one panel per subset (``label``) and one line per layer
    (``frame``: a tracker's per-layer rows: step, label, layer, abs_gc)."""
    plt = pyplot()
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
    plt = pyplot()
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

    plt = pyplot()
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
    top.set_ylim(lowest(frame, ["abs_gc", "null_low"]), 1.01)
    top.legend(fontsize=7, loc="lower right")
    series = excess_series(frame)
    steps = series["step"].to_numpy()
    mean = frame.groupby("step")
    for name, label, colour in NULLS:
        low, median, high = band_columns(name)
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
