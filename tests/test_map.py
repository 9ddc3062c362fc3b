"""The warm-up map's summary (ntkscope.reproduction.map_tables, ntkscope.experiments.map): paired
gains with block-bootstrap intervals, the pre-registered verdicts, and the committed map
rebuilt from its committed results; the second corpus mix (ntkscope corpus thin)."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ntkscope.reproduction.map_tables import family, gains, verdicts

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ["general"] * 6 + ["legal"] * 3 + ["biomedical"] * 3


def _result(arm, seed, loss, *, kind="cse", step=1200):
    loss = np.asarray(loss, dtype=float)
    tokens = np.full(len(loss), 10)
    ppl = {d: math.exp(loss[[i for i, x in enumerate(DOMAINS) if x == d]].sum() / 30) for d in set(DOMAINS)}
    return {"arm": arm, "seed": seed, "kind": kind, "warmup": None if kind == "dense" else step,
            **{f"ppl {d}": v for d, v in ppl.items()}, "blocks": {"loss": loss.tolist(), "tokens": tokens.tolist()}}


def test_gains_are_paired_log_ratios_with_intervals_around_them():
    rng = np.random.default_rng(0)
    trunk = 40 + rng.random(12)
    arm = trunk - np.array([0.0] * 6 + [2.0] * 3 + [1.0] * 3)  # legal -0.2 nats/token... per block of 10 tokens
    results = {"dense-seed0": _result("dense", 0, trunk, kind="dense"), "cse-at1200-seed0": _result("cse-at1200", 0, arm)}
    table = gains(results, DOMAINS, n_boot=200).set_index("domain")
    assert table.loc["legal", "gain"] == pytest.approx(-2.0 / 10) and table.loc["biomedical", "gain"] == pytest.approx(-0.1)
    assert table.loc["tail", "gain"] == pytest.approx(-0.15) and table.loc["general", "gain"] == pytest.approx(0.0)
    # every block of a domain moved by the same amount: the interval is the point
    assert table.loc["legal", "low"] == pytest.approx(-0.2) and table.loc["legal", "high"] == pytest.approx(-0.2)
    assert (table["arm"] == "cse").all() and (table["step"] == 1200).all()
    assert table.loc["legal", "ppl_dense"] == pytest.approx(results["dense-seed0"]["ppl legal"])


def test_family_strips_the_step_suffix_only():
    assert family("cse-at300") == "cse" and family("cse-shuffled-at1200") == "cse-shuffled"
    assert family("dense-null") == "dense-null" and family("cse-l01") == "cse-l01"


def _table(rows):
    return pd.DataFrame([{"arm": a, "step": 1200, "seed": s, "trunks": "", "domain": "tail", "gain": g, "low": g,
                          "high": g, "ppl": None, "ppl_dense": None} for a, s, g in rows])


def test_the_pre_registered_verdicts():
    seeds = [0, 1, 2, 3, 4]
    null = [("dense-null", s, g) for s, g in zip(seeds, [-0.02, 0.01, 0.02, -0.01, 0.0])]
    cse = [("cse", s, -0.08) for s in seeds]
    shuffled = [("cse-shuffled", s, 0.04) for s in seeds]
    fair = [("switch-fair", s, g) for s, g in zip(seeds, [-0.09, -0.07, -0.07, -0.07, -0.07])]
    found = verdicts(_table(null + cse + shuffled + fair), seeds)
    assert found["clusters_vs_shuffled"]["verdict"] == "shown"  # 5 of 5, -0.12 beyond the 0.02 spread
    assert found["cse_vs_fair"]["verdict"] == "not shown"  # lower in 4 of 5, but by 0.008 < 0.02
    assert found["against_null"]["cse"]["verdict"] == "beats the noise floor"
    assert found["against_null"]["cse-shuffled"]["verdict"] == "worse than the noise floor"
    partial = verdicts(_table(null + cse + shuffled[:4]), seeds)
    v = partial["clusters_vs_shuffled"]
    assert v["verdict"] == "not decided" and "[4]" in v["why"] and v["on_seeds_ran"]["shown"]
    assert partial["cse_vs_fair"]["verdict"] == "not decided"


def test_a_difference_of_two_arms_is_also_read_against_its_own_spread():
    """The registered test reads a difference against one arm's null spread; the stricter reading
    beside it uses sqrt(2) x that spread, and says how much of the difference is the control's harm."""
    seeds = [0, 1, 2, 3, 4]
    null = [("dense-null", s, g) for s, g in zip(seeds, [-0.02, 0.01, 0.02, -0.01, 0.0])]  # spread 0.02
    cse = [("cse", s, -0.015) for s in seeds]
    shuffled = [("cse-shuffled", s, 0.01) for s in seeds]  # difference -0.025: beyond 0.02, within 0.0283
    fair = [("switch-fair", s, 0.02) for s in seeds]  # difference -0.035: beyond both
    found = verdicts(_table(null + cse + shuffled + fair), seeds)
    v = found["clusters_vs_shuffled"]
    assert v["verdict"] == "shown" and v["strict"]["verdict"] == "not shown"
    assert v["strict"]["difference_spread"] == pytest.approx(math.sqrt(2) * 0.02)
    assert v["strict"]["other_mean_gain"] == pytest.approx(0.01)
    assert v["strict"]["other_harm_share"] == pytest.approx(0.01 / 0.025)  # 40 % of the contrast is the harm
    w = found["cse_vs_fair"]
    assert w["verdict"] == "shown" and w["strict"]["verdict"] == "shown"
    helped = verdicts(_table(null + cse + [("cse-shuffled", s, -0.005) for s in seeds]), seeds)
    assert helped["clusters_vs_shuffled"]["strict"]["other_harm_share"] == 0.0  # a control that helps harms nothing


