"""Kernels across processes with ``torch.distributed``, launched by ``torchrun`` (gloo on CPU,
nccl on GPU; docs/distributed.md).

Every process holds the same batch (the commands sample it with the same seed). The samples
are sharded by rank in contiguous runs, sizes as ``numpy.array_split`` gives them (a rank may
hold none). A rank computes only its shard's rows of J, or its structured factors, and holds
them as its panel (the projected method's sketches are small, (n, K, k), and are summed over
the ranks whole). The kernel is assembled block by block: each rank in turn broadcasts its
panel, and every rank multiplies its own panel by it; a rank holds its panel and one block in
flight. When two panels do not fit the memory budget, shards are cut into sub-panels that are
formed again in each of several passes (:func:`_ring`). Each block pair is computed once (by
one of its two ranks, alternating round the ring) and the finished n × n kernel is summed over
the ranks. The matrix-free operator all-reduces ``J^T v`` over the ranks' shards and gathers
``J (J^T v)``; a weighted backward ``sum_i u_i grad f_i`` sums over ranks. The eigensolvers
and GC statistics then run on every rank on identical numbers, and only rank 0 writes results.

With no process group nothing here is used.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
import torch.distributed as dist

from ntkscope.core.progress import progress_bar
from ntkscope.kernel.eigen import NTKOperator
from ntkscope.kernel.grads import FunctionalModel, jacobian_rows, jvp_rows, vjp_rows
from ntkscope.kernel.kernels import gram_block, place_block, kernel_bytes, projected_sketch
from ntkscope.kernel.objectives import take
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.structured import Costs, accumulate, load_factors, setup
from ntkscope.kernel.structured_layout import WORK_SHARE, layout

log = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """(rank, number of processes) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def active() -> bool:
    """Whether kernels are computed through the process group (any size: one rank under torchrun
    runs the same collectives, which checks a backend on one GPU)."""
    return dist.is_available() and dist.is_initialized()


def writes() -> bool:
    """Whether this process writes results: the only one, or rank 0."""
    return world()[0] == 0


def from_rank0(obj):
    """``obj`` as rank 0 has it, on every process (picklable objects; itself without a group)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(n: int, rank: int | None = None, size: int | None = None) -> slice:
    """The contiguous run of ``n`` samples that ``rank`` holds (``numpy.array_split`` sizes)."""
    if rank is None or size is None:
        rank, size = world()
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n), size)])
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def _computes(r: int, s: int, size: int) -> bool:
    """Whether rank ``r`` computes the block pair (r, s): its own, and half the others round the ring."""
    d = (s - r) % size
    return d == 0 or 2 * d < size or (2 * d == size and r < s)


def _flatten(tree, tensors: list):
    if torch.is_tensor(tree):
        tensors.append(tree)
        return ("tensor", tuple(tree.shape), str(tree.dtype).removeprefix("torch."))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return ("dataclass", type(tree), {f.name: _flatten(getattr(tree, f.name), tensors)
                                          for f in dataclasses.fields(tree)})
    if isinstance(tree, dict):
        return ("dict", {k: _flatten(v, tensors) for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [_flatten(v, tensors) for v in tree])
    return ("leaf", tree)


def _unflatten(spec, leaf):
    """The tree ``spec`` describes, each tensor from ``leaf(spec)`` in :func:`_flatten`'s order."""
    kind = spec[0]
    if kind == "tensor":
        return leaf(spec)
    if kind == "dataclass":
        return spec[1](**{k: _unflatten(v, leaf) for k, v in spec[2].items()})
    if kind == "dict":
        return {k: _unflatten(v, leaf) for k, v in spec[1].items()}
    if kind in ("list", "tuple"):
        items = [_unflatten(v, leaf) for v in spec[1]]
        return items if kind == "list" else tuple(items)
    return spec[1]


def broadcast_tree(tree, src: int, device):
    """``tree`` (tensors in dataclasses, dicts, lists; None) of rank ``src``, on every rank: its
    structure by ``broadcast_object_list``, then each tensor by ``broadcast`` into place."""
    rank, _ = world()
    tensors: list = []
    spec = [_flatten(tree, tensors) if rank == src else None]
    dist.broadcast_object_list(spec, src=src)
    if rank != src:
        def empty(leaf):
            tensors.append(torch.empty(leaf[1], dtype=getattr(torch, leaf[2]), device=device))
            return tensors[-1]

        tree = _unflatten(spec[0], empty)
    for t in tensors:
        dist.broadcast(t.contiguous() if rank == src else t, src=src)
    return tree


def _subpanels(n: int, m: int, size: int) -> list[list[slice]]:
    """Every rank's shard of ``n`` samples cut into runs of at most ``m``: ``[rank][k]`` is a slice."""
    cuts = []
    for r in range(size):
        rows = shard(n, r, size)
        cuts.append([slice(a, min(rows.stop, a + m)) for a in range(rows.start, rows.stop, m)])
    return cuts


