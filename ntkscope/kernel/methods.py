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

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ntkscope.core.checks import InputError, UserError
from ntkscope.core.memory import format_bytes, kernel_thresholds
from ntkscope.kernel import distributed
from ntkscope.kernel.eigen import EigenResult, NTKOperator, dense_top_eigenpair, lanczos_top_eigenpair
from ntkscope.kernel.grads import (ALLOCATOR_RESERVE, VMAP_FACTOR, FunctionalModel, Transient, asked_memory,
                                   default_chunk_size, memory_budget, step_cost,
                                   vmap_transient)
from ntkscope.kernel.kernels import (
    exact_kernels,
    exact_memory,
    exact_minimum,
    exact_panel,
    jl_error_bound,
    kernel_bytes,
    matrix_free_memory,
    projected_kernels,
    projected_memory,
    sample_passes,
)
from ntkscope.kernel.objectives import batch_size
from ntkscope.kernel.options import KernelOptions, Method
from ntkscope.kernel.structured import probe, structured_kernels
from ntkscope.kernel.structured_layout import held_bytes, layout, layout_cost, minimum_budget, work_elements

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
        ``(workload, reduction) -> Blocks``; None when the method never forms the kernel.
    eigen : callable
        ``(workload) -> (EigenResult, kernel (n, n) or None)`` (a symmetric workload).
    memory : callable
        ``(task, workload) -> bytes`` held at the peak when nothing has to be streamed: the
        method's own tensors and the measured transient of a chunk's forward and backward.
    minimum : callable
        ``(task, workload) -> bytes``: the smallest ``max_memory`` it runs in (in panels where it can).
    cost : callable
        ``(task, workload) -> multiply-adds``, the estimate "auto" compares (:func:`step_cost` is
        one forward and backward over the n1 samples).
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
    minimum: Callable
    cost: Callable
    vector_outputs: bool
    approximate: bool = False


@dataclass(frozen=True)
class Workload:
    """One kernel computation, made once per call by :func:`workload`: the functional model, the
    prepared data (``data2`` None: the symmetric K(X, X)), the sample counts, the samples per vmap
    call (``chunk``), the memory ``budget`` in bytes that layouts may fill (``max_memory``, the budget
    asked for or the default, less :data:`ALLOCATOR_RESERVE`), the options, and whether the processes of a
    distributed run share the work (``sharded``, decided once here)."""

    fm: FunctionalModel
    data1: dict
    data2: dict | None
    n1: int
    n2: int
    chunk: int
    budget: int
    opts: KernelOptions
    sharded: bool
    max_memory: int

    @property
    def symmetric(self) -> bool:
        return self.data2 is None

    def of(self, data: dict, n: int) -> "Workload":
        """The symmetric workload of ``n`` prepared rows ``data`` (e.g. a subset), all else the same."""
        return dataclasses.replace(self, data1=data, data2=None, n1=n, n2=n)


def workload(fm: FunctionalModel, batch, batch2=None, *, opts: KernelOptions) -> Workload:
    """The :class:`Workload` of ``batch`` (and ``batch2``; None: the symmetric kernel of ``batch``)."""
    n1 = batch_size(batch, "batch")
    n2 = n1 if batch2 is None else batch_size(batch2, "batch2")
    data1 = fm.prepare(batch, "batch")
    data2 = None if batch2 is None else fm.prepare(batch2, "batch2")
    asked = asked_memory(opts.max_memory, fm.device)
    if fm.device.type == "cpu":
        kernel_thresholds()  # so that what is freed stops counting against the budget
    budget = memory_budget(asked)
    chunk = opts.chunk_size or default_chunk_size(max(n1, n2), fm, budget)
    return Workload(fm, data1, data2, n1, n2, chunk, budget, opts, distributed.active(), asked)


def _asked(nbytes: int) -> int:
    """Bytes a layout holds, as the ``max_memory`` that leaves room for them."""
    return int(nbytes / (1 - ALLOCATOR_RESERVE)) + 1


# ---- memory: what each method holds, with a chunk's measured transient ------------------------------


def _row(w: Workload) -> int:
    return w.fm.n_outputs * w.fm.selection.n_params * w.fm.itemsize


