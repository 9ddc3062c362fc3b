"""Null bands for a subset's |GC|: what it would be if the subset were not special (docs/design.md §1.1).

A band is the (1 - c)/2, 1/2 and (1 + c)/2 quantiles of |GC| over subsets of the same size,
drawn on the same kernel, against the same whole set. Each control rules out one boring
explanation of "the subset is below the random null":

- ``random``: uniform subsets. Below it: the subset is less aligned with the whole set than a
  random one of its size; any group more alike than a random draw (a coherent source) can be.
- ``homogeneous``: subsets of one ordinary source. With pools (index arrays of one non-tail
  source or label each) the draws come from one pool at a time; without pools, from the
  nearest neighbours of a random seed sample by gradient cosine
  ``Theta_ij / sqrt(Theta_ii Theta_jj)`` (the model's own gradient representation, from the
  kernel alone), seeds drawn from outside the subset. Below it: less aligned than a coherent group of ordinary text, i.e. not
  explained by coherence alone.
- ``matched``, per covariate (e.g. length, loss): random subsets with the subset's
  distribution over the covariate's quantile bins. Below it: not explained by the covariate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ntkscope.core.checks import InputError, entry
from ntkscope.kernel.replicates import Direction, subset_abs_gcs


class NullBand(NamedTuple):
    """Quantiles of ``|GC|`` over ``draws`` subsets of one size: (1 - c)/2, 1/2, (1 + c)/2
    (NaN and 0 draws where the control could not be drawn)."""

    low: float
    median: float
    high: float
    draws: int

    def versus(self, value: float, interval=None) -> str:
        """``value`` against the band: "above", "below", "within", or "n/a" without a band. With
        ``interval`` (low, high) around the value, it must clear the band: "below" only when its
        upper end is under the band, "above" only when its lower end is over it."""
        if self.draws == 0 or math.isnan(value):
            return "n/a"
        low, high = (value, value) if interval is None or any(map(math.isnan, interval)) else interval
        if low > self.high:
            return "above"
        if high < self.low:
            return "below"
        return "within"

    @property
    def median_se(self) -> float:
        """The standard error of the median as an estimate from ``draws`` draws (normal
        approximation: 1.2533 sd / sqrt(draws), the sd read off the band)."""
        if self.draws == 0:
            return math.nan
        return 1.2533 * (self.high - self.low) / (2 * 1.645) / math.sqrt(self.draws)


NO_BAND = NullBand(math.nan, math.nan, math.nan, 0)


class KernelLoss(NamedTuple):
    """A matched covariate still to be read: each sample's loss under ``objective`` (the kernel
    output's language-model loss), taken from the kernel's own forward where its method runs one
    over every sample (structured), else from one forward of its own (:func:`resolve_loss`)."""

    objective: object


def resolve_loss(controls: Controls | None, n: int, recorded, forward) -> Controls | None:
    """``controls`` with each :class:`KernelLoss` covariate replaced by ``recorded`` (the (n,)
    losses a kernel's forward kept, or None) or, failing that, by ``forward(objective)``; checked."""
    if not wants_loss(controls):
        return controls
    matched = {name: (v if not isinstance(v, KernelLoss) else
                      np.asarray(recorded if recorded is not None else forward(v.objective), dtype=np.float64))
               for name, v in controls.matched.items()}
    return check_controls(Controls(controls.homogeneous, controls.neighbours, matched, controls.quantiles), n)


def wants_loss(controls: Controls | None) -> bool:
    """Whether ``controls`` has a :class:`KernelLoss` covariate still to read."""
    return controls is not None and any(isinstance(v, KernelLoss) for v in controls.matched.values())


@dataclass(frozen=True)
class Controls:
    """The nulls beside the random one.

    Parameters
    ----------
    homogeneous : sequence of index sequences, or None
        Pools of ordinary (non-tail) text, one source or label each. None: the nearest
        neighbours of a random seed sample in gradient-cosine space (``neighbours=True``).
    neighbours : bool
        Without pools, draw the homogeneous null from nearest neighbours (False: no
        homogeneous null).
    matched : mapping of name to array of shape (n,)
        Covariates (e.g. ``{"length": tokens, "loss": loss}``) to match random subsets on; a
        :class:`KernelLoss` is read from the kernel's own forward by the GC functions.
    quantiles : int
        Quantile bins of each covariate that a matched draw keeps the subset's counts in.
    """

    homogeneous: Sequence | None = None
    neighbours: bool = True
    matched: Mapping = field(default_factory=dict)
    quantiles: int = 5

    @entry("Controls")
    def __post_init__(self):
        if isinstance(self.quantiles, bool) or not isinstance(self.quantiles, int) or self.quantiles < 1:
            raise InputError("quantiles", "must be a positive integer", self.quantiles)
        if not isinstance(self.matched, Mapping):
            raise InputError("matched", "must map a covariate's name to one value per sample", type(self.matched).__name__)
        if self.homogeneous is not None and len(self.homogeneous) == 0:
            raise InputError("homogeneous", "must hold at least one pool of indices, or be None", [])

    def names(self) -> list:
        """The control names a result carries, in order."""
        homogeneous = self.homogeneous is not None or self.neighbours
        return ["homogeneous"] * homogeneous + [f"matched-{name}" for name in self.matched]


def check_controls(controls, n: int) -> Controls | None:
    """``controls`` with its pools as sorted index arrays and its covariates as float arrays,
    checked against ``n`` samples (entry-point validation)."""
    if controls is None:
        return None
    if not isinstance(controls, Controls):
        raise InputError("controls", "must be a Controls or None", type(controls).__name__)
    pools = None
    if controls.homogeneous is not None:
        pools = []
        for pool in controls.homogeneous:
            idx = np.unique(np.asarray(pool))
            if idx.ndim != 1 or idx.size < 2 or not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0 \
                    or idx.max() >= n:
                raise InputError("controls.homogeneous", f"must be pools of at least 2 indices in [0, {n})",
                                 np.asarray(pool).tolist()[:10])
            pools.append(idx)
    matched = {}
    for name, values in controls.matched.items():
        if isinstance(values, KernelLoss):  # read with the kernel (resolve_loss), checked then
            matched[name] = values
            continue
        x = np.asarray(values, dtype=np.float64)
        if x.shape != (n,) or not np.isfinite(x).all():
            raise InputError(f"controls.matched[{name!r}]", f"must hold one finite value per sample, shape ({n},)",
                             x.shape if x.shape != (n,) else "non-finite values")
        matched[name] = x
    return Controls(pools, controls.neighbours, matched, controls.quantiles)


def _band(K: np.ndarray, whole: Direction, draw, draws: int, confidence: float, solve=None) -> NullBand:
    """|GC| of ``draws`` subsets ``draw(i) -> index array`` (None: cannot be drawn) against ``whole``,
    solved by ``solve(along, norm, subsets)`` (default: :func:`~ntkscope.kernel.replicates.subset_abs_gcs`
    on the host; :meth:`~ntkscope.kernel.device_statistics.DeviceStatistics.abs_gcs` on a device)."""
    along, norm = whole.weights @ K, math.sqrt(max(whole.eigenvalue, 0))  # the whole set's side, once
    subsets = []
    for i in range(draws):  # every draw first, in order (the seeded stream), then solved together
        idx = draw(i)
        if idx is None:
            return NO_BAND
        subsets.append(np.sort(idx))
    if not subsets:
        return NO_BAND
    out = subset_abs_gcs(K, along, norm, subsets) if solve is None else solve(along, norm, subsets)
    tail = (1 - confidence) / 2
    low, median, high = np.quantile(out, [tail, 0.5, 1 - tail])
    return NullBand(float(low), float(median), float(high), len(out))


def random_band(K, whole, size: int, *, draws: int, confidence: float, seed: int, solve=None) -> NullBand:
    """|GC| of uniform random subsets of ``size`` samples."""
    n = K.shape[0]
    if draws == 0 or size >= n:
        return NO_BAND
    rng = np.random.default_rng([seed, 1, size])
    return _band(K, whole, lambda i: rng.choice(n, size=size, replace=False), draws, confidence, solve)


def homogeneous_band(K, whole, members: np.ndarray, controls: Controls, *, draws: int, confidence: float,
                     seed: int, solve=None) -> NullBand:
    """|GC| of subsets of ``members``' size from one ordinary source (a pool at a time, cycling
    over the pools large enough) or, without pools, of the nearest neighbours of random seed
    samples from outside ``members`` (so the subset's own cluster does not seed its null)."""
    size = members.size
    n = K.shape[0]
    if draws == 0 or size >= n:
        return NO_BAND
    rng = np.random.default_rng([seed, 3, size])
    if controls.homogeneous is not None:
        pools = [p for p in controls.homogeneous if p.size > size]
        if not pools:
            return NO_BAND
        return _band(K, whole, lambda i: rng.choice(pools[i % len(pools)], size=size, replace=False), draws,
                     confidence, solve)
    if not controls.neighbours:
        return NO_BAND
    diag = np.sqrt(np.clip(np.diag(K), 1e-300, None))
    similarity = K / diag[:, None] / diag[None, :]
    seeds = rng.permutation(np.setdiff1d(np.arange(n), members))[:draws]
    return _band(K, whole, lambda i: np.argsort(-similarity[seeds[i]], kind="stable")[:size], len(seeds),
                 confidence, solve)


def matched_band(K, whole, members: np.ndarray, covariate: np.ndarray, quantiles: int, *, draws: int,
                 confidence: float, seed: int, solve=None) -> NullBand:
    """|GC| of random subsets with the same count as ``members`` in each quantile bin of ``covariate``."""
    n = K.shape[0]
    if draws == 0 or members.size >= n:
        return NO_BAND
    edges = np.unique(np.quantile(covariate, np.linspace(0, 1, quantiles + 1)[1:-1]))
    which = np.searchsorted(edges, covariate, side="right")
    bins = [np.flatnonzero(which == b) for b in range(len(edges) + 1)]
    need = np.bincount(which[members], minlength=len(bins))
    rng = np.random.default_rng([seed, 4, members.size, int(members.sum())])

    def draw(i):
        return np.concatenate([rng.choice(pool, size=k, replace=False) for pool, k in zip(bins, need) if k])

    return _band(K, whole, draw, draws, confidence, solve)
