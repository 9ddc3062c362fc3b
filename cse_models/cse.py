"""Building sparse layers in a warmed-up model: CSE layers from clusters (docs/design.md §4,
steps 2-3 of Algorithm 1), and Switch / DEMix layers by sparse upcycling.

After the dense warm-up: embed N sequences at the input of each chosen module, fit a router
on them (:func:`ntkscope.representation.router.fit_router`: centred on the sample mean,
projected when asked, L2-normalised, clustered by HDBSCAN by default; centres and radii),
and turn the module into C experts copied from the warmed-up one, routed by the clusters'
centres and radii in that space. At routing time every
sequence, noise or not, goes to its nearest scaled centre.
"""

from __future__ import annotations

import copy
import logging

import torch

from cse_models.experts import CSELayer, DEMixLayer, SwitchFFN
from cse_models.model import check_expert_copies, check_sparse_host
from ntkscope.core.checks import UserError
from ntkscope.representation.router import NoClusterError, RouterFit, fit_router

log = logging.getLogger(__name__)

__all__ = ["NoClusterError", "RouterFit", "convert_to_cse", "fit_router", "upcycle"]


def convert_to_cse(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   rule: str = "hdbscan", representation: str = "centred-cosine", min_cluster_size: int = 15,
                   eps: float | dict | None = None, min_samples: int = 5, percentile: float = 10.0,
                   selection: str = "eom", max_experts: int | None = 8, seed: int = 0,
                   on_no_cluster: str = "single", shuffled: bool = False,
                   n_clusters: list | dict | None = None) -> dict[int, RouterFit]:
    """Turn each chosen dense module of a warmed-up model into a CSE layer (router format 2), in place.

    ``input_ids``/``attention_mask`` (N, T): the fitting sample. The model's ``config.sparse``
    (kind ``"cse"``) names the layers and module; its ``n_experts``, ``router_format`` and
    ``normalise`` are filled in. ``rule``, ``representation`` and the rest are
    :func:`~ntkscope.representation.router.fit_router`'s; ``eps`` (DBSCAN rules): one value,
    ``{layer: eps}`` (layers' scales differ), or None (automatic). Returns {layer: RouterFit}.

    ``shuffled``: the ``cse-shuffled`` control. The same fit, experts and counts, but each layer
    routes every sequence by a fixed hash of its tokens, in the proportions in which its clusters
    route the fitting sample (:class:`~cse_models.experts.CSELayer`'s ``shares``): CSE without
    its clusters. The model's function is unchanged at conversion either way (every expert is a
    copy of the dense module).

    ``n_clusters``: the experts of each layer fixed (one count per layer in ``sparse.layers``'
    order, or ``{layer: count}``; :func:`~ntkscope.representation.router.fit_router`'s
    ``n_clusters``), e.g. another step's counts, to separate the count from the representation.
    """
    check_sparse_host(model, "convert_to_cse")
    sparse = model.config.sparse
    if sparse is None or sparse.kind != "cse":
        raise UserError("convert_to_cse: model.config.sparse must describe CSE layers (kind='cse')")
    if shuffled and not hasattr(model, "transformer"):
        raise UserError("convert_to_cse: shuffled CSE layers are built for cse_models GPT and BERT models (the model "
                        f"sets each batch's sequence keys); got {type(model).__name__}")
    if n_clusters is not None:
        counts = n_clusters if isinstance(n_clusters, dict) else dict(zip(sparse.layers, n_clusters)) \
            if isinstance(n_clusters, (list, tuple)) and len(n_clusters) == len(sparse.layers) else None
        if counts is None or set(counts) != set(sparse.layers):
            raise UserError(f"convert_to_cse: n_clusters must give one count per sparse layer {list(sparse.layers)} "
                            f"(got {n_clusters!r})")
        n_clusters = counts
    done = [i for i in sparse.layers if sparse.experts_at(i) > 0]
    if done:
        raise UserError(f"convert_to_cse: layers {done} are CSE layers already")
    was_training = model.training
    model.eval()
    embeddings = model.module_inputs(input_ids, attention_mask, sparse.layers, sparse.module)
    model.train(was_training)
    fits = {}
    for n, i in enumerate(sparse.layers):
        eps_i = eps.get(i) if isinstance(eps, dict) else eps
        fit = fit_router(embeddings[i].float().cpu().numpy(), rule=rule, representation=representation,
                         proj_dim=sparse.proj_dim, min_cluster_size=min_cluster_size, min_samples=min_samples,
                         eps=eps_i, percentile=percentile, selection=selection, max_experts=max_experts,
                         seed=seed + i, on_no_cluster=on_no_cluster,
                         n_clusters=None if n_clusters is None else n_clusters[i])
        dense = model.sparse_module(i)
        check_expert_copies([(dense, fit.n_clusters)], f"convert_to_cse: layer {i}'s {fit.n_clusters} experts")
        weight = next(dense.parameters())
        as_t = lambda a: torch.as_tensor(a, device=weight.device, dtype=weight.dtype)  # noqa: E731
        router = (as_t(fit.projection), as_t(fit.centres), as_t(fit.radii))
        options = dict(mean=as_t(fit.mean), normalise=fit.normalise, mean_rate=sparse.mean_rate)
        layer = CSELayer([copy.deepcopy(dense) for _ in range(fit.n_clusters)], *router, sparse.alpha, **options)
        if shuffled:  # the clusters' proportions on the fitting sample, then no clusters
            _, own = layer._route(embeddings[i].to(weight.device))
            shares = torch.bincount(own, minlength=fit.n_clusters).to(weight.dtype) / len(own)
            layer = CSELayer(list(layer.experts), *router, sparse.alpha, **options, shares=shares)
            log.info("CSE layer %d shuffled: sequences routed by a hash of their tokens in the shares %s", i,
                     [round(float(x), 3) for x in shares])
        model.replace_sparse_module(i, layer.train(was_training))  # the mode the model is in
        sparse.n_experts[n] = fit.n_clusters
        fits[i] = fit
        log.info("CSE layer %d (%s): %d experts from %d sequences (%s, %s), cluster sizes %s, %d noise%s",
                 i, sparse.module, fit.n_clusters, len(fit.labels), rule, representation, list(fit.sizes),
                 fit.n_noise, " (fallback: no cluster found)" if fit.fallback else "")
        _warn_thin_fit(i, fit)
    sparse.router_format, sparse.normalise, sparse.shuffled = 2, fits[sparse.layers[0]].normalise, bool(shuffled)
    return fits