def test_the_rule_is_judged_against_each_trunks_map():
    steps = [300, 600, 900, 1200, 1800]
    curve = [-0.01, -0.05, -0.09, -0.10, -0.08]
    table = _table([])
    table = pd.DataFrame([{"arm": "cse", "step": st, "seed": 0, "trunks": "", "domain": "tail", "gain": g, "low": g,
                           "high": g} for st, g in zip(steps, curve)])
    plans = {0: {"convert_at": 900, "warmup_rule": "consensus-structure"}}
    assert verdicts(table, [0], plans=plans)["rule"]["0"]["verdict"] == "good"  # 0.09 >= 0.8 x 0.10, before 1200
    plans = {0: {"warmup_steps": 600, "warmup_rule": "consensus-structure"}}  # a plan of format 2 reads alike
    assert verdicts(table, [0], plans=plans)["rule"]["0"]["verdict"] == "not good"  # 0.05 < 0.08
    plans = {0: {"convert_at": 1200, "warmup_rule": "window-end"}}
    assert verdicts(table, [0], plans=plans)["rule"]["0"]["verdict"] == "the rule chose nothing"


def test_the_layer_pair_ranked_by_structure_is_judged_against_the_map():
    table = _table([("cse", 0, -0.09), ("cse-l01", 0, -0.03), ("cse", 1, -0.05), ("cse-l01", 1, -0.10),
                    ("cse", 2, -0.05), ("cse-l01", 2, -0.01)]).assign(trunks="a")
    def plan(structure):
        return {"convert_at": 900, "warmup_rule": "consensus-structure",
                "evidence": {"structure_rule": {"min_structure": 0.05},
                             "structure_by_layer": [{"layer": L, "structure": x} for L, x in enumerate(structure)]}}
    plans = {0: plan([0.0, 0.1, 0.2, 0.2]), 1: plan([0.0, 0.1, 0.2, 0.2]), 2: plan([0.01, 0.0, 0.02, 0.0])}
    found = verdicts(table, [0, 1, 2], plans=plans)["layers"]
    assert found["trunks"]["0"]["verdict"] == "agrees"  # {2, 3} ranked higher and lower in the map
    assert found["trunks"]["1"]["verdict"] == "disagrees" and found["trunks"]["1"]["map_better"] == [0, 1]
    assert found["trunks"]["2"]["verdict"] == "no choice"  # neither pair reaches min_structure
    assert (found["agree"], found["judged"]) == (1, 2)


