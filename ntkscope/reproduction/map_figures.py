"""The warm-up map's figures (docs/warmup-map.md), from
:func:`ntkscope.reproduction.map_tables.gains` tables and the plans' structure evidence:

- :func:`map_controls`: every arm at one conversion step, one point per seed;
- :func:`map_curve`: tail gain against conversion step per arm, with the label-free structure
  measure on the same step axis and each trunk's rule step marked.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ntkscope.plotting.base import pyplot


def map_controls(gains, *, step: int = 1200, title: str = ""):
    """The warm-up map's arms at one conversion step: each arm's paired tail gain over its trunk
    (log-perplexity, legal and biomedical averaged; negative is better), one point per seed with
    its block-bootstrap interval, and the null arm's seeds as a grey band. ``gains``: a
    :func:`ntkscope.reproduction.map_tables.gains` table."""
    plt = pyplot()
    tail = gains[(gains["domain"] == "tail") & (gains["step"] == step)]
    null = tail[tail["arm"] == "dense-null"]["gain"]
    arms = sorted(set(tail["arm"]), key=lambda a: tail.loc[tail["arm"] == a, "gain"].mean())
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(arms) + 1.4))
    if len(null):
        ax.axvspan(null.min(), null.max(), color="0.85", label=f"dense-null ({len(null)} seeds)")
    ax.axvline(0, color="0.4", lw=0.8)
    for y, arm in enumerate(arms):
        part = tail[tail["arm"] == arm].sort_values("seed")
        offsets = np.linspace(-0.18, 0.18, max(len(part), 1))
        ax.errorbar(part["gain"], y + offsets[:len(part)], xerr=[part["gain"] - part["low"], part["high"] - part["gain"]],
                    fmt="o", ms=4, lw=1, capsize=2)
    ax.set_yticks(range(len(arms)), [f"{a} ({int((tail['arm'] == a).sum())})" for a in arms])
    ax.set_xlabel("tail gain over the trunk: Δ log perplexity (legal, biomedical); < 0 is better")
    ax.set_title(title or f"converted at step {step}: one point per seed, 90 % block-bootstrap intervals", fontsize=9)
    if len(null):
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def map_curve(gains: pd.DataFrame, structure: pd.DataFrame | None = None, rule_steps: dict | None = None,
              *, title: str = "", total_steps: int = 2400):
    """Tail gain (Δ log perplexity over the trunk, legal and biomedical averaged) against the
    conversion step for each arm mapped at several steps: the mean over seeds as a line, each
    seed as a dot; the null arm's spread at its step as a grey band. ``structure``: columns
    step, seed, structure (one trunk's consensus structure, averaged over the sparse layers),
    drawn on a second axis over the same steps (mean over trunks, their range shaded).
    ``rule_steps``: {seed: step} where the rule chose, marked on the step axis."""
    plt = pyplot()
    tail = gains[gains["domain"] == "tail"]
    mapped = [a for a, part in tail.groupby("arm") if part["step"].nunique() > 1]
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    null = tail[tail["arm"] == "dense-null"]["gain"]
    if len(null):
        ax.axhspan(null.min(), null.max(), color="0.88", label=f"dense-null spread ({len(null)} seeds)")
    ax.axhline(0, color="0.4", lw=0.8)
    for arm in sorted(mapped, key=lambda a: tail.loc[tail["arm"] == a, "gain"].mean()):
        part = tail[tail["arm"] == arm]
        mean = part.groupby("step")["gain"].mean()
        line, = ax.plot(mean.index, mean.to_numpy(), "-o", ms=4, lw=1.5, label=f"{arm} (mean over seeds)")
        ax.scatter(part["step"], part["gain"], s=10, alpha=0.45, color=line.get_color())
    if rule_steps:
        for seed, step in sorted(rule_steps.items()):
            ax.axvline(step, color="0.3", lw=0.6, ls=":")
        ax.plot([], [], color="0.3", lw=0.6, ls=":", label="a trunk's rule step")
    ax.set_xlabel(f"conversion step (of {total_steps})")
    ax.set_ylabel("tail gain over the trunk (Δ log ppl); < 0 is better")
    if structure is not None and len(structure):
        right = ax.twinx()
        by_step = structure.groupby("step")["structure"]
        right.fill_between(by_step.min().index, by_step.min(), by_step.max(), color="tab:purple", alpha=0.12)
        right.plot(by_step.mean().index, by_step.mean(), color="tab:purple", lw=1.2, ls="--")
        right.set_ylabel("consensus structure (share of blocks)", color="tab:purple")
        right.set_ylim(bottom=0)
        ax.plot([], [], color="tab:purple", lw=1.2, ls="--", label="structure, mean over trunks (range shaded)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_title(title or "the warm-up map: gain against conversion step, and the structure the rule reads",
                 fontsize=9)
    fig.tight_layout()
    return fig


def trunk_curves(curves: pd.DataFrame, *, arm: str = "dense", best_steps=(), title: str = ""):
    """Each domain's validation loss over a trunk's training (``curves``: a
    :func:`ntkscope.reproduction.sweep_tables.curves` table; the rows of ``arm``), as the drop
    from the first logged step so that the domains share one axis: the mean over seeds as a
    line, their range shaded, with the learning rate on a second axis and ``best_steps`` (the
    map's best conversion steps) marked."""
    plt = pyplot()
    part = curves[curves["arm"] == arm]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for domain in [d for d in ("general", "legal", "biomedical") if d in set(part["domain"])]:
        rows = part[part["domain"] == domain].pivot_table(index="step", columns="seed", values="loss")
        drop = rows - rows.iloc[0]
        line, = ax.plot(drop.index, drop.mean(axis=1), lw=1.5, label=f"{domain} ({rows.shape[1]} trunks)")
        ax.fill_between(drop.index, drop.min(axis=1), drop.max(axis=1), color=line.get_color(), alpha=0.15)
    for step in sorted(set(best_steps)):
        ax.axvline(step, color="0.3", lw=0.6, ls=":")
    if len(best_steps):
        ax.plot([], [], color="0.3", lw=0.6, ls=":", label="a trunk's best conversion step (the map)")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss minus its value at the first logged step")
    lr = part.groupby("step")["lr"].first()
    right = ax.twinx()
    right.plot(lr.index, lr.to_numpy(), color="0.5", lw=0.8, ls="--")
    right.set_ylabel("learning rate (dashed)", color="0.4")
    right.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper right")
    steps = sorted(set(part["step"]))
    every = f", every {steps[1] - steps[0]} steps" if len(steps) > 1 else ""
    ax.set_title(title or f"the trunks' validation loss by domain{every}", fontsize=9)
    fig.tight_layout()
    return fig