def _ring(out: dict, n: int, m: int, load, product, device) -> int:
    """A symmetric kernel from sub-panels of at most ``m`` samples; returns the passes.

    In pass ``a`` every rank holds its ``a``-th sub-panel A (``load(rows)``). Each rank in turn
    forms each of its sub-panels and broadcasts it, and a rank adds ``product(A, B, rows, cols,
    mirror)`` for the pairs it computes: another rank's, as :func:`_computes` assigns them, and
    its own sub-panels from the ``a``-th on (the ``a``-th is A itself). A sub-panel that no
    other rank needs in a pass is not broadcast. When a shard fits (``m`` at least the largest
    shard) there is one pass, in which each rank forms and broadcasts its panel once. A rank
    holds A and one sub-panel in flight; the kernels are then summed over the ranks. The
    structure travels by pickle, between this job's own processes only."""
    rank, size = world()
    cuts = _subpanels(n, m, size)
    passes = max(len(c) for c in cuts)
    for a in range(passes):
        def uses(r, src, q, a=a):  # rank r multiplies its a-th sub-panel by src's q-th in this pass
            return a < len(cuts[r]) and (q >= a if r == src else _computes(r, src, size))

        rows = cuts[rank][a] if a < len(cuts[rank]) else None
        A = None  # the last pass's sub-panel goes before this one is loaded
        A = load(rows) if rows is not None else None
        for src in range(size):
            for q, cols in enumerate(cuts[src]):
                others = any(uses(r, src, q) for r in range(size) if r != src)
                if src == rank and (others or uses(rank, src, q)):
                    B = A if q == a else load(cols)
                    if others:
                        broadcast_tree(B, src, device)
                elif others:
                    B = broadcast_tree(None, src, device)
                else:
                    continue
                if uses(rank, src, q):
                    product(A, B, rows, cols, B is not A)
                del B
    for k in out.values():
        dist.all_reduce(k)
    return passes


def _cross(out: dict, n1: int, n2: int, m: int, load1, load2, product, device) -> int:
    """A cross-kernel from sub-panels of at most ``m`` samples of each set; returns the passes.
    In pass ``a`` every rank holds its ``a``-th sub-panel of the first set, and every rank's
    sub-panels of the second set pass it (formed by their rank, broadcast when another rank
    needs them); then the kernels are summed over the ranks."""
    rank, size = world()
    cuts1, cuts2 = _subpanels(n1, m, size), _subpanels(n2, m, size)
    passes = max(len(c) for c in cuts1)
    for a in range(passes):
        rows = cuts1[rank][a] if a < len(cuts1[rank]) else None
        A = None  # the last pass's sub-panel goes before this one is loaded
        A = load1(rows) if rows is not None else None
        for src in range(size):
            others = any(a < len(cuts1[r]) for r in range(size) if r != src)
            for cols in cuts2[src]:
                if others:
                    B = broadcast_tree(load2(cols) if src == rank else None, src, device)
                elif src == rank and A is not None:
                    B = load2(cols)
                else:
                    continue
                if A is not None:
                    product(A, B, rows, cols, False)
                del B
    for k in out.values():
        dist.all_reduce(k)
    return passes


