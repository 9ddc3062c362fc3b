"""CSE, Switch and DEMix layers against the obvious slow versions, in float64."""

import copy
import logging

import numpy as np
import pytest
import torch

from cse_models import BERT, BERTConfig, GPT, GPTConfig, SparseConfig
from cse_models.cse import NoClusterError, convert_to_cse, fit_router
from cse_models.demix import (
    DomainPrior,
    add_expert,
    estimate_prior,
    expert_log_probs,
    mixture_log_probs,
    remove_expert,
)
from cse_models.experts import CSELayer, SwitchFFN, sequence_embedding
from cse_models.layers import MLP, SelfAttention


def tiny(model_type="gpt", sparse=None, **kw):
    torch.manual_seed(0)
    cls, config_cls = (GPT, GPTConfig) if model_type == "gpt" else (BERT, BERTConfig)
    extra = {"mask_token_id": 3} if model_type == "bert" else {}
    return cls(config_cls(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=16, sparse=sparse, **extra, **kw))


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (6, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[4, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("module", ["ffn", "attn"])
@pytest.mark.parametrize("model_type", ["gpt", "bert"])
def test_one_expert_cse_equals_the_dense_layer(module, model_type, batch):
    ids, mask = batch
    dense = tiny(model_type)
    cse = copy.deepcopy(dense)
    cse.config.sparse = SparseConfig(kind="cse", module=module, layers=[1], n_experts=[0], proj_dim=4)
    fits = convert_to_cse(cse, ids, mask, rule="dbscan-knee", eps=1e9, min_samples=2)  # one huge cluster
    assert cse.config.sparse.router_format == 2 and cse.config.sparse.normalise
    assert fits[1].n_clusters == 1 and len(cse.transformer.h[1].mlp.experts if module == "ffn" else
                                           cse.transformer.h[1].attn.experts) == 1
    out_d, out_c = dense(ids, mask), cse(ids, mask)
    torch.testing.assert_close(out_c, out_d, rtol=0, atol=0)
    out_d.square().mean().backward()
    out_c.square().mean().backward()
    grads_d = dict(dense.named_parameters())
    for name, p in cse.named_parameters():
        dense_name = name.replace(".experts.0.", ".")
        torch.testing.assert_close(p.grad, grads_d[dense_name].grad, rtol=1e-12, atol=1e-14)


def test_dispatch_equals_brute_force_argmin(batch):
    ids, mask = batch
    torch.manual_seed(1)
    C, d, dp = 3, 16, 5
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=d)
    layer = CSELayer([MLP(config) for _ in range(C)], torch.randn(dp, d), torch.randn(C, dp), torch.rand(C) + 0.5)
    x = torch.randn(6, 10, d)
    key_mask = mask.bool()
    z, assign = layer.route(x, key_mask)
    for b in range(6):
        v = x[b, key_mask[b]].mean(0)
        scores = [float(torch.linalg.norm(layer.projection @ v - layer.centres[j]) / layer.radii[j]) for j in range(C)]
        assert assign[b].item() == int(np.argmin(scores))
    out = layer(x, key_mask)
    for b in range(6):
        expected = layer.experts[assign[b].item()](x[b:b + 1], key_mask[b:b + 1])
        torch.testing.assert_close(out[b:b + 1], expected)
    assert layer.load.tolist() == torch.bincount(assign, minlength=C).tolist()
    assert layer.domain_load.numel() == 0  # no domain labels given: nothing counted by domain
    domains = torch.tensor([0, 2, 1, 2, 0, 2])
    layer.reset_load()
    layer(x, key_mask, domains)
    expected = torch.zeros(C, 3, dtype=torch.long)
    for e, d in zip(assign.tolist(), domains.tolist()):
        expected[e, d] += 1
    assert torch.equal(layer.domain_load, expected)  # what each expert received, by domain
    torch.testing.assert_close(layer(x, key_mask, domains), out)  # labels never change the routing
    layer.eval()
    layer(x, key_mask, domains)
    assert torch.equal(layer.domain_load, 2 * expected)  # counted in training only
    layer.reset_load()
    assert layer.domain_load.sum() == 0 and layer.load.sum() == 0


def test_ema_centre_update_matches_the_formula():
    torch.manual_seed(2)
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=8)
    layer = CSELayer([MLP(config), MLP(config)], torch.randn(3, 8), torch.randn(2, 3), torch.ones(2), alpha=0.9).train()
    before = layer.centres.clone()
    x = torch.randn(5, 4, 8)
    z, assign = layer.route(x)
    layer(x)
    assert torch.equal(layer.centres, before)  # forward never updates state
    layer.update_centres()
    expected = before.clone()
    for zi, j in zip(z, assign.tolist()):
        expected[j] = 0.9 * expected[j] + 0.1 * zi
    torch.testing.assert_close(layer.centres, expected)
    layer.eval()
    layer(x)
    layer.update_centres()
    torch.testing.assert_close(layer.centres, expected)  # no update outside training


