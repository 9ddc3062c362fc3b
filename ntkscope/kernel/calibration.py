"""Planted pools with a known answer, and how well GC's intervals and nulls cover it (docs/gc-calibration.md).

A :class:`PlantedPool` draws per-sample gradients ``g_i = a s + b_k d_k(i) + sigma e_i``: a
shared direction ``s``, one direction per group ``k`` (group 0 is the tail), and noise ``e_i``
of unit variance per coordinate on average: isotropic Gaussian by default, anisotropic
(``spectrum``: the variance along a random basis falls as ``(j + 1)^-spectrum``) and/or heavy
tailed (``df``: multivariate t, each sample's noise scaled by its own chi-square draw).
Its GC has two known answers:

- **finite-n**: the mean |GC| over independent draws of the same sizes (Monte Carlo), the
  quantity :attr:`~ntkscope.GCResult.abs_interval` should cover;
- **large-sample**: with n -> infinity the whole set's ``g(X)`` points along the top eigenvector
  of the gradients' second moment ``sum_k pi_k mu_k mu_k^T + sigma^2 Sigma`` (``Sigma`` the
  noise covariance; isotropic noise moves no eigenvector) and a group's along the top
  eigenvector of its own, ``mu_k mu_k^T + sigma^2 Sigma`` (its mean ``mu_k`` when isotropic),
  so ``GC_inf`` is the cosine of the two, exactly.

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
    spectrum : float
        Noise anisotropy: the variance along the j-th of a random orthonormal basis is
        proportional to ``(j + 1)^-spectrum`` (0: isotropic), scaled to a mean of 1.
    df : float
        Heavy tails: the noise is multivariate t with ``df`` degrees of freedom (> 2), scaled to
        the same covariance; 0: Gaussian.
    seed : int
        Seeds the directions and the noise basis (draws take their own generator).
    """

    shares: tuple = (0.1, 0.45, 0.45)
    strength: tuple = (2.0, 1.0, 1.0)
    shared: float = 1.0
    noise: float = 0.25
    dim: int = 64
    spectrum: float = 0.0
    df: float = 0.0
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
        if not self.spectrum >= 0:
            raise InputError("spectrum", "must be a non-negative number (0: isotropic noise)", self.spectrum)
        if not (self.df == 0 or self.df > 2):
            raise InputError("df", "must be 0 (Gaussian) or above 2 (a t with finite variance)", self.df)

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

    def noise_basis(self) -> tuple[np.ndarray, np.ndarray]:
        """(Q (P, P) orthonormal, scales (P,)): the noise is ``Q (scales * z)``, mean scale^2 1."""
        scales = (np.arange(self.dim) + 1.0) ** (-self.spectrum / 2)
        scales /= np.sqrt(np.mean(scales ** 2))
        if not self.spectrum:
            return np.eye(self.dim), scales
        q, _ = np.linalg.qr(np.random.default_rng([self.seed, 1]).normal(size=(self.dim, self.dim)))
        return q, scales

    def covariance(self) -> np.ndarray:
        """(P, P) the noise covariance ``Sigma`` (per unit ``noise``)."""
        q, scales = self.noise_basis()
        return (q * scales ** 2) @ q.T

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n, P) gradients of one independent draw, in :meth:`labels` order."""
        mu = self.means()[self.labels(n)]
        q, scales = self.noise_basis()
        e = rng.normal(size=mu.shape) * scales
        if self.df:
            e *= np.sqrt((self.df - 2) / rng.chisquare(self.df, size=(len(mu), 1)))
        return mu + self.noise * (e @ q.T if self.spectrum else e)

    def large_sample_gc(self, groups=None) -> np.ndarray:
        """Per group (default all): GC as n -> infinity, the cosine of the top eigenvectors of the
        whole set's and the group's second moments (module docstring)."""
        mu, noise = self.means(), self.noise ** 2 * self.covariance()

        def top(m):
            return np.linalg.eigh(m)[1][:, -1]

        second = (np.array(self.shares)[:, None, None] * mu[:, :, None] * mu[:, None, :]).sum(0) + noise
        whole = top(second)
        cos = np.array([abs(whole @ top(np.outer(m, m) + noise)) for m in mu])
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
