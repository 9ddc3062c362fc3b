"""The method table: every way to compute an NTK or its top eigenpair, in one place.

Each :class:`~ntkscope.kernel.options.Method` has one :class:`MethodSpec` row in
:data:`METHODS`: how it computes the kernel blocks (if it forms a kernel at all), how it
finds the top eigenpair, how much memory and how many multiply-adds it needs, and which
outputs it supports. ``"auto"`` is decided here alone, by :func:`choose`, from those rows:
the cheapest estimate among the exact methods that fit the memory budget (exact and
structured run in panels when they do not fit), and the projection only when it is far
cheaper; the estimates, in training steps, are the reason recorded in a result. The command line
takes its ``--method`` choices from :func:`method_names` and refuses a combination that
:func:`unsupported` names.

Adding a method: a member of :class:`~ntkscope.kernel.options.Method`, its functions (in
:mod:`ntkscope.kernel.kernels` or :mod:`ntkscope.kernel.eigen`), and its row here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ntkscope.core.checks import InputError
from ntkscope.core.memory import format_bytes
from ntkscope.kernel import distributed
from ntkscope.kernel.eigen import EigenResult, NTKOperator, dense_top_eigenpair, lanczos_top_eigenpair
from ntkscope.kernel.grads import FunctionalModel
from ntkscope.kernel.kernels import (
    exact_kernels,
    exact_panel,
    exact_memory,
    jl_error_bound,
    matrix_free_memory,
    projected_kernels,
    projected_memory,
)
from ntkscope.kernel.options import KernelOptions, Method
from ntkscope.kernel.structured import held_bytes, layout, pair_cost, probe, structured_kernels, work_elements

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
        ``(task, fm, data, n1, n2, chunk, opts, symmetric) -> bytes`` held at the peak when nothing
        has to be streamed.
    cost : callable
        ``(task, fm, data, n1, n2, chunk, budget, opts, symmetric) -> multiply-adds``, the estimate
        "auto" compares (:func:`step_cost` is one forward and backward over the n1 samples).
    vector_outputs : bool
        Whether vector outputs ("logits", "hidden-mean") are supported (eigenpairs need a scalar one).
    approximate : bool
        Whether the result is an estimate (then "auto" takes it only when it is far cheaper).
    """

    method: Method
    summary: str
    kernel: Callable | None
    eigen: Callable
    memory: Callable
    cost: Callable
    vector_outputs: bool
    approximate: bool = False


