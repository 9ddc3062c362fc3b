"""The candidate warm-up signals on planted trunks with a known onset (the onset found, none
before it), the registered rule reproduced from the committed plans, and the cross-validation
on planted trunks whose answer is known."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ntkscope.core.checks import UserError
from ntkscope.representation.plan import plan_step
from ntkscope.reproduction import signal_cv
from ntkscope.runs.checkpoints import schedule_length
from ntkscope.runs.signals import (CROSS_VALIDATED, LOSS_WINDOW, SIGNALS, Signal, TrunkLog, cluster_count, consensus_structure,
                                   get_signal, loss_plateau, lr_fraction, register, schedule_fraction,
                                   schedule_fraction_step, tail_slope_ratio, warmup_record)

ROOT = Path(__file__).resolve().parents[1]


def planted(total=2400, every=50, warmup=100, all_loss=None, general=None, tail=None, structure=None):
    """A trunk's logs: cosine learning rate after a linear warm-up, the given loss curves
    (functions of the step; defaults flat)."""
    steps = np.arange(every, total + 1, every)
    peak = 3e-3
    lr = np.where(steps < warmup, peak * steps / warmup,
                  peak * 0.5 * (1 + np.cos(np.pi * (steps - warmup) / (total - warmup))))
    curves = {"all": all_loss or (lambda s: 5.0), "general": general or (lambda s: 5.0),
              "legal": tail or (lambda s: 6.0), "biomedical": tail or (lambda s: 6.0)}
    rows = [{"step": int(s), "domain": d, "loss": float(f(s)), "lr": float(r)}
            for s, r in zip(steps, lr) for d, f in curves.items()]
    return TrunkLog(pd.DataFrame(rows), total, structure)


def structure_table(onsets: dict, steps=range(100, 1500, 100), before=(0.0, 2), after=(0.2, 5)):
    """Consensus structure per layer: ``before`` (structure_low, n_clusters) up to the layer's
    onset, ``after`` from it on."""
    rows = [{"step": s, "layer": L, "structure_low": (after if s >= on else before)[0],
             "n_clusters": (after if s >= on else before)[1]} for L, on in onsets.items() for s in steps]
    return pd.DataFrame(rows)


def test_schedule_fraction_is_the_nearest_logged_step():
    log = planted(total=1200)
    assert schedule_fraction(log, 0.5) == 600
    assert schedule_fraction(log, 0.26) == 300  # 312 -> the nearest multiple of 50


@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.5, 0.25])
def test_lr_fraction_finds_the_cosines_known_crossing(fraction):
    total, warmup = 2400, 100
    log = planted(total=total, warmup=warmup)
    crossing = warmup + (total - warmup) * math.acos(2 * fraction - 1) / math.pi
    step = lr_fraction(log, fraction)
    assert step == 50 * math.ceil(crossing / 50)
    lr = log.lr()
    assert (lr.loc[lr.idxmax():step].iloc[:-1] > fraction * lr.max()).all()  # none before it


def test_loss_plateau_fires_after_the_planted_knee_and_never_before():
    knee = 1000
    log = planted(all_loss=lambda s: 6.0 - 0.002 * min(s, knee))
    assert loss_plateau(log, 1e-9) == knee + LOSS_WINDOW  # the first window without any drop
    step = loss_plateau(log, 0.05)
    assert knee < step <= knee + LOSS_WINDOW  # partly flat windows: after the knee, never before
    before = planted(all_loss=lambda s: 6.0 - 0.002 * s)  # no knee: the drop stays above the rate
    assert loss_plateau(before, 0.05) is None


def test_tail_slope_ratio_fires_once_the_general_text_slows():
    knee = 900
    log = planted(general=lambda s: 6.0 - 0.004 * min(s, knee) - 1e-5 * s, tail=lambda s: 7.0 - 0.003 * s)
    step = tail_slope_ratio(log, 2.0)
    assert knee < step <= knee + LOSS_WINDOW
    assert tail_slope_ratio(planted(general=lambda s: 6.0 - 0.004 * s, tail=lambda s: 7.0 - 0.003 * s), 2.0) is None


def test_structure_signals_wait_for_every_layer():
    log = planted(structure=structure_table({2: 500, 3: 800}))
    assert consensus_structure(log, 0.05) == 800  # the later layer decides
    assert cluster_count(log, 5) == 800 and cluster_count(log, 3.5) == 500  # the mean over layers
    assert consensus_structure(log, 0.3) is None and cluster_count(log, 6) is None
    assert consensus_structure(planted(), 0.05) is None  # no structure logged: never fires


def test_the_registered_rule_is_reproduced_from_the_committed_plans():
    for name, folder, seed in signal_cv.MAP_TRUNKS:
        trunk = signal_cv.load_trunk(name, ROOT / folder, seed)
        plan = json.loads((ROOT / folder / "plans" / f"seed{seed}.json").read_text())
        step = consensus_structure(trunk.log, 0.05)
        if plan["warmup_rule"] == "consensus-structure":
            assert step == plan_step(plan), name
        else:
            assert step is None, name


def test_trunk_log_and_registry_refuse_bad_input():
    good = planted().curves
    with pytest.raises(UserError, match="TrunkLog: curves must have the columns"):
        TrunkLog(good.drop(columns="lr"), 2400)
    with pytest.raises(UserError, match="domain 'all'"):
        TrunkLog(good[good["domain"] != "all"], 2400)
    with pytest.raises(UserError, match="total_steps must be a positive int"):
        TrunkLog(good, 0)
    with pytest.raises(UserError, match="register: name is a registered signal already"):
        register(SIGNALS["lr-fraction"])
    with pytest.raises(UserError, match="get_signal: name must be a registered signal"):
        get_signal("nope")
    with pytest.raises(UserError, match="TrunkLog.loss: domain must be logged"):
        planted().loss("code")


def _trunk(name, total, best):
    """A planted trunk whose CSE map is best at ``best`` (gain -0.1 there, -0.02 elsewhere) and
    whose consensus count reaches 5 at ``best``."""
    log = planted(total=total, structure=structure_table({2: best, 3: best}, steps=range(100, total + 1, 100)))
    steps = [s for s in (total // 8, total // 4, 3 * total // 8, total // 2, 3 * total // 4)]
    gains = pd.Series({s: (-0.1 if s == best else -0.02) for s in steps}).sort_index()
    return signal_cv.Trunk(name, log, gains)


def test_cross_validation_picks_the_signal_that_tracks_the_best_step():
    # best steps that are not one fraction of the schedule: only the count signal tracks them
    trunks = [_trunk("a", 2400, 600), _trunk("b", 2400, 1800), _trunk("c", 1600, 800), _trunk("d", 1600, 400)]
    signals = [SIGNALS["schedule-fraction"], SIGNALS["cluster-count"]]
    cv, grid = signal_cv.cross_validate(trunks, signals)
    good = cv.groupby("signal")["good"].sum()
    assert good["cluster-count"] == 4 and good["schedule-fraction"] < 4
    rule = signal_cv.choose_rule(cv, trunks, signals)
    assert rule["signal"] == "cluster-count" and rule["passes"]
    assert set(grid["signal"]) == {"schedule-fraction", "cluster-count"}


def test_the_held_out_trunk_never_sets_its_own_threshold():
    # three trunks best at half the schedule, one at an eighth: the fraction fit on the other
    # three is 0.5, which is not good on the fourth, although 0.125 would be
    trunks = [_trunk("a", 2400, 1200), _trunk("b", 1600, 800), _trunk("c", 2400, 1200), _trunk("d", 2400, 300)]
    fraction = Signal("fraction", "test", True, (0.125, 0.5), schedule_fraction)
    cv, _ = signal_cv.cross_validate(trunks, [fraction])
    held = cv.set_index("held_out")
    assert held.loc["d", "threshold"] == 0.5 and not held.loc["d", "good"]
    assert held.loc[["a", "b", "c"], "good"].all()


def test_the_plans_record_is_the_committed_cross_validation():
    rule = json.loads((ROOT / "figures" / "warmup-map" / "signals" / "rule.json").read_text())
    for key in ("signal", "threshold", "cv_good", "trunks", "cv_record"):
        assert CROSS_VALIDATED[key] == rule[key], key
    verdicts = ROOT / "figures" / "warmup-map" / "fresh" / "verdicts.json"
    if verdicts.is_file():  # the record says the registered verdict as the committed table has it
        fresh = json.loads(verdicts.read_text())["rule_on_fresh_trunks"]
        assert CROSS_VALIDATED["fresh_verdict"] == fresh["verdict"]
        assert CROSS_VALIDATED["fresh"].startswith(fresh["verdict"]), (CROSS_VALIDATED["fresh"], fresh["verdict"])
        assert CROSS_VALIDATED["fresh_good"] == {k: [f["good"], f["judged"]] for k, f in fresh["per_family"].items()}
        good, judged = (sum(g[i] for g in CROSS_VALIDATED["fresh_good"].values()) for i in (0, 1))
        assert f"good in {good} of the {judged} fresh trunks" in CROSS_VALIDATED["fresh"]
        trunks = pd.read_csv(verdicts.parent / "trunks.csv")
        best = trunks.loc[trunks["signal"].str.startswith("rule"), "best_fraction"]
        assert CROSS_VALIDATED["fresh_best_fraction"] == [best.min(), best.max(), int((best == best.max()).sum())]
    else:
        assert CROSS_VALIDATED["fresh"].startswith("not yet run")


def test_warmup_record_and_schedule_length(tmp_path):
    record = warmup_record(400, "stable-clusters", 2400)
    assert record["cross_validated"]["step"] == 1200 and record["measured_step"] == 400
    assert "good in 6 of 7" in record["summary"] and "step 1200" in record["summary"]
    unknown = warmup_record(400, "stable-clusters", None)
    assert unknown["cross_validated"]["step"] is None and "--schedule-steps" in unknown["summary"]
    with pytest.raises(UserError, match="schedule_fraction_step: total_steps must be a positive int"):
        schedule_fraction_step(0, 0.5)
    assert schedule_length(tmp_path) is None
    (tmp_path / "train_config.json").write_text(json.dumps({"steps": 900}))
    assert schedule_length(tmp_path) == 900
    (tmp_path / "train_config.json").write_text("{not json")
    assert schedule_length(tmp_path) is None
