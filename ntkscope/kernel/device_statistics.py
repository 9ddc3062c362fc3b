"""GC's jackknife and null bands as batched torch on the kernel's device (docs/design.md §1.1).

The host path (:mod:`ntkscope.kernel.replicates`, :mod:`ntkscope.kernel.nulls`) solves each
replicate and each null draw by its own LAPACK call: thousands of small eigendecompositions
holding the GIL, most of the statistics' time when the kernel itself came from a GPU.
:class:`DeviceStatistics` solves the same replicates, drawn by the same seeded plan
(:func:`~ntkscope.kernel.replicates.jackknife_plan`, the bands' draws), as a few batched calls
on the device that holds the kernel:

- **the whole set of every deletion** by one power iteration on the masked kernel, an (n, n) by
  (n, D) product a step, started from the whole set's direction, nudged (the host's
  :func:`~ntkscope.kernel.replicates.deletion_directions`); a deletion still unconverged after
  ``MAX_POWER`` products, and every half-sample (solved exactly on the host too), by batched
  ``torch.linalg.eigh`` of the kernel of the samples it keeps;
- **each subset of every replicate that changes it** by one batched ``torch.linalg.eigh`` of
  its masked blocks (a left-out sample's row and column zeroed: its eigenvector entry is 0, the
  other eigenpairs those of the samples present); a replicate that leaves the subset as it was
  keeps the point's direction, as on the host;
- **the null draws** of one size by one batched ``eigh`` of their blocks.

The point values and conditioning come from the host path itself (one eigendecomposition
each), so a result differs from the host one only in the replicates' and draws' float
rounding: the same intervals and null bands to about 1e-10 (tested in float64 against the host
path). The bootstrap intervals (``interval="basic"`` or ``"bca"``) stay on the host.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ntkscope.kernel import replicates
from ntkscope.kernel.replicates import MAX_POWER, RESIDUAL, Jackknife

#: bytes of stacked blocks one batched eigh may hold (the blocks and their eigenvectors)
BATCH_BYTES = 256 * 2**20


def orient_rows(w: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` (R, n) flipped so that each sums to > 0 (a zero sum: its first nonzero entry
    > 0), the host's sign convention."""
    total = w.sum(-1)
    first = w.gather(-1, (w != 0).to(torch.int8).argmax(-1, keepdim=True)).squeeze(-1)
    flip = (total < 0) | ((total == 0) & (first < 0))
    return torch.where(flip[:, None], -w, w)


def _cosine(product: torch.Tensor, norm_a: torch.Tensor, norm_b: torch.Tensor) -> torch.Tensor:
    """The host's ``_cosine`` elementwise: clipped to [-1, 1], NaN where a norm is 0."""
    value = (product / (norm_a * norm_b)).clamp(-1.0, 1.0)
    return torch.where((norm_a > 0) & (norm_b > 0), value, torch.full_like(value, math.nan))


