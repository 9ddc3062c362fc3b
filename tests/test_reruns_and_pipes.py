"""Round three of bad input: data through a pipe is sniffed, never read as text when it
holds JSON; a rerun that changes what was asked is refused (or started over with --force), never
mixed; one lock on every --out; options checked where they are parsed; a refused command leaves
nothing behind. Each test failed on the main of 2026-11-26 (the row of the issue's table is named)."""

import gzip
import json
import os
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch
from commandline import in_process, write_domain_rows

from cse_models import GPT, GPTConfig
from cse_models.train import TrainConfig, main as cse_train, train
from ntkscope.text.corpus.pack import DEFAULT_PACK
from ntkscope.text.inputs import DataSource, as_source

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def float32_default(float64_default):
    """Training and compare build models in the default dtype: float32, as a user's process has it."""
    torch.set_default_dtype(torch.float32)


def one_line(proc, code=1) -> str:
    """The refusal: exit ``code`` and (for exit 1) one line on stderr."""
    err = proc.stderr.strip()
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    if code == 1:
        assert len(err.splitlines()) == 1, err
    return err


def pipe_of(data: bytes) -> str:
    """``/dev/fd/N`` of a pipe that gives ``data`` once, as ``<(cat rows.jsonl)`` does."""
    read, write = os.pipe()

    def feed():
        with os.fdopen(write, "wb") as f:
            f.write(data)

    threading.Thread(target=feed, daemon=True).start()
    return f"/dev/fd/{read}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GPT checkpoint with the pack's tokenizer, labelled JSONL rows of real text, and a tiny
    GPT-NeoX directory with train / test tables for compare."""
    root = tmp_path_factory.mktemp("world")
    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=2, n_head=2, n_embd=16)).float().save_pretrained(root / "gpt")
    (root / "gpt" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    write_domain_rows(root, {"train": 60, "test": 12})
    config = transformers.GPTNeoXConfig(vocab_size=8192, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64, rotary_pct=0.25,
                                        bos_token_id=0, eos_token_id=0)
    transformers.GPTNeoXForCausalLM(config).float().save_pretrained(root / "neox")
    (root / "neox" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    return root


# ---- row 1: a pipe is a pipe, whatever its name ------------------------------------------------------------------

def test_json_lines_through_a_pipe_are_read_as_json_lines(world, tmp_path):
    rows = (world / "test.jsonl").read_bytes()
    want = DataSource(world / "test.jsonl", label_column="domain").rows()
    assert as_source(DataSource(Path(pipe_of(rows)), label_column="domain")).rows() == want
    assert as_source(DataSource(Path(pipe_of(gzip.compress(rows))), label_column="domain")).rows() == want
    # the README's example, end to end: the same GC as from the file
    args = ["--by", "label", "--label-column", "domain", "--n", 24, "--seq-len", 24, "--resamples", 0,
            "--null-draws", 0, "--min-count", 3]
    proc = in_process("gc", world / "gpt", "--data", world / "test.jsonl", *args, "--out", tmp_path / "file")
    assert proc.returncode == 0, proc.stderr
    proc = in_process("gc", world / "gpt", "--data", pipe_of(rows), *args, "--out", tmp_path / "pipe")
    assert proc.returncode == 0, proc.stderr
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "file" / "gc.csv"), pd.read_csv(tmp_path / "pipe" / "gc.csv"))


def test_a_pipe_of_unknown_format_is_refused_or_named_with_format(world, tmp_path):
    text = b"The court held that the contract was void.\nA second line of plain text here.\n"
    proc = in_process("freq", pipe_of(text), "--tokenizer", DEFAULT_PACK / "tokenizer.json")
    err = one_line(proc)
    assert "--format" in err and "/dev/fd/" in err, err
    proc = in_process("freq", pipe_of(text), "--format", "text", "--tokenizer", DEFAULT_PACK / "tokenizer.json")
    assert proc.returncode == 0, proc.stderr
    # a regular file whose name says nothing is sniffed as well
    plain = tmp_path / "rows"
    plain.write_bytes((world / "test.jsonl").read_bytes())
    assert as_source(DataSource(plain, label_column="domain")).rows() == \
        DataSource(world / "test.jsonl", label_column="domain").rows()


# ---- rows 2 and 3: a rerun that changes what was asked ---------------------------------------------------------

def _compare(world, out, *extra):
    return in_process("compare", world / "neox", "--layers", 1, "--train-data", world / "train.jsonl", "--data",
                      world / "test.jsonl", "--label-column", "domain", "--steps", 2, "--batch-size", 4,
                      "--seq-len", 16, "--min-cluster-size", 5, "--out", out, *extra)


def test_compare_rerun_with_other_options_is_refused_naming_them(world, tmp_path):
    out = tmp_path / "cmp"
    assert _compare(world, out).returncode == 0
    before = (out / "tables" / "comparison.csv").read_bytes()
    err = one_line(_compare(world, out, "--lr", 0.5))
    assert "lr" in err and "--force" in err, err
    assert (out / "tables" / "comparison.csv").read_bytes() == before
    other = tmp_path / "other.jsonl"
    other.write_text("".join(line + "\n" for line in (world / "train.jsonl").read_text().splitlines()[::2]))
    proc = in_process("compare", world / "neox", "--layers", 1, "--train-data", other, "--data",
                      world / "test.jsonl", "--label-column", "domain", "--steps", 2, "--batch-size", 4,
                      "--seq-len", 16, "--min-cluster-size", 5, "--out", out)
    assert "train_data" in one_line(proc)
    proc = _compare(world, out, "--lr", 0.5, "--force")  # started over, never mixed
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "runs" / "dense-seed0" / "train_config.json").read_text())
    assert saved["lr"] == 0.5


def _train_config(out, **model):
    return {"out_dir": str(out), "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, **model},
            "data": {"seq_len": 16, "split": "validation"}, "steps": 2, "batch_size": 4, "checkpoint_every": 1,
            "warmup_steps": 1, "tensorboard": False, "device": "cpu"}


def test_cse_train_rerun_with_another_config_is_refused_and_the_record_describes_the_weights(tmp_path, capsys):
    out = tmp_path / "run"
    first = tmp_path / "first.json"
    first.write_text(json.dumps(_train_config(out)))
    assert cse_train([str(first)]) == 0
    capsys.readouterr()
    second = tmp_path / "second.json"
    second.write_text(json.dumps({**_train_config(out, n_embd=64), "lr": 0.01}))
    assert cse_train([str(second)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.n_embd" in err and "lr" in err and "--force" in err, err
    assert json.loads((out / "train_config.json").read_text())["model"]["n_embd"] == 32
    assert cse_train([str(first), "--steps", "2"]) == 0  # the same request resumes (here: is done)
    assert cse_train([str(second), "--force"]) == 0
    saved = json.loads((out / "train_config.json").read_text())
    weights = json.loads((out / "checkpoints" / "step-000002" / "config.json").read_text())
    assert saved["model"]["n_embd"] == 64 == weights["n_embd"] and saved["lr"] == 0.01


def test_a_resumed_training_may_stop_elsewhere_but_not_change_its_schedule(tmp_path):
    cfg = _train_config(tmp_path / "run")
    train(TrainConfig.from_dict({**cfg, "stop_at": 1}))
    train(TrainConfig.from_dict(cfg))  # stop_at is where it stops, not what it trains
    with pytest.raises(ValueError, match=r"steps \(2 -> 5\)"):
        train(TrainConfig.from_dict({**cfg, "steps": 5}))


# ---- row 5: one lock on every --out --------------------------------------------------------------------------

def test_a_second_writer_of_the_same_out_is_refused_in_one_line(world, tmp_path):
    out = tmp_path / "gc"
    args = ["--n", 16, "--seq-len", 24, "--bins", 2, "--resamples", 0, "--null-draws", 0]
    from ntkscope.core.files import output_lock  # the lock sits beside the output

    with output_lock(out, "gc"):  # another gc writing there
        err = one_line(in_process("gc", world / "gpt", *args, "--out", out))
    assert "in use by another process" in err and str(out) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing was left behind
    with output_lock(tmp_path / "c.csv", "clusters"):
        err = one_line(in_process("clusters", world / "gpt", "--n", 16, "--seq-len", 24, "--out", tmp_path / "c.csv"))
    assert "in use by another process" in err


# ---- rows 4, 7, 11: options checked where they are parsed -------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.set_default_dtype(torch.float32)
    run = tmp_path_factory.mktemp("run") / "run"
    train(TrainConfig.from_dict({**_train_config(run), "steps": 8}))
    return run


@pytest.mark.parametrize("argv, option", [
    (["plan", "RUN", "--n", "16", "--seq-len", "16", "--top-k", "1", "--tail-fraction", "-0.5"], "--tail-fraction"),
    (["plan", "RUN", "--n", "16", "--seq-len", "16", "--top-k", "1", "--tail-fraction", "2"], "--tail-fraction"),
    (["plan", "RUN", "--n", "16", "--seq-len", "16", "--top-k", "1", "--overlap", "7"], "--overlap"),
    (["gc", "RUN", "--tail-fraction", "0"], "--tail-fraction"),
    (["gc", "CKPT", "--confidence", "1.5"], "--confidence"),
    (["gc", "CKPT", "--resamples", "-1"], "--resamples"),
    (["reproduce", "--sweep", "--threads", "-2"], "--threads"),
    (["reproduce", "--sweep", "--threads", "0"], "--threads"),
    (["compare", "CKPT", "--layers", "1", "--train-data", "x", "--data", "y", "--steps", "-3"], "--steps"),
    (["eval", "CKPT", "--n-boot", "0"], "--n-boot"),
])
def test_impossible_option_values_are_usage_errors_before_any_work(argv, option, run_dir, tmp_path):
    argv = [str(run_dir) if a == "RUN" else str(run_dir / "checkpoints" / "step-000008") if a == "CKPT" else a
            for a in argv]
    proc = in_process(*argv, "--out", tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert option in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not (tmp_path / "out").exists()


def test_gc_over_a_run_without_intervals_says_no_peak(run_dir, tmp_path):
    proc = in_process("gc", run_dir, "--n", 48, "--seq-len", 16, "--resamples", 0, "--null-draws", 0,
                      "--output", "true-logit", "--out", tmp_path / "over")  # (an output no row is flagged in)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not shown" in proc.stdout
    series = pd.read_csv(tmp_path / "over" / "gc_over_steps.csv")
    assert list(series["step"]) == list(range(1, 9))


# ---- rows 9, 10, 14: refused before any work, nothing left behind -------------------------------------------

def test_an_out_that_is_a_file_is_refused_before_any_work(world, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    err = one_line(_compare(world, taken))
    assert "exists and is not a directory" in err
    err = one_line(in_process("reproduce", "--sweep", "--out", taken))
    assert "exists and is not a directory" in err
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("adopt", ["missing", "file"])
def test_reproduce_adopt_must_be_a_directory(tmp_path, adopt):
    path = tmp_path / "models"
    if adopt == "file":
        path.write_text("")
    err = one_line(in_process("reproduce", "--tables-late", "--adopt", path, "--out", tmp_path / "late"))
    assert "adopt" in err and str(path) in err
    assert not (tmp_path / "late").exists()


def test_a_refused_compare_leaves_nothing_and_checks_its_layers_first(world, tmp_path):
    err = one_line(_compare(world, tmp_path / "layers", "--layers", 7))
    assert "7" in err
    assert not (tmp_path / "layers").exists()  # refused before the dense arm trained
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((world / "neox" / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    proc = in_process("compare", pickled, "--layers", 1, "--train-data", world / "train.jsonl", "--data",
                      world / "test.jsonl", "--steps", 2, "--out", tmp_path / "pickle")
    one_line(proc)
    assert not (tmp_path / "pickle").exists()


# ---- the Python API at the command line's standard ---------------------------------------------------------

def test_probes_load_takes_what_a_user_has_and_names_a_wrong_argument(world):
    """An HF tokenizer object or a path, a label column by name; anything else is one ValueError."""
    from ntkscope.gc.tracker import Probes

    path = DEFAULT_PACK / "tokenizer.json"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    loaded = [Probes.load(world / "test.jsonl", tok, n=16, seq_len=16, by="label", label_column="domain",
                          min_count=2) for tok in (hf, str(path))]
    assert sorted(loaded[0].groups) == ["biomedical", "general", "legal"]
    assert all((a == b).all() for a, b in zip(loaded[0].batch.values(), loaded[1].batch.values()))
    assert hf.backend_tokenizer.padding is None  # the user's tokenizer is left as it was
    with pytest.raises(ValueError, match=r"^Probes.load: tokenizer must be .* \(got 'int'\)"):
        Probes.load(world / "test.jsonl", 3, n=16)
    with pytest.raises(ValueError, match=r"^Probes.load: labell is not an argument"):
        Probes.load(world / "test.jsonl", path, n=16, labell="domain")
