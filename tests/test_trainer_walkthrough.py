"""The README's Trainer walkthrough (examples/trainer_cse.py) runs as written, at toy size: a
GPT-NeoX trained with transformers' Trainer, converted to CSE by SparseCallback at the warm-up,
saved, read back by AutoModelForCausalLM, asked to generate, and reported on."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_the_trainer_walkthrough_runs(tmp_path):
    path = Path(__file__).resolve().parents[1] / "examples" / "trainer_cse.py"
    spec = importlib.util.spec_from_file_location("trainer_cse", path)
    walkthrough = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walkthrough)
    out = walkthrough.main(["--out", str(tmp_path / "run"), "--steps", "12", "--convert-at", "6", "--layers", "0", "1",
                            "--n-layer", "2", "--width", "32", "--seq-len", "32", "--test-per-domain", "10"])
    assert out["converted_at"] == 6 and out["generated"].startswith("The licence")
    assert (tmp_path / "run" / "checkpoint-12" / "cse_sparse.json").is_file()
    assert (tmp_path / "run" / "cse" / "config.json").is_file() and (tmp_path / "run" / "findings.txt").read_text()
    assert set(out["report"].layers["layer"]) == {"layer 0 (mlp)", "layer 1 (mlp)"}
