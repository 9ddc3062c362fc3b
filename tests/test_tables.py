"""The paper's tables: CSE/MoA and DEMix branched from a dense run, tuned rows that start from
their base model exactly, DEMix's mixture against a hand computation, and the statistics that
call a difference a difference."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from cse_models import SparseConfig, load_model
from cse_models.checkpointing import branch_from
from cse_models.config import GPTConfig
from cse_models.demix import DomainPrior, estimate_prior, mixture_log_probs, sequence_posterior
from cse_models.experts import CSELayer, DEMixLayer
from cse_models.model import active_parameter_count, build_model, parameter_count
from cse_models.train import TrainConfig, global_batch, lm_loss, load_data, train
from ntkscope.reproduction import paper, training
from ntkscope.reproduction.settings import settings_for

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2}


def config(tmp_path, name, **overrides):
    base = {"out_dir": str(tmp_path / name), "model": dict(TINY), "data": {"seq_len": 32, "split": "validation"},
            "steps": 10, "batch_size": 8, "checkpoint_every": 2, "log_every": 2, "warmup_steps": 3, "lr": 3e-3}
    base.update(overrides)
    return TrainConfig.from_dict(base)


@pytest.mark.parametrize("model_type", ["gpt", "bert"])
def test_cse_on_attention_routes_and_trains(tmp_path, model_type):
    """CSE/MoA in a GPT and a BERT: branched from the dense run at step 6, the attention of layer 1
    becomes experts copied from it (2 or more here), sequences reach more than one of them, and
    training goes on with a finite loss; the experts drift apart from the shared start."""
    arch = {**TINY, "model_type": model_type, **({"mask_token_id": 2} if model_type == "bert" else {})}
    train(config(tmp_path, "dense", model=arch))
    sparse = {"kind": "cse", "module": "attn", "layers": [1], "n_experts": [0], "proj_dim": 8, "router_format": 2}
    branch_from(tmp_path / "dense" / "checkpoints" / "step-000006", tmp_path / "moa", sparse=sparse)
    cse = {"convert_at": 6, "n_samples": 256, "rule": "dbscan-percentile", "min_samples": 3, "percentile": 30}
    last = train(config(tmp_path, "moa", model={**arch, "sparse": sparse}, cse=cse))
    model = load_model(last)
    layer = model.transformer.h[1].attn
    assert isinstance(layer, CSELayer) and model.config.sparse.module == "attn"
    assert len(layer.experts) == model.config.sparse.n_experts[0] >= 2
    loads = [json.loads(line).get("load") for line in (tmp_path / "moa" / "metrics.jsonl").read_text().splitlines()]
    used = [sum(c > 0 for c in load["transformer.h.1.attn"]) for load in loads if load]
    assert max(used) >= 2
    assert all(math.isfinite(json.loads(line)["loss"]) for line in (tmp_path / "moa" / "metrics.jsonl").open())
    first, second = (dict(e.named_parameters()) for e in layer.experts[:2])
    assert any(not torch.equal(first[k], second[k]) for k in first)


def test_demix_upcycled_from_a_dense_run(tmp_path):
    """DEMix from a dense run's warm-up: one expert per domain, each a copy of the warmed-up FFN,
    each trained only on its own domain's sequences; domains out of the data's order are refused."""
    train(config(tmp_path, "dense"))
    domains = ["biomedical", "general", "legal"]
    sparse = {"kind": "demix", "layers": [1], "n_experts": [0], "domains": domains}
    start = branch_from(tmp_path / "dense" / "checkpoints" / "step-000006", tmp_path / "demix", sparse=sparse)
    assert load_model(start).config.sparse.n_experts == [0]
    last = train(config(tmp_path, "demix", model={**TINY, "sparse": sparse}, upcycle={"convert_at": 6}))
    model = load_model(last)
    assert isinstance(model.transformer.h[1].mlp, DEMixLayer) and model.config.sparse.n_experts == [3]
    loads = [json.loads(line)["load"] for line in (tmp_path / "demix" / "metrics.jsonl").read_text().splitlines()
             if "load" in json.loads(line)]
    blocks, _ = load_data(config(tmp_path, "x"))
    seen = np.zeros(3, int)
    for step in range(6, 10):  # the load is the count of each domain's sequences in the batches
        seen += np.bincount(blocks.domains[global_batch(blocks, step, 8, 0)].numpy(), minlength=3)
    assert np.sum([load["transformer.h.1.mlp"] for load in loads], axis=0).tolist() == seen.tolist()
    with pytest.raises(ValueError, match=r"DEMix model's domains must be the data's domains in order"):
        bad = {**sparse, "domains": ["legal", "general", "biomedical"]}
        train(config(tmp_path, "bad", model={**TINY, "sparse": bad}, upcycle={"convert_at": 6}))
    with pytest.raises(ValueError, match=r"dense until upcycled"):
        train(config(tmp_path, "bad2", model={**TINY, "sparse": sparse}))


@pytest.mark.parametrize("kind", ["dense", "switch"])
def test_a_tuned_row_starts_from_its_base_weights_exactly(tmp_path, kind):
    """The first step of a tuned row computes its loss with the base model's weights: the logged
    loss equals the base model's loss on that step's batch of the domain's blocks."""
    sparse = {"kind": "switch", "layers": [1], "n_experts": [2]} if kind == "switch" else None
    base_last = train(config(tmp_path, "base", model={**TINY, "sparse": sparse}, data={"seq_len": 32}, steps=4,
                             checkpoint_every=4))
    settings = settings_for("smoke", finetune_steps=2)
    tuned = training.train_finetuned(settings, tmp_path / "tuned", None, base_last, "legal", seed=3)
    state = json.loads((tuned / "trainer_state.json").read_text())["train_config"]
    assert state["init_from"] == str(base_last) and state["data"]["domains"] == ["legal"]
    cfg = TrainConfig.from_dict(state)
    blocks, _ = load_data(cfg)
    assert set(blocks.domain_names) == {"legal"}
    model = load_model(base_last).train()
    idx = global_batch(blocks, 0, cfg.batch_size, cfg.seed)
    with torch.no_grad():
        loss_sum, count = lm_loss(model, blocks.input_ids[idx], blocks.domains[idx], 0, cfg)
    first = json.loads((tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(float(loss_sum / count), rel=1e-6)


def _demix(model_type="gpt"):
    torch.manual_seed(0)
    extra = {"model_type": "bert", "mask_token_id": 3} if model_type == "bert" else {}
    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, **extra,
                    sparse=SparseConfig(kind="demix", layers=[0, 1], domains=["a", "b", "c"]))
    return build_model(cfg).double().eval()


def test_demix_mixture_weights_match_a_hand_computation():
    """P(D=j | x_<t) = P(D=j) prod_{s<t} p(x_s | x_<s, D=j) / normaliser, by explicit loops: the
    weights sum to 1 at every position, equal mixture_log_probs', and the product of the
    per-position mixtures is the sequence-level mixture (the chain rule), whose posterior is the
    final one. The cached prior is a distribution."""
    model = _demix()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    prior = DomainPrior(3, "cached", probs=torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    mixed, post = mixture_log_probs(model, ids, prior=DomainPrior(3, "cached", probs=prior.probs))
    for b in range(2):
        p = np.zeros((3, 6))
        for j in range(3):
            logits = model(ids[b:b + 1], domains=torch.tensor([j]))[0]
            for t in range(6):
                p[j, t] = F.softmax(logits[t], -1)[ids[b, t + 1]].item()
        for t in range(6):
            w = prior.probs.numpy() * np.prod(p[:, :t], axis=1)
            w = w / w.sum()
            np.testing.assert_allclose(post[b, t].numpy(), w, rtol=1e-10)
            assert post[b, t].sum().item() == pytest.approx(1.0, abs=1e-12)
            assert mixed[b, t].item() == pytest.approx(math.log((w * p[:, t]).sum()), rel=1e-10)
        loglik, final = sequence_posterior(model, ids[b:b + 1], prior=prior)
        joint = prior.probs.numpy() * np.prod(p, axis=1)
        assert loglik.item() == pytest.approx(mixed[b].sum().item(), rel=1e-10)
        assert loglik.item() == pytest.approx(math.log(joint.sum()), rel=1e-10)
        np.testing.assert_allclose(final[0].numpy(), joint / joint.sum(), rtol=1e-10)
    cached = estimate_prior(model, ids)
    assert cached.mode == "cached" and cached.probs.sum().item() == pytest.approx(1.0)


def test_bert_demix_posterior_is_the_masked_tokens_marginal_likelihood():
    """For a masked LM the posterior over domains weighs each expert by the probability it gives
    the masked tokens (explicit loop), from the prior; the mixture is log sum_j P(j) prod p_j."""
    model = _demix("bert")
    ids = torch.randint(4, 40, (2, 8), generator=torch.Generator().manual_seed(2))
    labels = torch.full_like(ids, -100)
    labels[:, [1, 4, 6]] = ids[:, [1, 4, 6]]
    inputs = ids.masked_fill(labels != -100, 3)
    prior = DomainPrior(3, "cached", probs=torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64))
    loglik, post = sequence_posterior(model, inputs, prior=prior, labels=labels)
    for b in range(2):
        joint = []
        for j in range(3):
            logp = F.log_softmax(model(inputs[b:b + 1], domains=torch.tensor([j]))[0], -1)
            joint.append(prior.probs[j].item() * math.exp(sum(logp[t, ids[b, t]].item() for t in (1, 4, 6))))
        joint = np.array(joint)
        assert loglik[b].item() == pytest.approx(math.log(joint.sum()), rel=1e-10)
        np.testing.assert_allclose(post[b].numpy(), joint / joint.sum(), rtol=1e-10)


def test_active_parameters_count_one_expert_per_token():
    dense = GPTConfig(**TINY)
    cse = GPTConfig(**TINY, sparse=SparseConfig(kind="cse", layers=[0, 1], n_experts=[3, 2], proj_dim=8))
    moa = GPTConfig(**TINY, sparse=SparseConfig(kind="cse", module="attn", layers=[1], n_experts=[4], proj_dim=8))
    switch = GPTConfig(**TINY, sparse=SparseConfig(kind="switch", layers=[1], n_experts=[4]))
    assert parameter_count(cse) > parameter_count(dense) == active_parameter_count(cse) == active_parameter_count(moa)
    assert active_parameter_count(switch) == parameter_count(dense) + 32 * 4  # the router


def _runs(cse_ppl, other_ppl):
    rows = []
    for seed, (a, b) in enumerate(zip(cse_ppl, other_ppl)):
        for key, value in (("cse-mof", a), ("dense", b)):
            rows.append({"arch": "gpt", "key": key, "seed": seed, "perplexity": value, "average": 0.5,
                         "ppl general": value, "acc general-wordnet-lexname": 0.3})
    return pd.DataFrame(rows)


def test_a_difference_is_called_only_outside_the_spread():
    """Welch's t-test and mean +- std apart: clearly lower perplexity is "better"; overlapping
    seeds are "not shown" whatever the means; identical probes are "not shown"."""
    clear = pd.DataFrame(paper._tests(_runs([100, 101, 103], [110, 111, 113]), "gpt", ["dense", "cse-mof"]))
    row = clear[(clear["row"] == "CSE/MoF") & (clear["metric"] == "perplexity")].iloc[0]
    assert row["verdict"] == "better" and row["apart"] and row["welch_p"] < 0.01
    assert row["difference"] == pytest.approx(-10.0)
    noisy = pd.DataFrame(paper._tests(_runs([100, 110, 120], [104, 114, 124]), "gpt", ["dense", "cse-mof"]))
    assert set(noisy["verdict"]) == {"not shown"}
    forgetting = pd.DataFrame(paper._forgetting(_runs([100, 101, 103], [110, 111, 112]), "gpt",
                                                ["dense", "cse-mof"], "general-wordnet-lexname"))
    cse = forgetting.set_index("model").loc["CSE/MoF"]
    assert cse["ppl_general change mean"] == pytest.approx(-9.6667, abs=1e-3) and cse["ppl_general change"] == "better"
    assert paper.row_keys(settings_for("tables")) == [
        "dense", "dense-legal", "dense-biomedical", "switch", "switch-legal", "switch-biomedical", "cse-mof",
        "cse-moa", "demix"]
    assert [paper.row_label("bert", k) for k in ("dense", "dense-legal", "switch-biomedical", "cse-moa")] == [
        "BERT dense", "BERT/legal", "Switch/biomedical", "CSE/MoA"]