def _vmap_transient(w: Workload) -> Transient:
    """The per-sample-gradient probe's transient, or a guess of three rows of J a sample where even
    the probe (a row of J and its gradient) would not fit the budget."""
    if 3 * _row(w) + kernel_bytes(w.fm, w.n1, w.n2) > w.budget:
        return Transient(3 * _row(w), False)
    return vmap_transient(w.fm, w.data1)


def _vmap_chunk(w: Workload, fixed: int, share: float) -> int:
    """Samples per vmap call: ``w.chunk`` as asked, else the largest default whose rows of J and
    transient take at most ``share`` of the budget beside ``fixed`` bytes (at least 1)."""
    if w.opts.chunk_size:
        return w.chunk
    t, row = _vmap_transient(w), _row(w)
    chunk = w.chunk
    while chunk > 1 and fixed + chunk * row + t.bytes(chunk) > share * w.budget:
        chunk -= 1
    return chunk


def _exact_chunk(w: Workload) -> tuple[int, int]:
    """(chunk, its transient bytes) for exact: beside one held row of J and the kernels, in half the
    budget (panels of J rows get the other half)."""
    chunk = _vmap_chunk(w, kernel_bytes(w.fm, w.n1, w.n2) + _row(w), 0.5)
    return chunk, _vmap_transient(w).bytes(chunk)


def _exact_memory(task: str, w: Workload) -> int:
    chunk, transient = _exact_chunk(w)
    return exact_memory(w.fm, w.n1, w.n2, chunk, transient)


def _exact_minimum(task: str, w: Workload) -> int:
    return exact_minimum(w.fm, w.n1, w.n2, _vmap_transient(w).bytes(1))


def _projected_chunk(w: Workload) -> int:
    sketches = projected_memory(w.fm, w.n1, w.n2, 0, w.opts.projection_dim, w.symmetric, 0)
    return _vmap_chunk(w, sketches, 1.0)  # no panels: all of the budget


def _projected_memory(task: str, w: Workload, chunk: int | None = None) -> int:
    chunk = _projected_chunk(w) if chunk is None else chunk
    return projected_memory(w.fm, w.n1, w.n2, chunk, w.opts.projection_dim, w.symmetric,
                            _vmap_transient(w).bytes(chunk))


def _structured_memory(task: str, w: Workload) -> int:
    pr, kernels = probe(w.fm, w.data1, w.n1, w.budget), kernel_bytes(w.fm, w.n1, w.n2)
    _, _, chunk = layout(pr, w.n1, w.n2, w.budget, w.opts.chunk_size, w.symmetric, kernels)
    return held_bytes(pr, w.n1, w.n2, w.symmetric, kernels, chunk)


def _structured_minimum(task: str, w: Workload) -> int:
    return minimum_budget(probe(w.fm, w.data1, w.n1, w.budget), w.n1, w.n2, w.symmetric,
                          kernel_bytes(w.fm, w.n1, w.n2))


def _matrix_free_memory(task: str, w: Workload) -> int:
    return matrix_free_memory(w.fm, w.n1, w.chunk)


# ---- the kernel and eigenpair columns ---------------------------------------------------------------


def _exact_blocks(w: Workload, reduction: str) -> Blocks:
    compute = distributed.exact_kernels if w.sharded else exact_kernels
    chunk, transient = _exact_chunk(w)
    kernels, passes = compute(w.fm, w.data1, w.data2, w.n1, w.n2, chunk, w.budget, reduction, transient)
    return Blocks(kernels, passes)


def _structured_blocks(w: Workload, reduction: str) -> Blocks:
    compute = distributed.structured_kernels if w.sharded else structured_kernels
    kernels, costs = compute(w.fm, w.data1, w.data2, w.n1, w.n2, w.budget, w.opts.chunk_size)
    return Blocks(kernels, costs.passes)


def _projected_blocks(w: Workload, reduction: str) -> Blocks:
    compute = distributed.projected_kernels if w.sharded else projected_kernels
    kernels = compute(w.fm, w.data1, w.data2, w.n1, w.n2, _projected_chunk(w), reduction, w.opts)
    n_vectors = (w.n1 + w.n2) ** 2 * w.fm.n_outputs * len(kernels)
    return Blocks(kernels, 1, jl_error_bound(w.opts.projection_dim, n_vectors, w.opts.confidence))