def _agreed(fits: int, device) -> int:
    """The least of every rank's ``fits``: each rank measured its own probe, and the sub-panels
    must be cut alike on all of them."""
    box = torch.tensor([int(fits)], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def _subpanel_size(largest: int, fits: int, what: str) -> int:
    """Samples per sub-panel: the whole largest shard when two fit, else ``fits`` (at least 1)."""
    m = int(min(largest, max(1, fits)))
    if m < largest:
        log.info("%s: a shard of %d samples does not fit twice in the memory budget; it is formed in "
                 "sub-panels of %d samples, each formed again in every pass (%d passes)", what, largest, m,
                 math.ceil(largest / m))
    return m


def exact_kernels(fm: FunctionalModel, data1, data2, n1, n2, chunk, budget, reduction, transient: int):
    """:func:`ntkscope.kernel.kernels.exact_kernels` across processes: ({block: kernel}, passes)."""
    _, size = world()
    sel, K, P = fm.selection, fm.n_outputs, fm.selection.n_params
    kshape = (K,) if (K > 1 and reduction == "diagonal") else ()
    out = {b: torch.zeros(*kshape, n1, n2, dtype=fm.dtype, device=fm.device) for b in sel.blocks}

    def rows_of(data, rows):
        J = torch.empty(rows.stop - rows.start, K, P, dtype=fm.dtype, device=fm.device)  # (n_r, K, P)
        for c0 in range(rows.start, rows.stop, chunk):
            c1 = min(rows.stop, c0 + chunk)
            jacobian_rows(fm, take(data, slice(c0, c1)), J[c0 - rows.start : c1 - rows.start], c0)
        return J

    def product(JA, JB, rows, cols, mirror):
        for name, (s, e) in sel.blocks.items():
            place_block(out, name, gram_block(JA, JB, slice(s, e), reduction), rows, cols, mirror)

    row = K * P * fm.itemsize  # held: a sub-panel, one in flight, a chunk's rows and transient, the kernels
    free = budget - kernel_bytes(fm, n1, n2) - chunk * row - transient
    m = _subpanel_size(shard(max(n1, n2), 0, size).stop, _agreed(free // row // 2, fm.device), "exact")
    if data2 is None:
        return out, _ring(out, n1, m, lambda rows: rows_of(data1, rows), product, fm.device)
    return out, _cross(out, n1, n2, m, lambda rows: rows_of(data1, rows), lambda rows: rows_of(data2, rows),
                       product, fm.device)


def projected_kernels(fm: FunctionalModel, data1, data2, n1, n2, chunk, reduction, opts: KernelOptions) -> dict:
    """:func:`ntkscope.kernel.kernels.projected_kernels` across processes: each rank sketches its
    shard's samples with the same seeded R (a sample's sketch is its row of J times R, whichever
    process forms it); the sketches, (n, K, k) per block, are summed into place over the ranks,
    and every rank forms the Gram matrices from them."""
    rank, size = world()
    sel, K, k = fm.selection, fm.n_outputs, opts.projection_dim

    def sketch(data, n, bar):
        rows = shard(n)
        Z = {b: torch.zeros(n, K, k, dtype=fm.dtype, device=fm.device) for b in sel.blocks}
        if rows.stop > rows.start:
            for b, part in projected_sketch(fm, data, rows, chunk, opts, bar).items():
                Z[b][rows] = part
        for z in Z.values():
            dist.all_reduce(z)
        return Z

    own = sum(r.stop - r.start for r in (shard(n1), None if data2 is None else shard(n2)) if r is not None)
    with progress_bar(own, "projected NTK (rank 0's shard)", "sample", hidden=rank != 0) as bar:
        Z1 = sketch(data1, n1, bar)
        Z2 = Z1 if data2 is None else sketch(data2, n2, bar)
    log.info("projected across %d processes: %d samples sketched here", size, own)
    return {b: gram_block(Z1[b], Z2[b], slice(0, k), reduction) for b in sel.blocks}


def structured_kernels(fm: FunctionalModel, data1, data2, n1: int, n2: int, budget: int,
                       chunk: int | None = None) -> tuple[dict, Costs]:
    """:func:`ntkscope.kernel.structured.structured_kernels` across processes."""
    _, size = world()
    st = setup(fm, data1, n1, budget)
    kernels = kernel_bytes(fm, n1, n2)
    _, _, chunk = layout(st.probe, n1, n2, budget, chunk, data2 is None, kernels)
    out = {b: torch.zeros(n1, n2, dtype=fm.dtype, device=fm.device) for b in fm.selection.blocks}
    # held: a sub-panel, one in flight, the kernels, and the larger of a chunk's transient and the
    # tiles' share (a chunk's forward and backward end before its pair products start)
    free = budget - max(int(WORK_SHARE * budget), st.probe.transient.bytes(chunk)) - kernels - st.probe.sample_bytes
    m = _subpanel_size(shard(max(n1, n2), 0, size).stop, _agreed(free // (2 * st.probe.sample_bytes), fm.device),
                       "structured")

    def product(A, B, rows, cols, mirror):  # B is A for a sub-panel's own pair: each use pair once
        accumulate(out, st, A, B, rows, cols, mirror)

    def load(data):
        return lambda rows: load_factors(fm, st, data, rows.start, rows.stop, chunk)

    if data2 is None:
        passes = _ring(out, n1, m, load(data1), product, fm.device)
    else:
        passes = _cross(out, n1, n2, m, load(data1), load(data2), product, fm.device)
    log.info("structured across %d processes: %d samples here in sub-panels of %d, pair products %s", size,
             shard(n1).stop - shard(n1).start, m, st.forms)
    return out, Costs(st.forms, passes, m, chunk)


class ShardedNTKOperator(NTKOperator):
    """``v -> J (J^T v)`` with J's rows sharded over the processes: each rank forms ``J_r^T v_r``,
    they are all-reduced, and the ranks' ``J_r (J^T v)`` are gathered (summed into place)."""

    def _matvec(self, v):
        self.matvecs += 1
        fm = self.fm
        rows = shard(self.n)
        v = torch.as_tensor(np.asarray(v).reshape(-1), dtype=fm.dtype, device=fm.device)
        jt_v = weighted_gradient(fm, self.data, v, self.chunk)  # (P,), summed over ranks
        out = torch.zeros(self.n, dtype=fm.dtype, device=fm.device)
        if rows.stop > rows.start:
            out[rows] = jvp_rows(fm, take(self.data, rows), jt_v, self.chunk, rows.stop - rows.start)
        dist.all_reduce(out)
        return out.detach().cpu().double().numpy()


def weighted_gradient(fm: FunctionalModel, data, weights: torch.Tensor, chunk: int) -> torch.Tensor:
    """``sum_i w_i grad f(x_i)`` (P,): :func:`~ntkscope.kernel.grads.vjp_rows`, or across processes
    each rank's shard, summed over the ranks. ``weights``: (n,)."""
    if not active():
        return vjp_rows(fm, data, weights, chunk)
    rows = shard(weights.shape[0])
    if rows.stop > rows.start:
        total = vjp_rows(fm, take(data, rows), weights[rows], chunk)
    else:
        total = torch.zeros(fm.selection.n_params, dtype=fm.dtype, device=fm.device)
    dist.all_reduce(total)
    return total
