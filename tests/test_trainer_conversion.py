"""The conversion inside a researcher's own Trainer, one step off the plain path: a GC tracker
measuring the model across the conversion, a resume at (or after) the plan's step from a dense
checkpoint, and post-conversion checkpoints loading as the sparse model they hold."""

import json
import subprocess
import sys

import pytest
import torch

from cse_models.hf import key_padding_mask, load_any_model
from cse_models.hf_trainer import SparseCallback, convert_in_training

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from test_hf_sparse import dense, planted_domains  # noqa: E402
from test_hf_trainer import StopAt  # noqa: E402

ROWS, DOMAINS = planted_domains(n_per=48, T=16)


def callback(**changes):
    return SparseCallback(**{"convert_at": 4, "kind": "cse", "layers": [1, 2], "fitting": {"input_ids": ROWS[:64]},
                             "router": {"min_cluster_size": 10}, **changes})


def train(kind, out, callbacks=(), *, resume=None, model=None):
    torch.set_default_dtype(torch.float32)
    model = dense(kind).train() if model is None else model
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=8, per_device_train_batch_size=8,
                                          learning_rate=3e-3, save_steps=2, report_to=[], use_cpu=True, seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True)
    data = [{"input_ids": r, "labels": r} for r in ROWS]
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks)).train(
        resume_from_checkpoint=None if resume is None else str(resume))
    return model


