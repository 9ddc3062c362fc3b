"""How the NTK's blocks are computed, method by method (rows of :mod:`ntkscope.kernel.methods`).

``exact_kernels``
    Per-sample gradients are computed chunk by chunk and written into a panel of J rows
    held in memory; the Gram matrix is one matmul per block. When all of J fits in the
    budget this is one gradient pass (the fast case). When it does not, rows are held in
    panels that fit and the other rows are streamed past each panel in chunks (recomputed,
    never stored), so memory is one panel plus one chunk, at the cost of extra passes.
``projected_kernels``
    A seeded Gaussian or Rademacher matrix ``R_b`` of shape (P_b, k) per block,
    ``Theta_b ~ (J_b R_b)(J_b R_b)^T``; one gradient pass. ``R`` is never stored: it is
    generated in row tiles from one seed per tile, for each chunk of samples, so memory is
    one tile plus one chunk plus the (n, k) sketches, independent of ``P k``. :func:`jl_error_bound` states the
    Johnson-Lindenstrauss bound it implies.

Each takes a :class:`~ntkscope.kernel.grads.FunctionalModel` and prepared data, and returns
``{block: kernel}`` with kernels of shape (n1, n2), or (K, n1, n2) for ``reduction="diagonal"``.
The ``*_memory`` functions estimate the bytes each holds.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import brentq

from ntkscope.core.progress import progress_bar
from ntkscope.kernel.grads import FunctionalModel, jacobian_rows
from ntkscope.kernel.objectives import take
from ntkscope.kernel.options import KernelOptions


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


def gram_block(A: torch.Tensor, B: torch.Tensor, cols: slice, reduction: str | None) -> torch.Tensor:
    """Rows of A (a, K, P) against rows of B (b, K, P) over columns ``cols``: (a, b) or (K, a, b)."""
    if A.shape[1] == 1:
        return A[:, 0, cols] @ B[:, 0, cols].T  # (a, Pb) @ (Pb, b) -> (a, b)
    if reduction == "trace":
        return torch.einsum("akp,bkp->ab", A[:, :, cols], B[:, :, cols])
    return torch.einsum("akp,bkp->kab", A[:, :, cols], B[:, :, cols])


def place_block(out: dict, name: str, G: torch.Tensor, r: slice, c: slice, mirror: bool) -> None:
    """Write the block ``G`` into kernel ``out[name]`` at rows ``r`` and columns ``c`` (and its
    transpose at ``c, r`` when ``mirror``: a symmetric kernel's other half)."""
    out[name][..., r, c] = G
    if mirror:
        out[name][..., c, r] = G.transpose(-1, -2)


def kernel_bytes(fm: FunctionalModel, n1: int, n2: int) -> int:
    """The finished kernels: one (K, n1, n2) per block and their sum."""
    return (len(fm.selection.blocks) + 1) * fm.n_outputs * n1 * n2 * fm.itemsize


def sample_passes(n1: int, n2: int, panel: int, symmetric: bool) -> float:
    """Per-sample computations when ``panel`` samples are held and the rest streamed past each panel."""
    panels = math.ceil(n1 / max(1, panel))
    if symmetric:
        return n1 + sum(max(0, n1 - min(n1, (i + 1) * panel)) for i in range(panels))
    return n1 + panels * n2 if panels > 1 else n1 + n2


def exact_panel(fm: FunctionalModel, n1: int, n2: int, chunk: int, budget: int, transient: int) -> int:
    """Rows of J held at once: what fits ``budget`` beside the kernels, a chunk's rows and its
    ``transient`` bytes (at least 1; :func:`exact_minimum` says whether 1 fits)."""
    row = fm.n_outputs * fm.selection.n_params * fm.itemsize
    free = budget - kernel_bytes(fm, n1, n2) - chunk * row - transient
    return int(min(n1, max(1, free // row)))


def exact_minimum(fm: FunctionalModel, n1: int, n2: int, transient_one: int) -> int:
    """The smallest budget exact runs in: the kernels, one held row, one streamed row and its transient."""
    return kernel_bytes(fm, n1, n2) + 2 * fm.n_outputs * fm.selection.n_params * fm.itemsize + transient_one


def exact_kernels(fm: FunctionalModel, data1, data2, n1, n2, chunk, budget, reduction, transient: int):
    """Exact NTK blocks, in panels of J rows that fit ``budget`` bytes beside a chunk's ``transient``
    bytes; returns ({block: kernel}, gradient passes)."""
    sel, K, P = fm.selection, fm.n_outputs, fm.selection.n_params
    symmetric = data2 is None
    panel = exact_panel(fm, n1, n2, chunk, budget, transient)
    kshape = (K,) if (K > 1 and reduction == "diagonal") else ()
    out = {b: torch.zeros(*kshape, n1, n2, dtype=fm.dtype, device=fm.device) for b in sel.blocks}
    chunk_buf = torch.empty(chunk, K, P, dtype=fm.dtype, device=fm.device)
    passes = np.zeros(n1 + (0 if symmetric else n2), dtype=int)
    starts = range(0, n1, panel)
    gradients = n1 + sum(n1 - min(n1, a0 + panel) if symmetric else n2 for a0 in starts)
    bar = progress_bar(gradients, "exact NTK", "sample")
    for a0 in starts:
        a1 = min(n1, a0 + panel)
        JA = None  # the last panel goes before the next is allocated
        JA = torch.empty(a1 - a0, K, P, dtype=fm.dtype, device=fm.device)  # (a, K, P) panel of J
        for c0 in range(a0, a1, chunk):
            c1 = min(a1, c0 + chunk)
            jacobian_rows(fm, take(data1, slice(c0, c1)), JA[c0 - a0 : c1 - a0], c0)
            bar.update(c1 - c0)
        passes[a0:a1] += 1
        rows = slice(a0, a1)
        if symmetric:
            for name, (s, e) in sel.blocks.items():
                place_block(out, name, gram_block(JA, JA, slice(s, e), reduction), rows, rows, False)
            start, stop, src, offset = a1, n1, data1, 0
        else:
            start, stop, src, offset = 0, n2, data2, n1
        for b0 in range(start, stop, chunk):
            b1 = min(stop, b0 + chunk)
            JB = chunk_buf[: b1 - b0]
            jacobian_rows(fm, take(src, slice(b0, b1)), JB, b0)
            bar.update(b1 - b0)
            passes[offset + b0 : offset + b1] += 1
            for name, (s, e) in sel.blocks.items():
                place_block(out, name, gram_block(JA, JB, slice(s, e), reduction), rows, slice(b0, b1), symmetric)
    bar.close()
    return out, int(passes.max())


_TILE_BYTES = 32 * 2**20  # one tile of the projection, regenerated from its seed wherever it is needed


def _tile_rows(k: int, itemsize: int) -> int:
    return max(1, _TILE_BYTES // (k * itemsize))


def _projection_tile(fm: FunctionalModel, seed: int, rows: int, k: int, kind: str) -> torch.Tensor:
    """One (rows, k) tile of R, a function of ``seed`` alone; entries N(0, 1/k) or +-1/sqrt(k)."""
    gen = torch.Generator(device=fm.device).manual_seed(seed)
    R = torch.empty(rows, k, device=fm.device, dtype=fm.dtype)
    if kind == "gaussian":
        return R.normal_(0.0, 1.0 / math.sqrt(k), generator=gen)
    return R.bernoulli_(0.5, generator=gen).mul_(2.0 / math.sqrt(k)).sub_(1.0 / math.sqrt(k))


def _tile_seeds(fm: FunctionalModel, seed: int, k: int) -> list:
    """[(block, column range of J, tile seed)]: R is never stored, each tile is regenerated from its seed."""
    rows = _tile_rows(k, fm.itemsize)
    out = []
    for (name, (s, e)), ss in zip(fm.selection.blocks.items(),
                                  np.random.SeedSequence(seed).spawn(len(fm.selection.blocks))):
        starts = range(s, e, rows)
        for t0, child in zip(starts, ss.spawn(len(starts))):
            out.append((name, slice(t0, min(e, t0 + rows)), int(child.generate_state(1)[0])))
    return out


def projected_kernels(fm: FunctionalModel, data1, data2, n1, n2, chunk, reduction, opts: KernelOptions):
    """Sketched NTK blocks ``(J_b R_b)(J_b R_b)^T`` with ``opts.projection_dim`` columns per block.

    ``R_b`` (P_b, k) is generated in tiles of rows from a seed each (one tile of at most 32 MiB
    at a time), so memory does not grow with P k; the tiles are regenerated for every chunk of
    samples. The entries are the same i.i.d. draws however the samples are chunked, so the JL
    bound (:func:`jl_error_bound`) holds unchanged."""
    with progress_bar(n1 + (0 if data2 is None else n2), "projected NTK", "sample") as bar:
        Z1 = projected_sketch(fm, data1, slice(0, n1), chunk, opts, bar)
        Z2 = Z1 if data2 is None else projected_sketch(fm, data2, slice(0, n2), chunk, opts, bar)
    full = slice(0, opts.projection_dim)
    return {b: gram_block(Z1[b], Z2[b], full, reduction) for b in fm.selection.blocks}


def projected_sketch(fm: FunctionalModel, data, rows: slice, chunk: int, opts: KernelOptions, bar) -> dict:
    """``{block: J_b R_b}`` for the samples ``rows`` of ``data``, each (len(rows), K, k): a sample's
    sketch depends on its own row of J and the seeded tiles of R only, whichever rows are asked."""
    k, sel, K, P = opts.projection_dim, fm.selection, fm.n_outputs, fm.selection.n_params
    tiles = _tile_seeds(fm, opts.seed, k)
    buf = torch.empty(min(chunk, rows.stop - rows.start), K, P, dtype=fm.dtype, device=fm.device)
    Z = {b: torch.zeros(rows.stop - rows.start, K, k, dtype=fm.dtype, device=fm.device) for b in sel.blocks}
    for c0 in range(rows.start, rows.stop, chunk):
        c1 = min(rows.stop, c0 + chunk)
        J = buf[: c1 - c0]
        jacobian_rows(fm, take(data, slice(c0, c1)), J, c0)
        for name, cols, tile_seed in tiles:
            R = _projection_tile(fm, tile_seed, cols.stop - cols.start, k, opts.projection)
            Z[name][c0 - rows.start : c1 - rows.start] += J[:, :, cols] @ R  # (c, K, rows) @ (rows, k) -> (c, K, k)
            del R  # one tile at a time: this one goes before the next is drawn
        bar.update(c1 - c0)
    return Z


def exact_memory(fm: FunctionalModel, n1: int, n2: int, chunk: int, transient: int) -> int:
    """Bytes for exact in one pass: all n1 rows of J, a chunk's rows and ``transient`` bytes, the kernels."""
    row = fm.n_outputs * fm.selection.n_params * fm.itemsize
    return n1 * row + chunk * row + transient + kernel_bytes(fm, n1, n2)


def projected_memory(fm: FunctionalModel, n1: int, n2: int, chunk: int, k: int, symmetric: bool,
                     transient: int) -> int:
    """Bytes for the projected method: one tile of R and its product, a chunk of J and its
    ``transient`` bytes, the sketches, the kernels (not P k)."""
    K, P, isz = fm.n_outputs, fm.selection.n_params, fm.itemsize
    sketches = (n1 + (0 if symmetric else n2)) * K * k * len(fm.selection.blocks) * isz
    rows = min(P, _tile_rows(k, isz))
    tile = rows * k * isz + chunk * K * rows * isz  # a tile of R, and a chunk's columns of J against it
    return tile + chunk * K * P * isz + transient + sketches + kernel_bytes(fm, n1, n2)


def matrix_free_memory(fm: FunctionalModel, n: int, chunk: int) -> int:
    """Bytes for the matrix-free operator: a few parameter-sized vectors and one chunk's graph (O(P + n))."""
    return 4 * fm.selection.n_params * fm.itemsize + 3 * chunk * fm.selection.n_params * fm.itemsize + 8 * n * 8
