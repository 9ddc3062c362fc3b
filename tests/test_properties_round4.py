"""Property tests of random experiment-spec values, random sparse layouts and counts, and random
Trainer checkpoint files (training_args.bin fields, trainer_state.json, optimizer.pt shapes).
Every outcome is a result or the documented one-line error (a ``UserError``, or a reason string);
never another exception, and never a change to a class of the process. 20 examples in CI;
``NTKSCOPE_PROPERTY_EXAMPLES=300`` locally."""

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ntkscope.core.checks import UserError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
EXAMPLES = int(os.environ.get("NTKSCOPE_PROPERTY_EXAMPLES", 20))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NUMBERS = st.one_of(st.integers(-10, 10**6), st.sampled_from([0, -1, 2**32, 10**400]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=5), st.none())
NAMES = st.one_of(st.sampled_from(["mlp", "attn", "transformer.h", "mlp.c_fc", "c_proj", "__class__", "_modules",
                                   "mlp.__class__.forward", "attn.c_attn.weight", "mlp.forward", "h", "ln_1", "",
                                   "transformer.h.0", "self_attn"]), st.text(max_size=12), st.integers(), st.none())


# ---- experiment specs: values -------------------------------------------------------------------

@SETTINGS
@given(key=st.sampled_from(["steps", "checkpoint_every", "batch_size", "lr", "seq_len", "cse_samples", "warmup_steps",
                            "min_cluster_size", "max_warmup_fraction", "eval_every", "proj_dim"]),
       value=NUMBERS, seeds=st.lists(st.one_of(st.integers(-3, 2**33), st.text(max_size=3)), max_size=3),
       layers=st.lists(st.integers(-1, 3), max_size=3), arm_name=st.sampled_from(["cse", "cse-at20", "plan", "x"]))
def test_a_spec_is_a_spec_or_one_spec_error(key, value, seeds, layers, arm_name):
    from ntkscope.experiments import parse_spec

    data = {"name": "toy", "kind": "sweep", "preset": "smoke", "seeds": seeds,
            "settings": {"steps": 60, "checkpoint_every": 10, key: value},
            "trunk": {"layers": layers, "gc_peak_step": 10},
            "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [20, 40]},
                     {"name": arm_name, "kind": "cse", "convert_at": 30}],
            "criteria": {"arms": ["cse-at20"]}}
    try:
        spec = parse_spec(data)
    except UserError as err:
        assert "\n" not in str(err)
        return
    from ntkscope.experiments.units import units

    names = [u.name for u in units(spec, "v")]
    assert len(names) == len(set(names))  # every unit its own name, after expansion
    assert all(0 <= s < 2**31 for s in spec.seeds) and len(set(spec.trunk.layers)) == len(spec.trunk.layers)


# ---- sparse configs: layouts and counts ---------------------------------------------------------

def _gpt2():
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


@SETTINGS
@given(layout=st.dictionaries(st.sampled_from(["blocks", "ffn", "ffn_out", "attn", "shell"]), NAMES, max_size=5),
       n_experts=st.one_of(st.integers(-2, 4), st.sampled_from([10**9, 10**12])),
       kind=st.sampled_from(["cse", "switch"]),
       module=st.sampled_from(["ffn", "attn"]))
def test_a_sparse_config_loads_or_is_one_line_and_touches_no_class(layout, n_experts, kind, module):
    from cse_models import SparseHF
    from cse_models.hf import saved_layout
    from cse_models.hf_modules import HFSparseAttention, HFSparseFFN

    before = (HFSparseFFN.forward, HFSparseAttention.forward, torch.Tensor.softmax, torch.nn.Module.__call__)
    model = _gpt2()
    try:
        chosen = saved_layout({"layout": layout}, None, "config.json")  # an unknown family: child modules only
        SparseHF(model, {"kind": kind, "module": module, "layers": [1], "n_experts": [n_experts]}, chosen)
    except UserError as err:
        assert "\n" not in str(err)
    assert (HFSparseFFN.forward, HFSparseAttention.forward, torch.Tensor.softmax, torch.nn.Module.__call__) == before


# ---- Trainer checkpoints: training_args.bin, trainer_state.json, optimizer.pt ----------------------

@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 50, (8, 12))]
    args = transformers.TrainingArguments(output_dir=str(root / "run"), max_steps=4, per_device_train_batch_size=8,
                                          learning_rate=3e-3, lr_scheduler_type="linear", save_steps=2, report_to=[],
                                          use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    transformers.Trainer(model=_gpt2().train(), args=args, train_dataset=rows).train()
    torch.set_default_dtype(previous)
    return root / "run" / "checkpoint-2"


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(["learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon",
                                               "weight_decay", "max_grad_norm", "warmup_steps", "warmup_ratio",
                                               "lr_scheduler_type", "optim"]), NUMBERS, max_size=3),
       step=NUMBERS, shape=st.lists(st.integers(0, 5), max_size=3), which=st.sampled_from(["exp_avg", "exp_avg_sq"]))
def test_a_trainer_checkpoint_continues_or_says_why(trainer_checkpoint, tmp_path_factory, fields, step, shape, which):
    from cse_models.continued import run_state
    from ntkscope.runs.checkpoints import list_checkpoints

    folder = tmp_path_factory.mktemp("variant") / "checkpoint-2"
    shutil.copytree(trainer_checkpoint, folder)
    args = torch.load(folder / "training_args.bin", weights_only=False)  # the test's own file
    for key, value in fields.items():
        object.__setattr__(args, key, value)
    torch.save(args, folder / "training_args.bin")
    state = json.loads((folder / "trainer_state.json").read_text())
    state["global_step"] = step
    (folder / "trainer_state.json").write_text(json.dumps(state, allow_nan=True))
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    first = next(iter(saved["state"]))
    saved["state"][first][which] = torch.zeros(shape)
    torch.save(saved, folder / "optimizer.pt")
    found, why = run_state(folder)
    assert (found is None) == bool(why) and "\n" not in why
    try:
        listed = list_checkpoints(folder.parent)
    except UserError as err:
        assert "\n" not in str(err)
    else:
        assert [p for _, p in listed] == [folder]
