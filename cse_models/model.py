"""GPT (causal) and BERT (masked) language models whose chosen layers may be sparse.

The layout follows nanoGPT, with GPT-2's parameter names (``transformer.wte``,
``transformer.h.{i}.attn.c_attn``, ...). A sparse layer replaces ``block.mlp`` (MoF)
or ``block.attn`` (MoA); its experts are ``...mlp.experts.{j}``. Checkpoints are a
directory with ``config.json`` and ``model.safetensors`` (tied weights stored once);
loading never unpickles anything.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
from safetensors.torch import save_file

from cse_models.config import BERTConfig, GPTConfig
from cse_models.experts import CSELayer, DEMixLayer, SwitchFFN, sequence_embedding, sequence_keys
from cse_models.layers import Block
from ntkscope.core.checks import MissingInput, UserError, check_path
from ntkscope.core.files import atomic_path, load_safetensors, read_json_object, write_json
from ntkscope.core.lm import linear_cross_entropy, lm_loss
from ntkscope.core.memory import check_fits

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SPARSE_TYPES = (CSELayer, SwitchFFN, DEMixLayer)


def sparse_layer_of(config, dense: nn.Module, n_experts: int) -> nn.Module:
    """The sparse layer that config.sparse asks for, its experts copies of ``dense``."""
    sparse = config.sparse
    experts = [copy.deepcopy(dense) for _ in range(n_experts)]
    if sparse.kind == "switch":
        return SwitchFFN(experts, config.n_embd, sparse.capacity_factor, preserving=sparse.preserving)
    if sparse.kind == "demix":
        return DEMixLayer(experts)
    d, dp = config.n_embd, sparse.route_dim(config.n_embd)
    mean = torch.zeros(d) if sparse.router_format >= 2 else None
    return CSELayer(experts, torch.zeros(dp, d), torch.zeros(n_experts, dp), torch.ones(n_experts), sparse.alpha,
                    mean=mean, normalise=sparse.normalise, mean_rate=sparse.mean_rate if mean is not None else 0.0,
                    shares=torch.ones(n_experts) if sparse.shuffled else None)


def check_expert_copies(modules_and_counts, what: str) -> None:
    """Refuse to make ``count`` copies of each ``module`` ((module, count) pairs: a layer's dense
    module and its experts) when their parameters would not fit in free memory, before one is
    made; ``what`` begins the message (e.g. "SparseHF: sparse.n_experts")."""
    pairs = [(m, int(k)) for m, k in modules_and_counts if k]
    params = [next(m.parameters(), None) for m, _ in pairs]
    if not pairs or any(p is None or p.is_meta for p in params):  # a model built on the meta device allocates nothing
        return
    size = sum(sum(p.numel() for p in m.parameters()) * k for m, k in pairs)
    check_fits(size, params[0].element_size(), what, device=params[0].device)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def _initialise(module: nn.Module, n_layer: int) -> None:
    """GPT-2's init: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
    module.apply(_init_weights)
    for name, p in module.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


@runtime_checkable
class SparseHost(Protocol):
    """What a model family provides so that its dense modules can become CSE, Switch or DEMix
    layers (:func:`cse_models.cse.convert_to_cse`, :func:`cse_models.cse.upcycle`, cse-train and
    the Trainer callback). :class:`TransformerLM` (our GPT and BERT) and :class:`cse_models.hf.SparseHF`
    (any HF causal LM with a :class:`~cse_models.hf.Layout`) implement it; a new family either adds
    one ``Layout`` to ``cse_models.hf.LAYOUTS`` (an HF model: the blocks' path and the FFN's name)
    or implements these members and mixes in :class:`SparseRouting` (docs/cse-models.md,
    "A new model family").

    - ``config``: ``n_layer``, ``n_embd`` and ``sparse`` (a :class:`~cse_models.SparseConfig` or None).
    - ``sparse_module(layer)``: the module of block ``layer`` that ``sparse.module`` names (its
      FFN, or attention): the dense module before conversion, the sparse layer after.
    - ``replace_sparse_module(layer, module)``: put ``module`` in its place.
    - ``module_inputs(input_ids (B, T), attention_mask (B, T) | None, layers, module, *, chunk)``:
      {layer: (B, d)}, each sequence's mean over real tokens of that module's input (what CSE's
      router clusters); and ``forward(input_ids, attention_mask, domains)``, ``domains`` (B,)
      read by DEMix layers only.
    """

    config: object

    def sparse_module(self, layer: int) -> nn.Module: ...

    def replace_sparse_module(self, layer: int, module: nn.Module) -> None: ...

    def module_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers,
                      module: str = "ffn", *, chunk: int = 256) -> dict[int, torch.Tensor]: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                domains: torch.Tensor | None = None, **kwargs): ...