def _top_pairs(block, count: int, size: int) -> tuple:
    """(eigenvalue (count,), eigenvector (count, size)) of the top eigenpair of the symmetric
    blocks ``block(sl)`` (len(sl), size, size) of ``count``, built and solved BATCH_BYTES at a time."""
    step = max(1, BATCH_BYTES // (4 * 8 * size * size))  # the products that build a block, eigh's copy and vectors
    vals, vecs = [], []
    for start in range(0, count, step):
        v, e = torch.linalg.eigh(block(slice(start, start + step)))
        vals.append(v[:, -1].clone())  # copies: a view would keep the whole batch's eigenvectors alive
        vecs.append(e[:, :, -1].clone())
        del v, e
    return torch.cat(vals), torch.cat(vecs)


class DeviceStatistics:
    """The statistics of one float64 kernel ``K`` (n, n; checked) on ``device``: the jackknife of
    :func:`~ntkscope.kernel.replicates.jackknife` and the null draws' |GC| of
    :func:`~ntkscope.kernel.replicates.subset_abs_gcs`, the same numbers to float rounding."""

    def __init__(self, K: np.ndarray, device):
        self.K = K
        self.device = torch.device(device)
        self.Kt = torch.as_tensor(K, dtype=torch.float64, device=self.device)

    def jackknife(self, members: list, *, budget: int, halves: int, seed: int, point: tuple | None = None
                  ) -> Jackknife | None:
        """:func:`ntkscope.kernel.replicates.jackknife` of the same plan, solved in batches; ``point``:
        :func:`~ntkscope.kernel.replicates.statistics` of the whole set when the caller has it."""
        n = self.K.shape[0]
        plan = replicates.jackknife_plan(n, members, budget=budget, halves=halves, seed=seed)
        if plan is None:
            return None
        whole, subs = point or replicates.statistics(self.K, np.ones(n, dtype=np.int64), members)
        point = np.concatenate([[s[0] for s in subs], [abs(s[0]) for s in subs], [s[2] for s in subs]])
        masks = np.concatenate([plan.present.astype(np.float64), plan.halves.astype(np.float64)])
        reps = self._values(torch.as_tensor(masks, device=self.device), members, whole, subs, len(plan.present))
        return replicates.jackknife_summary(point, plan, reps[:len(plan.present)], reps[len(plan.present):])

    def _wholes(self, C: torch.Tensor, start: np.ndarray, iterate: int) -> tuple:
        """(weights (R, n), eigenvalue (R,)) of the top eigenpair of the kernel of the samples each
        row of ``C`` (R, n; 0 or 1) keeps: its first ``iterate`` rows (the deletions) by the power
        iteration from ``start`` as on the host, ``eigh`` for those unconverged and for the rest
        (the half-samples, which the host solves exactly too: a half-sample's top eigenvector can
        be far from the whole set's)."""
        K = self.Kt
        X = torch.zeros_like(C)
        lam = torch.zeros(len(C), dtype=torch.float64, device=self.device)
        exact = torch.arange(iterate, len(C), device=self.device)
        if iterate:
            D = C[:iterate].T  # (n, D)
            V = torch.as_tensor(replicates.power_start(start), device=self.device)[:, None] * D
            V = V / V.norm(dim=0)
            for _ in range(MAX_POWER):
                Y = (K @ V) * D
                value = (V * Y).sum(0)
                converged = (Y - value * V).norm(dim=0) <= RESIDUAL * value.abs()
                if bool(converged.all()):
                    break
                V = Y / Y.norm(dim=0)
            X[:iterate], lam[:iterate] = V.T, value
            exact = torch.cat([torch.nonzero(~converged | (value <= 0)).flatten(), exact])
        for count in torch.unique(C[exact].sum(1)):  # the rows that keep the same number of samples at once
            rows = exact[C[exact].sum(1) == count]
            idx = torch.nonzero(C[rows])[:, 1].reshape(len(rows), -1)  # (r, k): each row's samples, ascending
            lam[rows], vecs = _top_pairs(lambda sl: K[idx[sl, :, None], idx[sl, None, :]], len(rows), idx.shape[1])
            X[rows] = torch.zeros_like(X[rows]).scatter_(1, idx, vecs)
        W = X * C  # a left-out sample's entry exactly 0
        return orient_rows(W / W.norm(dim=1, keepdim=True)), lam

    def _values(self, C: torch.Tensor, members: list, whole, subs, iterate: int) -> np.ndarray:
        """:func:`~ntkscope.kernel.replicates.values` (R, 3k) of the replicates whose counts are
        the rows of ``C`` (R, n; 0 or 1), given the point's ``whole`` and ``subs``; the first
        ``iterate`` rows' whole sets by the power iteration (:meth:`_wholes`)."""
        K = self.Kt
        W, lam = self._wholes(C, whole.weights, iterate)
        along, mean_along = W @ K, C @ K  # (R, n): the whole set's side of both cosines
        norm = lam.clamp(min=0).sqrt()
        whole_mean = (mean_along * C).sum(1).clamp(min=0).sqrt()
        gcs, means = [], []
        for idx, (_, sub, _) in zip(members, subs):
            at = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=self.device)
            c = C[:, at]  # (R, m)
            block = K[at][:, at]
            changed = torch.nonzero((c != 1).any(1)).flatten()
            w = torch.as_tensor(sub.weights, device=self.device).expand(len(C), -1).clone()
            lam_sub = torch.full((len(C),), sub.eigenvalue, dtype=torch.float64, device=self.device)
            if len(changed):
                cc = c[changed]
                lam_sub[changed], v = _top_pairs(lambda sl: cc[sl, :, None] * block * cc[sl, None, :], len(cc),
                                                 len(idx))
                w[changed] = orient_rows(v * cc)
            gcs.append(_cosine((along[:, at] * w).sum(1), norm, lam_sub.clamp(min=0).sqrt()))
            mean_sub = ((c @ block) * c).sum(1).clamp(min=0).sqrt()
            means.append(_cosine((mean_along[:, at] * c).sum(1), whole_mean, mean_sub))
        gc = torch.stack(gcs, 1)
        return torch.cat([gc, gc.abs(), torch.stack(means, 1)], 1).cpu().numpy()

    def abs_gcs(self, along: np.ndarray, norm: float, subsets: list) -> np.ndarray:
        """:func:`~ntkscope.kernel.replicates.subset_abs_gcs` of the draws ``subsets`` (sorted
        index arrays) against the whole set of ``along`` (n,) and ``norm``: one batched eigh per size."""
        out = np.empty(len(subsets))
        by_size: dict = {}
        for i, rows in enumerate(subsets):
            by_size.setdefault(len(rows), []).append(i)
        along_t = torch.as_tensor(along, device=self.device)
        for size, which in by_size.items():
            idx = torch.as_tensor(np.stack([subsets[i] for i in which]).astype(np.int64), device=self.device)  # (d, m)
            lam, vecs = _top_pairs(lambda sl: self.Kt[idx[sl, :, None], idx[sl, None, :]], len(idx), size)
            product = (along_t[idx] * vecs).sum(1).abs()
            value = _cosine(product, torch.tensor(norm, dtype=torch.float64, device=self.device),
                            lam.clamp(min=0).sqrt())
            out[which] = value.cpu().numpy()
        return out