def _exact_blocks(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks:
    compute = distributed.exact_kernels if distributed.active() else exact_kernels
    kernels, passes = compute(fm, data1, data2, n1, n2, chunk, budget, reduction)
    return Blocks(kernels, passes)


def _structured_blocks(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks:
    compute = distributed.structured_kernels if distributed.active() else structured_kernels
    kernels, costs = compute(fm, data1, data2, n1, n2, budget, opts.chunk_size)
    return Blocks(kernels, costs.passes)


def _projected_blocks(fm, data1, data2, n1, n2, chunk, budget, reduction, opts) -> Blocks:
    compute = distributed.projected_kernels if distributed.active() else projected_kernels
    kernels = compute(fm, data1, data2, n1, n2, chunk, reduction, opts)
    n_vectors = (n1 + n2) ** 2 * fm.n_outputs * len(kernels)
    return Blocks(kernels, 1, jl_error_bound(opts.projection_dim, n_vectors, opts.confidence))


def _dense_eigen(kernel_fn):
    def solve(fm, data, n, chunk, budget, opts):
        kernel = sum(kernel_fn(fm, data, None, n, n, chunk, budget, "trace", opts).kernels.values())
        return dense_top_eigenpair(kernel), kernel
    return solve


def _lanczos_eigen(fm, data, n, chunk, budget, opts):
    operator = (distributed.ShardedNTKOperator if distributed.active() else NTKOperator)(fm, data, n, chunk)
    return lanczos_top_eigenpair(operator, tol=opts.tol, ncv=opts.ncv), None


# ---- the cost model: multiply-adds, compared by "auto" and reported in training steps --------------

#: A per-sample gradient by vmap costs about two batched forward+backward passes per sample
#: (measured, benchmarks/README.md: exact = 1.9-2.3 training steps); a matrix-free matvec is one VJP
#: and one JVP over the batch, about two; the single Lanczos run from the all-ones vector needs 7-10 of them.
_VMAP_FACTOR, _MATVEC_FACTOR, _MATVECS = 2.0, 2.0, 10


def tokens_per_sample(data: dict) -> int:
    """T: the length of a sample's token ids (1 for inputs without token ids, e.g. features)."""
    inputs = data["inputs"]
    ids = inputs if torch.is_tensor(inputs) else inputs.get("input_ids") if isinstance(inputs, dict) else None
    if torch.is_tensor(ids) and ids.dim() >= 2 and not ids.is_floating_point():
        return int(ids.shape[1])
    return 1


def step_cost(fm: FunctionalModel, data: dict, n: int) -> float:
    """Multiply-adds of one forward and backward over n samples: 3 T P per sample."""
    return 3.0 * n * tokens_per_sample(data) * fm.selection.n_params


def _sample_passes(n1: int, n2: int, panel: int, symmetric: bool) -> float:
    """Per-sample computations when ``panel`` rows are held and the rest streamed past each panel."""
    panels = math.ceil(n1 / max(1, panel))
    if symmetric:
        return n1 + sum(max(0, n1 - min(n1, (i + 1) * panel)) for i in range(panels))
    return n1 + panels * n2 if panels > 1 else n1 + n2


def _exact_cost(task, fm, data, n1, n2, chunk, budget, opts, symmetric):
    grads = _sample_passes(n1, n2, exact_panel(fm, n1, chunk, budget), symmetric)
    gram = n1 * n2 * fm.n_outputs * fm.selection.n_params / (2 if symmetric else 1)
    return _VMAP_FACTOR * step_cost(fm, data, 1) * grads + gram


def _structured_cost(task, fm, data, n1, n2, chunk, budget, opts, symmetric):
    pr = probe(fm, data, n1)
    panel, _, _ = layout(pr, n1, n2, budget, opts.chunk_size, symmetric)
    passes = _sample_passes(n1, n2, panel, symmetric)
    fallback = _VMAP_FACTOR * step_cost(fm, data, 1) * passes if pr.plan.fallback else 0.0
    products = pair_cost(pr, n1, n2, work_elements(budget, fm.itemsize))
    return step_cost(fm, data, 1) * passes + fallback + products / (2 if symmetric else 1)


def _structured_memory(task, fm, data, n1, n2, chunk, opts, symmetric):
    return held_bytes(probe(fm, data, n1), n1, n2, symmetric)


def _projected_cost(task, fm, data, n1, n2, chunk, budget, opts, symmetric):
    P, k, K = fm.selection.n_params, opts.projection_dim, fm.n_outputs
    n = n1 + (0 if symmetric else n2)
    chunks = math.ceil(n / max(1, chunk))
    return _VMAP_FACTOR * step_cost(fm, data, n) + n * K * P * k + 2 * chunks * P * k + n1 * n2 * K * k


def _matrix_free_cost(task, fm, data, n1, n2, chunk, budget, opts, symmetric):
    return _MATVECS * _MATVEC_FACTOR * step_cost(fm, data, n1)


METHODS: dict[str, MethodSpec] = {
    Method.EXACT.value: MethodSpec(
        Method.EXACT, "per-sample gradients (vmap) streamed into the Gram matrix (in panels when J does not fit)",
        _exact_blocks, _dense_eigen(_exact_blocks),
        lambda task, fm, data, n1, n2, chunk, opts, symmetric: exact_memory(fm, n1, n2, chunk), _exact_cost, True),
    Method.STRUCTURED.value: MethodSpec(
        Method.STRUCTURED, "exact, from each layer's inputs and output cotangents (one forward and backward of "
        "the batch; ghost or materialised per layer by a cost model); scalar outputs",
        _structured_blocks, _dense_eigen(_structured_blocks), _structured_memory, _structured_cost, False),
    Method.PROJECTED.value: MethodSpec(
        Method.PROJECTED, "seeded random projection of each block, (JR)(JR)^T, generated tile by tile "
        "(never stored), with the JL error bound",
        _projected_blocks, _dense_eigen(_projected_blocks),
        lambda task, fm, data, n1, n2, chunk, opts, symmetric: projected_memory(
            fm, n1, n2, chunk, opts.projection_dim, symmetric), _projected_cost, True, approximate=True),
    Method.MATRIX_FREE.value: MethodSpec(
        Method.MATRIX_FREE, "Lanczos on v -> J(J^T v) (one VJP and one JVP per matvec), memory O(P + n); "
        "eigenpairs only", None, _lanczos_eigen,
        lambda task, fm, data, n1, n2, chunk, opts, symmetric: matrix_free_memory(fm, n1, chunk),
        _matrix_free_cost, False),
}

#: An approximate method is taken by "auto" only when its estimate is this many times below the best exact one.
APPROXIMATE_GAIN = 4.0


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
    """The method that will run, why, its memory estimate in bytes, and its cost estimate in
    training steps (one forward and backward over the samples)."""

    spec: MethodSpec
    reason: str
    memory: int
    steps: float = float("nan")

    @property
    def name(self) -> str:
        return self.spec.method.value


def _candidates(task: str, scalar: bool) -> list:
    return [spec for name, spec in METHODS.items()
            if unsupported(task, name, scalar=scalar) is None and (task == "eigen" or spec.kernel is not None)]


def choose(task: str, fm: FunctionalModel, data: dict, n1: int, n2: int, chunk: int, budget: int,
           opts: KernelOptions, *, symmetric: bool = True) -> Choice:
    """The method for ``task`` under ``opts.method`` and a memory ``budget`` in bytes (the one "auto" rule).

    "auto": every method that can do the task is estimated (memory, and multiply-adds by its cost
    column); one whose memory does not fit runs in panels where it can (exact, structured) or is
    dropped; the cheapest exact estimate wins, and an approximate method (projected) only when it is
    :data:`APPROXIMATE_GAIN` times cheaper still. The estimates are in the reason.
    """
    row = fm.n_outputs * fm.selection.n_params * fm.itemsize
    if task == "kernel" and 4 * chunk * row > budget and opts.method == Method.EXACT.value:
        raise InputError("max_memory", f"is too small for even one chunk of per-sample gradients "
                         f"({format_bytes(4 * chunk * row)} for chunk_size={chunk}, P={fm.selection.n_params}, "
                         f"K={fm.n_outputs}); select fewer params, a smaller chunk_size, or method='structured' "
                         "or 'projected'", budget)
    step = step_cost(fm, data, n1)

    def estimate(spec: MethodSpec) -> tuple[int, float]:
        memory = spec.memory(task, fm, data, n1, n2, chunk, opts, symmetric)
        return memory, spec.cost(task, fm, data, n1, n2, chunk, budget, opts, symmetric) / max(step, 1.0)

    if opts.method != "auto":
        spec = METHODS[opts.method]
        memory, steps = estimate(spec)
        if spec.method == Method.PROJECTED and memory > budget:
            raise InputError("projection_dim", f"needs {format_bytes(memory)} of sketches, more than "
                             f"max_memory={format_bytes(budget)}; lower it or use method='exact'", opts.projection_dim)
        reason = f"asked for; about {steps:.3g} training steps"
        if spec.method in (Method.EXACT, Method.STRUCTURED) and memory > budget:
            reason += f"; needs {format_bytes(memory)} > max_memory {format_bytes(budget)}, so it runs in panels"
            memory = budget
        log.info("%s: method=%r (%s)", task, spec.method.value, reason)
        return Choice(spec, reason, memory, steps)
    rows = []
    for spec in _candidates(task, fm.scalar):
        if spec.method == Method.EXACT and 4 * chunk * row > budget:
            continue
        try:
            memory, steps = estimate(spec)
        except RuntimeError as err:  # e.g. the structured probe met data-dependent dispatch
            log.info("%s: %s left out of auto (%s)", task, spec.method.value, err)
            continue
        panels = memory > budget and spec.method in (Method.EXACT, Method.STRUCTURED)
        if memory > budget and not panels:
            continue
        rows.append((spec, min(memory, budget), steps, panels))
    exact = [r for r in rows if not r[0].approximate]
    best = min(exact, key=lambda r: r[2]) if exact else None
    approx = [r for r in rows if r[0].approximate and (best is None or r[2] * APPROXIMATE_GAIN < best[2])]
    chosen = min(approx, key=lambda r: r[2]) if approx else best
    if chosen is None:
        raise InputError("max_memory", "is too small for any method that can do this", format_bytes(budget))
    table = ", ".join(f"{r[0].method.value}{' in panels' if r[3] else ''} {r[2]:.3g} steps "
                      f"{format_bytes(r[1])}" for r in rows)
    choice = Choice(chosen[0], f"auto: cheapest estimate of [{table}] under {format_bytes(budget)}",
                    chosen[1], chosen[2])
    log.info("%s: method=%r (%s)", task, choice.name, choice.reason)
    return choice


def solve_top(fm: FunctionalModel, data: dict, n: int, chunk: int, budget: int, opts: KernelOptions,
              *, method: str | None = None) -> tuple[EigenResult, torch.Tensor | None, str]:
    """Top eigenpair of the NTK of prepared ``data``: (EigenResult, kernel (n, n) or None, method name).

    ``method`` overrides ``opts.method`` (e.g. matrix-free for subsets once the whole set was).
    """
    if method is not None and method != opts.method:
        opts = KernelOptions.build(opts, method=method)
    choice = choose("eigen", fm, data, n, n, chunk, budget, opts)
    result, kernel = choice.spec.eigen(fm, data, n, chunk, budget, opts)
    return result, kernel, choice.name
