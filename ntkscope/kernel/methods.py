"""The method table: every way to compute an NTK or its top eigenpair, in one place.

Each :class:`~ntkscope.kernel.options.Method` has one :class:`MethodSpec` row in
:data:`METHODS`: how it computes the kernel blocks (if it forms a kernel at all), how it
finds the top eigenpair, how much memory it needs, and which outputs it supports.
``"auto"`` is decided here alone, by :func:`choose`, from those rows: the first method of
:data:`AUTO_ORDER` whose memory estimate fits the budget, else the task's fallback, which
always fits (exact in panels for a kernel, matrix-free for eigenpairs). The command line
takes its ``--method`` choices from :func:`method_names` and refuses a combination that
:func:`unsupported` names.

Adding a method: a member of :class:`~ntkscope.kernel.options.Method`, its functions (in
:mod:`ntkscope.kernel.kernels` or :mod:`ntkscope.kernel.eigen`), and its row here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ntkscope.core.checks import InputError
from ntkscope.core.memory import format_bytes
from ntkscope.kernel.eigen import EigenResult, NTKOperator, dense_top_eigenpair, lanczos_top_eigenpair
from ntkscope.kernel.grads import FunctionalModel
from ntkscope.kernel.kernels import (
    exact_kernels,
    exact_memory,
    jl_error_bound,
    matrix_free_memory,
    projected_kernels,
    projected_memory,
)
from ntkscope.kernel.options import KernelOptions, Method

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Blocks:
    """What a kernel method returns: ``kernels`` {block: (n1, n2) or (K, n1, n2)}, the most
    gradient passes over one sample, and the projection's error bound (None when exact)."""

    kernels: dict
    gradient_passes: int
    error_bound: float | None = None


@dataclass(frozen=True)
class MethodSpec:
    """One row of the method table.

    Attributes
    ----------
    method : Method
    summary : str
        One line for ``--help`` and the docs.
    kernel : callable or None
        ``(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks``; None when the
        method never forms the kernel.
    eigen : callable
        ``(fm, data, n, chunk, budget, opts) -> (EigenResult, kernel (n, n) or None)``.
    memory : callable
        ``(fm, n1, n2, chunk, opts, symmetric) -> bytes`` held at the peak.
    vector_outputs : bool
        Whether vector outputs ("logits", "hidden-mean") are supported (eigenpairs need a scalar one).
    """

    method: Method
    summary: str
    kernel: Callable | None
    eigen: Callable
    memory: Callable
    vector_outputs: bool


