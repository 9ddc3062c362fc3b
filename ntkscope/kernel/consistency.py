"""The primary gradient direction and gradient consistency (GC).

``g(X) = u_max^T J(X)`` is computed as one weighted backward pass,
``g(X) = grad_theta sum_i u_i f(x_i)`` (exact, no J needed). GC of a subset
``X' of X`` is ``cos(g(X), g(X'))`` where ``g(X')`` uses the top eigenvector of
the NTK of ``X'`` alone (docs/design.md §1).

When the whole set's kernel Theta is at hand (methods ``"exact"`` and
``"projected"``), no gradient is needed at all: ``g(X) . g(X') = u^T Theta[:, S] u'``,
``|g(X)|^2 = lambda`` and ``|g(X')|^2 = lambda'``, so

    GC(X') = u^T Theta[:, S] u' / sqrt(lambda lambda')

and every subset costs only an eigendecomposition of ``Theta[S, S]``; so do its jackknife
interval, bias, sign confidence and null bands (:mod:`ntkscope.kernel.uncertainty`). The
matrix-free method computes the two directions, and the two mean gradients, by weighted
backward passes; without a kernel it reports the point value, the conditioning and the
mean-gradient consistency, and no interval or null band.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import InputError, entry
from ntkscope.kernel.eigen import EigenResult
from ntkscope.kernel.distributed import weighted_gradient
from ntkscope.kernel.grads import functional_model
from ntkscope.kernel.methods import solve_top
from ntkscope.kernel.ntk import scalar_workload
from ntkscope.kernel.objectives import LossRecorder, batch_size, sample_outputs, take
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.nulls import Controls, check_controls, resolve_loss, wants_loss
from ntkscope.kernel.uncertainty import (GCResult, Resampling, check_resampling, conditioning_flags,
                                         kernel_statistics, statistics_device)


@dataclass(frozen=True)
class DirectionResult:
    """The primary gradient direction ``g(X) = u_max^T J(X)``.

    Attributes
    ----------
    vector : Tensor of shape (P,)
        Flat, in the order of ``names`` (use ``unflatten`` for per-parameter views).
    eigen : EigenResult
        The eigenpair behind it; ``|vector|^2 = eigen.eigenvalue``.
    names, shapes : tuples
        The selected parameters and their shapes.
    method : str
    """

    vector: torch.Tensor
    eigen: EigenResult
    names: tuple
    shapes: tuple
    method: str

    def unflatten(self) -> dict:
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            out[name] = self.vector[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out


@dataclass(frozen=True)
class GCGroups:
    """GC of every group of a labelling against the whole set.

    Attributes
    ----------
    results : dict of label to GCResult
        Groups with at least ``min_count`` samples.
    skipped : dict of label to int
        Groups left out for having fewer samples, with their counts.
    """

    results: dict
    skipped: dict = field(default_factory=dict)

    def to_frame(self):
        """A pandas DataFrame, one :meth:`GCResult.row` per group: label, gc and its interval,
        abs_gc and its interval, the null band, versus_null, sign_confidence, gc_signed,
        mean_gradient and its interval, flags, sizes, eigenvalues, eigengaps, cos_ones, method."""
        return pd.DataFrame([r.row() for r in self.results.values()])


def subset_indices(subset, n: int, labels=None) -> np.ndarray:
    """Sorted unique sample indices of a subset given as indices, a boolean mask, or a label."""
    if labels is not None:
        labels = _as_array(labels)
        if labels.shape != (n,):
            raise InputError("labels", f"must have one label per sample, shape ({n},)", labels.shape)
        idx = np.flatnonzero(labels == subset)
        if idx.size == 0:
            raise InputError("subset", "must be a label present in labels", subset)
    else:
        arr = _as_array(subset)
        if arr.dtype == bool:
            if arr.shape != (n,):
                raise InputError("subset", f"as a boolean mask must have shape ({n},)", arr.shape)
            idx = np.flatnonzero(arr)
        elif arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer):
            if arr.size and (arr.min() < 0 or arr.max() >= n):
                raise InputError("subset", f"must hold indices in [0, {n})", arr.tolist()[:10])
            idx = np.unique(arr)
            if idx.size != arr.size:
                raise InputError("subset", "must not repeat an index", arr.tolist()[:10])
        else:
            raise InputError("subset", "must be a list of indices, a boolean mask, or a label with labels=", subset)
    if idx.size < 2:
        raise InputError("subset", "must hold at least 2 samples (an NTK eigenvector needs 2); size", int(idx.size))
    return idx


def _as_array(x) -> np.ndarray:
    if torch.is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def _clip(x: float) -> float:
    return float(min(1.0, max(-1.0, x)))


@entry("principal_direction")
def principal_direction(model, batch, *, options: KernelOptions | None = None, **fields) -> DirectionResult:
    """The primary gradient direction ``g(X) = u_max^T J(X)`` of shape (P,), by one weighted backward.

    ``options`` / ``**fields`` are those of :func:`ntkscope.ntk_top_eigenpair`, which finds ``u_max``.

    Returns
    -------
    DirectionResult
    """
    opts = KernelOptions.build(options, **fields)
    with functional_model(model, opts) as fm:
        w = scalar_workload(fm, batch, opts)
        data, chunk = w.data1, w.chunk
        eig, _, used = solve_top(w)
        u = torch.as_tensor(eig.eigenvector, dtype=fm.dtype, device=fm.device)
        g = weighted_gradient(fm, data, u, chunk)
        return DirectionResult(g, eig, fm.selection.names, fm.selection.shapes, used)


def _gc_many(model, batch, subsets: Sequence, names: Sequence, opts: KernelOptions, resampling, controls) -> list:
    """GC of each index array in ``subsets`` against the whole batch; the whole set is solved once."""
    with functional_model(model, opts) as fm:
        w = scalar_workload(fm, batch, opts)
        data, n, chunk = w.data1, w.n1, w.chunk
        recorder = LossRecorder(n) if wants_loss(controls) else None  # the loss-matched null's covariate
        fm.objective.recorder = recorder  # kept from the kernel's own forward where it runs one
        try:
            whole, kernel, used = solve_top(w)
        finally:
            fm.objective.recorder = None
        common = dict(method=used, dtype=fm.dtype, output=fm.objective.name)
        if kernel is not None:
            recorded = recorder.values() if recorder is not None else None
            controls = resolve_loss(controls, n, recorded,
                                    lambda loss: sample_outputs(model, batch, output=loss).double().cpu().numpy())
            K = kernel.detach().double().cpu().numpy()  # (n, n)
            stats = kernel_statistics(K, list(subsets), resampling, controls, device=statistics_device(kernel))
            return [GCResult(label=label, **common, **fields) for fields, label in zip(stats, names)]
        u = torch.as_tensor(whole.eigenvector, dtype=fm.dtype, device=fm.device)
        g = weighted_gradient(fm, data, u, chunk)  # (P,)
        mean = weighted_gradient(fm, data, torch.full((n,), 1.0 / n, dtype=fm.dtype, device=fm.device), chunk)
        cos_ones = float(whole.eigenvector.sum() / n ** 0.5)
        results = []
        for idx, label in zip(subsets, names):
            m = len(idx)
            sub_data = take(data, torch.as_tensor(idx, device=fm.device))
            sub, _, _ = solve_top(w.of(sub_data, m), method="matrix-free")
            u_s = torch.as_tensor(sub.eigenvector, dtype=fm.dtype, device=fm.device)
            g_s = weighted_gradient(fm, sub_data, u_s, chunk)
            ones_s = torch.full((m,), 1.0 / m, dtype=fm.dtype, device=fm.device)
            mean_s = weighted_gradient(fm, sub_data, ones_s, chunk)
            cos_sub = float(sub.eigenvector.sum() / m ** 0.5)
            flags = () if resampling is None else conditioning_flags(whole.eigengap, cos_ones, sub.eigengap, cos_sub,
                                                                     resampling)
            results.append(GCResult(
                score=_clip(_cos(g, g_s)), eigenvalue=whole.eigenvalue, eigengap=whole.eigengap, cos_ones=cos_ones,
                eigenvalue_subset=sub.eigenvalue, eigengap_subset=sub.eigengap, cos_ones_subset=cos_sub,
                mean_gradient=_clip(_cos(mean, mean_s)), n=n, n_subset=m, label=label, flags=flags,
                resampling=resampling, matvecs=whole.matvecs + sub.matvecs, **common))
        return results


@entry("gradient_consistency")
def gradient_consistency(model, batch, subset, *, labels=None, resampling: Resampling | None = Resampling(),
                         controls: Controls | None = None, options: KernelOptions | None = None,
                         **fields) -> GCResult:
    """Gradient consistency ``GC(X') = cos(g(X), g(X'))`` of a subset of ``batch``.

    Parameters
    ----------
    model, batch
        As for :func:`ntkscope.empirical_ntk`; the output must be scalar.
    subset : sequence of int, boolean mask of shape (n,), or a label
        The subset X' (at least 2 samples). A label needs ``labels``.
    labels : array-like of shape (n,), optional
        One label per sample; ``subset`` is then the label of X'.
    resampling : Resampling or None
        The interval, bias, sign confidence, null band and flag thresholds
        (:class:`~ntkscope.Resampling`; default: jackknife of at most 200 deletions, 200 null
        draws, 90 %, seed 0). They come from the kernel (methods "exact" and "projected") and
        cost eigendecompositions only; the matrix-free method reports the conditioning flags
        but no interval or band. ``None``: the point value and conditioning only.
    controls : Controls or None
        Null bands beside the random one (:class:`~ntkscope.Controls`: homogeneous pools or
        gradient-space neighbours, covariate-matched draws); kernel methods only.
    options, **fields
        :class:`~ntkscope.KernelOptions` or its fields. ``method``: "auto" (the cheapest
        estimate that fits in memory), "exact", "structured", "matrix-free" or "projected".

    Returns
    -------
    GCResult
    """
    opts = KernelOptions.build(options, **fields)
    check_resampling(resampling)
    n = batch_size(batch)
    controls = check_controls(controls, n)
    idx = subset_indices(subset, n, labels)
    (result,) = _gc_many(model, batch, [idx], [subset if labels is not None else None], opts, resampling, controls)
    return result


@entry("gradient_consistency_groups")
def gradient_consistency_groups(model, batch, labels, *, min_count=2, resampling: Resampling | None = Resampling(),
                                controls: Controls | None = None, options: KernelOptions | None = None,
                                **fields) -> GCGroups:
    """GC of every group of ``labels`` (e.g. frequency bins, domains) against the whole batch.

    The whole set's NTK and eigenvector are computed once. Groups with fewer than
    ``min_count`` samples (at least 2) are skipped and reported. The jackknife (or bootstrap)
    leaves out (resamples) every group within itself and the rest of the set within itself, so
    all groups' intervals come from the same replicates. ``resampling``, ``controls``,
    ``options`` / ``**fields`` as for :func:`gradient_consistency`.

    Returns
    -------
    GCGroups
    """
    opts = KernelOptions.build(options, **fields)
    check_resampling(resampling)
    n = batch_size(batch)
    labels = _as_array(labels)
    if labels.shape != (n,):
        raise InputError("labels", f"must have one label per sample, shape ({n},)", labels.shape)
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 2:
        raise InputError("min_count", "must be an integer >= 2", min_count)
    controls = check_controls(controls, n)
    kept, skipped = [], {}
    for label in sorted(set(labels.tolist()), key=str):
        idx = np.flatnonzero(labels == label)
        if idx.size >= min_count:
            kept.append((label, idx))
        else:
            skipped[label] = int(idx.size)
    if not kept:
        raise InputError("labels", f"has no group with at least min_count={min_count} samples; group sizes", skipped)
    results = _gc_many(model, batch, [i for _, i in kept], [lab for lab, _ in kept], opts, resampling, controls)
    return GCGroups({r.label: r for r in results}, skipped)
