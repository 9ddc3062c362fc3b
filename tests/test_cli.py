"""The ntkscope command as a user runs it (a new process), or its same main() in this process."""

import subprocess
import sys

import pandas as pd
import pytest
from commandline import in_process


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ntkscope.app.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "gc.csv"
    proc = _run("--quiet", "demo", "--steps", "10", "--n", "24", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "gradient consistency of each group" in proc.stdout
    table = pd.read_csv(out)
    assert set(table["by"]) == {"domain", "frequency bin"}
    assert table["gc"].between(-1, 1).all() and (table["abs_gc_low"] <= table["abs_gc"]).all()
    assert table.loc[table.by == "domain", "n_subset"].sum() == 24


def test_user_error_is_one_line_and_exit_code_1(capsys):
    from ntkscope.app.cli import main

    assert main(["--quiet", "demo", "--steps", "1", "--n", "1"]) == 1  # in process: the same main() as the command
    err = capsys.readouterr().err.strip()
    assert err == "ntkscope demo: error: run_demo: n must be an integer >= 8 (two long-tail domains, general text, " \
                  "3 frequency bins) (got 1)"  # refused before any work
    assert len(err.splitlines()) == 1


def test_a_bad_memory_budget_is_refused_before_any_work(capsys):
    from ntkscope.app.cli import main

    for value, shown in (("0", "0.0"), ("inf", "inf"), ("nan", "nan")):
        assert main(["--quiet", "gc", "CKPT", "--max-memory", value]) == 1
        assert capsys.readouterr().err.strip() == "ntkscope gc: error: max-memory must be a positive, finite number " \
                                                  f"of GiB (got {shown})"


def test_a_device_this_machine_lacks_is_one_line(capsys, tmp_path):
    """--device cuda / cuda:7 / banana without a GPU."""
    import torch

    from cse_models import GPT, GPTConfig
    from ntkscope.app.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(tmp_path / "gpt")
    for command in ("gc", "ntk"):
        for device, rule in (("cuda", "CUDA is not available"), ("cuda:7", "CUDA is not available"),
                             ("banana", "a device string")):
            assert main(["--quiet", command, str(tmp_path / "gpt"), "--n", "24", "--seq-len", "16", "--device",
                         device]) == 1
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.startswith(f"ntkscope {command}: error: device must") \
                and rule in err, err


def test_usage_error_is_exit_code_2(capsys):
    from ntkscope.app.cli import main

    for argv in (["frobnicate"], ["demo", "--method", "fast"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "usage: ntkscope" in capsys.readouterr().err


@pytest.mark.parametrize("args, reason", [
    (["ntk", "CKPT", "--method", "matrix-free"], "--method matrix-free must form the kernel"),
    (["gc", "CKPT", "--output", "logits"], "--output logits must be a scalar output"),
    (["gc", "CKPT", "--output", "hidden-mean", "--method", "exact"], "--output hidden-mean must be a scalar output"),
    (["ntk", "CKPT", "--output", "logits", "--method", "structured"], "--method structured must support vector outputs"),
])
def test_the_method_table_refuses_what_cannot_run_before_any_work(args, reason, capsys):
    from ntkscope.app.cli import main

    # CKPT does not exist: the refusal comes from the command line, before anything is loaded
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert len(err.strip().splitlines()) == 1
    assert last.startswith(f"ntkscope {args[0]}: error: {reason}")


def test_the_command_line_choices_come_from_the_tables():
    from ntkscope.app.cli import build_parser
    from ntkscope.kernel.methods import METHODS
    from ntkscope.kernel.objectives import OUTPUTS

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("gc", "ntk"):
        actions = {a.dest: a for a in sub[command]._actions}
        assert actions["method"].choices == ["auto", *METHODS]
        assert actions["output"].choices == list(OUTPUTS)


def test_corpus_info_on_the_default_pack_writes_its_tables(tmp_path):
    proc = in_process("corpus", "info", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "the 20 largest categories" in proc.stdout and "percentage of sentences per score bin" in proc.stdout
    domains = pd.read_csv(tmp_path / "domain_table.csv")
    assert domains["percent"].sum() == pytest.approx(100)
    hist = pd.read_csv(tmp_path / "score_histogram.csv")
    assert hist["percent"].sum() == pytest.approx(100)
    scores = pd.read_parquet(tmp_path / "sentence_scores.parquet")
    assert set(scores["domain"]) == {"general", "legal", "biomedical"}


def test_corpus_build_from_real_excerpts_and_its_errors(tmp_path):
    from pathlib import Path

    excerpts = Path(__file__).parent / "data" / "sources"
    args = ["--root", str(excerpts / "root"), "--data-dir", str(excerpts / "data")]
    proc = _run("--quiet", "corpus", "build", str(tmp_path / "p"), "--vocab-size", "400", "--share", "0.1", *args)
    assert proc.returncode == 0, proc.stderr
    assert "long-tail share: asked 10.00%" in proc.stdout
    again = in_process("corpus", "build", str(tmp_path / "p"), *args)  # the rest in process: the same main()
    assert again.returncode == 1 and "exists; pass overwrite=True (--force)" in again.stderr
    bad = in_process("corpus", "build", str(tmp_path / "q"), "--share", "1.2", *args)
    assert bad.returncode == 1
    assert bad.stderr.strip() == ("ntkscope corpus: error: build_pack: share must be a number strictly "
                                  "between 0 and 1 (got 1.2)")
    listing = in_process("corpus", "sources", "--root", str(tmp_path), "--data-dir", str(tmp_path))
    assert listing.returncode == 0 and "missing: apt-get update && apt-get install -y dict-gcide" in listing.stdout
    small = in_process("corpus", "build", str(tmp_path / "small"), "--vocab-size", "400", "--share", "0.1",
                       "--max-tokens", "3000", *args)
    assert small.returncode == 0, small.stderr
    grown = in_process("corpus", "grow", str(tmp_path / "grown"), "--pack", str(tmp_path / "small"),
                       "--train-tokens", "5000", *args)
    assert grown.returncode == 0, grown.stderr
    assert "validation, test, probes and tokenizer those of" in grown.stdout
    short = in_process("corpus", "grow", str(tmp_path / "nope"), "--pack", str(tmp_path / "small"),
                       "--train-tokens", "10", *args)
    assert short.returncode == 1 and "grow_pack: train_tokens must exceed the pack's training words" in short.stderr
    assert not (tmp_path / "nope").exists()


def test_ctrl_c_is_one_line_with_exit_130_and_no_partial_output(capsys, monkeypatch, tmp_path):
    """Ctrl-C mid-command."""
    from ntkscope.app import commands
    from ntkscope.app.cli import main
    from ntkscope.core.files import Staging, write_table

    def interrupted(*args, out=None, **kwargs):
        with Staging(out) as files:  # a command half-way through writing its files
            write_table(__import__("pandas").DataFrame({"a": [1]}), files.path("freq.csv"))
            raise KeyboardInterrupt

    monkeypatch.setattr(commands, "freq_command", interrupted)
    assert main(["--quiet", "freq", "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "ntkscope freq: interrupted; no partial results were written"
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_retrained_in_place_is_not_served_from_the_cache(tmp_path, monkeypatch):
    """Every input that changes a result is part of gc's cache key: the
    tokenizer's contents, the data's contents, the weights, an option and the code version."""
    import json

    from cse_models import GPT, GPTConfig
    from ntkscope.app import commands
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.tokenization import train_bpe

    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(tmp_path / "gpt")
    texts = [r.text for r in load_pack().records("validation")][:400]
    tok_path = tmp_path / "tokenizer.json"
    train_bpe(texts[:200], vocab_size=600).backend.save(str(tok_path))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:80]))
    from ntkscope.gc.options import GCOptions
    from ntkscope.text.sentences import Sentences

    kw = dict(sentences=Sentences(n=24, seq_len=16, tokenizer=str(tok_path)), gc=GCOptions(bins=2),
              resampling=commands.Resampling(resamples=10, null_draws=10), out=tmp_path / "out")
    first = commands.gc_command(tmp_path / "gpt", str(data), **kw)
    again = commands.gc_command(tmp_path / "gpt", str(data), **kw)
    assert again["key"] == first["key"]  # unchanged inputs: reused
    keys = {first["key"]}

    def recomputed(**changes):
        result = commands.gc_command(tmp_path / "gpt", str(data), **{**kw, **changes})
        assert result["key"] not in keys and "files" in result  # a new key, and computed (files written)
        assert json.loads((tmp_path / "out" / "result.json").read_text())["key"] == result["key"]
        keys.add(result["key"])

    train_bpe(texts[200:], vocab_size=600).backend.save(str(tok_path))  # retrained in place
    recomputed()
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[80:160]))  # other rows, same file
    recomputed()
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(tmp_path / "gpt")
    recomputed()  # new weights in place
    recomputed(gc=GCOptions(bins=3))
    recomputed(sentences=Sentences(n=24, seq_len=16, seed=1, tokenizer=str(tok_path)))
    recomputed(kernel=commands.KernelOptions(output="loss"))
    recomputed(resampling=commands.Resampling(resamples=11, null_draws=10))
    monkeypatch.setattr(commands, "__version__", "0.0.0-other")
    recomputed(resampling=commands.Resampling(resamples=11, null_draws=10))


def test_gc_refuses_what_it_would_not_honour(tmp_path, capsys):
    """--by label on data with one label and --bins 1 (GC = 1 by construction) are one
    line and exit 1; options that apply to one checkpoint given for a run directory are a usage error (exit 2)."""
    import json

    from cse_models import GPT, GPTConfig
    from ntkscope.app.cli import main
    from ntkscope.text.corpus.pack import load_pack

    from ntkscope.text.corpus.pack import DEFAULT_PACK

    model = GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16))
    for step in (0, 10):
        model.save_pretrained(tmp_path / "run" / f"step{step}")
    (tmp_path / "run" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    rows = [{"text": r.text} for r in load_pack().records("validation")[:60]]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--quiet", "gc", str(tmp_path / "run" / "step0"), "--data", str(tmp_path / "rows.jsonl"), "--by",
                 "label", "--n", "24", "--seq-len", "16"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'label' needs data whose rows carry two or more labels" in err, err
    assert main(["--quiet", "gc", str(tmp_path / "run" / "step0"), "--data", str(tmp_path / "rows.jsonl"), "--bins",
                 "1", "--n", "24", "--seq-len", "16"]) == 1  # one bin: the whole set, GC = 1 by construction
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bins must give two or more non-empty frequency bins" in err, err
    for extra in (["--by", "label"], ["--outputs", "loss,centred-true-logit"], ["--bins", "3"]):
        with pytest.raises(SystemExit) as exited:  # a usage error: exit 2, one line
            main(["--quiet", "gc", str(tmp_path / "run"), "--n", "24", *extra])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "applies to one checkpoint" in err and extra[0] in err, err


def test_a_rerun_into_the_same_out_replaces_the_whole_result(tmp_path):
    """gc, then gc --by label into one --out left the first run's figure."""
    from ntkscope.core.files import Staging

    out = tmp_path / "out"
    (out).mkdir()
    (out / "notes.txt").write_text("mine")  # the user's own file: never touched
    with Staging(out) as files:
        files.path("gc.csv").write_text("a\\n1\\n")
        files.path("gc_vs_frequency.png").write_bytes(b"png")
    with Staging(out) as files:
        files.path("gc.csv").write_text("a\\n2\\n")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["gc.csv", "notes.txt"]
    assert (out / "gc.csv").read_text() == "a\\n2\\n"


def test_demo_checks_its_out_before_the_work(monkeypatch, capsys, tmp_path):
    """Demo --out into a read-only place failed after 20 s of work."""
    import ntkscope.core.files as files
    from ntkscope.app import cli
    from ntkscope.app.cli import main

    monkeypatch.setattr(cli, "run_demo", lambda **kw: pytest.fail("the demo ran before --out was checked"))
    assert main(["--quiet", "demo", "--out", str(tmp_path / "gc.txt")]) == 1
    assert "demo: --out" in capsys.readouterr().err
    monkeypatch.setattr(files.os, "access", lambda path, mode: False)  # as a read-only directory answers
    assert main(["--quiet", "demo", "--out", str(tmp_path / "gc.csv")]) == 1
    assert "is not a writable directory" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback_and_a_user_mistake_is_one_line(tmp_path, monkeypatch, capsys):
    """One error type for the user's mistakes (UserError, a ValueError), caught alone by both
    command lines; a ValueError from a bug inside (numpy, pandas, our own code) keeps its traceback."""
    import subprocess
    import sys

    from cse_models import train as train_module
    from ntkscope.app import commands
    from ntkscope.app.cli import main
    from ntkscope.core.checks import InputError, MissingInput, UserError

    assert issubclass(InputError, UserError) and issubclass(MissingInput, FileNotFoundError)

    def buggy(*args, **kwargs):
        raise ValueError("operands could not be broadcast together with shapes (3,) (4,)")  # as numpy says it

    monkeypatch.setattr(commands, "freq_command", buggy)
    with pytest.raises(ValueError, match="could not be broadcast"):
        main(["--quiet", "freq", "--out", str(tmp_path / "f")])
    assert "this is a bug in ntkscope" in capsys.readouterr().err
    assert main(["--quiet", "gc", str(tmp_path / "nothing-here")]) == 1  # the user's mistake: one line
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err, err
    monkeypatch.setattr(train_module, "train", buggy)
    (tmp_path / "run.json").write_text('{"out_dir": "%s", "steps": 1}' % (tmp_path / "run"))
    with pytest.raises(ValueError, match="could not be broadcast"):
        train_module.main([str(tmp_path / "run.json")])
    bad = subprocess.run([sys.executable, "-m", "cse_models.train", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("cse-train: error:"), bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.fixture(scope="module")
def tiny_gc_run(tmp_path_factory):
    """A run directory of two real checkpoints (a short training) and a labelled table."""
    import json

    from cse_models.train import TrainConfig, train
    from ntkscope.text.corpus.pack import load_pack

    root = tmp_path_factory.mktemp("gc-run")
    train(TrainConfig.from_dict({"out_dir": str(root / "run"), "model": {"n_layer": 1, "n_embd": 16, "n_head": 2},
                                 "data": {"seq_len": 16, "split": "validation"}, "steps": 4, "batch_size": 4,
                                 "checkpoint_every": 2, "log_every": 2, "warmup_steps": 1}))
    rows = [{"text": r.text, "domain": r.domain} for r in load_pack().records("validation")[:120]]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    legal = [r.text for r in load_pack().records("train") if r.domain == "legal"][:400]  # another reference
    (root / "other.txt").write_text("\n".join(legal) + "\n")
    return root


def test_every_gc_option_is_honoured_for_a_run_or_refused_with_exit_2(tiny_gc_run, capsys):
    """Each option the gc parser accepts, given for a run directory, either changes what is
    computed (the run's result records it, and the result differs from the default run's) or is a
    usage error (exit 2). An option added to the parser fails here until it is placed."""
    import json

    from ntkscope.app.cli import build_parser, main
    from ntkscope.text.corpus.pack import DEFAULT_PACK

    run, rows = tiny_gc_run / "run", str(tiny_gc_run / "rows.jsonl")
    base = ["--quiet", "gc", str(run), "--data", rows, "--n", "24", "--seq-len", "16", "--resamples", "4",
            "--null-draws", "4"]
    honoured = {  # option -> (its value, what the result shows)
        "--data": None, "--n": None, "--seq-len": None, "--resamples": None, "--null-draws": None,  # in base
        "--out": None,
        "--frequency-from": (["--frequency-from", str(tiny_gc_run / "other.txt")],
                             lambda r: r["options"]["frequency_from"].endswith("other.txt")),
        "--text-column": (["--text-column", "text"], lambda r: r["data"]),
        "--format": (["--format", "jsonl"], lambda r: r["options"]["data_format"] == "jsonl"),
        "--label-column": (["--label-column", "domain", "--homogeneous-label", "general"],
                           lambda r: r["options"]["gc"]["homogeneous_label"] == "general"),
        "--homogeneous-label": None,  # with --label-column above
        "--tokenizer": (["--tokenizer", str(DEFAULT_PACK / "tokenizer.json")], lambda r: True),
        "--params": (["--params", "transformer.h.0.*"], lambda r: r["options"]["kernel"]["params"] == ["transformer.h.0.*"]),
        "--output": (["--output", "loss"], lambda r: r["options"]["kernel"]["output"] == "loss"),
        "--method": (["--method", "exact"], lambda r: r["options"]["kernel"]["method"] == "exact"),
        "--dtype": (["--dtype", "float64"], lambda r: r["options"]["kernel"]["dtype"] == "float64"),
        "--device": (["--device", "cpu"], lambda r: r["options"]["kernel"]["device"] == "cpu"),
        "--max-memory": (["--max-memory", "2"], lambda r: r["options"]["kernel"]["max_memory"] == 2 * 2 ** 30),
        "--seed": (["--seed", "3"], lambda r: r["options"]["sentences"]["seed"] == r["options"]["kernel"]["seed"] == 3),
        "--confidence": (["--confidence", "0.8"], lambda r: r["options"]["resampling"]["confidence"] == 0.8),
        "--interval": (["--interval", "basic"], lambda r: r["options"]["resampling"]["interval"] == "basic"),
        "--tail-fraction": (["--tail-fraction", "0.5"], lambda r: r["n_tail"] == 12),
        "--cache-dir": (["--cache-dir", str(tiny_gc_run / "cache")], lambda r: (tiny_gc_run / "cache").is_dir()),
    }
    refused = {"--by": ["--by", "label"], "--outputs": ["--outputs", "loss,true-logit"], "--bins": ["--bins", "3"],
               "--binning": ["--binning", "width"], "--min-count": ["--min-count", "2"], "--tokens": ["--tokens", "3"]}
    options = {s for a in build_parser()._subparsers._group_actions[0].choices["gc"]._actions
               for s in a.option_strings if s.startswith("--") and s not in ("--help", "--pack")}
    assert options == set(honoured) | set(refused), sorted(options ^ (set(honoured) | set(refused)))
    out = tiny_gc_run / "out"
    assert main(base + ["--out", str(out)]) == 0
    default = json.loads((out / "result.json").read_text())
    for option, spec in honoured.items():
        if spec is None:
            continue
        extra, shows = spec
        assert main(base + extra + ["--out", str(out)]) == 0, option
        result = json.loads((out / "result.json").read_text())
        assert shows(result), (option, result["options"])
        # the same computation by design (the defaults spelled out); --frequency-from rescores the sentences
        # (tests/test_inputs.py) but here leaves the same lowest third
        if option not in ("--text-column", "--tokenizer", "--device", "--cache-dir", "--max-memory",
                          "--frequency-from", "--format"):
            assert result["series"] != default["series"] or result["n_tail"] != default["n_tail"], option
    for option, extra in refused.items():
        with pytest.raises(SystemExit) as exited:
            main(base + extra)
        assert exited.value.code == 2, option
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "applies to one checkpoint" in err, (option, err)


def test_every_command_that_writes_to_out_says_how_it_is_held():
    """Each command declares its --out beside its parser (parsing.add_out): the command line's
    lock on a file or a directory, or the command's own. One without it would skip the lock
    silently, so every (sub)command with --out is found here and must say which."""
    import argparse

    from ntkscope.app.cli import build_parser
    from ntkscope.app.parsing import OUT_KINDS

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])
        yield path, parser

    with_out = {" ".join(path): parser.get_default("out_kind") for path, parser in walk(build_parser(), [])
                if "--out" in parser._option_string_actions}
    assert len(with_out) >= 12 and all(kind in OUT_KINDS for kind in with_out.values()), with_out
    assert with_out["gc"] == "dir" and with_out["plan"] == "file" and with_out["compare"] == "own"
