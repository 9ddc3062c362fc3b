"""GC on a weighted kernel, and its replicates: the jackknife and the bootstrap (docs/design.md §1.1).

A sample with multiplicities ``counts`` (n,) (0: left out, 2: drawn twice) has the kernel
``P Theta P^T``. Its top eigenvector is ``P a`` with ``C^(1/2) Theta C^(1/2) v = lambda v``,
``a = C^(-1/2) v``, so ``g = (C^(1/2) v)^T J`` and only the samples present enter the
eigendecomposition. Every replicate below is such a ``counts`` vector:

- **the jackknife** (the default interval): each stratum (the samples that belong to the same
  subsets) is cut into ``g_h`` groups and each group is left out in turn (delete-1 when the
  budget allows). Its variance ``sum_h (g_h - 1)/g_h sum_j (T_(hj) - T_(h.))^2`` estimates the
  draw-to-draw variance of the finite-n statistic, and its bias ``sum_h (g_h - 1) (T_(h.) - T)``
  the O(1/n) gap between the finite-n mean and the large-sample value;
- **half-samples**: each stratum halved without replacement; their mean against the point
  checks that the bias is O(1/n) (then it equals the jackknife's bias), the condition under
  which the large-sample estimate is claimed;
- **the bootstrap** (``interval="basic"`` or ``"bca"``, kept for comparison): resamples with
  replacement; a resample holds about 63 % distinct samples, so its GC sits lower than the
  point and its basic interval is pushed up (docs/gc-calibration.md).
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
import scipy.linalg
import scipy.linalg.lapack
import scipy.stats

from ntkscope.core.progress import progress_bar


class Direction(NamedTuple):
    weights: np.ndarray  # (k,) w with g = w^T J[rows]: sqrt(c) * v, oriented so that sum(w) > 0
    eigenvalue: float
    eigengap: float
    cos_ones: float


def direction(K: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> Direction:
    """Top eigenvector of the kernel of ``rows`` repeated ``counts`` times (the module's docstring)."""
    return _top(K[np.ix_(rows, rows)], counts)


def _top(block: np.ndarray, counts: np.ndarray) -> Direction:
    """:func:`direction` of the kernel ``block`` (k, k) of the samples present, ``counts`` (k,)."""
    root = np.sqrt(counts)
    M = root[:, None] * block * root[None, :]
    k = len(counts)
    if k == 0:
        raise np.linalg.LinAlgError("a kernel with no samples has no top eigenvector")
    # the top two eigenpairs by LAPACK's dsyevr, as scipy.linalg.eigh(subset_by_index=...) runs it,
    # without its checks (K was checked at the entry point): thousands of small solves per kernel
    vals, vecs, found, _, info = scipy.linalg.lapack.dsyevr(M, compute_v=1, range="I", il=max(1, k - 1), iu=k,
                                                             lower=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"dsyevr did not converge on a {k} x {k} kernel (info {info})")
    vals, vecs = vals[:found], vecs[:, :found]
    w = root * vecs[:, -1]
    total = w.sum()
    if total < 0 or (total == 0 and w[np.flatnonzero(w)[:1]].sum() < 0):
        w = -w
    lam1 = float(vals[-1])
    gap = float(max(vals[0], 0.0) / lam1) if k > 1 and lam1 > 0 else 0.0
    return Direction(w, lam1, gap, float(w.sum() / math.sqrt(counts.sum())))


#: the jackknife's whole-set directions by one batched power iteration: a replicate is taken once its
#: residual ``|K v - lambda v|`` is under RESIDUAL * lambda; one still above it after MAX_POWER products
#: (close top eigenvalues) is solved by ``dsyevr`` as a single replicate is
RESIDUAL, MAX_POWER = 1e-12, 300
#: the share of a fixed positive random vector added to the power iteration's start (:func:`power_start`)
NUDGE = 1e-6


def power_start(weights: np.ndarray) -> np.ndarray:
    """The power iteration's start for every deletion: the whole set's direction ``weights`` (n,)
    plus NUDGE of a fixed positive random unit vector. A deletion can make another eigenvector the
    top one; where the whole set's direction is exactly orthogonal to it (groups of gradients in
    orthogonal coordinates) the iteration would never reach it and would stop, converged, on the
    wrong one. With the nudge that eigenvector's share grows instead, and the replicate is either
    solved or left unconverged (then by ``dsyevr``)."""
    n = weights.size
    nudge = np.random.default_rng(0).uniform(0.5, 1.5, n)
    return weights / np.linalg.norm(weights) + NUDGE * nudge / np.linalg.norm(nudge)


def deletion_directions(K: np.ndarray, present: np.ndarray, start: np.ndarray) -> list:
    """The top eigenvector of the kernel of the samples ``present`` (R, n; bool) in each of R
    replicates, all at once: a power iteration from ``start`` (n,: the whole set's direction) with
    one (n, n) by (n, R) product a step. A :class:`Direction` per replicate (its eigengap not
    computed: NaN), or None where it has not converged (:data:`RESIDUAL`, :data:`MAX_POWER`)."""
    mask = present.T.astype(np.float64)  # (n, R)
    X = start[:, None] * mask
    X /= np.linalg.norm(X, axis=0)
    for _ in range(MAX_POWER):
        Y = (K @ X) * mask
        lam = np.einsum("ir,ir->r", X, Y)
        converged = np.linalg.norm(Y - lam * X, axis=0) <= RESIDUAL * np.abs(lam)
        if converged.all():
            break
        X = Y / np.linalg.norm(Y, axis=0)
    out = []
    for r in range(present.shape[0]):
        if not converged[r] or lam[r] <= 0:
            out.append(None)
            continue
        w = X[present[r], r]
        w = w / np.linalg.norm(w)
        total = w.sum()
        if total < 0 or (total == 0 and w[np.flatnonzero(w)[:1]].sum() < 0):
            w = -w
        out.append(Direction(w, float(lam[r]), math.nan, float(w.sum() / math.sqrt(w.size))))
    return out


def _cosine(product: float, norm_a: float, norm_b: float) -> float:
    """``product / (norm_a norm_b)`` clipped to [-1, 1]; NaN where a norm is 0."""
    if norm_a <= 0 or norm_b <= 0:
        return math.nan
    return float(min(1.0, max(-1.0, product / (norm_a * norm_b))))


def subset_gc(K: np.ndarray, along: np.ndarray, norm: float, rows: np.ndarray) -> float:
    """GC of the subset ``rows`` (sorted, every sample once) against a whole set fixed across
    calls (a null band's draws): ``along`` (n,) is ``w^T K`` and ``norm`` ``sqrt(lambda)`` of the
    whole set's :func:`direction`, so a call costs the subset's eigendecomposition alone. Equal
    to :func:`statistics`' GC of that subset to float rounding."""
    sub = direction(K, rows, np.ones(rows.size))
    return _cosine(along[rows] @ sub.weights, norm, math.sqrt(max(sub.eigenvalue, 0)))


#: subsets up to this size are solved as one stacked ``numpy.linalg.eigh`` per size (a null band's
#: draws: a Python call and a LAPACK call each otherwise); larger ones by ``dsyevr``'s top pair alone
STACKED_UP_TO, STACK_BYTES = 16, 64 * 2**20


def subset_abs_gcs(K: np.ndarray, along: np.ndarray, norm: float, subsets: list) -> np.ndarray:
    """``|subset_gc|`` of each subset (sorted index arrays) against the whole set of ``along`` and
    ``norm``: (len(subsets),). Subsets of one size up to STACKED_UP_TO are solved together; equal
    to :func:`subset_gc` one by one to float rounding (NaN where it is NaN)."""
    out = np.empty(len(subsets))
    by_size: dict = {}
    for i, rows in enumerate(subsets):
        by_size.setdefault(len(rows), []).append(i)
    for size, which in by_size.items():
        if size > STACKED_UP_TO or size < 2:
            out[which] = [abs(subset_gc(K, along, norm, subsets[i])) for i in which]
            continue
        step = max(1, STACK_BYTES // (8 * size * size))
        for start in range(0, len(which), step):
            part = which[start:start + step]
            idx = np.stack([subsets[i] for i in part])  # (d, k)
            vals, vecs = np.linalg.eigh(K[idx[:, :, None], idx[:, None, :]])
            lam = np.maximum(vals[:, -1], 0.0)
            product = np.abs(np.einsum("dk,dk->d", along[idx], vecs[:, :, -1]))
            with np.errstate(divide="ignore", invalid="ignore"):
                value = np.minimum(1.0, product / (norm * np.sqrt(lam)))
            out[part] = np.where((lam > 0) & (norm > 0), value, np.nan)
    return out


def statistics(K: np.ndarray, counts: np.ndarray, members: list, kept: dict | None = None,
               whole: Direction | None = None) -> tuple:
    """(whole direction, [(gc, subset direction, mean-gradient consistency)] per subset) for
    sample ``counts`` (n,) and subsets given as sorted member index arrays. ``kept``: a dict
    shared by the replicates of one kernel; a subset whose counts a replicate leaves as they were
    at the first call reuses its direction from there (the same numbers: its block is the same).
    ``whole``: the whole set's direction when it is already known (:func:`deletion_directions`)."""
    rows = np.flatnonzero(counts)
    c = counts[rows].astype(np.float64)
    block = K[np.ix_(rows, rows)]  # the samples present, indexed once
    whole = _top(block, c) if whole is None else whole
    along, mean_along = whole.weights @ block, c @ block  # the whole set's side of both cosines
    norm, whole_mean = math.sqrt(max(whole.eigenvalue, 0)), math.sqrt(max(float(mean_along @ c), 0.0))
    out = []
    for j, idx in enumerate(members):
        at = np.searchsorted(rows, idx[counts[idx] > 0])  # the subset's samples present, as positions in rows
        sc = c[at]
        own = counts[idx].tobytes()
        if kept is not None and j in kept and kept[j][0] == own:
            sub, norm_sub, mean_sub = kept[j][1:]
        else:
            sub_block = block[np.ix_(at, at)]
            sub = _top(sub_block, sc)
            norm_sub, mean_sub = math.sqrt(max(sub.eigenvalue, 0)), math.sqrt(max(float(sc @ sub_block @ sc), 0.0))
            if kept is not None and j not in kept:  # the first call's (the point's) is the one kept
                kept[j] = (own, sub, norm_sub, mean_sub)
        gc = _cosine(along[at] @ sub.weights, norm, norm_sub)
        mean = _cosine(mean_along[at] @ sc, whole_mean, mean_sub)
        out.append((gc, sub, mean))
    return whole, out


def values(K: np.ndarray, counts: np.ndarray, members: list, kept: dict | None = None,
           whole: Direction | None = None) -> np.ndarray:
    """(3k,) [gc per subset, |gc| per subset, mean-gradient consistency per subset]; ``kept`` and
    ``whole`` as for :func:`statistics`."""
    _, subs = statistics(K, counts, members, kept, whole)
    gc = np.array([s[0] for s in subs])
    return np.concatenate([gc, np.abs(gc), [s[2] for s in subs]])


def strata(n: int, members: list) -> list:
    """Disjoint resampling units: the samples that belong to the same subsets (for disjoint
    groups: each group, then the rest of the set). Every subset is a union of units, so it keeps
    its size (up to what a replicate leaves out) in every replicate."""
    belongs = np.zeros((n, len(members)), dtype=bool)
    for j, idx in enumerate(members):
        belongs[idx, j] = True
    _, unit = np.unique(belongs, axis=0, return_inverse=True)
    return [np.flatnonzero(unit.reshape(-1) == u) for u in range(unit.max() + 1)]


class Jackknife(NamedTuple):
    """Per statistic (3k,): the point, the jackknife standard error, the jackknife bias
    (finite-n mean minus large-sample value, O(1/n)), and the half-sample check of that bias:
    the mean over half-samples minus the point, which equals the bias when it is O(1/n);
    ``df``: the variance's degrees of freedom, Satterthwaite's over the strata (a stratum of
    g_h groups gives g_h - 1; the strata's shares weigh them), the t quantile's for the interval;
    ``half_sd``: the half-samples' spread around their mean, the delete-half jackknife's standard
    error (deleting d = n/2 weighs the squares by (n - d)/d = 1), which stays consistent where
    the statistic is not smooth enough for delete-1 (Shao & Wu 1989, Ann. Stat. 17(3))."""

    point: np.ndarray
    se: np.ndarray
    bias: np.ndarray
    half_bias: np.ndarray
    half_se: np.ndarray
    deletions: int
    df: np.ndarray
    half_sd: np.ndarray


def _groups(units: list, budget: int, rng) -> list:
    """Each unit (of at least 2 samples) cut into g_h random groups, sum g_h <= max(budget, 2 per
    unit), g_h proportional to the unit's size; delete-1 where the budget allows."""
    usable = [u for u in units if u.size >= 2]
    n = sum(u.size for u in usable)
    out = []
    for u in usable:
        g = u.size if n <= budget else min(u.size, max(2, int(round(budget * u.size / n))))
        out.append(np.array_split(rng.permutation(u), g))
    return out


class JackknifePlan(NamedTuple):
    """The replicates of :func:`jackknife`, drawn from its seed: ``sizes`` the number of groups of
    each stratum, in order; ``present`` (D, n) bool, deletion r leaves its group out (the
    strata's groups in order); ``halves`` (H, n) int64, the stratified half-samples' counts."""

    sizes: tuple
    present: np.ndarray
    halves: np.ndarray


def jackknife_plan(n: int, members: list, *, budget: int, halves: int, seed: int) -> JackknifePlan | None:
    """The replicates :func:`jackknife` solves (its docstring), or None when no stratum has 2 samples."""
    units = strata(n, members)
    rng = np.random.default_rng([seed, 2])
    groups = _groups(units, budget, rng)
    if not groups:
        return None
    left_out = [g for unit_groups in groups for g in unit_groups]
    present = np.ones((len(left_out), n), dtype=bool)
    for r, g in enumerate(left_out):
        present[r, g] = False
    half = np.zeros((halves, n), dtype=np.int64)
    for h in range(halves):
        for u in units:
            half[h, rng.choice(u, max(1, u.size // 2), replace=False)] = 1
    return JackknifePlan(tuple(len(g) for g in groups), present, half)


def jackknife_summary(point: np.ndarray, plan: JackknifePlan, deleted: np.ndarray, half: np.ndarray) -> Jackknife:
    """The :class:`Jackknife` of the statistics ``point`` (3k,) from the values of ``plan``'s
    deletions ``deleted`` (D, 3k) and half-samples ``half`` (H, 3k): the strata's variances and
    biases, Satterthwaite's degrees of freedom, the half-samples' bias and spread."""
    var, bias, shares = np.zeros_like(point), np.zeros_like(point), np.zeros_like(point)
    start = 0
    for g in plan.sizes:
        reps = deleted[start:start + g]
        start += g
        mean = reps.mean(0)
        part = (g - 1) / g * ((reps - mean) ** 2).sum(0)
        var += part
        shares += part ** 2 / (g - 1)
        bias += (g - 1) * (mean - point)
    halves = len(half)
    half = half if halves else np.full((1, point.size), np.nan)
    df = np.divide(var ** 2, shares, out=np.full_like(var, np.inf), where=shares > 0)  # Satterthwaite
    spread = half.std(0, ddof=1) if halves > 1 else np.full(point.size, np.nan)
    return Jackknife(point, np.sqrt(var), bias, half.mean(0) - point,
                     spread / math.sqrt(halves) if halves > 1 else np.full(point.size, np.nan),
                     len(deleted), df, spread)


def jackknife(K: np.ndarray, members: list, *, budget: int, halves: int, seed: int) -> Jackknife | None:
    """The stratified delete-a-group jackknife of :func:`values` (module docstring), ``budget``
    deletions at most (at least 2 per stratum), and ``halves`` stratified half-samples; None
    when no stratum has 2 samples. On the host; :class:`ntkscope.kernel.device_statistics.DeviceStatistics`
    solves the same plan as batched torch on a device."""
    n = K.shape[0]
    plan = jackknife_plan(n, members, budget=budget, halves=halves, seed=seed)
    if plan is None:
        return None
    ones = np.ones(n, dtype=np.int64)
    kept: dict = {}  # a subset no deletion touches keeps the point's direction
    point = values(K, ones, members, kept)
    start = power_start(_top(K, ones.astype(np.float64)).weights)
    wholes = deletion_directions(K, plan.present, start)  # every deletion's whole set at once
    deleted, half = [], []
    with progress_bar(len(plan.present) + halves, "GC jackknife", "replicate") as bar:
        for present, whole in zip(plan.present, wholes):
            deleted.append(values(K, present.astype(np.int64), members, kept, whole))
            bar.update(1)
        for counts in plan.halves:
            half.append(values(K, counts, members))
            bar.update(1)
    return jackknife_summary(point, plan, np.array(deleted), np.array(half).reshape(halves, point.size))


def bootstrap(K: np.ndarray, members: list, *, resamples: int, confidence: float, method: str, seed: int):
    """Intervals (3k,) of [gc, |gc|, mean-gradient] per subset and the (3k, B) bootstrap
    distribution (``scipy.stats.bootstrap``, "basic" or "BCa", stratified by unit), or None when
    no unit has 2 samples to resample. A unit of one sample stays fixed (scipy resamples samples
    of at least 2)."""
    n = K.shape[0]
    units = strata(n, members)
    fixed = np.concatenate([u for u in units if u.size == 1] or [np.zeros(0, dtype=int)])
    data = [u for u in units if u.size > 1]
    if not data:
        return None
    calls = resamples + (sum(u.size for u in data) if method == "bca" else 0)
    bar = progress_bar(calls, "GC bootstrap", "resample")  # BCa's jackknife adds one call per sample

    def statistic(*samples):
        bar.update(1)
        return values(K, np.bincount(np.concatenate([*samples, fixed]).astype(np.int64), minlength=n), members)

    with warnings.catch_warnings(), bar:
        warnings.simplefilter("ignore")  # BCa on a degenerate distribution: NaN, handled by the caller
        res = scipy.stats.bootstrap(data, statistic, n_resamples=resamples, vectorized=False,
                                    confidence_level=confidence, method="BCa" if method == "bca" else "basic",
                                    rng=np.random.default_rng([seed, 0]))
    dist = np.atleast_2d(res.bootstrap_distribution)
    low, high = np.atleast_1d(res.confidence_interval.low), np.atleast_1d(res.confidence_interval.high)
    return low, high, dist
