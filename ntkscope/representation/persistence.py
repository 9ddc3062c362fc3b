"""Do the router's small clusters persist? The warm-up rule from CSE's own precondition.

Algorithm 1 of the CSE paper fixes the cluster structure after the dense warm-up: each
expert keeps the sequences of the cluster it was built from. That is safe only when the
small (long-tail) clusters are stable, so the warm-up should end at the earliest checkpoint
from which they persist. Here a cluster's *best match* at a later checkpoint is the cluster
there (noise excluded) with the largest member overlap, measured by the Jaccard index of the
two member sets (the same analysis sequences are embedded at every checkpoint). Splits and
merges of the largest cluster are ignored: only the non-largest clusters are tested.

- :func:`cluster_persistence`: per checkpoint and cluster, its size and best-match Jaccard at
  each of the next ``horizon`` checkpoints.
- :func:`persistence_summary`: per checkpoint, the small clusters, their share of the
  sequences, and the share of small-cluster members whose cluster persists.
- :func:`persistent_step`: the rule: the earliest checkpoint at which, at every chosen
  layer, there is a small cluster and at least ``min_persisting`` of the small-cluster
  members sit in clusters that persist.

Shapes: ``labels`` maps step -> (n,) integer labels, -1 noise, the same n sequences in the
same order at every step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ntkscope.core.checks import entry, fail

SUMMARY_COLUMNS = ["step", "n_clusters", "n_small", "small_share", "persisting_share", "min_jaccard"]


def _members(labels: np.ndarray) -> dict[int, np.ndarray]:
    return {int(c): np.flatnonzero(labels == c) for c in np.unique(labels) if c >= 0}


def _best_jaccard(members: np.ndarray, later: dict[int, np.ndarray]) -> float:
    """The largest Jaccard index of ``members`` with any cluster of ``later`` (0 when none)."""
    best = 0.0
    for other in later.values():
        inter = np.intersect1d(members, other, assume_unique=True).size
        if inter:
            best = max(best, inter / (members.size + other.size - inter))
    return best


@entry("cluster_persistence")
def cluster_persistence(labels: dict, *, horizon: int = 2, threshold: float = 0.5) -> pd.DataFrame:
    """Per (step, cluster): step, cluster, size, small (not the largest), jaccard_1 ..
    jaccard_h (best-match Jaccard at the next 1 .. ``horizon`` checkpoints; NaN past the last),
    and persists (every available jaccard >= ``threshold`` and all ``horizon`` available).

    labels: {step: (n,) int labels, -1 noise}; every array the same length (same sequences)."""
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
        raise fail("cluster_persistence", "horizon", "must be a positive integer", horizon)
    if not 0 < threshold <= 1:
        raise fail("cluster_persistence", "threshold", "must be in (0, 1]", threshold)
    steps = sorted(labels)
    arrays = {s: np.asarray(labels[s]).ravel() for s in steps}
    sizes = {len(a) for a in arrays.values()}
    if len(sizes) > 1:
        raise fail("cluster_persistence", "labels", "must label the same sequences at every step (one length)",
                   {s: len(a) for s, a in arrays.items()})
    members = {s: _members(arrays[s]) for s in steps}
    rows = []
    for i, step in enumerate(steps):
        found = members[step]
        largest = max(found, key=lambda c: (found[c].size, -c)) if found else None
        for c, m in sorted(found.items()):
            row = {"step": int(step), "cluster": c, "size": int(m.size), "small": c != largest}
            scores = []
            for h in range(1, horizon + 1):
                score = _best_jaccard(m, members[steps[i + h]]) if i + h < len(steps) else float("nan")
                row[f"jaccard_{h}"] = score
                scores.append(score)
            row["persists"] = bool(all(np.isfinite(scores)) and min(scores) >= threshold)
            rows.append(row)
    columns = ["step", "cluster", "size", "small"] + [f"jaccard_{h}" for h in range(1, horizon + 1)] + ["persists"]
    return pd.DataFrame(rows, columns=columns)


def persistence_summary(table: pd.DataFrame, n: int) -> pd.DataFrame:
    """Per step of a :func:`cluster_persistence` table of ``n`` sequences: n_clusters,
    n_small, small_share (of the n sequences), persisting_share (of small-cluster members, in
    clusters that persist; NaN without small clusters or past the horizon) and min_jaccard."""
    horizon = [c for c in table.columns if c.startswith("jaccard_")]
    rows = []
    for step, group in table.groupby("step", sort=True):
        small = group[group["small"]]
        complete = bool(len(small)) and bool(np.isfinite(small[horizon].to_numpy()).all())
        members = small["size"].sum()
        rows.append({"step": int(step), "n_clusters": len(group), "n_small": len(small),
                     "small_share": float(members / n),
                     "persisting_share": float(small.loc[small["persists"], "size"].sum() / members)
                     if complete else float("nan"),
                     "min_jaccard": float(small[horizon].min(axis=1).min()) if complete else float("nan")})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


@entry("persistent_step")
def persistent_step(summaries: dict, *, min_persisting: float = 0.8, min_small_share: float = 0.0) -> int | None:
    """The earliest step at which, for every layer of ``summaries`` ({layer: a
    :func:`persistence_summary` table}), there is a small cluster, the small clusters hold more
    than ``min_small_share`` of the sequences, and at least ``min_persisting`` of their members
    are in clusters that persist; None when no step qualifies."""
    if not 0 < min_persisting <= 1:
        raise fail("persistent_step", "min_persisting", "must be in (0, 1]", min_persisting)
    if not summaries:
        raise fail("persistent_step", "summaries", "must hold at least one layer's table", summaries)
    steps = sorted(set.intersection(*(set(t["step"]) for t in summaries.values())))
    for step in steps:
        rows = [t.set_index("step").loc[step] for t in summaries.values()]
        if all(r["n_small"] >= 1 and r["small_share"] > min_small_share and r["persisting_share"] >= min_persisting
               for r in rows):
            return int(step)
    return None
