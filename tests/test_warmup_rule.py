"""The warm-up rule built on GC's uncertainty (docs/design.md §1.1): the GC peak read on the
excess over the random null from unflagged checkpoints, independent draws as a second source of
noise, and the plan's fallbacks (stable clusters, then the window's end)."""

import numpy as np
import pandas as pd
import pytest

import ntkscope as ns
from ntkscope.representation.plan import excess_series, stable_step


def _series(abs_gc, se=0.01, null_median=0.5, flags=""):
    steps = [10 * (i + 1) for i in range(len(abs_gc))]
    return pd.DataFrame({"step": steps, "abs_gc": abs_gc, "abs_gc_se": se, "null_median": null_median,
                         "flags": flags})


def test_gc_peak_is_read_on_the_excess_over_the_null_from_unflagged_checkpoints_only():
    clear = ns.gc_peak(_series([0.6, 0.9, 0.6]))
    assert clear["step"] == 20 and clear["shown"] and clear["on"] == "excess over the random null"
    assert clear["rise_z"] == pytest.approx(0.3 / (0.01 * np.sqrt(2)), rel=1e-3) and clear["left_out"] == []
    noisy = ns.gc_peak(_series([0.6, 0.9, 0.85], se=[0.01, 0.02, 0.03]))  # fall 0.05 < 1.645 * 0.036
    assert not noisy["shown"] and "the excess's fall to the last (step 30: 0.050) is within 1.645 standard errors " \
        "(0.059)" in noisy["why"]
    # random subsets peak as much: a global alignment event, no peak of the tail's own
    event = ns.gc_peak(_series([0.6, 0.9, 0.6], null_median=[0.5, 0.8, 0.5]))
    assert not event["shown"] and "no rise and fall" in event["why"]
    # the flagged checkpoint is left out: the rise is measured from the next one
    flagged = ns.gc_peak(_series([0.3, 0.62, 0.9, 0.6], flags=["eigengap sign", "", "", ""]))
    assert flagged["left_out"] == [10] and flagged["shown"] and flagged["step"] == 30
    from_flag = ns.gc_peak(_series([0.3, 0.89, 0.9, 0.6], flags=["eigengap", "", "", ""]))
    assert not from_flag["shown"] and "rise from the first unflagged checkpoint (step 20: 0.010)" in from_flag["why"]
    peak_flagged = ns.gc_peak(_series([0.6, 0.9, 0.6, 0.55], flags=["", "eigengap", "", ""]))
    assert peak_flagged["step"] != 20
    rising = ns.gc_peak(_series([0.6, 0.7, 0.9]))
    assert not rising["shown"] and "at the last unflagged checkpoint" in rising["why"]
    with pytest.raises(ValueError, match=r"gc_peak: gc must be a gc_series table with columns"):
        ns.gc_peak(pd.DataFrame({"step": [1], "gc": [0.5]}))


def test_gc_peak_takes_independent_draws_as_a_second_source_of_noise():
    one = _series([0.6, 0.9, 0.6])
    agree = pd.concat([one.assign(draw=d) for d in range(3)], ignore_index=True)
    assert ns.gc_peak(agree)["shown"] and ns.gc_peak(agree)["draws"] == 3
    # the draws disagree far more than each draw's own standard error says: the peak is not shown
    spread = pd.concat([_series(v).assign(draw=d) for d, v in enumerate([[0.6, 0.9, 0.6], [0.9, 0.6, 0.6],
                                                                         [0.6, 0.6, 0.9]])], ignore_index=True)
    assert not ns.gc_peak(spread)["shown"]
    series = excess_series(spread)
    assert series["excess"].tolist() == pytest.approx([0.2, 0.2, 0.2])
    assert series["excess_se"].iloc[0] == pytest.approx(np.std([0.1, 0.4, 0.1], ddof=1) / np.sqrt(3))


def test_plan_falls_back_to_stable_clusters_then_to_the_window_end():
    separation = pd.DataFrame({"step": [10, 10, 20, 20, 30, 30], "layer": [0, 1] * 3,
                               "separation": [1.0, 2.0, 2.0, 1.0, 1.0, 3.0]})
    noisy = _series([0.6, 0.9, 0.6], se=0.2)
    stability = pd.DataFrame({"step": [10, 20, 30], "layer": [1] * 3, "n_clusters": [2, 3, 3],
                              "n_noise": [0, 0, 0], "overlap_next": [0.9, 0.85, np.nan]})
    seen = []
    plan = ns.make_plan(separation, noisy, top_k=1, stability=lambda layers: (seen.append(layers), stability)[1])
    assert seen == [[1]] and plan.layers == [1] and plan.evidence["scores_at_step"] == 30
    assert plan.convert_at == 20 and plan.warmup_rule == "stable-clusters"  # step 10: 2 clusters, then 3
    assert plan.evidence["gc_peak"]["shown"] is False and plan.evidence["overlap"] == 0.8
    assert stable_step(stability, [1], overlap=0.88) is None
    loose = ns.make_plan(separation, noisy, top_k=1, stability=stability, overlap=0.95)
    assert loose.convert_at == 30 and loose.warmup_rule == "window-end"
    clear = ns.make_plan(separation, _series([0.6, 0.9, 0.6]), top_k=1,
                         stability=lambda layers: pytest.fail("not needed when the peak is shown"))
    assert clear.convert_at == 20 and clear.warmup_rule == "gc-peak" and clear.layers == [0]
