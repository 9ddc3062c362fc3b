"""Sparse HF checkpoints as transformers models (cse_models.hf_auto): after ``import cse_models``,
``AutoModelForCausalLM.from_pretrained`` on a saved CSE or Switch model gives our logits, and
``generate`` and ``pipeline`` run; without cse_models, plain transformers refuses the directory
(no random model); a dense model saves as a plain HF checkpoint; the older format still loads,
with a warning."""

import json
import subprocess
import sys

import pytest
import torch

from cse_models import load_any_model
from cse_models.hf_auto import MODEL_TYPE

transformers = pytest.importorskip("transformers")
from test_hf_sparse import CONFIGS, MASKED, batch, convert, dense  # noqa: E402


def _sparse(kind: str, sparse_kind: str, tmp_path):
    dense(kind).save_pretrained(tmp_path / "dense")
    model = convert(load_any_model(tmp_path / "dense", dict(kind=sparse_kind, layers=[0, 2], n_experts=[0, 0])))
    model.save_pretrained(tmp_path / sparse_kind)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("sparse_kind", ["cse", "switch"])
@torch.no_grad()
def test_auto_model_reads_a_sparse_checkpoint_with_its_weights(kind, sparse_kind, tmp_path):
    model = _sparse(kind, sparse_kind, tmp_path)
    data = json.loads((tmp_path / sparse_kind / "config.json").read_text())
    assert data["model_type"] == MODEL_TYPE and data["base_model_type"] == kind and "model_type" not in data["base"]
    ids, mask = batch()
    reader, other = (transformers.AutoModelForMaskedLM, transformers.AutoModelForCausalLM) if kind in MASKED else \
        (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM)
    auto = reader.from_pretrained(tmp_path / sparse_kind)
    assert type(auto).__name__ == ("SparseForMaskedLM" if kind in MASKED else "SparseForCausalLM") and not auto.training
    with pytest.raises(ValueError, match=f"load it with transformers.{reader.__name__}"):
        other.from_pretrained(tmp_path / sparse_kind)  # the other Auto class refuses in one line
    torch.testing.assert_close(auto(input_ids=ids, attention_mask=mask).logits, model(ids, mask), rtol=0, atol=0)
    labels = ids.masked_fill(mask == 0, -100)
    loss = auto(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isfinite(loss)
    # saved again through transformers' name, the directory loads to the same model
    auto.save_pretrained(tmp_path / "again")
    torch.testing.assert_close(load_any_model(tmp_path / "again")(ids, mask), model(ids, mask), rtol=0, atol=0)


@torch.no_grad()
def test_generate_routes_the_whole_sequence_so_far(tmp_path):
    """Greedy generate equals a hand loop that feeds the whole sequence (prompt and continuation)
    at every step: CSE routes the sequence as one, as in training (no key-value cache)."""
    model = _sparse("gpt_neox", "cse", tmp_path)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cse")
    prompt = torch.tensor([[3, 7, 11, 2]])
    out = auto.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    seq = prompt.clone()
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.tolist() == seq.tolist()


def test_pipeline_generates(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _sparse("gpt2", "cse", tmp_path)
    vocab = {f"w{i}": i for i in range(50)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w1")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cse")
    generate = transformers.pipeline("text-generation", model=auto, tokenizer=tokenizer)
    text = generate("w3 w7 w11", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("w3 w7 w11") and text.count("w") == 7  # the prompt and 4 new words


@pytest.mark.parametrize("kind, auto", [("gpt_neox", "AutoModelForCausalLM"), ("bert", "AutoModelForMaskedLM")])
def test_plain_transformers_refuses_a_sparse_checkpoint(kind, auto, tmp_path):
    """In a fresh interpreter that never imports cse_models: an error naming the model type, never a
    random model."""
    _sparse(kind, "cse", tmp_path)
    code = ("import transformers, sys\n"
            f"try:\n    transformers.{auto}.from_pretrained({str(tmp_path / 'cse')!r})\n"
            "except (ValueError, KeyError) as err:\n    print('refused:', err); sys.exit(3)\n"
            "print('loaded'); sys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert MODEL_TYPE in proc.stdout and "cse_models" in proc.stdout


@torch.no_grad()
def test_a_sparse_encoder_fills_masks_in_a_pipeline(tmp_path):
    """A CSE BERT read by AutoModelForMaskedLM runs in pipeline("fill-mask"); its top token is the
    argmax of our logits at the masked position."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = _sparse("bert", "cse", tmp_path)
    vocab = {f"w{i}": i for i in range(49)} | {"[MASK]": 49}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w0", mask_token="[MASK]")
    fill = transformers.pipeline("fill-mask", model=transformers.AutoModelForMaskedLM.from_pretrained(
        tmp_path / "cse"), tokenizer=tokenizer)
    best = fill("w3 w7 [MASK] w11", top_k=1)[0]
    expected = model(torch.tensor([[3, 7, 49, 11]]))[0, 2].argmax()
    assert best["token"] == int(expected)


@torch.no_grad()
def test_a_dense_model_saves_as_a_plain_hf_checkpoint_and_old_sparse_directories_still_load(tmp_path, caplog):
    ids, mask = batch()
    plain = load_any_model(_dense_dir(tmp_path))
    plain.save_pretrained(tmp_path / "plain")
    data = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert data["model_type"] == "gpt_neox" and "cse_sparse" not in data
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits, plain(ids, mask), rtol=0, atol=0)
    # the older format: the base config with the section added; it loads, with a one-line warning
    model = _sparse("gpt_neox", "switch", tmp_path)
    config = tmp_path / "switch" / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data["base"], "model_type": data["base_model_type"], "cse_sparse": data["cse_sparse"]}))
    with caplog.at_level("WARNING"):
        old = load_any_model(tmp_path / "switch")
    torch.testing.assert_close(old(ids, mask), model(ids, mask), rtol=0, atol=0)
    assert any("older cse_models" in r.getMessage() and "save_pretrained" in r.getMessage() for r in caplog.records)


def _dense_dir(tmp_path):
    dense("gpt_neox").save_pretrained(tmp_path / "d")
    return tmp_path / "d"


@torch.no_grad()
def test_a_pytorch_model_bin_checkpoint_is_an_init_from_without_pickled_code(tmp_path):
    ids, mask = batch()
    hf = dense("gpt_neox")
    hf.config.save_pretrained(tmp_path / "bin")  # an older checkpoint: config.json and a torch.save'd state dict
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert (tmp_path / "bin" / "pytorch_model.bin").is_file() and not (tmp_path / "bin" / "model.safetensors").exists()
    model = load_any_model(tmp_path / "bin", dict(kind="cse", layers=[1], n_experts=[0]))
    torch.testing.assert_close(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
    # a pickle that would run code is refused, and the code never runs
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    torch.save({"x": Payload()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="load_hf: .*pytorch_model.bin holds more than tensors"):
        load_any_model(tmp_path / "bin")
    assert not marker.exists()


@torch.no_grad()
def test_a_left_padded_batch_generates_as_its_unpadded_prompts(tmp_path):
    """Positions count the real tokens (transformers' rule for GPT-2): a left-padded prompt in a
    batch continues as it does alone."""
    _sparse("gpt2", "cse", tmp_path)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cse")
    short, long = [5, 9], [3, 7, 11, 2]
    ids = torch.tensor([[0, 0] + short, long])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    batched = auto.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    alone = auto.generate(torch.tensor([short]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert batched[0, 2:].tolist() == alone[0].tolist()


def test_from_pretrained_takes_dtype_names_and_one_device_maps(tmp_path):
    _sparse("gpt2", "cse", tmp_path)
    load = transformers.AutoModelForCausalLM.from_pretrained
    assert next(load(tmp_path / "cse", torch_dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load(tmp_path / "cse", dtype=torch.float64).parameters()).dtype == torch.float64
    assert next(load(tmp_path / "cse", device_map={"": "cpu"}).parameters()).device.type == "cpu"
    assert next(load(tmp_path / "cse", device_map="auto").parameters()).device.type in ("cpu", "cuda")
    sparse_cls = type(load(tmp_path / "cse"))  # transformers' Auto class checks a dtype name itself first
    with pytest.raises(ValueError, match="from_pretrained: dtype must be a torch dtype or its name"):
        sparse_cls.from_pretrained(tmp_path / "cse", dtype="float17")
    with pytest.raises(ValueError, match="device_map must place the model on one device"):
        load(tmp_path / "cse", device_map={"hf.transformer.h.0": "cpu", "hf.lm_head": "meta"})


def test_a_find_spec_probe_does_not_disarm_the_registration():
    """Probing transformers' Auto module without importing it (as tools do) leaves the hook armed."""
    code = ("import importlib.util, sys, cse_models\n"
            "importlib.util.find_spec('transformers.models.auto.modeling_auto')\n"
            "from transformers import AutoConfig\n"
            "import transformers.models.auto.modeling_auto\n"
            "from cse_models.hf_auto import MODEL_TYPE\n"
            "AutoConfig.for_model(MODEL_TYPE)\n"
            "print('registered')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "registered" in out.stdout, out.stderr[-2000:]
