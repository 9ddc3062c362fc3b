"""The HF families of today's long-tail papers, built tiny from their configs (no hub):
GPT-NeoX (Pythia), Llama (untied head, grouped-query attention, RMSNorm), Qwen2 (tied,
q/k/v biases), OLMo and OLMo-2 (post-norm). Each kernel equals the per-sample autograd loop
in float64 on a right-padded batch; layer points read the model's own hidden states; the
command runs on a save_pretrained directory and on a directory of Pythia-style stepN
checkpoints."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

import ntkscope as ns
from ntkscope.app.cli import main
from ntkscope.core.lm import masked_mean
from ntkscope.runs.checkpoints import is_run_dir, list_checkpoints, load_checkpoint
from ntkscope.runs.families import family_of
from ntkscope.text.corpus.pack import DEFAULT_PACK
from reference import causal_jacobian

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=32)
CONFIGS = {
    "gpt_neox": lambda v: transformers.GPTNeoXConfig(vocab_size=v, rotary_pct=0.25, use_parallel_residual=True,
                                                     bos_token_id=0, eos_token_id=0, **SIZES),
    "llama": lambda v: transformers.LlamaConfig(vocab_size=v, num_key_value_heads=1, tie_word_embeddings=False,
                                                **SIZES),
    "qwen2": lambda v: transformers.Qwen2Config(vocab_size=v, num_key_value_heads=1, tie_word_embeddings=True,
                                                **SIZES),
    "olmo": lambda v: transformers.OlmoConfig(vocab_size=v, pad_token_id=0, bos_token_id=None, eos_token_id=1,
                                              **SIZES),
    "olmo2": lambda v: transformers.Olmo2Config(vocab_size=v, pad_token_id=0, bos_token_id=None, eos_token_id=1,
                                                **SIZES),
}
FAMILY = {"gpt_neox": "gpt_neox", "llama": "llama", "qwen2": "llama", "olmo": "llama", "olmo2": "olmo2"}


def tiny(kind: str, vocab: int = 50, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](vocab)).eval()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_kernel_equals_the_per_sample_loop(kind, lm_batch):
    model = tiny(kind)
    assert family_of(model).name == FAMILY[kind]
    J = causal_jacobian(model, lm_batch)  # one sequence at a time, its padding cut off
    for method in ("exact", "structured"):
        res = ns.empirical_ntk(model, lm_batch, method=method, dtype="float64")
        torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["gpt_neox", "llama", "olmo2"])
@torch.no_grad()
def test_layer_points_read_the_hidden_states(kind, lm_batch):
    model = tiny(kind)
    mask = lm_batch["attention_mask"]
    hidden = model(**lm_batch, output_hidden_states=True).hidden_states
    emb = ns.layer_embeddings(model, lm_batch)  # block outputs
    assert emb.layers == [0, 1]
    np.testing.assert_allclose(emb.embeddings[0], masked_mean(hidden[1].float(), mask).numpy(), rtol=1e-5, atol=1e-6)
    first_block = family_of(model).blocks(model)[0]
    seen = {}
    probe = first_block.mlp.register_forward_hook(lambda m, args, out: seen.update(args=args[0], out=out))
    model(**lm_batch)
    probe.remove()
    for point, value in (("ffn_input", seen["args"]), ("ffn_output", seen["out"])):
        got = ns.layer_embeddings(model, lm_batch, point=point, layers=[0]).embeddings[0]
        np.testing.assert_allclose(got, masked_mean(value.float(), mask).numpy(), rtol=1e-5, atol=1e-6)
    attn = ns.layer_embeddings(model, lm_batch, point="attn_input", layers=[1]).embeddings[1]
    assert attn.shape == (8, 16) and np.isfinite(attn).all()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Llama and Qwen2 save_pretrained directories, and a Pythia-style directory of stepN
    checkpoints with the tokenizer beside them, all over the shipped pack's 8192-token BPE."""
    root = tmp_path_factory.mktemp("families")
    for kind in ("llama", "qwen2"):
        tiny(kind, vocab=8192).save_pretrained(root / kind)
        (root / kind / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    for step, seed in ((0, 0), (1000, 1)):
        tiny("gpt_neox", vocab=8192, seed=seed).save_pretrained(root / "pythia" / f"step{step}")
    (root / "pythia" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    return root


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gc_command_on_a_saved_directory(saved, kind, tmp_path):
    out = tmp_path / "gc"
    assert main(["-q", "gc", str(saved / kind), "--n", "24", "--seq-len", "16", "--bins", "2", "--resamples", "50",
                 "--null-draws", "20", "--out", str(out)]) == 0
    table = pd.read_csv(out / "gc.csv")
    assert len(table) == 2 and table["abs_gc"].between(0, 1).all()
    result = json.loads((out / "result.json").read_text())
    assert result["n"] == 24 and type(load_checkpoint(saved / kind)).__name__ == \
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]


def test_pythia_training_checkpoints_are_a_run(saved, tmp_path):
    run = saved / "pythia"
    assert is_run_dir(run) and not is_run_dir(run / "step1000")
    assert [s for s, _ in list_checkpoints(run)] == [0, 1000]
    assert main(["-q", "gc", str(run), "--n", "24", "--seq-len", "16", "--resamples", "50", "--null-draws", "20",
                 "--out", str(tmp_path / "gc")]) == 0
    series = pd.read_csv(tmp_path / "gc" / "gc_over_steps.csv")
    assert list(series["step"]) == [0, 1000]
