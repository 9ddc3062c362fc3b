"""The fair capacity control: Switch upcycled so that the model's function is unchanged
at conversion (the gate renormalised to 1, no token dropped in evaluation), with CSE's per-layer
expert counts; the classic gate kept as an option, and shown to move the logits."""

import json

import pytest
import torch

from cse_models import GPT, GPTConfig
from cse_models.cse import upcycle
from cse_models.experts import SwitchFFN
from cse_models.model import load_model
from cse_models.train_config import TrainConfig


def _switch_ready(seed=0):
    """A dense-initialised GPT whose layers 0 and 1 are Switch layers with 0 experts (dense until upcycled)."""
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16,
                       sparse={"kind": "switch", "layers": [0, 1], "n_experts": [0, 0]})
    return GPT(config).eval()


def test_preserving_upcycling_leaves_the_logits_unchanged_with_per_layer_counts(lm_batch):
    model = _switch_ready()
    before = model(lm_batch["input_ids"], lm_batch["attention_mask"])
    assert upcycle(model, [3, 2]) == [3, 2]  # CSE's counts, layer by layer
    assert model.config.sparse.n_experts == [3, 2] and model.config.sparse.preserving
    assert [len(m.experts) for m in model.sparse_layers().values()] == [3, 2]
    after = model(lm_batch["input_ids"], lm_batch["attention_mask"])
    real = lm_batch["attention_mask"].bool()  # (a padded position passes no expert: its logits mean nothing)
    torch.testing.assert_close(after[real], before[real], rtol=0, atol=1e-12)
    assert not model.training and all(not m.training for m in model.sparse_layers().values())
    classic = _switch_ready()
    upcycle(classic, 3, preserving=False)  # the old behaviour: the softmax gate (about 1/3) scales the FFN
    moved = classic(lm_batch["input_ids"], lm_batch["attention_mask"])[real]
    assert (moved - before[real]).norm() / before[real].norm() > 0.01


def test_no_token_is_dropped_in_evaluation_and_the_router_still_learns(lm_batch):
    model = _switch_ready()
    upcycle(model, 2)
    layer = model.sparse_layers()["transformer.h.0.mlp"]
    with torch.no_grad():  # every token to expert 0: far over its capacity of 1.25 x tokens / 2
        layer.router.weight.zero_()
        layer.router.weight[0] = 1.0
        layer.router.weight[1] = -1.0
    x = torch.randn(3, 8, 16)
    dense = layer.experts[0](x)
    torch.testing.assert_close(layer(x), dense, rtol=0, atol=1e-12)  # eval: all of them served
    layer.per_sample_dispatch = True  # the NTK path: the same function
    torch.testing.assert_close(layer(x), dense, rtol=0, atol=1e-12)
    layer.per_sample_dispatch = False
    layer.train()
    out = layer(x)
    served = (out - dense).abs().amax(-1) < 1e-12
    assert 0 < served.float().mean() < 1  # training keeps Switch's capacity: the overflow skips the layer
    model.train()
    loss = model(lm_batch["input_ids"], lm_batch["attention_mask"]).square().mean() + model.aux_loss()
    loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_a_saved_switch_model_keeps_its_gate(tmp_path, lm_batch):
    for preserving in (True, False):
        model = _switch_ready()
        upcycle(model, [2, 3], preserving=preserving)
        model.save_pretrained(tmp_path / str(preserving))
        saved = json.loads((tmp_path / str(preserving) / "config.json").read_text())
        assert saved["sparse"]["preserving"] is preserving
        loaded = load_model(tmp_path / str(preserving)).eval()
        assert all(isinstance(m, SwitchFFN) and m.preserving is preserving for m in loaded.sparse_layers().values())
        torch.testing.assert_close(loaded(lm_batch["input_ids"]), model(lm_batch["input_ids"]), rtol=0, atol=0)
    old = dict(saved["sparse"])
    old.pop("preserving")  # a model saved before the field existed: the classic gate, as it was trained
    assert GPTConfig.from_dict({**saved, "sparse": old}).sparse.preserving is False


@pytest.mark.parametrize("bad, rule", [({"n_experts": []}, "one count per sparse layer"),
                                       ({"n_experts": [2, 0]}, "positive integer"),
                                       ({"preserving": "yes"}, "true or false")])
def test_upcycle_settings_are_checked(bad, rule):
    with pytest.raises(ValueError, match=rule):
        TrainConfig.from_dict({"upcycle": {"convert_at": 2, "n_experts": 2, **bad}})
    assert TrainConfig.from_dict({"upcycle": {"convert_at": 2, "n_experts": [3, 2]}}).upcycle.preserving is True
