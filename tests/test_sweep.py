"""The sweep (ntkscope.reproduction.sweep): every arm kind trains, resumes and is tabulated, at toy size."""

import json

import pandas as pd
import pytest

from ntkscope.reproduction.settings import settings_for
from ntkscope.reproduction.sweep import ARMS, Sweep


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    run = tmp_path_factory.mktemp("sweep")
    settings = settings_for("smoke", steps=30, checkpoint_every=10, early_every=0, seeds=2, cse_samples=64,
                            min_cluster_size=5, min_samples=3)
    sweep = Sweep(run, settings, arms=("dense", "cse-rule", "demix", "switch-rule"),
                  gc_peak_step=10, layers=(0, 1))
    return sweep, sweep.run(poll=0.1)


def test_every_unit_finishes_with_its_plan_and_tables(swept):
    sweep, verdict = swept
    arms = pd.read_csv(sweep.run_dir / "tables" / "arms.csv")
    assert sorted(map(tuple, arms[["arm", "seed"]].to_numpy())) == sorted(
        (a.name, s) for a in sweep.arms for s in (0, 1))
    plan = json.loads((sweep.run_dir / "plans" / "seed0.json").read_text())
    assert plan["warmup_rule"] in ("small-clusters-persist", "window-end") and plan["warmup_steps"] == 10
    assert (arms.loc[arms.arm != "dense", "warmup"] == 10).all() and arms.loc[arms.arm == "dense", "warmup"].isna().all()
    paired = pd.read_csv(sweep.run_dir / "tables" / "paired.csv")
    assert set(paired.arm) == {"cse-rule", "demix", "switch-rule"} and (paired.seeds == 2).all()
    load = pd.read_csv(sweep.run_dir / "tables" / "load.csv")
    assert set(load.arm) == {"cse-rule"} and {"n legal", "n biomedical"} <= set(load.columns)
    assert (load.groupby(["seed", "step", "layer"])["share"].sum().round(9) == 1).all()
    assert verdict["cse-rule"]["status"] == "complete" and verdict["cse-late"] == {"status": "not run"}
    json.loads((sweep.run_dir / "tables" / "verdict.json").read_text())  # strict JSON


def test_a_finished_sweep_resumes_without_work(swept):
    sweep, verdict = swept
    before = {p: p.stat().st_mtime_ns for p in (sweep.run_dir / "results").glob("*.json")}
    text = (sweep.run_dir / "tables" / "verdict.json").read_text()
    Sweep(sweep.run_dir, sweep.settings, arms=[a.name for a in sweep.arms], gc_peak_step=10, layers=(0, 1)).run()
    assert (sweep.run_dir / "tables" / "verdict.json").read_text() == text
    assert {p: p.stat().st_mtime_ns for p in (sweep.run_dir / "results").glob("*.json")} == before


def test_an_arm_that_trains_what_a_finished_one_did_takes_its_result(swept, monkeypatch):
    sweep, _ = swept
    late = next(a for a in ARMS if a.name == "cse-late")
    rule = json.loads(sweep.result_path("cse-rule", 0).read_text())
    monkeypatch.setattr(sweep, "warmup", lambda arm, seed: rule["warmup"])  # the late step = the rule's fallback
    result = sweep.run_unit(late, 0)
    assert result["same_as"] == "cse-rule" and result["ppl"] == rule["ppl"]
    assert not sweep.model_dir("cse-late", 0).exists() and sweep.done("cse-late", 0)
    sweep.result_path("cse-late", 0).unlink()


def test_bad_arms_layers_and_other_settings_are_refused(swept, tmp_path):
    sweep, _ = swept
    with pytest.raises(ValueError, match=r"Sweep: arms must name one or more arms of .* \(got \['nope'\]\)"):
        Sweep(tmp_path / "a", sweep.settings, arms=("dense", "nope"))
    with pytest.raises(ValueError, match=r"Sweep: arms must include 'dense'"):
        Sweep(tmp_path / "b", sweep.settings, arms=("cse-rule",))
    with pytest.raises(ValueError, match=r"Sweep: layers must be block indices in \[0, 2\) \(got \[2, 3\]\)"):
        Sweep(tmp_path / "c", sweep.settings)
    with pytest.raises(ValueError, match=r"Sweep: run_dir holds a sweep with other settings"):
        Sweep(sweep.run_dir, sweep.settings.replace(steps=50), layers=(0, 1))


def test_each_arm_is_paired_with_the_trunk_it_branched_from():
    """A re-made trunk (the same seed trained again) pairs with the arms branched from it, and the
    original with the rest; DEMix's gap stays against its own trunk."""
    import math

    from ntkscope.reproduction.sweep_tables import paired

    e = math.e
    arms = pd.DataFrame([
        {"arm": "dense", "seed": 0, "kind": "dense", "trunk": "dense", "ppl legal": e ** 5.0},
        {"arm": "dense", "seed": 1, "kind": "dense", "trunk": "dense", "ppl legal": e ** 5.0},
        {"arm": "dense-remade", "seed": 1, "kind": "dense", "trunk": "dense", "ppl legal": e ** 5.2},
        {"arm": "demix", "seed": 0, "kind": "demix", "trunk": "dense", "ppl legal": e ** 4.6},
        {"arm": "demix", "seed": 1, "kind": "demix", "trunk": "dense", "ppl legal": e ** 4.6},
        {"arm": "cse-gc", "seed": 0, "kind": "cse", "trunk": "dense", "ppl legal": e ** 4.9},
        {"arm": "cse-gc", "seed": 1, "kind": "cse", "trunk": "dense-remade", "ppl legal": e ** 5.1},
    ])
    table = paired(arms).set_index("arm")
    assert "dense-remade" not in table.index  # a trunk, not an arm
    row = table.loc["cse-gc"]
    assert row["diff_per_seed"] == "-0.1000 -0.1000"  # seed 1 against the re-made trunk (5.1 - 5.2)
    assert row["gap_closed"] == pytest.approx(0.1 / 0.4)
    assert table.loc["demix", "mean_diff"] == pytest.approx(-0.4)
