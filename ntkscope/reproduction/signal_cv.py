"""Choosing the warm-up signal without peeking: leave-one-trunk-out cross-validation of the
candidate signals (:mod:`ntkscope.runs.signals`) over the warm-up map's trunks, each judged by
the map's verdict 4 (figures/warmup-map/CRITERIA.md: the chosen step's tail gain at least 80 %
of the best step's, at or before the best step).

For each signal and each held-out trunk, the threshold is the one that is good in the most of
the other trunks (ties: the middle of the tied thresholds in grid order); the held-out trunk is
judged at that threshold. The rule is the signal good in the most held-out trunks (ties: a
label-free signal first, then the order of :data:`~ntkscope.runs.signals.SIGNALS`), its
threshold refit on every trunk. ``python -m ntkscope.reproduction.signal_cv`` writes
figures/warmup-map/signals/{cv.csv, thresholds.csv, rule.json} from the committed tables.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope.core.checks import fail
from ntkscope.core.files import write_json, write_table
from ntkscope.reproduction.map_tables import judge_step
from ntkscope.runs.signals import SIGNALS, Signal, TrunkLog, trunk_log

MAP = Path("figures/warmup-map")
#: the map's trunks: (name, the folder of its build's tables and plans, seed)
MAP_TRUNKS = tuple([(f"map-seed{s}", MAP, s) for s in range(5)] + [(f"mix-seed{s}", MAP / "mix", s) for s in range(2)])


@dataclass(frozen=True)
class Trunk:
    """One trunk: its logs and its CSE map (conversion step -> tail gain)."""

    name: str
    log: TrunkLog
    gains: pd.Series


def load_trunk(name: str, folder: Path, seed: int) -> Trunk:
    """A map trunk from its committed files: FOLDER/tables/curves.csv (the dense arm's validation
    curves), FOLDER/tables/gains.csv (CSE's tail gains) and FOLDER/plans/seedN.json (the consensus
    structure per layer, over the registered rule's window and layers)."""
    folder = Path(folder)
    curves = pd.read_csv(folder / "tables" / "curves.csv")
    curves = curves[(curves["arm"] == "dense") & (curves["seed"] == seed)]
    gains = pd.read_csv(folder / "tables" / "gains.csv")
    gains = gains[(gains["arm"] == "cse") & (gains["seed"] == seed) & (gains["domain"] == "tail")]
    plan = json.loads((folder / "plans" / f"seed{seed}.json").read_text())
    if not len(curves) or not len(gains):
        raise fail("load_trunk", "folder", f"must hold the dense curves and CSE gains of seed {seed}", str(folder))
    log = trunk_log(curves, plan, int(curves["step"].max()))  # the map's trunks log to their schedule's end
    return Trunk(name, log, gains.set_index("step")["gain"].sort_index())


def map_trunks() -> list:
    return [load_trunk(*t) for t in MAP_TRUNKS]


def judge(signal: Signal, trunk: Trunk, threshold: float) -> dict:
    """The signal's step on ``trunk`` at ``threshold``, judged by verdict 4."""
    step = signal.step(trunk.log, threshold)
    if step is None:
        return {"step": None, "gain": None, "best_step": int(trunk.gains.idxmin()), "good": False,
                "verdict": "chose nothing"}
    j = judge_step(trunk.gains, int(step))
    return {"step": int(step), "gain": j["gain_at_rule"], "best_step": j["best_step"], "good": j["verdict"] == "good",
            "verdict": j["verdict"] + (" (extrapolated)" if j["extrapolated"] else "")}


def fit_threshold(signal: Signal, trunks: list) -> tuple:
    """The threshold of ``signal.grid`` good in the most of ``trunks``: (threshold, how many)."""
    counts = [sum(judge(signal, t, th)["good"] for t in trunks) for th in signal.grid]
    best = max(counts)
    tied = [i for i, c in enumerate(counts) if c == best]
    return signal.grid[tied[(len(tied) - 1) // 2]], best


def cross_validate(trunks: list, signals=None) -> tuple:
    """(cv, thresholds): cv has a row per signal and held-out trunk (the threshold fit on the
    others, the step, its gain, the best step, good); thresholds has a row per signal and grid
    threshold with the number of trunks where it is good (in sample)."""
    signals = list(SIGNALS.values()) if signals is None else signals
    rows, grid = [], []
    for signal in signals:
        for i, held in enumerate(trunks):
            threshold, fit_good = fit_threshold(signal, trunks[:i] + trunks[i + 1:])
            rows.append({"signal": signal.name, "label_free": signal.label_free, "held_out": held.name,
                         "threshold": threshold, "good_in_fit": fit_good, "fit_trunks": len(trunks) - 1,
                         **judge(signal, held, threshold)})
        for th in signal.grid:
            judged = [judge(signal, t, th) for t in trunks]
            grid.append({"signal": signal.name, "threshold": th, "good": sum(j["good"] for j in judged),
                         "trunks": len(trunks), "steps": " ".join("-" if j["step"] is None else str(j["step"])
                                                                  for j in judged)})
    return pd.DataFrame(rows).astype({"step": "Int64"}), pd.DataFrame(grid)


def choose_rule(cv: pd.DataFrame, trunks: list, signals=None) -> dict:
    """The signal good in the most held-out trunks, with its threshold refit on all ``trunks``."""
    signals = {s.name: s for s in (list(SIGNALS.values()) if signals is None else signals)}
    order = list(signals)
    score = cv.groupby("signal")["good"].sum()
    ranked = sorted(score.index, key=lambda n: (-int(score[n]), not signals[n].label_free, order.index(n)))
    name = ranked[0]
    threshold, good = fit_threshold(signals[name], trunks)
    per = {t.name: judge(signals[name], t, threshold) for t in trunks}
    return {"signal": name, "what": signals[name].what, "label_free": signals[name].label_free,
            "threshold": threshold, "cv_good": int(score[name]), "trunks": len(trunks),
            "in_sample_good": good, "steps": {k: v["step"] for k, v in per.items()},
            "cv_record": {n: int(score[n]) for n in order if n in score.index},
            "thresholds": {n: fit_threshold(signals[n], trunks)[0] for n in order},
            "passes": bool(score[name] >= int(np.ceil(0.8 * len(trunks))))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MAP / "signals")
    args = parser.parse_args(argv)
    trunks = map_trunks()
    args.out.mkdir(parents=True, exist_ok=True)
    cv, grid = cross_validate(trunks)
    rule = choose_rule(cv, trunks)
    write_table(cv, args.out / "cv.csv")
    write_table(grid, args.out / "thresholds.csv")
    write_json(args.out / "rule.json", rule)
    print(cv.groupby("signal")["good"].sum().to_string())
    print(json.dumps(rule, indent=1))


if __name__ == "__main__":
    main()
