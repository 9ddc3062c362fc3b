"""Bad input to the experiment runner and the data readers: arm names that collide after expansion,
deleted results, stale folders, spec values, damaged unit records and results, Trainer checkpoints,
endless pipes and SIGTERM, tokenizers that cannot encode, mixed label types."""

import json
import logging
from pathlib import Path

import pytest

from ntkscope.experiments import parse_spec
from ntkscope.experiments.spec import SpecError
from ntkscope.experiments.units import Unit, is_done, read_state, write_state

TOY = {"name": "toy", "kind": "sweep", "preset": "smoke", "seeds": [0, 1],
       "settings": {"steps": 60, "checkpoint_every": 10},
       "trunk": {"layers": [0, 1], "gc_peak_step": 10},
       "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [20, 40]}],
       "criteria": {"arms": ["cse-at20"]}}


def _spec(**changes):
    data = json.loads(json.dumps(TOY))
    for key, value in changes.items():
        if key == "arm":
            data["arms"].append(value)
        elif isinstance(value, dict):
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("changes, message", [
    ({"arm": {"name": "cse-at20", "kind": "cse", "convert_at": 30}},
     r"arms must have distinct names once an arm of several steps becomes one arm per step .*cse-at20"),
    ({"arm": {"name": "plan", "kind": "cse", "convert_at": 30}}, r"arms must not name an arm 'plan'"),
    ({"arm": {"name": "more", "kind": "cse", "convert_at": 30, "seeds": [0, 0]}}, r"arms \(more\)\.seeds must not repeat"),
    ({"seeds": [2**32]}, r"seeds must be in \[0, \d+\] \(got \[4294967296\]\)"),
    ({"settings": {"lr": float("inf")}}, r"settings\.lr must be a finite number \(got Infinity\)"),
    ({"settings": {"batch_size": 0}}, r"settings\.batch_size must be above 0 \(got 0\)"),
    ({"settings": {"lr": 0.0}}, r"settings\.lr must be above 0"),
    ({"settings": {"model": {"n_layer": 2, "n_head": 0, "n_embd": 32}}}, r"settings\.model\.n_head must be a positive"),
    ({"trunk": {"layers": [0, 0]}}, r"trunk\.layers must not repeat a layer \(got \[0, 0\]\)"),
    ({"arm": {"name": "x", "kind": "cse", "convert_at": 30, "layers": [1, 1]}}, r"arms\[2\] \(x\)\.layers must not repeat"),
    ({"criteria": {"arms": ["nope"]}}, r"criteria must name arms of the spec .* \(got \[\"nope\"\]\)"),
])
def test_a_spec_that_passed_the_check_is_refused_whole(changes, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(_spec(**changes))


def test_a_deleted_result_makes_its_unit_run_again(tmp_path):
    from ntkscope.experiments.runner import status

    unit = Unit("cse-at20-seed0", 0, {"kind": "arm"}, (), key="k1")
    write_state(tmp_path, unit.name, {"name": unit.name, "key": "k1", "status": "done",
                                      "result": "results/cse-at20-seed0.json"})
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "cse-at20-seed0.json").write_text("{}")
    assert is_done(read_state(tmp_path, unit.name), unit, tmp_path)
    (tmp_path / "results" / "cse-at20-seed0.json").unlink()
    assert not is_done(read_state(tmp_path, unit.name), unit, tmp_path)
    (tmp_path / "experiment.json").write_text(json.dumps({"units": [
        {"name": unit.name, "seed": 0, "what": {"kind": "arm"}, "needs": [], "key": "k1"}]}))
    assert status(tmp_path)["state"].tolist() == ["result missing"]