def check_sparse_host(model, func: str) -> None:
    """Refuse, in one line naming what is missing, a model that is not a :class:`SparseHost`."""
    missing = [m for m in ("config", "sparse_module", "replace_sparse_module", "module_inputs", "forward")
               if not hasattr(model, m)]
    if missing:
        raise UserError(f"{func}: model must be a cse_models.SparseHost (a cse_models GPT/BERT, or an HF model wrapped "
                        f"in cse_models.SparseHF); {type(model).__name__} has no {', '.join(missing)}")


class SparseRouting:
    """What a model holding CSE / Switch / DEMix layers offers a training loop (mixed into
    :class:`TransformerLM` and :class:`cse_models.hf.SparseHF`): the layers, Switch's auxiliary
    loss, the CSE centre updates after a step, and the routing counters. Needs ``config.sparse``
    (a :class:`SparseHost` otherwise)."""

    def sparse_layers(self) -> dict[str, nn.Module]:
        """{qualified name: layer} of the CSE / Switch / DEMix layers, in depth order."""
        return {name: m for name, m in self.named_modules() if isinstance(m, SPARSE_TYPES)}

    def aux_loss(self) -> torch.Tensor:
        """Switch load-balancing losses of the last forward, weighted by ``aux_weight``; else 0."""
        losses = [m.aux_loss for m in self.sparse_layers().values() if isinstance(m, SwitchFFN)]
        if not losses:
            return torch.zeros((), device=next(self.parameters()).device)
        return self.config.sparse.aux_weight * torch.stack(losses).sum()

    def update_routers(self) -> None:
        """After an optimiser step: the CSE centres' EMA update."""
        for m in self.sparse_layers().values():
            if isinstance(m, CSELayer):
                m.update_centres()

    def routing_load(self, reset: bool = True) -> dict[str, list[int]]:
        """Sequences (CSE, DEMix) or tokens (Switch) sent to each expert since the last reset."""
        out = {name: m.load.tolist() for name, m in self.sparse_layers().items()}
        if reset:
            for m in self.sparse_layers().values():
                m.reset_load()
        return out

    def routing_domains(self) -> dict[str, list[list[int]]]:
        """{CSE layer name: (E, D) counts}: the sequences of each domain label sent to each expert
        since the last :meth:`routing_load` reset (training with domain labels only)."""
        return {name: m.domain_load.tolist() for name, m in self.sparse_layers().items()
                if isinstance(m, CSELayer) and m.domain_load.numel()}