def test_the_committed_map_is_its_committed_results(tmp_path):
    """gains.csv and verdicts.json are rebuilt, equal, from figures/warmup-map's H200 build alone;
    every verdict pairs arms on that one build; the H100's record is another model."""
    from ntkscope.experiments import load_spec
    from ntkscope.experiments.map import summarise_map

    folder = ROOT / "figures" / "warmup-map"
    shutil.copytree(folder / "tables", tmp_path / "tables")  # curves.csv is the GPU run's, not rebuilt here
    summarise_map([folder], tmp_path, load_spec("warmup-map"))
    table = pd.read_csv(tmp_path / "tables" / "gains.csv")
    pd.testing.assert_frame_equal(table, pd.read_csv(folder / "tables" / "gains.csv"))
    assert set(table["trunks"]) == {"NVIDIA H200"}
    found = json.loads((tmp_path / "tables" / "verdicts.json").read_text())
    assert found == json.loads((folder / "tables" / "verdicts.json").read_text())
    assert found["units"] == {"spec": "warmup-map", "planned": 84, "done": 84}
    for name in ("clusters_vs_shuffled", "cse_vs_fair"):
        assert found[name]["same_trunks"] == found[name]["seeds_ran"] == [0, 1, 2, 3, 4], name
    for arm, entry in found["against_null"].items():
        assert entry["same_trunks"] == entry["seeds_ran"], arm
    assert all(e["same_trunks"] for e in found["layers"]["trunks"].values())
    assert (tmp_path / "curves.png").is_file()
    # the H100's trunk is another model (a pair across the two would be wrong) ...
    h100 = json.loads((folder / "h100" / "results" / "dense-seed0.json").read_text())
    h200 = json.loads((folder / "results" / "dense-seed0.json").read_text())
    assert abs(np.log(h100["ppl legal"] / h200["ppl legal"])) > 1e-3
    # ... while the H200's re-made trunks (the fifth call's units branched from them) are float rounding away
    for path in sorted((folder / "remade" / "results").glob("dense-seed*.json")):
        remade = np.asarray(json.loads(path.read_text())["blocks"]["loss"])
        committed = np.asarray(json.loads((folder / "results" / path.name).read_text())["blocks"]["loss"])
        np.testing.assert_allclose(remade, committed, rtol=2e-6)
    # the trunk curves: every trunk, each domain every 50 steps to the end
    curves = pd.read_csv(folder / "tables" / "curves.csv")
    trunks = curves[curves["arm"] == "dense"]
    assert sorted(trunks["seed"].unique()) == [0, 1, 2, 3, 4]
    for _, part in trunks.groupby("seed"):
        assert sorted(part["step"].unique()) == list(range(50, 2401, 50))
        assert set(part["domain"]) == {"general", "legal", "biomedical", "all"}
    # the medium-scale hint (8 layers x 512, its own spec and trunks) is rebuilt the same way
    scale = folder / "scale"
    summarise_map([scale], tmp_path / "scale", load_spec("warmup-map-scale"))
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "scale" / "tables" / "gains.csv"),
                                  pd.read_csv(scale / "tables" / "gains.csv"))
    found = json.loads((tmp_path / "scale" / "tables" / "verdicts.json").read_text())
    assert found == json.loads((scale / "tables" / "verdicts.json").read_text())
    assert found["units"] == {"spec": "warmup-map-scale", "planned": 12, "done": 12}
    assert not (tmp_path / "scale" / "map.png").exists()  # one conversion step: no curve to draw


def test_thin_pack_halves_the_tail_in_train_only(tmp_path):
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.corpus.thin import thin_pack

    source = load_pack()
    out = load_pack(thin_pack(tmp_path / "half", {"legal": 0.5, "biomedical": 0.5}))
    count = lambda pack, split, d: sum(r.domain == d for r in pack.records(split))  # noqa: E731
    for d in ("legal", "biomedical"):
        assert count(out, "train", d) == round(0.5 * count(source, "train", d))
    assert count(out, "train", "general") == count(source, "train", "general")
    assert out.records("test") == source.records("test") and out.manifest["version"] != source.manifest["version"]
    assert out.manifest["derived_from"]["version"] == source.manifest["version"]
    assert 0.03 < out.manifest["share_measured_train"] < 0.04
    with pytest.raises(ValueError, match="thin_pack.*keep.*clinical"):
        thin_pack(tmp_path / "bad", {"clinical": 0.5})


def test_the_count_question_is_judged_against_its_registered_margin():
    from ntkscope.reproduction.map_tables import count_verdicts

    rows = []
    for seed, (e, l, el, le) in enumerate([(0.0, -0.10, -0.05, -0.02), (0.01, -0.09, -0.06, -0.03),
                                           (-0.01, -0.08, -0.03, 0.02)]):
        rows += [("cse", 300, seed, e), ("cse", 1200, seed, l), ("cse-at300-k1200", 300, seed, el),
                 ("cse-at1200-k300", 1200, seed, le)]
    table = pd.DataFrame([{"arm": a, "step": st, "seed": s, "trunks": "", "domain": "tail", "gain": g}
                          for a, st, s, g in rows])
    found = count_verdicts(table, [0, 1, 2], 0.04)
    late, early = found["count_matters_late"], found["count_brings_gain_early"]
    assert late["per_seed"] == pytest.approx({"0": 0.08, "1": 0.06, "2": 0.10})  # fewer experts lose the gain
    assert late["verdict"] == "shown" and late["share_of_late_gain"] == pytest.approx(0.08 / 0.09)
    assert early["per_seed"] == pytest.approx({"0": -0.05, "1": -0.07, "2": -0.02})
    assert early["verdict"] == "shown" and early["share_of_late_gain"] == pytest.approx((-0.14 / 3) / (-0.27 / 3))
    assert count_verdicts(table, [0, 1, 2], 0.09)["count_matters_late"]["verdict"] == "not shown"
    assert count_verdicts(table[table["seed"] < 2], [0, 1, 2], 0.04)["count_matters_late"]["verdict"] == "not decided"