def test_moving_aside_twice_makes_a_new_folder_each_time(tmp_path):
    from ntkscope.experiments.runner import move_aside
    spec = parse_spec(_spec())
    unit = Unit("cse-at20-seed0", 0, {"kind": "arm", "name": "cse-at20"}, (), key="new")
    model = tmp_path / "models" / "cse-at20-seed0"
    for turn in (1, 2):  # s1, s2, s1, s2: the same old key twice
        model.mkdir(parents=True)
        (model / "weights.txt").write_text(f"turn {turn}")
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / "cse-at20-seed0.json").write_text(json.dumps({"turn": turn}))
        move_aside(spec, tmp_path, unit, "old")
    first, second = tmp_path / "stale" / "cse-at20-seed0-old", tmp_path / "stale" / "cse-at20-seed0-old-2"
    assert (first / "cse-at20-seed0" / "weights.txt").read_text() == "turn 1"
    assert (second / "cse-at20-seed0" / "weights.txt").read_text() == "turn 2"
    assert json.loads((first / "cse-at20-seed0.json").read_text()) == {"turn": 1}
    assert not (first / "cse-at20-seed0" / "cse-at20-seed0").exists()  # never nested in itself


@pytest.mark.parametrize("text", ['{"name": "x", "attempts": "x", "status": "failed", "key": "k"}', "{", "[1, 2]",
                                  '{"status": 3}'])
def test_a_damaged_unit_record_counts_as_none_with_a_warning(tmp_path, caplog, text):
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "cse-at20-seed0.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert read_state(tmp_path, "cse-at20-seed0") is None
    assert "cse-at20-seed0.json" in caplog.text and "runs again" in caplog.text


@pytest.mark.parametrize("result", [{"blocks": "x"}, {"arm": "cse", "seed": 0, "blocks": {"loss": [1.0], "tokens": []}},
                                    {"arm": "cse", "seed": 0, "blocks": {"loss": ["a"], "tokens": [3]}}, [1]])
def test_a_foreign_result_is_one_line_naming_it(tmp_path, result):
    from ntkscope.core.checks import UserError
    from ntkscope.reproduction.map_tables import read_results

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "cse-seed0.json").write_text(json.dumps(result))
    with pytest.raises(UserError, match=r"experiment map: .*cse-seed0\.json (is not a unit's result|must hold a JSON)"):
        read_results(tmp_path)


def _trainer_checkpoint(root, name, state):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    folder = root / name
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    (folder / "trainer_state.json").write_text(state)
    return folder


@pytest.mark.parametrize("states, message", [
    (['{"global_step": 4}', '{"global_step": 4}'],
     r"list_checkpoints: .* holds 2 checkpoints of step 4 \(checkpoint-2, checkpoint-4, by their trainer_state"),
    (['{"global_step": 1e400}', '{"global_step": 4}'], r"checkpoint-2/trainer_state\.json: global_step must be a step"),
    (['{"global_step": "2"}', '{"global_step": 4}'], r"global_step must be a step, an integer >= 0 \(got '2'\)"),
])
def test_trainer_checkpoints_of_one_step_or_no_step_are_one_line(tmp_path, states, message):
    from ntkscope.core.checks import UserError
    from ntkscope.runs.checkpoints import list_checkpoints

    for name, state in zip(("checkpoint-2", "checkpoint-4"), states):
        _trainer_checkpoint(tmp_path, name, state)
    with pytest.raises(UserError, match=message):
        list_checkpoints(tmp_path)


def test_trainer_checkpoints_renamed_by_hand_keep_their_real_steps(tmp_path):
    from ntkscope.runs.checkpoints import list_checkpoints

    _trainer_checkpoint(tmp_path, "checkpoint-2", '{"global_step": 6}')
    _trainer_checkpoint(tmp_path, "checkpoint-4", "not json")  # unreadable: the name says the step
    assert [(s, p.name) for s, p in list_checkpoints(tmp_path)] == [(4, "checkpoint-4"), (6, "checkpoint-2")]


def test_an_endless_pipe_is_bounded_and_its_copy_deleted(tmp_path, monkeypatch):
    from ntkscope.core.checks import UserError
    from ntkscope.text import inputs

    monkeypatch.setenv("NTKSCOPE_MAX_PIPE_GIB", "0.002")
    monkeypatch.setattr(inputs.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UserError, match=r"/dev/zero gave more than 0\.002 GiB, the most a pipe is read into a "
                                        r"temporary file \(raise NTKSCOPE_MAX_PIPE_GIB\); a pipe without end\?"):
        inputs._spooled(Path("/dev/zero"))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("NTKSCOPE_MAX_PIPE_GIB", "-1")
    with pytest.raises(UserError, match=r"NTKSCOPE_MAX_PIPE_GIB must be a positive number of GiB \(got '-1'\)"):
        inputs.pipe_limit()


