"""In-run GC: the gradient consistency of the training batch's own subsets, from the factors the
training step's backward already has.

For a linear map ``y = x W^T`` applied at every token, sample i's gradient is
``sum_t delta_it a_it^T`` (a: the layer's input, delta: the gradient of the loss at its output),
so the kernel of per-sample gradients is ``sum_{t,s} (a_it . a_js)(delta_it . delta_js)`` over
the layers (the "ghost" form; :mod:`ntkscope.kernel.factors` picks it or the per-sample
gradients, whichever is cheaper). The training step's forward holds every ``a`` and its
backward computes every ``delta``: :class:`InRunGC` keeps them with hooks, and :meth:`InRunGC.gc`
turns them into the kernel and the GC of each subset, with no second forward or backward.

What it measures, precisely: the NTK of the *training batch at the current weights* under the
training loss, restricted to the weights of the hooked linear layers (every ``nn.Linear`` and
HF ``Conv1D`` whose weight trains, by default; not embeddings, biases or norms), in the mode the
step ran (with dropout, if the model has it). It is not the kernel of a fixed probe set
(:class:`ntkscope.GCTracker`): each step sees other samples. A sample's gradient is its share
of the batch loss; with ``loss_terms`` (how many loss terms each sample has) it is rescaled to
the sample's mean token loss, the ``"loss"`` output of :func:`ntkscope.gradient_consistency_groups`,
which gives the same rows (tests/test_inrun.py). A global scale of the loss cancels in GC.

Not covered: a layer called twice in one forward with gradient checkpointing (the recomputed
forward adds a second use), and models that run their linear layers outside ``nn.Module`` calls.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from ntkscope.core.checks import InputError, check_positive_int, entry
from ntkscope.core.files import write_table
from ntkscope.gc.sketch import GradientSketch, SketchedGC
from ntkscope.kernel.factors import Linear, is_conv1d, pair_kernel
from ntkscope.kernel.uncertainty import GCResult, Resampling, kernel_gc

log = logging.getLogger(__name__)
WORK_ELEMENTS = 1 << 24  # elements a pair product's tiles may hold at once
HALF = (torch.float16, torch.bfloat16)
ESTIMATORS = ("exact", "sketch")  # InRunTracker's estimators


def _common(use: Linear) -> torch.dtype:
    """The dtype a layer's pair products take: its inputs' and gradients' common one, float32 at least."""
    dtype = torch.promote_types(use.a.dtype, use.delta.dtype)
    return torch.float32 if dtype in HALF else dtype


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _trained_linears(model: nn.Module) -> list:
    """Every linear layer whose weight trains and is its own (a head tied to an embedding is
    left out: its other use is not a linear layer's)."""
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    return [m for m in model.modules()
            if _is_linear(m) and m.weight.requires_grad and m.weight.data_ptr() not in embedded]


