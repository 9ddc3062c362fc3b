"""Gradient consistency inside a training loop: fixed probe sets, measured every k steps.

A :class:`GCTracker` holds :class:`Probes` (one batch of analysis sentences and named subsets
of it: frequency bins, labels, the long tail, or index sets of one's own) and, every ``every``
steps, measures each subset's GC against the whole probe set with the same statistics as
:func:`ntkscope.gradient_consistency_groups` (interval, bias, sign confidence, the random null
and the controls), from one kernel per probe: the eigengap, the mean-gradient consistency, and
the kernel's centred alignment (CKA) with the previous probe's. With ``per_layer`` it does the
same on each layer's block of the kernel (the blocks sum to the whole).

A probe leaves training as it was: the model runs in eval mode on the functional copy of its
weights (no ``.grad`` is written, the optimizer is not seen), its train/eval modes are restored,
and the RNG streams training uses (torch's CPU and CUDA generators, NumPy's and Python's global
ones) are put back, so the losses of a run with the tracker equal those of a run without it.

Rows go to ``OUT/gc.csv`` (one per step, label and layer: the columns of
:meth:`ntkscope.GCResult.row`, plus step, layer, kernel_cka and seconds), written whole at every
probe under a temporary name; with one subset and ``layer == "all"`` it is the table
:func:`ntkscope.gc_series` returns, and :func:`ntkscope.plotting.gc_over_steps` and
:func:`ntkscope.gc_peak` read it as it is. ``OUT/tracker.json`` says what made it; a run that
resumes keeps the rows before its step and measures the rest again. TensorBoard scalars go to
``OUT/tensorboard`` when ``tensorboard`` is installed and asked for.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import random
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import check_choice, check_positive_int, entry, fail
from ntkscope.core.files import digest, read_json_object, strict_json, write_json, write_table
from ntkscope.core.memory import training_thresholds, training_thresholds_kept
from ntkscope.core.provenance import provenance
from ntkscope.kernel import distributed
from ntkscope.kernel.consistency import subset_indices
from ntkscope.kernel.grads import functional_model, step_cost
from ntkscope.kernel.methods import choose, method_names, workload
from ntkscope.kernel.nulls import check_controls, resolve_loss
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.kernel.objectives import batch_size, sample_outputs, take
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.params import select_parameters
from ntkscope.kernel.uncertainty import GCResult, Resampling, check_resampling, kernel_statistics, statistics_device
from ntkscope.gc.groups import GC_OUTPUT, analysis_controls, group_labels, homogeneous_pools
from ntkscope.gc.options import GCOptions, given_once
from ntkscope.text.frequency import long_tail_subset
from ntkscope.text.inputs import DataSource, as_source
from ntkscope.text.sentences import AnalysisData, load_analysis_data

log = logging.getLogger(__name__)

PROBE_KINDS = ("tail", "frequency-bins", "label")
FRONT = ["step", "label", "layer"]


def _check_out(out) -> Path | None:
    """``out`` before any probe: an existing directory this user may write, or one that can be made
    (its nearest existing folder a directory this user may write), as is ``kernels/`` in it."""
    if out is None:
        return None
    if not isinstance(out, (str, os.PathLike)):
        raise fail("GCTracker", "out", "must be a directory path or None", type(out).__name__)
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise fail("GCTracker", "out", "must be a directory (it is an existing file)", str(path))
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise fail("GCTracker", "out", f"must be a directory that can be made ({folder} is a file, not a directory)",
                   str(path))
    for place in (folder, path / "kernels"):
        if place.is_dir() and not os.access(place, os.W_OK | os.X_OK):
            raise fail("GCTracker", "out", f"must be a directory this user may write ({place} is not writable)",
                       str(path))
    return path


#: the GCOptions fields Probes.from_data also takes as keywords
PROBE_GROUPING = ("tail_fraction", "bins", "binning", "min_count")


def check_model(func: str, model) -> None:
    """The model a probe measures: the module itself (a name or a path is not loaded here)."""
    if isinstance(model, torch.nn.Module):
        return
    shown = type(model).__name__
    if model is None or isinstance(model, (str, os.PathLike)):
        shown = model if model is None else str(model)
    raise fail(func, "model", "must be the torch.nn.Module being trained (load a named model first)", shown)


def check_step(func: str, step, arg: str = "step") -> None:
    """A step count: an integer >= 0 (a fraction is no step; it would never be a multiple of every)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise fail(func, arg, "must be an integer >= 0 (the optimizer steps done)", step)


