"""The CSE plan: which layers get sparse experts, and how long the dense warm-up lasts
(docs/design.md §3), with the evidence that chose them.

- Layers: the largest separation scores (top-k, default 2), or every layer whose score is
  at least ``min_fraction`` of the best. Scores are taken at the checkpoint closest to the
  warm-up's end when a series is given (that is when CSE layers are built).
- Warm-up: the step where the GC of the long-tail subset against the whole set peaks.

A plan is a small JSON file that ``cse_models`` training reads directly: a config with
``plan: PLAN.json`` and ``sparse.layers: auto`` / ``cse.warmup_steps: auto`` takes both.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import check_positive_int, entry, fail
from ntkscope.core.files import write_json

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Plan:
    """layers: chosen block indices; module: "ffn" or "attn"; warmup_steps (None without a GC
    series); chosen_by: the rule; evidence: {"separation": [{"layer", "separation"}],
    "scores_at_step", "gc": [{"step", "gc"}]}."""

    layers: list
    module: str
    warmup_steps: int | None
    chosen_by: str
    evidence: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        return write_json(path, {"format": PLAN_FORMAT, **asdict(self)})

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"Plan.load: {path} does not exist")
        data = json.loads(path.read_text())
        if data.pop("format", None) != PLAN_FORMAT:
            raise fail("Plan.load", "path", f"must hold a plan of format {PLAN_FORMAT}", str(path))
        return cls(**data)


def warmup_at_gc_peak(gc: pd.DataFrame) -> int:
    """The step of the largest GC (the first, on ties)."""
    if gc is None or len(gc) == 0 or not {"step", "gc"} <= set(gc.columns):
        raise fail("warmup_at_gc_peak", "gc", "must be a table with columns step and gc, one row per checkpoint",
                   None if gc is None else list(gc.columns))
    return int(gc.loc[gc["gc"].idxmax(), "step"])


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


def make_plan(separation: pd.DataFrame, gc: pd.DataFrame | None = None, *, top_k: int | None = 2,
              min_fraction: float | None = None, module: str = "ffn") -> Plan:
    """A plan from a separation table (one model, or a series with a ``step`` column) and,
    optionally, a GC-over-checkpoints series of the long-tail subset."""
    if module not in ("ffn", "attn"):
        raise fail("make_plan", "module", "must be 'ffn' or 'attn'", module)
    if not {"layer", "separation"} <= set(separation.columns):
        raise fail("make_plan", "separation", "must have columns layer and separation", list(separation.columns))
    warmup = warmup_at_gc_peak(gc) if gc is not None else None
    at_step = None
    table = separation
    if "step" in separation.columns:
        steps = sorted(separation["step"].unique())
        target = warmup if warmup is not None else steps[-1]
        at_step = int(min(steps, key=lambda s: (abs(s - target), -s)))
        table = separation[separation["step"] == at_step]
    layers = choose_layers(table, top_k=None if min_fraction else top_k, min_fraction=min_fraction)
    rule = f"separation >= {min_fraction:g} x best" if min_fraction else f"top-{top_k} separation"
    evidence = {"separation": [{"layer": int(r.layer), "separation": float(r.separation)} for r in table.itertuples()],
                "scores_at_step": at_step,
                "gc": [] if gc is None else [{"step": int(s), "gc": float(g)} for s, g in zip(gc["step"], gc["gc"])]}
    return Plan(sorted(layers), module, warmup, rule, evidence)
