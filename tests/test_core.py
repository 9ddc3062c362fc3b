"""The shared core (one LM loss, the masked mean, atomic writes, errors), the options object
and the model-family registry."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import ntkscope as ns
from ntkscope.core.checks import InputError, entry
from ntkscope.core.files import JsonCache, atomic_path, digest
from ntkscope.core.lm import causal_pairs, causal_targets, lm_loss, masked_mean, token_values
from ntkscope.runs.families import FAMILIES, family_for_config, family_of, layer_points
from cse_models import GPT, GPTConfig


def test_causal_lm_loss_equals_a_token_loop():
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 6, 11), torch.randint(0, 11, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    per_seq = lm_loss(*causal_pairs(logits, ids, mask), reduction="sequence")
    for i in range(3):
        pairs = [(t, ids[i, t + 1]) for t in range(5) if mask[i, t] and mask[i, t + 1]]
        expected = sum(-F.log_softmax(logits[i, t], -1)[y] for t, y in pairs) / len(pairs)
        torch.testing.assert_close(per_seq[i], expected)
    total = lm_loss(*causal_pairs(logits, ids, mask), reduction="sum")
    tokens = lm_loss(*causal_pairs(logits, ids, mask), reduction="none")  # (3, 5), 0 at dropped pairs
    assert tokens.shape == (3, 5) and tokens[1, 3:].eq(0).all()
    torch.testing.assert_close(total, tokens.sum())
    torch.testing.assert_close(lm_loss(*causal_pairs(logits, ids, mask), reduction="mean"),
                               total / (mask[:, 1:] & mask[:, :-1]).sum())


@pytest.mark.parametrize("value", ["loss", "true-logit", "centred-true-logit"])
def test_causal_targets_read_the_pairs_without_slicing_the_logits(value):
    # every value and reduction, and the gradient the kernel differentiates, as over causal_pairs
    torch.manual_seed(2)
    logits, ids = torch.randn(3, 6, 11, requires_grad=True), torch.randint(0, 11, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    for reduction in ("sequence", "sequence-sum", "none"):
        pairs = token_values(*causal_pairs(logits, ids, mask), value=value, reduction=reduction)
        whole = token_values(logits, *causal_targets(ids, mask), value=value, reduction=reduction)
        torch.testing.assert_close(whole if reduction != "none" else whole[:, :-1], pairs, rtol=1e-12, atol=0)
    for m in (mask, None):
        a = torch.autograd.grad(token_values(*causal_pairs(logits, ids, m), value=value).sum(), logits)[0]
        b = torch.autograd.grad(token_values(logits, *causal_targets(ids, m), value=value).sum(), logits)[0]
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)


def test_masked_lm_loss_ignores_unmasked_targets():
    torch.manual_seed(1)
    logits, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels = torch.full_like(ids, -100)
    labels[0, 1], labels[1, 3], labels[1, 4] = ids[0, 1], ids[1, 3], ids[1, 4]
    sums = lm_loss(logits, labels, reduction="sequence-sum")
    torch.testing.assert_close(sums[0], -F.log_softmax(logits[0, 1], -1)[ids[0, 1]])
    torch.testing.assert_close(lm_loss(logits, labels, reduction="sequence")[1], sums[1] / 2)
    torch.testing.assert_close(lm_loss(logits, labels, labels != -100, reduction="sum"), sums.sum())


def test_masked_mean_over_real_tokens():
    x = torch.arange(12.0).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = masked_mean(x, mask)
    torch.testing.assert_close(out[0], x[0, :2].mean(0))
    assert out[1].eq(0).all()  # no real token: 0, not NaN
    torch.testing.assert_close(masked_mean(x, None), x.mean(1))


def test_the_outermost_entry_names_the_error():
    @entry("inner")
    def inner(value):
        raise InputError("value", "must be good", value)

    @entry("outer")
    def outer(value):
        return inner(value)

    with pytest.raises(ValueError, match=r"^outer: value must be good \(got 3\)$"):
        outer(3)
    with pytest.raises(ValueError, match=r"^inner: value must be good \(got 4\)$"):
        inner(4)


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]
    with atomic_path(target) as tmp:
        tmp.write_text("new\n")
    assert target.read_text() == "new\n" and len(list(tmp_path.iterdir())) == 1


def test_json_cache_computes_once(tmp_path):
    calls = []
    cache = JsonCache(tmp_path / "cache")
    key = digest({"a": 1}, arrays={"x": torch.arange(3)})
    assert key == digest({"a": 1}, arrays={"x": torch.arange(3)}) != digest({"a": 2}, arrays={"x": torch.arange(3)})
    for _ in range(2):
        assert cache.get("step-000001", key, lambda: calls.append(1) or [{"v": 1.5}]) == [{"v": 1.5}]
    assert len(calls) == 1


def test_kernel_options_are_one_validated_object(gpt, lm_batch):
    opts = ns.KernelOptions(method="exact", dtype="float64")
    assert opts.dtype is torch.float64
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.method = "projected"
    a = ns.empirical_ntk(gpt, lm_batch, options=opts)
    b = ns.empirical_ntk(gpt, lm_batch, method="exact", dtype=torch.float64)
    torch.testing.assert_close(a.matrix, b.matrix, rtol=0, atol=0)
    assert ns.empirical_ntk(gpt, lm_batch, options=opts, method="projected", projection_dim=8).method == "projected"
    with pytest.raises(ValueError, match=r"empirical_ntk: options must be fields of KernelOptions .* \(got \['chunk'\]\)"):
        ns.empirical_ntk(gpt, lm_batch, chunk=4)
    with pytest.raises(ValueError, match=r"empirical_ntk: method must form the kernel, one of \['auto', 'exact', "
                                         r"'structured', 'projected'\] \('matrix-free' finds eigenpairs without "
                                         r"forming it\)"):
        ns.empirical_ntk(gpt, lm_batch, options=ns.KernelOptions(method="matrix-free"))
    eig = ns.ntk_top_eigenpair(gpt, lm_batch, options=opts)
    assert eig.method == "dense" and eig.eigenvector.shape == (8,)


def test_model_families(gpt, hf_bert):
    transformers = pytest.importorskip("transformers")
    hf_gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                   n_layer=2, n_head=2))
    assert family_of(gpt).name == "cse_models" and family_of(hf_gpt2).name == "gpt2"
    assert family_of(hf_bert).name == "bert"
    assert family_of(gpt).causal(gpt) and not family_of(hf_bert).causal(hf_bert)
    blocks, path, use_input = layer_points(hf_bert, "ffn_input")
    assert len(blocks) == 2 and (path, use_input) == ("intermediate", True)
    assert family_of(hf_gpt2).vocab_size(hf_gpt2) == 50 == family_of(gpt).vocab_size(gpt)
    assert family_for_config({"model_type": "gpt"}) is FAMILIES["cse_models"]
    assert family_for_config({"model_type": "bert", "architectures": ["BertForMaskedLM"]}) is FAMILIES["bert"]
    assert family_for_config({"hidden": 3}) is None
    with pytest.raises(ValueError, match=r"model must be a model of a known family"):
        family_of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("spec", [
    {},
    {"bias": False, "tie_weights": False},
    {"sparse": {"kind": "switch", "layers": [1, 2], "n_experts": [3, 2]}},
    {"sparse": {"kind": "cse", "layers": [1], "n_experts": [4], "module": "attn", "proj_dim": 4}},
    {"sparse": {"kind": "demix", "layers": [0], "n_experts": [3], "domains": ["a", "b", "c"]}},
    {"model_type": "bert", "mask_token_id": 3},
])
def test_the_size_check_counts_a_models_parameters_from_its_config(spec):
    from cse_models import BERT, BERTConfig
    from cse_models.model import parameter_count
    from ntkscope.core.memory import parameter_count as count_on_meta

    bert = spec.pop("model_type", None) == "bert"
    config = (BERTConfig if bert else GPTConfig)(vocab_size=100, block_size=16, n_layer=3, n_head=2, n_embd=8, **spec)
    model = (BERT if bert else GPT)(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    assert count_on_meta(lambda: (BERT if bert else GPT)(config)) == parameter_count(config)


def test_progress_bars_follow_the_log_level_ci_and_the_switch(monkeypatch, capsys):
    import logging

    from ntkscope.core.progress import progress_bar, progress_shown

    logger = logging.getLogger("ntkscope")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("NTKSCOPE_PROGRESS", raising=False)
    level = logger.level
    logger.setLevel(logging.WARNING)
    assert not progress_shown()  # library use in a script: quiet
    logger.setLevel(logging.INFO)
    assert progress_shown()  # the command line's default
    with progress_bar(5, "chunks", "sample") as bar:
        bar.update(5)
    assert "chunks" in capsys.readouterr().err
    assert not progress_bar(5, "hidden", hidden=True).update(5) and "hidden" not in capsys.readouterr().err
    for name, value in (("CI", "true"), ("NTKSCOPE_PROGRESS", "0")):
        monkeypatch.setenv(name, value)
        assert not progress_shown(), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("NTKSCOPE_PROGRESS", "1")  # forced on, above CI and the level
    logger.setLevel(logging.WARNING)
    assert progress_shown()
    logger.setLevel(level)


@pytest.mark.parametrize("n,chunk", [(37, 8), (64, 64), (5, 256)])
def test_linear_cross_entropy_equals_the_logits_path_and_its_gradients(n, chunk):
    from ntkscope.core.lm import linear_cross_entropy

    torch.manual_seed(n)
    h = torch.randn(n, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (n,))
    fused = linear_cross_entropy(h, weight, y, chunk=chunk)
    plain = lm_loss(h @ weight.T, y, reduction="sum")
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    g_fused = torch.autograd.grad(2.5 * fused, (h, weight))
    g_plain = torch.autograd.grad(2.5 * plain, (h, weight))
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_training_loss_equals_the_full_logits_path_in_float64():
    """cse_models.train.lm_loss (no last-position logits; fused head on CPU) against every
    position's logits shifted by causal_pairs: the same loss and the same gradients."""
    from cse_models.train import TrainConfig, lm_loss as train_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=12, n_layer=2, n_head=2, n_embd=16)).double()
    ids = torch.randint(0, 50, (4, 12))
    loss_sum, count = train_loss(model, ids, None, 0, TrainConfig())
    grads = torch.autograd.grad(loss_sum, list(model.parameters()))
    logits, targets, _ = causal_pairs(model(ids), ids)
    reference = lm_loss(logits, targets, reduction="sum")
    torch.testing.assert_close(loss_sum, reference, rtol=1e-12, atol=1e-10)
    assert int(count) == targets.numel()
    for a, b in zip(grads, torch.autograd.grad(reference, list(model.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