def kernel_cka(a: np.ndarray, b: np.ndarray) -> float:
    """Centred kernel alignment of two (n, n) kernels: ``<HaH, HbH>_F / (|HaH|_F |HbH|_F)`` with
    ``H = I - 11^T/n`` (Cortes et al. 2012; Kornblith et al. 2019); 1 for kernels equal up to
    scale, NaN when either is constant."""
    def centred(k):
        k = np.asarray(k, dtype=np.float64)
        return k - k.mean(0, keepdims=True) - k.mean(1, keepdims=True) + k.mean()
    ca, cb = centred(a), centred(b)
    norm = np.linalg.norm(ca) * np.linalg.norm(cb)
    return float(np.sum(ca * cb) / norm) if norm > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Probes:
    """The fixed sentences a tracker measures, and the subsets whose GC it follows.

    Attributes
    ----------
    batch : dict
        ``input_ids`` and ``attention_mask`` of shape (n, T).
    groups : dict of str to ndarray
        Subset name -> sorted indices into the batch (at least 2 each; they may overlap).
    pools : list of ndarray, or None
        The homogeneous null's pools (index arrays of one ordinary source each); None:
        gradient-space neighbours.
    source : str
        Where the sentences came from.
    """

    batch: dict
    groups: dict
    pools: list | None = None
    source: str = ""

    @entry("Probes")
    def __post_init__(self):
        if not isinstance(self.batch, dict) or "input_ids" not in self.batch:
            raise fail("Probes", "batch", "must be a dict with input_ids (n, T) and attention_mask", type(self.batch))
        n = batch_size(self.batch)
        if not self.groups:
            raise fail("Probes", "groups", "must name at least one subset", self.groups)
        groups = {str(name): subset_indices(idx, n) for name, idx in self.groups.items()}
        object.__setattr__(self, "groups", groups)
        if self.pools is not None:
            object.__setattr__(self, "pools", [subset_indices(p, n) for p in self.pools])

    @property
    def n(self) -> int:
        return batch_size(self.batch)

    @classmethod
    @entry("Probes.from_data")
    def from_data(cls, data: AnalysisData, *, by: str = "tail", gc: GCOptions | None = None, homogeneous=None,
                  **grouping) -> "Probes":
        """Subsets of analysis sentences (:func:`ntkscope.load_analysis_data`): ``by`` "tail" (the
        lowest ``gc.tail_fraction`` of frequency scores, one subset named "tail": the CSE paper's
        Figure 3(a)), "frequency-bins" ("bin k", ``gc.bins`` of them by ``gc.binning``) or "label"
        (the data's labels); groups smaller than ``gc.min_count`` are left out. ``gc``: a
        :class:`~ntkscope.GCOptions` (default: its defaults); ``grouping``: its fields
        ``tail_fraction``, ``bins``, ``binning``, ``min_count`` as keywords instead (one that
        differs from ``gc``'s is refused; ``gc.by`` is not read: ``by`` is the probes' own, with
        "tail"). ``homogeneous``: a label of the data whose sentences make the homogeneous null
        (default ``gc.homogeneous_label``; not both), or pools of indices."""
        check_choice("by", by, PROBE_KINDS)
        if not isinstance(data, AnalysisData):
            raise fail("Probes.from_data", "data", "must be an AnalysisData (ntkscope.load_analysis_data; Probes.load "
                       "reads a path or a table)", type(data).__name__)
        unknown = sorted(set(grouping) - set(PROBE_GROUPING))
        if unknown:
            raise fail("Probes.from_data", unknown[0], f"is not an argument (the grouping's keywords are "
                       f"{list(PROBE_GROUPING)}, or gc=GCOptions(...))", unknown[0])
        gc, homogeneous = given_once(gc, grouping, homogeneous)
        if by == "tail":
            groups = {"tail": long_tail_subset(data.labels["score"], gc.tail_fraction)}
        else:
            labels, _ = group_labels(data, by, gc.bins, gc.binning)
            groups = {str(lab): np.flatnonzero(labels == lab) for lab in sorted(set(labels.tolist()), key=str)}
            groups = {k: v for k, v in groups.items() if len(v) >= max(2, gc.min_count)}
        return cls(data.batch, groups, homogeneous_pools(data, homogeneous), data.source)

    @classmethod
    @entry("Probes.load")
    def load(cls, data, tokenizer, *, n: int = 128, seq_len: int = 64, seed: int = 0, text_column: str = "text",
             label_column: str | None = None, per_group: int | None = None, **subsets) -> "Probes":
        """``n`` sentences of ``data`` (a ``--data`` input: pack, table, text file, ``datasets``
        directory, or a :class:`~ntkscope.text.inputs.DataSource`; :func:`ntkscope.load_analysis_data`),
        read with ``text_column`` / ``label_column`` when it is a path, tokenized by ``tokenizer`` (a
        path, a ``tokenizers`` or transformers tokenizer, or ours), and their subsets
        (:meth:`from_data`'s keywords). ``per_group``: that many sentences of each label instead of
        ``n`` drawn uniformly (a rare domain gets as many probes as a common one)."""
        known = set(inspect.signature(cls.from_data).parameters) - {"data", "cls", "grouping"} | set(PROBE_GROUPING)
        unknown = sorted(set(subsets) - known)
        if unknown:
            raise fail("Probes.load", unknown[0], f"is not an argument (the subsets take {sorted(known)})", unknown)
        if not isinstance(data, DataSource):
            data = as_source(data, columns=DataSource(None, text_column, label_column))
        return cls.from_data(load_analysis_data(data, tokenizer, n=n, seq_len=seq_len, seed=seed,
                                                per_group=per_group), **subsets)

    def key(self) -> dict:
        return {"groups": {k: v.tolist() for k, v in self.groups.items()},
                "pools": None if self.pools is None else [p.tolist() for p in self.pools], "source": self.source}


