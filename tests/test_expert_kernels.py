"""Per-expert kernels (ntkscope.kernel.experts): each expert's NTK over its own parameters and the
units routed to it equals an explicit per-expert Jacobian in float64 (a per-unit autograd loop
over the whole fused tensors, then the expert's row), for transformers' Mixtral, OLMoE and
Qwen-MoE and for our CSE and Switch layers; the routed units are read from the experts' own call,
so a token the router never sends (or padding, or the last token) is not a row; and on a planted
mixture the expert serving a domain whose gradients agree is the more consistent one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cse_models import SparseHF
from cse_models.cse import convert_to_cse, upcycle
from ntkscope.core.checks import InputError
from ntkscope.gc.experts import expert_gc, split_half_gc
from ntkscope.kernel.experts import expert_ntk, find_mixtures

transformers = pytest.importorskip("transformers")
from test_hf_sparse import dense, planted_domains  # noqa: E402

MIXTURES = {
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_SIZES),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **_SIZES),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                                     shared_expert_intermediate_size=8, decoder_sparse_step=1,
                                                     mlp_only_layers=[], **_SIZES),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                                     decoder_sparse_step=1, mlp_only_layers=[], head_dim=8, **_SIZES),
}
_SIZES = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=32)


def _mixture(kind: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MIXTURES[kind]()).double().eval()
    model.config._experts_implementation = "eager"  # the reference's own forward in float64
    return model


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    mask[3, 4:] = 0
    return ids, mask


def _token_losses(logits, ids, mask):
    """(n, T) next-token losses, 0 where nothing is predicted (padding, the last real token)."""
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    kept = (mask[:, 1:] & mask[:, :-1]).bool()
    return torch.cat([torch.where(kept, loss, 0.0), loss.new_zeros(len(ids), 1)], 1), \
        torch.cat([kept, kept.new_zeros(len(ids), 1)], 1)


def _reference(model, ids, mask, e, layer_module, params, unit):
    """Units routed to expert ``e`` (read from the experts' own call: the top-k indices it is
    given, or our layer's routing) and J_e J_e^T by a per-unit autograd loop over whole tensors."""
    seen = {}

    def record(key, value):
        seen.setdefault(key, value)  # the first call only; a hook that returns None changes nothing

    if hasattr(layer_module, "gate"):  # transformers: the experts module's (hidden, top_k_index, weights)
        handle = layer_module.experts.register_forward_pre_hook(lambda m, a: record("topk", a[1]))
    else:
        handle = layer_module.register_forward_hook(lambda m, a, o: record("x", a))
    out = model(input_ids=ids, attention_mask=mask)
    logits = getattr(out, "logits", out)  # SparseHF returns the logits
    handle.remove()
    losses, kept = _token_losses(logits, ids, mask)
    if "topk" in seen:
        routed = (seen["topk"] == e).any(-1).reshape(ids.shape)
    elif hasattr(layer_module, "route"):  # CSE: the sequence's expert
        routed = (layer_module.route(*seen["x"][:2])[1] == e)[:, None].expand(ids.shape)
    else:  # Switch: its per-sequence routes
        routed = layer_module.sequence_routes(*seen["x"][:2])[1] == e
    routed = routed & mask.bool()
    if unit == "token":
        units = [(i, t) for i, t in zip(*np.nonzero((routed & kept).numpy()))]
        values = [losses[i, t] for i, t in units]
    else:
        units = [(i, -1) for i in np.flatnonzero((routed & kept).any(1).numpy())]  # a position with a value
        values = [losses[i].sum() / kept[i].sum() for i, _ in units]
    rows = []
    for v in values:
        grads = torch.autograd.grad(v, [p for p, _ in params], retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g)[index if index is not None else ...].reshape(-1)
                               for g, (p, index) in zip(grads, params)]))
    J = torch.stack(rows)
    return units, J @ J.T


