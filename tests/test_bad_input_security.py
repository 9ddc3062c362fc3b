"""Nothing from a checkpoint runs or rewrites the process. A tokenizer's custom code is never
imported; a sparse layout is data (child-module names checked against the model before anything
is touched); expert counts are sized before a copy is made."""

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from cse_models import SparseHF, load_hf
from cse_models.hf import LAYOUTS, Layout
from cse_models.hf_modules import HFSparseFFN
from cse_models.hf_trainer import SIDECAR, SparseCallback, restore
from ntkscope.core.checks import UserError

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
MARK = "ran.txt"  # what the planted code writes when it is imported


def _tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=3, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def _plant_code(folder: Path, config_name: str, auto: str) -> None:
    """An ``auto_map`` in ``folder/config_name`` naming ``evil.T``, and the evil.py it names."""
    (folder / "evil.py").write_text(f"open({str(folder / MARK)!r}, 'w').write('x')\n"
                                    "from transformers import PreTrainedTokenizerFast, PretrainedConfig\n"
                                    "class T(PreTrainedTokenizerFast):\n    pass\n")
    data = json.loads((folder / config_name).read_text())
    data["auto_map"] = {auto: ["evil.T", "evil.T"] if auto == "AutoTokenizer" else "evil.T"}
    (folder / config_name).write_text(json.dumps(data))


# ---- a checkpoint's code never runs -----------------------------------------------------------

