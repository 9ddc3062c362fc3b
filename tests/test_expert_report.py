"""What the experts learned (cse_models.expert_report): on planted routing, an expert that serves
one domain gives purity 1 and NMI 1, and ablating it changes that domain's perplexity most (a
causal LM's next tokens, a masked LM's masked tokens); the findings say so in words; layers are
named by block."""

import numpy as np
import pytest
import torch

from cse_models import SparseHF
from cse_models.cse import convert_to_cse, upcycle
from cse_models.expert_report import expert_report, layer_label

transformers = pytest.importorskip("transformers")
from test_hf_sparse import dense, planted_domains  # noqa: E402


def _planted_model(kind: str = "gpt_neox"):
    hf = dense(kind)
    if kind == "bert":
        hf.config.mask_token_id = 49  # a masked LM is scored on its masked tokens
    emb = hf.get_input_embeddings().weight
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0)).to(emb.dtype)
    with torch.no_grad():
        emb[:25] += u
        emb[25:] -= u
    model = SparseHF(hf, dict(kind="cse", layers=[1], n_experts=[0])).eval()
    ids, _ = planted_domains()
    convert_to_cse(model, ids, None, min_cluster_size=10, max_experts=4)
    return model


@pytest.mark.parametrize("kind, ffn", [("gpt_neox", "mlp"), ("bert", "intermediate")])
@torch.no_grad()
def test_an_expert_that_serves_one_domain(kind, ffn):
    model = _planted_model(kind)
    layer = next(iter(model.sparse_layers().values()))
    assert len(layer.experts) == 2
    ids, domain = planted_domains(seed=1)
    labels = ["a" if d == 0 else "b" for d in domain.tolist()]
    # which expert takes domain b; zero the other expert's output, so that b loses most without its own
    assign = layer.route(model.module_inputs(ids, None, [1])[1][:, None, :])[1]
    b_expert = int(assign[domain == 1].mode().values)
    for p in layer.experts[1 - b_expert].parameters():
        p.zero_()
    report = expert_report(model, ids.tolist(), labels, n_boot=100)
    row = report.layers.iloc[0]
    assert row["layer"] == f"layer 1 ({ffn})" and row["unit"] == "sequences" and row["experts"] == 2
    assert row["purity"] == 1.0 and row["nmi"] == pytest.approx(1.0)
    assert row["purity_low"] <= row["purity"] <= row["purity_high"] and row["load_entropy"] == pytest.approx(1.0)
    assert row["purity_majority"] == pytest.approx(0.5)  # two domains of one size: half, one expert taking all
    assert row["purity_majority"] <= row["purity_null"] < 0.8 and row["nmi_null"] < 0.1  # labels shuffled
    experts = report.experts.set_index("expert")
    assert experts.loc[b_expert, "top_domain"] == "b" and experts.loc[b_expert, "top_share"] == 1.0
    ablation = report.ablation[report.ablation["expert"] == b_expert].set_index("domain")
    assert ablation.loc["a", "change"] == 0.0  # a's texts never reach the ablated expert
    if kind == "bert":  # a random encoder's masked-token loss barely reads its FFN: changed, sign not planted
        assert abs(ablation.loc["b", "change"]) > 1e-5
    else:
        assert ablation.loc["b", "change"] > 0 and ablation.loc["b", "change_low"] > 0  # the whole interval
    assert any(f.startswith(f"layer 1 ({ffn}): expert") and "serves b" in f for f in report.findings)
    assert any("without expert" in f and ("b perplexity" in f or kind == "bert") for f in report.findings)


@torch.no_grad()
def test_switch_layers_count_tokens_and_a_dense_model_is_refused():
    model = SparseHF(dense("llama"), dict(kind="switch", layers=[0], n_experts=[0])).eval()
    upcycle(model, 2)
    ids, domain = planted_domains(n_per=8)
    report = expert_report(model, ids.tolist(), [str(d) for d in domain.tolist()], n_boot=20, ablate=False)
    assert report.layers.iloc[0]["unit"] == "tokens" and report.ablation.empty
    assert np.isclose(report.experts["load"].sum(), 1.0)
    with pytest.raises(ValueError, match="expert_report: the model has no CSE or Switch layer"):
        expert_report(dense("gpt2"), ids.tolist(), ["x"] * len(ids))


def test_layer_labels_come_from_module_names():
    assert layer_label("hf.gpt_neox.layers.2.mlp.layer") == "layer 2 (mlp)"
    assert layer_label("transformer.h.3.mlp") == "layer 3 (mlp)"


