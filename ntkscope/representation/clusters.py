"""How sequence embeddings cluster (docs/design.md §3): scikit-learn-style estimators for the elbow
of K-Means and for DBSCAN with automatic eps, the geometry of a clustering (radii,
inter-cluster distance, separation score), and the seeded Gaussian random projection.

Estimators follow scikit-learn's conventions: parameters are set in ``__init__`` and
stored as given, ``fit`` returns ``self``, learned values end in ``_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, ClusterMixin
from sklearn.cluster import DBSCAN, KMeans
from sklearn.metrics import silhouette_score
from sklearn.neighbors import NearestNeighbors
from sklearn.random_projection import GaussianRandomProjection, johnson_lindenstrauss_min_dim
from threadpoolctl import threadpool_limits

from ntkscope.core.checks import InputError, check_positive_int, entry


def check_embeddings(X, *, min_rows: int = 2) -> np.ndarray:
    """(n, d) finite float64, n >= min_rows."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < min_rows:
        raise InputError("X", f"must have shape (n, d) with n >= {min_rows}", X.shape)
    if not np.isfinite(X).all():
        bad = np.flatnonzero(~np.isfinite(X).all(axis=1))[:5].tolist()
        raise InputError("X", "must be finite; NaN/inf in rows", bad)
    return X


@entry("projection_matrix")
def projection_matrix(d: int, dim: int, *, seed: int = 0) -> np.ndarray:
    """M of shape (dim, d) with N(0, 1/dim) entries, seeded (scikit-learn's GaussianRandomProjection)."""
    check_positive_int("dim", dim)
    return GaussianRandomProjection(n_components=dim, random_state=seed).fit(np.zeros((1, d))).components_


@entry("random_projection")
def random_projection(X, dim: int, *, seed: int = 0) -> np.ndarray:
    """``X M^T`` with M = :func:`projection_matrix` (dim, d): (n, d) -> (n, dim).

    ``dim`` >= d returns X unchanged (a projection cannot help there)."""
    X = check_embeddings(X, min_rows=1)
    check_positive_int("dim", dim)
    if dim >= X.shape[1]:
        return X
    return X @ projection_matrix(X.shape[1], dim, seed=seed).T  # (n, d) @ (d, dim) -> (n, dim)


def jl_guidance(n_samples: int, eps=(0.1, 0.2, 0.3, 0.5)) -> dict:
    """The Johnson-Lindenstrauss dimension that keeps all pairwise distances of ``n_samples``
    points within a factor (1 +- eps), for a few eps: {eps: min dim}."""
    return {float(e): int(johnson_lindenstrauss_min_dim(n_samples, eps=e)) for e in eps}


def knn_distances(X, k: int) -> np.ndarray:
    """The distance from each point of X (n, d) to its ``k``-th nearest other point, sorted: (n,)."""
    k = min(k, len(X) - 1)
    dist, _ = NearestNeighbors(n_neighbors=k + 1).fit(X).kneighbors(X)
    return np.sort(dist[:, -1])


def auto_eps(X, min_samples: int) -> float:
    """DBSCAN's eps from the knee (kneedle, ``kneed``) of the sorted distances to each point's
    ``min_samples``-th nearest neighbour; the 90th percentile of those distances when kneedle
    finds no knee."""
    from kneed import KneeLocator  # imports scipy.signal (0.7 s): only when a knee is asked for

    curve = knn_distances(X, min_samples)
    knee = KneeLocator(np.arange(len(curve)), curve, curve="convex", direction="increasing").knee_y
    if knee is None or not np.isfinite(knee) or knee <= 0:
        return float(np.percentile(curve, 90))
    return float(knee)


#: Kaufman & Rousseeuw's reading of the average silhouette: below 0.25, "no substantial structure"
MIN_SILHOUETTE = 0.25


