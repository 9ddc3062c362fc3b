"""What the experts learned: for each sparse layer of a model (CSE or Switch; ours
or a converted HF model; or the routers of a transformers mixture of experts, such as Mixtral,
OLMoE and Qwen-MoE, whose ``*TopKRouter`` returns (logits, scores, indices)), against the user's
labels:

- the layer: routing purity (the share of units whose expert's majority domain is their own)
  and normalised mutual information (scikit-learn) between domain and expert, each beside its
  baselines: the majority domain's share of the units (the purity of one expert taking all) and
  both measures with the labels shuffled over texts (routing that ignores the labels, mean of
  :data:`NULL_SHUFFLES`); with the load entropy (the experts' loads, normalised to [0, 1]: 1 = even);
- each expert: its load and its domain shares (the domain that leads it, and by how much);
- each expert ablated: its units sent to their next-best expert (CSE: the next-nearest scaled
  centre; Switch: the router's second choice; an HF router: its logit for the expert set to -inf
  before its own softmax and top-k, the top-k weights renormalised where the router renormalises
  them), and the perplexity change per domain;
- an interval for every number, a percentile bootstrap over texts (the ablation's paired:
  the same texts with and without the expert), and findings in words first.

A *unit* is a sequence for CSE (one text is routed as one) and a real token for Switch and an HF
router (a token routed to k experts counts for its first choice). Layers are named by their block
index and module (``layer 2 (mlp)``), from the model's module names.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import normalized_mutual_info_score

from cse_models.domains import check_lm, RoutingRecorder, context_length, padded_batches, scored_log_probs
from cse_models.experts import CSELayer, SwitchFFN
from ntkscope.core.checks import UserError

log = logging.getLogger(__name__)

LAYER_COLUMNS = ["layer", "name", "unit", "experts", "purity", "purity_low", "purity_high", "purity_majority",
                 "purity_null", "nmi", "nmi_low", "nmi_high", "nmi_null", "load_entropy"]
#: label shuffles of the null that purity and NMI are read against
NULL_SHUFFLES = 50
EXPERT_COLUMNS = ["layer", "expert", "load", "load_low", "load_high", "top_domain", "top_share", "top_share_low",
                  "top_share_high"]
ABLATION_COLUMNS = ["layer", "expert", "domain", "ppl", "ppl_ablated", "change", "change_low", "change_high"]


def layer_label(name: str) -> str:
    """``hf.gpt_neox.layers.2.mlp.layer`` -> ``layer 2 (mlp)``; names without a block index as they are."""
    found = re.search(r"\.(\d+)\.(\w+)", name)
    return f"layer {found.group(1)} ({found.group(2)})" if found else name


@dataclass(frozen=True)
class ExpertReport:
    """``layers`` (LAYER_COLUMNS), ``experts`` (EXPERT_COLUMNS, plus ``share DOMAIN`` columns),
    ``ablation`` (ABLATION_COLUMNS: change = ppl_ablated / ppl - 1), ``findings`` (sentences,
    the most telling first), ``level`` (the intervals' coverage)."""

    layers: pd.DataFrame
    experts: pd.DataFrame
    ablation: pd.DataFrame
    findings: list
    level: float


#: routers whose top-k is a softmax over the logits, renormalised by ``norm_topk_prob`` (Mixtral:
#: always): the ones :func:`_router_without` ablates as the router itself would route (read in
#: transformers 5.24). Other ``*TopKRouter`` kinds (sigmoid scores, expert biases) are read, not ablated.
SOFTMAX_ROUTERS = ("MixtralTopKRouter", "OlmoeTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")


def is_hf_router(module) -> bool:
    """A transformers mixture-of-experts router (``MixtralTopKRouter``, ``OlmoeTopKRouter``,
    ``Qwen2MoeTopKRouter`` ...): (tokens, d) -> (logits (tokens, E), top-k scores, top-k indices)."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "num_experts") \
        and hasattr(module, "top_k")


def _ablatable(module) -> bool:
    return not is_hf_router(module) or type(module).__name__ in SOFTMAX_ROUTERS


def has_experts(model) -> bool:
    """Whether :func:`expert_report` has a layer to read in ``model`` (CSE, Switch or an HF router)."""
    return any(isinstance(m, (CSELayer, SwitchFFN)) or is_hf_router(m) for m in model.modules())


def _n_experts(module) -> int:
    return int(module.num_experts) if is_hf_router(module) else len(module.experts)


class _Recorder(RoutingRecorder):
    """:class:`~cse_models.domains.RoutingRecorder`, and an HF router's first choice per real token
    (B, T) (padding -1; ``mask``: the batch's, set before each forward)."""

    def __init__(self, model):
        super().__init__(model)
        self.mask = None
        routers = {name: m for name, m in model.named_modules() if is_hf_router(m)}
        self.layers.update(routers)
        self.hooks += [m.register_forward_hook(self._router_hook(name)) for name, m in routers.items()]

    def _router_hook(self, name):
        def hook(_module, _args, out):
            first = out[-1][:, 0].reshape(self.mask.shape)  # top-k indices come best first
            self.batch[name] = first.masked_fill(~self.mask.bool().to(first.device), -1).cpu()
        return hook


def _router_without(module, expert: int):
    """A forward hook making ``module`` (an HF router) route as if ``expert`` did not exist."""
    def hook(_m, _args, out):
        logits, scores, _ = out
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == expert, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        top, indices = torch.topk(probs, module.top_k, dim=-1)
        if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises; others by config
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(scores.dtype), indices
    return hook


@contextlib.contextmanager
def _ablated(module, expert: int):
    """``module``'s units that would go to ``expert`` go to their next-best expert instead."""
    if is_hf_router(module):
        handle = module.register_forward_hook(_router_without(module, expert))
        try:
            yield
        finally:
            handle.remove()
    elif isinstance(module, CSELayer):
        inner = module._route

        def route(v, dtype=None):
            z, assign = inner(v, dtype)
            scaled = torch.cdist(z, module.centres.to(z.dtype)) / module.radii.to(z.dtype)
            scaled[:, expert] = float("inf")
            return z, torch.where(assign == expert, scaled.argmin(dim=1), assign)
        module._route = route
        try:
            yield
        finally:
            del module._route
    else:
        def hook(_m, _args, out):
            out = out.clone()
            out[..., expert] = float("-inf")
            return out
        handle = module.router.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def _score(model, texts: list, batch_size: int, layers: dict) -> tuple[np.ndarray, dict, np.ndarray]:
    """Per text: summed NLL of its scored tokens (N,) (next tokens, or a masked LM's masked ones:
    :func:`~cse_models.domains.scored_log_probs`), per layer of ``layers`` the units each expert
    took (N, E), and the scored tokens (N,)."""
    device = next(model.parameters()).device
    nll, pairs = np.zeros(len(texts)), np.zeros(len(texts))
    taken = {name: np.zeros((len(texts), _n_experts(m)), dtype=np.int64) for name, m in layers.items()}
    recorder = _Recorder(model)
    try:
        for rows, ids, mask in padded_batches(texts, batch_size):
            recorder.batch.clear()
            recorder.mask = mask
            logp, scored = (t.cpu() for t in scored_log_probs(model, ids.to(device), mask.to(device)))
            nll[rows], pairs[rows] = -logp.sum(1).numpy(), scored.sum(1).numpy()
            for name in taken:
                assign, E = recorder.batch[name], taken[name].shape[1]
                if assign.dim() == 1:  # CSE: one expert per text
                    taken[name][rows, assign.numpy()] += 1
                else:  # Switch: per token, padding -1
                    for r, i in enumerate(rows):
                        taken[name][i] += np.bincount(assign[r][assign[r] >= 0].numpy(), minlength=E)
    finally:
        recorder.remove()
    return nll, taken, pairs


def _purity_nmi(counts: np.ndarray, domain: np.ndarray, names: list) -> tuple[float, float]:
    """Purity and NMI of the units in ``counts`` (N texts, E experts) with text domains."""
    table = np.zeros((counts.shape[1], len(names)))
    for d in range(len(names)):
        table[:, d] = counts[domain == d].sum(0)
    total = table.sum()
    if not total:
        return float("nan"), float("nan")
    purity = float(table.max(axis=1).sum() / total)
    experts, domains = np.nonzero(table)
    weights = table[experts, domains].astype(np.int64)
    nmi = float(normalized_mutual_info_score(np.repeat(domains, weights), np.repeat(experts, weights)))
    return purity, nmi


def _interval(values, level: float) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    tail = (1 - level) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


@torch.no_grad()
def expert_report(model, token_ids: Sequence[Sequence[int]], labels: Sequence[str], *, batch_size: int = 16,
                  n_boot: int = 500, level: float = 0.9, seed: int = 0, ablate: bool = True) -> ExpertReport:
    """What each sparse layer's experts learned of ``labels`` (module docstring). ``token_ids``:
    one list of ids per text (truncated to the model's context); ``ablate=False`` skips the
    ablations (one forward pass per expert each)."""
    if len(token_ids) != len(labels) or not len(labels):
        raise UserError(f"expert_report: token_ids and labels must be non-empty and of one length "
                        f"(got {len(token_ids)} and {len(labels)})")
    check_lm(model, "expert_report")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (CSELayer, SwitchFFN)) or is_hf_router(m)}
    if not layers:
        raise UserError("expert_report: the model has no CSE or Switch layer and no transformers mixture-of-experts "
                        "router (a dense model has no experts)")
    context = context_length(model)
    texts = [list(ids)[:context] for ids in token_ids]
    names = sorted(set(map(str, labels)))
    domain = np.array([names.index(str(label)) for label in labels])
    was_training = model.training
    model.eval()
    try:
        nll, taken, pairs = _score(model, texts, batch_size, layers)
        ablated = {}
        if ablate:
            for name, module in layers.items():
                if getattr(module, "shuffled", False) or _n_experts(module) < 2:  # no next-best expert
                    continue
                if not _ablatable(module):
                    log.warning("expert_report: %s (%s) is read, not ablated: its routing is not a softmax top-k "
                                "(SOFTMAX_ROUTERS)", name, type(module).__name__)
                    continue
                for e in range(_n_experts(module)):
                    with _ablated(module, e):
                        ablated[name, e] = _score(model, texts, batch_size, {})[0]
    finally:
        model.train(was_training)
    rng = np.random.default_rng(seed)
    draws = [np.concatenate([rng.choice(np.flatnonzero(domain == d), (domain == d).sum()) for d in range(len(names))])
             for _ in range(n_boot)]  # texts resampled within each domain
    layer_rows, expert_rows, ablation_rows, findings = [], [], [], []
    for name, module in layers.items():
        counts, label = taken[name], layer_label(name)
        purity, nmi = _purity_nmi(counts, domain, names)
        boot = np.array([_purity_nmi(counts[i], domain[i], names) for i in draws]).reshape(-1, 2)
        shuffled = np.random.default_rng(seed + 1)  # labels shuffled over texts: routing that ignores them
        null = np.array([_purity_nmi(counts, shuffled.permutation(domain), names) for _ in range(NULL_SHUFFLES)])
        units = np.array([counts[domain == d].sum() for d in range(len(names))])
        load = counts.sum(0) / max(counts.sum(), 1)
        positive = load[load > 0]
        entropy = float(-(positive * np.log(positive)).sum() / np.log(len(load))) if len(load) > 1 else 0.0
        layer_rows.append({"layer": label, "name": name, "unit": "sequences" if isinstance(module, CSELayer)
                           else "tokens", "experts": len(load), "purity": purity,
                           **dict(zip(("purity_low", "purity_high"), _interval(boot[:, 0], level))),
                           "purity_majority": float(units.max() / max(units.sum(), 1)),
                           "purity_null": float(np.nanmean(null[:, 0])), "nmi": nmi,
                           **dict(zip(("nmi_low", "nmi_high"), _interval(boot[:, 1], level))),
                           "nmi_null": float(np.nanmean(null[:, 1])), "load_entropy": entropy})
        by_domain = np.stack([counts[domain == d].sum(0) for d in range(len(names))], axis=1)  # (E, D)
        for e in range(len(load)):
            shares = by_domain[e] / max(by_domain[e].sum(), 1)
            top = int(shares.argmax())
            boot_load = [counts[i][:, e].sum() / max(counts[i].sum(), 1) for i in draws]
            boot_share = [counts[i][domain[i] == top, e].sum() / max(counts[i][:, e].sum(), 1) for i in draws]
            expert_rows.append({"layer": label, "expert": e, "load": float(load[e]),
                                **dict(zip(("load_low", "load_high"), _interval(boot_load, level))),
                                "top_domain": names[top], "top_share": float(shares[top]),
                                **dict(zip(("top_share_low", "top_share_high"), _interval(boot_share, level))),
                                **{f"share {n}": float(shares[d]) for d, n in enumerate(names)}})
        for d, dname in enumerate(names):  # the domain's best expert: its share of the domain's units
            row = by_domain[:, d] / max(by_domain[:, d].sum(), 1)
            best = int(np.argmax(by_domain[:, d] / np.maximum(by_domain.sum(1), 1)))
            lead = by_domain[best, d] / max(by_domain[best].sum(), 1)
            if lead >= 0.8:
                findings.append((lead, f"{label}: expert {best} serves {dname} ({lead:.0%} of its {layer_rows[-1]['unit']} "
                                       f"are {dname}; it takes {row[best]:.0%} of {dname}'s)"))
            else:
                findings.append((1 - lead, f"{label}: no expert serves {dname}: its best share of an expert is "
                                           f"{lead:.2f} (expert {best})"))
        if (name, 0) in ablated:
            for e in range(len(load)):
                for d, dname in enumerate(names):
                    keep = np.flatnonzero((domain == d) & (pairs > 0))
                    if not len(keep):
                        continue
                    base = np.exp(nll[keep].sum() / pairs[keep].sum())
                    gone = np.exp(ablated[name, e][keep].sum() / pairs[keep].sum())
                    boot = [np.exp(ablated[name, e][i].sum() / pairs[i].sum()) / np.exp(nll[i].sum() / pairs[i].sum())
                            - 1 for i in (rng.choice(keep, len(keep)) for _ in range(n_boot))]
                    ablation_rows.append({"layer": label, "expert": e, "domain": dname, "ppl": float(base),
                                          "ppl_ablated": float(gone), "change": float(gone / base - 1),
                                          **dict(zip(("change_low", "change_high"), _interval(boot, level)))})
    ablation = pd.DataFrame(ablation_rows, columns=ABLATION_COLUMNS)
    if len(ablation):
        for (label, e), rows in ablation.groupby(["layer", "expert"], sort=False):
            worst = rows.loc[rows["change"].idxmax()]
            findings.append((float(worst["change"]), f"{label}: without expert {e}, {worst['domain']} perplexity "
                             f"changes by {worst['change']:+.1%} [{worst['change_low']:+.1%}, "
                             f"{worst['change_high']:+.1%}]"))
    ordered = [text for _, text in sorted(findings, key=lambda f: -f[0])]
    experts = pd.DataFrame(expert_rows)
    return ExpertReport(pd.DataFrame(layer_rows, columns=LAYER_COLUMNS),
                        experts[EXPERT_COLUMNS + [c for c in experts.columns if c not in EXPERT_COLUMNS]],
                        ablation, ordered, level)
