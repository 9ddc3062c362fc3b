"""The CSE plan: which layers get sparse experts, and how long the dense warm-up lasts
(docs/design.md §3), with the evidence that chose them.

- Layers: the largest separation scores (top-k, default 2), or every layer whose score is
  at least ``min_fraction`` of the best. Scores are taken at the window's last checkpoint (at
  the GC peak when only GC decides the warm-up). With domain labels, the plan also records the
  layers where the tail's clusters hold the most tail sequences, and ``choose_by="labels"``
  takes those.
- Warm-up, by the first rule that decides (the plan records which, with its evidence):
  1. ``"small-clusters-persist"``: the earliest checkpoint from which the router's small
     (non-largest) clusters persist at every chosen layer (:mod:`ntkscope.representation.
     persistence`): Algorithm 1 freezes the cluster structure at the warm-up, which is safe
     only once the long tail's clusters are stable;
  2. ``"gc-peak"``: the checkpoint where the long tail's |GC| stands highest over its random
     null, when the statistics show a peak on that excess: a rise and a fall beyond the noise,
     unflagged checkpoints only (:func:`gc_peak`);
  3. ``"stable-clusters"``: else the earliest checkpoint whose router clusters, at every chosen
     layer, have the same count as at the next checkpoint and an adjusted Rand index with it
     of at least ``overlap`` (:func:`stable_step`; the table comes from
     :func:`ntkscope.runs.dynamics.router_dynamics`);
  4. ``"window-end"``: else the last checkpoint considered.
  With ``choose_by="labels"``, ``"tail-clusters"`` (the earliest checkpoint with a pure tail
  cluster at every chosen layer) comes first.

A plan is a small JSON file that ``cse_models`` training reads directly: a config with
``plan: PLAN.json`` and ``sparse.layers: auto`` / ``cse.convert_at: auto`` takes both. The warm-up
ends at the conversion step, which every config, spec and plan names ``convert_at``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import MissingInput, check_positive_int, entry, fail, renamed_keys
from ntkscope.core.files import write_json
from ntkscope.representation.persistence import persistent_step

PLAN_FORMAT = 3  # 3: the conversion step is convert_at (formats 1 and 2 named it warmup_steps)
GC_COLUMNS = ("step", "abs_gc", "abs_gc_se", "null_median", "flags")


@dataclass(frozen=True)
class Plan:
    """layers: chosen block indices; module: "ffn" or "attn"; convert_at: the step the warm-up ends
    and the layers are converted (None without a GC series or a stability table); chosen_by: the
    layer rule; warmup_rule: "small-clusters-persist", "tail-clusters", "gc-peak",
    "stable-clusters", "window-end" or None; evidence: {"separation": [{"layer", "separation"}], "scores_at_step", "gc": [per
    checkpoint: step, abs_gc, interval, null band, ...], "gc_peak": {"step", "shown", "why"},
    "persistence": {layer: [per step: n_small, small_share, persisting_share, ...]},
    "min_persisting", "labels": [per step and layer: n_pure_tail, tail_share, ...],
    "labels_at_warmup", "layers_by_labels", "layers_by_separation", "stability": [{"step",
    "layer", "n_clusters", "overlap_next"}], "overlap"}, each only when measured; source: what the
    plan was measured on (``ntkscope plan`` fills it: the model's architecture, layers and width,
    the tokenizer, the data, the run's steps), checked when a training applies the plan."""

    layers: list
    module: str
    convert_at: int | None
    chosen_by: str
    evidence: dict = field(default_factory=dict)
    warmup_rule: str | None = None
    source: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        return write_json(path, {"format": PLAN_FORMAT, **asdict(self)})

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise MissingInput(f"Plan.load: {path} does not exist")
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.pop("format", None) not in (1, 2, PLAN_FORMAT):
            raise fail("Plan.load", "path", f"must hold a plan of format 1 to {PLAN_FORMAT}", str(path))
        return cls(**renamed_keys(data, {"warmup_steps": "convert_at"}, "Plan.load", warn=False))


def plan_step(record: dict):
    """The conversion step of a plan read as JSON (a :class:`Plan` file of any format, or a run's
    plan.json): ``convert_at``, or ``warmup_steps`` in one written before format 3; None if neither."""
    return record.get("convert_at", record.get("warmup_steps"))


def excess_series(gc: pd.DataFrame) -> pd.DataFrame:
    """Per checkpoint: step, excess (|GC| minus the random null's median), its standard error,
    abs_gc, null_median, flags and draws. With a ``draw`` column (independent draws of analysis
    sentences), the mean over draws, and the larger of two standard errors of that mean: the
    spread between draws and the within-draw one (``excess_se``, else ``abs_gc_se``); a step is
    flagged when any draw is. A tracker's table (:class:`ntkscope.GCTracker`: label and layer
    columns) is read as it is when it holds one subset at one layer."""
    for column in ("label", "layer"):
        if column in gc.columns and gc[column].nunique() > 1:
            raise fail("excess_series (gc_peak, gc_over_steps)", "gc", f"must hold one subset at one layer; its "
                       f"{column} column has {sorted(map(str, gc[column].unique()))[:8]} (select one: "
                       "GCTracker.series(label, layer))", f"{len(gc)} rows")
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
    if usable["excess"].isna().any():
        return {"step": None, "shown": False, "why": "the excess over the random null is not measured at every "
                "checkpoint (no null draws)", **out}
    if usable["excess_se"].isna().any():
        at = int(usable["excess"].idxmax())
        return {"step": int(usable.iloc[at]["step"]), "shown": False, "why": "the excess has no standard errors "
                "(no resamples): a peak cannot be shown", **out}
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


def _records(frame: pd.DataFrame) -> list:
    return json.loads(frame.to_json(orient="records"))


def _label_layers(labels: pd.DataFrame, top_k: int) -> tuple[list, list]:
    """The ``top_k`` layers where the tail's clusters hold the most tail sequences (tail_share,
    best over the window's steps; ties to the purer, then the shallower layer), and per layer the
    step its best share came from ([{layer, tail_share, step}], best first). No layer when every
    share is 0: a tie among zeros is no choice."""
    ranked = labels.sort_values(["layer", "tail_share", "step"], ascending=[True, False, True])
    best = ranked.groupby("layer", as_index=False).first()
    best["n_pure_tail"] = labels.groupby("layer")["n_pure_tail"].max().to_numpy()
    best = best.sort_values(["tail_share", "n_pure_tail", "layer"], ascending=[False, False, True])
    scores = [{"layer": int(r.layer), "tail_share": float(r.tail_share), "step": int(r.step)}
              for r in best.itertuples()]
    if not len(best) or not best["tail_share"].max() > 0:
        return [], scores
    return sorted(int(x) for x in best[best["tail_share"] > 0]["layer"].head(top_k)), scores


def _tail_step(labels: pd.DataFrame, layers) -> int | None:
    """The earliest step at which one of ``layers`` has a pure tail cluster (the first pure tail
    cluster the labels see)."""
    found = labels[labels["layer"].isin(list(layers)) & (labels["n_pure_tail"] >= 1)]
    return int(found["step"].min()) if len(found) else None


def make_plan(separation: pd.DataFrame, gc: pd.DataFrame | None = None, *, stability=None, overlap: float = 0.8,
              top_k: int | None = 2, min_fraction: float | None = None, module: str = "ffn", persistence=None,
              min_persisting: float = 0.8, labels=None, choose_by: str = "structure") -> Plan:
    """A plan from a separation table (one model, or a series with a ``step`` column) and,
    optionally, the long tail's GC over checkpoints (a :func:`ntkscope.gc_series` table), the
    persistence of the router's small clusters (``persistence``: {layer:
    :func:`~ntkscope.representation.persistence.persistence_summary`}, or a callable ``layers ->``
    that dict), the router's stability (a :func:`ntkscope.runs.dynamics.router_dynamics` table,
    or a callable ``layers -> table``) and what the router's clusters hold by domain label
    (``labels``: a router_dynamics table made with ``domains`` and ``tail``, or a callable
    ``layers -> table``). The steps of ``gc`` (or of the other tables) are the window the
    warm-up is chosen from.

    Warm-up rules, the first that decides: "small-clusters-persist" (:func:`~ntkscope.
    representation.persistence.persistent_step` with ``min_persisting``), "gc-peak" (shown on the
    excess over the null), "stable-clusters", "window-end". ``choose_by="labels"`` (needs
    ``labels``) instead takes the layers whose clusters hold the most tail sequences and the
    first step at which one of them holds a pure tail cluster ("tail-clusters"); when no layer
    holds one (every tail share 0), the labels choose nothing, the evidence says so
    (``labels_verdict``) and the structure's choice stands. With labels, the evidence records what
    the clusters hold at the chosen step, the layers the labels would choose and the step each
    layer's best tail share came from (``tail_share_by_layer``); ``scores_at_step`` is the
    checkpoint the separation scores came from."""
    if module not in ("ffn", "attn"):
        raise fail("make_plan", "module", "must be 'ffn' or 'attn'", module)
    if not {"layer", "separation"} <= set(separation.columns):
        raise fail("make_plan", "separation", "must have columns layer and separation", list(separation.columns))
    if choose_by not in ("structure", "labels"):
        raise fail("make_plan", "choose_by", "must be 'structure' or 'labels'", choose_by)
    if choose_by == "labels" and labels is None:
        raise fail("make_plan", "labels", "must be given when choose_by='labels' (a router_dynamics table made "
                   "with domains and tail)", None)
    evidence = {}
    warmup, rule = None, None
    if gc is not None:
        evidence["gc_peak"] = gc_peak(gc)
        evidence["gc"] = _records(gc)
    window = sorted(gc["step"]) if gc is not None else None
    table, at_step = separation, None
    if "step" in separation.columns:
        steps = sorted(separation["step"].unique())
        peak_first = gc is not None and evidence["gc_peak"]["shown"] and persistence is None and choose_by != "labels"
        target = evidence["gc_peak"]["step"] if peak_first else (window[-1] if window else steps[-1])
        at_step = int(min(steps, key=lambda s: (abs(s - target), -s)))
        table = separation[separation["step"] == at_step]
    layers = sorted(choose_layers(table, top_k=None if min_fraction else top_k, min_fraction=min_fraction))
    label_table = None
    if labels is not None:
        label_table = labels(list(range(int(separation["layer"].max()) + 1))) if callable(labels) else labels
        if window:
            label_table = label_table[label_table["step"] <= window[-1]]
        evidence["labels"] = _records(label_table[[c for c in ("step", "layer", "n_clusters", "n_pure", "n_pure_tail",
                                                                "tail_share") if c in label_table.columns]])
        evidence["layers_by_labels"], evidence["tail_share_by_layer"] = _label_layers(label_table, len(layers))
        evidence["layers_by_separation"] = layers
        if not evidence["layers_by_labels"]:
            evidence["labels_verdict"] = "no layer holds a pure tail cluster"
        if choose_by == "labels" and evidence["layers_by_labels"]:
            layers = evidence["layers_by_labels"]
            warmup = _tail_step(label_table, layers)
            rule = "tail-clusters" if warmup is not None else None
    if warmup is None and persistence is not None:
        found = persistence(layers) if callable(persistence) else {k: persistence[k] for k in layers}
        if window:
            found = {k: t[t["step"] <= window[-1]] for k, t in found.items()}
        evidence["persistence"] = {str(k): _records(t) for k, t in found.items()}
        evidence["min_persisting"] = min_persisting
        warmup = persistent_step(found, min_persisting=min_persisting)
        rule = "small-clusters-persist" if warmup is not None else None
        window = window or sorted(set.intersection(*(set(t["step"]) for t in found.values())))
    if warmup is None and gc is not None and evidence["gc_peak"]["shown"]:
        warmup, rule = evidence["gc_peak"]["step"], "gc-peak"
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
    if choose_by == "labels":
        rule_layers = f"top-{len(layers)} tail share (labels)" if evidence["layers_by_labels"] else \
            f"{rule_layers} (the labels chose none: no layer holds a pure tail cluster)"
    if label_table is not None and warmup is not None:
        evidence["labels_at_warmup"] = _records(label_table[label_table["step"] == warmup][
            [c for c in ("layer", "n_clusters", "n_pure_tail", "tail_share") if c in label_table.columns]])
    evidence.update(separation=[{"layer": int(r.layer), "separation": float(r.separation)} for r in table.itertuples()],
                    scores_at_step=at_step)
    return Plan(layers, module, warmup, rule_layers, evidence, rule)
