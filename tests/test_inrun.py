"""In-run GC (ntkscope.gc.inrun): the GC of a training batch's subsets from the factors of the
training step's own backward equals a separate gradient_consistency_groups call on the same
weights, batch and parameters, for a causal and a masked LM with padding; with a token-mean
training loss, ``loss_terms`` turns it into the mean-token-loss kernel."""

import numpy as np
import pytest
import torch

from ntkscope import LMLoss, gradient_consistency_groups
from ntkscope.gc.inrun import InRunGC
from ntkscope.kernel.objectives import call_model, resolve_output

transformers = pytest.importorskip("transformers")

LABELS = np.array(["a", "a", "b", "b", "b", "c", "c", "a"])


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 40, (8, 12), generator=g)
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[5, 4:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


def _names(model, modules):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(m.weight)] for m in modules]


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_in_run_gc_equals_a_separate_call_on_the_same_weights(kind):
    model, batch = _model(kind), _batch()
    output = "loss" if kind == "gpt2" else LMLoss(objective="masked", mask_token_id=4)
    objective = resolve_output(output, model)
    with InRunGC(model) as inrun:
        data = objective.prepare(model, batch)
        loss = objective.evaluate(lambda inputs: call_model(model, inputs), data).mean()  # a training step's loss
        loss.backward()
        rows = {r.label: r for r in inrun.gc(LABELS, dtype=torch.float64)}
    separate = gradient_consistency_groups(model, batch, LABELS, output=output, resampling=None, method="exact",
                                           params=_names(model, inrun.modules), dtype=torch.float64)
    assert set(rows) == {"a", "b", "c"}
    for label, r in rows.items():
        assert r.score == pytest.approx(separate.results[label].score, abs=1e-6)
        assert r.mean_gradient == pytest.approx(separate.results[label].mean_gradient, abs=1e-6)


def test_a_token_mean_loss_reads_the_mean_token_kernel_with_its_loss_terms():
    model, batch = _model("gpt2"), _batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    with InRunGC(model) as inrun:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # HF's token-mean loss
        terms = (labels[:, 1:] != -100).sum(1)
        rows = {r.label: r for r in inrun.gc(LABELS, loss_terms=terms, dtype=torch.float64)}
        plain = {r.label: r for r in inrun.gc(LABELS, dtype=torch.float64)}
        inrun_float32 = {r.label: r for r in inrun.gc(LABELS)}
        K = inrun.kernel()
    assert np.array_equal(K, K.T)  # float32 products, symmetric exactly (kernel_gc's check is strict)
    separate = gradient_consistency_groups(model, batch, LABELS, output="loss", resampling=None, method="exact",
                                           params=_names(model, inrun.modules), dtype=torch.float64)
    for label, r in rows.items():
        assert r.score == pytest.approx(separate.results[label].score, abs=1e-6)
    assert any(abs(plain[k].score - rows[k].score) > 1e-4 for k in rows)  # padding: the weighting matters
    for k, r in plain.items():  # the factors' own float32 products: the same rows to float32's precision
        assert r.score == pytest.approx(inrun_float32[k].score, abs=1e-4)


def test_in_run_gc_needs_a_step_and_one_label_per_sample():
    model = _model("gpt2")
    inrun = InRunGC(model)
    with pytest.raises(ValueError, match="InRunGC.kernel.*needs a training step first"):
        inrun.gc(LABELS)
    with pytest.raises(ValueError, match="InRunGC.*modules.*linear layers"):
        InRunGC(model, modules=[model.transformer.wte])
    batch = _batch()
    with inrun:
        model(**batch, labels=batch["input_ids"]).loss.backward()
        with pytest.raises(ValueError, match="labels.*one label per sample"):
            inrun.gc(LABELS[:3])


def test_the_in_run_tracker_in_cse_train_reads_each_batch_and_changes_no_loss(tmp_path):
    """As a cse_models.train callback: hooked before the first step, a row per domain of the batch at
    every ``every``-th step (the batch's domain counts), the table written atomically, and the
    losses those of the same run without it."""
    import json

    import pandas as pd

    from cse_models.train import TrainConfig, global_batch, load_data, train
    from ntkscope import InRunTracker

    torch.set_default_dtype(torch.float32)
    spec = {"model": {"n_layer": 2, "n_embd": 32, "n_head": 2}, "data": {"seq_len": 32, "split": "validation"},
            "steps": 4, "batch_size": 8, "checkpoint_every": 4, "log_every": 2, "warmup_steps": 2,
            "tensorboard": False}
    tracker = InRunTracker(every=2, out=tmp_path / "inrun")
    train(TrainConfig.from_dict({**spec, "out_dir": str(tmp_path / "tracked")}), callbacks=[tracker])
    train(TrainConfig.from_dict({**spec, "out_dir": str(tmp_path / "plain")}))

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert losses("tracked") == losses("plain")
    frame = pd.read_csv(tmp_path / "inrun" / "inrun.csv")
    cfg = TrainConfig.from_dict({**spec, "out_dir": str(tmp_path / "plain")})
    blocks, _ = load_data(cfg)
    batches = {step: [blocks.domain_names[d] for d in blocks.domains[global_batch(blocks, step - 1, 8,
                                                                                 cfg.seed)].tolist()]
               for step in (2, 4)}
    mixed = [step for step, names in batches.items() if len(set(names)) > 1]  # one group: no row (GC = 1 by design)
    assert sorted(set(frame["step"])) == mixed and 0 < tracker.overhead < 10
    assert (tracker.measured, tracker.one_group) == (2, 2 - len(mixed)) and mixed
    for step in mixed:
        names = batches[step]
        counts = {k: names.count(k) for k in set(names) if names.count(k) >= 2}
        rows = frame[frame["step"] == step].set_index("label")
        assert dict(rows["n_subset"]) == counts and (rows["n"] == 8).all()
    with pytest.raises(ValueError, match="InRunTracker: every must be a positive integer"):
        InRunTracker(every=0)
    model, batch = _model("gpt2"), _batch()
    alone = InRunTracker(model)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert alone.step(model, 1, list("abcdefgh")) == [] and alone.frame.empty  # no group of 2: no row, no error
    with pytest.raises(ValueError, match="InRunTracker.step: model must be the model this tracker hooked"):
        alone.step(_model("bert"), 2, LABELS)
    alone.close()


