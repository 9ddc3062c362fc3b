"""The small GPT: checkpoint round trip, causality, padding."""

import json

import pytest
import torch

from cse_models import GPT, GPTConfig


def test_save_load_round_trip_gives_identical_logits(gpt, tmp_path):
    ids = torch.randint(0, 50, (3, 10))
    gpt.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["n_layer"] == 2
    loaded = GPT.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(ids), gpt(ids))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied


def test_outputs_are_causal_and_padding_does_not_leak(gpt):
    ids = torch.randint(0, 50, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 50
    torch.testing.assert_close(gpt(ids)[:, :-1], gpt(changed)[:, :-1])
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    torch.testing.assert_close(gpt(ids, mask)[:, :5], gpt(ids[:, :5]))


def test_bad_config_and_mismatched_weights(tmp_path):
    with pytest.raises(ValueError, match=r"GPTConfig: n_embd must be divisible by n_head"):
        GPTConfig(n_embd=10, n_head=3)
    GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=20, block_size=8)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_layer"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match its config"):
        GPT.from_pretrained(tmp_path)
