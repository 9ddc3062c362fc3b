"""The documentation site (mkdocs.yml): it builds in strict mode without a network, its API
reference is ``ntkscope.__all__`` exactly, and a broken link fails the build."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocstrings", reason="the docs site needs the dev extra (mkdocs-material, mkdocstrings)")
pytest.importorskip("material", reason="the docs site needs the dev extra (mkdocs-material, mkdocstrings)")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, cwd=config.parent)


def test_the_site_builds_strict_and_its_api_is_all(tmp_path):
    import ntkscope

    proc = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    documented = set(re.findall(r'<h3 id="(ntkscope\.[\w.]+)"', api))
    expected = {f"{ntkscope._EXPORTS[n]}.{n}" for n in ntkscope.__all__}
    assert documented == expected
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Install and the two commands" in home and 'href="warmup-map/"' in home  # the README, docs/ links as site links
    # a figure the guide shows from outside docs/ is in the site
    assert (tmp_path / "site" / "repo" / "figures" / "warmup-map" / "controls.png").is_file()


@pytest.mark.parametrize("link", ["[gone](missing.md)", "![gone](../figures/no-such.png)"])
def test_a_broken_link_fails_the_build(tmp_path, link):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", tmp_path / "scripts" / "mkdocs_hooks.py")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for folder in ("figures", "benchmarks", "ntkscope"):  # what the pages link to outside docs/
        (tmp_path / folder).symlink_to(ROOT / folder)
    page = tmp_path / "docs" / "speed.md"
    page.write_text(page.read_text() + f"\n{link}\n")
    proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    assert "missing.md" in proc.stderr or "no-such.png" in proc.stderr