def _dense_eigen(kernel_fn):
    def solve(w: Workload):
        kernel = sum(kernel_fn(w, "trace").kernels.values())
        return dense_top_eigenpair(kernel), kernel
    return solve


def _lanczos_eigen(w: Workload):
    operator = (distributed.ShardedNTKOperator if w.sharded else NTKOperator)(w.fm, w.data1, w.n1, w.chunk)
    return lanczos_top_eigenpair(operator, tol=w.opts.tol, ncv=w.opts.ncv), None


# ---- the cost model: multiply-adds, compared by "auto" and reported in training steps --------------

#: A matrix-free matvec is one VJP and one JVP over the batch, about two forward+backward passes;
#: the single Lanczos run from the all-ones vector needs 7-10 of them.
_MATVEC_FACTOR, _MATVECS = 2.0, 10


def _exact_cost(task: str, w: Workload) -> float:
    chunk, transient = _exact_chunk(w)
    grads = sample_passes(w.n1, w.n2, exact_panel(w.fm, w.n1, w.n2, chunk, w.budget, transient), w.symmetric)
    gram = w.n1 * w.n2 * w.fm.n_outputs * w.fm.selection.n_params / (2 if w.symmetric else 1)
    return VMAP_FACTOR * step_cost(w.fm, w.data1, 1) * grads + gram


def _structured_cost(task: str, w: Workload) -> float:
    pr = probe(w.fm, w.data1, w.n1, w.budget)
    panel, stream, _ = layout(pr, w.n1, w.n2, w.budget, w.opts.chunk_size, w.symmetric,
                              kernel_bytes(w.fm, w.n1, w.n2))
    return layout_cost(pr, w.n1, w.n2, panel, stream, w.symmetric, work_elements(w.budget, w.fm.itemsize))


def _projected_cost(task: str, w: Workload) -> float:
    P, k, K = w.fm.selection.n_params, w.opts.projection_dim, w.fm.n_outputs
    n = w.n1 + (0 if w.symmetric else w.n2)
    chunks = math.ceil(n / max(1, _projected_chunk(w)))
    return VMAP_FACTOR * step_cost(w.fm, w.data1, n) + n * K * P * k + 2 * chunks * P * k + w.n1 * w.n2 * K * k


def _matrix_free_cost(task: str, w: Workload) -> float:
    return _MATVECS * _MATVEC_FACTOR * step_cost(w.fm, w.data1, w.n1)


