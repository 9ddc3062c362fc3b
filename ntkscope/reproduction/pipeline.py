"""A reproduction of the CSE paper's Figures 1-5 and Tables 1-2 in one run directory.

``Reproduction(run_dir, mode)`` trains what a figure needs on first use and caches every
table, so each stage runs once and an interrupted run resumes (training from its last
checkpoint, analyses per checkpoint)::

    RUN/settings.json              the ReproduceSettings (a run refuses other settings)
    RUN/models/NAME/checkpoints    gpt-dense, gpt-switch, gpt-cse, gpt-dense-legal, gpt-cse-seed1, ...
    RUN/plan.json                  layers and warm-up chosen from the dense run
    RUN/tables/NAME.csv (.npz)     every measurement behind the figures; results.md
    RUN/figures/figNN.png, .pdf    Figures 1-5
    RUN/manifest.json              what made each file: settings, versions, machine, timings

``tables(figure)`` returns a figure's tables; ``figure(panel)`` draws a panel with
:mod:`ntkscope.plotting`; :func:`reproduce` does everything and writes the manifest. Which
tables a figure needs and how each panel is drawn are the rows of
:mod:`ntkscope.reproduction.panels`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import fail
from ntkscope.core.files import DirectoryLock, atomic_path, check_output, sha256_file, write_json, write_text
from ntkscope.core.provenance import environment
from ntkscope.plotting import save_figure
from ntkscope.representation.plan import Plan, make_plan
from ntkscope.reproduction import paper, training
from ntkscope.reproduction.panels import FIGURES, PANELS, STAGES, TRACKED_PANELS
from ntkscope.reproduction.settings import ReproduceSettings, bind_settings, settings_for
from ntkscope.runs.dynamics import STABILITY_COLUMNS
from cse_models.train import TrainConfig, fitting_sample, load_data
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.sentences import load_analysis_data

log = logging.getLogger(__name__)


class Reproduction:
    """One reproduction in ``run_dir`` at ``mode``'s settings (or ``settings``); ``pack``: a
    corpus pack directory (default: the shipped one)."""

    def __init__(self, run_dir, mode: str = "quick", *, settings: ReproduceSettings | None = None, pack=None):
        self.run_dir = Path(run_dir)
        self.settings = settings if settings is not None else settings_for(mode)
        self.pack = load_pack(pack)
        self.pack_path = str(self.pack.path)
        bind_settings(self.run_dir, self.settings, self.pack, "Reproduction")
        (self.run_dir / "tables").mkdir(exist_ok=True)
        (self.run_dir / "figures").mkdir(exist_ok=True)
        self._data = {}
        self._nested = 0.0
        #: where :meth:`_timed` adds up stage times (a side process beside the main one uses its own file)
        self.timings_path = self.run_dir / "timings.json"

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
        path = self.timings_path
        timings = json.loads(path.read_text()) if path.is_file() else {}
        timings[stage] = round(timings.get(stage, 0.0) + own, 1)
        write_json(path, timings)
        if own > 1:
            log.info("%s: %.0f s", stage, own)
        return out

    def _cached(self, stage: str) -> dict:
        """The tables of ``stage`` (a row of :data:`~ntkscope.reproduction.panels.STAGES`) from
        ``RUN/tables`` (CSV; ``kernels``: NPZ), computed once; the time spent computing is added
        to ``RUN/timings.json`` under the stage's name."""
        spec = STAGES[stage]
        folder = self.run_dir / "tables"
        files = {n: folder / (f"{n}.npz" if n == "kernels" else f"{n}.csv") for n in spec.names}
        if all(f.is_file() for f in files.values()):
            return {n: dict(np.load(f)) if f.suffix == ".npz" else pd.read_csv(f) for n, f in files.items()}
        out = self._timed(spec.timing, lambda: spec.compute(self))
        for n, f in files.items():
            with atomic_path(f) as tmp:
                if f.suffix == ".npz":
                    np.savez_compressed(tmp, **out[n])
                else:
                    out[n].to_csv(tmp, index=False)
        return out

    # ---- models -------------------------------------------------------------------------------

    def model_dir(self, name: str) -> Path:
        return self.run_dir / "models" / name

    def mask_token_id(self) -> int:
        """The pack tokenizer's mask token (a BERT's masked inputs)."""
        return self.pack.tokenizer().backend.token_to_id("<mask>")

    def domain_names(self) -> list:
        """The training data's domains in label order (DEMix's experts)."""
        if "domains" not in self._data:
            self._data["domains"] = sorted({r.domain for r in self.pack.records("train")})
        return self._data["domains"]

    def dense(self) -> Path:
        """The dense GPT's last checkpoint (trained on first use)."""
        return self._timed("train gpt-dense", lambda: training.train_dense(
            self.settings, self.model_dir("gpt-dense"), self.pack_path))

    def dense_tracked(self, callbacks=()) -> Path:
        """The dense GPT trained again with ``callbacks`` (a GC tracker), into ``models/gpt-dense-tracked``:
        the same training (a tracker changes nothing it does), measured from inside."""
        return self._timed("train gpt-dense-tracked", lambda: training.train_dense(
            self.settings, self.model_dir("gpt-dense-tracked"), self.pack_path, callbacks=callbacks))

    def dense_run(self) -> Path:
        """The dense run's directory, all of its checkpoints trained."""
        self.dense()
        return self.model_dir("gpt-dense")

    def plan(self):
        """The CSE plan (layers: top separation at the warm-up; warm-up: the long tail's GC peak
        when its statistics show one, else the earliest checkpoint with stable router clusters,
        within ``max_warmup_fraction`` of the steps), from the dense run's Figure 3 tables."""
        path = self.run_dir / "plan.json"
        if path.is_file():
            return Plan.load(path)
        plan = self.measured_plan()
        plan.save(path)
        log.info("plan: CSE layers %s, warm-up %s steps (%s: %s)", plan.layers, plan.convert_at, plan.warmup_rule,
                 plan.evidence.get("gc_peak", {}).get("why", ""))
        return plan

    def measured_plan(self) -> Plan:
        """The plan the current rules make from Figure 3's tables (measured on first use), within
        ``max_warmup_fraction`` of the steps; :meth:`plan` saves it once and keeps it."""
        t = self.tables("fig3")
        s = self.settings
        limit = int(s.max_warmup_fraction * s.steps)
        gc = t["gc_over_steps"][t["gc_over_steps"]["step"] <= limit]
        stability = t["router_dynamics"][STABILITY_COLUMNS]
        return make_plan(t["dynamics"], gc, top_k=s.sparse_layers, overlap=s.stable_overlap,
                         stability=stability[stability["step"] <= limit])

    def warmup_checkpoint(self) -> Path:
        """The dense checkpoint at the planned warm-up (where CSE's router is fitted)."""
        return self.dense_run() / "checkpoints" / f"step-{int(self.plan().convert_at):06d}"

    def _seed(self, seed: int | None) -> int:
        return self.settings.seed if seed is None else seed

    def _name(self, base: str, seed: int | None, stop_at: int | None) -> str:
        """gpt-cse (the main run), gpt-cse-seed1, gpt-cse-to500-seed0, ..."""
        if stop_at is not None:
            return f"{base}-to{stop_at}-seed{self._seed(seed)}"
        return base if self._seed(seed) == self.settings.seed else f"{base}-seed{seed}"

    def cse(self, seed: int | None = None, stop_at: int | None = None) -> Path:
        """CSE from the warm-up, data order ``seed`` (default the settings' seed), to the end or ``stop_at``."""
        plan, dense, name = self.plan(), self.dense_run(), self._name("gpt-cse", seed, stop_at)
        return self._timed(f"train {name}", lambda: training.train_cse(
            self.settings, self.model_dir(name), self.pack_path, dense, plan.layers, plan.convert_at,
            self._seed(seed), stop_at))

    def switch(self, seed: int | None = None, stop_at: int | None = None) -> Path:
        """Switch, upcycled from the warm-up, data order ``seed``, to the end or ``stop_at``."""
        plan, dense, name = self.plan(), self.dense_run(), self._name("gpt-switch", seed, stop_at)
        return self._timed(f"train {name}", lambda: training.train_switch(
            self.settings, self.model_dir(name), self.pack_path, dense, plan.layers, plan.convert_at,
            self._seed(seed), stop_at))

    def continued(self, seed: int | None = None, stop_at: int | None = None) -> Path:
        """The dense model with data order ``seed`` after the warm-up, to the end or ``stop_at``
        (the settings' seed: the dense run itself, or its checkpoint at ``stop_at``)."""
        if self._seed(seed) == self.settings.seed:
            at = self.dense_run() / "checkpoints" / f"step-{stop_at:06d}" if stop_at else self.dense()
            if at.is_dir():
                return at
        plan, dense, name = self.plan(), self.dense_run(), self._name("gpt-dense", seed, stop_at)
        return self._timed(f"train {name}", lambda: training.train_continued(
            self.settings, self.model_dir(name), self.pack_path, dense, plan.convert_at, self._seed(seed), stop_at))

    def finetuned(self, domain: str) -> Path:
        last = self.dense()
        name = f"gpt-dense-{domain}"
        return self._timed(f"train {name}", lambda: training.train_finetuned(
            self.settings, self.model_dir(name), self.pack_path, last, domain))

    # ---- data and tables ----------------------------------------------------------------------

    def data(self, n: int | None = None, seed: int | None = None):
        """``n`` (default ``settings.n``) validation sentences drawn with ``seed`` (default the
        settings' seed), tokenized and scored."""
        n, seed = n or self.settings.n, self._seed(seed)
        if (n, seed) not in self._data:
            self._data[n, seed] = load_analysis_data(self.pack_path, self.pack.tokenizer(), n=n,
                                                     seq_len=self.settings.seq_len, seed=seed)
        return self._data[n, seed]

    def data_draws(self) -> list:
        """``settings.gc_draws`` independent draws of analysis sentences (the first is :meth:`data`)."""
        return [self.data(seed=self.settings.seed + d) for d in range(self.settings.gc_draws)]

    def _blocks(self, split: str, n: int | None) -> dict:
        """{"batch": {"input_ids", "attention_mask"}, "domains"} of ``split``'s blocks: the seeded
        draw of ``n`` that CSE's conversion clusters (:func:`cse_models.train.fitting_sample`), or all."""
        key = (split, n)
        if key not in self._data:
            blocks, _ = load_data(TrainConfig.from_dict({"data": {"pack": self.pack_path,
                                                                  "seq_len": self.settings.seq_len}}), split)
            idx = fitting_sample(len(blocks), n, self.settings.seed) if n else torch.arange(len(blocks))
            ids = blocks.input_ids[idx]
            self._data[key] = {"batch": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               "domains": [blocks.domain_names[int(d)] for d in blocks.domains[idx]]}
        return self._data[key]

    def fitting(self) -> dict:
        """The fitting sample: the ``cse_samples`` training blocks CSE's router is fitted on."""
        return self._blocks("train", self.settings.cse_samples)

    def held_out(self) -> dict:
        """Every validation block (held-out text for the routing table)."""
        return self._blocks("validation", None)

    def tables(self, figure: str) -> dict:
        """The tables behind ``figure`` ("fig1" ... "fig5", "tables"; or a stage's name), computed on first use."""
        stages = FIGURES.get(figure, (figure,) if figure in STAGES else None)
        if stages is None:
            raise fail("Reproduction.tables", "figure", f"must be one of {list(FIGURES)}", figure)
        out = {}
        for stage in stages:
            out.update(self._cached(stage))
        return out

    def runs(self) -> dict:
        """{row name: last checkpoint} of the models in Tables 1-2, training what is missing."""
        runs = {"GPT dense": self.dense()}
        runs.update({f"GPT/{d}": self.finetuned(d) for d in self.settings.finetune_domains})
        runs["Switch"] = self.switch()
        runs["CSE/MoF"] = self.cse()
        return runs

    def compare_until(self) -> int | None:
        """The step the seeds comparison stops at: ``settings.compare_until`` when it lies after the
        warm-up and before the end, else None (the full schedule)."""
        end = self.settings.compare_until
        return end if end and self.plan().convert_at < end < self.settings.steps else None

    def seed_runs(self) -> dict:
        """{(model, seed): last checkpoint} of CSE, upcycled Switch and the dense continuation,
        each from the shared warm-up with ``settings.seeds`` data orders, to :meth:`compare_until`."""
        seeds = range(self.settings.seed, self.settings.seed + self.settings.seeds)
        stop = self.compare_until()
        makers = {"GPT dense": self.continued, "Switch": self.switch, "CSE/MoF": self.cse}
        return {(model, s): make(s, stop) for model, make in makers.items() for s in seeds}

    # ---- figures ------------------------------------------------------------------------------

    def figure_path(self, panel: str) -> Path:
        return self.run_dir / "figures" / panel

    def figure(self, panel: str):
        """Panel ``panel`` (e.g. "fig2a", "fig3bc") as a matplotlib Figure."""
        spec = PANELS.get(panel) or TRACKED_PANELS.get(panel)
        if spec is None:
            raise fail("Reproduction.figure", "panel", f"must be one of {[*PANELS, *TRACKED_PANELS]}", panel)
        return spec.draw(self, self.tables(spec.figure) if spec.uses_tables else {})

    def write_figure(self, panel: str, formats=("png", "pdf")) -> list[Path]:
        return save_figure(self.figure(panel), self.figure_path(panel), formats=formats)

    def write_paper_tables(self) -> list[Path]:
        """The paper's tables (every row, seeds, general tasks, tests) as CSV (cached) and ``paper.md``."""
        t = self.tables("paper")
        folder = self.run_dir / "tables"
        md = write_text(folder / "paper.md", paper.markdown(t, self.settings))
        return [md, *(folder / f"{n}.csv" for n in t)]

    def write_tables(self) -> list[Path]:
        """Tables 1-2 and the seeds comparison as CSV (already cached) and Markdown."""
        t = self.tables("tables")
        folder = self.run_dir / "tables"
        md = write_text(folder / "results.md", t["results"].to_markdown(index=False, floatfmt=".3f") + "\n")
        seeds = write_text(folder / "seeds_summary.md", t["seeds_summary"].to_markdown(index=False, floatfmt=".3f") + "\n")
        return [folder / "results.csv", md, folder / "seeds_summary.csv", seeds]


