"""Sparse layers: CSE (cluster-guided, sequence-level), Switch (learned top-1 token
routing) and DEMix (one expert per domain label).

Each wraps a list of experts, copies of a dense module, and takes ``(x, key_mask)`` like
the module it replaces. State updates (CSE centres) never happen inside ``forward``: a
training loop calls :meth:`CSELayer.update_centres` after the step. Bookkeeping (the load
per expert, Switch's auxiliary loss) happens in training mode only, so in eval mode
``forward`` is a pure function that ``torch.func`` transforms can differentiate (docs/design.md §6).

``per_sample_dispatch`` (False; ntkscope sets it while it computes an NTK): every expert runs on
every sequence and a 0/1 routing mask picks each output, so shapes never depend on the routing.
Same outputs, E times the expert compute; ``vmap`` and per-layer hooks then see every sample at
every expert (a sequence not routed to an expert gets a zero cotangent there). Switch's capacity
is then counted per sequence, as it is for a batch of one: the per-sample function that a
per-sample gradient differentiates.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ntkscope.core.checks import UserError
from ntkscope.core.lm import masked_mean
from ntkscope.kernel.experts import MixtureKind, register_mixture


def sequence_embedding(x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real tokens: x (B, T, d), key_mask (B, T) bool -> (B, d)."""
    return masked_mean(x, key_mask)