@dataclasses.dataclass(frozen=True)
class ProbeCost:
    """A tracker's cost before it runs: the method "auto" picks, its estimate in forward and
    backward passes over the probe set, one such pass timed, the statistics' seconds, and so the
    seconds per probe."""

    method: str
    passes: float
    pass_seconds: float
    statistics_seconds: float
    seconds: float


@contextmanager
def _training_untouched(model):
    """Run a probe in eval mode (dropout off) and put back what training uses: every module's
    train/eval mode and the RNG streams (torch CPU and CUDA, NumPy's and Python's global generators)."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
        for m, mode in modes.items():
            m.train(mode)


class GCTracker:
    """Gradient consistency of fixed probe subsets, every ``every`` steps of any training loop.

    Parameters
    ----------
    probes : Probes
    every : int
        Probe at steps that are multiples of ``every`` (step = optimizer steps done).
    out : path or None
        Directory for ``gc.csv``, ``tracker.json`` and ``kernels/step-NNNNNN.npz`` (the probe
        kernels, whole and per layer); None keeps the rows in memory only (:attr:`frame`).
    options : KernelOptions or None
        How the kernel is computed (default: output "centred-true-logit", method "auto"); a
        method that forms the kernel ("auto", "exact", "structured", "projected"). With no
        ``max_memory`` a probe leaves training's malloc thresholds as they are
        (:func:`~ntkscope.core.memory.training_thresholds_kept`: faster, no budget kept for what
        it frees); with one, it keeps that budget as every kernel computation does.
    resampling : Resampling or None
        The intervals and random null, as for :func:`ntkscope.gradient_consistency_groups`.
    controls : "auto" or None
        "auto": the homogeneous null (the probes' pools, else gradient-space neighbours) and
        nulls matched on length and loss, measured at each probe (:func:`ntkscope.gc.groups.analysis_controls`).
    per_layer : bool
        Also each layer's block of the kernel (``layer`` column: the module path, e.g.
        ``transformer.h.0``; the whole kernel is ``"all"``).
    tensorboard : bool
        Also write scalars to ``OUT/tensorboard`` (needs the ``tensorboard`` package and ``out``).

    Notes
    -----
    Use it as a ``cse_models.train`` callback (``train(cfg, callbacks=[tracker])``), through
    :class:`ntkscope.GCCallback` in a Hugging Face ``Trainer``, or call :meth:`step` in a loop,
    in single-process training: under a process group of several ranks a probe is refused (its
    kernel's collectives would wait for ranks that are training).
    """

    @entry("GCTracker")
    def __init__(self, probes: Probes, *, every: int = 100, out=None, options: KernelOptions | None = None,
                 resampling: Resampling | None = Resampling(), controls: str | None = "auto",
                 per_layer: bool = False, tensorboard: bool = False):
        if not isinstance(probes, Probes):
            raise fail("GCTracker", "probes", "must be a Probes (Probes.from_data, Probes.load or Probes(...))",
                       type(probes).__name__)
        check_positive_int("every", every)
        self.options = options if options is not None else KernelOptions(output=GC_OUTPUT)
        if not isinstance(self.options, KernelOptions):
            raise fail("GCTracker", "options", "must be a KernelOptions", type(self.options).__name__)
        check_choice("method", self.options.method, method_names("kernel"))
        check_resampling(resampling)
        if not (controls is None or isinstance(controls, str) and controls == "auto"):
            raise fail("GCTracker", "controls", "must be 'auto' or None", controls)
        for name, flag in (("per_layer", per_layer), ("tensorboard", tensorboard)):
            if not isinstance(flag, bool):
                raise fail("GCTracker", name, "must be True or False", type(flag).__name__)
        if tensorboard and out is None:
            raise fail("GCTracker", "tensorboard", "needs out= (the event files go to OUT/tensorboard)", tensorboard)
        self.probes, self.every, self.resampling, self.controls = probes, every, resampling, controls
        self.per_layer = bool(per_layer)
        self.out = _check_out(out)
        self.rows: list[dict] = []
        self.cost: ProbeCost | None = None
        self._n_params = 0
        self.probe_seconds: list[float] = []
        self.train_seconds = 0.0
        self._previous: dict = {}
        self._last_call: float | None = None
        self._writer = None
        if self.out is not None:
            self._open(tensorboard)

    # ---- files --------------------------------------------------------------------------------

    def _data_files(self) -> list:
        source = Path(self.probes.source) if self.probes.source else None
        return [source] if source is not None and source.exists() else []

    def describe(self) -> dict:
        """What makes this tracker's rows: the probes' digest and every option."""
        return {"probes": digest(self.probes.key(), arrays=self.probes.batch), "n": self.probes.n,
                "groups": {k: len(v) for k, v in self.probes.groups.items()}, "source": self.probes.source,
                "every": self.every, "kernel": self.options.to_dict(), "per_layer": self.per_layer,
                "controls": self.controls,
                "resampling": None if self.resampling is None else dataclasses.asdict(self.resampling)}

    def _open(self, tensorboard: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        made, csv = self.out / "tracker.json", self.out / "gc.csv"
        if made.is_file():
            have = read_json_object(made, "GCTracker")
            if have.get("made_by") != json.loads(strict_json(self.describe())):  # as the file holds it
                raise fail("GCTracker", "out", "holds a tracker with other probes or options (tracker.json); use "
                           "another directory", str(self.out))
            if csv.is_file():
                self.rows = pd.read_csv(csv, keep_default_na=False, na_values=[""]).to_dict("records")
        write_json(made, {"made_by": self.describe(), "provenance": provenance(data_files=self._data_files())})
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard, only when asked for
            except ImportError:
                log.warning("GCTracker: tensorboard is not installed; writing gc.csv only (pip install tensorboard)")
            else:
                self._writer = SummaryWriter(str(self.out / "tensorboard"))

    def _previous_kernels(self, step: int) -> dict:
        """The kernels of the probe before ``step`` ({layer: (n, n)}): kept from the last probe, or
        read back from ``kernels/`` when a run resumed."""
        before = step - self.every
        if self._previous.get("step") == before:
            return self._previous["kernels"]
        path = None if self.out is None else self.out / "kernels" / f"step-{before:06d}.npz"
        if path is not None and path.is_file():
            with np.load(path) as saved:
                return {name: saved[name] for name in saved.files}
        return {}

    def _save(self, step: int, kernels: dict, rows: list) -> None:
        self.rows = [r for r in self.rows if int(r["step"]) < step] + rows
        self._previous = {"step": step, "kernels": kernels}
        if self.out is None:
            return
        path = self.out / "kernels" / f"step-{step:06d}.npz"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.stem}.tmp.npz")
        np.savez(tmp, **kernels)
        tmp.replace(path)
        write_table(self.frame, self.out / "gc.csv")
        if self._writer is not None:
            for row in rows:
                tag = f"{row['label']}" + ("" if row["layer"] == "all" else f"/{row['layer']}")
                for column in ("abs_gc", "excess", "mean_gradient", "eigengap", "kernel_cka"):
                    value = row.get(column)
                    if value is not None and np.isfinite(value):
                        self._writer.add_scalar(f"gc/{tag}/{column}", float(value), step)
            self._writer.flush()

    @property
    def frame(self) -> pd.DataFrame:
        """Every row so far: step, label, layer, the :meth:`~ntkscope.GCResult.row` columns, kernel_cka, seconds."""
        frame = pd.DataFrame(self.rows)
        if frame.empty:
            return frame
        return frame[FRONT + [c for c in frame.columns if c not in FRONT]].sort_values(
            ["step", "layer", "label"], key=lambda s: s.astype(str) if s.name != "step" else s,
            kind="stable").reset_index(drop=True)

    def series(self, label: str | None = None, layer: str = "all") -> pd.DataFrame:
        """One subset's rows over steps at one layer: the table :func:`ntkscope.gc_series` returns."""
        frame = self.frame
        label = label if label is not None else next(iter(self.probes.groups))
        if label not in self.probes.groups:
            raise fail("GCTracker.series", "label", f"must be one of {list(self.probes.groups)}", label)
        rows = frame[(frame["label"] == label) & (frame["layer"].astype(str) == str(layer))]
        return rows.drop(columns=["label", "layer"]).reset_index(drop=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---- cost ---------------------------------------------------------------------------------

    @entry("GCTracker.estimate")
    def estimate(self, model) -> ProbeCost:
        """The seconds one probe will take, before it runs: the method table's estimate in
        forward and backward passes over the probe set times one such pass (timed on a slice of at
        most 16 probe sentences, scaled to the set by the cost model), plus the statistics: one
        eigendecomposition of a subset-sized kernel, timed, per jackknife replicate and null draw
        of every subset and band (per layer too with ``per_layer``)."""
        check_model("GCTracker.estimate", model)
        self._n_params = sum(p.numel() for p in model.parameters())
        probes = self.probes
        with _training_untouched(model), functional_model(model, self.options) as fm:
            w = workload(fm, probes.batch, opts=self.options)
            choice = choose("kernel", w)
            m = min(16, probes.n)
            part = take(w.data1, slice(0, m))
            params = {k: v.detach().requires_grad_(True) for k, v in fm.params.items()}
            times = []
            for _ in range(2):  # the first pass pays for warm-up
                start = time.perf_counter()
                with torch.enable_grad():
                    torch.autograd.grad(fm.outputs(params, part).sum(), list(params.values()), allow_unused=True)
                times.append(time.perf_counter() - start)
            pass_seconds = times[-1] * step_cost(fm, w.data1, probes.n) / step_cost(fm, w.data1, m)
            blocks = len(select_parameters(model, self.options.params, "layer").blocks) if self.per_layer else 0
        statistics = self._statistics_seconds() * (1 + blocks)
        # the loss-matched null's forward: none where the structured kernel's own forward keeps the losses
        wants = self.resampling is not None and self.controls == "auto" and choice.name != "structured"
        controls = pass_seconds / 3 if wants else 0.0
        self.cost = ProbeCost(choice.name, choice.steps, pass_seconds, statistics,
                              choice.steps * pass_seconds + controls + statistics)
        return self.cost

    def _statistics_seconds(self) -> float:
        r = self.resampling
        if r is None:
            return 0.0
        bands = 1 + (3 if self.controls == "auto" else 0)  # random; homogeneous, matched on length and loss
        sizes = [len(idx) for idx in self.probes.groups.values()]
        solves = sum(min(r.resamples, self.probes.n) + r.null_draws * bands for _ in sizes)
        x = np.random.default_rng(0).normal(size=(int(np.median(sizes)), 8))
        K = x @ x.T + np.eye(len(x))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            np.linalg.eigh(K)
            times.append(time.perf_counter() - start)
        return 2 * solves * min(times)  # an eigendecomposition and the products around it

    # ---- probing ------------------------------------------------------------------------------

    def __call__(self, step: int, metrics=None, model=None) -> None:
        """A ``cse_models.train`` callback: ``(step, metrics, model)``."""
        if model is None:
            raise fail("GCTracker", "model", "must be passed (callbacks receive (step, metrics, model))", model)
        self.step(model, step)

    @entry("GCTracker.step")
    def step(self, model, step: int) -> pd.DataFrame | None:
        """Call after every optimizer step (``step`` = steps done): probes when ``step`` is a
        multiple of ``every`` and returns that probe's rows, else None. The time between calls
        counts as training time for the overhead it logs."""
        check_model("GCTracker.step", model)
        check_step("GCTracker.step", step)
        now = time.perf_counter()
        if self._last_call is not None:
            self.train_seconds += now - self._last_call
        n_params = sum(p.numel() for p in model.parameters())
        if self.cost is not None and n_params != self._n_params:  # e.g. converted to sparse experts mid-run
            log.info("GCTracker: the model changed from %d to %d parameters since the last estimate; the probes "
                     "measure it as it is now (every parameter, experts included)", self._n_params, n_params)
            self.cost = None
        if self.cost is None:
            self._n_params = n_params
            cost = self.estimate(model)
            log.info("GCTracker: %d probe sentences, %d subsets%s, every %d steps: about %.1f s a probe (method %s, "
                     "%.2g forward+backward passes over the probes at %.2f s, statistics %.1f s)", self.probes.n,
                     len(self.probes.groups), ", per layer" if self.per_layer else "", self.every, cost.seconds,
                     cost.method, cost.passes, cost.pass_seconds, cost.statistics_seconds)
        rows = None
        if step > 0 and step % self.every == 0:
            rows = self.probe(model, step)
            share = sum(self.probe_seconds) / max(self.train_seconds, 1e-9)
            log.info("GCTracker: step %d probed in %.1f s; probes so far %.0f s, %.1f %% of the %.0f s of training "
                     "between them", step, self.probe_seconds[-1], sum(self.probe_seconds), 100 * share,
                     self.train_seconds)
        training_thresholds()  # training goes on: not under the kernel's malloc threshold (15 % slower steps)
        self._last_call = time.perf_counter()
        return rows

    @entry("GCTracker.probe")
    def probe(self, model, step: int) -> pd.DataFrame:
        """Measure now, at ``step``: one row per subset (and per layer with ``per_layer``)."""
        check_model("GCTracker.probe", model)
        check_step("GCTracker.probe", step)
        if distributed.active() and distributed.world()[1] > 1:  # its kernel would wait for ranks that train
            raise fail("GCTracker.probe", "world", "must be 1: the tracker runs in single-process training (measure "
                       "a data-parallel run's checkpoints afterwards with ntkscope gc RUN_DIR)", distributed.world()[1])
        start = time.perf_counter()
        probes = self.probes
        # no max_memory asked: the probe, small beside training, leaves training's malloc thresholds
        kept = training_thresholds_kept() if self.options.max_memory is None else nullcontext()
        with _training_untouched(model), kept:
            wants = self.resampling is not None and self.controls == "auto"
            ntk = empirical_ntk(model, probes.batch, blocks="layer" if self.per_layer else None, sample_loss=wants,
                                options=self.options)
            controls = None
            if wants:  # the loss-matched null's losses from the kernel's forward (a forward of their own otherwise)
                controls = resolve_loss(check_controls(analysis_controls(
                    model, probes.batch, pools=probes.pools, output=self.options.output, loss_from="kernel"),
                    probes.n), probes.n, ntk.sample_loss,
                    lambda loss: sample_outputs(model, probes.batch, output=loss).double().cpu().numpy())
        kernels = {"all": ntk.matrix}
        if self.per_layer:
            kernels.update(ntk.blocks)
        device = statistics_device(ntk.matrix)
        kernels = {name: k.detach().double().cpu().numpy() for name, k in kernels.items()}
        previous = self._previous_kernels(step)
        names, members = list(probes.groups), list(probes.groups.values())
        common = dict(method=ntk.method, dtype=ntk.dtype, output=ntk.output)
        rows = []
        for layer, K in kernels.items():
            cka = kernel_cka(K, previous[layer]) if layer in previous else float("nan")
            stats = kernel_statistics(K, members, self.resampling, controls, device)
            for name, fields in zip(names, stats):
                row = GCResult(label=name, **common, **fields).row()
                rows.append({"step": int(step), **row, "layer": layer, "kernel_cka": cka})
        seconds = time.perf_counter() - start
        for row in rows:
            row["seconds"] = seconds
        self.probe_seconds.append(seconds)
        self._save(int(step), kernels, rows)
        return pd.DataFrame(rows)[FRONT + [c for c in rows[0] if c not in FRONT]]