class ElbowKMeans(ClusterMixin, BaseEstimator):
    """K-Means for K = 1..k_max; K at the knee of the inertia curve (kneedle), the paper's rule,
    beside a rule that can say "no clusters".

    Attributes
    ----------
    inertias_ : (k_max,) inertia for K = 1..k_max.
    k_ : the elbow K (1 when the curve has no knee).
    knee_strength_ : the peak of kneedle's difference curve, in [0, 1] (0: a straight line); a
        smooth convex inertia curve has a knee of some strength whether or not there are clusters.
    silhouettes_ : (k_max - 1,) mean silhouette (scikit-learn) of K = 2..k_max.
    k_silhouette_ : the K of the best silhouette, or 1 ("no clusters") when that silhouette is
        below ``min_silhouette`` (:data:`MIN_SILHOUETTE`).
    labels_ : (n,) labels of the K-Means at ``k_``.  cluster_centers_ : (k_, d).
    """

    def __init__(self, k_max: int = 10, *, n_init: int = 4, random_state: int = 0,
                 min_silhouette: float = MIN_SILHOUETTE):
        self.k_max = k_max
        self.n_init = n_init
        self.random_state = random_state
        self.min_silhouette = min_silhouette

    @entry("ElbowKMeans.fit")
    def fit(self, X, y=None):
        from kneed import KneeLocator  # imports scipy.signal (0.7 s): only when a knee is asked for

        X = check_embeddings(X)
        check_positive_int("k_max", self.k_max)
        if self.k_max > X.shape[0]:
            raise InputError("k_max", f"must be at most the number of samples ({X.shape[0]})", self.k_max)
        fits = [KMeans(k, n_init=self.n_init, random_state=self.random_state).fit(X) for k in range(1, self.k_max + 1)]
        self.inertias_ = np.array([f.inertia_ for f in fits])
        knee, self.knee_strength_ = None, 0.0
        if self.k_max >= 3 and self.inertias_[0] > 0:
            locator = KneeLocator(np.arange(1, self.k_max + 1), self.inertias_, curve="convex", direction="decreasing")
            knee, self.knee_strength_ = locator.knee, float(np.max(locator.y_difference))
        self.k_ = int(knee) if knee is not None else 1
        self.silhouettes_ = np.array([silhouette_score(X, f.labels_, random_state=self.random_state)
                                      if len(set(f.labels_.tolist())) > 1 else np.nan for f in fits[1:]])
        best = int(np.nanargmax(self.silhouettes_)) if np.isfinite(self.silhouettes_).any() else None
        self.k_silhouette_ = best + 2 if best is not None and self.silhouettes_[best] >= self.min_silhouette else 1
        chosen = fits[self.k_ - 1]
        self.labels_, self.cluster_centers_ = chosen.labels_, chosen.cluster_centers_
        return self


class AutoDBSCAN(ClusterMixin, BaseEstimator):
    """DBSCAN with ``eps`` from :func:`auto_eps` when not given.

    Attributes: eps_, labels_ (-1 = noise), n_clusters_, n_noise_.
    """

    def __init__(self, eps: float | None = None, *, min_samples: int = 5):
        self.eps = eps
        self.min_samples = min_samples

    @entry("AutoDBSCAN.fit")
    def fit(self, X, y=None):
        X = check_embeddings(X)
        check_positive_int("min_samples", self.min_samples)
        if self.eps is not None and not self.eps > 0:
            raise InputError("eps", "must be positive or None", self.eps)
        self.eps_ = float(self.eps) if self.eps is not None else auto_eps(X, self.min_samples)
        self.labels_ = DBSCAN(eps=self.eps_, min_samples=self.min_samples).fit(X).labels_
        self.n_clusters_ = int(len(set(self.labels_.tolist()) - {-1}))
        self.n_noise_ = int((self.labels_ < 0).sum())
        return self


