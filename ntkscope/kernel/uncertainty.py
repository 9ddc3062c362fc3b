"""How far a gradient consistency can be trusted, from the kernel alone (docs/design.md §1.1).

With the whole set's NTK ``Theta`` (n, n) at hand, every GC statistic costs
eigendecompositions, not gradients:

- **the point value** ``GC(S) = u^T Theta[:, S] u_S / sqrt(lambda lambda_S)``;
- **conditioning** of both eigenvectors: ``lambda_2 / lambda_1`` and ``cos(u, 1) = sum(u) / sqrt(n)``.
  Where ``cos(u, 1)`` is near 0, the sign convention ``sum(u) > 0`` is a coin toss;
- **mean-gradient consistency**: the cosine between the subset's mean gradient and the whole
  set's, ``1_S^T Theta[S, :] 1 / sqrt(1_S^T Theta[S, S] 1_S 1^T Theta 1)``, whose sign means
  something;
- **a bootstrap interval** (``scipy.stats.bootstrap``, basic or BCa) that resamples the whole set
  stratified by subset: each subset is resampled within itself, the rest of the set within
  itself, and the whole set is their union. A resample with counts ``c`` has the kernel
  ``P Theta P^T``; its top eigenvector is ``P a`` with ``C^(1/2) Theta C^(1/2) v = lambda v``,
  ``a = C^(-1/2) v``, so ``g* = (C^(1/2) v)^T J`` and only the distinct samples enter the
  eigendecomposition. Each resample keeps the sign convention of its own eigenvectors, so a
  coin-toss sign shows up as a low **sign confidence** (the share of resamples whose GC has the
  point value's sign);
- **a null band**: ``|GC|`` of random subsets of the same size, against the same whole set.

``|GC|`` is the headline, always against the null band; the signed value is reported only
when its sign is confident; a **flag** names each diagnostic past its threshold (:class:`Resampling`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import scipy.linalg
import scipy.stats

from ntkscope.core.checks import InputError, check_choice, check_fraction, entry
from ntkscope.core.progress import progress_bar

INTERVALS = ("basic", "bca")


@dataclass(frozen=True)
class Resampling:
    """How the uncertainty of a GC is measured, and when its direction counts as ill-defined.

    Parameters
    ----------
    resamples : int
        Bootstrap resamples (0: no interval, no sign confidence).
    null_draws : int
        Random subsets behind the null band (0: no band).
    confidence : float
        Level of the interval and of the null band (two-sided).
    interval : {"basic", "bca"}
        ``scipy.stats.bootstrap``'s ``"basic"`` or ``"BCa"``. BCa adds one jackknife
        eigendecomposition per sample (n of them).
    seed : int
        Seeds the resamples and the null draws; recorded with every result.
    max_eigengap, min_cos_ones, min_sign_confidence : float
        Flag thresholds: ``lambda_2 / lambda_1`` above, ``|cos(u, 1)|`` below (whole set or
        subset), sign confidence below. The starting points measured on the quick reproduction
        (the GC issue's spike); not a law.
    """

    resamples: int = 200
    null_draws: int = 200
    confidence: float = 0.9
    interval: str = "basic"
    seed: int = 0
    max_eigengap: float = 0.5
    min_cos_ones: float = 0.3
    min_sign_confidence: float = 0.9

    @entry("Resampling")
    def __post_init__(self):
        for name in ("resamples", "null_draws", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(name, "must be a non-negative integer", value)
        check_fraction("confidence", self.confidence)
        check_choice("interval", self.interval, INTERVALS)
        for name in ("max_eigengap", "min_cos_ones", "min_sign_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise InputError(name, "must be a number in [0, 1]", value)


class Interval(NamedTuple):
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


class NullBand(NamedTuple):
    """Quantiles of ``|GC|`` over ``draws`` random subsets of one size: (1 - c)/2, 1/2, (1 + c)/2."""

    low: float
    median: float
    high: float
    draws: int


_NAN = Interval(math.nan, math.nan)
_NO_NULL = NullBand(math.nan, math.nan, math.nan, 0)


@dataclass(frozen=True)
class GCResult:
    """Gradient consistency of one subset against the whole set, with its uncertainty.

    Attributes
    ----------
    score : float
        ``cos(g(X), g(X'))`` in [-1, 1].
    eigenvalue, eigengap, cos_ones : float
        lambda_1, lambda_2 / lambda_1 and ``cos(u, 1)`` of the whole set's NTK.
    eigenvalue_subset, eigengap_subset, cos_ones_subset : float
        The same for the subset's own NTK.
    mean_gradient : float
        Cosine between the subset's and the whole set's mean gradients.
    interval, abs_interval, mean_gradient_interval : Interval
        Bootstrap intervals of the score, of ``|score|`` and of ``mean_gradient`` (NaN
        without a kernel or with ``resamples=0``); each contains its point value.
    abs_se : float
        Bootstrap standard deviation of ``|score|``: the noise to compare two GCs of the same
        size by (the interval also carries the bootstrap's bias towards larger samples).
    sign_confidence : float
        Share of resamples whose score has the point value's sign.
    null : NullBand
        ``|GC|`` of random subsets of ``n_subset`` samples.
    flags : tuple of str
        Diagnostics past their :class:`Resampling` threshold: "eigengap", "eigengap-subset",
        "cos-ones", "cos-ones-subset", "sign". Any of them: :attr:`ill_defined`.
    extended : bool
        An interval was extended to reach its point value, because the bootstrap distribution
        lay almost wholly on one side of it (a bias larger than the spread, e.g. near GC = 1).
        Also set when BCa was undefined for that reason and the basic interval of the same
        resamples took its place.
    n, n_subset : int
    method : str
        "exact", "matrix-free", "projected" or "kernel" (:func:`kernel_gc`).
    resampling : Resampling
        The settings, seed included.
    """

    score: float
    eigenvalue: float
    eigengap: float
    eigenvalue_subset: float
    eigengap_subset: float
    n: int
    n_subset: int
    method: str
    dtype: object = None
    output: object = None
    label: object = None
    matvecs: int = 0
    cos_ones: float = math.nan
    cos_ones_subset: float = math.nan
    mean_gradient: float = math.nan
    interval: Interval = _NAN
    abs_interval: Interval = _NAN
    mean_gradient_interval: Interval = _NAN
    sign_confidence: float = math.nan
    abs_se: float = math.nan
    null: NullBand = _NO_NULL
    flags: tuple = ()
    extended: bool = False
    resampling: Resampling | None = field(default=None, repr=False)

    @property
    def ill_defined(self) -> bool:
        """Any conditioning or sign flag: the direction, and so the signed score, is not to be read."""
        return bool(self.flags)

    @property
    def signed(self) -> float:
        """The score when its sign is confident (no "sign" flag and a measured confidence), else NaN."""
        confident = not math.isnan(self.sign_confidence) and "sign" not in self.flags
        return self.score if confident else math.nan

    @property
    def versus_null(self) -> str:
        """``|score|`` against the null band: "above", "below" or "within" ("n/a" without a band).

        A permutation test at level ``1 - confidence``: the point value against the values that
        random subsets of the same size give on the same kernel. The band already holds the
        sampling noise of a subset of this size, so the point is what is compared (the
        interval answers another question: how the score would move with other data)."""
        if self.null.draws == 0:
            return "n/a"
        value = abs(self.score)
        if value > self.null.high:
            return "above"
        if value < self.null.low:
            return "below"
        return "within"

    def row(self) -> dict:
        """One flat table row of every field (intervals and band as ``*_low`` / ``*_high``)."""
        return dict(
            label=self.label, gc=self.score, gc_low=self.interval.low, gc_high=self.interval.high,
            abs_gc=abs(self.score), abs_gc_low=self.abs_interval.low, abs_gc_high=self.abs_interval.high,
            abs_gc_se=self.abs_se,
            null_low=self.null.low, null_median=self.null.median, null_high=self.null.high,
            versus_null=self.versus_null, sign_confidence=self.sign_confidence, gc_signed=self.signed,
            mean_gradient=self.mean_gradient, mean_gradient_low=self.mean_gradient_interval.low,
            mean_gradient_high=self.mean_gradient_interval.high, flags=" ".join(self.flags), extended=self.extended,
            n_subset=self.n_subset, n=self.n, eigenvalue=self.eigenvalue, eigenvalue_subset=self.eigenvalue_subset,
            eigengap=self.eigengap, eigengap_subset=self.eigengap_subset, cos_ones=self.cos_ones,
            cos_ones_subset=self.cos_ones_subset, method=self.method,
            resamples=self.resampling.resamples if self.resampling else 0,
            seed=self.resampling.seed if self.resampling else None)


# ---- the statistic on a (weighted) kernel --------------------------------------------------------


class _Direction(NamedTuple):
    weights: np.ndarray  # (k,) w with g = w^T J[rows]: sqrt(c) * v, oriented so that sum(w) > 0
    eigenvalue: float
    eigengap: float
    cos_ones: float


def _direction(K: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> _Direction:
    """Top eigenvector of the kernel of ``rows`` repeated ``counts`` times (docstring of the module)."""
    root = np.sqrt(counts)
    M = root[:, None] * K[np.ix_(rows, rows)] * root[None, :]
    k = len(rows)
    vals, vecs = scipy.linalg.eigh(M, subset_by_index=[max(0, k - 2), k - 1])
    w = root * vecs[:, -1]
    total = w.sum()
    if total < 0 or (total == 0 and w[np.flatnonzero(w)[:1]].sum() < 0):
        w = -w
    lam1 = float(vals[-1])
    gap = float(max(vals[0], 0.0) / lam1) if k > 1 and lam1 > 0 else 0.0
    return _Direction(w, lam1, gap, float(w.sum() / math.sqrt(counts.sum())))


def _cosine(K: np.ndarray, rows_a, a: np.ndarray, norm_a: float, rows_b, b: np.ndarray, norm_b: float) -> float:
    """``(a^T J[rows_a]) . (b^T J[rows_b]) / (norm_a norm_b)``, clipped to [-1, 1]."""
    if norm_a <= 0 or norm_b <= 0:
        return math.nan
    value = a @ K[np.ix_(rows_a, rows_b)] @ b / (norm_a * norm_b)
    return float(min(1.0, max(-1.0, value)))


def _mean_norm(K: np.ndarray, rows, counts) -> float:
    return math.sqrt(max(float(counts @ K[np.ix_(rows, rows)] @ counts), 0.0))


def _statistics(K: np.ndarray, counts: np.ndarray, members: list, whole: _Direction | None = None) -> tuple:
    """(whole direction, [(gc, subset direction, mean-gradient consistency)] per subset) for
    sample ``counts`` (n,) and subsets given as member index arrays."""
    rows = np.flatnonzero(counts)
    c = counts[rows].astype(np.float64)
    if whole is None:
        whole = _direction(K, rows, c)
    whole_mean = _mean_norm(K, rows, c)
    out = []
    for idx in members:
        sub_rows = idx[counts[idx] > 0]
        sc = counts[sub_rows].astype(np.float64)
        sub = _direction(K, sub_rows, sc)
        gc = _cosine(K, rows, whole.weights, math.sqrt(max(whole.eigenvalue, 0)), sub_rows, sub.weights,
                     math.sqrt(max(sub.eigenvalue, 0)))
        mean = _cosine(K, rows, c, whole_mean, sub_rows, sc, _mean_norm(K, sub_rows, sc))
        out.append((gc, sub, mean))
    return whole, out


def _strata(n: int, members: list) -> list:
    """Disjoint resampling units: the samples that belong to the same subsets (for disjoint
    groups: each group, then the rest of the set). Every subset is a union of units, so it keeps
    its size in every resample."""
    belongs = np.zeros((n, len(members)), dtype=bool)
    for j, idx in enumerate(members):
        belongs[idx, j] = True
    _, unit = np.unique(belongs, axis=0, return_inverse=True)
    return [np.flatnonzero(unit.reshape(-1) == u) for u in range(unit.max() + 1)]


def _bootstrap(K, members, resampling: Resampling):
    """Intervals (3k,) of [gc, |gc|, mean-gradient] per subset and the (3k, B) bootstrap
    distribution, or None when no unit has 2 samples to resample. A unit of one sample stays
    fixed (scipy resamples samples of at least 2)."""
    n = K.shape[0]
    units = _strata(n, members)
    fixed = np.concatenate([u for u in units if u.size == 1] or [np.zeros(0, dtype=int)])
    data = [u for u in units if u.size > 1]
    if not data:
        return None

    calls = resampling.resamples + (sum(u.size for u in data) if resampling.interval == "bca" else 0)
    bar = progress_bar(calls, "GC bootstrap", "resample")  # BCa's jackknife adds one call per sample

    def statistic(*samples):
        bar.update(1)
        counts = np.bincount(np.concatenate([*samples, fixed]).astype(np.int64), minlength=n)
        _, subs = _statistics(K, counts, members)
        gc = np.array([s[0] for s in subs])
        return np.concatenate([gc, np.abs(gc), [s[2] for s in subs]])

    with warnings.catch_warnings(), bar:
        warnings.simplefilter("ignore")  # BCa on a degenerate distribution: NaN, handled below
        res = scipy.stats.bootstrap(data, statistic, n_resamples=resampling.resamples, vectorized=False,
                                    confidence_level=resampling.confidence,
                                    method="BCa" if resampling.interval == "bca" else "basic",
                                    rng=np.random.default_rng([resampling.seed, 0]))
    dist = np.atleast_2d(res.bootstrap_distribution)
    low, high = np.atleast_1d(res.confidence_interval.low), np.atleast_1d(res.confidence_interval.high)
    return low, high, dist


def _defined(point: float, low: float, high: float, values: np.ndarray, confidence: float) -> tuple:
    """(low, high, replaced): BCa is undefined (NaN) when every resampled value lies on one side
    of the point; the basic interval of the same resamples replaces it then."""
    if not (math.isnan(low) or math.isnan(high)):
        return low, high, False
    values = values[np.isfinite(values)]
    if values.size == 0 or np.ptp(values) == 0:
        return point, point, False
    tail = (1 - confidence) / 2
    q_low, q_high = np.quantile(values, [tail, 1 - tail])
    return 2 * point - q_high, 2 * point - q_low, True


def _contain(point: float, low: float, high: float, bounds=(-1.0, 1.0)) -> tuple[Interval, bool]:
    """Clip to the statistic's range and extend to the point value if needed (True when extended)."""
    if math.isnan(low) or math.isnan(high):
        return Interval(point, point), False
    low, high = max(bounds[0], low), min(bounds[1], high)
    extended = not low <= point <= high
    return Interval(min(low, point), max(high, point)), extended


def _null_band(K: np.ndarray, whole: _Direction, size: int, resampling: Resampling) -> NullBand:
    """|GC| of ``null_draws`` random subsets of ``size`` samples against the whole set's direction."""
    n = K.shape[0]
    if resampling.null_draws == 0 or size >= n:
        return _NO_NULL
    rng = np.random.default_rng([resampling.seed, 1, size])
    ones = np.ones(n, dtype=np.int64)
    values = []
    for _ in progress_bar(resampling.null_draws, f"GC null band (size {size})", "draw",
                          iterable=range(resampling.null_draws)):
        idx = np.sort(rng.choice(n, size=size, replace=False))
        _, ((gc, _, _),) = _statistics(K, ones, [idx], whole)
        values.append(abs(gc))
    tail = (1 - resampling.confidence) / 2
    low, median, high = np.quantile(values, [tail, 0.5, 1 - tail])
    return NullBand(float(low), float(median), float(high), resampling.null_draws)


def kernel_statistics(K: np.ndarray, members: list, resampling: Resampling | None) -> list[dict]:
    """The GCResult fields of each subset (member index arrays, sorted, >= 2 each) of a valid
    float64 kernel ``K`` (n, n); ``resampling=None``: the point values and conditioning only."""
    n = K.shape[0]
    whole, subs = _statistics(K, np.ones(n, dtype=np.int64), members)
    k = len(members)
    intervals = None
    if resampling is not None and resampling.resamples > 0:
        intervals = _bootstrap(K, members, resampling)
    nulls = {}
    out = []
    for j, (idx, (gc, sub, mean)) in enumerate(zip(members, subs)):
        fields = dict(score=gc, eigenvalue=whole.eigenvalue, eigengap=whole.eigengap, cos_ones=whole.cos_ones,
                      eigenvalue_subset=sub.eigenvalue, eigengap_subset=sub.eigengap, cos_ones_subset=sub.cos_ones,
                      mean_gradient=mean, n=n, n_subset=len(idx), resampling=resampling)
        flags = []
        if resampling is not None:
            if intervals is not None:
                low, high, dist = intervals
                bounds = [_defined(point, low[r], high[r], dist[r], resampling.confidence)
                          for point, r in ((gc, j), (abs(gc), k + j), (mean, 2 * k + j))]
                fields["interval"], e1 = _contain(gc, *bounds[0][:2])
                fields["abs_interval"], e2 = _contain(abs(gc), *bounds[1][:2], (0.0, 1.0))
                fields["mean_gradient_interval"], e3 = _contain(mean, *bounds[2][:2])
                e1 = e1 or any(b[2] for b in bounds)
                fields["abs_se"] = float(np.nanstd(dist[k + j], ddof=1))
                agree = np.sign(dist[j]) == np.sign(gc)
                fields["sign_confidence"] = float(agree[np.isfinite(dist[j])].mean())
                fields["extended"] = bool(e1 or e2 or e3)
            if len(idx) not in nulls:
                nulls[len(idx)] = _null_band(K, whole, len(idx), resampling)
            fields["null"] = nulls[len(idx)]
            flags = list(conditioning_flags(whole.eigengap, whole.cos_ones, sub.eigengap, sub.cos_ones, resampling,
                                            fields.get("sign_confidence", math.nan)))
        fields["flags"] = tuple(flags)
        out.append(fields)
    return out


def conditioning_flags(eigengap: float, cos_ones: float, eigengap_subset: float, cos_ones_subset: float,
                       resampling: Resampling, sign_confidence: float = math.nan) -> tuple:
    """The flags past ``resampling``'s thresholds (no "sign" flag without a sign confidence)."""
    r = resampling
    checks = (("eigengap", eigengap > r.max_eigengap), ("eigengap-subset", eigengap_subset > r.max_eigengap),
              ("cos-ones", abs(cos_ones) < r.min_cos_ones), ("cos-ones-subset", abs(cos_ones_subset) < r.min_cos_ones),
              ("sign", not math.isnan(sign_confidence) and sign_confidence < r.min_sign_confidence))
    return tuple(name for name, fired in checks if fired)


def check_resampling(resampling) -> None:
    if resampling is not None and not isinstance(resampling, Resampling):
        raise InputError("resampling", "must be a Resampling or None", type(resampling).__name__)


@entry("kernel_gc")
def kernel_gc(kernel, subsets, *, resampling: Resampling | None = Resampling()) -> list[GCResult]:
    """GC of each subset against the whole set, with its uncertainty, from a kernel alone.

    Parameters
    ----------
    kernel : Tensor or ndarray of shape (n, n)
        A symmetric PSD NTK (e.g. ``empirical_ntk(...).matrix``), used in float64.
    subsets : sequence of index sequences
        Each of at least 2 distinct indices in [0, n).
    resampling : Resampling or None
        ``None``: point values, conditioning and mean-gradient consistency only.

    Returns
    -------
    list of GCResult, one per subset (``method="kernel"``)
    """
    K = np.asarray(kernel.detach().cpu().numpy() if hasattr(kernel, "detach") else kernel, dtype=np.float64)
    if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] < 2:
        raise InputError("kernel", "must be a square matrix of shape (n, n) with n >= 2", K.shape)
    if not np.isfinite(K).all():
        raise InputError("kernel", "must be finite", "NaN/inf entries")
    if not np.allclose(K, K.T, rtol=1e-8, atol=1e-12 * max(1.0, float(np.abs(K).max()))):
        raise InputError("kernel", "must be symmetric", "max |K - K^T| = %.3g" % float(np.abs(K - K.T).max()))
    if not np.trace(K) > 0:
        raise InputError("kernel", "must have a positive diagonal somewhere (all gradients are zero); trace",
                         float(np.trace(K)))
    check_resampling(resampling)
    n = K.shape[0]
    members = []
    for s in subsets:
        idx = np.asarray(s)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or idx.size < 2 or len(np.unique(idx)) != idx.size \
                or idx.min() < 0 or idx.max() >= n:
            raise InputError("subsets", f"must each hold at least 2 distinct indices in [0, {n})", np.asarray(s).tolist()[:10])
        members.append(np.sort(idx))
    if not members:
        raise InputError("subsets", "must hold at least one subset", [])
    return [GCResult(method="kernel", **fields) for fields in kernel_statistics(K, members, resampling)]
