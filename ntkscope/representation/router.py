"""Fitting a CSE router (docs/design.md §4, step 2 of Algorithm 1), on the clustering estimators.

Sequence embeddings (N, d) are projected with a seeded Gaussian matrix M (d', d) (the
:func:`~ntkscope.representation.clusters.projection_matrix` of :func:`random_projection`),
clustered by :class:`~ntkscope.representation.clusters.AutoDBSCAN` (eps at the knee of the
sorted k-NN distances when not given), and each cluster's centre and radius come from
:func:`~ntkscope.representation.clusters.cluster_geometry`. Clusters are numbered by size,
largest first. Noise points belong to no cluster; they are counted and reported. If DBSCAN
finds no cluster, the documented fallback is one cluster of all points (one expert: the layer
stays dense in effect), with a warning; ``on_no_cluster="error"`` raises instead.
``cse_models.cse.convert_to_cse`` turns a fit into a CSE layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ntkscope.core.checks import check_choice, entry
from ntkscope.representation.clusters import AutoDBSCAN, check_embeddings, cluster_geometry, projection_matrix

log = logging.getLogger(__name__)


class NoClusterError(ValueError):
    """DBSCAN found no cluster and the caller asked for an error."""


@dataclass(frozen=True)
class RouterFit:
    """A fitted CSE router.

    projection : (d', d) float32, M.  centres : (C, d').  radii : (C,), mean member distance.
    labels : (N,) cluster of each point, largest cluster 0 (-1 = noise).  eps : the eps used
    (given or automatic).  sizes : members per cluster.  n_noise : points in no cluster.
    fallback : True when DBSCAN found nothing and all points became one cluster.
    """

    projection: np.ndarray
    centres: np.ndarray
    radii: np.ndarray
    labels: np.ndarray
    eps: float
    sizes: tuple
    n_noise: int
    fallback: bool

    @property
    def n_clusters(self) -> int:
        return len(self.centres)


@entry("fit_router")
def fit_router(embeddings, *, proj_dim: int = 32, eps: float | None = None, min_samples: int = 5,
               max_experts: int | None = 8, seed: int = 0, on_no_cluster: str = "single") -> RouterFit:
    """Random projection + DBSCAN on sequence embeddings (N, d) -> a :class:`RouterFit`.

    ``max_experts`` keeps the largest clusters (their other members become noise).
    """
    x = check_embeddings(embeddings)
    check_choice("on_no_cluster", on_no_cluster, ("single", "error"))
    M = projection_matrix(x.shape[1], proj_dim, seed=seed)  # (d', d), N(0, 1/d')
    z = x @ M.T  # (N, d) @ (d, d') -> (N, d')
    dbscan = AutoDBSCAN(eps, min_samples=min_samples).fit(z)
    labels = dbscan.labels_
    clusters = sorted((c for c in set(labels.tolist()) if c >= 0), key=lambda c: (-(labels == c).sum(), c))
    fallback = False
    if not clusters:
        message = (f"fit_router: DBSCAN found no cluster among {len(z)} embeddings (eps={dbscan.eps_:.4g}, "
                   f"min_samples={min_samples}): every point is noise")
        if on_no_cluster == "error":
            raise NoClusterError(message + "; pass a larger eps or a smaller min_samples")
        log.warning("%s; falling back to one cluster of all points (one expert)", message)
        labels, clusters, fallback = np.zeros(len(z), dtype=int), [0], True
    if max_experts is not None and len(clusters) > max_experts:
        log.info("fit_router: keeping the %d largest of %d clusters", max_experts, len(clusters))
        clusters = clusters[:max_experts]
    relabel = {c: i for i, c in enumerate(clusters)}
    labels = np.array([relabel.get(c, -1) for c in labels.tolist()])
    geometry = cluster_geometry(z, labels)
    radii = np.maximum(geometry.radii, 1e-6 * max(geometry.radii.max(), 1e-12))  # a cluster of identical points
    return RouterFit(M.astype(np.float32), geometry.centres.astype(np.float32), radii.astype(np.float32), labels,
                     dbscan.eps_, tuple(int(s) for s in geometry.sizes), int((labels < 0).sum()), fallback)

