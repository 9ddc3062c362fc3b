"""cse-shuffled: CSE's machinery, expert counts and cluster sizes without its clusters.
Each sequence goes to an expert drawn by a fixed hash of its tokens, in the proportions in which
the clusters route the fitting sample, in training and in evaluation alike; the function is
unchanged at conversion, and the routing carries no cluster information."""

import copy
import json

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from cse_models import GPT, GPTConfig
from cse_models.cse import convert_to_cse
from cse_models.experts import sequence_keys, shuffled_experts
from cse_models.model import load_model
from cse_models.train import TrainConfig, train

FIT = dict(rule="hdbscan", representation="centred-cosine", min_cluster_size=20, min_samples=5, seed=0)


def _planted(n: int, seed: int):
    """Sequences of two topics (tokens 1-5 or 30-34 on 12 of 16 positions, the rest random): the
    model's own clusters separate them. Returns ids (n, 16) and the topic (n,)."""
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, 2, (n,), generator=g)
    ids = torch.randint(0, 50, (n, 16), generator=g)
    core = 1 + torch.randint(0, 5, (n, 16), generator=g) + 29 * topic[:, None]
    keep = torch.rand(n, 16, generator=g) < 0.75
    return torch.where(keep, core, ids), topic


def _converted(shuffled: bool):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16,
                       sparse={"kind": "cse", "layers": [0, 1], "n_experts": [0, 0], "proj_dim": 8})
    model = GPT(config).eval()
    ids, _ = _planted(400, seed=1)
    before = model(ids[:8])
    convert_to_cse(model, ids, None, shuffled=shuffled, **FIT)
    return model, before, ids


@pytest.fixture(scope="module")
def models():
    torch.set_default_dtype(torch.float64)
    cse, _, fitting = _converted(False)
    shuffled, before, _ = _converted(True)
    return cse, shuffled, before, fitting


def test_shuffled_conversion_keeps_the_function_and_cses_counts_and_sizes(models):
    cse, shuffled, before, fitting = models
    assert shuffled.config.sparse.shuffled and not cse.config.sparse.shuffled
    assert shuffled.config.sparse.n_experts == cse.config.sparse.n_experts and min(cse.config.sparse.n_experts) >= 2
    torch.testing.assert_close(shuffled(fitting[:8]), before, rtol=0, atol=1e-12)  # unchanged at conversion
    inputs = cse.module_inputs(fitting, None, [0, 1])
    for i, name in enumerate(cse.sparse_layers()):
        _, own = cse.sparse_layers()[name].route(inputs[i][:, None, :])
        shares = torch.bincount(own, minlength=len(own.unique())) / len(own)  # the clusters' proportions
        torch.testing.assert_close(shuffled.sparse_layers()[name].shares, shares.to(torch.float64))


def test_a_sequence_goes_to_the_same_expert_in_training_and_evaluation(models):
    """The experts made different, so that an output says which expert made it: in evaluation and in
    training, alone or in another batch, padded or not, each sequence reaches the hash's expert."""
    _, shuffled, _, _ = models
    model = copy.deepcopy(shuffled)
    name = next(iter(model.sparse_layers()))
    layer = model.sparse_layers()[name]
    with torch.no_grad():
        for j, expert in enumerate(layer.experts):
            for p in expert.parameters():
                p.add_(0.1 * (j + 1))
    ids, _ = _planted(64, seed=2)
    mask = torch.ones_like(ids)
    mask[:8, 12:] = 0  # padding: only the real tokens count
    want = shuffled_experts(sequence_keys(ids, mask), layer.shares)
    assert len(want.unique()) >= 2
    seen = {}
    handle = layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    try:
        for mode in ("eval", "train"):
            model.train(mode == "train")
            model(ids, mask)
            x, out = seen["x"], seen["out"]
            by_expert = torch.stack([expert(x, mask.bool()) for expert in layer.experts])  # (E, B, T, d)
            made_by = (out[None] - by_expert).abs().amax(dim=(2, 3)).argmin(0)
            assert torch.equal(made_by, want), mode
            if mode == "train":  # and its bookkeeping counted the same
                assert torch.equal(layer._pending[1], want)
    finally:
        handle.remove()
        model.eval()
    alone = torch.stack([shuffled_experts(sequence_keys(ids[k:k + 1], mask[k:k + 1]), layer.shares)[0]
                         for k in range(len(ids))])
    assert torch.equal(alone, want)  # another batch: the same expert
    z, routed = layer.route(torch.randn(len(ids), 16, 16, dtype=torch.float64), keys=sequence_keys(ids, mask))
    assert torch.equal(routed, want) and z.shape == (len(ids), 8)  # whatever the hidden states
    layer.sequence_keys = None
    with pytest.raises(ValueError, match="routes by its sequences' tokens"):
        layer(torch.randn(3, 16, 16, dtype=torch.float64))