class InRunGC:
    """Hooks that keep each linear layer's inputs and output gradients of the last training step.

    Parameters
    ----------
    model : nn.Module
        The model being trained.
    modules : None or list of nn.Module
        The linear layers whose weights the kernel covers (default: every ``nn.Linear`` and HF
        ``Conv1D`` whose weight requires grad, less a head tied to the input embedding).

    Notes
    -----
    Use as a context manager around the training loop (or :meth:`attach` / :meth:`detach`);
    after each ``loss.backward()``, :meth:`gc` gives the GC of the batch's subsets. Only forwards
    of modules in training mode with gradients on are kept: an evaluation, or a
    :class:`~ntkscope.GCTracker`'s probe (eval mode) between steps, leaves the step's factors as
    they were. Shapes: the
    batch is (B, T); a layer's inputs (B, T, d_in), its output gradients (B, T, d_out).
    """

    @entry("InRunGC")
    def __init__(self, model: nn.Module, modules=None):
        if not isinstance(model, nn.Module):
            raise InputError("model", "must be a torch nn.Module", type(model).__name__)
        found = _trained_linears(model) if modules is None else list(modules)
        bad = [type(m).__name__ for m in found if not _is_linear(m)]
        if bad or not found:
            raise InputError("modules", "must be linear layers (nn.Linear or HF Conv1D) of the model, at least one",
                             bad or found)
        self.model, self.modules = model, found
        self.recording = True  #: False: the hooks keep nothing (InRunTracker between measured steps)
        self._hooks: list = []
        self._uses: dict = {}  # layer index -> its uses in the last step: {"a", "io", "delta"}
        self._backward_seen = False

    def attach(self) -> "InRunGC":
        if not self._hooks:
            self._hooks = [m.register_forward_hook(self._keep(i)) for i, m in enumerate(self.modules)]
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._uses, self._backward_seen = [], {}, False

    def __enter__(self) -> "InRunGC":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _keep(self, i: int):
        def hook(module, args, output):
            # a training step's forward only: not an evaluation's, nor a GCTracker's probe (eval mode)
            if not self.recording or not module.training or not torch.is_grad_enabled() or not output.requires_grad:
                return
            if module is not self.modules[i]:  # a copy made with the hook (an expert of a conversion): not hooked
                return
            if self._backward_seen:  # a new step's forward: drop the last one's factors
                self._uses, self._backward_seen = {}, False
            use = {"a": args[0].detach(), "io": not isinstance(module, nn.Linear)}
            self._uses.setdefault(i, []).append(use)

            def grad(g):
                use["delta"] = g.detach()
                self._backward_seen = True
            output.register_hook(grad)
        return hook

    def factors(self) -> list:
        """Per hooked layer, its :class:`~ntkscope.kernel.factors.Linear` factors of the last step."""
        layers = []
        for i in range(len(self.modules)):
            uses = [u for u in self._uses.get(i, []) if "delta" in u]
            if uses:
                layers.append([Linear(u["a"].reshape(u["a"].shape[0], -1, u["a"].shape[-1]),
                                      u["delta"].reshape(u["delta"].shape[0], -1, u["delta"].shape[-1]), u["io"])
                               for u in uses])
        return layers

    def kernel(self, loss_terms=None, *, dtype=None) -> np.ndarray:
        """The (B, B) kernel of the last step's per-sample gradients over the hooked weights, in
        float64; ``loss_terms`` (B,): each sample's number of loss terms, to read the mean token
        loss's kernel (module docstring); ``dtype``: of the pair products (default the factors'
        own, as training computed them; torch.float64 for a reference)."""
        layers = self.factors()
        if not layers:
            raise InputError("InRunGC.kernel", "needs a training step first: no layer has both its inputs and its "
                             "output gradients (call it after loss.backward(), inside the hooks' context)", None)
        K = None
        for uses in layers:
            if dtype is None:  # mixed precision (bf16=True, autocast): inputs and gradients in one dtype, float32+
                uses = [u if u.a.dtype == u.delta.dtype and u.a.dtype not in HALF else
                        Linear(u.a.to(_common(u)), u.delta.to(_common(u)), u.io) for u in uses]
            else:
                uses = [Linear(u.a.to(dtype), u.delta.to(dtype), u.io) for u in uses]
            for p, fa in enumerate(uses):
                for q, fb in enumerate(uses):
                    block, _ = pair_kernel(fa, fb, WORK_ELEMENTS, symmetric=p == q)
                    K = block.double() if K is None else K + block.double()
        if loss_terms is not None:
            terms = torch.as_tensor(loss_terms, dtype=K.dtype, device=K.device).reshape(-1)
            if terms.shape != (K.shape[0],) or bool((terms <= 0).any()):
                raise InputError("loss_terms", f"must give each of the {K.shape[0]} samples a positive count",
                                 terms.tolist())
            K = K / terms[:, None] / terms[None, :]
        # a pair product's mirrored tiles are exact, its diagonal tiles symmetric to the GEMM's rounding
        # only (3e-8 on GPT-2 small's shape in float32): the kernel is symmetric by definition
        return ((K + K.T) / 2).cpu().numpy()

    def gc(self, labels, *, loss_terms=None, min_count: int = 2, resampling: Resampling | None = None,
           dtype=None) -> list[GCResult]:
        """GC of every group of ``labels`` (B,) (e.g. domains or frequency bins of the batch's
        samples) against the whole batch, on :meth:`kernel` (``resampling``: intervals, as
        :func:`ntkscope.kernel_gc`; default none, the point values). Groups under ``min_count``
        samples are left out; ``loss_terms``, ``dtype``: :meth:`kernel`'s. Returns one
        :class:`~ntkscope.GCResult` per group, labelled."""
        K = self.kernel(loss_terms, dtype=dtype)
        groups = batch_groups(labels, K.shape[0], min_count)
        found = kernel_gc(K, [idx for _, idx in groups], resampling=resampling)
        return [dataclasses.replace(r, label=lab) for r, (lab, _) in zip(found, groups)]

    def sketched_gc(self, labels, sketch: GradientSketch, directions: SketchedGC, *, loss_terms=None,
                    min_count: int = 2) -> list[GCResult]:
        """:meth:`gc`'s point values from the step's gradient sketches (:mod:`ntkscope.gc.sketch`):
        ``sketch`` makes them, ``directions`` keeps the primary directions from one call to the next."""
        layers = self.factors()
        if not layers:
            raise InputError("InRunGC.sketched_gc", "needs a training step first: no layer has both its inputs and "
                             "its output gradients (call it after loss.backward(), inside the hooks' context)", None)
        S = sketch.sketch(layers, loss_terms)
        return directions.gc(S, batch_groups(labels, S.shape[0], min_count))


