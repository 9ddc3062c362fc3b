"""The import direction (docs/architecture.md) is a contract, checked by import-linter."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="pip install import-linter (the dev extra)")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # lint-imports reads .importlinter in the working directory and imports the packages from there
    return subprocess.run([LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_imports_go_one_way():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def _copy(tmp_path: Path) -> Path:
    for name in ("ntkscope", "cse_models"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("data", "__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


@pytest.mark.parametrize("module, forbidden", [
    ("ntkscope/kernel/eigen.py", "from ntkscope.runs.checkpoints import load_checkpoint"),  # kernel -> runs
    ("cse_models/model.py", "from ntkscope.reproduction import reproduce"),  # cse_models -> the reproduction
    ("ntkscope/core/lm.py", "import ntkscope.text.frequency"),  # the core -> text
    ("ntkscope/kernel/ntk.py", "from ntkscope.representation.clusters import ElbowKMeans"),  # sibling stages
    ("ntkscope/kernel/structured_layout.py", "from ntkscope.kernel.structured import FactorPlan"),  # the old cycle
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, forbidden):
    copy = _copy(tmp_path)
    path = copy / module
    path.write_text(path.read_text() + f"\n{forbidden}  # planted by the test\n")
    proc = _lint(copy)
    assert proc.returncode == 1, proc.stdout
    assert "BROKEN" in proc.stdout and "1 broken" in proc.stdout
