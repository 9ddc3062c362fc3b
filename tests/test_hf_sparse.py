"""CSE, Switch and DEMix layers in Hugging Face models (GPT-2, GPT-NeoX, the Llama layout; the
BERT and RoBERTa encoders with their masked-LM heads),
built tiny from their configs (no hub): a one-expert conversion is the dense model; a planted
two-domain batch reaches two experts; save, load and resume round-trip exactly; loading runs
no checkpoint code."""

import copy
import json

import pytest
import torch

from cse_models import SparseHF, load_any_model, load_hf
from cse_models.hf import LAYOUTS
from cse_models.cse import convert_to_cse, upcycle
from cse_models.experts import CSELayer, SwitchFFN

transformers = pytest.importorskip("transformers")

SIZES = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
             max_position_embeddings=32)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=3, n_head=2),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=50, rotary_pct=0.25, bos_token_id=0, eos_token_id=0,
                                                   **SIZES),
    "llama": lambda: transformers.LlamaConfig(vocab_size=50, num_key_value_heads=1, tie_word_embeddings=False,
                                              **SIZES),
    "bert": lambda: transformers.BertConfig(vocab_size=50, **SIZES),
    "roberta": lambda: transformers.RobertaConfig(vocab_size=50, pad_token_id=1, **SIZES),
}
MASKED = ("bert", "roberta")  # encoders: *ForMaskedLM, their FFN split in intermediate / output.dense


