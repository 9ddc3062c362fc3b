"""A reproduction of the CSE paper's Figures 1-5 and Tables 1-2 in one run directory.

``Reproduction(run_dir, mode)`` trains what a figure needs on first use and caches every
table, so each stage runs once and an interrupted run resumes (training from its last
checkpoint, analyses per checkpoint)::

    RUN/settings.json              the ReproduceSettings (a run refuses other settings)
    RUN/models/NAME/checkpoints    gpt-dense, gpt-switch, gpt-cse, gpt-dense-legal, ...
    RUN/plan.json                  layers and warm-up chosen from the dense run
    RUN/tables/NAME.csv (.npz)     every measurement behind the figures; results.md
    RUN/figures/figNN.png, .pdf    Figures 1-5
    RUN/manifest.json              what made each file: settings, versions, machine, timings

``tables(figure)`` returns a figure's tables; ``figure(panel)`` draws a panel with
:mod:`ntkscope.plotting`; :func:`reproduce` does everything and writes the manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope._checks import fail
from ntkscope.reproduction import analyses, training
from ntkscope.reproduction.settings import ReproduceSettings, settings_for

log = logging.getLogger(__name__)

FIGURES = ("fig1", "fig2", "fig3", "fig4", "fig5", "tables")
PANELS = {"fig1": ("fig1a", "fig1b"), "fig2": ("fig2a", "fig2b"), "fig3": ("fig3a", "fig3bc"),
          "fig4": ("fig4a", "fig4b"), "fig5": ("fig5a", "fig5bc"), "tables": ()}


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Reproduction:
    """One reproduction in ``run_dir`` at ``mode``'s settings (or ``settings``); ``pack``: a
    corpus pack directory (default: the shipped one)."""

    def __init__(self, run_dir, mode: str = "quick", *, settings: ReproduceSettings | None = None, pack=None):
        self.run_dir = Path(run_dir)
        self.settings = settings if settings is not None else settings_for(mode)
        from ntkscope.corpus.pack import load_pack

        self.pack = load_pack(pack)
        self.pack_path = str(self.pack.path)
        wanted = {"settings": self.settings.to_dict(), "pack": self.pack.manifest.get("version")}
        saved = self.run_dir / "settings.json"
        if saved.is_file():
            have = json.loads(saved.read_text())
            if have != json.loads(json.dumps(wanted)):
                raise fail("Reproduction", "run_dir", f"holds a reproduction with other settings or another pack "
                           f"(mode {have['settings']['mode']!r}, pack {have['pack']!r}); use another directory",
                           str(self.run_dir))
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _write_json(saved, wanted)
        (self.run_dir / "tables").mkdir(exist_ok=True)
        (self.run_dir / "figures").mkdir(exist_ok=True)
        self._data = {}
        self._nested = 0.0

    # ---- caching ------------------------------------------------------------------------------

    def _timed(self, stage: str, compute):
        """Run ``compute`` and add its own time (less that of stages nested in it) to
        ``RUN/timings.json`` under ``stage``; a resumed stage adds up."""
        outer, self._nested = self._nested, 0.0
        start = time.perf_counter()
        try:
            out = compute()
        finally:
            elapsed = time.perf_counter() - start
            own, self._nested = elapsed - self._nested, outer + elapsed
        path = self.run_dir / "timings.json"
        timings = json.loads(path.read_text()) if path.is_file() else {}
        timings[stage] = round(timings.get(stage, 0.0) + own, 1)
        _write_json(path, timings)
        if own > 1:
            log.info("%s: %.0f s", stage, own)
        return out

    def _cached(self, stage: str, names: tuple, compute) -> dict:
        """Tables ``names`` from ``RUN/tables`` (CSV; ``kernels``: NPZ), computed once; the time
        spent computing is added to ``RUN/timings.json`` under ``stage``."""
        folder = self.run_dir / "tables"
        files = {n: folder / (f"{n}.npz" if n == "kernels" else f"{n}.csv") for n in names}
        if all(f.is_file() for f in files.values()):
            out = {}
            for n, f in files.items():
                out[n] = dict(np.load(f)) if f.suffix == ".npz" else pd.read_csv(f)
            return out
        out = self._timed(stage, compute)
        for n, f in files.items():
            tmp = f.with_name(f".{f.stem}.tmp-{os.getpid()}{f.suffix}")
            if f.suffix == ".npz":
                np.savez_compressed(tmp, **out[n])
            else:
                out[n].to_csv(tmp, index=False)
            os.replace(tmp, f)
        return out

    # ---- models -------------------------------------------------------------------------------

    def model_dir(self, name: str) -> Path:
        return self.run_dir / "models" / name

    def dense(self) -> Path:
        """The dense GPT's last checkpoint (trained on first use)."""
        return self._timed("train gpt-dense", lambda: training.train_dense(
            self.settings, self.model_dir("gpt-dense"), self.pack_path))

    def dense_run(self) -> Path:
        """The dense run's directory, all of its checkpoints trained."""
        self.dense()
        return self.model_dir("gpt-dense")

    def plan(self):
        """The CSE plan (layers: top separation at the warm-up; warm-up: the long tail's GC peak,
        at most ``max_warmup_fraction`` of the steps), from the dense run's Figure 3 tables."""
        from ntkscope.plan import Plan, make_plan

        path = self.run_dir / "plan.json"
        if path.is_file():
            return Plan.load(path)
        t = self.tables("fig3")
        s = self.settings
        limit = int(s.max_warmup_fraction * s.steps)
        gc = t["gc_over_steps"][t["gc_over_steps"]["step"] <= limit]
        plan = make_plan(t["dynamics"], gc, top_k=s.sparse_layers)
        plan.save(path)
        log.info("plan: CSE layers %s, warm-up %s steps", plan.layers, plan.warmup_steps)
        return plan

    def cse(self) -> Path:
        plan, dense = self.plan(), self.dense_run()
        return self._timed("train gpt-cse", lambda: training.train_cse(
            self.settings, self.model_dir("gpt-cse"), self.pack_path, dense, plan.layers, plan.warmup_steps))

    def switch(self) -> Path:
        layers = self.plan().layers
        return self._timed("train gpt-switch", lambda: training.train_switch(
            self.settings, self.model_dir("gpt-switch"), self.pack_path, layers))

    def finetuned(self, domain: str) -> Path:
        last = self.dense()
        name = f"gpt-dense-{domain}"
        return self._timed(f"train {name}", lambda: training.train_finetuned(
            self.settings, self.model_dir(name), self.pack_path, last, domain))

    # ---- data and tables ----------------------------------------------------------------------

    def data(self, n: int | None = None):
        """``n`` (default ``settings.n``) validation sentences, tokenized and scored."""
        from ntkscope.analysis_data import load_analysis_data

        n = n or self.settings.n
        if n not in self._data:
            self._data[n] = load_analysis_data(self.pack_path, self.pack.tokenizer(), n=n,
                                               seq_len=self.settings.seq_len, seed=self.settings.seed)
        return self._data[n]

    def tables(self, figure: str) -> dict:
        """The tables behind ``figure`` ("fig1" ... "fig5", "tables"), computed on first use."""
        if figure not in FIGURES:
            raise fail("Reproduction.tables", "figure", f"must be one of {list(FIGURES)}", figure)
        s = self.settings
        if figure == "fig1":
            return self._cached("fig1", ("domain_sizes", "perplexity", "perplexity_by_bin"), lambda: analyses.long_tail(
                self.pack, self.dense(), self.data(s.n_perplexity), s))
        if figure == "fig2":
            gc = self._cached("fig2a", ("gc_by_bin", "histogram"), lambda: analyses.gc_by_frequency(
                self.dense(), self.pack_path, s, self.run_dir / "analysis" / "gc-by-frequency"))
            return {**gc, **self._routing()}
        if figure == "fig3":
            return self._cached("fig3", ("gc_over_steps", "dynamics"), lambda: analyses.training_dynamics(
                self.dense_run(), self.data(), s))
        if figure == "fig4":
            layer = self.plan().layers[0]
            return self._cached("fig4", ("snapshot_points", "snapshot_clusters"), lambda: analyses.snapshots(
                self.dense_run(), self.data(), layer, s))
        if figure == "fig5":
            routing = self._routing()
            layer = self.plan().layers[0]
            kernels = self._cached("fig5bc", ("expert_ntk", "kernels"), lambda: analyses.expert_kernels(
                self.cse(), self.dense(), self.data(), routing["routing"], layer))
            return {**routing, **kernels}
        return self._cached("tables", ("results",), lambda: analyses.results(self.runs(), self.pack, s))

    def _routing(self) -> dict:
        layer = self.plan().layers[0]
        return self._cached("routing", ("routing", "routing_summary"), lambda: analyses.routing(
            self.cse(), self.data(), layer, self.settings))

    def runs(self) -> dict:
        """{row name: last checkpoint} of the models in Tables 1-2, training what is missing."""
        runs = {"GPT dense": self.dense()}
        runs.update({f"GPT/{d}": self.finetuned(d) for d in self.settings.finetune_domains})
        runs["Switch"] = self.switch()
        runs["CSE/MoF"] = self.cse()
        return runs

    # ---- figures ------------------------------------------------------------------------------

    def figure_path(self, panel: str) -> Path:
        return self.run_dir / "figures" / panel

    def figure(self, panel: str):
        """Panel ``panel`` (e.g. "fig2a", "fig3bc") as a matplotlib Figure."""
        from ntkscope import plotting

        figure = panel[:4]
        if figure not in PANELS or panel not in PANELS[figure]:
            raise fail("Reproduction.figure", "panel", f"must be one of {[p for ps in PANELS.values() for p in ps]}",
                       panel)
        if panel == "fig4a":
            return plotting.cse_schematic()
        t = self.tables(figure)
        mode = self.settings.mode
        if panel == "fig1a":
            return plotting.domain_sizes(t["domain_sizes"])
        if panel == "fig1b":
            return plotting.perplexity_vs_frequency(t["perplexity"], t["perplexity_by_bin"])
        if panel == "fig2a":
            return plotting.gc_vs_frequency(t["gc_by_bin"], t["histogram"], title=f"dense GPT ({mode}): GC against "
                                            "sentence frequency")
        layer = self.plan().layers[0] if figure in ("fig2", "fig4", "fig5") else None
        if panel == "fig2b":
            k = int((t["routing"]["cluster"].unique() >= 0).sum())
            return plotting.cluster_view(t["routing"], colour_by="cluster", title=f"CSE layer {layer}'s input: "
                                         f"DBSCAN (automatic eps) finds {k} cluster{'s' * (k != 1)}")
        if panel == "fig3a":
            return plotting.gc_over_steps(t["gc_over_steps"])
        if panel == "fig3bc":
            return plotting.layer_dynamics(t["dynamics"])
        if panel == "fig4b":
            return plotting.cluster_view(t["snapshot_points"], colour_by="cluster",
                                         title=f"dense GPT, layer {layer}'s FFN input: elbow K-Means over training")
        if panel == "fig5a":
            k = t["routing"]["expert"].nunique()
            return plotting.cluster_view(t["routing"], colour_by="expert", title=f"CSE layer {layer}: the expert "
                                         f"each sentence is routed to ({k} expert{'s' * (k != 1)} used)")
        return plotting.expert_kernels(t["kernels"], t["expert_ntk"])

    def write_figure(self, panel: str, formats=("png", "pdf")) -> list[Path]:
        from ntkscope.plotting import save_figure

        return save_figure(self.figure(panel), self.figure_path(panel), formats=formats)

    def write_tables(self) -> list[Path]:
        """Tables 1-2 as CSV (already cached) and Markdown."""
        table = self.tables("tables")["results"]
        md = self.run_dir / "tables" / "results.md"
        tmp = md.with_name(f".results.md.tmp-{os.getpid()}")
        tmp.write_text(table.to_markdown(index=False, floatfmt=".3f") + "\n")
        os.replace(tmp, md)
        return [self.run_dir / "tables" / "results.csv", md]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _environment() -> dict:
    import torch

    import ntkscope

    import subprocess

    try:  # the code's commit, when ntkscope runs from a git checkout
        commit = subprocess.run(["git", "-C", str(Path(ntkscope.__file__).parent), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"ntkscope": ntkscope.__version__, "commit": commit, "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, threads "
                       f"{torch.get_num_threads()}" + (f", {torch.cuda.get_device_name(0)}"
                                                       if torch.cuda.is_available() else ", no GPU")}


def reproduce(run_dir, mode: str = "quick", *, settings: ReproduceSettings | None = None, pack=None) -> dict:
    """Everything: train, analyse, write Figures 1-5 (PNG + PDF), Tables 1-2 (CSV + MD) and
    ``manifest.json``; returns the manifest. Resumes from whatever ``run_dir`` holds."""
    start = time.perf_counter()
    rep = Reproduction(run_dir, mode, settings=settings, pack=pack)
    written = []
    for figure in FIGURES[:-1]:
        for panel in PANELS[figure]:
            written += rep.write_figure(panel)
            log.info("wrote %s", panel)
    written += rep.write_tables()
    timings = json.loads((rep.run_dir / "timings.json").read_text())
    manifest = {
        "mode": rep.settings.mode, "settings": rep.settings.to_dict(), "pack": rep.pack_path,
        "pack_version": rep.pack.manifest.get("version"), "plan": json.loads((rep.run_dir / "plan.json").read_text()),
        "environment": _environment(), "seconds_this_call": round(time.perf_counter() - start, 1),
        "seconds_per_stage": timings, "seconds_total": round(sum(timings.values()), 1),
        "files": {str(p.relative_to(rep.run_dir)): _sha256(p) for p in sorted(written)
                  + sorted((rep.run_dir / "tables").glob("*.csv")) + sorted((rep.run_dir / "tables").glob("*.npz"))},
    }
    _write_json(rep.run_dir / "manifest.json", manifest)
    return manifest
