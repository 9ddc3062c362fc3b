"""DEMix at inference time, and its modularity (Gururangan et al., 2022, §5-6).

Without a domain label, the next-token distribution is a mixture over the experts,
weighted by the posterior over domains given the prefix::

    p(x_t | x_<t) = sum_j p(x_t | x_<t, D=j) P(D=j | x_<t)
    P(D=j | x_<t) ∝ P(D=j) prod_{s<t} p(x_s | x_<s, D=j)

The model runs once per expert (every DEMix layer set to expert j). The prior P(D) is
``uniform``, ``cached`` (the mean final posterior over held-out sequences, then fixed) or
``updating`` (an EMA of the posteriors of the sequences seen so far: ``prior <- lam prior
+ (1 - lam) mean posterior``). Experts can be added (initialised from an existing one)
and removed, which removes the domain from every mixture.

By the chain rule the product of the per-position mixtures is the sequence-level mixture
``sum_j P(D=j) prod_t p(x_t | x_<t, D=j)`` (:func:`sequence_posterior`). That form also serves a
masked LM (BERT), where the "sequence" is the masked tokens given the visible ones: the
marginal likelihood of the targets under the prior, and the posterior after seeing them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cse_models.experts import DEMixLayer
from ntkscope.core.checks import UserError


def _demix_layers(model) -> list[DEMixLayer]:
    layers = [m for m in model.modules() if isinstance(m, DEMixLayer)]
    if not layers:
        raise UserError("demix: the model has no DEMix layers (config.sparse.kind must be 'demix')")
    return layers


@torch.no_grad()
def expert_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target | context, D=j) for every expert j: (C, B, T-1) for a causal model (the next
    token), or (C, B, T) for a masked one given ``labels`` (B, T) (the masked inputs are
    ``input_ids``; positions whose label is -100 get 0)."""
    C = len(model.config.sparse.domains)
    B = input_ids.shape[0]
    out = []
    for j in range(C):
        logits = model(input_ids, attention_mask, domains=torch.full((B,), j, dtype=torch.long, device=input_ids.device))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> float32; float64 stays
        if labels is None:
            logp = F.log_softmax(logits[:, :-1], dim=-1)
            out.append(logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1))
        else:
            keep = labels != -100
            logp = F.log_softmax(logits, dim=-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out.append(logp * keep)
    return torch.stack(out)


@dataclass
class DomainPrior:
    """P(D) over the experts: ``mode`` in {"uniform", "cached", "updating"}; ``lam`` the EMA factor."""

    n_domains: int
    mode: str = "uniform"
    lam: float = 0.3
    probs: torch.Tensor = field(default=None)

    def __post_init__(self):
        if self.mode not in ("uniform", "cached", "updating"):
            raise UserError(f"DomainPrior: mode must be 'uniform', 'cached' or 'updating' (got {self.mode!r})")
        if self.probs is None:
            self.probs = torch.full((self.n_domains,), 1.0 / self.n_domains)

    def update(self, posterior: torch.Tensor) -> None:
        """After a batch: the ``updating`` prior moves towards the batch's mean final posterior (B, C)."""
        if self.mode == "updating":
            self.probs = self.lam * self.probs + (1 - self.lam) * posterior.mean(dim=0).cpu()


@torch.no_grad()
def sequence_posterior(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       prior: DomainPrior | None = None, labels: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence-level mixture: log sum_j P(D=j) prod_t p(x_t | ., D=j) (B,) and the posterior
    P(D | x) (B, C). Causal models score every next token (padding excluded); a masked model
    (``labels`` given, ``input_ids`` masked) scores the masked tokens given the visible ones."""
    C = len(model.config.sparse.domains)
    prior = prior or DomainPrior(C)
    per_expert = expert_log_probs(model, input_ids, attention_mask, labels)  # (C, B, L)
    if labels is None and attention_mask is not None:
        per_expert = per_expert * (attention_mask[:, 1:] * attention_mask[:, :-1]).to(per_expert.dtype)
    joint = per_expert.sum(dim=2).T + torch.log(prior.probs.to(per_expert)).clamp_min(-1e30)  # (B, C)
    return torch.logsumexp(joint, dim=1), F.softmax(joint, dim=1)


@torch.no_grad()
def estimate_prior(model, input_ids, attention_mask=None, *, batch_size: int = 32, masking=None) -> DomainPrior:
    """The ``cached`` prior: the mean posterior (from a uniform prior) over held-out sequences
    (N, T). ``masking(ids, start) -> (inputs, labels)``: for a masked LM, how a batch is masked."""
    C = len(model.config.sparse.domains)
    posts = []
    for s in range(0, len(input_ids), batch_size):
        ids = input_ids[s:s + batch_size]
        mask = None if attention_mask is None else attention_mask[s:s + batch_size]
        labels = None
        if masking is not None:
            ids, labels = masking(ids, s)
        posts.append(sequence_posterior(model, ids, mask, DomainPrior(C), labels)[1])
    return DomainPrior(C, "cached", probs=torch.cat(posts).mean(dim=0).cpu())


@torch.no_grad()
def mixture_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      prior: DomainPrior | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probabilities under the posterior-weighted mixture: (B, T-1), and the posterior
    used at each position (B, T-1, C). Padding positions contribute no evidence."""
    C = len(model.config.sparse.domains)
    prior = prior or DomainPrior(C)
    per_expert = expert_log_probs(model, input_ids, attention_mask).permute(1, 2, 0)  # (B, T-1, C)
    if attention_mask is not None:
        real = (attention_mask[:, 1:] * attention_mask[:, :-1]).to(per_expert.dtype).unsqueeze(-1)
        evidence = per_expert * real
    else:
        evidence = per_expert
    # evidence before position t: the sum over s < t (exclusive cumulative sum)
    before = torch.cumsum(evidence, dim=1) - evidence
    log_prior = torch.log(prior.probs.to(per_expert)).clamp_min(-1e30)
    log_post = F.log_softmax(before + log_prior, dim=-1)  # (B, T-1, C)
    mixed = torch.logsumexp(log_post + per_expert, dim=-1)
    posterior = log_post.exp()
    final = F.softmax(evidence.sum(dim=1) + log_prior, dim=-1)
    prior.update(final)
    return mixed, posterior


def add_expert(model, domain: str, *, init_from: str) -> int:
    """A new expert for ``domain`` in every DEMix layer, a copy of expert ``init_from``; returns its index."""
    domains = model.config.sparse.domains
    if domain in domains:
        raise UserError(f"add_expert: domain {domain!r} has an expert already (domains: {domains})")
    if init_from not in domains:
        raise UserError(f"add_expert: init_from must be one of {domains} (got {init_from!r})")
    src = domains.index(init_from)
    for layer in _demix_layers(model):
        layer.experts.append(copy.deepcopy(layer.experts[src]))
        layer.load = torch.zeros(len(layer.experts), dtype=torch.long, device=layer.load.device)
    domains.append(domain)
    model.config.sparse.n_experts = [len(domains)] * len(model.config.sparse.layers)
    return len(domains) - 1


def remove_expert(model, domain: str) -> None:
    """Remove ``domain``'s expert from every DEMix layer (and so from every mixture)."""
    domains = model.config.sparse.domains
    if domain not in domains:
        raise UserError(f"remove_expert: domain must be one of {domains} (got {domain!r})")
    if len(domains) == 1:
        raise UserError("remove_expert: cannot remove the last expert")
    j = domains.index(domain)
    for layer in _demix_layers(model):
        del layer.experts[j]
        layer.load = torch.zeros(len(layer.experts), dtype=torch.long, device=layer.load.device)
    domains.remove(domain)
    model.config.sparse.n_experts = [len(domains)] * len(model.config.sparse.layers)


def freeze_all_but(model, domain: str) -> list[str]:
    """Train only ``domain``'s experts (DEMix §6: a new domain is learned by its expert alone).
    Returns the names of the parameters left trainable."""
    j = model.config.sparse.domains.index(domain)
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad = f".experts.{j}." in name
        if p.requires_grad:
            trainable.append(name)
    return trainable
