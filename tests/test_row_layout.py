"""Training on padded rows (``data.layout = "rows"``: one text per row, cut and padded, as a
padding collator gives a ``Trainer``): the padding is neither attended to nor predicted, so a
padded batch's summed loss is the sum of each row's loss computed alone (our GPT and an HF
GPT-NeoX, dense and with CSE experts routing by each sequence); a run on rows trains and counts
only the rows' tokens."""

import json

import pytest
import torch

from cse_models import SparseHF
from cse_models.train_config import TrainConfig
from cse_models.config import GPTConfig
from cse_models.cse import convert_to_cse
from cse_models.data import make_blocks
from cse_models.model import build_model
from cse_models.train import lm_loss, load_data, train
from ntkscope.text.tokenization import train_bpe

transformers = pytest.importorskip("transformers")


def ours():
    torch.manual_seed(0)
    return build_model(GPTConfig.from_dict({"vocab_size": 50, "block_size": 16, "n_layer": 2, "n_head": 2,
                                            "n_embd": 16, "dropout": 0.0,
                                            "sparse": {"kind": "cse", "layers": [1], "n_experts": [0]}}))


def neox():
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, rotary_pct=0.25, bos_token_id=0, eos_token_id=0))
    return SparseHF(hf, {"kind": "cse", "layers": [1], "n_experts": [0]})


def planted(n: int = 40, T: int = 12):
    """Two domains with disjoint vocabularies, so that CSE's fit makes two experts."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randint(1, 25, (n, T), generator=g), torch.randint(25, 50, (n, T), generator=g)])


@pytest.mark.parametrize("make", [ours, neox], ids=["gpt", "gpt_neox"])
@pytest.mark.parametrize("converted", [False, True], ids=["dense", "cse"])
@torch.no_grad()
def test_a_padded_batch_loses_what_its_rows_lose_alone(make, converted):
    torch.set_default_dtype(torch.float64)
    try:
        model = make().double().eval()
        if converted:
            fits = convert_to_cse(model, planted(), None, min_cluster_size=5, min_samples=3, max_experts=4)
            assert all(f.n_clusters >= 2 for f in fits.values())
        rows = planted()[[0, 1, 50, 60]]
        lengths = [12, 7, 3, 9]
        mask = torch.zeros_like(rows, dtype=torch.bool)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
        padded = rows.masked_fill(~mask, 0)
        cfg = TrainConfig.from_dict({"out_dir": "unused"})
        domains = torch.zeros(len(rows), dtype=torch.long)
        total, count = lm_loss(model, padded, domains, 0, cfg, mask=mask)
        alone = [lm_loss(model, padded[i:i + 1, :n], domains[:1], 0, cfg) for i, n in enumerate(lengths)]
        torch.testing.assert_close(total, sum(a[0] for a in alone), rtol=1e-12, atol=1e-12)
        assert int(count) == sum(n - 1 for n in lengths) == sum(int(a[1]) for a in alone)
    finally:
        torch.set_default_dtype(torch.float32)


def test_rows_are_one_text_each_cut_and_padded():
    texts = ["short text", "a much longer text " * 20, "x"]
    tok = train_bpe(texts * 5, vocab_size=300)
    blocks = make_blocks({"d": texts}, tok, 16, layout="rows")
    lengths = [len(ids) for ids in tok.encode(texts)]
    kept = [min(n, 16) for n in lengths if n >= 2]
    assert blocks.mask.sum(1).tolist() == kept and blocks.input_ids.shape == (len(kept), 16)
    assert (blocks.input_ids[~blocks.mask] == tok.pad_id).all()
    assert make_blocks({"d": texts}, tok, 16).mask is None  # packed: every position a token


def test_a_run_on_rows_trains_and_counts_only_their_tokens(tmp_path):
    from ntkscope.text.corpus.pack import load_pack

    rows = [{"text": r.text, "domain": r.domain} for r in load_pack().records("train")[:200]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig.from_dict({
        "out_dir": str(tmp_path / "run"), "steps": 4, "batch_size": 4, "checkpoint_every": 4, "log_every": 1,
        "data": {"table": str(tmp_path / "rows.jsonl"), "label_column": "domain", "seq_len": 32, "layout": "rows",
                 "tokenizer": str(load_pack().path / "tokenizer.json")},
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 16}})
    blocks, _ = load_data(cfg)
    assert len(blocks) == len(rows) and blocks.mask is not None and not blocks.mask.all()  # one row per text
    assert train(cfg).name == "step-000004"
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["data"]["layout"] == "rows"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(0 < x < 20 for x in losses)
    with pytest.raises(Exception, match="data.layout must be one of packed, rows"):
        TrainConfig.from_dict({"out_dir": "x", "data": {"layout": "padded"}})


def test_a_pack_run_on_rows_scores_its_validation_on_packed_blocks(tmp_path):
    """layout rows on the shipped pack with eval_every: training reads rows, the validation curve
    is scored on the pack's packed validation blocks (the same for every layout)."""
    cfg = {"steps": 2, "batch_size": 4, "checkpoint_every": 2, "log_every": 1, "eval_every": 2,
           "model": {"n_layer": 1, "n_head": 2, "n_embd": 16}}
    rows = train(TrainConfig.from_dict({**cfg, "out_dir": str(tmp_path / "rows"),
                                        "data": {"seq_len": 32, "layout": "rows"}}))
    assert rows.name == "step-000002"
    text = (tmp_path / "rows" / "validation.csv").read_text()
    assert "all" in text and len(text.splitlines()) > 1
