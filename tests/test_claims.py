"""Numbers quoted in README.md and docs/ about the committed runs are the numbers in their tables,
and every JSON file the project writes or commits is strict RFC 8259 JSON."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from commandline import strict_json_load

from ntkscope.core.files import strict_json, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the claims machinery is documentation tooling, not a package module
from doc_claims.claims import MARKER, claims, main, mismatches, render  # noqa: E402

QUOTING = [ROOT / "README.md", ROOT / "benchmarks/README.md", ROOT / "figures/sweep/README.md",
           *sorted((ROOT / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def values():
    return claims(ROOT)


def test_every_quoted_number_is_its_tables(values):
    found = 0
    for path in QUOTING:
        text = path.read_text()
        found += len(MARKER.findall(text))
        assert mismatches(text, values) == [], f"{path.name}: quoted (claim, text, table) differ; run " \
                                               "python scripts/render_claims.py README.md docs/*.md"
    assert found >= 40


def test_a_table_that_changes_is_caught(values, tmp_path):
    for folder in ("figures/tail", "figures/tables", "figures/tables-late", "figures/sweep", "figures/own-model",
                   "figures/warmup-map/fresh/experts"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("*.png", "*.pdf", "*.npz"))
    (tmp_path / "docs").mkdir()
    for name in ("router-table.csv", "gc-outputs-quick.csv"):
        shutil.copy(ROOT / "docs" / name, tmp_path / "docs")
    (tmp_path / "benchmarks").mkdir()
    for name in ("training_step.csv", "gpu_gc.csv", "tracker.csv", "budget.csv", "structured_p1.csv", "p7.csv"):
        shutil.copy(ROOT / "benchmarks" / name, tmp_path / "benchmarks")
    table = pd.read_csv(tmp_path / "figures/tail/tables/gc_by_bin.csv")
    first = table["left"].idxmin()
    table.loc[first, "abs_gc"] += 0.01
    table.to_csv(tmp_path / "figures/tail/tables/gc_by_bin.csv", index=False)
    changed = claims(tmp_path)
    text = (ROOT / "docs" / "figures.md").read_text()  # the guide that quotes Figure 2a
    assert [m[0] for m in mismatches(text, changed)] and "tail.fig2a.abs_gc.0" in [m[0] for m in mismatches(text, changed)]
    assert mismatches(render(text, changed), changed) == []
    assert mismatches("<!--claim:no.such-->1<!--/claim-->", values) == [("no.such", "1", None)]


def test_every_committed_json_file_is_strict():
    files = [p for p in (ROOT / "figures").rglob("*.json")]
    assert len(files) >= 6
    for path in files:
        strict_json_load(path)


def test_strict_json_writes_null_for_nan_and_infinities(tmp_path):
    data = {"a": math.nan, "b": [1.0, math.inf, -math.inf], "c": np.float32("nan"), "d": np.float64(2.5),
            "e": (np.int64(3), None), "f": Path("x")}
    assert json.loads(strict_json(data)) == {"a": None, "b": [1.0, None, None], "c": None, "d": 2.5, "e": [3, None],
                                             "f": "x"}
    path = write_json(tmp_path / "r.json", data)
    assert strict_json_load(path)["b"] == [1.0, None, None]


def test_every_committed_manifest_hash_is_its_file():
    import hashlib

    for run in ("figures/tail", "figures/tables"):
        manifest = strict_json_load(ROOT / run / "manifest.json")
        for name, digest in manifest["files"].items():
            assert hashlib.sha256((ROOT / run / name).read_bytes()).hexdigest() == digest, f"{run}/{name}"


def test_the_claims_are_read_from_the_checkout_they_are_given(tmp_path, monkeypatch):
    """Not from wherever the package is installed: a directory without figures/ is refused in one line."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--root . holds no figures/"):
        main(["README.md"])
    text = "<!--claim:map.cse.tail-->x<!--/claim-->"
    (tmp_path / "page.md").write_text(text)
    assert main(["--root", str(ROOT), str(tmp_path / "page.md")]) == 0
    assert (tmp_path / "page.md").read_text() != text
