"""The empirical neural tangent kernel ``Theta = J J^T`` and its blocks.

Two ways, chosen by ``method``:

``"exact"``
    Per-sample gradients are computed chunk by chunk and written into a panel
    of J rows held in memory; the Gram matrix is one matmul per block. When all
    of J fits in ``max_memory`` this is one gradient pass (the fast case). When
    it does not, rows are held in panels that fit and the other rows are
    streamed past each panel in chunks (recomputed, never stored), so memory
    is one panel plus one chunk, at the cost of extra gradient passes.
``"projected"``
    A seeded Gaussian or Rademacher matrix ``R_b`` of shape (P_b, k) per block,
    ``Theta_b ~ (J_b R_b)(J_b R_b)^T``; one gradient pass, memory ``P k`` for
    the projections plus one chunk, independent of n. The result states the
    Johnson-Lindenstrauss bound it implies (see :func:`jl_error_bound`).
``"auto"``
    ``"exact"`` if all of J fits, else ``"projected"`` if its projections fit,
    else exact in panels. The choice and the reason are logged and stored in
    ``NTKResult.method`` / ``NTKResult.reason``.

Shapes: scalar outputs give ``(n1, n2)``; vector outputs with
``reduction="trace"`` give ``(n1, n2)`` with ``Theta_ij = sum_k J_ik . J_jk``
(the plain sum: neural-tangents' ``trace_axes`` divides by K, this does not);
``reduction="diagonal"`` gives ``(K, n1, n2)``, one kernel per output.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import brentq

from ntkscope._checks import check_choice, check_fraction, check_positive_int, fail, format_bytes
from ntkscope.grads import (
    FunctionalModel,
    default_chunk_size,
    functional_model,
    jacobian_rows,
    resolve_budget,
)
from ntkscope.objectives import batch_size, take

log = logging.getLogger(__name__)

METHODS = ("auto", "exact", "projected")
REDUCTIONS = ("trace", "diagonal")
PROJECTIONS = ("gaussian", "rademacher")


@dataclass(frozen=True)
class NTKResult:
    """An empirical NTK and what produced it.

    Attributes
    ----------
    matrix : Tensor of shape (n1, n2), or (K, n1, n2) for ``reduction="diagonal"``
    blocks : dict of str to Tensor, or None
        One kernel per parameter block, same shape as ``matrix``; they sum to it.
    method : {"exact", "projected"}
    reason : str
        Why this method ran (asked for, or the memory estimate behind ``"auto"``).
    error_bound : float or None
        Projected only: with probability at least ``confidence``,
        ``|matrix_ij - Theta_ij| <= error_bound * sqrt(Theta(x_i, x_i) Theta(y_j, y_j))``
        for every i, j and every block (inf when k is too small to promise anything).
    gradient_passes : int
        The most times one sample's gradient was computed (1 unless exact ran in panels).
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

    def numpy(self) -> np.ndarray:
        return self.matrix.detach().cpu().numpy()


def jl_error_bound(k: int, n_vectors: int, confidence: float = 0.95) -> float:
    """Relative inner-product error that a (P, k) JL projection keeps with probability ``confidence``.

    For a Gaussian ``R`` with N(0, 1/k) entries (Rademacher +-1/sqrt(k) is at least
    as concentrated, Achlioptas 2003), ``P(| |Rx|^2 - |x|^2 | > eps |x|^2) <=
    2 exp(-k (eps^2/2 - eps^3/3) / 2)`` (Dasgupta & Gupta 2003). Polarisation,
    ``<x, y> = (|x+y|^2 - |x-y|^2) / 4``, turns norm errors on x +- y into
    ``|<Rx, Ry> - <x, y>| <= eps |x| |y|``. A union bound over ``n_vectors`` such
    vectors gives the eps returned here; ``inf`` if no eps < 1 reaches the confidence.
    """
    delta = 1.0 - confidence
    target = 2.0 * math.log(2.0 * n_vectors / delta) / k  # need eps^2/2 - eps^3/3 >= target

    def gap(eps):
        return eps * eps / 2 - eps ** 3 / 3 - target

    if gap(1.0) < 0:
        return math.inf
    return float(brentq(gap, 1e-12, 1.0))


