"""Per-sample gradients and parameter selection against a per-sample autograd loop."""

import pytest
import torch
import torch.nn as nn

import ntkscope as ns
from tests.reference import causal_jacobian, jacobian_loop


def test_per_sample_grads_match_autograd_loop(gpt, lm_batch):
    res = ns.per_sample_grads(gpt, lm_batch, chunk_size=3)
    J_ref = causal_jacobian(gpt, lm_batch)
    assert res.flatten().shape == J_ref.shape
    torch.testing.assert_close(res.flatten(), J_ref, rtol=1e-10, atol=1e-12)
    # per-parameter views have the parameter's shape and the right values
    wte = res.grads["transformer.wte.weight"]
    assert wte.shape == (8, 50, 16)
    torch.testing.assert_close(wte[3].reshape(-1), J_ref[3, : 50 * 16])


def test_outputs_are_the_per_sample_losses(gpt, lm_batch):
    from tests.reference import causal_loss

    res = ns.per_sample_grads(gpt, lm_batch)
    expected = torch.stack([causal_loss(gpt, lm_batch["input_ids"][i], lm_batch["attention_mask"][i]) for i in range(8)])
    torch.testing.assert_close(res.outputs, expected.detach())


def test_float64_on_a_float32_model_leaves_the_model_unchanged(lm_batch):
    from cse_models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)).float()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = ns.per_sample_grads(model, lm_batch, dtype="float64")
    assert res.flatten().dtype == torch.float64  # J takes the parameters' dtype, not the default
    assert next(model.parameters()).dtype == torch.float32
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # and the float64 result is the float64 reference (dropout off: eval mode)
    ref_model = GPT(model.config).double().eval()
    ref_model.load_state_dict({k: v.double() for k, v in before.items()})
    torch.testing.assert_close(res.flatten(), causal_jacobian(ref_model, lm_batch), rtol=1e-9, atol=1e-12)


def test_param_globs_select_columns(gpt, lm_batch):
    res = ns.per_sample_grads(gpt, lm_batch, params="transformer.h.1.*")
    assert all(n.startswith("transformer.h.1.") for n in res.names)
    names = [n for n, _ in gpt.named_parameters() if n.startswith("transformer.h.1.")]
    J_ref = causal_jacobian(gpt, lm_batch, names)
    torch.testing.assert_close(res.flatten(), J_ref, rtol=1e-10, atol=1e-12)


def test_modules_select_their_parameters(gpt):
    sel = ns.select_parameters(gpt, params=[gpt.transformer.h[0].mlp])
    assert sel.names == ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
                         "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias")


def test_blocks_are_contiguous_and_cover_all_columns(gpt):
    sel = ns.select_parameters(gpt, blocks="layer")
    assert list(sel.blocks) == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                                "transformer.ln_f"]
    ranges = list(sel.blocks.values())
    assert ranges[0][0] == 0 and ranges[-1][1] == sel.n_params
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # tied lm_head appears once, under wte
    assert "lm_head.weight" not in sel.names
    assert sel.n_params == sum(p.numel() for p in gpt.parameters())


def test_expert_and_mapping_blocks():
    model = nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), "head": nn.Linear(2, 1)})
    sel = ns.select_parameters(model, blocks="expert")
    assert list(sel.blocks) == ["experts.0", "experts.1", "head"]
    sel = ns.select_parameters(model, blocks={"e": "experts.*"})
    assert list(sel.blocks) == ["e", "rest"]


def test_vector_output_jacobian_matches_jacrev_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    res = ns.per_sample_grads(model, x, output="logits")
    assert res.flatten().shape == (5, 2, sum(p.numel() for p in model.parameters()))
    for k in range(2):
        J_k = jacobian_loop(model, 5, lambda i: model(x[i : i + 1])[0, k])
        torch.testing.assert_close(res.flatten()[:, k], J_k)


def test_callable_output_is_applied_per_sample():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(6, 3)
    res = ns.per_sample_grads(model, x, output=lambda m, b: (m(b) ** 2).sum(-1))
    J_ref = jacobian_loop(model, 6, lambda i: (model(x[i : i + 1]) ** 2).sum())
    torch.testing.assert_close(res.flatten(), J_ref)


def test_hf_gpt2_with_padding_and_tied_embeddings(hf_gpt2, lm_batch):
    res = ns.per_sample_grads(hf_gpt2, lm_batch)
    J_ref = causal_jacobian(hf_gpt2, lm_batch)
    torch.testing.assert_close(res.flatten(), J_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunking_does_not_change_the_result(gpt, lm_batch, chunk):
    full = ns.per_sample_grads(gpt, lm_batch, chunk_size=8).flatten()
    torch.testing.assert_close(ns.per_sample_grads(gpt, lm_batch, chunk_size=chunk).flatten(), full)
