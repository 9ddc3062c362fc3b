"""Candidate warm-up signals: each a named function of one trunk's logs that returns the step
at which to convert a dense trunk to CSE, or None when it never fires (docs/warmup-map.md,
"Choosing the warm-up").

A trunk's logs (:class:`TrunkLog`) are what a training run can write as it goes: the validation
loss per domain every few steps with the learning rate (``cse_models.validation``; a domain
``"all"`` is the whole validation set), and optionally the label-free consensus structure per
layer (:func:`ntkscope.representation.consensus.structure_series`, as a plan's evidence holds
it). A signal is *label-free* when it reads neither the domain names nor the tail; the labelled
ones say so (``label_free=False``).

Each signal takes one threshold, and its ``grid`` lists the thresholds a cross-validation may
try (:mod:`ntkscope.reproduction.signal_cv`). Adding a signal: write ``fn(log, threshold) ->
step | None`` that reads only ``log`` and returns a logged step, then ``register(Signal(name,
what, label_free, grid, fn))``; give it a planted-trunk test with a known onset
(``tests/test_signals.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from ntkscope.core.checks import fail
from ntkscope.core.registry import Registry
from ntkscope.representation.consensus import structure_step

CURVE_COLUMNS = ("step", "domain", "loss", "lr")
STRUCTURE_COLUMNS = ("step", "layer", "structure_low", "n_clusters")


@dataclass(frozen=True)
class TrunkLog:
    """One dense trunk's logs. ``curves``: step, domain, loss, lr (a row per logged step and
    domain; the domain ``"all"`` is the whole validation set); ``total_steps``: the schedule's
    length; ``structure``: step, layer, structure_low, n_clusters (optional); ``layers``: the
    layers whose structure the structure signals read; ``tail`` and ``general``: the domain
    names the labelled signals read."""

    curves: pd.DataFrame
    total_steps: int
    structure: pd.DataFrame | None = None
    layers: tuple = (2, 3)
    window: tuple | None = None
    tail: tuple = ("legal", "biomedical")
    general: str = "general"

    def __post_init__(self):
        missing = [c for c in CURVE_COLUMNS if c not in self.curves.columns]
        if missing:
            raise fail("TrunkLog", "curves", f"must have the columns {list(CURVE_COLUMNS)} (missing {missing})",
                       list(self.curves.columns))
        if "all" not in set(self.curves["domain"]):
            raise fail("TrunkLog", "curves", "must hold the whole validation set's loss as domain 'all'",
                       sorted(set(self.curves["domain"])))
        if not isinstance(self.total_steps, (int, np.integer)) or self.total_steps <= 0:
            raise fail("TrunkLog", "total_steps", "must be a positive int", self.total_steps)
        if self.structure is not None:
            missing = [c for c in STRUCTURE_COLUMNS if c not in self.structure.columns]
            if missing:
                raise fail("TrunkLog", "structure", f"must have the columns {list(STRUCTURE_COLUMNS)} (missing "
                           f"{missing})", list(self.structure.columns))

    def loss(self, domain: str) -> pd.Series:
        """step -> validation loss of ``domain`` (mean over the tail's domains for a tuple)."""
        names = [domain] if isinstance(domain, str) else list(domain)
        rows = self.curves[self.curves["domain"].isin(names)]
        if rows["domain"].nunique() != len(names):
            raise fail("TrunkLog.loss", "domain", f"must be logged (the log has {sorted(set(self.curves['domain']))})",
                       domain)
        return rows.groupby("step")["loss"].mean().sort_index()

    def lr(self) -> pd.Series:
        return self.curves.groupby("step")["lr"].first().sort_index()


def trunk_log(curves: pd.DataFrame, plan: dict, total_steps: int) -> TrunkLog:
    """A dense trunk's :class:`TrunkLog` from its validation curves (step, domain, loss, lr) and
    its plan (the consensus structure per layer in ``evidence.structure``, read over the
    registered rule's window and layers, ``evidence.structure_rule``), on a schedule of
    ``total_steps``."""
    evidence = plan.get("evidence") or {}
    rule = evidence.get("structure_rule") or {}
    structure = pd.concat([pd.DataFrame(rows).assign(layer=int(layer)) for layer, rows in evidence["structure"].items()],
                          ignore_index=True) if evidence.get("structure") else None
    return TrunkLog(curves[list(CURVE_COLUMNS)].reset_index(drop=True),
                    int(total_steps), structure, layers=tuple(rule.get("judged_at_layers", (2, 3))),
                    window=tuple(rule["window"]) if rule.get("window") else None)


@dataclass(frozen=True)
class Signal:
    """name; what it reads, in words; label_free; grid: the thresholds a cross-validation tries
    (in the order of an earlier to a later step where that order exists); fn(log, threshold) ->
    step | None."""

    name: str
    what: str
    label_free: bool
    grid: tuple
    fn: Callable[[TrunkLog, float], int | None]

    def step(self, log: TrunkLog, threshold: float) -> int | None:
        return self.fn(log, threshold)


SIGNALS = Registry("signal")


def register(signal: Signal) -> Signal:
    """Add ``signal`` to :data:`SIGNALS` (a name is registered once)."""
    return SIGNALS.add(signal.name, signal, func="register")


def get_signal(name: str) -> Signal:
    """The signal registered as ``name``."""
    return SIGNALS.get_one(name, func="get_signal")


def _grid(start: float, stop: float, step: float) -> tuple:
    return tuple(round(float(x), 6) for x in np.arange(start, stop + step / 2, step))


#: the loss signals compare a step with the step this many steps earlier
LOSS_WINDOW = 200


def _relative_drop(loss: pd.Series, window: int = LOSS_WINDOW) -> pd.Series:
    """step -> (loss(step - window) - loss(step)) / loss(step - window), at steps whose
    ``step - window`` is logged."""
    out = {}
    for step, value in loss.items():
        before = loss.get(step - window)
        if before is not None and before > 0:
            out[int(step)] = (before - value) / before
    return pd.Series(out, dtype=float)


def schedule_fraction(log: TrunkLog, fraction: float) -> int | None:
    """The logged step nearest ``fraction`` of the schedule (reads only its length)."""
    steps = np.array(sorted(log.curves["step"].unique()))
    return int(steps[np.argmin(np.abs(steps - fraction * log.total_steps))])


def lr_fraction(log: TrunkLog, fraction: float) -> int | None:
    """The first logged step after the learning rate's peak at which it is at most ``fraction``
    of that peak."""
    lr = log.lr()
    after = lr.loc[lr.idxmax():]
    below = after[after <= fraction * lr.max()]
    return int(below.index[0]) if len(below) else None


def loss_plateau(log: TrunkLog, rate: float) -> int | None:
    """The first logged step at which the whole validation loss fell by less than ``rate`` (a
    relative drop) over the last :data:`LOSS_WINDOW` steps."""
    drop = _relative_drop(log.loss("all"))
    hit = drop[drop < rate]
    return int(hit.index[0]) if len(hit) else None


def tail_slope_ratio(log: TrunkLog, ratio: float) -> int | None:
    """Labelled: the first logged step at which the tail's validation loss falls at least
    ``ratio`` times as fast as the general domain's, relative drops over :data:`LOSS_WINDOW`
    steps (the general text slowing while the tail still learns)."""
    tail, general = _relative_drop(log.loss(tuple(log.tail))), _relative_drop(log.loss(log.general))
    both = pd.concat({"tail": tail, "general": general}, axis=1).dropna()
    both = both[both["general"] > 0]
    hit = both[both["tail"] >= ratio * both["general"]]
    return int(hit.index[0]) if len(hit) else None


def _structure(log: TrunkLog) -> dict:
    if log.structure is None:
        return {}
    table = log.structure
    if log.window is not None:
        table = table[table["step"].isin(list(log.window))]
    return {L: table[table["layer"] == L].sort_values("step") for L in log.layers if (table["layer"] == L).any()}


def consensus_structure(log: TrunkLog, minimum: float) -> int | None:
    """The registered consensus-structure rule (:func:`~ntkscope.representation.consensus.
    structure_step`): the first step at which the structure's interval, at every one of the
    log's layers, has its lower end at least ``minimum``."""
    series = _structure(log)
    return structure_step(series, min_structure=minimum) if series else None


def cluster_count(log: TrunkLog, count: float) -> int | None:
    """The first step at which the consensus finds at least ``count`` clusters, on the mean over
    the log's layers (the number of experts CSE's fit would make grows with it)."""
    series = _structure(log)
    if not series:
        return None
    table = pd.concat(series.values()).groupby("step")["n_clusters"].mean().sort_index()
    hit = table[table >= count]
    return int(hit.index[0]) if len(hit) else None


register(Signal("schedule-fraction", "a fixed fraction of the schedule's length (reads no measurement)", True,
                _grid(0.1, 0.8, 0.05), schedule_fraction))
register(Signal("lr-fraction", "the learning rate falling to a fraction of its peak", True,
                _grid(0.95, 0.2, -0.05), lr_fraction))
register(Signal("loss-plateau", f"the whole validation loss's relative drop over {LOSS_WINDOW} steps falling "
                "below a rate", True, _grid(0.05, 0.004, -0.002), loss_plateau))
register(Signal("tail-slope-ratio", f"the tail's validation loss falling a multiple as fast as the general "
                f"domain's over {LOSS_WINDOW} steps (labelled)", False, _grid(1.0, 2.5, 0.1), tail_slope_ratio))
register(Signal("consensus-structure", "the label-free consensus structure's lower bound reaching a minimum at "
                "every layer (the registered rule at 0.05)", True, _grid(0.02, 0.25, 0.01), consensus_structure))
register(Signal("cluster-count", "the consensus's number of clusters, mean over layers, reaching a count", True,
                _grid(2.0, 5.0, 0.25), cluster_count))


#: what cross-validation chose on the warm-up map's trunks (figures/warmup-map/signals/rule.json,
#: checked equal by the tests) and what the fresh trunks registered in
#: figures/warmup-map/fresh/CRITERIA.md have shown of it (lists, not tuples: a plan's JSON gives
#: the same record back)
CROSS_VALIDATED = {
    "signal": "schedule-fraction", "threshold": 0.5, "cv_good": 6, "trunks": 7,
    "cv_record": {"schedule-fraction": 6, "lr-fraction": 2, "loss-plateau": 2, "tail-slope-ratio": 1,
                  "consensus-structure": 2, "cluster-count": 0},
    "on": "leave-one-trunk-out over the warm-up map's 7 trunks (4 x 128 GPT, 2400-step cosine, one H200 build)",
    "fresh_verdict": "not shown",
    "fresh_good": {"warmup-fresh": [2, 5], "warmup-fresh-half": [1, 3], "warmup-fresh-mix": [1, 3]},
    # the best conversion step's fraction of the schedule on the 11 fresh trunks: lowest, highest, and
    # the trunks at the highest (the latest step tried, 0.75 of the schedule)
    "fresh_best_fraction": [0.375, 0.75, 6],
    "fresh_needed": 9,
}
#: the fresh families (figures/warmup-map/fresh/README.md), in the words of the plan's record
FRESH_FAMILIES = {"warmup-fresh": "seeds 5-9 of the map's configuration", "warmup-fresh-half": "a 1200-step schedule",
                  "warmup-fresh-mix": "a third mix"}
CROSS_VALIDATED["fresh"] = (
    f"{CROSS_VALIDATED['fresh_verdict']}: good in {sum(g for g, _ in CROSS_VALIDATED['fresh_good'].values())} of the "
    f"{sum(n for _, n in CROSS_VALIDATED['fresh_good'].values())} fresh trunks, {CROSS_VALIDATED['fresh_needed']} "
    "needed (" + "; ".join(f"{FRESH_FAMILIES[f]}: {g} of {n}" for f, (g, n) in CROSS_VALIDATED["fresh_good"].items())
    + "; CPU build, figures/warmup-map/fresh)")


def warmup_record(measured_step: int | None, measured_rule: str | None, total_steps: int | None) -> dict:
    """What a plan says about its warm-up: the step its measured rule chose, the step the
    cross-validated signal gives on this schedule (``total_steps``; None when the run does not
    say its length), and both records in words."""
    cv = CROSS_VALIDATED
    fraction = schedule_fraction_step(total_steps, cv["threshold"]) if total_steps else None
    best_measured = max(v for k, v in cv["cv_record"].items() if SIGNALS[k].fn is not schedule_fraction)
    return {"measured_rule": measured_rule, "measured_step": measured_step, "schedule_steps": total_steps,
            "cross_validated": {**cv, "step": fraction},
            "summary": (f"No measured signal chose the warm-up well on the map's trunks (the best was good in "
                        f"{best_measured} of {cv['trunks']} held out); a fixed fraction of the schedule, "
                        f"{cv['threshold']:g}, was good in {cv['cv_good']} of {cv['trunks']}, and reads no measurement "
                        f"of the run. Fresh trunks: {cv['fresh']}; there the best step lay at "
                        f"{cv['fresh_best_fraction'][0]:g}-{cv['fresh_best_fraction'][1]:g} of the schedule "
                        f"({cv['fresh_best_fraction'][1]:g}, the latest step tried, in {cv['fresh_best_fraction'][2]} "
                        f"of {sum(g[1] for g in cv['fresh_good'].values())}). Here: "
                        + (f"the measured rule '{measured_rule}' chose step {measured_step}" if measured_step is not None
                           else "the measured rules chose nothing") + "; half the schedule is "
                        + (f"step {fraction}." if fraction is not None else "unknown (the run does not say its "
                           "length: give it with --schedule-steps)."))}


def schedule_fraction_step(total_steps: int, fraction: float) -> int:
    """``fraction`` of a schedule of ``total_steps``, rounded to a step."""
    if not isinstance(total_steps, (int, np.integer)) or isinstance(total_steps, bool) or total_steps <= 0:
        raise fail("schedule_fraction_step", "total_steps", "must be a positive int", total_steps)
    return int(fraction * total_steps + 0.5)  # halves up (round() would take them to even)