@pytest.mark.parametrize("kind", sorted(MIXTURES))
@pytest.mark.parametrize("unit", ["token", "sequence"])
def test_a_transformers_mixture_s_expert_kernel_is_its_explicit_jacobian(kind, unit):
    model = _mixture(kind)
    ids, mask = _batch()
    layer = "model.layers.1.mlp"
    assert list(find_mixtures(model)) == ["model.layers.0.mlp", layer]
    block = model.get_submodule(layer)
    kernels = expert_ntk(model, {"input_ids": ids, "attention_mask": mask}, layer=layer, unit=unit)
    assert [k.expert for k in kernels] == sorted({k.expert for k in kernels}) and len(kernels) >= 2
    total = 0
    for k in kernels:
        fused = [(block.experts.gate_up_proj, k.expert), (block.experts.down_proj, k.expert)]
        units, reference = _reference(model, ids, mask, k.expert, block, fused, unit)
        assert [tuple(r) for r in k.rows[["sample", "position"]].to_numpy()] == units
        assert k.n_params == 2 * 12 * 16 + 16 * 12 if kind.startswith("qwen") else 2 * 24 * 16 + 16 * 24
        assert k.method == "per-unit backward" and k.unit == unit
        torch.testing.assert_close(k.matrix, reference, rtol=1e-10, atol=1e-12)
        total += len(units)
    if unit == "token":  # every predicting real token goes to its top 2: no other token is a row
        kept = (mask[:, 1:] & mask[:, :-1]).sum()
        assert total == 2 * kept


@pytest.mark.parametrize("sparse", ["cse", "switch"])
def test_our_layers_expert_kernels_are_their_explicit_jacobians(sparse):
    torch.manual_seed(0)
    hf = dense("gpt2").double()
    model = SparseHF(hf, dict(kind=sparse, layers=[1], n_experts=[0])).eval()
    ids, _ = planted_domains(n_per=10)
    if sparse == "cse":
        emb = hf.get_input_embeddings().weight
        with torch.no_grad():  # two vocabularies apart: two clusters
            u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0), dtype=emb.dtype)
            emb[:25] += u
            emb[25:] -= u
        convert_to_cse(model, ids, None, min_cluster_size=5, max_experts=4)
    else:
        upcycle(model, 3)
        with torch.no_grad():
            next(iter(model.sparse_layers().values())).router.weight.normal_(0, 1.0)
    (path, layer), = model.sparse_layers().items()
    ids, mask = _batch()
    ids = ids % 50
    kernels = expert_ntk(model, {"input_ids": ids, "attention_mask": mask})
    assert {k.layer for k in kernels} == {path}
    assert all(k.unit == ("sequence" if sparse == "cse" else "token") for k in kernels)
    for k in kernels:
        own = [(p, None) for p in layer.experts[k.expert].parameters()]
        units, reference = _reference(model, ids, mask, k.expert, layer, own, k.unit)
        assert [tuple(r) for r in k.rows[["sample", "position"]].to_numpy()] == units
        assert k.method.startswith("engine") if sparse == "cse" else k.method == "per-unit backward"
        torch.testing.assert_close(k.matrix.double(), reference, rtol=1e-9, atol=1e-12)


