"""Property tests: over the public functions' argument ranges and small random texts, every
input gives a valid result or the documented ValueError; never another exception, a hang,
or a NaN in a result (the one documented exception: a text with no tokens has no frequency
score, NaN beside its token count 0)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ntkscope as ns
from cse_models import GPT, GPTConfig
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.frequency import bin_indices

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
scores = st.lists(st.one_of(st.floats(0, 1), st.sampled_from([math.nan, math.inf, -1.0])), min_size=0, max_size=60)
sizes = st.one_of(st.none(), st.integers(-2, 40), st.sampled_from([True, 2.5, "3"]))


@pytest.fixture(scope="module")
def tokenizer():
    return load_pack().tokenizer()


@SETTINGS
@given(scores=scores, bins=sizes, min_count=sizes, cap=sizes)
def test_bin_indices(scores, bins, min_count, cap):
    try:
        out = bin_indices(scores, bins=bins, min_count=min_count, cap=cap)
    except ValueError as err:
        assert str(err).startswith("bin_indices: "), err
        return
    seen = set()
    for b, idx in out.items():
        # min_count applies before the cap (the docstring: fewer are left out, larger are sub-sampled to cap)
        assert 0 <= b < bins and len(idx) >= (min_count if cap is None else min(min_count, cap))
        assert cap is None or len(idx) <= cap
        assert np.all(np.diff(idx) > 0) and not seen & set(idx.tolist())
        assert np.isfinite(np.asarray(scores, dtype=float)[idx]).all()
        seen |= set(idx.tolist())


@SETTINGS
@given(scores=scores, bins=sizes)
def test_score_histogram(scores, bins):
    try:
        hist = ns.score_histogram(scores, bins=bins)
    except ValueError as err:
        assert str(err).startswith("score_histogram: "), err
        return
    finite = np.isfinite(np.asarray(scores, dtype=float))
    assert len(hist) == bins and hist["count"].sum() == finite.sum()
    assert np.isclose(hist["percent"].sum(), 100.0) and not hist.isna().any().any()


@SETTINGS
@given(texts=st.lists(st.text(max_size=40), min_size=0, max_size=6), normalisation=st.sampled_from(
    ["max", "log", "prob", "rank", "zipf"]))
def test_frequency_scores_of_random_text(tokenizer, texts, normalisation):
    try:
        counts = ns.count_tokens(texts, tokenizer)
        phi = ns.token_frequency(counts, normalisation)
        score, n_tokens = ns.sentence_scores(texts, tokenizer, phi)
    except ValueError as err:
        assert str(err).split(":")[0] in ("count_tokens", "token_frequency", "sentence_scores"), err
        return
    assert np.isfinite(phi).all() and ((phi >= 0) & (phi <= 1)).all()
    assert len(score) == len(texts) and (n_tokens >= 0).all()
    # the one documented missing value: a text with no tokens has no score (NaN), and says so (0 tokens)
    assert np.isfinite(score[n_tokens > 0]).all() and np.isnan(score[n_tokens == 0]).all()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(-1, 8), seq_len=st.integers(-2, 20), seed=st.integers(0, 3))
def test_load_analysis_data(tokenizer, n, seq_len, seed):
    try:
        data = ns.load_analysis_data("default", tokenizer, n=n, seq_len=seq_len, seed=seed)
    except ValueError as err:
        assert str(err).startswith("load_analysis_data: "), err
        return
    ids = data.batch["input_ids"]
    assert ids.shape[0] == n and 1 <= ids.shape[1] <= seq_len and np.isfinite(data.labels["score"]).all()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=8)).eval()


@SETTINGS
@given(n=st.integers(0, 6), T=st.integers(1, 6), chunk_size=sizes,
       dtype=st.sampled_from([None, "float32", "float64", "float8", torch.int64]),
       method=st.sampled_from(["auto", "exact", "projected", "matrix-free", "fast"]),
       output=st.sampled_from(["loss", "logits", "perplexity"]), data=st.data())
def test_empirical_ntk_and_gc(gpt, n, T, chunk_size, dtype, method, output, data):
    batch = {"input_ids": torch.randint(0, 40, (n, T), generator=torch.Generator().manual_seed(n * 7 + T)),
             "attention_mask": torch.ones(n, T, dtype=torch.long)}
    options = dict(chunk_size=chunk_size, dtype=dtype, method=method, output=output, projection_dim=16)
    try:
        res = ns.empirical_ntk(gpt, batch, **options)
    except ValueError as err:
        assert str(err).startswith("empirical_ntk: "), err
    else:
        assert res.matrix.shape == (n, n) and torch.isfinite(res.matrix).all()
        torch.testing.assert_close(res.matrix, res.matrix.T, rtol=1e-5, atol=1e-5)  # float32 sums in either order
    subset = data.draw(st.lists(st.integers(-1, max(n, 1)), max_size=4))
    try:
        gc = ns.gradient_consistency(gpt, batch, subset, **options)
    except ValueError as err:
        assert str(err).startswith("gradient_consistency: "), err
    else:
        assert -1 <= gc.score <= 1 and math.isfinite(gc.eigenvalue)


@SETTINGS
@given(n=st.integers(4, 24), rank=st.integers(1, 6), seed=st.integers(0, 10_000), groups=st.integers(1, 3),
       interval=st.sampled_from(["jackknife", "basic", "bca"]))
def test_kernel_gc_intervals_hold_their_point(n, rank, seed, groups, interval):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(n, rank)) @ rng.normal(size=(rank, 7))  # PSD, rank <= rank: often lambda_2 = 0
    order = rng.permutation(n)
    subsets = [s for s in np.array_split(order, groups) if len(s) >= 2]
    try:
        results = ns.kernel_gc(J @ J.T, subsets, resampling=ns.Resampling(resamples=20, null_draws=20, seed=seed,
                                                                           interval=interval, half_samples=5),
                               controls=ns.Controls(matched={"order": np.arange(n, dtype=float)}))
    except ValueError as err:
        assert str(err).startswith("kernel_gc: "), err
        return
    for r in results:
        assert r.interval.low <= r.score <= r.interval.high and -1 <= r.interval.low and r.interval.high <= 1
        assert r.abs_interval.low <= abs(r.score) <= r.abs_interval.high
        assert 0 <= r.sign_confidence <= 1 and r.versus_null in ("above", "below", "within", "n/a")
        assert all(r.versus(name) in ("above", "below", "within", "n/a") for name in r.controls)
        if r.large_sample == "claimed":
            assert r.abs_large_interval.low <= r.abs_large <= r.abs_large_interval.high


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(root / "gpt")
    return root / "gpt"


@settings(max_examples=int(__import__('os').environ.get('NTKSCOPE_PROPERTY_EXAMPLES', 20)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=400), st.text(max_size=300).map(str.encode)),
       suffix=st.sampled_from([".txt", ".jsonl", ".csv", ".tsv", ".txt.gz"]),
       command=st.sampled_from(["freq", "ntk", "gc"]),
       n=st.sampled_from(["1", "2", "8", "0", "-3", "x"]), seq_len=st.sampled_from(["4", "16", "0", "64"]))
def test_the_command_line_never_shows_a_traceback_or_writes_nan(cli_checkpoint, tmp_path_factory, data, suffix,
                                                               command, n, seq_len):
    """random bytes, sizes and option values through gc / ntk / freq in process: success, one
    line and exit 1, or a usage error (exit 2); never a traceback, never a NaN in JSON."""
    import json

    from commandline import in_process
    from ntkscope.text.corpus.pack import DEFAULT_PACK

    folder = tmp_path_factory.mktemp("prop")
    path = folder / f"data{suffix}"
    path.write_bytes(data)
    args = ["--tokenizer", DEFAULT_PACK, "--out", folder / "out"]
    if command == "freq":
        proc = in_process("freq", path, *args)
    else:
        proc = in_process(command, cli_checkpoint, "--data", path, "--n", n, "--seq-len", seq_len, *args,
                          *(["--bins", "2", "--resamples", "10", "--null-draws", "10"] if command == "gc" else []))
    assert proc.returncode in (0, 1, 2), proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    lines = proc.stderr.strip().splitlines()
    if proc.returncode == 1:  # one error line (warnings about the data may precede it, each once)
        assert [line for line in lines if "error:" in line] == lines[-1:], proc.stderr[-1500:]
    assert len(set(lines)) == len(lines), proc.stderr[-1500:]  # nothing said twice
    for result in (folder / "out").glob("*.json"):
        json.loads(result.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {result.name}"))