@dataclass(frozen=True)
class ClusterGeometry:
    """centres (K, d); radii (K,) mean member distance to the centre; inter_distance: mean pairwise
    distance between centres (0 for one cluster); separation = inter_distance / mean radius."""

    centres: np.ndarray
    radii: np.ndarray
    sizes: np.ndarray
    inter_distance: float
    separation: float

    @property
    def mean_radius(self) -> float:
        return float(self.radii.mean())


@entry("cluster_geometry")
def cluster_geometry(X, labels) -> ClusterGeometry:
    """Geometry of a clustering; noise (label -1) is ignored."""
    X = check_embeddings(X, min_rows=1)
    labels = np.asarray(labels)
    if labels.shape != (X.shape[0],):
        raise InputError("labels", f"must have shape ({X.shape[0]},)", labels.shape)
    ids = sorted(set(labels.tolist()) - {-1})
    if not ids:
        raise InputError("labels", "must contain at least one cluster (all are noise)", labels[:10])
    centres = np.stack([X[labels == c].mean(axis=0) for c in ids])
    radii = np.array([np.linalg.norm(X[labels == c] - centres[i], axis=1).mean() for i, c in enumerate(ids)])
    sizes = np.array([(labels == c).sum() for c in ids])
    if len(ids) > 1:
        diff = centres[:, None, :] - centres[None, :, :]
        dist = np.linalg.norm(diff, axis=-1)
        inter = float(dist[np.triu_indices(len(ids), k=1)].mean())
    else:
        inter = 0.0
    mean_radius = float(radii.mean())
    separation = inter / mean_radius if mean_radius > 0 else float("inf") if inter > 0 else 0.0
    return ClusterGeometry(centres, radii, sizes, inter, separation)


LAYER_COLUMNS = ["layer", "n", "k", "knee_strength", "k_silhouette", "silhouette", "inter_distance", "mean_radius",
                 "separation"]


#: a layer of at most this many sequences is clustered on one thread (OpenMP's and BLAS's): there
#: the threads' start-up costs more than they share (Figure 3's 28 checkpoints of 192 sentences:
#: 12 s on two threads, 8 s on one; the same labels)
ONE_THREAD_ROWS = 4096


@entry("layer_separation")
def layer_separation(embeddings, *, k_max: int = 10, projection_dim: int | None = 64, seed: int = 0) -> pd.DataFrame:
    """One row per layer: layer, n, k (elbow), knee_strength, k_silhouette (1: no clusters),
    silhouette (the best K's), inter_distance, mean_radius, separation (at the elbow K).

    ``embeddings``: a :class:`~ntkscope.runs.embeddings.LayerEmbeddings` or {layer: (n, d)}.
    The table's ``attrs["jl_guidance"]`` gives the JL dimension for a few distortions.
    """
    check_positive_int("k_max", k_max)
    table = embeddings.embeddings if hasattr(embeddings, "embeddings") else dict(embeddings)
    if not table:
        raise InputError("embeddings", "must hold at least one layer", table)
    rows = []
    for layer in sorted(table):
        X = check_embeddings(table[layer])
        if k_max > X.shape[0]:
            raise InputError("k_max", f"must be at most the number of samples ({X.shape[0]})", k_max)
        Z = random_projection(X, projection_dim, seed=seed) if projection_dim else X
        with threadpool_limits(1 if len(Z) <= ONE_THREAD_ROWS else None):
            elbow = ElbowKMeans(k_max, random_state=seed).fit(Z)
            geo = cluster_geometry(Z, elbow.labels_)
        rows.append((layer, X.shape[0], elbow.k_, elbow.knee_strength_, elbow.k_silhouette_,
                     float(np.nanmax(elbow.silhouettes_)) if np.isfinite(elbow.silhouettes_).any() else np.nan,
                     geo.inter_distance, geo.mean_radius, geo.separation))
    frame = pd.DataFrame(rows, columns=LAYER_COLUMNS)
    frame.attrs["jl_guidance"] = jl_guidance(frame["n"].iloc[0])
    return frame