METHODS: dict[str, MethodSpec] = {
    Method.EXACT.value: MethodSpec(
        Method.EXACT, "per-sample gradients (vmap) streamed into the Gram matrix (in panels when J does not fit)",
        _exact_blocks, _dense_eigen(_exact_blocks), _exact_memory, _exact_minimum, _exact_cost, True),
    Method.STRUCTURED.value: MethodSpec(
        Method.STRUCTURED, "exact, from each layer's inputs and output cotangents (one forward and backward of "
        "the batch; ghost or materialised per layer by a cost model); scalar outputs",
        _structured_blocks, _dense_eigen(_structured_blocks), _structured_memory, _structured_minimum,
        _structured_cost, False),
    Method.PROJECTED.value: MethodSpec(
        Method.PROJECTED, "seeded random projection of each block, (JR)(JR)^T, generated tile by tile "
        "(never stored), with the JL error bound",
        _projected_blocks, _dense_eigen(_projected_blocks), _projected_memory,
        lambda task, w: _projected_memory(task, w, 1), _projected_cost, True, approximate=True),
    Method.MATRIX_FREE.value: MethodSpec(
        Method.MATRIX_FREE, "Lanczos on v -> J(J^T v) (one VJP and one JVP per matvec), memory O(P + n); "
        "eigenpairs only", None, _lanczos_eigen, _matrix_free_memory, _matrix_free_memory, _matrix_free_cost, False),
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


def choose(task: str, w: Workload, *, method: str | None = None) -> Choice:
    """The method for ``task`` on workload ``w`` under ``method`` (default ``w.opts.method``) and
    ``w.budget`` bytes (the one "auto" rule).

    "auto": every method that can do the task is estimated (memory, and multiply-adds by its cost
    column); one whose memory does not fit runs in panels where it can (exact, structured) or is
    dropped; the cheapest exact estimate wins, and an approximate method (projected) only when it is
    :data:`APPROXIMATE_GAIN` times cheaper still. The estimates are in the reason.
    """
    fm, budget, asked, given = w.fm, w.budget, method or w.opts.method, format_bytes(w.max_memory)
    step = step_cost(fm, w.data1, w.n1)

    def estimate(spec: MethodSpec) -> tuple[int, float]:
        return spec.memory(task, w), spec.cost(task, w) / max(step, 1.0)

    if asked != "auto":
        spec = METHODS[asked]
        minimum = spec.minimum(task, w)
        if minimum > budget:
            hint = {Method.EXACT: "use method='structured' or 'projected', or select fewer params",
                    Method.PROJECTED: "lower projection_dim, or use method='structured'",
                    }.get(spec.method, "select fewer params or use fewer samples")
            raise InputError("max_memory", f"is too small for method={asked!r} here: it needs at least "
                             f"{format_bytes(_asked(minimum))} (the measured forward and backward of a chunk "
                             f"included); give at least that, or {hint}", given)
        memory, steps = estimate(spec)
        reason = f"asked for; about {steps:.3g} training steps"
        if spec.method in (Method.EXACT, Method.STRUCTURED) and memory > budget:
            reason += f"; needs {format_bytes(_asked(memory))} > max_memory {given}, so it runs in panels"
            memory = budget
        log.info("%s: method=%r (%s)", task, spec.method.value, reason)
        return Choice(spec, reason, _asked(memory), steps)
    rows, minimums, failed = [], {}, {}
    candidates = list(_candidates(task, fm.scalar))
    for spec in candidates:
        try:
            minimums[spec.method.value] = minimum = spec.minimum(task, w)
            if minimum > budget:
                continue
            memory, steps = estimate(spec)
        except RuntimeError as err:  # e.g. the structured probe met data-dependent dispatch
            log.info("%s: %s left out of auto (%s)", task, spec.method.value, err)
            failed[spec.method.value] = str(err).splitlines()[0][:160]
            continue
        panels = memory > budget and spec.method in (Method.EXACT, Method.STRUCTURED)
        if memory > budget and not panels:
            continue
        rows.append((spec, min(memory, budget), steps, panels))
    exact = [r for r in rows if not r[0].approximate]
    best = min(exact, key=lambda r: r[2]) if exact else None
    approx = [r for r in rows if r[0].approximate and (best is None or r[2] * APPROXIMATE_GAIN < best[2])]
    chosen = min(approx, key=lambda r: r[2]) if approx else best
    if chosen is None and failed and len(failed) == len(candidates):  # none ran: not a memory question
        raise UserError(f"{task}: every method failed on this model, before any memory limit applied ("
                        + "; ".join(f"{m}: {e}" for m, e in failed.items()) + ")")
    if chosen is None:
        minimums = {m: v for m, v in minimums.items() if m not in failed}  # a method that failed is no answer
        smallest = min(minimums, key=minimums.get) if minimums else None
        need = f"; the smallest that would do: {format_bytes(_asked(minimums[smallest]))} (method={smallest!r})" \
            if smallest else ""
        raise InputError("max_memory", f"is too small for any method that can do this{need}", given)
    table = ", ".join(f"{r[0].method.value}{' in panels' if r[3] else ''} {r[2]:.3g} steps "
                      f"{format_bytes(min(_asked(r[1]), w.max_memory))}" for r in rows)
    choice = Choice(chosen[0], f"auto: cheapest estimate of [{table}] under {given}",
                    min(_asked(chosen[1]), w.max_memory), chosen[2])
    log.info("%s: method=%r (%s)", task, choice.name, choice.reason)
    return choice


def solve_top(w: Workload, *, method: str | None = None) -> tuple[EigenResult, torch.Tensor | None, str]:
    """Top eigenpair of the NTK of the symmetric workload ``w``: (EigenResult, kernel (n, n) or
    None, method name). ``method`` overrides ``w.opts.method`` (e.g. matrix-free for subsets once
    the whole set was)."""
    choice = choose("eigen", w, method=method)
    result, kernel = choice.spec.eigen(w)
    return result, kernel, choice.name