def test_switch_routes_tokens_top1_with_capacity_and_aux_loss():
    torch.manual_seed(4)
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=8)
    layer = SwitchFFN([MLP(config) for _ in range(3)], 8, capacity_factor=10.0)
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    out = layer(x, mask)
    probs = torch.softmax(layer.router(x), -1)
    gate, choice = probs.max(-1)
    for b in range(2):
        for t in range(5):
            if not mask[b, t]:
                assert torch.all(out[b, t] == 0)
                continue
            expected = layer.experts[choice[b, t]](x[b, t][None, None])[0, 0] * gate[b, t]
            torch.testing.assert_close(out[b, t], expected)
    real = probs[mask]
    f = torch.bincount(real.argmax(-1), minlength=3).double() / len(real)
    torch.testing.assert_close(layer.aux_loss, 3 * (f * real.mean(0)).sum())
    assert layer.load.sum() == 8  # capacity 27 per expert: nothing dropped
    tight = SwitchFFN(list(layer.experts), 8, capacity_factor=0.3)  # capacity ceil(0.3 * 8 / 3) = 1
    tight.router.load_state_dict(layer.router.state_dict())
    out = tight(x, mask)
    kept = (out != 0).any(-1)
    assert tight.load.tolist() == [min(1, int(c)) for c in torch.bincount(choice[mask], minlength=3)]
    assert kept.sum() == tight.load.sum()
    for j in range(3):  # the first token (in order) choosing each expert is the one kept
        first = (choice[mask] == j).nonzero()
        if len(first):
            assert kept[mask][first[0, 0]]


def test_sparse_models_round_trip_through_safetensors(tmp_path, batch):
    ids, mask = batch
    models = {
        "cse": tiny(sparse=SparseConfig(kind="cse", layers=[0, 1], n_experts=[3, 2], proj_dim=4)),
        "moa": tiny(sparse=SparseConfig(kind="cse", module="attn", layers=[1], n_experts=[2], proj_dim=4)),
        "switch": tiny(sparse=SparseConfig(kind="switch", layers=[1], n_experts=[4])),
        "demix": tiny(sparse=SparseConfig(kind="demix", layers=[0, 1], domains=["general", "legal"])),
        "bert": tiny("bert", sparse=SparseConfig(kind="cse", layers=[1], n_experts=[2], proj_dim=4)),
    }
    for name, model in models.items():
        for m in model.sparse_layers().values():  # distinct centres so that routing is not degenerate
            if isinstance(m, CSELayer):
                m.projection.normal_()
                m.centres.normal_()
        model.eval().save_pretrained(tmp_path / name)
        loaded = type(model).from_pretrained(tmp_path / name).eval()
        doms = torch.tensor([0, 1, 0, 1, 1, 0])
        assert torch.equal(loaded(ids, mask, doms), model(ids, mask, doms)), name
        assert loaded.config == model.config