def test_the_shuffled_routing_is_in_the_clusters_proportions_and_holds_no_cluster_information(models):
    cse, shuffled, _, _ = models
    ids, topic = _planted(4000, seed=4)
    inputs = cse.module_inputs(ids, None, [0, 1])
    for i, name in enumerate(cse.sparse_layers()):
        layer = shuffled.sparse_layers()[name]
        assign = shuffled_experts(sequence_keys(ids), layer.shares)
        share = torch.bincount(assign, minlength=len(layer.shares)).double() / len(ids)
        assert (share - layer.shares).abs().max() < 0.03  # 4000 draws: a binomial sd under 0.008
        _, own = cse.sparse_layers()[name].route(inputs[i][:, None, :])
        assert adjusted_rand_score(topic, own) > 0.5  # the clusters follow the planted topics
        assert abs(adjusted_rand_score(topic, assign)) < 0.02  # the hash does not
        assert abs(adjusted_rand_score(own, assign)) < 0.02


def test_a_shuffled_model_saves_and_loads_with_its_shares(models, tmp_path):
    _, shuffled, _, _ = models
    shuffled.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["sparse"]["shuffled"] is True
    loaded = load_model(tmp_path / "m").eval()
    ids, _ = _planted(16, seed=5)
    torch.testing.assert_close(loaded(ids), shuffled(ids), rtol=0, atol=0)
    for name, layer in loaded.sparse_layers().items():
        assert layer.shuffled and torch.equal(layer.shares, shuffled.sparse_layers()[name].shares)


def test_cse_train_converts_to_shuffled_mid_run(tmp_path):
    torch.set_default_dtype(torch.float32)
    last = train(TrainConfig.from_dict({
        "out_dir": str(tmp_path / "run"), "model": {"n_layer": 2, "n_embd": 16, "n_head": 2,
                                                    "sparse": {"kind": "cse", "layers": [1], "n_experts": [0]}},
        "data": {"seq_len": 16, "split": "validation"}, "steps": 4, "batch_size": 4, "checkpoint_every": 2,
        "warmup_steps": 1, "tensorboard": False, "device": "cpu",
        "cse": {"convert_at": 2, "n_samples": 200, "min_cluster_size": 10, "shuffled": True}}))
    sparse = json.loads((last / "config.json").read_text())["sparse"]
    assert sparse["shuffled"] is True and sparse["n_experts"][0] >= 1
    assert np.isfinite(json.loads((last / "trainer_state.json").read_text())["step"])


def test_a_fit_that_is_mostly_noise_is_said_in_one_warning(caplog):
    """compare and cse-train warn when most fitting sequences are noise (here: two small
    topics in a bulk of random token sequences, which the clustering leaves as noise)."""
    import logging

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16,
                          sparse={"kind": "cse", "layers": [1], "n_experts": [0], "proj_dim": 8})).eval()
    g = torch.Generator().manual_seed(3)
    topics = 1 + torch.randint(0, 5, (50, 16), generator=g) + 29 * (torch.arange(50) % 2)[:, None]
    ids = torch.cat([topics, torch.randint(0, 50, (250, 16), generator=g)])  # two small topics in a random bulk
    with caplog.at_level(logging.WARNING, logger="cse_models.cse"):
        fits = convert_to_cse(model, ids, None, **FIT)
    fit = fits[1]
    lines = [r.getMessage() for r in caplog.records if r.name == "cse_models.cse"]
    if fit.n_noise > len(fit.labels) / 2:
        assert len(lines) == 1 and f"{fit.n_noise} of 300 fitting sequences are noise" in lines[0]
    else:
        pytest.fail(f"the planted noise was clustered ({fit.n_noise} noise of 300): the test's premise is wrong")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cse_models.cse"):
        _converted(False)  # two clear topics: nothing to say
    assert [r for r in caplog.records if r.name == "cse_models.cse"] == []
