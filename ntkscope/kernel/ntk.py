"""The public kernel entry points: the empirical NTK ``Theta = J J^T`` and its top eigenpair.

How each is computed is a row of the method table (:mod:`ntkscope.kernel.methods`):
``"exact"`` streams per-sample gradients into the Gram matrix (in panels when J does not
fit), ``"structured"`` builds the same kernel from each layer's inputs and output cotangents
(:mod:`ntkscope.kernel.structured`), ``"projected"`` sketches each block with a seeded random
projection and states the Johnson-Lindenstrauss bound, ``"matrix-free"`` (eigenpairs only)
runs Lanczos on ``v -> J (J^T v)``. ``"auto"`` takes the cheapest estimate that fits in
memory; the choice and the estimates behind it are stored in the result.

Shapes: scalar outputs give ``(n1, n2)``; vector outputs with ``reduction="trace"`` give
``(n1, n2)`` with ``Theta_ij = sum_k J_ik . J_jk`` (the plain sum: neural-tangents'
``trace_axes`` divides by K, this does not); ``reduction="diagonal"`` gives ``(K, n1, n2)``,
one kernel per output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ntkscope.core.checks import InputError, check_choice, entry
from ntkscope.kernel.eigen import EigenResult
from ntkscope.kernel.grads import functional_model
from ntkscope.kernel.methods import Workload, choose, method_names, solve_top, unsupported, workload
from ntkscope.kernel.objectives import LossRecorder
from ntkscope.kernel.options import KernelOptions

REDUCTIONS = ("trace", "diagonal")


@dataclass(frozen=True)
class NTKResult:
    """An empirical NTK and what produced it.

    Attributes
    ----------
    matrix : Tensor of shape (n1, n2), or (K, n1, n2) for ``reduction="diagonal"``
    blocks : dict of str to Tensor, or None
        One kernel per parameter block, same shape as ``matrix``; they sum to it.
    method : {"exact", "structured", "projected"}
    reason : str
        Why this method ran (asked for, or the memory estimate behind ``"auto"``).
    error_bound : float or None
        Projected only: with probability at least ``confidence``,
        ``|matrix_ij - Theta_ij| <= error_bound * sqrt(Theta(x_i, x_i) Theta(y_j, y_j))``
        for every i, j and every block (inf when k is too small to promise anything).
    gradient_passes : int
        The most times one sample's gradient was computed (1 unless exact ran in panels).
    sample_loss : ndarray of shape (n,) or None
        With ``sample_loss=True``: each sample's loss under the output's language-model objective,
        read from the kernel's own forward (the structured method runs one over every sample);
        None where the method ran none or the output is not a language model's.
    """

    matrix: torch.Tensor
    blocks: dict | None
    method: str
    reason: str
    output: str
    reduction: str | None
    dtype: torch.dtype
    n_params: int
    parameter_blocks: dict = field(repr=False)
    gradient_passes: int = 1
    projection: str | None = None
    projection_dim: int | None = None
    error_bound: float | None = None
    confidence: float | None = None
    memory_estimate: int = 0
    sample_loss: np.ndarray | None = field(default=None, repr=False)

    def numpy(self) -> np.ndarray:
        return self.matrix.detach().cpu().numpy()


@entry("empirical_ntk")
def empirical_ntk(model, batch, batch2=None, *, reduction="trace", blocks=None, sample_loss: bool = False,
                  options: KernelOptions | None = None, **fields) -> NTKResult:
    """Empirical NTK ``Theta(X1, X2) = J(X1) J(X2)^T`` of ``model`` (``X2 = X1`` when ``batch2`` is None).

    Parameters
    ----------
    model : nn.Module
    batch, batch2 : Tensor (n, ...) or dict of tensors
        n1 and n2 samples (``input_ids``, ``attention_mask`` for language models).
    reduction : {"trace", "diagonal"}
        For vector outputs: sum of the K per-output kernels (n1, n2), or all of them (K, n1, n2).
    blocks : None, {"param", "layer", "expert"}, mapping or callable
        Grouping of the Jacobian's columns (:func:`ntkscope.select_parameters`); with blocks,
        ``NTKResult.blocks`` holds one kernel per block, summing to ``matrix``.
    sample_loss : bool
        Also keep each sample's loss from the kernel's forward (``NTKResult.sample_loss``; one
        batch only): the loss-matched null's covariate with no forward of its own.
    options, **fields
        :class:`~ntkscope.KernelOptions`, or its fields as keywords (``output``, ``params``,
        ``method``, ``dtype``, ``chunk_size``, ``max_memory``, ``projection``,
        ``projection_dim``, ``seed``, ``confidence``, ``device``). ``method``: "auto" (the cheapest
        estimate that fits in memory, in the result's ``reason``), "exact", "structured" (scalar
        outputs) or "projected".

    Returns
    -------
    NTKResult
    """
    opts = KernelOptions.build(options, methods=method_names("kernel"), **fields)
    check_choice("reduction", reduction, set(REDUCTIONS))
    if not isinstance(sample_loss, bool):
        raise InputError("sample_loss", "must be true or false", sample_loss)
    with functional_model(model, opts, blocks=blocks) as fm:
        why = unsupported("kernel", opts.method, scalar=fm.scalar)
        if why:
            raise InputError(*why, opts.method if why[0] == "method" else fm.objective.name)
        w = workload(fm, batch, batch2, opts=opts)
        choice = choose("kernel", w)
        recorder = LossRecorder(w.n1) if sample_loss and batch2 is None else None
        fm.objective.recorder = recorder
        try:
            parts = choice.spec.kernel(w, reduction)
        finally:
            fm.objective.recorder = None
        kernels = parts.kernels
        matrix = sum(kernels.values()) if len(kernels) > 1 else next(iter(kernels.values()))
        projected = parts.error_bound is not None
        return NTKResult(
            matrix=matrix,
            blocks=kernels if blocks is not None else None,
            method=choice.name,
            reason=choice.reason,
            output=fm.objective.name,
            reduction=None if fm.scalar else reduction,
            dtype=fm.dtype,
            n_params=fm.selection.n_params,
            parameter_blocks=dict(fm.selection.blocks),
            gradient_passes=parts.gradient_passes,
            projection=opts.projection if projected else None,
            projection_dim=opts.projection_dim if projected else None,
            error_bound=parts.error_bound,
            confidence=opts.confidence if projected else None,
            memory_estimate=choice.memory,
            sample_loss=None if recorder is None else recorder.values(),
        )


def scalar_workload(fm, batch, opts: KernelOptions) -> Workload:
    """The symmetric :class:`~ntkscope.kernel.methods.Workload` of ``batch``, once the output is
    checked to be scalar (an eigenvector over samples needs one)."""
    why = unsupported("eigen", opts.method, scalar=fm.scalar)
    if why:
        raise InputError(*why, fm.objective.name)
    return workload(fm, batch, opts=opts)


@entry("ntk_top_eigenpair")
def ntk_top_eigenpair(model, batch, *, options: KernelOptions | None = None, **fields) -> EigenResult:
    """Top eigenpair (lambda_max, u_max) of the NTK of ``batch`` for a scalar output.

    Parameters
    ----------
    model, batch
        As for :func:`empirical_ntk`.
    options, **fields
        :class:`~ntkscope.KernelOptions` or its fields. ``method``: "auto" (the cheapest
        estimate that fits in memory: a dense ``eigh`` of an exact or structured kernel, or
        matrix-free Lanczos with memory O(P + n)), "exact", "structured", "matrix-free" or
        "projected"; ``tol`` is the matrix-free method's Lanczos tolerance.

    Returns
    -------
    EigenResult
        ``eigenvector`` has shape (n,).
    """
    opts = KernelOptions.build(options, **fields)
    with functional_model(model, opts) as fm:
        result, _, _ = solve_top(scalar_workload(fm, batch, opts))
        return result


@entry("cosine_kernel")
def cosine_kernel(matrix) -> np.ndarray:
    """``Θ_ij / sqrt(Θ_ii Θ_jj)``: the cosine of the per-sample gradients, in [-1, 1] (n, n)."""
    k = np.asarray(matrix.detach().cpu() if torch.is_tensor(matrix) else matrix, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise InputError("matrix", "must be a square (n, n) kernel", k.shape)
    d = np.sqrt(np.clip(np.diag(k), np.finfo(np.float64).tiny, None))
    return k / d[:, None] / d[None, :]