def batch_groups(labels, n: int, min_count: int) -> list:
    """(label, sorted indices) of each group of ``labels`` (n,) with at least ``max(2, min_count)``
    samples; refused when none is, or when the only one is the whole batch (GC 1 by construction)."""
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise InputError("labels", f"must give one label per sample of the batch, shape ({n},)", labels.shape)
    groups = [(lab, np.flatnonzero(labels == lab)) for lab in sorted(set(labels.tolist()), key=str)]
    groups = [(lab, idx) for lab, idx in groups if idx.size >= max(2, min_count)]
    if len(groups) == 1 and groups[0][1].size == n:  # the whole batch: GC = 1 by construction
        raise InputError("labels", "must hold two or more groups: one group is the whole batch, whose GC "
                         "against the batch is 1 by construction", sorted(set(labels.tolist()), key=str))
    if not groups:
        raise InputError("labels", f"has no group of at least {max(2, min_count)} samples", labels.tolist())
    return groups


class InRunTracker:
    """In-run GC every ``every`` steps of a training run, as rows of a table (``out/inrun.csv``).

    Parameters
    ----------
    model : nn.Module or None
        The model being trained; hooked at once (:class:`InRunGC`), so that the next step's
        forward and backward are kept. None: hooked by :meth:`begin` (``cse_models.train`` calls
        it with the model it builds, before the first step).
    every : int
        Measure at steps that are multiples of ``every`` (1: every step).
    out : path or None
        Directory for ``inrun.csv`` (written at :meth:`close`, atomically); None: :attr:`frame` only.
    min_count : int
        A group of the batch with fewer samples is left out at that step.
    modules : None or list of nn.Module
        As for :class:`InRunGC`.
    estimator : {"exact", "sketch"}
        "exact": the kernel of the per-sample gradients (:meth:`InRunGC.gc`); "sketch": the same
        point values from CountSketches of width ``width`` of each sample's gradient
        (:mod:`ntkscope.gc.sketch`: no per-sample gradient formed, a fraction of the exact
        kernel's cost; its cost and its agreement with the exact rows, close where their direction
        is defined, are measured in docs/tracking.md).
    width, seed : int
        The sketch's width and seed ("sketch" only).

    Notes
    -----
    A ``cse_models.train`` callback as it is: ``train(cfg, callbacks=[InRunTracker(every=10,
    out=...)])`` reads each step's batch domains from the step's ``metrics["domains"]`` (the
    training loop gives them). A layer replaced during the run (a CSE conversion) is no longer
    hooked: start another tracker after it. In any other loop call :meth:`step` after ``loss.backward()`` with the batch's
    labels (its domains, its frequency bins, "tail"/"rest"). Each row is one group of one step's
    batch, at the weights that step started from (module docstring); ``seconds`` counts what the
    in-run GC took and ``train_seconds`` the time between calls, whose ratio :attr:`overhead` is.
    """

    @entry("InRunTracker")
    def __init__(self, model: nn.Module | None = None, *, every: int = 1, out=None, min_count: int = 2,
                 modules=None, estimator: str = "exact", width: int = 16, seed: int = 0):
        check_positive_int("every", every)
        check_positive_int("min_count", min_count)
        if estimator not in ESTIMATORS:
            raise InputError("estimator", f"must be one of {ESTIMATORS}", estimator)
        self.estimator = estimator
        self.sketch = GradientSketch(width, seed) if estimator == "sketch" else None
        self.directions = SketchedGC()
        if out is not None and not isinstance(out, (str, os.PathLike)):
            raise InputError("out", "must be a directory path or None", type(out).__name__)
        if out is not None and Path(out).exists() and not Path(out).is_dir():  # refused now, not after training
            raise InputError("out", "must be a directory (it exists and is not one)", str(out))
        self.hooks, self.modules = None, modules
        self.every, self.min_count = every, min_count
        if model is not None:
            self.begin(model)
        self.out = None if out is None else Path(out)
        self.rows: list[dict] = []
        self.measured = self.one_group = 0  # steps measured; of them, batches of one group (no row)
        self.seconds = self.train_seconds = 0.0
        self._last: float | None = None

    def begin(self, model: nn.Module) -> None:
        """Hook ``model`` (before its first step, which is kept whatever its number)."""
        if self.hooks is None:
            self.hooks = InRunGC(model, self.modules).attach()

    def _arm(self, done: int) -> None:
        """Keep the factors of the next step only when it is measured (the hooks cost nothing else)."""
        self.hooks.recording = (done + 1) % self.every == 0

    @property
    def frame(self) -> pd.DataFrame:
        """Every row so far: step, then :meth:`~ntkscope.GCResult.row`'s columns."""
        return pd.DataFrame(self.rows)

    @property
    def overhead(self) -> float:
        """The in-run GC's seconds as a share of the training time between calls."""
        return self.seconds / self.train_seconds if self.train_seconds > 0 else math.nan

    @entry("InRunTracker.step")
    def step(self, model: nn.Module, step: int, labels, *, loss_terms=None) -> list[GCResult] | None:
        """After a step's backward: at a multiple of ``every``, the GC of each group of ``labels``
        (B,) in that step's batch (:meth:`InRunGC.gc`), kept as rows; else None."""
        now = time.perf_counter()
        if self._last is not None:
            self.train_seconds += now - self._last
        if self.hooks is None or model is not self.hooks.model:
            raise InputError("model", "must be the model this tracker hooked (InRunTracker(model) or begin(model))",
                             type(model).__name__)
        results = None
        if step % self.every == 0:
            _, counts = np.unique(np.asarray(labels, dtype=str), return_counts=True)
            results = []  # a batch with no group of min_count samples has no row (training goes on)
            self.measured += 1
            if len(counts) == 1:  # one group is the whole batch: GC = 1 by construction, never a row
                self.one_group += 1
            elif (counts >= max(2, self.min_count)).any():
                if self.sketch is None:
                    results = self.hooks.gc(labels, loss_terms=loss_terms, min_count=self.min_count)
                else:
                    results = self.hooks.sketched_gc(labels, self.sketch, self.directions, loss_terms=loss_terms,
                                                     min_count=self.min_count)
            self.rows += [{"step": int(step), **r.row()} for r in results]
        self._arm(step)
        self._last = time.perf_counter()
        self.seconds += self._last - now
        return results

    @entry("InRunTracker")
    def __call__(self, step: int, metrics=None, model=None) -> None:
        """A ``cse_models.train`` callback: ``(step, metrics, model)``, the batch's domains in
        ``metrics["domains"]``."""
        if not isinstance(metrics, dict) or "domains" not in metrics:
            raise InputError("metrics", "must carry the batch's domains (metrics['domains'], as cse_models.train "
                             "gives them); in another loop call InRunTracker.step(model, step, labels)", metrics)
        self.step(model, step, metrics["domains"])

    def close(self) -> None:
        """Remove the hooks and write ``out/inrun.csv``."""
        if self.hooks is not None:
            self.hooks.detach()
        if self.one_group:
            log.warning("InRunTracker: %d of %d measured steps had a batch of one group (its GC against the batch "
                        "is 1 by construction): no row for them", self.one_group, self.measured)
        if self.out is not None and self.rows:
            self.out.mkdir(parents=True, exist_ok=True)
            write_table(self.frame, self.out / "inrun.csv")