def assert_same_weights(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert a.keys() == b.keys() and any(".experts.1." in k for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A GPT-NeoX converted at step 4 of 8, uninterrupted, checkpoints every 2 steps."""
    out = tmp_path_factory.mktemp("whole")
    cb = callback()
    model = train("gpt_neox", out, [cb])
    return out, model, cb


def test_a_gc_tracker_measures_the_model_across_the_conversion(tmp_path):
    from ntkscope import GCCallback, GCTracker
    from ntkscope.gc.tracker import Probes

    idx = torch.arange(0, 96, 6)
    groups = {name: [i for i, j in enumerate(idx) if DOMAINS[j] == d] for d, name in enumerate("ab")}
    probes = Probes({"input_ids": ROWS[idx], "attention_mask": torch.ones_like(ROWS[idx])}, groups)
    tracker = GCTracker(probes, every=2, resampling=None, per_layer=True)
    cb = callback()
    train("gpt_neox", tmp_path / "run", [cb, GCCallback(tracker)])  # probes at 6 and 8 measure the sparse model
    frame = tracker.frame
    assert cb.converted_at == 4 and sorted(set(frame["step"])) == [2, 4, 6, 8]
    assert frame["gc"].notna().all() and set(frame.loc[frame["step"] == 8, "label"]) == {"a", "b"}


def test_the_converted_hf_model_has_the_kernel_of_its_wrapper():
    from ntkscope.kernel.ntk import empirical_ntk
    from ntkscope.kernel.options import KernelOptions

    torch.set_default_dtype(torch.float64)
    try:
        model = dense("gpt_neox")
        sparse = convert_in_training(model, torch.optim.AdamW(model.parameters()), {"kind": "cse", "layers": [1]},
                                     fitting_ids=ROWS[:64], router={"min_cluster_size": 10})
        model.eval()
        mask = torch.ones(6, 16, dtype=torch.long)
        mask[1, 12:] = 0  # a padded row: the sparse layer routes it by its real tokens
        batch = {"input_ids": ROWS[::16][:6], "attention_mask": mask}
        bare = empirical_ntk(model, batch, options=KernelOptions(method="exact")).matrix
        wrapped = empirical_ntk(sparse, batch, options=KernelOptions(method="exact")).matrix
        torch.testing.assert_close(bare, wrapped, rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_key_padding_mask_reads_a_4d_mask_back_to_its_padding(causal):
    from ntkscope.kernel.objectives import hf_mask_4d

    mask = torch.ones(5, 6, dtype=torch.long)
    mask[1, 4:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    mask[3, 2:] = 0  # two real tokens
    mask[4, 1:] = 0  # one real token: its first position
    four = hf_mask_4d(mask, causal)
    assert torch.equal(key_padding_mask(four), mask.bool())
    additive = torch.where(four, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding_mask(additive), mask.bool())
    assert torch.equal(key_padding_mask(mask), mask.bool())


def test_a_resume_at_the_plans_step_from_a_dense_checkpoint_converts(whole, tmp_path):
    _, model, _ = whole
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"convert_at": 4, "layers": [1, 2]}))
    train("gpt_neox", tmp_path / "dense", [StopAt(4)])  # the first run: dense, checkpoint-4
    cb = callback(convert_at=None, plan=plan)
    resumed = train("gpt_neox", tmp_path / "dense", [cb], resume=tmp_path / "dense" / "checkpoint-4")
    assert cb.converted_at == 4
    assert_same_weights(model, resumed)  # as if it had converted at step 4 without stopping
    assert json.loads((tmp_path / "dense" / "checkpoint-8" / "cse_sparse.json").read_text())["converted_at"] == 4


def test_a_resume_after_the_step_converts_late_and_says_so(tmp_path, caplog):
    train("gpt_neox", tmp_path / "dense", [StopAt(6)])
    cb = callback()
    with caplog.at_level("WARNING", logger="cse_models.hf_trainer"):
        train("gpt_neox", tmp_path / "dense", [cb], resume=tmp_path / "dense" / "checkpoint-6")
    assert cb.converted_at == 6 and "after the conversion step 4" in caplog.text
    sidecar = json.loads((tmp_path / "dense" / "checkpoint-8" / "cse_sparse.json").read_text())
    assert (sidecar["converted_at"], sidecar["planned_at"]) == (6, 4)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_post_conversion_checkpoints_of_other_families_load_as_sparse(kind, tmp_path):
    cb = callback()
    train(kind, tmp_path / "run", [cb])
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-8")
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ROWS[:4]).logits, cb.sparse.eval()(ROWS[:4]), rtol=0, atol=0)


def test_a_post_conversion_checkpoint_loads_as_the_sparse_model(whole):
    out, _, cb = whole
    assert not (out / "checkpoint-2" / "cse_sparse.json").exists()  # before the conversion: dense
    assert json.loads((out / "checkpoint-2" / "config.json").read_text())["model_type"] == "gpt_neox"
    final = out / "checkpoint-8"
    auto = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(auto).__name__ == "SparseForCausalLM"
    with torch.no_grad():  # the checkpoint is the model at step 8: the head (saved as embed_out) included
        torch.testing.assert_close(auto(input_ids=ROWS[:4]).logits, cb.sparse.eval()(ROWS[:4]), rtol=0, atol=0)
    assert type(load_any_model(out / "checkpoint-4")).__name__ == "SparseHF"  # ntkscope eval's reader
    with pytest.raises(Exception, match="cse_models"):  # a concrete transformers class refuses it
        transformers.GPTNeoXForCausalLM.from_pretrained(final)
    plain = subprocess.run([sys.executable, "-c", "import sys, transformers; transformers.AutoModelForCausalLM."
                            "from_pretrained(sys.argv[1])", str(final)], capture_output=True, text=True)
    assert plain.returncode != 0 and "cse_models" in plain.stderr


def test_a_resume_from_a_converted_checkpoint_into_a_dense_model_is_refused(whole, tmp_path):
    """Without restore, a resume from a post-conversion checkpoint would train the sparse
    checkpoint's dense model with fresh FFNs (Trainer loads weights non-strictly): one line
    before the first step (when Trainer's own optimizer load has not refused it already)."""
    from types import SimpleNamespace

    from ntkscope.core.checks import UserError

    out, _, _ = whole
    args, state = SimpleNamespace(output_dir=str(out), max_steps=8), SimpleNamespace(global_step=6)
    with pytest.raises(UserError, match="call callback.restore"):
        callback().on_train_begin(args, state, None, model=dense("gpt_neox"))