def test_every_hf_load_in_the_library_goes_through_the_no_code_helper():
    """Every from_pretrained / from_config call on a transformers class in ntkscope and cse_models is
    ntkscope.core.pretrained's (which fixes trust_remote_code=False and local files only)."""
    ours = {"TransformerLM", "cls", "GPT", "BERT"}  # cse_models' own checkpoints: safetensors and JSON, no code
    offenders = []
    for package in ("ntkscope", "cse_models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "pretrained.py" and path.parent.name == "core":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("from_pretrained", "from_config")):
                    continue
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in ours:
                    continue
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_a_tokenizer_that_names_its_own_code_never_runs_it(tmp_path, monkeypatch):
    from ntkscope.runs.encoder import SentenceEncoder, shipped_encoder

    folder = tmp_path / "encoder"
    shutil.copytree(shipped_encoder(), folder)
    _plant_code(folder, "tokenizer_config.json", "AutoTokenizer")
    seen = []
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    monkeypatch.setattr("sys.stdin", None)  # no question may be asked
    encoder = SentenceEncoder(folder)
    assert seen and all(k.get("trust_remote_code") is False and k.get("local_files_only") is True for k in seen)
    assert not (folder / MARK).exists()
    assert type(encoder.tokenizer).__module__.startswith("transformers.")  # transformers' own class
    assert encoder.transform(["a sentence"]).shape == (1, encoder.dim)


def test_a_config_whose_only_class_is_its_own_code_is_refused_in_one_line(tmp_path):
    from ntkscope.runs.checkpoints import load_checkpoint

    folder = tmp_path / "model"
    _tiny_gpt2().save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(model_type="evil-model", auto_map={"AutoConfig": "evil.T", "AutoModelForCausalLM": "evil.T"})
    (folder / "config.json").write_text(json.dumps(data))
    _plant_code(folder, "config.json", "AutoModel")
    with pytest.raises(UserError, match=r"^load_checkpoint: .*config\.json is not a valid HF config") as err:
        load_checkpoint(folder)
    assert "\n" not in str(err.value)
    assert not (folder / MARK).exists()


def test_the_helper_refuses_to_unfix_its_keywords(tmp_path):
    from ntkscope.core.pretrained import from_pretrained

    with pytest.raises(UserError, match=r"^mine: trust_remote_code is fixed at False .*got True"):
        from_pretrained(transformers.AutoConfig, tmp_path, "mine", trust_remote_code=True)


# ---- a sparse layout is data, not code --------------------------------------------------------

HOSTILE = ["mlp.__class__.forward", "attn.c_attn.weight.__class__.__base__.softmax", "__class__", "_modules",
           "mlp.c_fc.weight", "mlp.forward", "mlp/../x", "", 3, None]


@pytest.mark.parametrize("path", HOSTILE)
def test_a_hostile_layout_path_is_refused_before_anything_is_touched(tmp_path, path):
    forward, softmax = HFSparseFFN.forward, torch.Tensor.softmax
    model = _tiny_gpt2()
    for field in ("ffn", "ffn_out", "attn", "blocks"):
        if field == "ffn_out" and path is None:  # no separate output projection: the default
            continue
        with pytest.raises(UserError, match=r"Layout: "):
            SparseHF(_tiny_gpt2(), {"kind": "cse", "layers": [1], "n_experts": [2]},
                     Layout(**{"blocks": "transformer.h", "attn": "attn", field: path}))
    assert HFSparseFFN.forward is forward and torch.Tensor.softmax is softmax
    assert type(model.transformer.h[1].mlp).__name__ == "GPT2MLP"


def _saved_sparse(tmp_path, kind="switch"):
    model = SparseHF(_tiny_gpt2(), {"kind": kind, "layers": [1], "n_experts": [2],
                                    **({"domains": ["a", "b"]} if kind == "demix" else {})})
    return model.save_pretrained(tmp_path / "sparse")


@pytest.mark.parametrize("layout, message", [
    ({"blocks": "transformer.h", "ffn": "mlp.__class__.forward", "attn": "attn"}, "ffn must be one child-module name"),
    ({"blocks": "transformer.h", "ffn": "attn", "attn": "attn"}, "layout must be the gpt2 family's"),
    ({"blocks": "transformer.h", "attn": "attn.c_attn.weight.__class__.__base__.softmax"}, "attn must be one"),
    ({"blocks": "transformer.h", "shell": "rm"}, "unknown keys \\['shell'\\]"),
    ("transformer.h", "layout must be a mapping"),
])
def test_a_saved_sparse_config_with_a_hostile_layout_loads_nothing(tmp_path, layout, message):
    folder = _saved_sparse(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["cse_sparse"]["layout"] = layout
    (folder / "config.json").write_text(json.dumps(config))
    forward, softmax = HFSparseFFN.forward, torch.Tensor.softmax
    with pytest.raises(UserError, match=message):
        load_hf(folder)
    import cse_models  # noqa: F401 (the Auto classes)
    with pytest.raises(UserError, match=message):
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert HFSparseFFN.forward is forward and torch.Tensor.softmax is softmax


def test_the_trainer_sidecar_layout_is_checked_too(tmp_path):
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    section = _saved_sparse(tmp_path)
    data = json.loads((section / "config.json").read_text())["cse_sparse"]
    data["layout"]["ffn"] = "mlp.__class__.forward"
    (folder / SIDECAR).write_text(json.dumps(data))
    forward = HFSparseFFN.forward
    with pytest.raises(UserError, match=r"^SparseCallback.restore: .*cse_sparse.json: Layout: ffn must be one"):
        restore(_tiny_gpt2(), folder)
    assert HFSparseFFN.forward is forward
    data["layout"] = dict(vars(LAYOUTS["gpt2"]))
    (folder / SIDECAR).write_text(json.dumps(data))
    assert isinstance(restore(_tiny_gpt2(), folder), SparseHF)  # the family's own layout restores


def test_a_known_layout_and_a_custom_one_of_child_modules_are_accepted():
    from cse_models.hf import saved_layout

    assert saved_layout({"layout": dict(vars(LAYOUTS["bert"]))}, "bert", "x") == LAYOUTS["bert"]
    custom = Layout("transformer.h", ffn="mlp", attn="attn")  # named directly: checked against the model only
    model = SparseHF(_tiny_gpt2(), {"kind": "switch", "layers": [0], "n_experts": [2]}, custom)
    assert type(model.hf.transformer.h[0].mlp).__name__ == "HFSparseFFN"


# ---- sizes estimated before allocation -----------------------------------------------------------

def test_a_billion_experts_are_refused_before_one_is_made(tmp_path):
    folder = _saved_sparse(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["cse_sparse"]["sparse"]["n_experts"] = [10**9]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"SparseHF: sparse.n_experts \[1000000000\] asks for .* parameters"):
        load_hf(folder)
    with pytest.raises(UserError, match=r"SparseHF: sparse.n_experts \[1000000000\] asks for"):
        SparseHF(_tiny_gpt2(), {"kind": "cse", "layers": [1], "n_experts": [10**9]})


def test_a_switch_callback_of_a_billion_experts_is_refused_when_training_begins():
    from types import SimpleNamespace

    callback = SparseCallback(convert_at=2, kind="switch", layers=[1], n_experts=10**9)
    with pytest.raises(UserError, match=r"SparseCallback: n_experts 1000000000 at layers \[1\] asks for"):
        callback.on_train_begin(SimpleNamespace(max_steps=4), None, None, model=_tiny_gpt2())
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(UserError, match=r"SparseCallback: n_experts must be a positive integer"):
            SparseCallback(convert_at=2, kind="switch", layers=[1], n_experts=bad)


# ---- SparseCallback's fitting and plan, checked when the callback is made --------------------------

@pytest.mark.parametrize("fitting, message", [
    ({"input_ids": torch.arange(10)}, r"input_ids'\] must be a 2-D integer tensor"),
    ({"input_ids": torch.rand(4, 6)}, r"input_ids'\] must be a 2-D integer tensor .*float32"),
    ({"input_ids": torch.full((4, 6), -1)}, r"input_ids'\] must be token ids >= 0"),
    ({"input_ids": torch.zeros(0, 6, dtype=torch.long)}, r"must hold two or more sequences"),
    ({"input_ids": torch.zeros(4, 6, dtype=torch.long), "attention_mask": torch.ones(4, 5)}, r"attention_mask'\] must "
     r"be a tensor of input_ids' shape"),
    ({"input_ids": torch.zeros(4, 6, dtype=torch.long), "attention_mask": torch.full((4, 6), 2)}, r"must hold 0 and 1"),
    ({"input_ids": torch.zeros(4, 6, dtype=torch.long), "attention_mask": torch.zeros(4, 6)}, r"a real token in every"),
    ({"ids": torch.zeros(4, 6, dtype=torch.long)}, r"fitting must be \{'input_ids'"),
])
def test_a_bad_fitting_sample_is_refused_when_the_callback_is_made(fitting, message):
    with pytest.raises(UserError, match=r"^SparseCallback: fitting") as err:
        SparseCallback(convert_at=2, layers=[1], fitting=fitting)
    assert re.search(message, str(err.value)) and "\n" not in str(err.value)


def test_out_of_vocabulary_fitting_ids_and_a_missing_plan_are_refused_before_training(tmp_path):
    from types import SimpleNamespace

    callback = SparseCallback(convert_at=2, layers=[1], fitting={"input_ids": torch.full((4, 6), 70)})
    with pytest.raises(UserError, match=r"fitting\['input_ids'\] must be token ids of this model's vocabulary "
                                        r"\[0, 50\) \(got ids up to 70\)"):
        callback.on_train_begin(SimpleNamespace(max_steps=4), None, None, model=_tiny_gpt2())
    with pytest.raises(UserError, match=r"SparseCallback: plan .*nope\.json does not exist"):
        SparseCallback(plan=tmp_path / "nope.json", fitting={"input_ids": torch.zeros(4, 6, dtype=torch.long)})


def test_a_concrete_class_refuses_a_sparse_directory_naming_cse_models(tmp_path):
    """GPT2LMHeadModel.from_pretrained(SPARSE_DIR) refuses, naming cse_models, where it would build random
    weights from the base config nested in the file."""
    import cse_models  # noqa: F401 (the Auto classes)

    folder = _saved_sparse(tmp_path)
    with pytest.raises(Exception, match=r"a cse_models sparse model: import cse_models, then "
                                        r"transformers\.AutoModelForCausalLM"):
        transformers.GPT2LMHeadModel.from_pretrained(folder)
    auto = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert auto.config.vocab_size == 50 and type(auto).__name__ == "SparseForCausalLM"
    ids = torch.randint(0, 50, (2, 6))
    torch.testing.assert_close(auto(input_ids=ids).logits, load_hf(folder)(ids, None), rtol=0, atol=0)


def test_a_sparse_directory_saved_without_some_layout_fields_still_loads(tmp_path):
    """An older file's layout that lacks a field (attn) takes the family's own, not Layout's default."""
    folder = _saved_sparse(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["cse_sparse"]["layout"]["attn"]
    (folder / "config.json").write_text(json.dumps(config))
    assert isinstance(load_hf(folder), SparseHF)