def test_demix_one_hot_prior_equals_the_single_expert(batch):
    ids, _ = batch
    model = tiny(sparse=SparseConfig(kind="demix", layers=[0, 1], domains=["general", "legal", "biomedical"])).eval()
    for layer in model.sparse_layers().values():
        for e in layer.experts:
            for p in e.parameters():
                torch.nn.init.normal_(p, std=0.1)
    per_expert = expert_log_probs(model, ids)
    for j in range(3):
        onehot = torch.zeros(3, dtype=torch.float64)
        onehot[j] = 1
        mixed, post = mixture_log_probs(model, ids, prior=DomainPrior(3, "cached", probs=onehot))
        torch.testing.assert_close(mixed, per_expert[j])
        assert torch.allclose(post[..., j], torch.ones_like(post[..., j]))
    mixed, post = mixture_log_probs(model, ids)  # uniform prior: a proper mixture
    brute = torch.logsumexp(torch.log(post.permute(2, 0, 1)) + per_expert, dim=0)
    torch.testing.assert_close(mixed, brute)
    torch.testing.assert_close(post[:, 0], torch.full_like(post[:, 0], 1 / 3))  # nothing seen yet
    prior = estimate_prior(model, ids)
    assert prior.mode == "cached" and prior.probs.sum().item() == pytest.approx(1)
    updating = DomainPrior(3, "updating", lam=0.5)
    mixture_log_probs(model, ids, prior=updating)
    assert not torch.allclose(updating.probs, torch.full((3,), 1 / 3))


def test_demix_remove_and_add_expert(batch):
    ids, _ = batch
    model = tiny(sparse=SparseConfig(kind="demix", layers=[1], domains=["general", "legal", "biomedical"])).eval()
    for layer in model.sparse_layers().values():
        for e in layer.experts:
            for p in e.parameters():
                torch.nn.init.normal_(p, std=0.1)
    before = expert_log_probs(model, ids)
    remove_expert(model, "legal")
    assert model.config.sparse.domains == ["general", "biomedical"] and model.config.sparse.n_experts == [2]
    after = expert_log_probs(model, ids)
    torch.testing.assert_close(after, before[[0, 2]])  # the others are untouched
    mixed, _ = mixture_log_probs(model, ids)
    two = torch.zeros(3, dtype=torch.float64)
    two[[0, 2]] = 0.5
    # the same mixture as the 3-expert model with zero prior on the removed domain
    full = tiny(sparse=SparseConfig(kind="demix", layers=[1], domains=["general", "legal", "biomedical"])).eval()
    for layer_full, layer_small in zip(full.sparse_layers().values(), model.sparse_layers().values()):
        layer_full.experts[0].load_state_dict(layer_small.experts[0].state_dict())
        layer_full.experts[2].load_state_dict(layer_small.experts[1].state_dict())
    full.load_state_dict({k: v for k, v in model.state_dict().items() if ".experts." not in k}, strict=False)
    expected, _ = mixture_log_probs(full, ids, prior=DomainPrior(3, "cached", probs=two))
    torch.testing.assert_close(mixed, expected)
    j = add_expert(model, "clinical", init_from="biomedical")
    assert j == 2 and model.config.sparse.domains[-1] == "clinical"
    torch.testing.assert_close(expert_log_probs(model, ids)[2], after[1])
    with pytest.raises(ValueError, match=r"remove_expert: domain must be one of \['general', 'biomedical', 'clinical'\]"):
        remove_expert(model, "legal")


def test_fit_router_finds_planted_clusters_and_reports_noise():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 20)) * 10
    x = np.concatenate([c + rng.normal(size=(60, 20)) * 0.3 for c in centres] + [rng.normal(size=(3, 20)) * 40])
    fit = fit_router(x, rule="dbscan-knee", representation="raw", proj_dim=8, min_samples=5, seed=0)  # turn 1's router
    assert fit.n_clusters == 3 and sorted(fit.sizes) == [60, 60, 60] and fit.n_noise == 3
    truth = np.repeat([0, 1, 2], 60)
    assert len({(t, l) for t, l in zip(truth, fit.labels[:180])}) == 3  # labels equal up to permutation
    np.testing.assert_allclose(fit.projection.std(), 1 / np.sqrt(8), rtol=0.2)  # N(0, 1/d')


def test_no_cluster_falls_back_to_one_expert_or_raises(caplog):
    x = np.random.default_rng(1).normal(size=(30, 6))
    with caplog.at_level(logging.WARNING):
        fit = fit_router(x, rule="dbscan-percentile", proj_dim=4, eps=1e-6, min_samples=5)
    assert fit.fallback and fit.n_clusters == 1 and fit.sizes == (30,)
    assert ("dbscan-percentile found no cluster among 30 embeddings (centred-cosine, eps=1e-06, min_samples=5, "
            "min_cluster_size=15): every point is noise") in caplog.text
    with pytest.raises(NoClusterError, match="pass a larger eps or smaller min_samples / min_cluster_size"):
        fit_router(x, rule="dbscan-percentile", proj_dim=4, eps=1e-6, min_samples=5, on_no_cluster="error")


