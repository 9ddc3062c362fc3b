"""Building CSE layers from clusters (DESIGN §4, steps 2-3 of Algorithm 1).

After the dense warm-up: embed N sequences at the input of each chosen module, project
them with a seeded Gaussian random projection (scikit-learn's, entries N(0, 1/d')),
cluster with DBSCAN, and turn the module into C experts copied from the warmed-up one,
routed by the clusters' centres and radii.

``eps`` is chosen automatically when not given: the knee (kneedle, ``kneed``) of the
sorted distances to each point's ``min_samples``-th nearest neighbour, the usual DBSCAN
heuristic. Noise points belong to no cluster; they are counted and reported, and at
routing time every sequence, noise or not, goes to its nearest scaled centre.
If DBSCAN finds no cluster, the documented fallback is one cluster of all points (one
expert: the layer stays dense in effect), with a warning; ``on_no_cluster="error"``
raises instead.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.cluster import DBSCAN
from sklearn.random_projection import GaussianRandomProjection

from cse_models.experts import CSELayer
from ntkscope.clusters import auto_eps

log = logging.getLogger(__name__)


class NoClusterError(ValueError):
    """DBSCAN found no cluster and the caller asked for an error."""


@dataclass(frozen=True)
class RouterFit:
    """A fitted CSE router.

    projection : (d', d) float32, M.  centres : (C, d').  radii : (C,), mean member distance.
    labels : (N,) DBSCAN labels (-1 = noise).  eps : the eps used (given or automatic).
    sizes : members per cluster.  n_noise : points in no cluster.  fallback : True when
    DBSCAN found nothing and all points became one cluster.
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


def fit_router(embeddings, *, proj_dim: int = 32, eps: float | None = None, min_samples: int = 5,
               max_experts: int | None = 8, seed: int = 0, on_no_cluster: str = "single") -> RouterFit:
    """Random projection + DBSCAN on sequence embeddings (N, d) -> a :class:`RouterFit`.

    ``max_experts`` keeps the largest clusters (their other members become noise).
    """
    func = "fit_router"
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"{func}: embeddings must have shape (N, d) with N >= 2 (got {x.shape})")
    if not np.isfinite(x).all():
        raise ValueError(f"{func}: embeddings must be finite")
    if on_no_cluster not in ("single", "error"):
        raise ValueError(f"{func}: on_no_cluster must be 'single' or 'error' (got {on_no_cluster!r})")
    if eps is not None and not eps > 0:
        raise ValueError(f"{func}: eps must be positive or None (got {eps!r})")
    projector = GaussianRandomProjection(n_components=proj_dim, random_state=seed).fit(x)
    M = projector.components_  # (d', d), N(0, 1/d')
    z = x @ M.T
    eps_used = eps if eps is not None else auto_eps(z, min_samples)
    labels = DBSCAN(eps=eps_used, min_samples=min_samples).fit(z).labels_
    clusters = sorted((c for c in set(labels.tolist()) if c >= 0), key=lambda c: (-(labels == c).sum(), c))
    fallback = False
    if not clusters:
        message = (f"{func}: DBSCAN found no cluster among {len(z)} embeddings (eps={eps_used:.4g}, "
                   f"min_samples={min_samples}): every point is noise")
        if on_no_cluster == "error":
            raise NoClusterError(message + "; pass a larger eps or a smaller min_samples")
        log.warning("%s; falling back to one cluster of all points (one expert)", message)
        labels, clusters, fallback = np.zeros(len(z), dtype=int), [0], True
    if max_experts is not None and len(clusters) > max_experts:
        log.info("%s: keeping the %d largest of %d clusters", func, max_experts, len(clusters))
        clusters = clusters[:max_experts]
    relabel = {c: i for i, c in enumerate(clusters)}
    labels = np.array([relabel.get(c, -1) for c in labels.tolist()])
    centres = np.stack([z[labels == i].mean(axis=0) for i in range(len(clusters))])
    radii = np.array([np.linalg.norm(z[labels == i] - centres[i], axis=1).mean() for i in range(len(clusters))])
    radii = np.maximum(radii, 1e-6 * max(radii.max(), 1e-12))  # a cluster of identical points
    sizes = tuple(int((labels == i).sum()) for i in range(len(clusters)))
    return RouterFit(M.astype(np.float32), centres.astype(np.float32), radii.astype(np.float32), labels,
                     float(eps_used), sizes, int((labels < 0).sum()), fallback)


def convert_to_cse(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   eps: float | dict | None = None, min_samples: int = 5, max_experts: int | None = 8, seed: int = 0,
                   on_no_cluster: str = "single") -> dict[int, RouterFit]:
    """Turn each chosen dense module of a warmed-up model into a CSE layer, in place.

    ``input_ids``/``attention_mask`` (N, T): the sampled sequences. The model's
    ``config.sparse`` (kind ``"cse"``) names the layers and module; its ``n_experts``
    is filled in. ``eps``: one value, ``{layer: eps}`` (layers' scales differ), or None
    (automatic). Returns {layer: RouterFit}.
    """
    sparse = model.config.sparse
    if sparse is None or sparse.kind != "cse":
        raise ValueError("convert_to_cse: model.config.sparse must describe CSE layers (kind='cse')")
    done = [i for i in sparse.layers if sparse.experts_at(i) > 0]
    if done:
        raise ValueError(f"convert_to_cse: layers {done} are CSE layers already")
    was_training = model.training
    model.eval()
    embeddings = model.module_inputs(input_ids, attention_mask, sparse.layers, sparse.module)
    model.train(was_training)
    fits = {}
    for n, i in enumerate(sparse.layers):
        eps_i = eps.get(i) if isinstance(eps, dict) else eps
        fit = fit_router(embeddings[i].float().cpu().numpy(), proj_dim=sparse.proj_dim, eps=eps_i,
                         min_samples=min_samples, max_experts=max_experts, seed=seed + i, on_no_cluster=on_no_cluster)
        dense = model._module(i)
        device = next(dense.parameters()).device
        as_t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
        layer = CSELayer([copy.deepcopy(dense) for _ in range(fit.n_clusters)], as_t(fit.projection),
                         as_t(fit.centres), as_t(fit.radii), sparse.alpha)
        model._replace(i, layer)
        sparse.n_experts[n] = fit.n_clusters
        fits[i] = fit
        log.info("CSE layer %d (%s): %d experts from %d sequences, eps %.4g, cluster sizes %s, %d noise%s",
                 i, sparse.module, fit.n_clusters, len(fit.labels), fit.eps, list(fit.sizes), fit.n_noise,
                 " (fallback: no cluster found)" if fit.fallback else "")
    return fits
