"""Planted pools with a known answer, and how well GC's intervals and nulls cover it (docs/gc-calibration.md).

A :class:`PlantedPool` draws per-sample gradients ``g_i = a s + b_k d_k(i) + sigma e_i``: a
shared direction ``s``, one direction per group ``k`` (group 0 is the tail), isotropic noise.
Its GC has two known answers:

- **finite-n**: the mean |GC| over independent draws of the same sizes (Monte Carlo), the
  quantity :attr:`~ntkscope.GCResult.abs_interval` should cover;
- **large-sample**: with n -> infinity the whole set's ``g(X)`` points along the top eigenvector
  of ``sum_k pi_k mu_k mu_k^T`` (noise adds ``sigma^2 I``, which moves no eigenvector) and a
  group's along its mean ``mu_k``, so ``GC_inf = |cos(v_top, mu_k)|`` exactly.

:func:`interval_calibration` measures coverage and width against the draw-to-draw spread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ntkscope.core.checks import InputError, entry
from ntkscope.kernel.uncertainty import Resampling, kernel_gc


@dataclass(frozen=True)
class PlantedPool:
    """Per-sample gradients with planted groups.

    Parameters
    ----------
    shares : tuple of float
        Each group's share of a draw (group 0: the tail); summing to 1.
    strength : tuple of float
        ``b_k``: the length of each group's own direction, against the shared direction's ``a``.
    shared : float
        ``a``: the length of the shared direction.
    noise : float
        ``sigma``: per-coordinate noise.
    dim : int
        P, the gradient dimension.
    seed : int
        Seeds the directions (draws take their own generator).
    """

    shares: tuple = (0.1, 0.45, 0.45)
    strength: tuple = (2.0, 1.0, 1.0)
    shared: float = 1.0
    noise: float = 0.25
    dim: int = 64
    seed: int = 0

    @entry("PlantedPool")
    def __post_init__(self):
        if len(self.shares) != len(self.strength) or len(self.shares) < 2:
            raise InputError("shares", "must give one share per group, at least 2 groups, as strength does",
                             (len(self.shares), len(self.strength)))
        if not math.isclose(sum(self.shares), 1.0) or min(self.shares) <= 0:
            raise InputError("shares", "must be positive and sum to 1", self.shares)
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise InputError("dim", "must be a positive integer", self.dim)
        if not self.noise >= 0:
            raise InputError("noise", "must be a non-negative number", self.noise)

    def directions(self) -> tuple[np.ndarray, np.ndarray]:
        """(shared direction s (P,), group directions d (k, P)), each of unit length."""
        rng = np.random.default_rng([self.seed, 0])
        raw = rng.normal(size=(len(self.shares) + 1, self.dim))
        raw /= np.linalg.norm(raw, axis=1, keepdims=True)
        return raw[0], raw[1:]

    def labels(self, n: int) -> np.ndarray:
        """(n,) group of each sample of a draw of ``n``: fixed counts per group, the tail first."""
        counts = np.floor(np.array(self.shares) * n).astype(int)
        counts[1] += n - counts.sum()
        return np.repeat(np.arange(len(self.shares)), counts)

    def means(self) -> np.ndarray:
        """(k, P) each group's mean gradient ``a s + b_k d_k``."""
        s, d = self.directions()
        return self.shared * s + np.array(self.strength)[:, None] * d

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n, P) gradients of one independent draw, in :meth:`labels` order."""
        mu = self.means()[self.labels(n)]
        return mu + self.noise * rng.normal(size=mu.shape)

    def large_sample_gc(self, groups=None) -> np.ndarray:
        """``|cos(v_top, mu_k)|`` per group (default all): GC as n -> infinity."""
        mu = self.means()
        second = (np.array(self.shares)[:, None, None] * mu[:, :, None] * mu[:, None, :]).sum(0)
        _, vecs = np.linalg.eigh(second)
        top = vecs[:, -1]
        cos = np.abs(mu @ top) / np.linalg.norm(mu, axis=1)
        return cos if groups is None else cos[list(groups)]


def _groups(labels: np.ndarray) -> list:
    return [np.flatnonzero(labels == k) for k in range(labels.max() + 1)]


@entry("interval_calibration")
def interval_calibration(pool: PlantedPool, n: int, *, draws: int = 100, truth_draws: int = 400,
                         resampling: Resampling = Resampling(null_draws=0), seed: int = 0) -> pd.DataFrame:
    """Coverage of GC's intervals on ``draws`` independent draws of ``n`` samples from ``pool``.

    The subsets are the planted groups. Per group: the finite-n target (mean |GC| over
    ``truth_draws`` further draws) and its draw-to-draw sd, the large-sample value, the share of
    draws whose ``abs_interval`` covers the target, the median width in units of that sd, the
    mean jackknife bias against the true bias (target minus large-sample value), and, over the
    draws where the large-sample estimate is claimed, the share claimed and its coverage.

    Returns a DataFrame, one row per group.
    """
    if not isinstance(pool, PlantedPool):
        raise InputError("pool", "must be a PlantedPool", type(pool).__name__)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2 * len(pool.shares):
        raise InputError("n", f"must be an integer of at least 2 samples per group ({2 * len(pool.shares)})", n)
    rng = np.random.default_rng([seed, 7])
    groups = _groups(pool.labels(n))
    truth = np.array([[abs(r.score) for r in kernel_gc(J @ J.T, groups, resampling=None)]
                      for J in (pool.draw(n, rng) for _ in range(truth_draws))])
    target, sd = truth.mean(0), truth.std(0, ddof=1)
    large = pool.large_sample_gc()
    rows = []
    for _ in range(draws):
        J = pool.draw(n, rng)
        rows.append(kernel_gc(J @ J.T, groups, resampling=resampling))
    out = []
    for k in range(len(groups)):
        res = [r[k] for r in rows]
        low = np.array([r.abs_interval.low for r in res])
        high = np.array([r.abs_interval.high for r in res])
        claimed = np.array([r.large_sample == "claimed" for r in res])
        l_low = np.array([r.abs_large_interval.low for r in res])
        l_high = np.array([r.abs_large_interval.high for r in res])
        out.append({
            "group": k, "n_group": len(groups[k]), "target": target[k], "sd_over_draws": sd[k],
            "large_sample": large[k], "true_bias": target[k] - large[k],
            "coverage": float(((low <= target[k]) & (target[k] <= high)).mean()),
            "median_width_over_sd": float(np.median(high - low) / sd[k]),
            "mean_bias_estimate": float(np.nanmean([r.abs_bias for r in res])),
            "claimed": float(claimed.mean()),
            "large_coverage": float(((l_low <= large[k]) & (large[k] <= l_high))[claimed].mean())
            if claimed.any() else math.nan,
        })
    return pd.DataFrame(out)
