"""``ntkscope report``: one self-contained HTML page of the committed tail run and of a tracked
training run; nothing fetched from elsewhere; every column in the glossary; a real browser draws it."""

import html.parser
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from commandline import in_process

from cse_models.train import main as cse_train

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


class _References(html.parser.HTMLParser):
    """Every URL-bearing attribute and every tag of a page."""

    def __init__(self):
        super().__init__()
        self.urls, self.tags, self.images = [], set(), 0

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.images += tag == "img"
        self.urls += [value for name, value in attrs if name in ("src", "href", "srcset", "action", "data", "poster")]


def _references(page: str) -> _References:
    parser = _References()
    parser.feed(page)
    return parser


@pytest.fixture(scope="module")
def tail_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "tail.html"
    proc = in_process("report", ROOT / "figures" / "tail", "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out


def test_the_tail_run_report_is_one_self_contained_page(tail_report):
    page = tail_report.read_text()
    refs = _references(page)
    assert all(u.startswith(("data:image/png;base64,", "#")) for u in refs.urls), \
        [u[:60] for u in refs.urls if not u.startswith("data:")]
    assert not refs.tags & {"script", "link", "iframe", "object", "embed"} and "url(" not in page
    assert "@import" not in page and "http://" not in page and "https://" not in page
    assert refs.images == 4  # the histogram, GC by bin, GC over steps, the cluster dynamics
    for title in ("What was found", "The plan", "GC of each subset against the whole set", "GC over training",
                  "Cluster and router dynamics", "Routing", "What made this", "Glossary"):
        assert f">{title}</h2>" in page
    assert "ntkscope reproduce --tail" in page and "below the random null band" in page
    assert "not described" not in page  # every column shown is in the glossary
    # findings first, and one verdict per quantity: the plan's GC peak (made with older statistics) beside
    # the one re-measured from its table, never the two as separate verdicts
    assert page.index(">What was found</h2>") < min(page.index(f">{t}</h2>") for t in ("The plan", "GC over training"))
    assert "GC peak: shown at step" not in page and "recorded it as shown at step 75" in page
    assert page.count("no GC peak shown") >= 1
    # long tables are shown in part, each whole one folded below it
    assert "<details><summary>The whole table (" in page and "12 of " in page
    assert "dotted lines are the bins" in page  # the scores' distribution, with the bins' edges


def test_a_real_browser_draws_the_report(tail_report, tmp_path):
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt install chromium); the page's structure is tested above")
    shot = tmp_path / "shot.png"
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1100,2600"]
    subprocess.run([*command, f"--screenshot={shot}", tail_report.as_uri()], capture_output=True, timeout=120,
                   check=True)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2600, 1100)
    ink = (pixels < 0.9).any(axis=2)
    assert ink.mean() > 0.05  # text and figures, not a blank or an error page
    colour = np.ptp(pixels, axis=2) > 0.25  # the figures' reds and blues: the embedded PNGs decoded and drew
    assert colour.sum() > 2000
    dom = subprocess.run([*command, "--dump-dom", tail_report.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "GC over training" in dom and dom.count("<img") == 4


def test_report_of_a_tracked_training_run(tmp_path):
    torch.set_default_dtype(torch.float32)
    spec = {"out_dir": str(tmp_path / "run"), "model": {"n_layer": 2, "n_embd": 32, "n_head": 2},
            "data": {"seq_len": 32, "split": "validation"}, "steps": 6, "batch_size": 8, "checkpoint_every": 6,
            "log_every": 2, "warmup_steps": 2, "tensorboard": False,
            "track": {"every": 3, "n": 24, "by": "frequency-bins", "bins": 2, "resamples": 20, "null_draws": 20,
                      "per_layer": True}}
    (tmp_path / "run.json").write_text(json.dumps(spec))
    assert cse_train([str(tmp_path / "run.json")]) == 0
    proc = in_process("report", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "run" / "report.html").read_text()
    assert ">GC over training</h2>" in page and ">Training</h2>" in page and "cse-train" in page
    assert "bin 0" in page and "bin 1" in page and "kernel_cka" in page and "not described" not in page
    assert "|GC| of each subset against the whole set" in page and "the long-tail subset" not in page
    assert "layers&#x27; blocks of the kernel" in page  # the per-layer rows have their own figure, not dropped
    assert _references(page).images == 4  # the per-layer panel, one per bin, the training curve
    bad = in_process("report", tmp_path / "run", "--out", tmp_path / "page.txt")
    assert bad.returncode == 1 and "report: out must end in .html" in bad.stderr
