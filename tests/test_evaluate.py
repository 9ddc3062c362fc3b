"""Evaluation: per-domain perplexity against a plain loop, probes, the results table."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cse_models import GPT, BERT, BERTConfig, GPTConfig, SparseConfig
from cse_models.data import pack_blocks
from cse_models.evaluate import perplexity_by_domain, probe_accuracy, results_table
from ntkscope.text.corpus.pack import load_pack


@pytest.fixture(scope="module")
def pack():
    return load_pack()


def tiny(cls=GPT, **kw):
    torch.manual_seed(0)
    config_cls = GPTConfig if cls is GPT else BERTConfig
    return cls(config_cls(vocab_size=8192, block_size=16, n_layer=1, n_head=2, n_embd=16, **kw)).eval()


def test_perplexity_per_domain_equals_a_plain_loop(pack):
    torch.set_default_dtype(torch.float32)
    tok = pack.tokenizer()
    blocks = pack_blocks(pack, tok, "test", 16)
    blocks = type(blocks)(blocks.input_ids[::20], blocks.domains[::20], blocks.domain_names)
    model = tiny()
    table = perplexity_by_domain(model, blocks, batch_size=7).set_index("domain")
    for j, name in enumerate(blocks.domain_names):
        losses = []
        for ids, d in zip(blocks.input_ids, blocks.domains):
            if d == j:
                logits = model(ids[None])[0]
                losses.extend(F.cross_entropy(logits[:-1], ids[1:], reduction="none").tolist())
        assert table.loc[name, "tokens"] == len(losses)
        assert table.loc[name, "perplexity"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-5)
    assert table.loc["all", "blocks"] == len(blocks)


def test_bert_and_demix_perplexity_are_finite(pack):
    torch.set_default_dtype(torch.float32)
    tok = pack.tokenizer()
    blocks = pack_blocks(pack, tok, "test", 16)
    blocks = type(blocks)(blocks.input_ids[::50], blocks.domains[::50], blocks.domain_names)
    bert = tiny(BERT, mask_token_id=2)
    demix = tiny(sparse=SparseConfig(kind="demix", layers=[0], domains=list(blocks.domain_names)))
    for model in (bert, demix):
        table = perplexity_by_domain(model, blocks)
        assert np.isfinite(table["perplexity"]).all() and (table["perplexity"] > 1).all()


def test_results_table_has_the_papers_shape(pack):
    torch.set_default_dtype(torch.float32)
    table = results_table({"dense": tiny(), "cse-mof": tiny(sparse=SparseConfig(kind="cse", layers=[0], n_experts=[2],
                                                                                 proj_dim=4))}, pack, seeds=(0,),
                          max_blocks=40, max_items=60)  # the shape; every block and item: the smoke reproduction
    assert list(table["model"]) == ["dense", "cse-mof"]
    probes = ["biomedical-go-ontology", "clinical-hpo-organ-system", "general-wordnet-lexname", "legal-licence-category"]
    assert set(probes) <= set(table.columns)
    assert {"perplexity", "ppl general", "ppl legal", "ppl biomedical", "average"} <= set(table.columns)
    assert table["average"].between(0, 1).all()


def test_probes_beat_chance_on_a_separable_task(pack):
    """Probing works end to end: GO ontology (3 classes) from a random-init model's embeddings
    still beats the majority class, because the token statistics differ by ontology."""
    torch.set_default_dtype(torch.float32)
    probes = pack.probes("biomedical-go-ontology")
    acc = probe_accuracy(tiny(), pack.tokenizer(), probes, seeds=(0, 1, 2))
    majority = probes["label"].value_counts(normalize=True).max()
    assert acc.loc[0, "accuracy_mean"] > majority
    assert acc.loc[0, "classes"] == 3 and acc.loc[0, "stands_in_for"] == "GAD / EU-ADR"
