"""How far a gradient consistency can be trusted, from the kernel alone (docs/design.md §1.1).

With the whole set's NTK ``Theta`` (n, n) at hand, every GC statistic costs
eigendecompositions, not gradients:

- **the point value** ``GC(S) = u^T Theta[:, S] u_S / sqrt(lambda lambda_S)``;
- **conditioning** of both eigenvectors: ``lambda_2 / lambda_1`` and ``cos(u, 1) = sum(u) / sqrt(n)``.
  Where ``cos(u, 1)`` is near 0, the sign convention ``sum(u) > 0`` is a coin toss;
- **mean-gradient consistency**: the cosine between the subset's mean gradient and the whole
  set's, ``1_S^T Theta[S, :] 1 / sqrt(1_S^T Theta[S, S] 1_S 1^T Theta 1)``, whose sign means
  something;
- **the interval of the finite-n quantity** (default: the stratified jackknife,
  :mod:`ntkscope.kernel.replicates`): where the GC of an independent analysis set of the same
  sizes would fall on average, ``point +- z se``. That is the quantity a null band is compared
  at. GC at finite n is biased against its large-sample value (noise pulls a cosine towards
  0), so the result also carries the jackknife's **bias** and, where the bias is O(1/n) (the
  half-sample check agrees), a **large-sample estimate** with its interval;
- **null bands** (:mod:`ntkscope.kernel.nulls`): |GC| of random subsets of the same size, and,
  with :class:`~ntkscope.kernel.nulls.Controls`, of homogeneous and covariate-matched subsets.

``|GC|`` is the headline, always against a null band; the signed value is reported only when
its sign is confident; a **flag** names each diagnostic past its threshold (:class:`Resampling`).
Calibration against planted pools and real kernels: docs/gc-calibration.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import scipy.stats
import torch

from ntkscope.core.checks import InputError, as_numbers, check_choice, check_fraction, entry
from ntkscope.kernel import replicates
from ntkscope.kernel.device_statistics import DeviceStatistics
from ntkscope.kernel.nulls import (NO_BAND, Controls, NullBand, check_controls, homogeneous_band, matched_band,
                                   random_band, wants_loss)

INTERVALS = ("jackknife", "basic", "bca")

__all__ = ["Controls", "GCResult", "Interval", "NullBand", "Resampling", "kernel_gc", "kernel_statistics"]


@dataclass(frozen=True)
class Resampling:
    """How the uncertainty of a GC is measured, and when its direction counts as ill-defined.

    Parameters
    ----------
    resamples : int
        Replicates: the jackknife's deletions at most (delete-1 up to this many samples, then
        delete-a-group, at least 2 groups per stratum), or the bootstrap's resamples
        (0: no interval, no sign confidence, no bias).
    null_draws : int
        Subsets behind each null band (0: no band).
    confidence : float
        Level of the intervals and of the null bands (two-sided).
    interval : {"jackknife", "basic", "bca"}
        "jackknife" (the default; calibrated in docs/gc-calibration.md): ``point +- t se`` with
        the larger of the stratified delete-1 jackknife's and the delete-half jackknife's (the
        half-samples') standard errors, t on its degrees of freedom, plus the bias and the
        large-sample estimate.
        "basic" / "bca": ``scipy.stats.bootstrap``'s intervals, kept for comparison; their
        resamples hold about 63 % distinct samples, so they describe a smaller sample than the
        point's (mostly ``[point, 1]`` near GC = 1).
    half_samples : int
        Stratified half-samples that check the jackknife's bias is O(1/n) (jackknife only; 0:
        the large-sample estimate is not claimed).
    seed : int
        Seeds the replicates and the null draws; recorded with every result.
    max_eigengap, min_cos_ones, min_sign_confidence : float
        Flag thresholds: ``lambda_2 / lambda_1`` above, ``|cos(u, 1)|`` below (whole set or
        subset), sign confidence below. The starting points measured on the quick reproduction
        (the GC issue's spike); not a law.
    """

    resamples: int = 200
    null_draws: int = 200
    confidence: float = 0.9
    interval: str = "jackknife"
    half_samples: int = 40
    seed: int = 0
    max_eigengap: float = 0.5
    min_cos_ones: float = 0.3
    min_sign_confidence: float = 0.9

    @entry("Resampling")
    def __post_init__(self):
        for name in ("resamples", "null_draws", "half_samples", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(name, "must be a non-negative integer", value)
        check_fraction("confidence", self.confidence)
        check_choice("interval", self.interval, INTERVALS)
        for name in ("max_eigengap", "min_cos_ones", "min_sign_confidence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise InputError(name, "must be a number in [0, 1]", value)

    @property
    def z(self) -> float:
        """The two-sided normal quantile of ``confidence`` (1.645 at 0.9)."""
        return float(scipy.stats.norm.ppf((1 + self.confidence) / 2))


class Interval(NamedTuple):
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


_NAN = Interval(math.nan, math.nan)


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
        Intervals of the score, of ``|score|`` and of ``mean_gradient`` as finite-n quantities:
        where the value of an independent analysis set of the same sizes falls on average
        (NaN without a kernel or with ``resamples=0``); each contains its point value.
    abs_se : float
        Standard error of ``|score|`` (jackknife; bootstrap standard deviation with a
        bootstrap interval): the draw-to-draw noise to compare two GCs of the same sizes by.
    abs_bias : float
        Jackknife estimate of the finite-n bias of ``|score|`` (finite-n mean minus
        large-sample value; negative: more data would give a larger |GC|). NaN unless jackknife.
        Trust it only where :attr:`large_sample` is "claimed": where the bias is not O(1/n)
        (few samples per direction, many noisy dimensions) it can be off by several times, and
        even in sign (docs/gc-calibration.md).
    abs_large, abs_large_interval : float, Interval
        The large-sample estimate ``|score| - abs_bias`` and its interval, where
        :attr:`large_sample` is "claimed"; NaN where not.
    large_sample : str
        "claimed", or why the large-sample estimate is not: the half-sample check finds the
        bias is not O(1/n), the estimate leaves [0, 1], or no jackknife ran.
    sign_confidence : float
        Jackknife: ``Phi(|score| / se)``, the chance an independent draw keeps the sign (normal
        approximation). Bootstrap: the share of resamples whose score has the point's sign.
    null : NullBand
        ``|GC|`` of random subsets of ``n_subset`` samples.
    controls : dict of name to NullBand
        The other nulls (:class:`~ntkscope.kernel.nulls.Controls`): "homogeneous",
        "matched-<covariate>".
    flags : tuple of str
        Diagnostics past their :class:`Resampling` threshold: "eigengap", "eigengap-subset",
        "cos-ones", "cos-ones-subset", "sign". Any of them: :attr:`ill_defined`.
    extended : bool
        A bootstrap interval was extended to reach its point value (the bootstrap distribution
        lay almost wholly on one side of it), or BCa was undefined and the basic interval of the
        same resamples took its place. Never set by the jackknife.
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
    abs_bias: float = math.nan
    abs_large: float = math.nan
    abs_large_interval: Interval = _NAN
    large_sample: str = "no jackknife"
    null: NullBand = NO_BAND
    controls: dict = field(default_factory=dict)
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
        """``|score|`` against the random null band: "above", "below" or "within" ("n/a" without a band).

        The verdict is about the finite-n quantity, what another analysis set of these sizes
        would show, so the score's interval (:attr:`abs_interval`) must clear the band: "below"
        only when its upper end lies under the band's lower end ("above" the other way). A point
        under the band with an interval reaching into it is "within" (a point alone would call a
        bin below the null while its interval covers the whole band). Without an interval (no
        resamples) the point is compared."""
        return self.null.versus(abs(self.score), self.abs_interval)

    def versus(self, control: str = "random") -> str:
        """``|score|`` (its interval) against the band of ``control`` ("random", "homogeneous",
        "matched-length", ...), as :attr:`versus_null`."""
        if control == "random":
            return self.versus_null
        if control not in self.controls:
            raise InputError("control", f"must be 'random' or one of this result's controls {list(self.controls)}",
                             control)
        return self.controls[control].versus(abs(self.score), self.abs_interval)

    @property
    def excess(self) -> float:
        """``|score|`` minus the random null's median: how far the subset is from a random one of its size."""
        return abs(self.score) - self.null.median if self.null.draws else math.nan

    @property
    def excess_se(self) -> float:
        """Standard error of :attr:`excess`: ``abs_se`` and the null median's own, combined."""
        return math.sqrt(self.abs_se ** 2 + self.null.median_se ** 2) if self.null.draws else math.nan

    def row(self) -> dict:
        """One flat table row of every field (intervals and bands as ``*_low`` / ``*_high``)."""
        row = dict(
            label=self.label, gc=self.score, gc_low=self.interval.low, gc_high=self.interval.high,
            abs_gc=abs(self.score), abs_gc_low=self.abs_interval.low, abs_gc_high=self.abs_interval.high,
            abs_gc_se=self.abs_se, abs_gc_bias=self.abs_bias, abs_gc_large=self.abs_large,
            abs_gc_large_low=self.abs_large_interval.low, abs_gc_large_high=self.abs_large_interval.high,
            large_sample=self.large_sample,
            null_low=self.null.low, null_median=self.null.median, null_high=self.null.high,
            versus_null=self.versus_null, excess=self.excess, excess_se=self.excess_se)
        for name, band in self.controls.items():
            row.update({f"null_{name}_low": band.low, f"null_{name}_median": band.median,
                        f"null_{name}_high": band.high,
                        f"versus_{name}": band.versus(abs(self.score), self.abs_interval)})
        row.update(
            sign_confidence=self.sign_confidence, gc_signed=self.signed,
            mean_gradient=self.mean_gradient, mean_gradient_low=self.mean_gradient_interval.low,
            mean_gradient_high=self.mean_gradient_interval.high, flags=" ".join(self.flags), extended=self.extended,
            n_subset=self.n_subset, n=self.n, eigenvalue=self.eigenvalue, eigenvalue_subset=self.eigenvalue_subset,
            eigengap=self.eigengap, eigengap_subset=self.eigengap_subset, cos_ones=self.cos_ones,
            cos_ones_subset=self.cos_ones_subset, method=self.method,
            interval_method=self.resampling.interval if self.resampling else None,
            resamples=self.resampling.resamples if self.resampling else 0,
            seed=self.resampling.seed if self.resampling else None)
        return row


# ---- the statistics of a kernel ------------------------------------------------------------------


def _clipped(point: float, low: float, high: float, bounds=(-1.0, 1.0)) -> Interval:
    """``[low, high]`` clipped to the statistic's range (NaN bounds: the point alone)."""
    if math.isnan(low) or math.isnan(high):
        return Interval(point, point)
    return Interval(float(max(bounds[0], min(low, point))), float(min(bounds[1], max(high, point))))


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


def _from_bootstrap(points: np.ndarray, k: int, j: int, boot, r: Resampling) -> dict:
    """The interval fields of subset ``j`` of ``k`` from the bootstrap ``(low, high, dist)``."""
    low, high, dist = boot
    fields, extended = {}, False
    names = (("interval", (-1.0, 1.0)), ("abs_interval", (0.0, 1.0)), ("mean_gradient_interval", (-1.0, 1.0)))
    for (name, bounds), row in zip(names, (j, k + j, 2 * k + j)):
        lo, hi, replaced = _defined(points[row], low[row], high[row], dist[row], r.confidence)
        interval = _clipped(points[row], lo, hi, bounds)
        extended = extended or replaced or not (lo <= points[row] <= hi if not math.isnan(lo) else True)
        fields[name] = interval
    fields["abs_se"] = float(np.nanstd(dist[k + j], ddof=1))
    agree = np.sign(dist[j]) == np.sign(points[j])
    fields["sign_confidence"] = float(agree[np.isfinite(dist[j])].mean())
    fields["extended"] = bool(extended)
    fields["large_sample"] = "not estimated by the bootstrap"
    return fields


def _large_sample(point: float, bias: float, half_bias: float, half_se: float, se: float, z: float) -> str:
    """"claimed" when the jackknife's bias is O(1/n): the half-sample mean sits as far from the
    point as the jackknife's bias says (a half-sample has half the samples, so its O(1/n) bias
    is twice the point's: the difference equals the bias), within the larger of ``z`` Monte
    Carlo errors of the half-samples, 50 % of the bias and half a standard error; and the
    corrected value stays in [0, 1]. Else why not."""
    if math.isnan(half_bias):
        return "no half-samples to check the bias"
    tolerance = max(z * half_se, 0.5 * abs(bias), 0.5 * se)
    if abs(half_bias - bias) > tolerance:
        return f"bias not O(1/n): half-samples {half_bias:+.3f}, jackknife {bias:+.3f}"
    if not 0.0 <= point - bias <= 1.0:
        return f"the corrected value {point - bias:.3f} leaves [0, 1]"
    return "claimed"


def _from_jackknife(jk: replicates.Jackknife, k: int, j: int, r: Resampling) -> dict:
    """The interval, bias and large-sample fields of subset ``j`` of ``k`` from the jackknife:
    ``point +- t se``, se the larger of the delete-1 jackknife's and the delete-half one's (the
    half-samples' spread: delete-1 under-covers under anisotropic or heavy-tailed gradients,
    docs/gc-calibration.md), t on the chosen one's degrees of freedom (Satterthwaite over the
    strata for delete-1, half-samples - 1 for delete-half; the normal quantile when they are many)."""
    p = jk.point
    halves = np.isfinite(jk.half_sd) & (jk.half_sd > jk.se)
    se = np.where(halves, jk.half_sd, jk.se)
    df = np.where(halves, r.half_samples - 1, jk.df)

    def t(i):
        return float(scipy.stats.t.ppf((1 + r.confidence) / 2, df[i])) if np.isfinite(df[i]) else r.z

    def around(i, bounds=None):
        return _clipped(p[i], p[i] - t(i) * se[i], p[i] + t(i) * se[i], *([bounds] if bounds else []))

    fields = {"interval": around(j), "abs_interval": around(k + j, (0.0, 1.0)),
              "mean_gradient_interval": around(2 * k + j), "abs_se": float(se[k + j]), "abs_bias": float(jk.bias[k + j])}
    fields["sign_confidence"] = 1.0 if se[j] == 0 else float(
        scipy.stats.t.cdf(abs(p[j]) / se[j], df[j]) if np.isfinite(df[j]) else scipy.stats.norm.cdf(abs(p[j]) / se[j]))
    claim = _large_sample(p[k + j], jk.bias[k + j], jk.half_bias[k + j], jk.half_se[k + j], se[k + j], r.z)
    fields["large_sample"] = claim
    if claim == "claimed":
        large = float(p[k + j] - jk.bias[k + j])
        spread = t(k + j) * math.sqrt(2) * se[k + j]  # the bias estimate is about as noisy as the point (calibration)
        fields["abs_large"] = large
        fields["abs_large_interval"] = _clipped(large, large - spread, large + spread, (0.0, 1.0))
    return fields


def kernel_statistics(K: np.ndarray, members: list, resampling: Resampling | None,
                      controls: Controls | None = None, device=None) -> list[dict]:
    """The GCResult fields of each subset (member index arrays, sorted, >= 2 each) of a valid
    float64 kernel ``K`` (n, n), with checked ``controls`` (:func:`~ntkscope.kernel.nulls.check_controls`);
    ``resampling=None``: the point values and conditioning only. ``device``: None solves the
    jackknife and the null draws on the host; a torch device (the kernel's, where it came from a
    GPU) solves them there as batched torch (:mod:`ntkscope.kernel.device_statistics`: the same
    numbers to float rounding)."""
    n = K.shape[0]
    on = None if device is None or resampling is None else DeviceStatistics(K, device)
    whole, subs = replicates.statistics(K, np.ones(n, dtype=np.int64), members)
    k = len(members)
    points = np.concatenate([[s[0] for s in subs], [abs(s[0]) for s in subs], [s[2] for s in subs]])
    r = resampling
    jk = boot = None
    if r is not None and r.resamples > 0:
        if r.interval == "jackknife":
            plan = dict(budget=r.resamples, halves=r.half_samples, seed=r.seed)
            jk = (replicates.jackknife(K, members, **plan) if on is None
                  else on.jackknife(members, **plan, point=(whole, subs)))
        else:
            boot = replicates.bootstrap(K, members, resamples=r.resamples, confidence=r.confidence,
                                        method=r.interval, seed=r.seed)
    bands = {}
    out = []
    for j, (idx, (gc, sub, mean)) in enumerate(zip(members, subs)):
        fields = dict(score=gc, eigenvalue=whole.eigenvalue, eigengap=whole.eigengap, cos_ones=whole.cos_ones,
                      eigenvalue_subset=sub.eigenvalue, eigengap_subset=sub.eigengap, cos_ones_subset=sub.cos_ones,
                      mean_gradient=mean, n=n, n_subset=len(idx), resampling=r)
        flags = []
        if r is not None:
            if jk is not None:
                fields.update(_from_jackknife(jk, k, j, r))
            elif boot is not None:
                fields.update(_from_bootstrap(points, k, j, boot, r))
            options = dict(draws=r.null_draws, confidence=r.confidence, seed=r.seed,
                           solve=None if on is None else on.abs_gcs)
            size = len(idx)
            if ("random", size) not in bands:
                bands["random", size] = random_band(K, whole, size, **options)
            fields["null"] = bands["random", size]
            if controls is not None:
                found = {}
                if "homogeneous" in controls.names():  # pools: one band per size; neighbours: per subset
                    key = ("homogeneous", size) if controls.homogeneous is not None else ("homogeneous", j)
                    if key not in bands:
                        bands[key] = homogeneous_band(K, whole, idx, controls, **options)
                    found["homogeneous"] = bands[key]
                for name, covariate in controls.matched.items():
                    found[f"matched-{name}"] = matched_band(K, whole, idx, covariate, controls.quantiles, **options)
                fields["controls"] = found
            flags = list(conditioning_flags(whole.eigengap, whole.cos_ones, sub.eigengap, sub.cos_ones, r,
                                            fields.get("sign_confidence", math.nan)))
            if flags and fields.get("large_sample") == "claimed":  # an ill-defined direction has no O(1/n) bias
                fields.update(large_sample=f"the direction is flagged ({' '.join(flags)})", abs_large=math.nan,
                              abs_large_interval=_NAN)
        fields["flags"] = tuple(flags)
        out.append(fields)
    return out


def statistics_device(kernel) -> torch.device | None:
    """Where the statistics of ``kernel`` run: its device when it is a torch tensor on a CUDA
    device (:class:`~ntkscope.kernel.device_statistics.DeviceStatistics`, in float64), else None:
    the host (a CPU tensor, an array, or a device without float64 such as Apple's MPS)."""
    device = getattr(kernel, "device", None)
    return device if isinstance(device, torch.device) and device.type == "cuda" else None


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
def kernel_gc(kernel, subsets, *, resampling: Resampling | None = Resampling(),
              controls: Controls | None = None) -> list[GCResult]:
    """GC of each subset against the whole set, with its uncertainty, from a kernel alone.

    Parameters
    ----------
    kernel : Tensor or ndarray of shape (n, n)
        A symmetric PSD NTK (e.g. ``empirical_ntk(...).matrix``), used in float64. A tensor on a
        GPU has its jackknife and null draws solved there as batched torch (the same numbers to
        float rounding as the host path, which a CPU tensor or an array takes).
    subsets : sequence of index sequences
        Each of at least 2 distinct indices in [0, n).
    resampling : Resampling or None
        ``None``: point values, conditioning and mean-gradient consistency only.
    controls : Controls or None
        Null bands beside the random one (homogeneous, covariate-matched).

    Returns
    -------
    list of GCResult, one per subset (``method="kernel"``)
    """
    K = as_numbers("kernel", kernel.detach().cpu().numpy() if hasattr(kernel, "detach") else kernel,
                   what="a square matrix of numbers")
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
    if isinstance(subsets, (str, bytes, os.PathLike)) or not isinstance(subsets, Iterable):
        raise InputError("subsets", "must be a sequence of index sequences", type(subsets).__name__)
    for s in subsets:
        idx = np.asarray(s)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or idx.size < 2 or len(np.unique(idx)) != idx.size \
                or idx.min() < 0 or idx.max() >= n:
            shown = idx.tolist()[:10] if idx.ndim == 1 else idx.tolist() if idx.ndim == 0 else f"shape {idx.shape}"
            raise InputError("subsets", f"must each hold at least 2 distinct indices in [0, {n})", shown)
        members.append(np.sort(idx))
    if not members:
        raise InputError("subsets", "must hold at least one subset", [])
    controls = check_controls(controls, n)
    if wants_loss(controls):
        raise InputError("controls", "must give each covariate as values here (a kernel alone has no forward to "
                         "read the loss from; analysis_controls(..., loss_from='forward') gives the losses)",
                         sorted(controls.matched))
    return [GCResult(method="kernel", **fields)
            for fields in kernel_statistics(K, members, resampling, controls, statistics_device(kernel))]
