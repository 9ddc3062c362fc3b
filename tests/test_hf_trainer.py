"""Conversion inside the researcher's own Trainer (cse_models.hf_trainer): a tiny Llama (CSE and
Switch), GPT-2 and BERT (CSE; BERT's labels every token, as a masked LM takes them), converted by SparseCallback mid-run, stopped after the conversion and
resumed from the Trainer checkpoint, end with the weights of the uninterrupted run; the
result loads through transformers' Auto classes; the plain function carries AdamW state to the
experts in any loop."""

import json

import pytest
import torch

from cse_models import SparseHF
from cse_models.checkpointing import expert_source
from cse_models.hf_trainer import SparseCallback, convert_in_training

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from test_hf_sparse import MASKED, dense, planted_domains  # noqa: E402

ROWS, DOMAINS = planted_domains(n_per=48, T=16)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _run(kind, sparse_kind, out, *, stop=None, resume=None, extra=()):
    model = dense(kind).train()
    fitting = {"input_ids": ROWS[:64]}
    kind_, _, module = sparse_kind.partition("-")
    callback = SparseCallback(convert_at=4, kind=kind_, layers=[1, 2], fitting=fitting, router={"min_cluster_size": 10},
                              n_experts=2, module=module or "ffn", domains=["a", "b"] if kind_ == "demix" else None)
    if resume is not None:
        assert callback.restore(model, resume) is not None
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=8,
                                          learning_rate=3e-3, save_steps=2, logging_steps=1, report_to=[],
                                          use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                                          remove_unused_columns=kind_ != "demix")
    # DEMix routes by the batch's labels: a domains column that Trainer passes (remove_unused_columns=False)
    data = [{"input_ids": r, "labels": r, **({"domains": d} if kind_ == "demix" else {})} for r, d in zip(ROWS, DOMAINS)]
    callbacks = [callback, *extra] + ([StopAt(stop)] if stop else [])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return model, callback


@pytest.mark.parametrize("kind, sparse_kind", [("llama", "cse"), ("llama", "switch"), ("gpt2", "cse"),
                                                     ("gpt_neox", "cse"), ("bert", "cse"), ("llama", "cse-attn"),
                                                     ("llama", "demix")])
def test_a_trainer_run_converted_mid_run_resumes_to_the_same_weights(kind, sparse_kind, tmp_path):
    """GPT-NeoX included: transformers 5.24 saves its head as embed_out and Trainer's resume does
    not load it back as lm_head; SparseCallback.restore loads it by transformers' renaming rule."""
    torch.set_default_dtype(torch.float32)
    whole, callback = _run(kind, sparse_kind, tmp_path / "whole")
    assert isinstance(callback.sparse, SparseHF) and len(callback.sparse.sparse_layers()) == 2
    sidecar = json.loads((tmp_path / "whole" / "checkpoint-4" / "cse_sparse.json").read_text())
    assert sidecar["converted_at"] == 4 and sidecar["sparse"]["layers"] == [1, 2]
    assert not (tmp_path / "whole" / "checkpoint-2" / "cse_sparse.json").exists()  # saved before the conversion
    _run(kind, sparse_kind, tmp_path / "split", stop=6)
    resumed, _ = _run(kind, sparse_kind, tmp_path / "split", resume=tmp_path / "split" / "checkpoint-6")
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and any(".experts.1." in k for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)
    # the result, saved in the sparse format, is a transformers model with these weights
    callback.save(tmp_path / "final")
    reader = transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM
    auto = reader.from_pretrained(tmp_path / "final")
    ids, labels = ROWS[::24], DOMAINS[::24]  # both domains
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ids, domains=labels).logits,
                                   callback.sparse.eval()(ids, None, labels), rtol=0, atol=0)
    if sparse_kind == "demix":  # each label's sequences went to its expert
        for layer in callback.sparse.sparse_layers().values():
            assert (layer.load > 0).all()


def test_a_neox_trainer_run_converts_and_its_result_loads(tmp_path):
    torch.set_default_dtype(torch.float32)
    _, callback = _run("gpt_neox", "cse", tmp_path / "neox")
    callback.save(tmp_path / "final")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ROWS[:4]).logits, callback.sparse.eval()(ROWS[:4]), rtol=0, atol=0)


def test_the_plain_function_carries_adam_state_to_the_experts():
    torch.set_default_dtype(torch.float32)
    model = dense("gpt_neox").train()
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)
    model(input_ids=ROWS[:8], labels=ROWS[:8]).loss.backward()
    opt.step()
    before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    sparse = convert_in_training(model, opt, {"kind": "switch", "layers": [1]}, n_experts=3)
    names = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    assert sorted(in_optimizer) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    experts = [n for n in in_optimizer if ".experts." in n]
    assert len(experts) == 3 * 4  # 3 copies of the MLP's 2 weights and 2 biases
    for name in experts:
        p = dict(model.named_parameters())[name]
        torch.testing.assert_close(opt.state[p]["exp_avg"], before[expert_source(name)]["exp_avg"])
    gate = [n for n in in_optimizer if n not in before and ".experts." not in n]
    assert gate and all(not opt.state.get(dict(model.named_parameters())[n]) for n in gate)  # no source: fresh
    model(input_ids=ROWS[:8], labels=ROWS[:8]).loss.backward()
    opt.step()  # the loop goes on
    assert len(sparse.sparse_layers()) == 1


def test_demix_and_in_run_gc_read_the_same_domains_column(tmp_path):
    """A DEMix conversion and in-run GC in one Trainer run, both reading the batch's domains
    column (taken off the model's call once): DEMix routes every step after the conversion, and
    in-run GC has a row per domain at each measured step, before and after it."""
    from ntkscope import GCCallback, InRunTracker

    torch.set_default_dtype(torch.float32)
    tracker = InRunTracker(every=2)
    _, callback = _run("llama", "demix", tmp_path / "run", extra=[GCCallback(tracker, names=["a", "b"])])
    assert all((layer.load > 0).all() for layer in callback.sparse.sparse_layers().values())
    frame = tracker.frame
    assert sorted(set(frame["step"])) == [2, 4, 6, 8] and set(frame["label"]) == {"a", "b"}
