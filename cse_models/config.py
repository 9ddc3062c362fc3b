"""Model configuration: a dataclass saved as ``config.json`` beside ``model.safetensors``.

``GPTConfig`` (causal) and ``BERTConfig`` (masked) share every field; ``model_type``
tells them apart in a checkpoint. ``sparse`` describes the sparse layers (CSE, Switch
or DEMix) and, once a CSE layer has been built from clusters, how many experts each
chosen layer has — so a checkpoint can be rebuilt from its config alone.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from ntkscope.core.checks import UserError

SPARSE_KINDS = ("cse", "switch", "demix")
SPARSE_MODULES = ("ffn", "attn")
ROUTER_FORMATS = (1, 2)  # CSE router formats a checkpoint may carry; 2 is the current one


def from_fields(cls, data: dict, where: str):
    """``cls(**data)`` for a dataclass ``cls``; keys that are not its fields are refused in one line,
    ``where`` (e.g. "TrainConfig: data has") followed by the unknown and the known keys."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{where} unknown keys {unknown} (known: {sorted(known)})")
    return cls(**data)


@dataclass
class SparseConfig:
    """Which layers are sparse, and how.

    kind : ``"cse"`` (cluster-guided, sequence-level, no router parameters), ``"switch"``
        (learned top-1 token routing) or ``"demix"`` (one expert per domain label).
    module : ``"ffn"`` (MoF) or ``"attn"`` (MoA; CSE and DEMix only).
    layers : block indices whose module is sparse.
    n_experts : experts per sparse layer, in ``layers`` order. For CSE, 0 until the
        clusters are found (the layer is dense during warm-up); for Switch and DEMix, 0 until
        the dense module is upcycled (``TrainConfig.upcycle``); DEMix otherwise fills it in
        (one expert per domain).
    proj_dim : CSE: dimension d' of the random projection M (d' x d); in router format 2,
        ``proj_dim >= n_embd`` means no projection (M is the identity, d' = d).
    router_format : CSE: 1 (turn 1: ``||M v - c|| / r``) or 2 (``||normalise(M (v - mu)) - c|| / r``,
        the mean mu stored in the layer). A config without it is format 1, so turn-1
        checkpoints load and route as before; new CSE layers are format 2.
    normalise : CSE, format 2: whether the routing space is L2-normalised (cosine geometry).
    alpha : CSE: EMA factor of the centre update ``c <- alpha c + (1 - alpha) v'``.
    mean_rate : CSE, format 2: drift handling. After each step the centring mean follows the
        batch's sequence embeddings, ``mu <- (1 - mean_rate) mu + mean_rate mean(v)``, so a
        shift common to all representations leaves the routing space where it was fitted and
        small clusters keep reaching their experts. 0 (the default): Algorithm 1 as written,
        mu fixed at the fit.
    capacity_factor, aux_weight : Switch: expert capacity and load-balancing loss weight.
    shuffled : CSE: the ``cse-shuffled`` control, each sequence routed by a fixed hash of its
        tokens in the clusters' proportions (:class:`~cse_models.experts.CSELayer`'s ``shares``).
    preserving : Switch: the gate renormalised to 1 and no token dropped in evaluation, so that
        upcycling leaves the model's function unchanged (:class:`~cse_models.experts.SwitchFFN`;
        :func:`~cse_models.cse.upcycle` sets it by default). False (a model saved before it
        existed): the softmax gate scales the output and the capacity applies in evaluation too.
    domains : DEMix: the domain label of each expert, in expert order.
    """

    kind: str = "cse"
    module: str = "ffn"
    layers: list = field(default_factory=list)
    n_experts: list = field(default_factory=list)
    proj_dim: int = 32
    router_format: int = 1
    normalise: bool = False
    alpha: float = 0.99
    mean_rate: float = 0.0
    capacity_factor: float = 1.25
    aux_weight: float = 0.01
    preserving: bool = False
    shuffled: bool = False
    domains: list = field(default_factory=list)

    def check(self, n_layer: int) -> None:
        where = "SparseConfig"
        if self.kind not in SPARSE_KINDS:
            raise UserError(f"{where}: kind must be one of {list(SPARSE_KINDS)} (got {self.kind!r})")
        if self.module not in SPARSE_MODULES:
            raise UserError(f"{where}: module must be one of {list(SPARSE_MODULES)} (got {self.module!r})")
        if self.kind == "switch" and self.module != "ffn":
            raise UserError(f"{where}: a Switch layer routes tokens through FFN experts; module must be 'ffn' "
                            f"(got {self.module!r})")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise UserError(f"{where}: layers must list distinct block indices (got {self.layers!r})")
        bad = [i for i in self.layers if not isinstance(i, int) or not 0 <= i < n_layer]
        if bad:
            raise UserError(f"{where}: layers must be block indices in [0, {n_layer}) for a {n_layer}-layer model "
                            f"(got {bad})")
        if self.kind == "demix":
            if len(self.domains) < 1 or len(set(self.domains)) != len(self.domains):
                raise UserError(f"{where}: a DEMix model needs distinct domain labels, one per expert "
                                f"(got {self.domains!r})")
            if any(self.n_experts) or len(self.n_experts) != len(self.layers):  # all 0: dense until upcycled
                self.n_experts = [len(self.domains)] * len(self.layers)
        if len(self.n_experts) != len(self.layers):
            raise UserError(f"{where}: n_experts must give one count per layer in layers "
                            f"(got {self.n_experts!r} for layers {self.layers!r})")
        minimum = 0  # 0: dense until converted (CSE) or upcycled (Switch, DEMix)
        if any(not isinstance(c, int) or c < minimum for c in self.n_experts):
            raise UserError(f"{where}: n_experts must be integers >= {minimum} (got {self.n_experts!r})")
        if self.router_format not in ROUTER_FORMATS:
            raise UserError(f"{where}: router_format must be one of {list(ROUTER_FORMATS)} (got {self.router_format!r})")
        if self.normalise and self.router_format < 2:
            raise UserError(f"{where}: normalise needs router_format 2 (got router_format={self.router_format})")
        if not 0.0 <= self.alpha < 1.0:
            raise UserError(f"{where}: alpha must be in [0, 1) (got {self.alpha!r})")
        if not 0.0 <= self.mean_rate < 1.0:
            raise UserError(f"{where}: mean_rate must be in [0, 1) (got {self.mean_rate!r})")
        if self.mean_rate and self.kind == "cse" and self.router_format < 2 and any(self.n_experts):
            raise UserError(f"{where}: mean_rate needs router_format 2 (a centring mean; got router_format="
                            f"{self.router_format})")
        for name in ("preserving", "shuffled"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{where}: {name} must be true or false (got {getattr(self, name)!r})")
        if self.shuffled and self.kind != "cse":
            raise UserError(f"{where}: shuffled applies to CSE layers (got kind {self.kind!r})")
        if self.proj_dim < 1 or self.capacity_factor <= 0 or self.aux_weight < 0:
            raise UserError(f"{where}: proj_dim must be >= 1, capacity_factor > 0 and aux_weight >= 0 "
                            f"(got {self.proj_dim}, {self.capacity_factor}, {self.aux_weight})")

    def experts_at(self, layer: int) -> int:
        return self.n_experts[self.layers.index(layer)] if layer in self.layers else 0

    def route_dim(self, n_embd: int) -> int:
        """d', the routing space's dimension, for a model of width ``n_embd``."""
        return min(self.proj_dim, n_embd) if self.router_format >= 2 else self.proj_dim


@dataclass
class GPTConfig:
    """Architecture of a :class:`~cse_models.GPT` (or, with ``model_type="bert"``, a BERT).

    The defaults are a CPU-sized toy; ``n_layer=12, n_head=12, n_embd=768,
    vocab_size=50257, block_size=1024`` is GPT-2 small (the CSE paper's size).
    """

    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    model_type: str = "gpt"
    mask_token_id: int | None = None
    sparse: SparseConfig | None = None

    def __post_init__(self):
        name = type(self).__name__
        if isinstance(self.sparse, dict):  # a copy: conversion fills in n_experts, never the caller's lists
            self.sparse = SparseConfig(**copy.deepcopy(self.sparse))
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name}: {key} must be a positive integer (got {value!r})")
        if self.n_embd % self.n_head:
            raise UserError(f"{name}: n_embd must be divisible by n_head (got n_embd={self.n_embd}, n_head={self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"{name}: dropout must be in [0, 1) (got {self.dropout!r})")
        if self.model_type not in ("gpt", "bert"):
            raise UserError(f"{name}: model_type must be 'gpt' or 'bert' (got {self.model_type!r})")
        if self.model_type == "bert" and (self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size):
            raise UserError(f"{name}: a BERT needs mask_token_id in [0, vocab_size) (got {self.mask_token_id!r})")
        if self.sparse is not None:
            self.sparse.check(self.n_layer)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        return from_fields(cls, data, f"{cls.__name__}.from_dict:")


@dataclass
class BERTConfig(GPTConfig):
    """A bidirectional encoder trained by masked language modelling."""

    model_type: str = "bert"
    mask_token_id: int | None = 2  # the pack BPE's <mask>