def test_the_expert_serving_agreeing_gradients_is_the_more_consistent():
    """Planted: domain a is one sentence with a token changed here and there (its gradients
    agree), domain b random text; CSE sends each to its own expert. The a expert's split-half
    |GC| is near 1 and above b's band; GC groups inside an expert read each domain's units."""
    torch.manual_seed(0)
    hf = dense("gpt2").double()
    emb = hf.get_input_embeddings().weight
    with torch.no_grad():
        u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0), dtype=emb.dtype)
        emb[:25] += u
        emb[25:] -= u
    model = SparseHF(hf, dict(kind="cse", layers=[1], n_experts=[0])).eval()
    fit, _ = planted_domains(n_per=20)
    convert_to_cse(model, fit, None, min_cluster_size=5, max_experts=4)
    g = torch.Generator().manual_seed(7)
    template = torch.randint(0, 25, (12,), generator=g)
    a = template.repeat(16, 1)
    a[torch.arange(16), torch.randint(0, 12, (16,), generator=g)] = torch.randint(0, 25, (16,), generator=g)
    b = torch.randint(25, 50, (16, 12), generator=g)
    ids = torch.cat([a, b])
    kernels = {k.expert: k for k in expert_ntk(model, ids, min_units=4)}
    domain = np.array(["a"] * 16 + ["b"] * 16)
    served = {e: set(domain[k.samples()]) for e, k in kernels.items()}
    (ea,), (eb,) = ([e for e, s in served.items() if s == {d}] for d in ("a", "b"))
    band_a, band_b = split_half_gc(kernels[ea].matrix), split_half_gc(kernels[eb].matrix)
    assert band_a.median > 0.95 and band_a.low > band_b.high
    table = expert_gc(list(kernels.values()), domain, resampling=None)
    assert set(table["group"]) == {"a", "b"} and (table["n"] == table["units"]).all()
    assert np.allclose(table["gc"], 1.0)  # a pure expert: its group is its whole set


def test_a_float32_model_analysed_in_float64_routes_its_own_copy():
    """dtype=float64 on a float32 model: the kernel is computed on a float64 copy, whose routers
    are the ones read (the user's model is left as it was)."""
    ids, mask = _batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    model = _mixture("olmoe")
    reference = expert_ntk(model, batch, layer="model.layers.0.mlp", unit="token")
    single = model.float()
    copied = expert_ntk(single, batch, layer="model.layers.0.mlp", unit="token", dtype=torch.float64)
    assert next(single.parameters()).dtype == torch.float32
    for a, b in zip(reference, copied):
        assert a.rows.equals(b.rows) and b.matrix.dtype == torch.float64
        torch.testing.assert_close(a.matrix, b.matrix, rtol=1e-4, atol=1e-6)


def test_split_half_gc_known_answers():
    """Parallel gradients: every half's direction is the whole set's (1); each draw equals
    kernel_gc's |GC| of that half; two kernels over the same units pair draw by draw."""
    from ntkscope.gc.experts import halves, subset_abs_gc
    from ntkscope.kernel.uncertainty import kernel_gc

    g = np.random.default_rng(0)
    J = np.outer(g.uniform(0.5, 2.0, 12), g.normal(size=30))  # rank one, one sign
    band = split_half_gc(J @ J.T, draws=50)
    assert band.low == pytest.approx(1.0) and band.median == pytest.approx(1.0)
    K = (lambda G: G @ G.T)(g.normal(size=(12, 40)))
    H = halves(12, 5, seed=3)
    assert all(len(h) == 6 and (np.diff(h) > 0).all() for h in H) and H[0].tolist() == halves(12, 5, seed=3)[0].tolist()
    values = subset_abs_gc(K, H)
    for h, v in zip(H, values):
        assert v == pytest.approx(abs(kernel_gc(K, [h], resampling=None)[0].score), abs=1e-10)
    assert split_half_gc(K, draws=200).median < 0.99


def test_expert_ntk_refuses_what_it_cannot_read():
    ids, mask = _batch()
    with pytest.raises(InputError, match="expert_ntk: model has no mixture layer"):
        expert_ntk(dense("gpt2"), ids)
    model = _mixture("mixtral")
    with pytest.raises(InputError, match="expert_ntk: layer must be one of the model's mixture layers"):
        expert_ntk(model, ids, layer="model.layers.0.self_attn")
    with pytest.raises(InputError, match=r"expert_ntk: experts must be expert indices in \[0, 4\)"):
        expert_ntk(model, ids, experts=[4])
    with pytest.raises(InputError, match="expert_ntk: params is set per expert"):
        expert_ntk(model, ids, params="model.*")
    with pytest.raises(InputError, match="expert_ntk: max_memory is below the .* two units' gradients"):
        expert_ntk(model, ids, max_memory=1000)


