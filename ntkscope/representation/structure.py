"""Whether clusters carry the domains (docs/design.md §3): what a clustering holds when each
sequence has a domain label, and how separable each domain is in a representation.

- :func:`cluster_purity`: the number of clusters, how many are pure (one domain holds at least
  ``purity`` of the members), the share of each tail domain's sequences that sit in a pure
  cluster of their own domain, and the adjusted Rand index against the domains;
- :func:`knn_lift`: per domain, the share of each member's k nearest neighbours in the same
  domain over the domain's base rate (1 = no better than chance);
- :func:`domain_silhouette`: per domain, the mean silhouette of its members with the domains as
  the clustering (scikit-learn).

All take embeddings already in the space being judged (e.g. a router's ``transform``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.metrics import adjusted_rand_score, silhouette_samples
from sklearn.neighbors import NearestNeighbors

from ntkscope.core.checks import InputError, entry
from ntkscope.representation.clusters import check_embeddings


def _domains(domains, n: int) -> np.ndarray:
    domains = np.asarray(domains)
    if domains.shape != (n,):
        raise InputError("domains", f"must have one label per row ({n},)", domains.shape)
    return domains


@entry("cluster_purity")
def cluster_purity(labels, domains, *, tail=(), purity: float = 0.8) -> dict:
    """What a clustering ``labels`` (n,) (-1 = noise) holds of ``domains`` (n,).

    Returns {n_clusters, n_noise, largest_share (of all points, in the largest cluster),
    n_pure (clusters with a domain share >= ``purity``), n_pure_tail (of those, led by a
    ``tail`` domain), tail_share (the share of tail-domain points in a pure cluster of their own
    domain; NaN without tail points), ari (adjusted Rand index against the domains, noise as one
    more label), and ``tail_share DOMAIN`` for each tail domain}.
    """
    labels = np.asarray(labels)
    domains = _domains(domains, len(labels))
    if not 0 < purity <= 1:
        raise InputError("purity", "must be in (0, 1]", purity)
    clusters = sorted(set(labels.tolist()) - {-1})
    pure_of = {}  # cluster -> its domain, for pure clusters
    for c in clusters:
        members = domains[labels == c]
        values, counts = np.unique(members, return_counts=True)
        if counts.max() >= purity * len(members):
            pure_of[c] = values[counts.argmax()]
    in_own_pure = np.array([pure_of.get(c) == d for c, d in zip(labels.tolist(), domains.tolist())])
    is_tail = np.isin(domains, list(tail))
    sizes = [int((labels == c).sum()) for c in clusters]
    out = {"n_clusters": len(clusters), "n_noise": int((labels < 0).sum()),
           "largest_share": max(sizes) / len(labels) if sizes else 0.0, "n_pure": len(pure_of),
           "n_pure_tail": sum(d in tail for d in pure_of.values()),
           "tail_share": float(in_own_pure[is_tail].mean()) if is_tail.any() else float("nan"),
           "ari": float(adjusted_rand_score(domains, labels))}
    for d in tail:
        mine = domains == d
        out[f"tail_share {d}"] = float(in_own_pure[mine].mean()) if mine.any() else float("nan")
    return out


@entry("knn_lift")
def knn_lift(X, domains, *, k: int = 10) -> pd.Series:
    """Per domain: mean share of same-domain points among each member's ``k`` nearest
    neighbours (Euclidean in X (n, d)), divided by the domain's share of all points."""
    X = check_embeddings(X)
    domains = _domains(domains, len(X))
    k = min(k, len(X) - 1)
    _, idx = NearestNeighbors(n_neighbors=k + 1).fit(X).kneighbors(X)
    same = (domains[idx[:, 1:]] == domains[:, None]).mean(axis=1)  # (n,)
    frame = pd.DataFrame({"domain": domains, "same": same})
    base = frame["domain"].value_counts(normalize=True)
    return (frame.groupby("domain")["same"].mean() / base).rename("knn_lift")


@entry("domain_silhouette")
def domain_silhouette(X, domains, *, metric: str = "euclidean") -> pd.Series:
    """Per domain: the mean silhouette (scikit-learn, ``metric``) of its members, with the
    domain labels as the clustering of X (n, d). Needs at least two domains."""
    X = check_embeddings(X)
    domains = _domains(domains, len(X))
    if len(set(domains.tolist())) < 2:
        raise InputError("domains", "must hold at least two domains", sorted(set(domains.tolist())))
    values = silhouette_samples(X, domains, metric=metric)
    return pd.Series(values).groupby(domains).mean().rename("silhouette")
