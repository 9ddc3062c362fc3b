"""Property test of the commands that train, evaluate and report: random option values,
damaged inputs and reruns with changed options through ``compare``, ``eval``, ``report``, ``plan``
and ``cse-train`` configs. Every outcome is a success, one line with exit 1, or a usage error
(exit 2); never a traceback, and a rerun that changes what was asked never mixes two requests.
20 examples in CI; ``NTKSCOPE_PROPERTY_EXAMPLES=300`` locally."""

import contextlib
import io
import json
import os
import shutil

import pytest
import torch
from commandline import in_process, write_domain_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cse_models.train import TrainConfig, main as cse_train, train
from ntkscope.text.corpus.pack import DEFAULT_PACK

transformers = pytest.importorskip("transformers")
EXAMPLES = int(os.environ.get("NTKSCOPE_PROPERTY_EXAMPLES", 20))
GARBAGE = st.one_of(st.sampled_from([b"", b"{", b"[1, 2]\n", b"\x00\xff\x10 not text", b'{"text": 3}\n',
                                     b"text,domain\n"]), st.binary(max_size=200))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny GPT-NeoX with the pack's tokenizer, JSONL train/test rows with a domain, a tiny
    cse_models run of 3 checkpoints, and a finished gc result to report on."""
    root = tmp_path_factory.mktemp("props")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(vocab_size=8192, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64, rotary_pct=0.25,
                                        bos_token_id=0, eos_token_id=0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(root / "neox")
    (root / "neox" / "tokenizer.json").write_bytes((DEFAULT_PACK / "tokenizer.json").read_bytes())
    write_domain_rows(root, {"train": 40, "test": 8})
    train(TrainConfig.from_dict({"out_dir": str(root / "run"), "model": {"n_layer": 2, "n_embd": 16, "n_head": 2},
                                 "data": {"seq_len": 16, "split": "validation"}, "steps": 3, "batch_size": 4,
                                 "checkpoint_every": 1, "warmup_steps": 1, "tensorboard": False, "device": "cpu"}))
    proc = in_process("gc", root / "run" / "checkpoints" / "step-000003", "--n", 16, "--seq-len", 16, "--bins", 2,
                      "--resamples", 4, "--null-draws", 4, "--out", root / "gc")
    assert proc.returncode == 0, proc.stderr
    torch.set_default_dtype(previous)
    return root


def _outcome(code, err: str) -> None:
    """Success, one error line and exit 1, or a usage error: never a traceback."""
    assert code in (0, 1, 2), err[-2000:]
    assert "Traceback" not in err and "this is a bug" not in err, err[-2000:]
    if code == 1:
        assert len([line for line in err.strip().splitlines() if "error:" in line]) == 1, err[-2000:]
        assert "error:" in err.strip().splitlines()[-1], err[-2000:]


def _options(draw, valid: dict, bad: dict) -> list:
    """``valid`` options with at most one of them (drawn, or none in half the examples) replaced by a
    value drawn from ``bad[name]``: every option's bad values are reached, and whole runs are common."""
    broken = draw(st.sampled_from([None] * len(bad) + sorted(bad)))  # half the examples run whole
    chosen = {**valid, **({broken: draw(bad[broken])} if broken else {})}
    return [str(part) for name, value in chosen.items() for part in ((name, value) if value is not None else ())]


def _damaged(folder, data: bytes) -> str:
    path = folder / "damaged.jsonl"
    path.write_bytes(data)
    return str(path)


def _run_compare(world, folder, draw):
    options = _options(draw, {"--train-data": world / "train.jsonl", "--data": world / "test.jsonl",
                              "--label-column": "domain", "--layers": "1", "--steps": "1", "--batch-size": "4",
                              "--seq-len": "16", "--min-cluster-size": "3", "--lr": "0.001"},
                       {"--train-data": GARBAGE.map(lambda b: _damaged(folder, b)),
                        "--data": GARBAGE.map(lambda b: _damaged(folder, b)),
                        "--label-column": st.sampled_from(["nope", "text"]),
                        "--layers": st.sampled_from(["7", "x", "0,0", "-1"]),
                        "--steps": st.sampled_from(["0", "-3", "1.5"]), "--batch-size": st.sampled_from(["0", "x"]),
                        "--seq-len": st.sampled_from(["0", "100000"]), "--min-cluster-size": st.sampled_from(["1"]),
                        "--lr": st.sampled_from(["-1", "nan", "inf", "0"])})
    args = [world / "neox", *options, "--out", folder / "cmp"]
    first = in_process("compare", *args)
    _outcome(first.returncode, first.stderr)
    if first.returncode == 0:  # a rerun with another lr is refused, and the first result stays as it was
        before = (folder / "cmp" / "tables" / "comparison.csv").read_bytes()
        again = in_process("compare", *args, "--lr", "0.01")
        assert again.returncode == 1 and "lr" in again.stderr, again.stderr
        assert (folder / "cmp" / "tables" / "comparison.csv").read_bytes() == before
    else:
        assert not (folder / "cmp").exists(), first.stderr  # a refused comparison leaves nothing behind
    return first.returncode


