"""The import direction (docs/architecture.md) is a contract, checked by import-linter."""

import ast
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


# ---- names and imports between modules ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ntkscope", "cse_models")


def _modules():
    """(module name, path, parsed tree) of every module of the packages and the docs' claims tooling."""
    for base, tops in ((ROOT, PACKAGES), (ROOT / "scripts", ("doc_claims",))):
        for top in tops:
            for path in sorted((base / top).rglob("*.py")):
                parts = path.relative_to(base).with_suffix("").parts
                yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path, ast.parse(path.read_text())


def _imports(tree):
    """(node, inside a function) for every `from X import ...` of the project's modules."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (*PACKAGES, "doc_claims"):
            yield node, id(node) in inside


def test_no_module_takes_another_modules_private_names():
    found = [f"{path.relative_to(ROOT)}:{node.lineno} takes {a.name} from {node.module}"
             for name, path, tree in _modules() for node, _ in _imports(tree)
             for a in node.names if a.name.startswith("_") and not a.name.startswith("__") and node.module != name]
    assert not found, "a name another module needs is public where it lives:\n" + "\n".join(found)


def test_imports_sit_at_the_top_and_make_no_cycle():
    """The project's own imports are all at module level (so the graph below is the whole story),
    an import inside a function (a third-party one) says why on its line, and no module reaches
    itself through its imports."""
    inner = [f"{path.relative_to(ROOT)}:{node.lineno}" for _, path, tree in _modules() for node, inside in
             _imports(tree) if inside]
    assert not inner, f"project imports inside functions: {inner}"
    silent = []
    for _, path, tree in _modules():
        lines = path.read_text().splitlines()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                silent += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(fn)
                           if isinstance(n, (ast.Import, ast.ImportFrom)) and "#" not in lines[n.lineno - 1]]
    assert not silent, f"imports inside functions without a comment saying why: {sorted(set(silent))}"
    modules = {name for name, _, _ in _modules()}
    graph = {}
    for name, _, tree in _modules():
        edges = set()
        for node, _ in _imports(tree):  # `from pkg import submodule` needs the submodule; a name, its module
            edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
        graph[name] = edges & modules - {name}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_a_users_error_is_raised_one_way():
    """A mistake in what the user gave is a UserError (core/checks.py: InputError through `fail` or
    an `@entry`, SpecError for a spec, MissingInput, OutputExists, MissingPackage, or UserError's
    own one line), never a bare ValueError: both command lines print a UserError as one line and
    keep the traceback of anything else, a bug."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for name, path, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
             and getattr(node.exc.func, "id", None) == "ValueError"]
    assert not found, found