def _exact_blocks(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks:
    kernels, passes = exact_kernels(fm, data1, data2, n1, n2, chunk, budget, reduction)
    return Blocks(kernels, passes)


def _projected_blocks(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks:
    kernels = projected_kernels(fm, data1, data2, n1, n2, chunk, reduction, opts)
    n_vectors = (n1 + n2) ** 2 * fm.n_outputs * len(kernels)
    return Blocks(kernels, 1, jl_error_bound(opts.projection_dim, n_vectors, opts.confidence))


def _dense_eigen(kernel_fn):
    def solve(fm, data, n, chunk, budget, opts):
        kernel = sum(kernel_fn(fm, data, None, n, n, chunk, budget, "trace", opts).kernels.values())
        return dense_top_eigenpair(kernel), kernel
    return solve


def _lanczos_eigen(fm, data, n, chunk, budget, opts):
    return lanczos_top_eigenpair(NTKOperator(fm, data, n, chunk), tol=opts.tol, ncv=opts.ncv), None


METHODS: dict[str, MethodSpec] = {
    Method.EXACT.value: MethodSpec(
        Method.EXACT, "per-sample gradients streamed into the Gram matrix (in panels when J does not fit)",
        _exact_blocks, _dense_eigen(_exact_blocks),
        lambda fm, n1, n2, chunk, opts, symmetric: exact_memory(fm, n1, n2, chunk), True),
    Method.PROJECTED.value: MethodSpec(
        Method.PROJECTED, "seeded random projection of each block, (JR)(JR)^T, with the JL error bound",
        _projected_blocks, _dense_eigen(_projected_blocks),
        lambda fm, n1, n2, chunk, opts, symmetric: projected_memory(fm, n1, n2, chunk, opts.projection_dim,
                                                                    symmetric), True),
    Method.MATRIX_FREE.value: MethodSpec(
        Method.MATRIX_FREE, "Lanczos on v -> J(J^T v) (one VJP and one JVP per matvec), memory O(P + n); "
        "eigenpairs only", None, _lanczos_eigen,
        lambda fm, n1, n2, chunk, opts, symmetric: matrix_free_memory(fm, n1, chunk), False),
}

_HOLDS = {Method.EXACT: "J", Method.PROJECTED: "its projections", Method.MATRIX_FREE: "the operator"}

#: ``"auto"``: the first of these whose memory fits; else the last, which always runs.
AUTO_ORDER = {"kernel": (Method.EXACT, Method.PROJECTED, Method.EXACT), "eigen": (Method.EXACT, Method.MATRIX_FREE)}


def method_names(task: str) -> list[str]:
    """``"auto"`` and the methods that can do ``task`` ("kernel" or "eigen")."""
    return ["auto"] + [name for name, spec in METHODS.items() if task == "eigen" or spec.kernel is not None]


def unsupported(task: str, method: str, *, scalar: bool) -> tuple[str, str] | None:
    """Why ``method`` cannot do ``task`` for a scalar or vector output, as (argument, rule it breaks),
    or None when it can."""
    if task == "eigen" and not scalar:
        return ("output", "must be a scalar output ('loss', 'true-logit', 'centred-true-logit', an LMLoss or a "
                          "callable returning (n,)) for an eigenvector over samples")
    if method == "auto":
        return None
    spec = METHODS[method]
    if task == "kernel" and spec.kernel is None:
        return ("method", f"must form the kernel, one of {method_names('kernel')} ({method!r} finds eigenpairs "
                          "without forming it)")
    if not scalar and not spec.vector_outputs:
        return ("method", "must support vector outputs (this one takes scalar outputs only)")
    return None


@dataclass(frozen=True)
class Choice:
    """The method that will run, why, and its memory estimate in bytes."""

    spec: MethodSpec
    reason: str
    memory: int

    @property
    def name(self) -> str:
        return self.spec.method.value


def choose(task: str, fm: FunctionalModel, n1: int, n2: int, chunk: int, budget: int, opts: KernelOptions,
           *, symmetric: bool = True) -> Choice:
    """The method for ``task`` under ``opts.method`` and a memory ``budget`` in bytes (the one "auto" rule)."""
    row = fm.n_outputs * fm.selection.n_params * fm.itemsize
    if task == "kernel" and 4 * chunk * row > budget and opts.method != Method.PROJECTED.value:
        raise InputError("max_memory", f"is too small for even one chunk of per-sample gradients "
                         f"({format_bytes(4 * chunk * row)} for chunk_size={chunk}, P={fm.selection.n_params}, "
                         f"K={fm.n_outputs}); select fewer params, a smaller chunk_size, or method='projected'", budget)

    def need(method: Method) -> int:
        return METHODS[method.value].memory(fm, n1, n2, chunk, opts, symmetric)

    if opts.method != "auto":
        spec = METHODS[opts.method]
        estimate = need(spec.method)
        if spec.method == Method.PROJECTED and estimate > budget:
            raise InputError("projection_dim", f"needs {format_bytes(estimate)} of projections, more than "
                             f"max_memory={format_bytes(budget)}; lower it or use method='exact'", opts.projection_dim)
        reason = "asked for"
        if spec.method == Method.EXACT and estimate > budget:
            reason += f"; J needs {format_bytes(estimate)} > max_memory {format_bytes(budget)}, so it runs in panels"
            estimate = budget
        return Choice(spec, reason, estimate)
    order = AUTO_ORDER[task]
    tried = []
    for method in order[:-1]:
        estimate = need(method)
        if estimate <= budget:
            tried.append(f"{_HOLDS[method]} fits ({format_bytes(estimate)} <= {format_bytes(budget)})")
            choice = Choice(METHODS[method.value], "auto: " + "; ".join(tried), estimate)
            break
        tried.append(f"{_HOLDS[method]} needs {format_bytes(estimate)} > {format_bytes(budget)}")
    else:
        last = order[-1]
        fallback = "exact in panels" if last == Method.EXACT else last.value
        choice = Choice(METHODS[last.value], "auto: " + "; ".join(tried + [fallback]), min(need(last), budget))
    log.info("%s: method=%r (%s)", task, choice.name, choice.reason)
    return choice


def solve_top(fm: FunctionalModel, data: dict, n: int, chunk: int, budget: int, opts: KernelOptions,
              *, method: str | None = None) -> tuple[EigenResult, torch.Tensor | None, str]:
    """Top eigenpair of the NTK of prepared ``data``: (EigenResult, kernel (n, n) or None, method name).

    ``method`` overrides ``opts.method`` (e.g. matrix-free for subsets once the whole set was).
    """
    if method is not None and method != opts.method:
        opts = KernelOptions.build(opts, method=method)
    choice = choose("eigen", fm, n, n, chunk, budget, opts)
    result, kernel = choice.spec.eigen(fm, data, n, chunk, budget, opts)
    return result, kernel, choice.name