def _run_eval(world, folder, draw):
    options = _options(draw, {"--data": world / "test.jsonl", "--label-column": "domain", "--n-boot": "10",
                              "--batch-size": "4"},
                       {"--data": GARBAGE.map(lambda b: _damaged(folder, b)),
                        "--label-column": st.sampled_from(["nope", "text"]),
                        "--n-boot": st.sampled_from(["0", "x", "-2"]), "--batch-size": st.sampled_from(["0", "x"])})
    checkpoint = draw(st.sampled_from([world / "neox", world / "neox", world / "missing", world / "test.jsonl"]))
    proc = in_process("eval", checkpoint, *options, "--out", folder / "eval")
    _outcome(proc.returncode, proc.stderr)
    return proc.returncode


def _run_report(world, folder, draw):
    target = folder / "result"
    shutil.copytree(world / "gc", target)
    name = draw(st.sampled_from([None, "result.json", "gc.csv"]))
    if name is not None:
        (target / name).write_bytes(draw(GARBAGE))
    proc = in_process("report", draw(st.sampled_from([target, target, folder / "missing", world / "test.jsonl"])),
                      "--out", folder / draw(st.sampled_from(["r.html", "r.html", "r.txt"])))
    _outcome(proc.returncode, proc.stderr)
    return proc.returncode


def _run_plan(world, folder, draw):
    options = _options(draw, {"--n": "16", "--seq-len": "16", "--top-k": "1", "--k-max": "3",
                              "--tail-fraction": "0.3", "--overlap": "0.8",
                              "--choose-by": draw(st.sampled_from(["structure", "labels"])),
                              "--data": world / "test.jsonl", "--label-column": "domain"},
                       {"--n": st.sampled_from(["0", "x"]), "--top-k": st.sampled_from(["5", "0"]),
                        "--k-max": st.sampled_from(["0", "1"]),
                        "--tail-fraction": st.sampled_from(["-0.5", "2", "0", "1", "x"]),
                        "--overlap": st.sampled_from(["7", "0", "-1"]),
                        "--data": GARBAGE.map(lambda b: _damaged(folder, b)),
                        "--label-column": st.sampled_from(["nope"])})
    proc = in_process("plan", world / "run", *options, "--out", folder / "plan.json")
    _outcome(proc.returncode, proc.stderr)
    return proc.returncode


def _cse_train(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cse_train([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def _run_cse_train(world, folder, draw):
    valid = {"steps": 2, "batch_size": 4, "lr": 1e-3, "n_embd": 16, "seq_len": 16, "device": "cpu",
             "text_files": None}
    bad = {"steps": st.sampled_from([0, 2.5, "x", -1]), "batch_size": st.sampled_from([0, 100000, True]),
           "lr": st.sampled_from([-1, 1e6, "inf"]), "n_embd": st.sampled_from([15, 0, "16"]),
           "seq_len": st.sampled_from([0, "16", 100000]), "device": st.sampled_from(["banana", "cuda:7"]),
           "text_files": st.sampled_from([[str(world / "test.jsonl")], 3, {"x": []}, "a.txt"])}
    broken = draw(st.sampled_from([None] * len(bad) + sorted(bad)))
    v = {**valid, **({broken: draw(bad[broken])} if broken else {})}
    data = {"table": str(world / "train.jsonl"), "label_column": "domain", "seq_len": v["seq_len"],
            "tokenizer": str(DEFAULT_PACK / "tokenizer.json")}
    if v["text_files"] is not None:
        data = {"text_files": v["text_files"], "seq_len": v["seq_len"], "tokenizer": data["tokenizer"]}
    spec = {"out_dir": str(folder / "run"), "data": data, "model": {"n_layer": 1, "n_head": 2, "n_embd": v["n_embd"]},
            "steps": v["steps"], "batch_size": v["batch_size"], "lr": v["lr"], "checkpoint_every": 1,
            "warmup_steps": 1, "tensorboard": False, "device": v["device"]}
    path = folder / "run.json"
    path.write_text(json.dumps(spec))
    code, err = _cse_train([path])
    _outcome(code, err)
    if code == 0:  # a rerun with another lr is refused; the record still describes the weights
        path.write_text(json.dumps({**spec, "lr": 0.02}))
        again, err = _cse_train([path])
        assert again == 1 and "lr" in err, err
        assert json.loads((folder / "run" / "train_config.json").read_text())["lr"] == spec["lr"]
    return code


RUNNERS = {"compare": _run_compare, "eval": _run_eval, "report": _run_report, "plan": _run_plan,
           "cse-train": _run_cse_train}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(RUNNERS)), data=st.data())
def test_commands_never_show_a_traceback_nor_mix_two_requests(world, tmp_path_factory, command, data):
    torch.set_default_dtype(torch.float32)
    folder = tmp_path_factory.mktemp("example")
    code = RUNNERS[command](world, folder, data.draw)
    OUTCOMES.setdefault(command, []).append(code)


OUTCOMES: dict = {}  # command -> exit codes seen (printed by the next test, for the closing note)


def test_the_examples_reached_successes_and_refusals(capsys):
    """After the property test: every command ran to a success and to a refusal at least once when
    there were enough examples (hypothesis draws the commands evenly)."""
    with capsys.disabled():
        print("\nexit codes per command:", {c: {k: codes.count(k) for k in sorted(set(codes))}
                                             for c, codes in sorted(OUTCOMES.items())})
    if sum(map(len, OUTCOMES.values())) >= 100:
        for command, codes in OUTCOMES.items():
            assert 0 in codes and (1 in codes or 2 in codes), (command, codes)