def test_bad_configs_and_checkpoints(tmp_path):
    with pytest.raises(ValueError, match=r"SparseConfig: layers must be block indices in \[0, 2\) for a 2-layer model \(got \[5\]\)"):
        GPTConfig(n_layer=2, sparse=SparseConfig(layers=[5], n_experts=[0]))
    with pytest.raises(ValueError, match="module must be 'ffn'"):
        GPTConfig(sparse=SparseConfig(kind="switch", module="attn", layers=[0], n_experts=[2]))
    with pytest.raises(ValueError, match="BERT needs mask_token_id"):
        BERTConfig(mask_token_id=None)
    bert = tiny("bert")
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"holds a 'bert' model; load it with BERT.from_pretrained"):
        GPT.from_pretrained(tmp_path / "bert")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    (tmp_path / "hf" / "model.safetensors").write_bytes((tmp_path / "bert" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"holds a 'gpt2' checkpoint, not one of cse_models' architectures"):
        GPT.from_pretrained(tmp_path / "hf")
    config = bert.config.to_dict()
    config["n_embd"] = 32
    (tmp_path / "bert" / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ValueError, match="do not match its config"):
        BERT.from_pretrained(tmp_path / "bert")


def test_sequence_embedding_ignores_padding():
    x = torch.arange(24, dtype=torch.float64).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(sequence_embedding(x, mask)[0], x[0, :2].mean(0))
    torch.testing.assert_close(sequence_embedding(x, mask)[1], x[1].mean(0))


def test_attention_is_bidirectional_for_bert_only():
    gpt, bert = tiny("gpt"), tiny("bert")
    ids = torch.randint(0, 40, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 40
    torch.testing.assert_close(gpt(ids)[:, :-1], gpt(changed)[:, :-1])
    assert not torch.allclose(bert(ids)[:, :-1], bert(changed)[:, :-1])
    assert isinstance(gpt.transformer.h[0].attn, SelfAttention) and gpt.transformer.h[0].attn.is_causal


def test_ntkscope_analyses_a_cse_model_per_expert(lm_batch):
    """The analysis library sees a CSE model as a pure function in eval mode: per-sample
    gradients equal the autograd loop, and the per-expert NTK blocks add up."""
    import ntkscope as ns
    from reference import causal_jacobian

    model = tiny(sparse=SparseConfig(kind="cse", layers=[1], n_experts=[2], proj_dim=4))
    model.config.vocab_size = 40
    layer = model.transformer.h[1].mlp
    ids = lm_batch["input_ids"] % 40
    batch = {"input_ids": ids, "attention_mask": lm_batch["attention_mask"]}
    model.eval()
    layer.projection.normal_()
    z = model.module_inputs(ids, batch["attention_mask"], [1])[1] @ layer.projection.T
    layer.centres.copy_(z[[0, 3]])  # two sequences seed two experts: both get traffic
    J = ns.per_sample_grads(model, batch).flatten()
    torch.testing.assert_close(J, causal_jacobian(model, batch), rtol=1e-9, atol=1e-12)
    ntk = ns.empirical_ntk(model, batch, blocks="expert", method="exact")
    torch.testing.assert_close(sum(ntk.blocks.values()), J @ J.T, rtol=1e-9, atol=1e-12)
    assert {k for k in ntk.blocks if ".experts." in k} == {"transformer.h.1.mlp.experts.0", "transformer.h.1.mlp.experts.1"}
    assert layer.load.sum() == 0  # eval mode: no bookkeeping
    model.train()
    model(ids, batch["attention_mask"])
    assert (layer.load > 0).all()  # both experts were used in the analysis above


class _Echo(torch.nn.Module):
    def forward(self, x, key_mask=None):
        return x


def _drifting_router(mean_rate, drift, seed=0, steps=300, d=16):
    """A router fitted (the CSE rule, centred cosine) on one big cluster and two small stable
    ones, then trained on batches whose embeddings all drift by a common, growing shift: per
    small cluster, the share of the members that reached its expert at the fit and still do."""
    from ntkscope import fit_router

    rng = np.random.default_rng(seed)
    X = np.vstack([rng.normal(size=(400, d)) * 0.5 + np.eye(d)[0] * 3.0,
                   rng.normal(size=(30, d)) * 0.1 + np.eye(d)[1] * 2.5,
                   rng.normal(size=(30, d)) * 0.1 + np.eye(d)[2] * 2.5])
    labels = np.repeat([0, 1, 2], [400, 30, 30])
    fit = fit_router(X, min_cluster_size=10, min_samples=3)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    layer = CSELayer([_Echo() for _ in range(fit.n_clusters)], t(fit.projection), t(fit.centres), t(fit.radii),
                     0.99, mean=t(fit.mean), normalise=fit.normalise, mean_rate=mean_rate).train()
    _, at_fit = layer._route(t(X), torch.float64)
    own = {k: int(np.bincount(at_fit.numpy()[labels == k]).argmax()) for k in (1, 2)}
    direction = rng.normal(size=d)
    shift = np.zeros(d)
    for _ in range(steps):
        shift += drift * direction / np.linalg.norm(direction)
        layer(t(X[rng.choice(len(X), 32)] + shift)[:, None, :])  # one-token sequences: v is the row itself
        layer.update_centres()
    _, now = layer._route(t(X + shift), torch.float64)
    reached = {k: (labels == k) & (at_fit.numpy() == own[k]) for k in (1, 2)}
    return {k: float((now.numpy()[reached[k]] == own[k]).mean()) for k in (1, 2)}


def test_a_common_drift_starves_small_experts_unless_the_centring_mean_follows_it():
    assert _drifting_router(0.0, 0.0) == {1: 1.0, 2: 1.0}  # no drift: Algorithm 1 keeps them
    assert max(_drifting_router(0.0, 0.02).values()) < 0.1  # Algorithm 1 as written loses both small clusters
    kept = _drifting_router(0.1, 0.02)
    assert min(kept.values()) >= 0.9, kept  # the running centring mean keeps them (measured: 1.0, 1.0)


def test_mean_rate_is_checked_and_saved(tmp_path):
    with pytest.raises(ValueError, match=r"SparseConfig: mean_rate must be in \[0, 1\) \(got 1.5\)"):
        SparseConfig(layers=[0], n_experts=[0], mean_rate=1.5).check(2)
    with pytest.raises(ValueError, match=r"CSELayer: mean_rate needs a router-format-2 layer"):
        CSELayer([_Echo()], torch.eye(2), torch.zeros(1, 2), torch.ones(1), mean_rate=0.1)
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=8,
                       sparse=SparseConfig(layers=[1], n_experts=[2], router_format=2, normalise=True, mean_rate=0.1))
    model = GPT(config)
    layer = model.sparse_layers()["transformer.h.1.mlp"]
    assert layer.mean_rate == 0.1
    model.save_pretrained(tmp_path)
    again = GPT.from_pretrained(tmp_path)
    assert again.config.sparse.mean_rate == 0.1 and again.sparse_layers()["transformer.h.1.mlp"].mean_rate == 0.1


def test_a_router_fit_over_checkpoints_names_the_step_and_layer_it_fell_back_at(caplog, monkeypatch):
    import ntkscope.runs.dynamics as dynamics

    x = torch.randn(30, 6, dtype=torch.float64)  # no cluster at this eps: the fit falls back to one expert
    monkeypatch.setattr(dynamics, "layer_embeddings",
                        lambda model, batch, point, layers: type("E", (), {"embeddings": {1: x}})())
    analysis = dynamics.router_analysis({"input_ids": torch.zeros(30, 4, dtype=torch.long)}, [1],
                                        router={"rule": "dbscan-percentile", "proj_dim": 4, "eps": 1e-6,
                                                "min_samples": 5})
    with caplog.at_level(logging.WARNING):
        analysis.compute(None, 300)
    assert "the checkpoint of step 300, layer 1: fit_router: dbscan-percentile found no cluster" in caplog.text