def _routing_embedding(x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """The sequence embedding a CSE layer routes by, in float32 at least: a bfloat16 / float16
    x (B, T, d) is averaged in float32, float32 and float64 as they are -> (B, d)."""
    return sequence_embedding(x.to(torch.promote_types(x.dtype, torch.float32)), key_mask)


_PRIME = 2**31 - 1  # the Mersenne prime of the sequence hash (int64 sums stay below 2**63 for T < 2**14)


def sequence_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A fixed hash of each sequence's real tokens as a number in [0, 1): input_ids (B, T) ->
    (B,) float64. It depends on the tokens and their positions only (not on the batch, the
    padding or the weights), so a sequence gets the same number in training and evaluation; over
    distinct sequences the numbers spread evenly (a sum of token x position weights mod a prime,
    then a Lehmer step)."""
    ids = input_ids.to(torch.int64) + 1
    if attention_mask is not None:
        ids = ids * attention_mask.to(torch.int64)
    position = torch.arange(1, ids.shape[-1] + 1, dtype=torch.int64, device=ids.device)
    weights = (position * 2654435761) % _PRIME  # a fixed weight per position, below 2**31
    h = (ids * weights).sum(-1) % _PRIME
    return ((h * 48271) % _PRIME).to(torch.float64) / _PRIME


def shuffled_experts(keys: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
    """Each key in [0, 1) (B,) to the expert whose slice of [0, 1) holds it, slices as wide as
    ``shares`` (C,): experts drawn in those proportions, by nothing but the sequence."""
    edges = torch.cumsum(shares.to(torch.float64), 0)
    return torch.clamp(torch.searchsorted(edges / edges[-1], keys.to(torch.float64), right=True), max=len(shares) - 1)


def _dispatch(experts: nn.ModuleList, x: torch.Tensor, key_mask, assign: torch.Tensor,
              masked: bool = False) -> torch.Tensor:
    """Run each sequence through its expert: x (B, T, d), assign (B,) -> (B, T, d); ``masked``:
    every expert on every sequence, outputs picked by a 0/1 mask (no data-dependent shapes)."""
    if len(experts) == 1:
        return experts[0](x, key_mask)
    if masked:
        return sum((assign == j).to(x.dtype)[:, None, None] * expert(x, key_mask) for j, expert in enumerate(experts))
    out = x.new_zeros(x.shape)
    for j, expert in enumerate(experts):
        idx = (assign == j).nonzero().squeeze(1)
        if idx.numel():
            rows = {"rows": idx} if getattr(expert, "takes_rows", False) else {}  # an HF attention: its call's rows
            y = expert(x[idx], None if key_mask is None else key_mask[idx], **rows)
            out = out.index_copy(0, idx, y.to(out.dtype))  # bf16 under autocast: the residual's dtype
    return out


class CSELayer(nn.Module):
    """Cluster-guided Sparse Expert layer (docs/design.md §4, Algorithm 1 of the CSE paper).

    A sequence with embedding v (the mean of the module's input over its real tokens, (d,))
    goes to ``argmin_j ||z - c_j|| / r_j`` with ``z = normalise(M (v - mu))``. Buffers (saved in
    the checkpoint): ``projection`` M (d', d), ``centres`` (C, d'), ``radii`` (C,) and, in router
    format 2, ``mean`` mu (d,); ``normalise`` says whether z is L2-normalised. ``mean=None`` is
    router format 1 (turn 1): ``z = M v``. No router parameters. ``load`` counts the sequences
    sent to each expert since the last :meth:`reset_load`, and ``domain_load`` (E, D) the same by
    domain label when ``forward`` is given the batch's ``domains`` (bookkeeping only: labels never
    route). ``mean_rate`` > 0 (format 2): after each step mu follows the batch's embeddings (drift
    handling, :class:`~cse_models.SparseConfig`).

    ``shares`` (C,) makes the layer ``cse-shuffled``, the control that keeps CSE's machinery, its
    expert count and its clusters' sizes but not its clusters: a sequence goes to the expert drawn
    by a fixed hash of its tokens (:func:`sequence_keys`, set by the model as ``sequence_keys``
    before each forward) in the proportions ``shares``, in training and in evaluation alike.
    """

    def __init__(self, experts: list[nn.Module], projection: torch.Tensor, centres: torch.Tensor,
                 radii: torch.Tensor, alpha: float = 0.99, *, mean: torch.Tensor | None = None,
                 normalise: bool = False, mean_rate: float = 0.0, shares: torch.Tensor | None = None):
        super().__init__()
        if mean is None and normalise:
            raise UserError("CSELayer: normalise needs a router-format-2 layer (a mean)")
        if mean is None and mean_rate:
            raise UserError("CSELayer: mean_rate needs a router-format-2 layer (a mean)")
        self.experts = nn.ModuleList(experts)
        self.alpha = float(alpha)
        self.mean_rate = float(mean_rate)
        self.normalise = bool(normalise)
        if mean is not None:
            self.register_buffer("mean", mean.clone())
        else:
            self.mean = None
        self.register_buffer("projection", projection.clone())
        self.register_buffer("centres", centres.clone())
        self.register_buffer("radii", radii.clone())
        self.register_buffer("load", torch.zeros(len(experts), dtype=torch.long), persistent=False)
        self._pending: tuple | None = None
        self.domain_load = torch.zeros(len(experts), 0, dtype=torch.long)  # (E, D) since the last reset
        self.per_sample_dispatch = False
        self.shuffled = shares is not None
        if self.shuffled:
            if shares.shape != (len(experts),):
                raise UserError(f"CSELayer: shares must give one share per expert (got shape {tuple(shares.shape)} "
                                f"for {len(experts)} experts)")
            self.register_buffer("shares", shares.clone())
        self.sequence_keys: torch.Tensor | None = None  # (B,) of the batch in flight, set by the model

    def route(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
              keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence embeddings in the routing space (B, d') and the chosen expert of each sequence (B,);
        z in float32 at least (see :meth:`_route`). A shuffled layer's experts come from ``keys``
        (:func:`sequence_keys` of these sequences; default the batch in flight's)."""
        z, assign = self._route(_routing_embedding(x, key_mask))
        return (z, self._shuffled(keys, len(z))) if self.shuffled else (z, assign)

    def _shuffled(self, keys: torch.Tensor | None, n: int) -> torch.Tensor:
        keys = self.sequence_keys if keys is None else keys
        if keys is None or keys.shape[0] != n:
            raise UserError("CSELayer: a shuffled layer routes by its sequences' tokens: call it through its model "
                            "(which sets sequence_keys), or pass keys=sequence_keys(input_ids, attention_mask)")
        return shuffled_experts(keys, self.shares).to(keys.device)

    def _route(self, v: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Route embeddings v (B, d) in ``dtype`` (default v's), float32 at least: a bfloat16 / float16
        model's embeddings and buffers are read in float32 (``cdist`` has no half kernels, and half
        precision would move close calls), so it routes as its float32 copy does."""
        v = v.to(torch.promote_types(dtype or v.dtype, torch.float32))
        if self.mean is not None:
            v = v - self.mean.to(v.dtype)
        z = v @ self.projection.to(v.dtype).T
        if self.normalise:
            z = F.normalize(z, dim=-1)
        scaled = torch.cdist(z, self.centres.to(z.dtype)) / self.radii.to(z.dtype)
        return z, scaled.argmin(dim=1)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                domains: torch.Tensor | None = None) -> torch.Tensor:
        v = _routing_embedding(x, key_mask)
        z, assign = self._route(v)
        if self.shuffled:
            assign = self._shuffled(None, len(z))
        if self.training:  # bookkeeping only in training: analyses (eval mode) see a pure function
            self._pending = (z.detach(), assign.detach(), v.detach().mean(0))
            with torch.no_grad():
                self.load += torch.bincount(assign.detach(), minlength=len(self.experts)).to(self.load.device)
                if domains is not None:  # what each expert receives, by domain label (never used to route)
                    self._count_domains(assign.detach().cpu(), domains.detach().cpu())
        return _dispatch(self.experts, x, key_mask, assign, self.per_sample_dispatch)

    def _count_domains(self, assign: torch.Tensor, domains: torch.Tensor) -> None:
        n_domains = max(int(domains.max()) + 1, self.domain_load.shape[1])
        if n_domains > self.domain_load.shape[1]:
            grown = torch.zeros(len(self.experts), n_domains, dtype=torch.long)
            grown[:, :self.domain_load.shape[1]] = self.domain_load
            self.domain_load = grown
        self.domain_load.index_put_((assign, domains), torch.ones_like(assign), accumulate=True)

    @torch.no_grad()
    def update_centres(self) -> None:
        """After a training step: each routed sequence moves its centre, ``c <- a c + (1 - a) z``, in
        batch order; then, with ``mean_rate``, the centring mean follows the batch's mean embedding."""
        if self._pending is None:
            return
        z, assign, batch_mean = self._pending
        self._pending = None
        for zi, j in zip(z.to(self.centres.dtype), assign.tolist()):
            self.centres[j].mul_(self.alpha).add_(zi, alpha=1.0 - self.alpha)
        if self.mean_rate:
            self.mean.mul_(1.0 - self.mean_rate).add_(batch_mean.to(self.mean.dtype), alpha=self.mean_rate)

    def reset_load(self) -> None:
        self.load.zero_()
        self.domain_load.zero_()


class SwitchFFN(nn.Module):
    """Switch Transformer FFN: each real token goes to its top-1 expert (``softmax(W x)``),
    scaled by the gate; at most ``ceil(capacity_factor * tokens / C)`` tokens per expert,
    the overflow skips the layer (its residual passes through); ``load`` counts the tokens
    each expert processed. ``aux_loss`` after a
    forward is the load-balancing loss ``C * sum_j f_j P_j`` (Fedus et al., 2021).

    ``preserving`` (the fair capacity control of upcycling): the gate is renormalised to 1 over
    the one chosen expert (its value ``g / g`` is 1, its gradient ``d log g`` still trains the
    router) and no token is dropped in evaluation, so a layer whose experts are copies of a dense
    module computes that module exactly: upcycling leaves the model's function unchanged."""

    def __init__(self, experts: list[nn.Module], n_embd: int, capacity_factor: float = 1.25, *,
                 preserving: bool = False):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.router = nn.Linear(n_embd, len(experts), bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.capacity_factor = capacity_factor
        self.preserving = bool(preserving)
        self.register_buffer("load", torch.zeros(len(experts), dtype=torch.long), persistent=False)
        self.aux_loss = torch.zeros(())
        self.per_sample_dispatch = False

    def _gate(self, gate: torch.Tensor) -> torch.Tensor:
        """The top-1 probability as the output's scale: as it is, or renormalised to 1 (``preserving``)."""
        return gate / gate.detach() if self.preserving else gate

    def _capacity(self, tokens):
        """Tokens an expert takes: ``ceil(capacity_factor * tokens / C)``, at least 1; all of them in
        evaluation when ``preserving`` (``tokens``: an int, or a (B, 1) tensor per sequence)."""
        if self.preserving and not self.training:
            return tokens
        C = len(self.experts)
        if isinstance(tokens, torch.Tensor):
            return torch.clamp(torch.ceil(self.capacity_factor * tokens / C), min=1)
        return max(1, math.ceil(self.capacity_factor * tokens / C))

    def sequence_routes(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's gate and expert as one sequence at a time routes them (the per-sample
        function): (gate (B, T), expert (B, T) long), the expert -1 for padding and for a token
        past its expert's capacity ``ceil(capacity_factor * real tokens / C)`` in its sequence."""
        B, T, _ = x.shape
        real = torch.ones(B, T, dtype=torch.bool, device=x.device) if key_mask is None else key_mask.bool()
        probs = F.softmax(self.router(x).to(torch.promote_types(x.dtype, torch.float32)), dim=-1)  # (B, T, C)
        gate, choice = probs.max(dim=-1)
        capacity = self._capacity(real.sum(1, keepdim=True))  # (B, 1)
        kept = torch.full_like(choice, -1)
        for j in range(len(self.experts)):
            routed = (choice == j) & real
            kept = torch.where(routed & (torch.cumsum(routed.long(), dim=1) <= capacity), j, kept)
        return self._gate(gate), kept

    def _masked(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Every expert on every token; a token keeps its top-1 expert's output, gated, if it is among
        the first ``ceil(capacity_factor * real tokens / C)`` of its sequence routed there."""
        gate, kept = self.sequence_routes(x, key_mask)
        out = x.new_zeros(x.shape)
        for j, expert in enumerate(self.experts):
            out = out + ((kept == j).to(x.dtype) * gate.to(x.dtype)).unsqueeze(-1) * expert(x)
        return out

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.per_sample_dispatch and not self.training:
            return self._masked(x, key_mask)
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        real = torch.ones(B * T, dtype=torch.bool, device=x.device) if key_mask is None else key_mask.reshape(-1)
        tokens = real.nonzero().squeeze(1)
        h = flat[tokens]
        logits = self.router(h)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (N, C)
        gate, choice = probs.max(dim=-1)
        gate = self._gate(gate)
        C = len(self.experts)
        capacity = self._capacity(tokens.numel())
        out = flat.new_zeros(flat.shape)
        processed = torch.zeros(C, dtype=torch.long)
        for j, expert in enumerate(self.experts):
            idx = (choice == j).nonzero().squeeze(1)[:capacity]  # first come, first served
            processed[j] = idx.numel()
            if idx.numel():
                y = expert(h[idx].unsqueeze(0)).squeeze(0) * gate[idx].unsqueeze(1).to(h.dtype)
                out = out.index_copy(0, tokens[idx], y.to(out.dtype))
        if self.training:  # bookkeeping only in training: analyses (eval mode) see a pure function
            fraction = torch.bincount(choice, minlength=C).to(probs.dtype) / max(1, choice.numel())
            self.aux_loss = C * (fraction * probs.mean(dim=0)).sum()
            self.load += processed.to(self.load.device)  # tokens each expert processed (overflow excluded)
        return out.view(B, T, d)

    def reset_load(self) -> None:
        self.load.zero_()


class DEMixLayer(nn.Module):
    """DEMix layer (Gururangan et al., 2022): one expert per domain; each sequence goes to the
    expert of its domain label. The inference-time mixture over domains lives in
    :mod:`cse_models.demix`, which runs the model once per expert."""

    def __init__(self, experts: list[nn.Module]):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.register_buffer("load", torch.zeros(len(experts), dtype=torch.long), persistent=False)
        self.per_sample_dispatch = False

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None, domains: torch.Tensor | None = None):
        if domains is None:
            raise UserError("DEMixLayer.forward: domains must be given (one expert index per sequence); "
                            "for inference without labels use cse_models.demix.mixture_log_probs")
        if self.training:
            with torch.no_grad():
                self.load += torch.bincount(domains.detach(), minlength=len(self.experts)).to(self.load.device)
        return _dispatch(self.experts, x, key_mask, domains, self.per_sample_dispatch)

    def reset_load(self) -> None:
        self.load.zero_()


def _sequence_routes(module, sink) -> list:
    """A CSE or DEMix layer's expert per sequence, (B, E) one-hot, recorded in its forward."""
    def hook(_m, args, _out):
        x, key_mask = args[0], (args[1] if len(args) > 1 else None)
        assign = module.route(x, key_mask)[1] if isinstance(module, CSELayer) else args[2]  # DEMix: its labels
        sink(F.one_hot(assign.long(), len(module.experts)).bool())
    return [module.register_forward_hook(hook)]


def _token_routes(module, sink) -> list:
    """A Switch layer's expert per token under per-sequence capacity, (B, T, E), recorded in its forward."""
    def hook(_m, args, _out):
        x, key_mask = args[0], (args[1] if len(args) > 1 else None)
        kept = module.sequence_routes(x, key_mask)[1]
        sink(F.one_hot(kept + 1, len(module.experts) + 1)[..., 1:].bool())
    return [module.register_forward_hook(hook)]


def _own_experts(module, e: int) -> list:
    return [(f"experts.{e}.{name}", None) for name, _ in module.experts[e].named_parameters()]


for _name, _layer, _unit, _routes in (("cse", CSELayer, "sequence", _sequence_routes),
                                      ("demix", DEMixLayer, "sequence", _sequence_routes),
                                      ("switch", SwitchFFN, "token", _token_routes)):
    register_mixture(MixtureKind(name=_name, unit=_unit, matches=lambda m, _layer=_layer: isinstance(m, _layer),
                                 n_experts=lambda m: len(m.experts), expert_params=_own_experts, route_hook=_routes))
