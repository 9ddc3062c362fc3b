"""Empirical NTK: exact and projected against J @ J.T, known answers, HF models."""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ntkscope as ns
from ntkscope.kernel.objectives import resolve_output
from tests.reference import masked_jacobian, causal_jacobian, jacobian_loop
from ntkscope.kernel.kernels import jl_error_bound


def test_exact_equals_explicit_gram(gpt, lm_batch):
    J = causal_jacobian(gpt, lm_batch)
    res = ns.empirical_ntk(gpt, lm_batch, method="exact", chunk_size=3)
    assert res.method == "exact" and res.gradient_passes == 1
    torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-10, atol=1e-12)
    assert torch.equal(res.matrix, res.matrix.T)


def test_cross_ntk_equals_j1_j2t(gpt, lm_batch):
    b1 = {k: v[:5] for k, v in lm_batch.items()}
    b2 = {k: v[5:] for k, v in lm_batch.items()}
    J = causal_jacobian(gpt, lm_batch)
    res = ns.empirical_ntk(gpt, b1, b2, method="exact", chunk_size=2)
    assert res.matrix.shape == (5, 3)
    torch.testing.assert_close(res.matrix, J[:5] @ J[5:].T, rtol=1e-10, atol=1e-12)


def test_blocks_sum_to_the_whole_and_match_their_columns(gpt, lm_batch):
    res = ns.empirical_ntk(gpt, lm_batch, blocks="layer", method="exact")
    torch.testing.assert_close(sum(res.blocks.values()), res.matrix, rtol=1e-12, atol=1e-12)
    names = [n for n, _ in gpt.named_parameters() if n.startswith("transformer.h.0.")]
    J0 = causal_jacobian(gpt, lm_batch, names)
    torch.testing.assert_close(res.blocks["transformer.h.0"], J0 @ J0.T, rtol=1e-10, atol=1e-12)


def test_panels_when_j_does_not_fit_give_the_same_kernel(gpt, lm_batch):
    full = ns.empirical_ntk(gpt, lm_batch, method="exact", chunk_size=2)
    P = full.n_params
    row = P * 8
    # 12 rows: a 2-sample chunk's rows and measured transient (2-4 rows a sample here) leave room for a
    # panel of a few rows, never all of J (8 rows)
    small = ns.empirical_ntk(gpt, lm_batch, method="exact", chunk_size=2, max_memory=12 * row + 1000)
    assert small.gradient_passes > 1
    torch.testing.assert_close(small.matrix, full.matrix, rtol=1e-12, atol=1e-12)
    cross = ns.empirical_ntk(gpt, lm_batch, {k: v[:3] for k, v in lm_batch.items()}, method="exact",
                             chunk_size=2, max_memory=12 * row + 1000)
    torch.testing.assert_close(cross.matrix, full.matrix[:, :3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("projection", ["gaussian", "rademacher"])
def test_projected_within_its_stated_bound(gpt, lm_batch, projection):
    exact = ns.empirical_ntk(gpt, lm_batch, method="exact", blocks="layer")
    proj = ns.empirical_ntk(gpt, lm_batch, method="projected", blocks="layer", projection=projection,
                            projection_dim=4000, seed=3)
    assert proj.method == "projected" and 0 < proj.error_bound < 1
    for name, block in exact.blocks.items():
        d = torch.sqrt(torch.outer(block.diag(), block.diag()))
        err = (proj.blocks[name] - block).abs()
        assert bool((err <= proj.error_bound * d + 1e-12).all()), name
    d = torch.sqrt(torch.outer(exact.matrix.diag(), exact.matrix.diag()))
    assert bool(((proj.matrix - exact.matrix).abs() <= proj.error_bound * d).all())
    # the same seed gives the same kernel; another seed another one
    again = ns.empirical_ntk(gpt, lm_batch, method="projected", blocks="layer", projection=projection,
                             projection_dim=4000, seed=3)
    assert torch.equal(again.matrix, proj.matrix)


def test_jl_bound_shrinks_with_k_and_is_infinite_for_tiny_k():
    assert jl_error_bound(10_000, 100) < jl_error_bound(1000, 100) < 1
    assert jl_error_bound(4, 10**6) == float("inf")


def test_linear_model_has_the_analytic_ntk():
    torch.manual_seed(0)
    X = torch.randn(7, 4)
    model = nn.Linear(4, 1)  # f(x) = w.x + b: grad = (x, 1), Theta = X X^T + 1
    res = ns.empirical_ntk(model, X, output="logits")
    torch.testing.assert_close(res.matrix, X @ X.T + 1)
    # K outputs: each output's kernel is X X^T + 1 (block-diagonal Jacobian); trace is K times that
    model3 = nn.Linear(4, 3)
    diag = ns.empirical_ntk(model3, X, output="logits", reduction="diagonal")
    assert diag.matrix.shape == (3, 7, 7)
    for k in range(3):
        torch.testing.assert_close(diag.matrix[k], X @ X.T + 1)
    trace = ns.empirical_ntk(model3, X, output="logits", reduction="trace")
    torch.testing.assert_close(trace.matrix, 3 * (X @ X.T + 1))


def test_auto_takes_the_cheapest_estimate_and_says_why(gpt, lm_batch):
    res = ns.empirical_ntk(gpt, lm_batch)
    assert res.method == "structured"  # a scalar output of a transformer: one batched backward
    assert all(m in res.reason for m in ("exact", "structured", "projected")) and "steps" in res.reason
    # a vector output (structured cannot take it), n = 100, P = 20001: J (16 MB) does not fit in 10 MB
    # (large enough that the measured transients are not lost in the kernel's RSS counting, ~0.5 MB)
    torch.manual_seed(0)
    X = torch.randn(100, 20000)
    model = nn.Linear(20000, 1)
    res = ns.empirical_ntk(model, X, output="logits", projection_dim=2, chunk_size=4, max_memory=10_000_000)
    assert res.method == "projected"  # estimated more than 4x cheaper than exact in panels
    panels = ns.empirical_ntk(model, X, output="logits", projection_dim=64, chunk_size=4, max_memory=10_000_000)
    assert panels.method == "exact" and panels.gradient_passes > 1 and "exact in panels" in panels.reason
    torch.testing.assert_close(panels.matrix, X @ X.T + 1)


def test_hf_gpt2_ntk_with_tied_weights(hf_gpt2, lm_batch):
    J = causal_jacobian(hf_gpt2, lm_batch)
    res = ns.empirical_ntk(hf_gpt2, lm_batch, method="exact")
    torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-9, atol=1e-12)


def test_hf_bert_masked_lm_ntk(hf_bert, lm_batch):
    output = ns.LMLoss(objective="masked", mask_token_id=1, mask_prob=0.3, seed=7)
    res = ns.empirical_ntk(hf_bert, lm_batch, output=output, method="exact")
    # reference: HF's own 2-D attention mask, one sample at a time, the same deterministic mask
    objective = resolve_output(output, hf_bert)
    J = masked_jacobian(hf_bert, lm_batch, objective, F.cross_entropy)
    torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-9, atol=1e-12)