def _gram(A: torch.Tensor, B: torch.Tensor, cols: slice, reduction: str | None) -> torch.Tensor:
    """Rows of A (a, K, P) against rows of B (b, K, P) over columns ``cols``: (a, b) or (K, a, b)."""
    if A.shape[1] == 1:
        return A[:, 0, cols] @ B[:, 0, cols].T  # (a, Pb) @ (Pb, b) -> (a, b)
    if reduction == "trace":
        return torch.einsum("akp,bkp->ab", A[:, :, cols], B[:, :, cols])
    return torch.einsum("akp,bkp->kab", A[:, :, cols], B[:, :, cols])


def _place(out: dict, name: str, G: torch.Tensor, r: slice, c: slice, mirror: bool) -> None:
    out[name][..., r, c] = G
    if mirror:
        out[name][..., c, r] = G.transpose(-1, -2)


def _exact(fm: FunctionalModel, data1, data2, n1, n2, chunk, budget, reduction):
    """Exact NTK blocks; returns ({block: kernel}, gradient passes)."""
    sel, K, P = fm.selection, fm.n_outputs, fm.selection.n_params
    row_bytes = K * P * fm.itemsize
    symmetric = data2 is None
    panel = int(min(n1, max(0, budget - 3 * chunk * row_bytes) // row_bytes))
    kshape = (K,) if (K > 1 and reduction == "diagonal") else ()
    out = {b: torch.zeros(*kshape, n1, n2, dtype=fm.dtype, device=fm.device) for b in sel.blocks}
    chunk_buf = torch.empty(chunk, K, P, dtype=fm.dtype, device=fm.device)
    passes = np.zeros(n1 + (0 if symmetric else n2), dtype=int)
    for a0 in range(0, n1, panel):
        a1 = min(n1, a0 + panel)
        JA = torch.empty(a1 - a0, K, P, dtype=fm.dtype, device=fm.device)  # (a, K, P) panel of J
        for c0 in range(a0, a1, chunk):
            c1 = min(a1, c0 + chunk)
            jacobian_rows(fm, take(data1, slice(c0, c1)), JA[c0 - a0 : c1 - a0], c0)
        passes[a0:a1] += 1
        rows = slice(a0, a1)
        if symmetric:
            for name, (s, e) in sel.blocks.items():
                _place(out, name, _gram(JA, JA, slice(s, e), reduction), rows, rows, False)
            start, stop, src, offset = a1, n1, data1, 0
        else:
            start, stop, src, offset = 0, n2, data2, n1
        for b0 in range(start, stop, chunk):
            b1 = min(stop, b0 + chunk)
            JB = chunk_buf[: b1 - b0]
            jacobian_rows(fm, take(src, slice(b0, b1)), JB, b0)
            passes[offset + b0 : offset + b1] += 1
            for name, (s, e) in sel.blocks.items():
                _place(out, name, _gram(JA, JB, slice(s, e), reduction), rows, slice(b0, b1), symmetric)
    return out, int(passes.max())


def _projections(fm: FunctionalModel, k: int, kind: str, seed: int) -> dict:
    """One seeded (P_b, k) matrix per block; entries N(0, 1/k) or +-1/sqrt(k)."""
    seeds = np.random.SeedSequence(seed).spawn(len(fm.selection.blocks))
    mats = {}
    for (name, (s, e)), ss in zip(fm.selection.blocks.items(), seeds):
        gen = torch.Generator(device=fm.device).manual_seed(int(ss.generate_state(1)[0]))
        R = torch.empty(e - s, k, device=fm.device, dtype=fm.dtype)  # filled in place: no second copy
        if kind == "gaussian":
            R.normal_(0.0, 1.0 / math.sqrt(k), generator=gen)
        else:
            R.bernoulli_(0.5, generator=gen).mul_(2.0 / math.sqrt(k)).sub_(1.0 / math.sqrt(k))
        mats[name] = R
    return mats


def _projected(fm: FunctionalModel, data1, data2, n1, n2, chunk, reduction, k, kind, seed):
    sel, K, P = fm.selection, fm.n_outputs, fm.selection.n_params
    R = _projections(fm, k, kind, seed)
    buf = torch.empty(chunk, K, P, dtype=fm.dtype, device=fm.device)

    def sketch(data, n):
        Z = {b: torch.empty(n, K, k, dtype=fm.dtype, device=fm.device) for b in sel.blocks}
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            J = buf[: c1 - c0]
            jacobian_rows(fm, take(data, slice(c0, c1)), J, c0)
            for name, (s, e) in sel.blocks.items():
                Z[name][c0:c1] = J[:, :, s:e] @ R[name]  # (c, K, Pb) @ (Pb, k) -> (c, K, k)
        return Z

    Z1 = sketch(data1, n1)
    Z2 = Z1 if data2 is None else sketch(data2, n2)
    full = slice(0, k)
    return {b: _gram(Z1[b], Z2[b], full, reduction) for b in sel.blocks}


def empirical_ntk(model, batch, batch2=None, *, output="loss", reduction="trace", params=None, blocks=None,
                  method="auto", dtype=None, chunk_size=None, max_memory=None, projection="gaussian",
                  projection_dim=1024, seed=0, confidence=0.95) -> NTKResult:
    """Empirical NTK ``Theta(X1, X2) = J(X1) J(X2)^T`` of ``model`` (``X2 = X1`` when ``batch2`` is None).

    Parameters
    ----------
    model : nn.Module
    batch, batch2 : Tensor (n, ...) or dict of tensors
        n1 and n2 samples (``input_ids``, ``attention_mask`` for language models).
    output : "loss", "logits", "hidden-mean", LMLoss or callable
        What f is; see :mod:`ntkscope.objectives`.
    reduction : {"trace", "diagonal"}
        For vector outputs: sum of the K per-output kernels (n1, n2), or all of them (K, n1, n2).
    params, blocks
        Jacobian columns and their grouping; see :func:`ntkscope.select_parameters`.
        With blocks, ``NTKResult.blocks`` holds one kernel per block, summing to ``matrix``.
    method : {"auto", "exact", "projected"}
        See the module docstring. ``"auto"`` is exact whenever J fits in memory.
    dtype : torch.dtype or str, optional
        Compute in this dtype on a cast copy of the model ("float64" for reference runs).
    chunk_size : int, optional
        Samples per vmap call (default up to 8).
    max_memory : int, optional
        Bytes the computation may hold (default: half the free memory of the model's device).
    projection, projection_dim, seed, confidence
        ``"gaussian"`` or ``"rademacher"``, k columns per block, the RNG seed, and
        the probability at which ``error_bound`` is stated.

    Returns
    -------
    NTKResult
    """
    func = "empirical_ntk"
    check_choice(func, "method", method, set(METHODS))
    check_choice(func, "reduction", reduction, set(REDUCTIONS))
    check_choice(func, "projection", projection, set(PROJECTIONS))
    check_positive_int(func, "chunk_size", chunk_size, allow_none=True)
    check_positive_int(func, "projection_dim", projection_dim)
    check_fraction(func, "confidence", confidence)
    with functional_model(func, model, output=output, params=params, blocks=blocks, dtype=dtype) as fm:
        n1 = batch_size(func, batch, "batch")
        n2 = n1 if batch2 is None else batch_size(func, batch2, "batch2")
        data1 = fm.prepare(batch, "batch")
        data2 = None if batch2 is None else fm.prepare(batch2, "batch2")
        budget = resolve_budget(func, max_memory, fm.device)
        chunk = chunk_size or default_chunk_size(max(n1, n2), fm, budget)
        chosen, reason, estimate = _choose(fm, method, n1, n2, chunk, budget, projection_dim, batch2 is None)
        if chosen == "exact":
            kernels, passes = _exact(fm, data1, data2, n1, n2, chunk, budget, reduction)
            bound = None
        else:
            kernels = _projected(fm, data1, data2, n1, n2, chunk, reduction, projection_dim, projection, seed)
            passes = 1
            n_vectors = (n1 + n2) ** 2 * fm.n_outputs * len(kernels)
            bound = jl_error_bound(projection_dim, n_vectors, confidence)
        matrix = sum(kernels.values()) if len(kernels) > 1 else next(iter(kernels.values()))
        return NTKResult(
            matrix=matrix,
            blocks=kernels if blocks is not None else None,
            method=chosen,
            reason=reason,
            output=fm.objective.name,
            reduction=None if fm.scalar else reduction,
            dtype=fm.dtype,
            n_params=fm.selection.n_params,
            parameter_blocks=dict(fm.selection.blocks),
            gradient_passes=passes,
            projection=projection if chosen == "projected" else None,
            projection_dim=projection_dim if chosen == "projected" else None,
            error_bound=bound,
            confidence=confidence if chosen == "projected" else None,
            memory_estimate=estimate,
        )


def exact_memory(fm: FunctionalModel, n1: int, n2: int, chunk: int) -> int:
    """Bytes for exact in one pass: all n1 rows of J, a chunk's working set, the kernels."""
    row = fm.n_outputs * fm.selection.n_params * fm.itemsize
    kernels = (len(fm.selection.blocks) + 1) * fm.n_outputs * n1 * n2 * fm.itemsize
    return n1 * row + 3 * chunk * row + kernels


def _choose(fm, method, n1, n2, chunk, budget, k, symmetric):
    """(method, reason, memory estimate in bytes) for ``method`` in METHODS."""
    K, P, isz = fm.n_outputs, fm.selection.n_params, fm.itemsize
    row = K * P * isz
    exact_bytes = exact_memory(fm, n1, n2, chunk)
    kernels = (len(fm.selection.blocks) + 1) * K * n1 * n2 * isz
    sketches = (n1 + (0 if symmetric else n2)) * K * k * len(fm.selection.blocks) * isz
    proj_bytes = P * k * isz + 3 * chunk * row + sketches + kernels
    if 4 * chunk * row > budget and method != "projected":
        raise fail("empirical_ntk", "max_memory", f"is too small for even one chunk of per-sample gradients "
                   f"({format_bytes(4 * chunk * row)} for chunk_size={chunk}, P={P}, K={K}); "
                   "select fewer params, a smaller chunk_size, or method='projected'", budget)
    if method == "exact":
        reason = "asked for"
        if exact_bytes > budget:
            reason += f"; J needs {format_bytes(exact_bytes)} > max_memory {format_bytes(budget)}, so it runs in panels"
        return "exact", reason, min(exact_bytes, budget)
    if method == "projected":
        if proj_bytes > budget:
            raise fail("empirical_ntk", "projection_dim", f"needs {format_bytes(proj_bytes)} of projections, more than "
                       f"max_memory={format_bytes(budget)}; lower it or use method='exact'", k)
        return "projected", "asked for", proj_bytes
    if exact_bytes <= budget:
        reason = f"auto: J fits ({format_bytes(exact_bytes)} <= {format_bytes(budget)})"
        chosen, estimate = "exact", exact_bytes
    elif proj_bytes <= budget:
        reason = (f"auto: J needs {format_bytes(exact_bytes)} > {format_bytes(budget)}; "
                  f"projections need {format_bytes(proj_bytes)}")
        chosen, estimate = "projected", proj_bytes
    else:
        reason = f"auto: neither J nor its projections fit {format_bytes(budget)}; exact in panels"
        chosen, estimate = "exact", budget
    log.info("empirical_ntk: method=%r (%s)", chosen, reason)
    return chosen, reason, estimate


def cosine_kernel(matrix) -> np.ndarray:
    """``Θ_ij / sqrt(Θ_ii Θ_jj)``: the cosine of the per-sample gradients, in [-1, 1] (n, n)."""
    k = np.asarray(matrix.detach().cpu() if torch.is_tensor(matrix) else matrix, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise fail("cosine_kernel", "matrix", "must be a square (n, n) kernel", k.shape)
    d = np.sqrt(np.clip(np.diag(k), np.finfo(np.float64).tiny, None))
    return k / d[:, None] / d[None, :]