def test_a_kernel_above_max_memory_is_made_in_panels_with_the_same_numbers():
    """J_e larger than max_memory: the units in panels, each panel against the later ones taken
    again; the same kernel as one panel to rounding."""
    model = _mixture("qwen3_moe")
    ids, mask = _batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    whole = expert_ntk(model, batch, layer="model.layers.1.mlp", unit="token")
    P = whole[0].n_params
    tight = expert_ntk(model, batch, layer="model.layers.1.mlp", unit="token", max_memory=2 * 4 * 8 * (P + 36))
    for a, b in zip(whole, tight):
        assert a.method == "per-unit backward" and b.method.endswith("panels") and int(b.method.split(", ")[1][0]) > 1
        torch.testing.assert_close(a.matrix, b.matrix, rtol=1e-12, atol=1e-14)


def test_a_sequence_routed_only_at_its_last_token_is_not_a_unit():
    """Top-1 routing, two-token sequences: a sequence whose only predicting position goes elsewhere
    has no gradient over the expert its last token went to, so it is not that expert's row (every
    diagonal entry of every kernel positive)."""
    config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=1, **_SIZES)
    torch.manual_seed(1)
    model = transformers.MixtralForCausalLM(config).double().eval()
    ids = torch.randint(0, 50, (24, 2), generator=torch.Generator().manual_seed(2))
    kernels = expert_ntk(model, ids, layer="model.layers.1.mlp", unit="sequence")
    assert sum(len(k.rows) for k in kernels) == 24  # each sequence once: the expert of its first token
    assert all((torch.diagonal(k.matrix) > 0).all() for k in kernels)


def test_a_callable_output_frozen_experts_and_a_numpy_index_are_read():
    """A callable output (the model wrapped, its names prefixed), an expert whose tensors do not
    require grad, and experts=np.int64: the same kernel as the plain call."""
    model = _mixture("mixtral")
    ids, mask = _batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    plain = expert_ntk(model, batch, layer="model.layers.1.mlp", unit="sequence", experts=1)

    def mean_loss(m, b):
        logits = m(**b).logits
        losses, kept = _token_losses(logits, b["input_ids"], b["attention_mask"])
        return losses.sum(1) / kept.sum(1)

    called = expert_ntk(model, batch, layer="model.layers.1.mlp", unit="sequence", experts=np.int64(1),
                        output=mean_loss)
    torch.testing.assert_close(called[0].matrix, plain[0].matrix, rtol=1e-9, atol=1e-12)
    for p in model.model.layers[1].mlp.experts.parameters():
        p.requires_grad_(False)
    frozen = expert_ntk(model, batch, layer="model.layers.1.mlp", unit="sequence", experts=[1])
    torch.testing.assert_close(frozen[0].matrix, plain[0].matrix, rtol=1e-12, atol=1e-14)


def test_split_half_gc_skips_halves_without_gradient():
    """Units with zero gradient: a half of only those has no |GC|; the band is over the others."""
    K = np.diag([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    K[:3, :3] = 1.0  # three parallel gradients, three zero ones
    band = split_half_gc(K, draws=100)
    assert 0 < band.draws < 100 and band.median == pytest.approx(1.0)


def test_the_eval_view_reads_a_masked_lm_s_switch_experts_by_sequence():
    """expert_view on a BERT with a Switch layer: a masked LM has no per-token value, so its token
    router's experts are read by sequence; consistency bands in [0, 1]; GC rows per label."""
    from ntkscope.gc.experts import expert_view

    hf = dense("bert")
    hf.config.mask_token_id = 49
    model = SparseHF(hf, dict(kind="switch", layers=[1], n_experts=[0])).eval()
    upcycle(model, 2)
    ids, domain = planted_domains(n_per=6)
    summary, gc = expert_view(model, ids.tolist(), ["a" if d == 0 else "b" for d in domain.tolist()], texts=12,
                              context=16)
    assert len(summary) and (summary["unit"] == "sequence").all()
    assert ((0 <= summary["consistency_low"]) & (summary["consistency_high"] <= 1)).all()
    assert set(gc["group"]) <= {"a", "b"} and len(gc)