FEW = 0.01  # an expert fitted on fewer than this share of the fitting sequences is said to be thin


def _warn_thin_fit(layer: int, fit: RouterFit) -> None:
    """One warning line when most fitting sequences are noise to the clustering, or an expert's
    cluster holds few of them: its experts then stand on little evidence."""
    n = len(fit.labels)
    said = []
    if fit.n_noise > n / 2:
        said.append(f"{fit.n_noise} of {n} fitting sequences are noise to the clustering (every one is still routed "
                    "to its nearest centre)")
    thin = [int(k) for k in fit.sizes if k < FEW * n]
    if not fit.fallback and thin:
        said.append(f"{len(thin)} of its {fit.n_clusters} experts {'is' if len(thin) == 1 else 'are'} fitted on "
                    f"fewer than {FEW:.0%} of them (cluster sizes {list(map(int, fit.sizes))})")
    if said:
        log.warning("CSE layer %d: %s; a larger fitting sample or min_cluster_size may fit firmer clusters",
                    layer, "; ".join(said))


def upcycle(model, n_experts: int | list | None = None, *, preserving: bool = True) -> list:
    """Sparse upcycling (Komatsuzaki et al., 2023), in place: each dense module that
    ``model.config.sparse`` (kind "switch" or "demix") names becomes a Switch layer of
    ``n_experts`` copies (one count for every layer, or one per layer in ``sparse.layers``' order,
    e.g. CSE's) and a fresh router (N(0, 0.02) from torch's RNG), or a DEMix layer with one copy
    per domain. ``preserving`` (Switch; the default): the gate is renormalised to 1 and no token is
    dropped in evaluation, so the model's function is unchanged at conversion, as CSE's is
    (:class:`~cse_models.experts.SwitchFFN`); False: the classic softmax-scaled gate. Returns the
    experts per layer."""
    check_sparse_host(model, "upcycle")
    sparse = model.config.sparse
    if sparse is None or sparse.kind not in ("switch", "demix"):
        raise UserError("upcycle: model.config.sparse must describe Switch or DEMix layers")
    if sparse.kind == "demix":
        counts = [len(sparse.domains)] * len(sparse.layers)
    else:
        counts = list(n_experts) if isinstance(n_experts, (list, tuple)) else [n_experts] * len(sparse.layers)
    if len(counts) != len(sparse.layers) or any(isinstance(k, bool) or not isinstance(k, int) or k < 1
                                                 for k in counts):
        raise UserError(f"upcycle: a Switch layer needs n_experts >= 1, one count or one per layer of "
                        f"{list(sparse.layers)} (got {n_experts!r})")
    if sparse.kind == "switch":
        sparse.preserving = bool(preserving)
    check_expert_copies([(model.sparse_module(i), k) for i, k in zip(sparse.layers, counts)],
                        f"upcycle: n_experts {counts}")
    weight = next(model.parameters())  # a new router in the model's device and dtype, whatever torch's default
    for n, (i, k) in enumerate(zip(sparse.layers, counts)):
        experts = [copy.deepcopy(model.sparse_module(i)) for _ in range(k)]
        layer = DEMixLayer(experts) if sparse.kind == "demix" else SwitchFFN(
            experts, model.config.n_embd, sparse.capacity_factor, preserving=sparse.preserving)
        model.replace_sparse_module(i, layer.to(device=weight.device, dtype=weight.dtype).train(model.training))
        sparse.n_experts[n] = k
    log.info("%s: upcycled layers %s (%s) into %s experts%s", sparse.kind, sparse.layers, sparse.module, counts,
             " (function-preserving: gate renormalised to 1, no token dropped in evaluation)"
             if sparse.kind == "switch" and sparse.preserving else "")
    return counts