def reproduce(run_dir, mode: str = "quick", *, settings: ReproduceSettings | None = None, pack=None) -> dict:
    """Everything the mode asks for: train, analyse, write Figures 1-5 (PNG + PDF), Tables 1-2
    (CSV + MD), the paper's tables (``tables/paper.md``) and ``manifest.json``; returns the
    manifest. Resumes from whatever ``run_dir`` holds."""
    start = time.perf_counter()
    check_output("reproduce", run_dir)
    with DirectoryLock(run_dir, "reproduce"):
        return _reproduce(Reproduction(run_dir, mode, settings=settings, pack=pack), start)


def _reproduce(rep: Reproduction, start: float) -> dict:
    written = []
    if rep.settings.figures:
        for panel in [*PANELS, *(TRACKED_PANELS if rep.settings.track_every else ())]:
            written += rep.write_figure(panel)
            log.info("wrote %s", panel)
        written += rep.write_tables()
    if rep.settings.table_archs:
        written += rep.write_paper_tables()
    timings = json.loads((rep.run_dir / "timings.json").read_text())
    for unit in sorted((rep.run_dir / "timings").glob("*.json")):  # an experiment's units, each in its own file
        for stage, seconds in json.loads(unit.read_text()).items():
            timings[stage] = round(timings.get(stage, 0.0) + seconds, 1)
    plan = rep.run_dir / "plan.json"
    if plan.is_file():
        plan = json.loads(plan.read_text())
    else:  # a tables-only run: the settings' layers and warm-up
        layers, warmup = paper.layout(rep)
        plan = {"layers": layers, "convert_at": warmup, "chosen_by": "settings (table_layers, table_convert_at)"}
    manifest = {
        "mode": rep.settings.mode, "settings": rep.settings.to_dict(), "pack": rep.pack_path,
        "pack_version": rep.pack.manifest.get("version"),
        "plan": plan,
        "environment": environment(), "seconds_this_call": round(time.perf_counter() - start, 1),
        "seconds_per_stage": timings, "seconds_total": round(sum(timings.values()), 1),
        "files": {str(p.relative_to(rep.run_dir)): sha256_file(p) for p in sorted(written)
                  + sorted((rep.run_dir / "tables").glob("*.csv")) + sorted((rep.run_dir / "tables").glob("*.npz"))},
    }
    write_json(rep.run_dir / "manifest.json", manifest)
    return manifest