def test_the_committed_count_question_is_its_committed_results(tmp_path):
    from ntkscope.experiments import load_spec
    from ntkscope.experiments.map import COUNT_MARGIN, summarise_map

    folder = ROOT / "figures" / "warmup-map" / "count"
    found = summarise_map([folder], tmp_path, load_spec("warmup-map-count"))
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "tables" / "gains.csv"),
                                  pd.read_csv(folder / "tables" / "gains.csv"))
    assert found == json.loads((folder / "tables" / "verdicts.json").read_text())
    # the margin is the one CRITERIA.md registered: sqrt(2) x the map's null spread, as committed before
    assert COUNT_MARGIN == pytest.approx(math.sqrt(2) * 0.029397706446627314, abs=5e-5)
    assert "0.0416" in (folder / "CRITERIA.md").read_text()
    experts = pd.read_csv(folder / "tables" / "experts.csv").set_index(["arm", "seed", "layer"])["experts"]
    for seed in (0, 1, 2):  # each fixed count is the other step's own
        for layer in (2, 3):
            assert experts[("cse-at1200-k300", seed, layer)] == experts[("cse-at300", seed, layer)]
            assert experts[("cse-at300-k1200", seed, layer)] == experts[("cse-at1200", seed, layer)]


def test_cse_is_judged_against_the_mixture_of_experts_from_scratch_when_the_spec_has_one():
    seeds = [0, 1, 2]
    null = [("dense-null", s, g) for s, g in zip(seeds, [-0.01, 0.01, 0.0])]  # spread 0.01
    cse = [("cse", s, -0.05) for s in seeds]
    found = verdicts(_table(null + cse + [("scratch", s, g) for s, g in zip(seeds, [0.02, -0.03, 0.01])]), seeds)
    v = found["cse_vs_scratch"]
    assert v["verdict"] == "shown" and v["wins"] == 3 and v["mean_difference"] == pytest.approx(-0.05)
    close = verdicts(_table(null + cse + [("scratch", s, g) for s, g in zip(seeds, [-0.06, -0.04, -0.045])]), seeds)
    assert close["cse_vs_scratch"]["verdict"] == "not shown"  # lower in 2 of 3 only
    assert "cse_vs_scratch" not in verdicts(_table(null + cse), seeds)  # the map's specs have no such arm


def test_the_verdicts_pair_arms_at_the_criteria_arms_step():
    from ntkscope.experiments.map import verdict_step
    from ntkscope.experiments.spec import load_spec
    assert verdict_step(load_spec("warmup-map")) == 1200
    assert verdict_step(load_spec("warmup-fresh-half")) == 600  # half the 1200-step schedule
    assert verdict_step(load_spec("scale-grown")) == 600


def test_trunks_are_compared_per_domain_on_the_same_blocks():
    from ntkscope.reproduction.map_tables import fits_its_data, trunk_perplexities
    domains = ["general"] * 4 + ["legal"] * 2

    def trunk(seed, nats):  # per-block losses of 10 tokens at ``nats`` per token, by domain
        loss = [10 * nats[d] for d in domains]
        return {"arm": "dense", "seed": seed, "blocks": {"loss": loss, "tokens": [10] * len(domains)}}

    big = {f"dense-seed{s}": trunk(s, {"general": 4.0 + s / 100, "legal": 4.5}) for s in (0, 1)}
    small = {f"dense-seed{s}": trunk(s, {"general": 5.0, "legal": 4.4 + s}) for s in (0, 1)}
    table = pd.concat([trunk_perplexities(big, domains, "big"), trunk_perplexities(small, domains, "small")])
    row = table[(table["model"] == "big") & (table["seed"] == 1) & (table["domain"] == "general")].iloc[0]
    assert row["ppl"] == pytest.approx(math.exp(4.01)) and row["blocks"] == 4 and row["tokens"] == 40
    found = fits_its_data(table, "big", "small")
    assert found["domains"]["general"]["below"] and not found["domains"]["legal"]["below"]  # 4.5 > small seed 0's 4.4
    assert found["verdict"] == "not shown"
    with pytest.raises(ValueError, match="has 6 test blocks, not the 5 of this pack"):
        trunk_perplexities(big, domains[:5], "big")


def test_the_map_figures_name_the_schedule_and_the_logging_interval():
    from ntkscope.reproduction.map_figures import map_curve, trunk_curves
    table = _table([("cse", 0, -0.05)])
    table = pd.concat([table, table.assign(step=600, gain=-0.02)])
    assert map_curve(table, total_steps=1200).axes[0].get_xlabel() == "conversion step (of 1200)"
    curves = pd.DataFrame([{"arm": "dense", "seed": 0, "domain": "general", "step": s, "loss": 5 - s / 1000, "lr": 1e-3}
                           for s in (100, 200, 300)])
    assert trunk_curves(curves).axes[0].get_title().endswith("every 100 steps")
