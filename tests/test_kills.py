"""Killed with SIGKILL mid-run, then run again: nothing partial is left, finished work is
reused, and the results equal an uninterrupted run's."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from commandline import in_process

from cse_models.train import TrainConfig, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ntkscope", "-q", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.set_default_dtype(torch.float32)
    root = tmp_path_factory.mktemp("kills")
    spec = {"out_dir": str(root / "run"), "model": {"n_layer": 2, "n_embd": 32, "n_head": 2},
            "data": {"seq_len": 24, "split": "validation"}, "steps": 12, "batch_size": 8, "checkpoint_every": 2,
            "log_every": 2, "warmup_steps": 2}
    train(TrainConfig.from_dict(spec))
    return root / "run"


def test_a_killed_gc_over_a_run_leaves_nothing_partial_and_reuses_finished_checkpoints(run_dir, tmp_path):
    out = tmp_path / "gc"
    cache = run_dir / "analysis"
    proc = _start("gc", run_dir, "--n", 96, "--seq-len", 24, "--out", out)
    _kill_when(proc, lambda: len(list(cache.glob("step-*.json"))) >= 2)
    finished = {p.name: p.stat().st_mtime_ns for p in cache.glob("step-*.json")}
    assert 2 <= len(finished) < 6 and not out.exists()  # no result directory, not even an empty one
    for p in cache.glob("step-*.json"):  # every cached file is whole: JSON that parses
        assert json.loads(p.read_text())
    again = in_process("gc", run_dir, "--n", 96, "--seq-len", 24, "--out", out)  # resumed: same main(), this process
    assert again.returncode == 0, again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("step-*.json") if p.name in finished} == finished
    assert len(json.loads((out / "result.json").read_text())["series"]) == 6
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".")]  # a killed write's temporary is gone


def _hashes(run: Path) -> dict:
    manifest = json.loads((run / "manifest.json").read_text())
    return {k: v for k, v in manifest["files"].items()}


@pytest.mark.slow
def test_a_killed_reproduction_resumes_to_the_same_tables_and_figures(tmp_path):
    whole = subprocess.run([sys.executable, "-m", "ntkscope", "-q", "reproduce", "--smoke", "--out",
                            str(tmp_path / "whole")], capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr
    run = tmp_path / "killed"
    # first kill: while the dense GPT trains; second: during the analyses, after some tables exist
    _kill_when(_start("reproduce", "--smoke", "--out", run),
               lambda: (run / "models" / "gpt-dense" / "metrics.jsonl").is_file())
    _kill_when(_start("reproduce", "--smoke", "--out", run), lambda: len(list((run / "tables").glob("*.csv"))) >= 3)
    again = subprocess.run([sys.executable, "-m", "ntkscope", "-q", "reproduce", "--smoke", "--out", str(run)],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr
    assert _hashes(run) == _hashes(tmp_path / "whole")
    assert not list(run.rglob(".*.tmp-*")) and not list(run.rglob("*.partial"))