class TransformerLM(SparseRouting, nn.Module):
    """The shared stack. ``forward(input_ids (B, T), attention_mask (B, T) | None,
    domains (B,) | None) -> logits (B, T, V)``; ``domains`` is needed by DEMix layers only."""

    config_class = GPTConfig

    def __init__(self, config: GPTConfig):
        super().__init__()
        expected = self.config_class.model_type
        if type(self) is not TransformerLM and config.model_type != expected:
            raise UserError(f"{type(self).__name__}: config.model_type must be {expected!r} "
                            f"(got {config.model_type!r}; use {config.model_type.upper()})")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        _initialise(self, config.n_layer)
        if config.sparse is not None:
            for i in config.sparse.layers:
                c = config.sparse.experts_at(i)
                if c > 0:
                    layer = sparse_layer_of(config, self.sparse_module(i), c)
                    if config.sparse.kind != "cse":  # Switch / DEMix experts start independent;
                        for expert in layer.experts:  # CSE experts are copies of the warmed-up module
                            _initialise(expert, config.n_layer)
                    self.replace_sparse_module(i, layer)

    # ---- the sparse layers ----------------------------------------------------------------

    def _attr(self) -> str:
        return "attn" if self.config.sparse is not None and self.config.sparse.module == "attn" else "mlp"

    def sparse_module(self, layer: int) -> nn.Module:
        return getattr(self.transformer.h[layer], self._attr())

    def replace_sparse_module(self, layer: int, module: nn.Module) -> None:
        setattr(self.transformer.h[layer], self._attr(), module)

    @torch.no_grad()
    def module_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers,
                      module: str = "ffn", *, chunk: int = 256) -> dict[int, torch.Tensor]:
        """Sequence embeddings (B, d) at the input of ``module`` ("ffn" or "attn") of each layer:
        the mean over real tokens of ``ln_2(x)`` (FFN) or ``ln_1(x)`` (attention). Runs ``chunk``
        sequences at a time and stops before the LM head (a fitting sample of thousands of
        sequences never holds its (B, T, V) logits)."""
        captured: dict[int, list] = {i: [] for i in layers}
        mask = None
        hooks = []
        for i in layers:
            norm = self.transformer.h[i].ln_2 if module == "ffn" else self.transformer.h[i].ln_1

            def hook(_m, _inp, out, i=i):
                captured[i].append(sequence_embedding(out, mask))

            hooks.append(norm.register_forward_hook(hook))
        try:
            for start in range(0, input_ids.shape[0], chunk):
                ids = input_ids[start:start + chunk]
                am = None if attention_mask is None else attention_mask[start:start + chunk]
                mask = None if am is None else am.bool()
                domains = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
                self.hidden_states(ids, am, domains=domains)
        finally:
            for h in hooks:
                h.remove()
        return {i: torch.cat(parts) for i, parts in captured.items()}

    # ---- forward ----------------------------------------------------------------------------

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      domains: torch.Tensor | None = None) -> torch.Tensor:
        """The final normalised hidden states (B, T, d)."""
        B, T = input_ids.size()
        if T > self.config.block_size:
            raise UserError(f"{type(self).__name__}.forward: input_ids has {T} positions, "
                            f"more than block_size={self.config.block_size}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))
        key_mask = None if attention_mask is None else attention_mask.bool()
        if self.config.sparse is not None and self.config.sparse.shuffled:  # cse-shuffled: routed by the tokens
            keys = sequence_keys(input_ids, attention_mask)
            for layer in self.sparse_layers().values():
                layer.sequence_keys = keys
        for block in self.transformer.h:
            x = block(x, key_mask, domains)
        return self.transformer.ln_f(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                domains: torch.Tensor | None = None, positions: slice | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); with ``positions`` (a slice of the T axis) only those positions'
        logits, (B, len(positions), V): training's next-token loss asks for ``slice(None, -1)``
        and so never builds (or back-propagates through) the last position's V logits.

        With ``targets`` (B, len(positions)) token ids (none ignored), the summed cross-entropy
        of those logits instead, a scalar: on CPU (float32, float64) by
        :func:`ntkscope.core.lm.linear_cross_entropy` (the logits never held whole), elsewhere from
        the logits in float32 (bf16 autocast on GPU) or float64.
        """
        h = self.hidden_states(input_ids, attention_mask, domains)
        h = h if positions is None else h[:, positions]
        if targets is None:
            return self.lm_head(h)
        if h.device.type == "cpu" and h.dtype in (torch.float32, torch.float64):
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(h)
        return lm_loss(logits if logits.dtype == torch.float64 else logits.float(), targets, reduction="sum")

    # ---- checkpoints: config.json + model.safetensors ------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (tied weights stored once), each atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_weights:
            state.pop("lm_head.weight")
        with atomic_path(directory / WEIGHTS_NAME) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt"})
        write_json(directory / CONFIG_NAME, self.config.to_dict())
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "TransformerLM":
        """Rebuild a model from ``config.json`` and load ``model.safetensors`` (no pickle)."""
        func = f"{cls.__name__}.from_pretrained"
        check_path("directory", directory, func=func)
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise MissingInput(f"{func}: {directory} has no {name}")
        data = read_json_object(directory / CONFIG_NAME, func)
        kind = data.get("model_type")
        if "architectures" in data:
            raise UserError(f"{func}: {directory} is an HF transformers checkpoint ({data['architectures']}), "
                            "not a cse_models one; load it with transformers (ntkscope.runs.checkpoints.load_checkpoint)")
        classes = {"gpt": GPT, "bert": BERT}
        if kind not in classes:
            raise UserError(f"{func}: {directory} holds a {kind!r} checkpoint, not one of cse_models' "
                            f"architectures {sorted(classes)}")
        target = classes[kind]
        if cls is not TransformerLM and target is not cls:
            raise UserError(f"{func}: {directory} holds a {kind!r} model; load it with {target.__name__}.from_pretrained")
        model = build_model(target.config_class.from_dict(data), f"{func}: {directory / CONFIG_NAME}")
        state = load_safetensors(directory / WEIGHTS_NAME, func)
        return load_weights(model, state, func, directory)

class GPT(TransformerLM):
    """Decoder-only causal LM."""

    config_class = GPTConfig


class BERT(TransformerLM):
    """Bidirectional encoder with a tied masked-LM head; ``config.mask_token_id`` marks masked inputs."""

    config_class = BERTConfig


def load_weights(model: TransformerLM, state: dict, func: str, where) -> TransformerLM:
    """Put ``state`` into ``model`` in the saved dtype (whatever torch's default dtype is now),
    tied weights from the embedding; a mismatch with the config is one line naming ``where``."""
    floats = {v.dtype for v in state.values() if v.is_floating_point()}
    if len(floats) == 1:
        model.to(floats.pop())
    if model.config.tie_weights and "transformer.wte.weight" in state:
        state = {**state, "lm_head.weight": state["transformer.wte.weight"]}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches: name the first
        lines = [x.strip() for x in str(err).splitlines() if "size mismatch" in x] or [str(err).splitlines()[0]]
        raise UserError(f"{func}: weights in {where} do not match its config ({len(lines)} tensors; "
                        f"first: {lines[0]})") from None
    if missing or unexpected:
        raise UserError(f"{func}: weights in {where} do not match its config "
                        f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return model


def _module_sizes(config: GPTConfig) -> dict:
    d, b = config.n_embd, int(config.bias)
    return {"attn": 3 * d * d + 3 * d * b + d * d + d * b, "mlp": 8 * d * d + 4 * d * b + d * b}


def parameter_count(config: GPTConfig) -> int:
    """The parameters a model of ``config`` has, from the config alone (tests check it against
    built models): embeddings, per block two LayerNorms, attention (d x 3d, d x d) and the MLP
    (d x 4d, 4d x d), the final LayerNorm, the head unless tied; a sparse layer holds one copy of
    its module per expert, plus Switch's router (d x C)."""
    d, b = config.n_embd, int(config.bias)
    norm = d * (1 + b)
    modules = _module_sizes(config)
    sparse = config.sparse
    total = config.vocab_size * d + config.block_size * d + norm
    total += 0 if config.tie_weights else config.vocab_size * d
    for layer in range(config.n_layer):
        block = 2 * norm + modules["attn"] + modules["mlp"]
        experts = sparse.experts_at(layer) if sparse is not None else 0
        if experts > 0:
            module = modules["attn" if sparse.module == "attn" else "mlp"]
            block += (experts - 1) * module + (d * experts if sparse.kind == "switch" else 0)
        total += block
    return int(total)


def active_parameter_count(config: GPTConfig) -> int:
    """The parameters one token passes through: every sparse layer here (CSE, Switch, DEMix at
    inference per expert) sends a token to one expert, so all but one copy of each sparse module
    are inactive; Switch's router counts as active."""
    sparse = config.sparse
    inactive = 0
    if sparse is not None:
        module = _module_sizes(config)["attn" if sparse.module == "attn" else "mlp"]
        inactive = sum(max(c - 1, 0) * module for c in sparse.n_experts)
    return parameter_count(config) - inactive


def build_model(config: GPTConfig, what: str = "build_model") -> TransformerLM:
    """The GPT or BERT of ``config``, after checking from the config alone that its parameters
    fit in free memory: a config asking for too much is refused, not allocated."""
    check_fits(parameter_count(config), 4, what)
    return (BERT if config.model_type == "bert" else GPT)(config)


def load_model(directory: str | os.PathLike) -> TransformerLM:
    """A GPT or BERT checkpoint, whichever ``config.json`` says."""
    check_path("directory", directory, func="load_model")
    return TransformerLM.from_pretrained(directory)
