"""Sketched in-run GC: the GC of the training batch's subsets from a random sketch of each
sample's gradient, made from the layer factors the step already holds, with no per-sample
gradient formed.

For a linear layer, sample i's gradient is ``J_i = sum_t delta_it a_it^T`` (d_out, d_in). The
sketch projects the wider side with a fixed CountSketch ``R`` (d, k): each coordinate goes, with
a random sign, to its bucket, the k buckets being consecutive blocks of ``ceil(d / k)``
coordinates (zero-padded). ``s_i = sum_t delta_it (a_it^T R)`` when the inputs are the wider side
(else ``R^T J_i``), and ``E[s_i . s_j] = <J_i, J_j>`` over the signs whatever the blocks: the
sketches' inner products are the kernel's entries without bias, with about the variance of a
Gaussian projection of the same width on gradients spread over their coordinates (a network's
units have no order at initialisation, so fixed blocks are as good as random ones). Applying
``R`` is a multiply by the signs and a sum (no multiply-add per bucket),
so forming the sketches costs ``2 B T k min(d_in, d_out)`` multiply-adds a layer (the per-sample
products on the narrow side), ``k / max(d_in, d_out)`` of the weight gradient's. Each layer has its
own ``R`` (seeded by the layer's position), the same at every step; a side no wider than k is
kept whole (exact).

The batch's primary direction is the top eigenvector of ``S S^T`` (S: the (B, D) sketches). Up to
:data:`GRAM_UP_TO` samples that B x B matrix costs less than any iterative solve (``B^2 D``
multiply-adds) and the statistics are the exact in-run ones on it
(:func:`~ntkscope.kernel.replicates.statistics`). Above, it is solved matrix-free by Lanczos
(:func:`~ntkscope.kernel.eigen.krylov_top_two`: each product ``S (S^T v)``) from the projections
``S g`` of the batch on the direction ``g`` (in the sketch's space) that the last measured step
found, kept across steps (the solve runs to the same tolerance from any start, so the start
changes no value); each group from its own last direction. GC, eigenvalues, eigengaps,
``cos(u, 1)`` and the mean-gradient consistency follow the definitions of docs/design.md section 1
on the sketched kernel; point values only (no intervals).

How close it is to the exact in-run GC is measured, not assumed: ``benchmarks/inrun_sketch.py``
(docs/tracking.md). An entry's relative error shrinks as ``1/sqrt(k)`` (faster where a sample's
gradient spreads over many tokens) and averages over the layers, each with its own sketch; the
primary directions, and so GC, are as stable as the sketched kernel's eigengap lets them be (a
group whose top two eigenvalues are close can swap its direction).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ntkscope.core.checks import InputError, check_positive_int
from ntkscope.kernel.eigen import krylov_top_two, orient
from ntkscope.kernel.replicates import statistics
from ntkscope.kernel.uncertainty import GCResult

#: the seed stream of the layers' projections (layer j's generator is seeded ``seed * STRIDE + j``)
STRIDE = 1_000_003
#: batches up to this many samples take the sketches' B x B kernel; larger ones the matrix-free solve
GRAM_UP_TO = 256


class GradientSketch:
    """Per-sample gradient sketches of width ``width`` from linear layers' factors (module docstring).

    Parameters
    ----------
    width : int
        k, the columns of each layer's projection (a layer's sketch has ``k * min(d_in, d_out)``
        entries).
    seed : int
        Seeds every layer's projection (the same matrices at every step).
    """

    def __init__(self, width: int = 16, seed: int = 0):
        check_positive_int("width", width)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError("seed", "must be an integer >= 0", seed)
        self.width, self.seed = width, seed
        self._projections: dict = {}  # (layer, d, device) -> (signs, padding)

    def projection(self, layer: int, d: int, device) -> tuple | None:
        """Layer ``layer``'s CountSketch of a side of width ``d``: (the coordinates' signs, the
        zero padding to k equal buckets); None when ``d <= k`` (kept whole)."""
        if d <= self.width:
            return None
        key = (layer, d, str(device))
        if key not in self._projections:
            gen = torch.Generator().manual_seed(self.seed * STRIDE + layer)
            signs = (2 * torch.randint(0, 2, (d,), generator=gen) - 1).to(torch.int8)
            self._projections[key] = (signs.to(device), (-d) % self.width)
        return self._projections[key]

    def project(self, x: torch.Tensor, projection) -> torch.Tensor:
        """``x`` (..., d) -> (..., k): bucket j the signed sum of the j-th block of ``ceil(d / k)``
        consecutive coordinates (``x`` itself without a projection)."""
        if projection is None:
            return x
        signs, pad = projection
        y = x * signs.to(x.dtype)
        if pad:
            y = torch.nn.functional.pad(y, (0, pad))
        return y.reshape(*x.shape[:-1], self.width, -1).sum(-1)

    def sketch(self, layers: list, loss_terms=None, *, dtype=None) -> torch.Tensor:
        """The (B, D) sketches of the samples' gradients over ``layers`` (per layer, its uses'
        :class:`~ntkscope.kernel.factors.Linear` factors, as :meth:`ntkscope.InRunGC.factors`
        gives them); ``loss_terms`` (B,) rescales each sample to its mean token loss;
        ``dtype``: of the products (default the factors', float32 at least)."""
        parts = []
        for j, uses in enumerate(layers):
            total = None
            for use in uses:
                kind = dtype or torch.promote_types(torch.promote_types(use.a.dtype, use.delta.dtype), torch.float32)
                a, delta = use.a.to(kind), use.delta.to(kind)
                if a.shape[-1] >= delta.shape[-1]:  # project the wider side
                    s = delta.transpose(1, 2) @ self.project(a, self.projection(j, a.shape[-1], a.device))
                else:
                    s = self.project(delta, self.projection(j, delta.shape[-1], a.device)).transpose(1, 2) @ a
                total = s if total is None else total + s
            parts.append(total.reshape(total.shape[0], -1))
        S = torch.cat(parts, dim=1)
        if loss_terms is not None:
            terms = torch.as_tensor(loss_terms, dtype=S.dtype, device=S.device).reshape(-1)
            if terms.shape != (S.shape[0],) or bool((terms <= 0).any()):
                raise InputError("loss_terms", f"must give each of the {S.shape[0]} samples a positive count",
                                 terms.tolist())
            S = S / terms[:, None]
        return S


def _top(S: torch.Tensor, start: torch.Tensor | None) -> tuple:
    """(lambda_1, lambda_2, u oriented, g = S^T u / |S^T u|, matvecs) of ``S S^T``, matrix-free
    from the projections of S on ``start`` (a direction in the sketch's space) or the ones."""
    n = S.shape[0]
    v0 = np.ones(n) if start is None else (S @ start).double().cpu().numpy()
    if not np.isfinite(v0).all() or np.linalg.norm(v0) == 0:
        v0 = np.ones(n)
    if n == 1:
        lam, lam2, u, matvecs = float((S * S).sum()), 0.0, np.ones(1), 1
    else:
        def matvec(v):
            w = torch.as_tensor(v, dtype=S.dtype, device=S.device)
            return (S @ (S.T @ w)).double().cpu().numpy()
        lam, lam2, u, matvecs = krylov_top_two(matvec, n, v0)
    u = orient(u)
    g = S.T @ torch.as_tensor(u, dtype=S.dtype, device=S.device)
    norm = torch.linalg.vector_norm(g)
    return lam, lam2, u, g / norm if norm > 0 else g, matvecs


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return float(torch.clamp(a @ b / denom, -1.0, 1.0)) if denom > 0 else math.nan


class SketchedGC:
    """GC of a batch's groups on its sketches (module docstring: the B x B kernel up to
    :data:`GRAM_UP_TO` samples, else matrix-free with the directions kept from the last call).

    ``gc(S, groups)``: S (B, D) from :meth:`GradientSketch.sketch`, ``groups`` a list of
    (label, sorted index array); one :class:`~ntkscope.GCResult` per group, ``method="sketch"``,
    ``matvecs`` the products its direction took (the whole set's are in :attr:`matvecs`; 0 on the
    B x B kernel)."""

    def __init__(self):
        self.direction: torch.Tensor | None = None  # the whole batch's g at the last call
        self.group_directions: dict = {}            # label -> its g at its last call
        self.matvecs = 0

    def gc(self, S: torch.Tensor, groups: list) -> list[GCResult]:
        if S.shape[0] <= GRAM_UP_TO:
            return self._from_gram(S, groups)
        S = S.double() if S.device.type == "cpu" else S
        keep = self.direction if self.direction is not None and self.direction.shape == S.shape[1:] else None
        lam, lam2, u, g, self.matvecs = _top(S, keep)
        if lam <= 0:
            raise InputError("batch", "has sketched gradients that are all zero (no positive eigenvalue)", lam)
        self.direction = g
        mean = S.sum(0)
        out = []
        for label, idx in groups:
            sub = S[torch.as_tensor(idx, device=S.device)]
            kept = self.group_directions.get(label)
            start = kept if kept is not None and kept.shape == g.shape else g
            lam_s, lam2_s, u_s, g_s, matvecs = _top(sub, start)
            self.group_directions[label] = g_s
            out.append(GCResult(
                score=float(torch.clamp(g @ g_s, -1.0, 1.0)), eigenvalue=lam, eigengap=max(lam2, 0.0) / lam,
                eigenvalue_subset=lam_s, eigengap_subset=max(lam2_s, 0.0) / lam_s if lam_s > 0 else math.nan,
                n=S.shape[0], n_subset=len(idx), method="sketch", label=label, matvecs=matvecs,
                cos_ones=float(u.sum() / math.sqrt(len(u))), cos_ones_subset=float(u_s.sum() / math.sqrt(len(u_s))),
                mean_gradient=_cos(sub.sum(0), mean)))
        return out

    def _from_gram(self, S: torch.Tensor, groups: list) -> list[GCResult]:
        """The exact in-run statistics on the sketches' B x B kernel (a small batch)."""
        K = (S @ S.T).double().cpu().numpy()
        K = (K + K.T) / 2
        if not np.trace(K) > 0:
            raise InputError("batch", "has sketched gradients that are all zero (no positive eigenvalue)", 0.0)
        whole, subs = statistics(K, np.ones(len(K), dtype=np.int64), [idx for _, idx in groups])
        self.matvecs = 0
        return [GCResult(score=gc, eigenvalue=whole.eigenvalue, eigengap=whole.eigengap,
                         eigenvalue_subset=sub.eigenvalue, eigengap_subset=sub.eigengap, n=len(K),
                         n_subset=len(idx), method="sketch", label=label, cos_ones=whole.cos_ones,
                         cos_ones_subset=sub.cos_ones, mean_gradient=mean)
                for (label, idx), (gc, sub, mean) in zip(groups, subs)]
