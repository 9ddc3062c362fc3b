"""The fresh trunks' registered verdicts (figures/warmup-map/fresh/CRITERIA.md) on planted CSE
maps whose answers are known."""

import pandas as pd

from ntkscope.reproduction.fresh_tables import Family, fresh_verdicts

STEPS = {"warmup-fresh": (2400, (300, 600, 900, 1200, 1800), (5, 6, 7, 8, 9)),
         "warmup-fresh-half": (1200, (200, 300, 500, 600, 900), (5, 6, 7)),
         "warmup-fresh-mix": (2400, (300, 600, 900, 1200, 1800), (5, 6, 7))}


def family(name, bad=(), drop=None):
    """CSE best at half the schedule (-0.08; -0.02 elsewhere) in every seed but those in ``bad``,
    whose best is the last step (-0.1) with half the schedule at -0.03; ``drop``: (seed, step)
    left out of the map."""
    total, steps, seeds = STEPS[name]
    rows = []
    for seed in seeds:
        for step in steps:
            if (seed, step) == drop:
                continue
            if seed in bad:
                gain = -0.1 if step == steps[-1] else (-0.03 if step == total // 2 else -0.02)
            else:
                gain = -0.08 if step == total // 2 else -0.02
            rows.append({"arm": "cse", "step": step, "seed": seed, "trunks": "cpu", "domain": "tail", "gain": gain,
                         "low": gain - 0.01, "high": gain + 0.01})
    return Family(name, pd.DataFrame(rows), {}, total, seeds)


THRESHOLDS = {"lr-fraction": 0.6, "loss-plateau": 0.018}


def test_the_rule_is_shown_at_nine_of_eleven_with_two_of_three_in_each_family():
    found, trunks = fresh_verdicts([family("warmup-fresh", bad=(9,)), family("warmup-fresh-half", bad=(7,)),
                                    family("warmup-fresh-mix", bad=(6,))], THRESHOLDS)
    rule = found["rule_on_fresh_trunks"]
    assert (rule["good"], rule["judged"], rule["verdict"]) == (8, 11, "not shown")  # 8 < 9
    found, _ = fresh_verdicts([family("warmup-fresh"), family("warmup-fresh-half", bad=(7,)),
                               family("warmup-fresh-mix", bad=(6,))], THRESHOLDS)
    assert (found["rule_on_fresh_trunks"]["good"], found["rule_on_fresh_trunks"]["verdict"]) == (9, "shown")
    found, _ = fresh_verdicts([family("warmup-fresh"), family("warmup-fresh-half"),
                               family("warmup-fresh-mix", bad=(5, 6))], THRESHOLDS)
    assert found["rule_on_fresh_trunks"]["good"] == 9  # but only 1 of 3 on the third mix
    assert found["rule_on_fresh_trunks"]["verdict"] == "not shown"
    assert found["step_or_position"]["best_fraction"] == {"5": 0.5, "6": 0.5, "7": 0.5}


def test_an_incomplete_map_leaves_the_rule_not_decided_and_signals_without_logs_unjudged():
    found, trunks = fresh_verdicts([family("warmup-fresh", drop=(5, 1800)), family("warmup-fresh-half"),
                                    family("warmup-fresh-mix")], THRESHOLDS)
    assert found["rule_on_fresh_trunks"]["verdict"] == "not decided"
    assert found["rule_on_fresh_trunks"]["judged"] == 10
    assert set(trunks.loc[trunks["signal"] == "lr-fraction", "verdict"]) == {"no log", "not decided"}
    assert found["gain_at_rule"]["warmup-fresh-half"]["step"] == 600
    assert found["gain_at_rule"]["warmup-fresh-half"]["per_seed"]["5"]["gain"] == -0.08


def test_a_map_of_two_builds_is_not_judged():
    mixed = family("warmup-fresh")
    gains = mixed.gains.copy()
    gains.loc[(gains["seed"] == 5) & (gains["step"] == 1800), "trunks"] = "another GPU"
    found, trunks = fresh_verdicts([Family(mixed.name, gains, {}, 2400, mixed.seeds), family("warmup-fresh-half"),
                                    family("warmup-fresh-mix")], THRESHOLDS)
    rule = trunks[(trunks["signal"].str.startswith("rule")) & (trunks["seed"] == 5) & (trunks["family"] == "warmup-fresh")]
    assert rule["verdict"].tolist() == ["not decided"] and found["rule_on_fresh_trunks"]["verdict"] == "not decided"



def test_a_family_that_can_no_longer_reach_its_count_decides_not_shown_before_the_rest_runs():
    """Verdict 1 needs 2 of 3 good trunks in the half family: once all three are judged with one
    good, no other trunk can change it (not shown), while a map that can still pass stays not
    decided."""
    half = family("warmup-fresh-half", bad=(6, 7))
    partial = [family("warmup-fresh", drop=(5, 1800)), half, family("warmup-fresh-mix", drop=(5, 1800))]
    rule = fresh_verdicts(partial, THRESHOLDS)[0]["rule_on_fresh_trunks"]
    assert rule["verdict"] == "not shown" and rule["judged"] == 9
    assert rule["decided_by"] == ["warmup-fresh-half: 1 good of 3 trunks, below 2"]
    only_half = fresh_verdicts([family("warmup-fresh-half", bad=(7,))], THRESHOLDS)[0]["rule_on_fresh_trunks"]
    assert only_half["verdict"] == "not decided" and "decided_by" not in only_half


def probe(fires_at):
    """A trunk probe's expert rows at the sparse layers {2, 3}: a pure tail expert of 8 blocks at
    both layers from ``fires_at`` on (None: never; before it the tail expert is mixed, 60 % tail)."""
    rows = []
    for step in (50, 100, 300, 600, 900, 1200, 1500, 1800):
        pure = fires_at is not None and step >= fires_at
        for layer in (2, 3):
            rows.append({"step": step, "layer": layer, "kind": "expert", "group": "0", "n": 100, "tail_share": 0.05})
            rows.append({"step": step, "layer": layer, "kind": "expert", "group": "1", "n": 8,
                         "tail_share": 1.0 if pure else 0.6})
    return pd.DataFrame(rows)


def with_probes(fam, fires):
    return Family(fam.name, fam.gains, fam.plans, fam.total_steps, fam.seeds, probes={s: probe(fires.get(s, 1200))
                                                                                     for s in fam.seeds})


def test_the_probe_rule_is_judged_on_the_mix_and_main_trunks_and_reported_on_the_half():
    """The addendum's tail-expert rule: good where it fires at or before the best step with 80 %
    of its gain (the planted best is half the schedule: step 1200), not good where it fires late or
    never; shown at 6 of the 8 trunks of warmup-fresh-mix and warmup-fresh."""
    main = with_probes(family("warmup-fresh"), {8: 1800, 9: None})  # late, never
    mix = with_probes(family("warmup-fresh-mix"), {})
    half = with_probes(family("warmup-fresh-half"), {5: 600})
    found, trunks = fresh_verdicts([main, half, mix], THRESHOLDS)
    v = found["tail_expert"]
    assert (v["good"], v["judged"], v["planned"], v["verdict"]) == (6, 8, 8, "shown")
    assert v["reported"]["warmup-fresh-half seed 5"] == {"step": 600, "verdict": "good"}
    rows = trunks[trunks["signal"] == "tail-expert"].set_index(["family", "seed"])
    assert rows.loc[("warmup-fresh", 9), "why"] == "the rule never fired"
    assert rows.loc[("warmup-fresh", 8), "verdict"] == "not good" and rows.loc[("warmup-fresh", 5), "step"] == 1200
    worse = with_probes(family("warmup-fresh"), {7: 1800, 8: 1800, 9: None})
    found, _ = fresh_verdicts([worse, with_probes(family("warmup-fresh-mix", drop=(5, 300)), {})], THRESHOLDS)
    assert found["tail_expert"]["verdict"] == "not shown"  # 2 + 2 good of 7 judged: 6 of 8 out of reach
    assert "out of reach" in found["tail_expert"]["decided_by"]
    assert found["tail_expert"]["rule_on_the_same_trunks"] == {"good": 7, "judged": 7}