def dense(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    auto = transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM
    return auto.from_config(CONFIGS[kind]()).eval()


def batch(seed: int = 1, n: int = 6, T: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[4, 5:] = 0
    return ids, mask


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("sparse_kind", ["cse", "switch", "demix"])
@torch.no_grad()
def test_one_expert_conversion_is_the_dense_model(kind, sparse_kind):
    ids, mask = batch()
    reference = dense(kind)(input_ids=ids, attention_mask=mask).logits
    spec = dict(kind=sparse_kind, layers=[1, 2], n_experts=[0, 0],
                **({"domains": ["only"]} if sparse_kind == "demix" else {}))
    model = SparseHF(dense(kind), spec).eval()
    torch.testing.assert_close(model(ids, mask), reference, rtol=0, atol=0)  # dense until converted
    if sparse_kind == "cse":  # one cluster: every sequence to the one expert
        fits = convert_to_cse(model, ids, mask, rule="hdbscan", min_cluster_size=100, on_no_cluster="single")
        assert [f.n_clusters for f in fits.values()] == [1, 1]
    else:
        upcycle(model, 1)
    assert len(model.sparse_layers()) == 2
    domains = torch.zeros(len(ids), dtype=torch.long)
    # CSE and DEMix run the expert on the batch as it is: bit for bit. Switch runs it on the real tokens
    # gathered (another matmul shape: float rounding) and leaves padding out of the layer
    real = mask.bool()
    exact = dict(rtol=0, atol=0) if sparse_kind != "switch" else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model(ids, mask, domains)[real], reference[real], **exact)


def planted_domains(n_per: int = 40, T: int = 16, seed: int = 0):
    """Two domains with disjoint vocabularies: tokens 0-24 and 25-49."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 25, (n_per, T), generator=g)
    b = torch.randint(25, 50, (n_per, T), generator=g)
    return torch.cat([a, b]), torch.cat([torch.zeros(n_per), torch.ones(n_per)]).long()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@torch.no_grad()
def test_cse_routes_a_planted_two_domain_batch_to_two_experts(kind):
    ids, domain = planted_domains()
    hf = dense(kind)
    emb = hf.get_input_embeddings().weight  # the plant: the two vocabularies sit apart along one direction
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0)).to(emb.dtype)
    emb[:25] += u
    emb[25:] -= u
    model = SparseHF(hf, dict(kind="cse", layers=[1], n_experts=[0])).eval()
    fits = convert_to_cse(model, ids, None, min_cluster_size=10, max_experts=4)
    assert fits[1].n_clusters == 2
    (name, layer), = model.sparse_layers().items()
    assert isinstance(layer, CSELayer) and name.endswith(".1.intermediate.layer" if kind in MASKED else ".1.mlp.layer")
    routed = []
    hook = layer.register_forward_hook(lambda m, args, out: routed.append(m.route(args[0], args[1])[1]))
    test_ids, test_domain = planted_domains(seed=1)
    model(test_ids)
    hook.remove()
    assign = routed[0]
    # held-out sequences of each domain go to one expert, and the two experts differ (up to permutation)
    majority = [int(assign[test_domain == d].mode().values) for d in (0, 1)]
    assert majority[0] != majority[1]
    for d in (0, 1):
        assert (assign[test_domain == d] == majority[d]).all()


def convert(model: SparseHF) -> SparseHF:
    """``model`` converted in place as its sparse config says: CSE on a planted two-domain batch,
    or Switch upcycled to 3 experts (torch's RNG seeded for the router)."""
    torch.manual_seed(3)
    if model.config.sparse.kind == "cse":
        convert_to_cse(model, planted_domains(T=12)[0], None, min_cluster_size=10)
    else:
        upcycle(model, 3)
    return model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@torch.no_grad()
def test_converted_models_round_trip_through_safetensors(kind, tmp_path):
    ids, mask = batch()
    dense(kind).save_pretrained(tmp_path / "dense")
    for sparse_kind in ("cse", "switch"):
        model = convert(load_any_model(tmp_path / "dense", dict(kind=sparse_kind, layers=[0, 2], n_experts=[0, 0])))
        assert isinstance(model, SparseHF)
        if sparse_kind == "switch":
            for layer in model.sparse_layers().values():  # experts that differ, so the round trip is tested
                for j, expert in enumerate(layer.experts):
                    for p in expert.parameters():
                        p.add_(0.01 * j)
        out = model(ids, mask)
        model.save_pretrained(tmp_path / sparse_kind)
        data = json.loads((tmp_path / sparse_kind / "config.json").read_text())
        assert data["cse_sparse"]["sparse"]["kind"] == sparse_kind and data["architectures"]
        back = load_any_model(tmp_path / sparse_kind)
        assert isinstance(back, SparseHF) and not back.training
        torch.testing.assert_close(back(ids, mask), out, rtol=0, atol=0)
        assert {k: v.shape for k, v in back.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
        if sparse_kind == "switch":
            assert all(isinstance(m, SwitchFFN) for m in back.sparse_layers().values())


def test_loading_runs_no_checkpoint_code_and_refuses_wrong_weights(tmp_path):
    model = dense("gpt2")
    model.save_pretrained(tmp_path / "m")
    marker = tmp_path / "ran"
    (tmp_path / "m" / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    data = json.loads((tmp_path / "m" / "config.json").read_text())
    data["auto_map"] = {"AutoModelForCausalLM": "evil.Evil", "AutoConfig": "evil.Evil"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(data))
    load_hf(tmp_path / "m", dict(kind="cse", layers=[0], n_experts=[0]))
    assert not marker.exists()
    data["n_layer"] = 2  # weights of 3 layers
    (tmp_path / "m" / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="do not match its config.json"):
        load_hf(tmp_path / "m")


def test_sparse_spec_is_checked():
    with pytest.raises(ValueError, match="module must be 'ffn'"):  # Switch routes tokens through FFN experts
        SparseHF(dense("gpt2"), dict(kind="switch", module="attn", layers=[0], n_experts=[0]))
    with pytest.raises(ValueError, match=r"layers must be block indices in \[0, 3\)"):
        SparseHF(dense("gpt2"), dict(kind="cse", layers=[3], n_experts=[0]))
    distil = transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(vocab_size=50, dim=16, n_layers=1,
                                                                              n_heads=2, hidden_dim=32))
    with pytest.raises(ValueError, match="no layout for HF model_type 'distilbert'"):
        SparseHF(distil)
    with pytest.raises(ValueError, match="a masked LM's loss is over its masked tokens"):
        SparseHF(dense("bert"))(*batch(), targets=batch()[0])


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@torch.no_grad()
def test_moa_routes_whole_sequences_through_attention_experts(kind, tmp_path):
    """MoA (sparse.module "attn") in every family: the attention of a block becomes CSE experts.
    With two identical experts, a padded batch split between them gives the dense model's logits
    (each expert sees its own sequences' masks and positions); a one-expert DEMix is the dense
    model bit for bit; experts that differ round-trip through save and load, and through
    transformers' Auto class."""
    ids, domain = planted_domains(n_per=4, T=12, seed=1)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[5, 4:] = 0
    hf = dense(kind)
    emb = hf.get_input_embeddings().weight  # the plant, as in the FFN test
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    emb[:25] += u
    emb[25:] -= u
    reference = copy.deepcopy(hf)(input_ids=ids, attention_mask=mask).logits
    model = SparseHF(hf, dict(kind="cse", module="attn", layers=[1], n_experts=[0])).eval()
    fits = convert_to_cse(model, planted_domains()[0], None, min_cluster_size=10, max_experts=4)
    (name, layer), = model.sparse_layers().items()
    assert fits[1].n_clusters == 2 and name.endswith(".1." + LAYOUTS[kind].attn + ".layer")
    routed = []
    hook = layer.register_forward_hook(lambda m, args, out: routed.append(m.route(args[0], args[1])[1]))
    real = mask.bool()
    torch.testing.assert_close(model(ids, mask)[real], reference[real], rtol=1e-5, atol=1e-5)
    hook.remove()
    assert sorted(set(routed[0].tolist())) == [0, 1]  # both experts got sequences of this batch
    # called as Trainer and generate call it (the config's cache setting: off since the conversion)
    torch.testing.assert_close(model.hf(input_ids=ids, attention_mask=mask).logits, model(ids, mask), rtol=0, atol=0)
    if kind not in MASKED:  # experts that see part of the batch cannot share one key-value cache
        with pytest.raises(ValueError, match="run without a key-value cache"):
            model.hf(input_ids=ids, attention_mask=mask, use_cache=True)
    for j, expert in enumerate(layer.experts):  # experts that differ
        for p in expert.parameters():
            p.add_(0.01 * j)
    out = model(ids, mask)
    assert not torch.equal(out[real], reference[real])
    model.save_pretrained(tmp_path / "moa")
    torch.testing.assert_close(load_hf(tmp_path / "moa")(ids, mask), out, rtol=0, atol=0)
    auto = (transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM)
    torch.testing.assert_close(auto.from_pretrained(tmp_path / "moa")(input_ids=ids, attention_mask=mask).logits, out,
                               rtol=0, atol=0)
    one = SparseHF(dense(kind), dict(kind="demix", module="attn", layers=[0, 2], n_experts=[0, 0], domains=["x"]))
    upcycle(one.eval(), 1)
    torch.testing.assert_close(one(ids, mask, torch.zeros(len(ids), dtype=torch.long))[real],
                               dense(kind)(input_ids=ids, attention_mask=mask).logits[real], rtol=0, atol=0)
