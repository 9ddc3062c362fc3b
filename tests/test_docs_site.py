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
    sys.path.insert(0, str(ROOT / "scripts"))
    from mkdocs_hooks import cse_models_names

    cse = set(re.findall(r'<h3 id="(cse_models\.[\w.]+)"', api))
    assert cse == set(cse_models_names()) and "cse_models.hf_trainer.SparseCallback" in cse
    assert not re.search(r":(func|class|meth|mod|data|attr|exc|obj):", api)  # roles rendered, not raw
    assert 'href="#ntkscope.kernel.ntk.empirical_ntk"><code>empirical_ntk</code></a>' in api
    assert "<h2 id=\"core-errors-memory\">" in api  # hand_back_freed_memory is not filed under "Errors"
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Install and the two commands" in home and 'href="warmup-map/"' in home  # the README, docs/ links as site links
    # a figure the guide shows from outside docs/ is in the site
    assert (tmp_path / "site" / "repo" / "figures" / "warmup-map" / "controls.png").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """A checkout's copy builds; the same copy with one broken link in a guide page, inside docs/
    or out of it, does not, and the error names the link. A link inside a code block is code."""
    for entry in ROOT.iterdir():  # the checkout, docs/ copied (it is edited), the rest linked
        if entry.name not in ("docs", ".git", "site"):
            (tmp_path / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "speed.md"
    text = page.read_text() + "\n```text\n[not a link](nowhere.md)\n```\n"
    page.write_text(text)
    assert _build(tmp_path / "mkdocs.yml", tmp_path / "site").returncode == 0
    for link, named in (("[gone](missing.md)", "missing.md"), ("![gone](../figures/no-such.png)", "no-such.png")):
        page.write_text(text + f"\n{link}\n")
        proc = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert proc.returncode != 0 and named in proc.stderr, link