def test_sigterm_while_a_pipe_is_read_leaves_no_copy_and_no_lock(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "ntkscope", "freq", "/dev/zero", "--out", str(tmp_path / "out")],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("ntkscope-data-*/zero")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # copying
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "ntkscope freq: terminated; no partial results were written" in err
    assert list(tmp_path.iterdir()) == []  # no staged copy, no lock, no output


@pytest.mark.parametrize("where", ["afile/sub", "/proc/x"])
def test_an_experiment_output_that_cannot_be_made_is_one_line(tmp_path, where, monkeypatch):
    from commandline import in_process

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    spec = tmp_path / "toy.toml"
    import tomli_w

    spec.write_text(tomli_w.dumps(TOY))
    proc = in_process("experiment", "run", spec, "--out", where, "--executor", "inline")
    assert proc.returncode == 1 and f"--out {where} cannot be created" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_spec_that_is_not_utf8_is_one_line(tmp_path):
    from ntkscope.core.checks import UserError
    from ntkscope.experiments import load_spec

    path = tmp_path / "bad.toml"
    path.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(UserError, match=r"load_spec: .*bad\.toml is not UTF-8 text \(byte 8: invalid start byte\)"):
        load_spec(path)


def test_compare_with_a_negative_seed_is_refused_before_anything_is_written(tmp_path):
    from commandline import in_process

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a line"}\n')
    proc = in_process("compare", tmp_path / "model", "--train-data", rows, "--data", rows, "--layers", "0",
                      "--seeds=-1", "--out", tmp_path / "out")
    assert proc.returncode == 1 and "seeds must list distinct integers in [0, 2^31 - 1] (got [-1])" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_whose_pattern_fails_or_panics_is_one_line(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from ntkscope.core.checks import UserError
    from ntkscope.runs.encoder import shipped_encoder
    from ntkscope.text import tokenization

    data = json.loads((shipped_encoder() / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a"}, "behavior": "Isolated", "invert": False}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"load_tokenizer: .*tokenizer\.json is not a tokenizers JSON file that can "
                                        r"encode text \(Oniguruma error"):
        tokenization.load_tokenizer(tmp_path)

    class PanicException(BaseException):  # what pyo3 raises when Rust panics (not an Exception)
        pass

    def panics(self, text, *args, **kwargs):
        raise PanicException("regex: retry limit in match over")

    good = tmp_path / "good"
    good.mkdir()
    (good / "tokenizer.json").write_text((shipped_encoder() / "tokenizer.json").read_text())
    monkeypatch.setattr(Tokenizer, "encode", panics, raising=False)
    with pytest.raises(UserError, match=r"that can encode text \(regex: retry limit in match over\)"):
        tokenization.load_tokenizer(good)


def test_a_label_column_of_mixed_types_is_said(tmp_path, caplog):
    from ntkscope.text.inputs import DataSource

    path = tmp_path / "rows.jsonl"
    labels = [1, "1", 1.0, True, "legal"]
    path.write_text("".join(json.dumps({"text": f"sentence number {i} of the user's rows", "label": v}) + "\n"
                            for i, v in enumerate(labels * 3)))
    with caplog.at_level(logging.WARNING):
        rows = DataSource(path, label_column="label").rows()
    assert len(rows) == 15
    assert "column 'label' mixes labels of types" in caplog.text and "are one label" in caplog.text
    caplog.clear()
    path.write_text("".join(json.dumps({"text": f"sentence number {i}", "label": v}) + "\n"
                            for i, v in enumerate(["a", "b"] * 3)))
    with caplog.at_level(logging.WARNING):
        DataSource(path, label_column="label").rows()
    assert "mixes labels" not in caplog.text
