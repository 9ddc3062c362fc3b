"""Fitting a CSE router (docs/design.md §4, step 2 of Algorithm 1), on the clustering estimators.

A router maps a sequence embedding v (the mean of a module's input over real tokens, (d,)) to

    z = normalise(M (v - mu))        (d',)

and sends the sequence to ``argmin_j ||z - c_j|| / r_j``. The *representation* fixes mu and
the normalisation:

- ``"centred-cosine"`` (default): mu is the fitting sample's mean and z is L2-normalised, so
  clusters are directions away from the bulk (cosine geometry);
- ``"centred"``: mu the sample mean, no normalisation;
- ``"raw"``: mu = 0, no normalisation (turn 1's router: ``||M v - c|| / r``).

M (d', d) is a seeded Gaussian random projection (:func:`~ntkscope.representation.clusters.projection_matrix`)
applied after centring when ``proj_dim`` < d, else the identity. The *rule* finds the clusters:

- ``"hdbscan"`` (default): scikit-learn's :class:`~sklearn.cluster.HDBSCAN` with
  ``min_cluster_size`` (no eps to choose); up to :data:`BRUTE_HDBSCAN_MAX` points from the whole
  distance matrix (``algorithm="brute"``: about six times faster than a k-d tree at d' = 128,
  n = 3000, the same clusters; where mutual-reachability distances tie, a bulk point may fall on
  the other side of a cluster's edge), more from the tree;
- ``"dbscan-percentile"``: DBSCAN with eps at the ``percentile``-th percentile of the
  distances to each point's ``min_samples``-th neighbour;
- ``"dbscan-knee"``: DBSCAN with eps at the knee of those distances (turn 1's rule; the knee
  follows the density of the general bulk, so it tends to find one giant cluster).

docs/router.md measures rule x representation on a real fitting sample. Clusters are numbered
by size, largest first; noise points belong to none (at routing time every sequence goes to
its nearest scaled centre). When the rule finds nothing, the documented fallback is one
cluster of all points (one expert: the layer stays dense in effect), with a warning;
``on_no_cluster="error"`` raises instead. ``cse_models.cse.convert_to_cse`` turns a fit
into a CSE layer, which stores mu, M, the normalisation, the centres and the radii.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import DBSCAN, HDBSCAN

from ntkscope.core.checks import InputError, UserError, check_choice, check_positive_int, entry
from ntkscope.representation.clusters import AutoDBSCAN, check_embeddings, cluster_geometry, knn_distances
from ntkscope.representation.clusters import projection_matrix

log = logging.getLogger(__name__)

RULES = ("hdbscan", "dbscan-percentile", "dbscan-knee")
REPRESENTATIONS = ("centred-cosine", "centred", "raw")


class NoClusterError(UserError):
    """The clustering rule found no cluster and the caller asked for an error."""


def route_space(X, mean, projection, normalise: bool) -> np.ndarray:
    """normalise(M (X - mu)): X (n, d), mean (d,), projection (d', d) -> (n, d')."""
    z = (np.asarray(X, dtype=np.float64) - mean) @ np.asarray(projection, dtype=np.float64).T
    if normalise:
        z = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
    return z


@dataclass(frozen=True)
class RouterFit:
    """A fitted CSE router.

    mean : (d,) float32, mu (zeros for ``"raw"``).  projection : (d', d) float32, M.
    normalise : whether z is L2-normalised.  centres : (C, d').  radii : (C,), mean member
    distance.  labels : (N,) cluster of each point, largest cluster 0 (-1 = noise).
    rule, representation : how it was fitted.  eps : DBSCAN's eps (NaN for HDBSCAN).
    sizes : members per cluster.  n_noise : points in no cluster.  fallback : True when the
    rule found nothing and all points became one cluster.
    """

    mean: np.ndarray
    projection: np.ndarray
    normalise: bool
    centres: np.ndarray
    radii: np.ndarray
    labels: np.ndarray
    rule: str
    representation: str
    eps: float
    sizes: tuple
    n_noise: int
    fallback: bool

    @property
    def n_clusters(self) -> int:
        return len(self.centres)

    def transform(self, X) -> np.ndarray:
        """The routing space: (n, d) embeddings -> (n, d') float64."""
        return route_space(check_embeddings(X, min_rows=1), self.mean, self.projection, self.normalise)

    def predict(self, X) -> np.ndarray:
        """The expert of each embedding (n,): ``argmin_j ||z - c_j|| / r_j``."""
        z = self.transform(X)
        dist = np.linalg.norm(z[:, None, :] - self.centres[None].astype(np.float64), axis=-1)  # (n, C)
        return (dist / self.radii.astype(np.float64)).argmin(axis=1)


#: HDBSCAN on at most this many points takes the whole (n, n) distance matrix (134 MB at 4096).
BRUTE_HDBSCAN_MAX = 4096


def cluster_labels(Z, *, rule: str = "hdbscan", min_cluster_size: int = 15, min_samples: int = 5,
                   eps: float | None = None, percentile: float = 10.0, selection: str = "eom") -> tuple:
    """Labels (n,) of ``rule`` on points Z (n, d') (-1 = noise) and the eps used (NaN for HDBSCAN)."""
    if rule == "hdbscan":
        fit = HDBSCAN(min_cluster_size=min_cluster_size, min_samples=min_samples,
                      cluster_selection_method=selection, copy=True,
                      algorithm="brute" if len(Z) <= BRUTE_HDBSCAN_MAX else "auto").fit(Z)
        return fit.labels_, float("nan")
    if rule == "dbscan-knee" or eps is not None:
        fit = AutoDBSCAN(eps, min_samples=min_samples).fit(Z)
        return fit.labels_, fit.eps_
    eps = float(np.percentile(knn_distances(Z, min_samples), percentile))
    return DBSCAN(eps=max(eps, 1e-12), min_samples=min_samples).fit(Z).labels_, eps


@entry("fit_router")
def fit_router(embeddings, *, rule: str = "hdbscan", representation: str = "centred-cosine", proj_dim: int = 128,
               min_cluster_size: int = 15, min_samples: int = 5, eps: float | None = None, percentile: float = 10.0,
               selection: str = "eom", max_experts: int | None = 8, seed: int = 0,
               on_no_cluster: str = "single", n_clusters: int | None = None) -> RouterFit:
    """Cluster sequence embeddings (N, d) in the routing space -> a :class:`RouterFit`.

    ``eps`` (DBSCAN rules) overrides the automatic one. ``selection``: HDBSCAN's cluster
    selection, "eom" or "leaf". ``max_experts`` keeps the largest clusters (their other
    members become noise). ``n_clusters`` (HDBSCAN; an expert count fixed apart from the
    representation, e.g. another step's): exactly that many, the largest of HDBSCAN's clusters
    when it finds more; when it finds fewer, it is refitted with leaf selection and
    ``min_cluster_size`` halved (to 2 at least) until it finds enough, and refused when even
    that does not (``max_experts`` does not apply).
    """
    x = check_embeddings(embeddings)
    check_choice("rule", rule, RULES)
    check_choice("representation", representation, REPRESENTATIONS)
    check_choice("on_no_cluster", on_no_cluster, ("single", "error"))
    check_choice("selection", selection, ("eom", "leaf"))
    for name, value in (("proj_dim", proj_dim), ("min_cluster_size", min_cluster_size), ("min_samples", min_samples)):
        check_positive_int(name, value)
    if not 0 < percentile < 100:
        raise InputError("percentile", "must be in (0, 100)", percentile)
    if eps is not None and not eps > 0:
        raise InputError("eps", "must be positive or None", eps)
    if eps is not None and rule == "hdbscan":
        raise InputError("eps", "applies to the DBSCAN rules only; rule is 'hdbscan'", eps)
    if n_clusters is not None:
        check_positive_int("n_clusters", n_clusters)
        if rule != "hdbscan":
            raise InputError("n_clusters", f"applies to rule 'hdbscan' only; rule is {rule!r}", n_clusters)
        if n_clusters > len(x):
            raise InputError("n_clusters", f"must be at most the {len(x)} embeddings", n_clusters)
    d = x.shape[1]
    mean = x.mean(axis=0) if representation != "raw" else np.zeros(d)
    M = projection_matrix(d, proj_dim, seed=seed) if proj_dim < d else np.eye(d)  # (d', d)
    normalise = representation == "centred-cosine"
    z = route_space(x, mean, M, normalise)  # (N, d')
    labels, eps_used = cluster_labels(z, rule=rule, min_cluster_size=min(min_cluster_size, len(z)),
                                      min_samples=min(min_samples, len(z) - 1), eps=eps, percentile=percentile,
                                      selection=selection)
    clusters = sorted((c for c in set(labels.tolist()) if c >= 0), key=lambda c: (-(labels == c).sum(), c))
    size = min(min_cluster_size, len(z))
    while n_clusters is not None and len(clusters) < n_clusters:  # finer clusters until there are enough
        if size <= 2 and selection == "leaf":
            raise InputError("n_clusters", f"is more clusters than HDBSCAN finds among {len(z)} embeddings even at "
                             f"leaf selection and min_cluster_size 2 (it finds {len(clusters)})", n_clusters)
        size, selection = max(2, size // 2) if selection == "leaf" else size, "leaf"
        labels, _ = cluster_labels(z, rule=rule, min_cluster_size=size, min_samples=min(min_samples, size, len(z) - 1),
                                   selection=selection)
        clusters = sorted((c for c in set(labels.tolist()) if c >= 0), key=lambda c: (-(labels == c).sum(), c))
    if n_clusters is not None:
        log.info("fit_router: %d experts fixed: the largest %d of %d clusters (min_cluster_size %d, %s selection)",
                 n_clusters, n_clusters, len(clusters), size, selection)
        clusters, max_experts = clusters[:n_clusters], None
    fallback = False
    if not clusters:
        message = (f"fit_router: {rule} found no cluster among {len(z)} embeddings ({representation}, "
                   f"eps={eps_used:.4g}, min_samples={min_samples}, min_cluster_size={min_cluster_size}): "
                   "every point is noise")
        if on_no_cluster == "error":
            raise NoClusterError(message + "; pass a larger eps or smaller min_samples / min_cluster_size")
        log.warning("%s; falling back to one cluster of all points (one expert)", message)
        labels, clusters, fallback = np.zeros(len(z), dtype=int), [0], True
    if max_experts is not None and len(clusters) > max_experts:
        log.info("fit_router: keeping the %d largest of %d clusters", max_experts, len(clusters))
        clusters = clusters[:max_experts]
    relabel = {c: i for i, c in enumerate(clusters)}
    labels = np.array([relabel.get(c, -1) for c in labels.tolist()])
    geometry = cluster_geometry(z, labels)
    radii = np.maximum(geometry.radii, 1e-6 * max(geometry.radii.max(), 1e-12))  # a cluster of identical points
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    return RouterFit(f32(mean), f32(M), normalise, f32(geometry.centres), f32(radii), labels, rule, representation,
                     float(eps_used), tuple(int(s) for s in geometry.sizes), int((labels < 0).sum()), fallback)
