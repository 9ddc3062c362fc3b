"""Shared fixtures: float64 by default (reference comparisons), tiny models, padded batches."""

import os

import pytest
import torch

from cse_models import GPT, GPTConfig

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each, not four on two
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()


@pytest.fixture
def lm_batch():
    """8 sequences of up to 10 tokens, two of them right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (8, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    mask[5, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture
def hf_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, max_position_embeddings=16)
    return transformers.BertForMaskedLM(config).eval()
