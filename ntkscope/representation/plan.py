"""The CSE plan: which layers get sparse experts, and how long the dense warm-up lasts
(docs/design.md §3), with the evidence that chose them.

- Layers: the largest separation scores (top-k, default 2), or every layer whose score is
  at least ``min_fraction`` of the best. Scores are taken at the checkpoint closest to the
  warm-up's end when a series is given (that is when CSE layers are built).
- Warm-up, by the first rule that decides (the plan records which, with its evidence):
  1. ``"gc-peak"``: the checkpoint where the long tail's |GC| stands highest over its random
     null, when the statistics show a peak on that excess: a rise and a fall beyond the noise,
     unflagged checkpoints only (:func:`gc_peak`);
  2. ``"stable-clusters"``: else the earliest checkpoint whose router clusters, at every chosen
     layer, have the same count as at the next checkpoint and an adjusted Rand index with it
     of at least ``overlap`` (:func:`stable_step`; the table comes from
     :func:`ntkscope.runs.dynamics.router_dynamics`);
  3. ``"window-end"``: else the last checkpoint considered.

A plan is a small JSON file that ``cse_models`` training reads directly: a config with
``plan: PLAN.json`` and ``sparse.layers: auto`` / ``cse.warmup_steps: auto`` takes both.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import check_positive_int, entry, fail
from ntkscope.core.files import write_json

PLAN_FORMAT = 2
GC_COLUMNS = ("step", "abs_gc", "abs_gc_se", "null_median", "flags")


@dataclass(frozen=True)
class Plan:
    """layers: chosen block indices; module: "ffn" or "attn"; warmup_steps (None without a GC
    series or a stability table); chosen_by: the layer rule; warmup_rule: "gc-peak",
    "stable-clusters", "window-end" or None; evidence: {"separation": [{"layer",
    "separation"}], "scores_at_step", "gc": [per checkpoint: step, abs_gc, interval, null band,
    ...], "gc_peak": {"step", "shown", "why"}, "stability": [{"step", "layer", "n_clusters",
    "overlap_next"}], "overlap"}."""

    layers: list
    module: str
    warmup_steps: int | None
    chosen_by: str
    evidence: dict = field(default_factory=dict)
    warmup_rule: str | None = None

    def save(self, path: str | Path) -> Path:
        return write_json(path, {"format": PLAN_FORMAT, **asdict(self)})

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Plan.load: {path} does not exist")
        data = json.loads(path.read_text())
        if data.pop("format", None) not in (1, PLAN_FORMAT):
            raise fail("Plan.load", "path", f"must hold a plan of format 1 or {PLAN_FORMAT}", str(path))
        return cls(**data)


def excess_series(gc: pd.DataFrame) -> pd.DataFrame:
    """Per checkpoint: step, excess (|GC| minus the random null's median), its standard error,
    abs_gc, null_median, flags and draws. With a ``draw`` column (independent draws of analysis
    sentences), the mean over draws, and the larger of two standard errors of that mean: the
    spread between draws and the within-draw one (``excess_se``, else ``abs_gc_se``); a step is
    flagged when any draw is."""
    gc = gc.copy()
    gc["excess"] = gc["abs_gc"] - gc["null_median"]
    if "excess_se" not in gc.columns:
        gc["excess_se"] = gc["abs_gc_se"]
    gc["flags"] = gc["flags"].where(gc["flags"].map(lambda f: isinstance(f, str)), "")
    if "draw" not in gc.columns:
        gc["draw"] = 0
    rows = []
    for step, g in gc.groupby("step", sort=True):
        d = len(g)
        within = float((g["excess_se"] ** 2).mean())
        between = float(g["excess"].var(ddof=1)) if d > 1 else 0.0
        flags = " ".join(sorted({f for fl in g["flags"] for f in fl.split()}))
        rows.append({"step": int(step), "excess": float(g["excess"].mean()),
                     "excess_se": math.sqrt(max(within, between) / d), "abs_gc": float(g["abs_gc"].mean()),
                     "null_median": float(g["null_median"].mean()), "flags": flags, "draws": d})
    return pd.DataFrame(rows)


@entry("gc_peak")
def gc_peak(gc: pd.DataFrame, *, z: float = 1.645) -> dict:
    """The checkpoint where the long tail's |GC| stands highest over its null, and whether the
    statistics show it.

    ``gc``: a :func:`ntkscope.gc_series` table (columns step, abs_gc, abs_gc_se, null_median,
    flags; optional excess_se and draw), one row per checkpoint and draw. Read on the **excess**
    ``|GC| - null median`` (:func:`excess_series`), so that a global alignment event, which lifts
    random subsets as much, is no peak. Flagged checkpoints are left out. The peak is shown when:

    1. it is neither the first nor the last unflagged checkpoint;
    2. the excess rises from the first unflagged checkpoint to it and falls from it to the last,
       each by more than ``z`` standard errors of the difference, ``z sqrt(se_peak^2 +
       se_other^2)`` (z = 1.645: one-sided 95 %).

    Returns {"step", "shown", "why", "on": "excess over the random null", "rise_z", "fall_z",
    "draws", "left_out": [flagged steps]}.
    """
    missing = [c for c in GC_COLUMNS if gc is None or c not in gc.columns]
    if gc is None or len(gc) == 0 or missing:
        raise fail("gc_peak", "gc", f"must be a gc_series table with columns {list(GC_COLUMNS)}, one row per "
                   "checkpoint", None if gc is None else list(gc.columns))
    series = excess_series(gc)
    flagged = series["flags"] != ""
    out = {"on": "excess over the random null", "draws": int(series["draws"].max()),
           "left_out": [int(s) for s in series.loc[flagged, "step"]], "rise_z": None, "fall_z": None}
    usable = series[~flagged].reset_index(drop=True)
    if len(usable) < 3:
        return {"step": None, "shown": False, "why": f"fewer than 3 unflagged checkpoints ({len(usable)})", **out}
    at = int(usable["excess"].idxmax())
    peak = usable.iloc[at]
    step = int(peak["step"])
    if at in (0, len(usable) - 1):
        return {"step": step, "shown": False, "why": f"the largest excess is at the {'first' if at == 0 else 'last'} "
                                                     "unflagged checkpoint (no rise and fall)", **out}
    reasons = []
    for name, key, row in (("rise from the first unflagged checkpoint", "rise_z", usable.iloc[0]),
                           ("fall to the last", "fall_z", usable.iloc[-1])):
        change = peak["excess"] - row["excess"]
        se = math.sqrt(peak["excess_se"] ** 2 + row["excess_se"] ** 2)
        out[key] = round(float(change / se), 3) if se > 0 else None
        if not change > z * se:
            reasons.append(f"the excess's {name} (step {int(row['step'])}: {change:.3f}) is within {z:g} standard "
                           f"errors ({z * se:.3f})")
    shown = not reasons
    return {"step": step, "shown": shown, "why": "; ".join(reasons) if reasons else
            f"the excess over the random null rises and falls beyond {z:g} standard errors, unflagged checkpoints only",
            **out}


@entry("stable_step")
def stable_step(stability: pd.DataFrame, layers, *, overlap: float = 0.8) -> int | None:
    """The earliest step at which, for every one of ``layers``, the router has the same number
    of clusters as at the next checkpoint and their adjusted Rand index is at least ``overlap``
    (``stability``: step, layer, n_clusters, overlap_next); None when no step qualifies."""
    if not 0 < overlap <= 1:
        raise fail("stable_step", "overlap", "must be in (0, 1]", overlap)
    table = stability[stability["layer"].isin(list(layers))].sort_values(["step", "layer"])
    steps = sorted(table["step"].unique())
    for now, after in zip(steps, steps[1:]):
        a = table[table["step"] == now].set_index("layer")
        b = table[table["step"] == after].set_index("layer")
        if all(layer in a.index and layer in b.index and a.at[layer, "n_clusters"] == b.at[layer, "n_clusters"]
               and a.at[layer, "overlap_next"] >= overlap for layer in layers):
            return int(now)
    return None


@entry("choose_layers")
def choose_layers(separation: pd.DataFrame, *, top_k: int | None = 2, min_fraction: float | None = None) -> list:
    """The layers with the largest ``separation`` (columns layer, separation), best first."""
    if min_fraction is not None:
        if not 0 < min_fraction <= 1:
            raise fail("choose_layers", "min_fraction", "must be in (0, 1]", min_fraction)
        best = separation["separation"].max()
        chosen = separation[separation["separation"] >= min_fraction * best]
    else:
        check_positive_int("top_k", top_k)
        if top_k > len(separation):
            raise fail("choose_layers", "top_k", f"must be at most the number of layers ({len(separation)})", top_k)
        chosen = separation
    chosen = chosen.sort_values(["separation", "layer"], ascending=[False, True], kind="stable")
    return [int(x) for x in (chosen["layer"] if min_fraction is not None else chosen["layer"].head(top_k))]


def make_plan(separation: pd.DataFrame, gc: pd.DataFrame | None = None, *, stability=None, overlap: float = 0.8,
              top_k: int | None = 2, min_fraction: float | None = None, module: str = "ffn") -> Plan:
    """A plan from a separation table (one model, or a series with a ``step`` column) and,
    optionally, the long tail's GC over checkpoints (a :func:`ntkscope.gc_series` table) and the
    router's stability (a :func:`ntkscope.runs.dynamics.router_dynamics` table, or a callable
    ``layers -> table``, called only when the GC peak does not decide). The steps of ``gc`` (or
    of ``stability``) are the window the warm-up is chosen from."""
    if module not in ("ffn", "attn"):
        raise fail("make_plan", "module", "must be 'ffn' or 'attn'", module)
    if not {"layer", "separation"} <= set(separation.columns):
        raise fail("make_plan", "separation", "must have columns layer and separation", list(separation.columns))
    evidence = {}
    warmup, rule = None, None
    if gc is not None:
        evidence["gc_peak"] = gc_peak(gc)
        evidence["gc"] = json.loads(gc.to_json(orient="records"))
        if evidence["gc_peak"]["shown"]:
            warmup, rule = evidence["gc_peak"]["step"], "gc-peak"
    window = sorted(gc["step"]) if gc is not None else None
    table, at_step = separation, None
    if "step" in separation.columns:
        steps = sorted(separation["step"].unique())
        target = warmup if warmup is not None else (window[-1] if window else steps[-1])
        at_step = int(min(steps, key=lambda s: (abs(s - target), -s)))
        table = separation[separation["step"] == at_step]
    layers = sorted(choose_layers(table, top_k=None if min_fraction else top_k, min_fraction=min_fraction))
    if warmup is None and stability is not None:
        stable = stability(layers) if callable(stability) else stability
        if window:
            stable = stable[stable["step"] <= window[-1]]
        evidence["stability"] = json.loads(stable.to_json(orient="records"))
        evidence["overlap"] = overlap
        warmup = stable_step(stable, layers, overlap=overlap)
        rule = "stable-clusters" if warmup is not None else None
        window = window or sorted(stable["step"].unique())
    if warmup is None and window:
        warmup, rule = int(window[-1]), "window-end"
    rule_layers = f"separation >= {min_fraction:g} x best" if min_fraction else f"top-{top_k} separation"
    evidence.update(separation=[{"layer": int(r.layer), "separation": float(r.separation)} for r in table.itertuples()],
                    scores_at_step=at_step)
    return Plan(layers, module, warmup, rule_layers, evidence, rule)
