"""The ntkscope command as a user runs it."""

import subprocess
import sys

import pandas as pd


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ntkscope.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_runs_and_writes_its_table(tmp_path):
    out = tmp_path / "gc.csv"
    proc = _run("--quiet", "demo", "--steps", "30", "--n", "40", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "gradient consistency of each group" in proc.stdout
    table = pd.read_csv(out)
    assert set(table["by"]) == {"domain", "frequency bin"}
    assert table["score"].between(-1, 1).all()
    assert table.loc[table.by == "domain", "n_subset"].sum() == 40


def test_user_error_is_one_line_and_exit_code_1():
    proc = _run("--quiet", "demo", "--steps", "1", "--n", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("ntkscope demo: error: gradient_consistency_groups: labels has no group")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_usage_error_is_exit_code_2():
    assert _run("frobnicate").returncode == 2
    assert _run("demo", "--method", "fast").returncode == 2
