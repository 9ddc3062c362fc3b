"""Training: exact resume after a kill, data-parallel equality, CSE conversion mid-run,
domain finetuning, the command, and its errors."""

import importlib.util
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from cse_models import SparseConfig, load_model
from cse_models.train import TrainConfig, lr_factor, train
from ntkscope.core.files import load_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def config(tmp_path, name="run", **overrides):
    base = {
        "out_dir": str(tmp_path / name),
        "model": {"n_layer": 2, "n_embd": 32, "n_head": 2,
                  "sparse": {"kind": "cse", "layers": [1], "n_experts": [0], "proj_dim": 8}},
        "data": {"seq_len": 32, "split": "validation"},
        "cse": {"convert_at": 6, "n_samples": 128, "min_samples": 3, "eps": 0.11, "rule": "dbscan-knee",
                "representation": "raw"},  # 3 experts at step 6 (turn 1's rule and representation)
        "steps": 14, "batch_size": 8, "checkpoint_every": 4, "log_every": 2, "warmup_steps": 3, "lr": 3e-3,
    }
    base.update(overrides)
    return TrainConfig.from_dict(base)


def weights(checkpoint):
    return load_file(str(Path(checkpoint) / "model.safetensors"))


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


class Killed(Exception):
    pass


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    torch.set_default_dtype(torch.float32)
    full = train(config(tmp_path, "full"))

    def kill_at(step, _metrics, _model):
        if step == 10:  # two steps after the checkpoint at 8: their work is lost
            raise Killed

    with pytest.raises(Killed):
        train(config(tmp_path, "killed"), callbacks=[kill_at])
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step-000004", "step-000008"]
    resumed = train(config(tmp_path, "killed"))
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and any(".experts.1." in k for k in a)  # CSE conversion happened (step 6)
    rows = {name: pd.read_csv(tmp_path / name / "metrics.csv") for name in ("full", "killed")}
    for table in rows.values():  # one row per logging step (log_every 2), the resumed run's redone rows once
        assert list(table["step"]) == [2, 4, 6, 8, 10, 12, 14]
        assert (table["tokens_per_s"] > 0).all() and (table["ppl"] == np.exp(table["loss"])).all()
        load = table[[c for c in table if c.startswith("load/transformer.h.1.mlp/")]]
        assert load.loc[table["step"] <= 6].isna().all().all()  # no experts before the conversion
        np.testing.assert_allclose(load.loc[table["step"] > 6].sum(axis=1), 1.0)
    np.testing.assert_allclose(rows["full"]["loss"], rows["killed"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(rows["full"]["loss"], np.mean(np.reshape(losses(tmp_path / "full"), (7, 2)), axis=1))
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "killed" / "tensorboard")).Reload()
        assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12, 14]  # step 10 purged, redone
        assert "load/transformer.h.1.mlp/expert_0" in events.Tags()["scalars"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert losses(tmp_path / "full") == losses(tmp_path / "killed")  # the log was rewound, not duplicated
    cfg = config(tmp_path, "full")
    for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines():  # the schedule survives the conversion
        m = json.loads(line)
        assert m["lr"] == pytest.approx(cfg.lr * lr_factor(m["step"] - 1, cfg), rel=1e-12)
    state = json.loads((Path(resumed) / "trainer_state.json").read_text())
    assert state["step"] == 14 and load_model(resumed).config.sparse.n_experts[0] >= 1


def test_two_process_gloo_matches_one_process(tmp_path):
    torch.set_default_dtype(torch.float32)
    dense = {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2}, "steps": 6, "checkpoint_every": 6}
    single = config(tmp_path, "single", **dense)
    train(single)
    cfg_path = tmp_path / "ddp.json"
    ddp = config(tmp_path, "ddp", **dense)
    cfg_path.write_text(json.dumps(dataclasses.asdict(ddp)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29517", "-m", "cse_models.train", str(cfg_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "ddp")), torch.tensor(losses(tmp_path / "single")),
                               rtol=1e-5, atol=1e-6)
    a, b = weights(tmp_path / "single/checkpoints/step-000006"), weights(tmp_path / "ddp/checkpoints/step-000006")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_switch_and_demix_baselines_train_and_domain_finetuning_continues(tmp_path):
    torch.set_default_dtype(torch.float32)
    switch = train(config(tmp_path, "switch", model={"n_layer": 2, "n_embd": 32, "n_head": 2, "sparse": {
        "kind": "switch", "layers": [1], "n_experts": [3]}}, steps=4))
    log = [json.loads(x) for x in (tmp_path / "switch" / "metrics.jsonl").read_text().splitlines()]
    assert log[-1]["aux"] > 0 and sum(log[-1]["load"]["transformer.h.1.mlp"]) > 0
    demix = train(config(tmp_path, "demix", model={"n_layer": 2, "n_embd": 32, "n_head": 2, "sparse": {
        "kind": "demix", "layers": [0, 1], "domains": ["biomedical", "general", "legal"]}}, steps=4))
    assert load_model(demix).config.sparse.domains == ["biomedical", "general", "legal"]
    legal = train(config(tmp_path, "legal", init_from=str(switch), model={}, steps=2,
                         data={"seq_len": 32, "split": "validation", "domains": ["legal"]}))
    assert load_model(legal).config.sparse.kind == "switch"


def test_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"train: the corpus is too small for the batch: \d+ blocks of 32 tokens, batch_size=100000"):
        train(config(tmp_path, batch_size=100000))
    with pytest.raises(ValueError, match=r"SparseConfig: layers must be block indices in \[0, 2\)"):
        train(config(tmp_path, model={"n_layer": 2, "sparse": {"kind": "cse", "layers": [7], "n_experts": [0]}}))
    with pytest.raises(ValueError, match=r"TrainConfig: unknown keys \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})
    # each section is a typed configuration, checked when the file is read, before any data is loaded
    for section, message in [({"data": {"seqlen": 32}}, r"TrainConfig: data has unknown keys \['seqlen'\]"),
                             ({"data": {"seq_len": 0}}, r"TrainConfig: data.seq_len must be a positive integer"),
                             ({"data": {"text_files": ["a.txt"]}}, r"data.text_files needs data.tokenizer"),
                             ({"cse": {"convert_at": "soon"}}, r"cse.convert_at must be a step >= 0, 'auto'"),
                             ({"upcycle": {"n_experts": 4}}, r"upcycle needs convert_at: STEP \(got n_experts 4 alone\)"),
                             ({"upcycle": [1]}, r"TrainConfig: upcycle must be a mapping \(got list\)"),
                             ({"model": [1]}, r"TrainConfig: model must be a mapping of GPTConfig fields")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_dict(section)
    cfg = TrainConfig.from_dict({"data": {"seq_len": 32}, "cse": {"convert_at": 5, "rule": "kmeans"}})
    assert (cfg.data.seq_len, cfg.data.split, cfg.cse.convert_at, cfg.cse.router_options()["rule"]) == (
        32, "train", 5, "kmeans") and not cfg.upcycle
    with pytest.raises(ValueError, match=r"pack_blocks: domains \['medieval'\] have no records"):
        train(config(tmp_path, data={"seq_len": 32, "domains": ["medieval"]}))


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(55, cfg) == pytest.approx(0.55)


def test_cse_train_command(tmp_path):
    cfg = config(tmp_path, "cmd", steps=2, checkpoint_every=2, checkpoint_steps=[1])  # an early extra checkpoint
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg)))))
    proc = subprocess.run([sys.executable, "-m", "cse_models.train", str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr and "last checkpoint:" in proc.stdout
    assert list(pd.read_csv(tmp_path / "cmd" / "metrics.csv")["step"]) == [2]  # log_every 2: one row
    assert sorted(p.name for p in (tmp_path / "cmd" / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    with pytest.raises(ValueError, match=r"TrainConfig: checkpoint_steps must be a list of positive integer steps"):
        config(tmp_path, checkpoint_steps=[0])
    bad = subprocess.run([sys.executable, "-m", "cse_models.train", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("cse-train: error: TrainConfig.load:")


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    from cse_models import GPTConfig

    cfg = TrainConfig.load(path)
    if cfg.model:
        config = GPTConfig.from_dict({"vocab_size": 8192, "block_size": cfg.data.seq_len, **cfg.model})
        assert config.n_embd % config.n_head == 0
    else:
        assert cfg.init_from  # a finetuning run continues a checkpoint


@pytest.mark.gpu
def test_bf16_autocast_training_on_gpu(tmp_path):
    torch.set_default_dtype(torch.float32)
    last = train(config(tmp_path, "gpu", device="cuda", bf16=True, steps=8))
    log = losses(tmp_path / "gpu")
    assert len(log) == 8 and all(math.isfinite(x) for x in log) and log[-1] < log[0]
    assert load_model(last).config.sparse.n_experts[0] >= 1


def test_training_on_plain_text_files(tmp_path):
    torch.set_default_dtype(torch.float32)
    from ntkscope.text.corpus.pack import DEFAULT_PACK, load_pack

    pack = load_pack()
    for domain in ("legal", "general"):
        text = "\n\n".join(r.text for r in pack.records("validation") if r.domain == domain)
        (tmp_path / f"{domain}.txt").write_text(text, encoding="utf-8")
    cfg = config(tmp_path, "text", model={"n_layer": 1, "n_embd": 16, "n_head": 2},
                 data={"seq_len": 32, "tokenizer": str(DEFAULT_PACK / "tokenizer.json"),
                       "text_files": {"legal": [str(tmp_path / "legal.txt")], "general": [str(tmp_path / "general.txt")]}},
                 steps=3, checkpoint_every=3)
    last = train(cfg)
    assert load_model(last).config.vocab_size == 8192 and len(losses(tmp_path / "text")) == 3
    with pytest.raises(ValueError, match="data.text_files needs data.tokenizer"):
        train(config(tmp_path, "text2", data={"seq_len": 32, "text_files": {"legal": [str(tmp_path / "legal.txt")]}}))


def test_cse_branched_from_a_dense_run_shares_its_warm_up_exactly(tmp_path):
    """Known answers. A CSE run branched from a dense run at step 6 equals the CSE run trained
    from scratch with a 6-step warm-up (2 experts there). When DBSCAN finds one cluster (eps
    huge) the one expert is a copy of the dense FFN, so the run must follow the dense run."""
    from cse_models.checkpointing import branch_from

    dense_model = {"n_layer": 2, "n_embd": 32, "n_head": 2}
    dense = train(config(tmp_path, "dense", model=dense_model, steps=10, checkpoint_every=2))
    scratch = train(config(tmp_path, "scratch", steps=10))
    sparse = {"kind": "cse", "layers": [1], "n_experts": [0], "proj_dim": 8}
    for name, eps in (("one", 1e9), ("three", 0.11)):
        branch_from(tmp_path / "dense" / "checkpoints" / "step-000006", tmp_path / name, sparse=sparse)
        last = train(config(tmp_path, name, steps=10, cse={"convert_at": 6, "n_samples": 128, "min_samples": 3,
                                                           "eps": eps, "rule": "dbscan-knee", "representation": "raw"}))
        if name == "one":
            assert load_model(last).config.sparse.n_experts == [1]
            got = {k.replace(".experts.0.", "."): v for k, v in weights(last).items()
                   if not k.endswith((".projection", ".centres", ".radii", ".mean"))}  # the router's buffers
            want = weights(dense)
        else:
            assert load_model(last).config.sparse.n_experts == load_model(scratch).config.sparse.n_experts == [2]
            got, want = weights(last), weights(scratch)
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="branch_from: .* is a sparse model already"):
        branch_from(tmp_path / "three" / "checkpoints" / "step-000010", tmp_path / "again", sparse=sparse)
    with pytest.raises(FileNotFoundError, match="branch_from: .* is not a training checkpoint"):
        branch_from(tmp_path / "nowhere", tmp_path / "again", sparse=sparse)


def test_switch_upcycled_from_a_dense_run(tmp_path):
    """Sparse upcycling: a Switch run branched from a dense run at step 6 has the dense run's
    weights until then, and from step 6 on copies of the warmed-up FFN as its experts (with their
    AdamW state) and a fresh router; a resumed run ends where an uninterrupted one does."""
    from cse_models.experts import SwitchFFN
    from cse_models.checkpointing import branch_from

    dense_model = {"n_layer": 2, "n_embd": 32, "n_head": 2}
    train(config(tmp_path, "dense", model=dense_model, steps=10, checkpoint_every=2))
    sparse = {"kind": "switch", "layers": [1], "n_experts": [0]}
    model = {**dense_model, "sparse": sparse}
    start = branch_from(tmp_path / "dense" / "checkpoints" / "step-000006", tmp_path / "switch", sparse=sparse)
    assert load_model(start).config.sparse.n_experts == [0]  # dense until the upcycling step
    upcycle = {"convert_at": 6, "n_experts": 3}
    last = train(config(tmp_path, "switch", model=model, steps=7, checkpoint_every=7, upcycle=upcycle))
    switched = load_model(last)
    layer = switched.transformer.h[1].mlp
    assert isinstance(layer, SwitchFFN) and switched.config.sparse.n_experts == [3]
    from cse_models.cse import upcycle as upcycle_layers

    fresh = load_model(start)
    dense_ffn = {k: v.clone() for k, v in fresh.transformer.h[1].mlp.state_dict().items()}
    fresh.config.sparse = SparseConfig(kind="switch", layers=[1], n_experts=[0])
    assert upcycle_layers(fresh, upcycle["n_experts"]) == [3]  # the count of each layer
    up = fresh.transformer.h[1].mlp
    assert isinstance(up, SwitchFFN) and len(up.experts) == 3 and fresh.config.sparse.n_experts == [3]
    for expert in up.experts:  # every expert starts as the warmed-up FFN
        for key, value in expert.state_dict().items():
            assert torch.equal(value, dense_ffn[key]), key
    assert up.router.weight.shape == (3, 32)
    with pytest.raises(ValueError, match=r"train: upcycle needs a Switch or DEMix model"):
        train(config(tmp_path, "bad", model=dense_model, upcycle=upcycle))


def test_stop_at_ends_early_on_the_full_schedule(tmp_path):
    """A run with stop_at follows the full run's schedule and weights up to that step."""
    dense_model = {"n_layer": 2, "n_embd": 32, "n_head": 2}
    full = config(tmp_path, "full", model=dense_model, steps=10, checkpoint_every=2)
    train(full)
    short = train(config(tmp_path, "short", model=dense_model, steps=10, checkpoint_every=10, stop_at=6))
    assert short.name == "step-000006"
    want = weights(tmp_path / "full" / "checkpoints" / "step-000006")
    for key, value in weights(short).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
    rates = [json.loads(line)["lr"] for line in (tmp_path / "short" / "metrics.jsonl").read_text().splitlines()]
    assert rates == [lr_factor(s, full) * full.lr for s in range(6)]
    with pytest.raises(ValueError, match=r"TrainConfig: stop_at must be a step in \[1, steps=10\] or null \(got 11\)"):
        config(tmp_path, "bad", steps=10, stop_at=11)


def test_a_diverged_run_stops_at_the_first_non_finite_step_and_keeps_finite_checkpoints(tmp_path):
    """A defect found by a user's trial, kept fixed."""
    torch.set_default_dtype(torch.float32)
    dense = {"n_layer": 1, "n_embd": 16, "n_head": 2}
    with pytest.raises(ValueError, match=r"train: the (loss|weights) (is|are) not finite (at|after) step \d+"):
        train(config(tmp_path, "nan", model=dense, cse={}, lr=1e6, grad_clip=0, warmup_steps=0, steps=12,
                     checkpoint_every=1))
    for checkpoint in sorted((tmp_path / "nan" / "checkpoints").glob("step-*")):  # every one finite
        state = load_safetensors(checkpoint / "model.safetensors", "test")
        assert all(torch.isfinite(v).all() for v in state.values()), checkpoint.name
    for bad in ({"lr": float("inf")}, {"lr": float("nan")}, {"betas": [0.9, float("inf")]}):
        with pytest.raises(ValueError, match="must be finite numbers"):
            config(tmp_path, "x", **bad)


def test_resuming_from_non_finite_weights_is_refused(tmp_path):
    torch.set_default_dtype(torch.float32)
    dense = {"n_layer": 1, "n_embd": 16, "n_head": 2}
    last = train(config(tmp_path, "run", model=dense, cse={}, steps=4, stop_at=2, checkpoint_every=2))
    state = load_safetensors(last / "model.safetensors", "test")
    state["transformer.wte.weight"][0, 0] = float("nan")
    save_file(state, str(last / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"step-000002 holds non-finite weights; resume from an earlier checkpoint"):
        train(config(tmp_path, "run", model=dense, cse={}, steps=4, checkpoint_every=2))


def test_a_warmup_that_is_not_an_integer_is_refused():
    with pytest.raises(ValueError, match=r"TrainConfig: warmup_steps must be an integer >= 0 \(got 'ten'\)"):
        TrainConfig.from_dict({"warmup_steps": "ten"})


def test_command_line_overrides_are_checked_with_the_file_and_out_dir_must_be_a_directory(tmp_path, capsys):
    """--steps 2 rescues steps: 0; --out-dir naming a file is one line."""
    from cse_models.train import main as cse_train

    torch.set_default_dtype(torch.float32)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"out_dir": str(tmp_path / "run"), "model": {"n_layer": 1, "n_embd": 16, "n_head": 2},
                                "data": {"seq_len": 32, "split": "validation"}, "steps": 0, "batch_size": 4,
                                "tensorboard": False}))
    assert cse_train([str(path)]) == 1
    assert "steps must be a positive integer (got 0)" in capsys.readouterr().err
    assert cse_train([str(path), "--steps", "2"]) == 0
    (tmp_path / "a-file").write_text("x")
    assert cse_train([str(path), "--steps", "2", "--out-dir", str(tmp_path / "a-file")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"cse-train: error: train: out_dir {tmp_path / 'a-file'} exists and is not a directory"
