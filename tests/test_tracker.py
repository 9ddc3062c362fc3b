"""GC inside a training loop: the tracker's rows equal a separate gradient_consistency_groups call
on the checkpoint of the same step, in a Hugging Face Trainer and in cse-train; training's losses
are the same with and without it; the kernel alignment against its definition; resume."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cse_models.data import pack_blocks
from cse_models.train import TrainConfig, main as cse_train, train
from ntkscope import Resampling, gradient_consistency_groups, load_checkpoint
from ntkscope.core.checks import UserError
from ntkscope.kernel.options import KernelOptions
from ntkscope.plotting import gc_over_steps
from ntkscope.representation.plan import gc_peak
from ntkscope.gc.groups import GC_OUTPUT, analysis_controls
from ntkscope.gc.tracker import GCTracker, Probes, kernel_cka
from ntkscope.text.corpus.pack import load_pack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the columns that must agree with a separate call (statistics, nulls, conditioning)
COMPARED = ["abs_gc", "gc", "abs_gc_low", "abs_gc_high", "null_low", "null_median", "null_high",
            "null_homogeneous_median", "null_matched-length_median", "null_matched-loss_median", "sign_confidence",
            "mean_gradient", "eigenvalue", "eigengap", "eigengap_subset", "cos_ones"]
FAST = Resampling(resamples=40, null_draws=40, seed=3)


def test_kernel_cka_is_the_centred_alignment():
    rng = np.random.default_rng(0)
    A = rng.normal(size=(12, 5))
    B = A + 0.7 * rng.normal(size=(12, 5))
    K, L = A @ A.T, B @ B.T
    H = np.eye(12) - np.ones((12, 12)) / 12
    reference = np.trace(K @ H @ L @ H) / np.sqrt(np.trace(K @ H @ K @ H) * np.trace(L @ H @ L @ H))
    assert kernel_cka(K, L) == pytest.approx(reference, rel=1e-12)
    assert 0.3 < kernel_cka(K, L) < 0.999
    assert kernel_cka(K, 3 * K + 2) == pytest.approx(1.0)  # scale- and shift-free (a constant is centred away)
    assert np.isnan(kernel_cka(np.ones((4, 4)), K[:4, :4]))


def _labels(probes: Probes) -> np.ndarray:
    labels = np.full(probes.n, "the rest", dtype=object)  # groups left out of the probes are measured, not compared
    for name, idx in probes.groups.items():
        labels[idx] = name
    return labels


def _separate(model, probes: Probes, resampling=FAST) -> pd.DataFrame:
    """What a researcher would call by hand on the checkpoint."""
    controls = analysis_controls(model, probes.batch, pools=probes.pools, output=GC_OUTPUT)
    return gradient_consistency_groups(model, probes.batch, _labels(probes), resampling=resampling,
                                       controls=controls, output=GC_OUTPUT).to_frame().set_index("label")


def _assert_rows_equal(tracked: pd.DataFrame, separate: pd.DataFrame) -> None:
    rows = tracked[tracked["layer"] == "all"].set_index("label")
    separate = separate.loc[rows.index]
    for column in COMPARED:
        np.testing.assert_allclose(rows[column].to_numpy(float), separate[column].to_numpy(float), rtol=2e-4,
                                   atol=2e-6, err_msg=column)
    assert list(rows["versus_null"]) == list(separate["versus_null"])


def test_a_probe_leaves_training_as_it_was_and_equals_a_separate_call(gpt, lm_batch, tmp_path):
    probes = Probes(lm_batch, {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}, pools=[[0, 1, 4, 5]])
    tracker = GCTracker(probes, every=2, out=tmp_path / "track", resampling=FAST, per_layer=True,
                        options=KernelOptions(output=GC_OUTPUT, method="exact"))
    gpt.train()
    gpt.lm_head.eval()  # a mixed state, put back as it was
    grads = {n: torch.full_like(p, 0.5) for n, p in gpt.named_parameters()}
    for n, p in gpt.named_parameters():
        p.grad = grads[n].clone()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    np.random.seed(7)
    assert tracker.step(gpt, 1) is None  # not a probe step: the cost estimate only
    assert tracker.cost.seconds > 0 and tracker.cost.method in ("exact", "structured")
    rows = tracker.step(gpt, 2)
    assert torch.equal(torch.rand(3), expected) and np.random.rand() == np.random.RandomState(7).rand()
    assert gpt.training and not gpt.lm_head.training
    assert all(torch.equal(p.grad, grads[n]) for n, p in gpt.named_parameters())
    gpt.eval()
    _assert_rows_equal(rows, _separate(gpt, probes))
    assert set(rows["layer"]) == {"all", "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                                  "transformer.ln_f"}
    saved = np.load(tmp_path / "track" / "kernels" / "step-000002.npz")
    np.testing.assert_allclose(sum(saved[k] for k in saved.files if k != "all"), saved["all"], rtol=1e-10)
    assert rows["kernel_cka"].isna().all()  # nothing to align with yet
    with torch.no_grad():
        gpt.transformer.h[1].mlp.c_fc.weight.mul_(1.5)
    second = tracker.step(gpt, 4)
    whole = second[second["layer"] == "all"]["kernel_cka"]
    assert (whole < 1).all() and (whole > 0.5).all()
    frame = pd.read_csv(tmp_path / "track" / "gc.csv")
    assert list(frame.columns[:3]) == ["step", "label", "layer"] and sorted(set(frame["step"])) == [2, 4]


def test_a_probe_keeps_the_budgets_malloc_threshold_only_when_max_memory_is_asked(gpt, lm_batch, monkeypatch):
    from ntkscope.core import memory

    fixed = []
    monkeypatch.setattr(memory, "_mallopt", lambda mmap, trim: fixed.append(mmap))  # no real mallopt calls
    monkeypatch.setattr(memory, "_pinned", False)
    probes = Probes(lm_batch, {"a": [0, 1, 2, 3]})
    for max_memory, expected in ((None, []), (2 << 30, [memory._MMAP_THRESHOLD])):
        monkeypatch.setattr(memory, "_threshold_fixed", False)  # as training leaves them
        fixed.clear()
        tracker = GCTracker(probes, every=1, resampling=None,
                            options=KernelOptions(output=GC_OUTPUT, method="structured", max_memory=max_memory))
        tracker.probe(gpt, 1)
        assert fixed == expected, max_memory


def test_the_tracker_resumes_and_refuses_other_options(gpt, lm_batch, tmp_path):
    probes = Probes(lm_batch, {"a": [0, 1, 2, 3, 4]})
    out = tmp_path / "track"
    first = GCTracker(probes, every=2, out=out, resampling=FAST)
    for step in (2, 4, 6):
        first.step(gpt, step)
    before = first.frame
    again = GCTracker(probes, every=2, out=out, resampling=FAST)  # a run resumed from its step-4 checkpoint
    assert len(again.frame) == 3
    again.step(gpt, 6)
    after = pd.read_csv(out / "gc.csv")
    assert list(after["step"]) == [2, 4, 6]  # step 6 measured again, once
    np.testing.assert_allclose(after["kernel_cka"], before["kernel_cka"], equal_nan=True)  # from kernels/
    assert after["kernel_cka"].iloc[2] == pytest.approx(1.0)
    with pytest.raises(UserError, match="GCTracker.*out.*other probes or options"):
        GCTracker(probes, every=3, out=out, resampling=FAST)
    series = again.series("a")
    assert "label" not in series and gc_peak(series)["shown"] in (True, False)  # a gc_series reader takes it


def test_bad_tracker_input_is_named(gpt, lm_batch, monkeypatch):
    with pytest.raises(UserError, match="GCTracker.*probes.*Probes"):
        GCTracker(lm_batch)
    with pytest.raises(UserError, match="^GCTracker: every must be a positive integer"):
        GCTracker(Probes(lm_batch, {"a": [0, 1]}), every=0)
    with pytest.raises(UserError, match="^Probes: subset.*at least 2"):
        Probes(lm_batch, {"a": [3]})
    with pytest.raises(UserError, match="^Probes.from_data: by must be one of"):
        Probes.from_data(None, by="domain")
    from ntkscope.gc import tracker as module

    monkeypatch.setattr(module.distributed, "world", lambda: (0, 2))
    monkeypatch.setattr(module.distributed, "active", lambda: True)
    with pytest.raises(UserError, match="^GCTracker.probe: world must be 1: the tracker runs in single-process"):
        GCTracker(Probes(lm_batch, {"a": [0, 1]})).probe(gpt, 1)
    monkeypatch.undo()
    with pytest.raises(UserError, match="^GCTracker: method must be one of"):
        GCTracker(Probes(lm_batch, {"a": [0, 1]}), options=KernelOptions(method="matrix-free"))


def _blocks(tokenizer, n: int, seq_len: int) -> list:
    return list(pack_blocks(load_pack(None), tokenizer, "train", seq_len, None).input_ids[:n])


def test_gc_callback_in_a_hugging_face_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ntkscope import GCCallback

    torch.set_default_dtype(torch.float32)
    tok = load_pack(None).tokenizer()
    data = [{"input_ids": b, "labels": b} for b in _blocks(tok, 64, 32)]
    probes = Probes.load("default", tok, n=24, seq_len=32, by="frequency-bins", bins=2, min_count=2)

    def run(name, callbacks):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(config)  # dropout 0.1: the losses depend on the RNG stream
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=8,
                                              per_device_train_batch_size=8, learning_rate=3e-3, save_steps=4,
                                              logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                              dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    tracker = GCTracker(probes, every=4, out=tmp_path / "track", resampling=FAST)
    assert run("tracked", [GCCallback(tracker)]) == run("plain", [])
    frame = pd.read_csv(tmp_path / "track" / "gc.csv")
    assert sorted(set(frame["step"])) == [4, 8]
    for step in (4, 8):
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tracked" / f"checkpoint-{step}")
        _assert_rows_equal(frame[frame["step"] == step], _separate(model.eval(), probes))


def _write_config(tmp_path, name: str, track: dict | None) -> Path:
    spec = {"out_dir": str(tmp_path / name), "model": {"n_layer": 2, "n_embd": 32, "n_head": 2},
            "data": {"seq_len": 32, "split": "validation"}, "steps": 8, "batch_size": 8, "checkpoint_every": 4,
            "log_every": 4, "warmup_steps": 3, "lr": 3e-3, "tensorboard": False}
    if track:
        spec["track"] = track
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def test_cse_train_tracks_gc_and_trains_the_same(tmp_path):
    torch.set_default_dtype(torch.float32)
    track = {"every": 4, "n": 24, "seq_len": 32, "by": "tail", "tail_fraction": 0.34, "resamples": 40,
             "null_draws": 40, "seed": 3}
    assert cse_train([str(_write_config(tmp_path, "tracked", track))]) == 0
    assert cse_train([str(_write_config(tmp_path, "plain", None))]) == 0

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert losses("tracked") == losses("plain")
    frame = pd.read_csv(tmp_path / "tracked" / "track" / "gc.csv")
    assert list(frame["step"]) == [4, 8] and set(frame["label"]) == {"tail"}
    tok = load_pack(None).tokenizer()
    probes = Probes.load("default", tok, n=24, seq_len=32, seed=3, tail_fraction=0.34)
    for step in (4, 8):
        model = load_checkpoint(tmp_path / "tracked" / "checkpoints" / f"step-{step:06d}")
        _assert_rows_equal(frame[frame["step"] == step], _separate(model, probes))
    gc_over_steps(frame)  # the plotting function takes the file as it is
    with pytest.raises(UserError, match="track.by"):
        TrainConfig.from_dict({"track": {"every": 4, "by": "domain"}})


def test_train_callbacks_receive_the_model(tmp_path):
    torch.set_default_dtype(torch.float32)
    seen = []
    cfg = TrainConfig.load(_write_config(tmp_path, "cb", None), steps=3)
    train(cfg, callbacks=[lambda step, metrics, model: seen.append((step, metrics["loss"], model.training))])
    assert [s for s, _, _ in seen] == [1, 2, 3] and all(training for _, _, training in seen)


def test_a_table_of_several_subsets_is_refused_by_the_series_readers(gpt, lm_batch):
    tracker = GCTracker(Probes(lm_batch, {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}), every=1, resampling=FAST)
    for step in (1, 2, 3):
        tracker.step(gpt, step)
    with pytest.raises(UserError, match="one subset at one layer.*label.*'a', 'b'"):
        gc_peak(tracker.frame)
    assert gc_peak(tracker.series("b"))["shown"] in (True, False)


def test_stratified_probes_give_each_domain_as_many_sentences(caplog):
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.sentences import load_analysis_data

    tok = load_pack(None).tokenizer()
    data = load_analysis_data("default", tok, seq_len=32, per_group=7, seed=1)
    counts = data.labels["label"].value_counts()
    assert set(counts.index) == {"general", "legal", "biomedical"} and (counts == 7).all()
    uniform = load_analysis_data("default", tok, n=21, seq_len=32, seed=1).labels["label"].value_counts()
    assert uniform.get("general", 0) > 7  # drawn uniformly, the common domain takes most of them
    probes = Probes.load("default", tok, seq_len=32, per_group=7, seed=1, tail_fraction=0.34)
    assert probes.n == 21
    with caplog.at_level("INFO", logger="ntkscope.text.sentences"):
        load_analysis_data("default", tok, seq_len=16, per_group=10**5)
    assert "fewer than per_group" in caplog.text  # every row of each label
    with pytest.raises(UserError, match="per_group must be a positive integer"):
        load_analysis_data("default", tok, per_group=0)