@torch.no_grad()
def test_a_transformers_mixture_of_experts_router_is_read_and_ablated():
    """Mixtral's router (a ``*TopKRouter``): on planted routing (domain a's tokens first-choose
    expert 0, b's expert 1, and b never takes 0 among its top 2) the report reads purity 1 per
    token, names the layer by block, and ablating expert 0 changes a's perplexity only."""
    config = transformers.MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).float().eval()  # its grouped GEMM takes no float64
    u = torch.nn.functional.normalize(torch.randn(16, generator=torch.Generator().manual_seed(0)), dim=0).float()
    emb = model.get_input_embeddings().weight
    emb[:25] += 20 * u  # the plant: the two vocabularies sit far apart along u
    emb[25:] -= 20 * u
    gate = model.model.layers[0].mlp.gate
    gate.weight.zero_()
    gate.weight[0], gate.weight[1] = 50 * u, -50 * u
    ids, domain = planted_domains(n_per=12)
    labels = ["a" if d == 0 else "b" for d in domain.tolist()]
    report = expert_report(model, ids.tolist(), labels, n_boot=50)
    row = report.layers.iloc[0]
    assert row["layer"] == "layer 0 (mlp)" and row["unit"] == "tokens" and row["experts"] == 4
    assert row["purity"] == 1.0 and row["nmi"] == pytest.approx(1.0)
    experts = report.experts.set_index("expert")
    assert experts.loc[0, "top_domain"] == "a" and experts.loc[1, "top_domain"] == "b"
    assert experts.loc[[2, 3], "load"].sum() == 0.0
    ablation = report.ablation[report.ablation["expert"] == 0].set_index("domain")
    assert abs(ablation.loc["a", "change"]) > 0 and ablation.loc["b", "change"] == 0.0
    assert any("expert 0 serves a" in f for f in report.findings)


def test_ntkscope_eval_reads_the_experts_of_a_transformers_moe_directory(tmp_path, capsys):
    """``ntkscope eval`` on a saved Mixtral (safetensors + config.json) writes the expert report."""
    import json

    import pandas as pd

    from ntkscope.app.cli import main as ntkscope
    from ntkscope.text.corpus.pack import DEFAULT_PACK

    config = transformers.MixtralConfig(vocab_size=8192, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=3,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).float().save_pretrained(tmp_path / "moe")
    rows = [{"text": f"The court held that clause {i} of the contract was void.", "domain": "legal"} for i in range(6)]
    rows += [{"text": f"Patients given dose {i} showed lower blood pressure.", "domain": "biomedical"} for i in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = ntkscope(["-q", "eval", str(tmp_path / "moe"), "--data", str(tmp_path / "rows.jsonl"), "--label-column",
                     "domain", "--tokenizer", str(DEFAULT_PACK / "tokenizer.json"), "--n-boot", "10",
                     "--expert-kernels", "8", "--out", str(tmp_path / "eval")])
    assert code == 0, capsys.readouterr().err
    layers = pd.read_csv(tmp_path / "eval" / "expert_layers.csv")
    assert layers["layer"].tolist() == ["layer 0 (mlp)", "layer 1 (mlp)"] and (layers["experts"] == 3).all()
    ablation = pd.read_csv(tmp_path / "eval" / "ablation.csv")
    assert len(ablation) == 2 * 3 * 2  # layers x experts x domains
    # the per-expert view on 8 of the 12 texts: token units, each expert's split-half |GC| in [0, 1]
    kernels = pd.read_csv(tmp_path / "eval" / "expert_kernels.csv")
    assert set(kernels["layer"]) <= {"model.layers.0.mlp", "model.layers.1.mlp"} and (kernels["unit"] == "token").all()
    assert ((kernels["consistency_low"] <= kernels["consistency"]) & (kernels["consistency"] <= 1)).all()
    assert (kernels["params"] == 2 * 32 * 16 + 16 * 32).all() and (kernels["units"] >= 4).all()
    gc = pd.read_csv(tmp_path / "eval" / "expert_gc.csv")
    assert set(gc["group"]) <= {"legal", "biomedical"} and gc["gc"].between(-1, 1).all()
    assert "inside the experts" in capsys.readouterr().out
    assert ntkscope(["-q", "report", str(tmp_path / "eval"), "--out", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "Inside the experts (" in page and "split-half |GC| of each expert" in page


@torch.no_grad()
def test_a_masked_lm_is_scored_on_its_seeded_masked_tokens():
    """evaluate_domains on a BERT equals a direct computation with transformers on the same seeded
    masking of each text alone; a text is masked the same way in any batch."""
    import zlib

    import torch.nn.functional as F

    from cse_models.data import mask_tokens
    from cse_models.domains import evaluate_domains

    hf = dense("bert")
    hf.config.mask_token_id = 49
    ids, domain = planted_domains(n_per=6, T=12)
    texts = [row[: 6 + i % 6].tolist() for i, row in enumerate(ids)]  # lengths 6..11: padded batches
    labels = ["a" if d == 0 else "b" for d in domain.tolist()]
    table = evaluate_domains(hf, texts, labels, batch_size=5, n_boot=10).perplexity.set_index("domain")
    again = evaluate_domains(hf, texts, labels, batch_size=3, n_boot=10).perplexity.set_index("domain")
    for name in ("a", "b"):
        nll = tokens = 0.0
        for text, label in zip(texts, labels):
            if label != name:
                continue
            t = torch.tensor(text)
            inputs, target = mask_tokens(t, mask_token_id=49, vocab_size=50, generator=torch.Generator().manual_seed(
                zlib.crc32(t.numpy().astype("<i8").tobytes())))
            logp = F.log_softmax(hf(input_ids=inputs[None]).logits[0].double(), -1)
            keep = target != -100
            nll -= float(logp[keep].gather(-1, target[keep][:, None]).sum())
            tokens += int(keep.sum())
        assert table.loc[name, "tokens"] == tokens > 0
        assert table.loc[name, "ppl"] == pytest.approx(np.exp(nll / tokens), rel=1e-6)
        assert again.loc[name, "ppl"] == pytest.approx(table.loc[name, "ppl"], rel=1e-6)