def test_an_evaluation_between_steps_leaves_the_steps_factors():
    """A forward in eval mode (an evaluation, a GCTracker's probe through the kernel engine) is not
    the training step's: the rows after it equal the rows before it."""
    from ntkscope import empirical_ntk

    model, batch = _model("gpt2"), _batch()
    model.train()
    with InRunGC(model) as inrun:
        model(**batch, labels=batch["input_ids"]).loss.backward()
        before = {r.label: r.score for r in inrun.gc(LABELS, dtype=torch.float64)}
        empirical_ntk(model, {k: v[:4] for k, v in batch.items()}, method="structured")  # a tracker's probe
        model.eval()  # other samples: were they kept, the kernel would be (4, 4)
        half = {k: v[:4] for k, v in batch.items()}
        model(**half, labels=half["input_ids"]).loss.backward()
        model.train()
        after = {r.label: r.score for r in inrun.gc(LABELS, dtype=torch.float64)}
    assert after == before


@pytest.mark.parametrize("accumulation", [1, 2])
def test_in_run_gc_inside_a_trainer_equals_the_steps_own_batch_at_its_weights(tmp_path, accumulation):
    """GCCallback(InRunTracker): each measured step's rows come from the batch's domains column
    (taken off the model's call) and its labels' loss terms; they equal InRunGC on that step's
    batch (with gradient accumulation, its last micro-batch) at the weights the step started from,
    recomputed apart (no dropout, so the step is reproducible); the losses are those of the same
    training without the callback, to float rounding."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import copy

    from ntkscope import GCCallback, GCTracker, InRunTracker, Probes

    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 25, (8, 16), generator=g), torch.randint(25, 50, (8, 16), generator=g)])
    rows = [{"input_ids": r, "labels": r, "domains": d} for r, d in zip(ids, [0] * 8 + [1] * 8)]
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)

    class Snapshots(transformers.TrainerCallback):  # the weights each step starts from, and its batch
        def __init__(self):
            self.weights, self.batches = {}, []

        def on_train_begin(self, args, state, control, model=None, **kwargs):  # before the column is taken
            model.register_forward_pre_hook(
                lambda m, a, kw: self.batches.append((kw["input_ids"].clone(), kw["domains"].tolist()))
                if m.training else None, with_kwargs=True, prepend=True)

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.weights[state.global_step + 1] = copy.deepcopy(model.state_dict())

    def run(name, with_gc):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        snapshots = Snapshots()
        tracker = InRunTracker(every=2, out=tmp_path / name / "inrun")
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=4,
                                              per_device_train_batch_size=8 // accumulation,
                                              gradient_accumulation_steps=accumulation, learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                              save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                                              remove_unused_columns=False)
        # a probe tracker in the same callback: no second GCCallback (transformers warns of one "already there")
        probe = GCTracker(Probes({"input_ids": ids[::2]}, {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}), every=2,
                          resampling=None)
        callbacks = ([GCCallback(tracker, probe, names=["a", "b"])] if with_gc else []) + [snapshots]
        run.probe = probe
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
        if not with_gc:  # the plain run's model must not see the domains column either
            model.register_forward_pre_hook(lambda m, a, kw: (a, {k: v for k, v in kw.items() if k != "domains"}),
                                            with_kwargs=True)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], tracker, snapshots

    losses, tracker, snapshots = run("gc", True)
    assert sorted(set(run.probe.frame["step"])) == [2, 4]  # the probes, beside the in-run rows
    if accumulation == 1:
        assert losses == pytest.approx(run("plain", False)[0], rel=1e-6)  # float rounding (kept factors move buffers)
    frame = tracker.frame
    mixed = [step for step in (2, 4) if len(set(snapshots.batches[step * accumulation - 1][1])) > 1]
    assert mixed and sorted(set(frame["step"])) == mixed  # a batch of one group has no row (GC = 1 by design)
    assert (tmp_path / "gc" / "inrun" / "inrun.csv").is_file()
    from ntkscope.app.report import report  # the run's page draws its in-run GC

    made = report(tmp_path / "gc", tmp_path / "gc.html")
    assert "In-run GC" in made["sections"] and "on average over" in (tmp_path / "gc.html").read_text()
    for step in mixed:
        batch, domains = snapshots.batches[step * accumulation - 1]  # the step's last micro-batch
        model = transformers.GPT2LMHeadModel(config)
        model.load_state_dict(snapshots.weights[step])
        with InRunGC(model.train()) as inrun:
            model(input_ids=batch, labels=batch).loss.backward()
            expected = {r.label: r.score for r in inrun.gc([["a", "b"][d] for d in domains],
                                                           loss_terms=torch.full((len(batch),), 15))}
        got = frame[frame["step"] == step].set_index("label")["gc"]
        assert set(got.index) == set(expected)
        for label, score in expected.items():
            assert got[label] == pytest.approx(score, abs=1e-5)


def test_in_run_gc_in_a_trainer_needs_the_label_column():
    transformers = pytest.importorskip("transformers")
    from ntkscope import GCCallback, InRunTracker

    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)  # remove_unused_columns
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                                                 n_head=2))
    with pytest.raises(ValueError, match="remove_unused_columns must be False for in-run GC"):
        GCCallback(InRunTracker()).on_train_begin(args, None, None, model=model)
    with pytest.raises(ValueError, match="GCCallback: names must be a list of label names"):
        GCCallback(InRunTracker(), names="ab")
    twice = InRunTracker()
    with pytest.raises(ValueError, match="GCCallback: tracker must be given once each"):
        GCCallback(twice, twice)
    # a batch without the label column (text labels do not collate): the columns it has, not "(got None)"
    from types import SimpleNamespace

    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, remove_unused_columns=False)
    callback = GCCallback(InRunTracker())
    callback.on_train_begin(args, None, None, model=model)
    model.train()
    ids = torch.randint(0, 50, (4, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match=r"text labels do not collate: give integer labels and their names with "
                                         r"names=\[\.\.\.\]\) \(got \"a batch with the columns \['labels'\]\"\)"):
        callback.on_step_end(args, SimpleNamespace(global_step=1, is_world_process_zero=True), None, model=model)


def test_a_batch_of_one_group_has_no_row_and_is_counted(tmp_path, caplog):
    """One label in a batch is the whole batch, whose GC is 1 by construction: no row, counted."""
    import logging

    from ntkscope.gc.inrun import InRunTracker

    model = _model("gpt2")
    batch = _batch()
    tracker = InRunTracker(model, out=tmp_path / "inrun")
    for step, labels in enumerate([["general"] * 8, ["general"] * 4 + ["legal"] * 4, ["legal"] * 8], start=1):
        model.zero_grad()
        model(**batch, labels=batch["input_ids"]).loss.backward()
        found = tracker.step(model, step, labels)
        assert (found == []) == (len(set(labels)) == 1)
    with caplog.at_level(logging.WARNING):
        tracker.close()
    frame = tracker.frame
    assert set(frame["step"]) == {2} and not (frame["gc"] == 1.0).any()
    assert (tracker.measured, tracker.one_group) == (3, 2) and "2 of 3 measured steps" in caplog.text
    inrun = InRunGC(model)
    with inrun:
        model(**batch, labels=batch["input_ids"]).loss.backward()
        with pytest.raises(ValueError, match="labels must hold two or more groups: one group is the whole batch"):
            inrun.gc(["general"] * 8)


def test_an_in_run_tracker_writing_into_a_file_is_refused_when_made(tmp_path):
    from ntkscope.gc.inrun import InRunTracker

    (tmp_path / "taken").write_text("x")
    with pytest.raises(ValueError, match=r"InRunTracker: out must be a directory \(it exists and is not one\)"):
        InRunTracker(out=tmp_path / "taken")


def test_in_run_gc_under_bfloat16_autocast_reads_the_mixed_precision_step():
    """bf16=True in a Trainer (autocast): the layers' inputs stay float32, their gradients are
    bfloat16; the kernel takes both in float32 and is close to the float32 step's."""
    model = _model("gpt2").float()
    batch = _batch()
    labels = LABELS
    reference = InRunGC(model)
    with reference:
        model(**batch, labels=batch["input_ids"]).loss.backward()
        K32 = reference.kernel()
    model.zero_grad()
    mixed = InRunGC(model)
    with mixed, torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch, labels=batch["input_ids"]).loss.backward()
        assert {u.delta.dtype for layer in mixed.factors() for u in layer} == {torch.bfloat16}
        K16 = mixed.kernel()
        found = mixed.gc(labels)
    assert np.linalg.norm(K16 - K32) / np.linalg.norm(K32) < 0.05
    assert len(found) == len(set(labels)) and all(np.isfinite(r.score) for r in found)