def test_masked_lm_mask_is_a_function_of_the_sample(hf_bert, lm_batch):
    objective = resolve_output(ns.LMLoss(objective="masked", mask_token_id=1), hf_bert)
    a = objective.prepare(hf_bert, lm_batch)["aux"]["mask"]
    flipped = {k: v.flip(0) for k, v in lm_batch.items()}
    b = objective.prepare(hf_bert, flipped)["aux"]["mask"]
    assert torch.equal(a, b.flip(0))
    assert bool((a.sum(1) >= 1).all()) and not bool((a & ~lm_batch["attention_mask"].bool()).any())


def test_loss_objective_is_detected(gpt, hf_bert):
    assert resolve_output("loss", gpt).__class__.__name__ == "CausalLMLoss"
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_output("loss", hf_bert)


def test_hidden_mean_of_an_encoder_without_head(lm_batch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                                                          intermediate_size=16, vocab_size=50,
                                                          max_position_embeddings=16), add_pooling_layer=False).eval()
    b = {k: v[:4] for k, v in lm_batch.items()}
    res = ns.empirical_ntk(bert, b, output="hidden-mean", reduction="trace")

    def pooled(i, k):
        n = int(b["attention_mask"][i].sum())
        return bert(input_ids=b["input_ids"][i : i + 1, :n]).last_hidden_state[0].mean(0)[k]

    ref = sum((lambda J: J @ J.T)(jacobian_loop(bert, 4, lambda i: pooled(i, k))) for k in range(8))
    torch.testing.assert_close(res.matrix, ref, rtol=1e-9, atol=1e-12)
    assert np.allclose(res.numpy(), ref.detach().numpy())


def test_a_registered_token_value_is_an_output_by_name(gpt, lm_batch):
    """The recipe in docs/architecture.md: one register_token_value call makes an output the kernel
    takes by name; its NTK, by every method "auto" may pick, equals the per-sample autograd loop's."""
    from ntkscope.core.checks import UserError
    from ntkscope.core.lm import TOKEN_VALUES, register_token_value
    from ntkscope.kernel.objectives import OUTPUTS

    def true_prob(logits, targets):  # the probability of the true token
        return torch.softmax(logits, dim=-1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)

    register_token_value("true-prob", true_prob)
    try:
        ids, mask = lm_batch["input_ids"], lm_batch["attention_mask"]

        def f(i):  # the mean over predicted positions of one sequence, its padding cut off
            x = ids[i : i + 1, : int(mask[i].sum())]
            return F.softmax(gpt(input_ids=x)[0, :-1], dim=-1).gather(1, x[0, 1:, None]).mean()

        J = jacobian_loop(gpt, ids.shape[0], f)
        for method in ("exact", "auto"):
            res = ns.empirical_ntk(gpt, lm_batch, output="true-prob", method=method)
            torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-10, atol=1e-12)
        assert OUTPUTS["true-prob"] is True and "true-prob" in list(OUTPUTS)
        with pytest.raises(UserError, match="is a registered token value already"):
            register_token_value("true-prob", true_prob)
        with pytest.raises(UserError, match="register_token_value: fn must be a function"):
            register_token_value("other", 3)
    finally:
        TOKEN_VALUES.pop("true-prob", None)
    with pytest.raises(UserError, match="output must be one of"):
        ns.empirical_ntk(gpt, lm_batch, output="true-prob")
