"""CSE, Switch and DEMix layers inside a Hugging Face language model.

:class:`SparseHF` wraps a ``transformers`` causal LM (GPT-2, GPT-NeoX / Pythia, the Llama layout)
or masked LM (BERT, RoBERTa: ``*ForMaskedLM``, trained by ``cse-train`` as our BERT is, on the
masked tokens) and offers what :class:`~cse_models.TransformerLM` offers a training loop and a conversion:
``forward(input_ids, attention_mask, domains, positions=, targets=)``, ``module_inputs`` (the
sequence embeddings at the FFN's input), ``sparse_module`` / ``replace_sparse_module`` (the FFN of a block: :class:`~cse_models.SparseHost`) and the
routing counters (:class:`~cse_models.model.SparseRouting`). So :func:`~cse_models.cse.convert_to_cse`,
:func:`~cse_models.cse.upcycle` and ``cse-train`` work on it unchanged, and a one-expert layer is
the dense MLP itself (the same output, bit for bit).

Where a family keeps its blocks and its FFN is one :class:`Layout` in :data:`LAYOUTS`, keyed by
the config's ``model_type``; ``ntkscope.runs.families`` reads the same table, so a new family is
one line here and one adapter there. A converted checkpoint is the HF ``config.json`` with a
``cse_sparse`` section (the layout and the :class:`~cse_models.SparseConfig`) beside
``model.safetensors`` (tied weights stored once); loading builds the model from the config
(``trust_remote_code=False``), rebuilds the sparse layers and loads the tensors strictly:
nothing is unpickled and no checkpoint code runs.

The FFN of an HF block is called with the hidden states only; the padding mask (for the mean
over real tokens that routes a CSE sequence, and Switch's real tokens) and DEMix's domain labels
reach the sparse layers through a context that :meth:`SparseHF.forward` (or a direct call of
``model.hf(..., attention_mask=..., domains=...)``, by a pre-hook that takes ``domains`` off
the call: how a ``Trainer`` batch with a ``domains`` column routes DEMix) sets for the call.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_model as _load_tensors_into
from safetensors.torch import save_model as _save_tensors_of
from tokenizers import Tokenizer

from cse_models.config import SparseConfig
from cse_models.experts import sequence_embedding
from cse_models.hf_weights import load_named, saved_names
from cse_models.hf_modules import HFAttentionExpert, HFExpert, HFSparseAttention, HFSparseFFN
from cse_models.model import (CONFIG_NAME, WEIGHTS_NAME, SparseRouting, TransformerLM, sparse_layer_of,
                              check_expert_copies, load_model)
from ntkscope.core.checks import MissingInput, UserError, check_path
from ntkscope.core.columns import batch_columns
from ntkscope.core.files import atomic_path, check_safetensors, read_json_object, write_json
from ntkscope.core.lm import lm_loss
from ntkscope.core.pretrained import from_config, from_pretrained

SECTION = "cse_sparse"  # the config.json key of a converted model
#: the model type of a converted model's config.json: transformers reads it only after
#: ``import cse_models`` (:mod:`cse_models.hf_auto`), and plain transformers refuses it naming it
MODEL_TYPE = "cse_models_sparse"
LEGACY_WEIGHTS = "pytorch_model.bin"  # a dense checkpoint's older weights file (read with weights_only=True)
log = logging.getLogger(__name__)


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")  # a layout's child-module names: never a dunder or a private


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its blocks (a dotted path from the ``*ForCausalLM`` / ``*ForMaskedLM``
    model) and the feed-forward module inside a block (an attribute name). ``ffn_out``: where the
    FFN's output projection sits apart from it (a dotted path in the block: an encoder's
    ``intermediate`` / ``output.dense`` split, whose ``output`` adds the residual and normalises);
    each expert then holds both, and the block keeps an identity at ``ffn_out``. ``attn``: the
    attention module inside a block (MoA: ``sparse.module = "attn"``)."""

    blocks: str
    ffn: str = "mlp"
    ffn_out: str | None = None
    attn: str = "self_attn"

    def __post_init__(self):  # data, not code: names of child modules, never a dunder, a class or a tensor
        for field, dotted in (("blocks", True), ("ffn", False), ("ffn_out", True), ("attn", False)):
            value = getattr(self, field)
            if value is None and field == "ffn_out":
                continue
            parts = value.split(".") if isinstance(value, str) else [None]
            if not all(isinstance(p, str) and _NAME.fullmatch(p) for p in parts) or (len(parts) > 1 and not dotted):
                raise UserError(f"Layout: {field} must be {'a dotted path of' if dotted else 'one'} child-module "
                                f"name{'s' if dotted else ''} (letters, digits and _, not beginning with _; got "
                                f"{value!r})")

    @classmethod
    def from_dict(cls, data, where: str) -> "Layout":
        """A saved layout (a sparse config's ``layout``), its keys and values checked; ``where``
        (the file, as the user knows it) begins any message."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or "blocks" not in data or set(data) - fields:
            extra = sorted(set(data) - fields) if isinstance(data, dict) else None
            raise UserError(f"{where}: layout must be a mapping with blocks and any of {sorted(fields - {'blocks'})} "
                            f"(got {'unknown keys ' + repr(extra) if extra else repr(data)[:120]})")
        try:
            return cls(**data)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None


LAYOUTS: dict[str, Layout] = {
    "gpt2": Layout("transformer.h", attn="attn"),
    "gpt_neox": Layout("gpt_neox.layers", attn="attention"),
    **{t: Layout("model.layers") for t in ("llama", "mistral", "qwen2", "olmo", "olmo2")},
    "bert": Layout("bert.encoder.layer", "intermediate", "output.dense", attn="attention"),
    "roberta": Layout("roberta.encoder.layer", "intermediate", "output.dense", attn="attention"),
}
MASK_TOKENS = ("[MASK]", "<mask>")  # a masked LM's mask token, when its config does not name its id


def child_module(obj: nn.Module, dotted: str) -> nn.Module:
    """The child module at ``dotted`` (each step a child of the last: never a class, a method,
    a tensor or any other attribute)."""
    for part in dotted.split("."):
        child = obj._modules.get(part) if isinstance(obj, nn.Module) else None
        if child is None:
            children = sorted(obj._modules)[:12] if isinstance(obj, nn.Module) else []
            raise UserError(f"Layout: {dotted!r} is not a path of child modules of this {type(obj).__name__} "
                            f"(at {part!r}; its children: {children})")
        obj = child
    return obj


def check_layout(model: nn.Module, layout: Layout, *, attention: bool = False) -> None:
    """Refuse ``layout`` unless every path it uses is a child module of ``model`` (blocks) or of
    each block (ffn and ffn_out; attn with ``attention``, MoA), before anything is replaced."""
    blocks = child_module(model, layout.blocks)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or not len(blocks):
        raise UserError(f"Layout: blocks {layout.blocks!r} must name a list of blocks (got a {type(blocks).__name__})")
    for block in blocks:
        for path in (layout.ffn, layout.attn if attention else None, layout.ffn_out):
            if path is not None:
                child_module(block, path)


def saved_layout(section: dict, model_type, where: str) -> Layout:
    """The layout of a saved sparse config (``cse_sparse``): checked as data, and for a family of
    :data:`LAYOUTS` equal to the family's own."""
    if not isinstance(section, dict):
        raise UserError(f"{where}: the sparse section must be a mapping (got {type(section).__name__})")
    known = LAYOUTS.get(model_type)
    data = section.get("layout")
    if known is not None and isinstance(data, dict):  # a field an older file lacks is the family's own
        data = {**dataclasses.asdict(known), **data}
    layout = Layout.from_dict(data, where)
    if known is not None and layout != known:
        raise UserError(f"{where}: layout must be the {model_type} family's {dataclasses.asdict(known)} "
                        f"(got {dataclasses.asdict(layout)})")
    return layout


def layout_blocks(model: nn.Module, layout: Layout) -> list:
    """The blocks of an HF model, by ``layout``."""
    return list(child_module(model, layout.blocks))


def is_masked_lm(hf_model: nn.Module) -> bool:
    """A ``transformers`` masked LM (``*ForMaskedLM``), not a causal one."""
    return type(hf_model).__name__.endswith("ForMaskedLM")


def require_transformers():
    try:
        import transformers  # optional: pip install 'ntkscope[hf]'
    except ImportError:
        raise UserError("SparseHF: an HF model needs transformers (pip install 'ntkscope[hf]')") from None
    return transformers


@contextlib.contextmanager
def quiet_loading():
    """transformers' weight-loading bars off for the duration (a small load needs none, and the
    command line's -q means quiet); restored afterwards."""
    logging_ = require_transformers().utils.logging
    bars = logging_.is_progress_bar_enabled()
    logging_.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging_.enable_progress_bar()


@dataclass
class HFSparseConfig:
    """What the training loop and the conversions read of a :class:`SparseHF`: the HF config
    underneath, its layout, width, context length and vocabulary, and the sparse layers."""

    hf: object
    layout: Layout
    sparse: SparseConfig | None = None
    masked: bool = False

    @property
    def model_type(self) -> str:
        """"bert" for a masked LM (trained and evaluated on masked tokens, as our BERT), else
        "hf-causal"."""
        return "bert" if self.masked else "hf-causal"

    @property
    def mask_token_id(self) -> int | None:
        """A masked LM's mask token (its config's ``mask_token_id``, set on loading from the
        tokenizer beside it when the config has none)."""
        value = getattr(self.hf, "mask_token_id", None)
        return None if value is None else int(value)

    @property
    def n_embd(self) -> int:
        return int(self.hf.hidden_size)

    @property
    def n_layer(self) -> int:
        return int(self.hf.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.vocab_size)

    @property
    def block_size(self) -> int:
        size = int(getattr(self.hf, "max_position_embeddings", None) or getattr(self.hf, "n_positions"))
        if self.hf.model_type == "roberta":  # positions start after the padding index
            size -= int(self.hf.pad_token_id or 0) + 1
        return size

    def section(self) -> dict:
        """The ``cse_sparse`` section of config.json."""
        return {"layout": dataclasses.asdict(self.layout), "masked": self.masked,
                "sparse": None if self.sparse is None else dataclasses.asdict(self.sparse)}


class SparseHF(SparseRouting, nn.Module):
    """An HF causal or masked LM whose chosen blocks' FFNs may be CSE, Switch or DEMix layers.

    ``forward(input_ids (B, T), attention_mask (B, T) | None, domains (B,) | None) -> logits
    (B, T, V)``; with ``positions`` / ``targets`` as :meth:`cse_models.TransformerLM.forward`
    (the summed next-token cross-entropy, a scalar; causal models only). ``hf`` is the wrapped model; ``sparse``
    (a :class:`~cse_models.SparseConfig` or dict, kind any, module "ffn" or "attn") says which layers
    become sparse; layers with experts (n_experts > 0) are built empty, ready for a state dict.
    """

    def __init__(self, hf_model: nn.Module, sparse: SparseConfig | dict | None = None,
                 layout: Layout | None = None):
        super().__init__()
        model_type = getattr(hf_model.config, "model_type", None)
        layout = layout or LAYOUTS.get(model_type)
        if layout is None:
            raise UserError(f"SparseHF: no layout for HF model_type {model_type!r} (known: {sorted(LAYOUTS)}); "
                            "add one Layout to cse_models.hf.LAYOUTS")
        if isinstance(sparse, dict):  # a copy: conversion fills in n_experts, never the caller's lists
            sparse = SparseConfig(**copy.deepcopy(sparse))
        check_layout(hf_model, layout, attention=sparse is not None and getattr(sparse, "module", None) == "attn")
        self.hf = hf_model
        self.config = HFSparseConfig(hf_model.config, layout, sparse, masked=is_masked_lm(hf_model))
        if sparse is not None:
            sparse.check(self.config.n_layer)
        self._context: dict = {}
        self._columns = batch_columns(self.hf, "domains")  # a direct call's labels (a Trainer batch column)
        self.hf.register_forward_pre_hook(self._capture_mask, with_kwargs=True)
        self.hf.register_forward_hook(self._release_domains, always_call=True)
        layers = [i for i in (sparse.layers if sparse is not None else ()) if sparse.experts_at(i) > 0]
        check_expert_copies([(self.sparse_module(i), sparse.experts_at(i)) for i in layers],
                            f"SparseHF: sparse.n_experts {sparse.n_experts if sparse is not None else None}")
        for i in layers:
            self.replace_sparse_module(i, sparse_layer_of(self.config, self.sparse_module(i), sparse.experts_at(i)))

    def _capture_mask(self, _module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._context["key_mask"] = None if mask is None else key_padding_mask(mask)
        if "domains" in self._columns.current:  # a direct call (a Trainer batch): the labels DEMix routes by
            self._context["domains"], self._context["direct_domains"] = self._columns.current["domains"], True

    def _release_domains(self, _module, _args, _output):
        if self._context.pop("direct_domains", False):
            self._context.pop("domains", None)

    # ---- the FFN of a block ---------------------------------------------------------------

    def block(self, layer: int) -> nn.Module:
        return layout_blocks(self.hf, self.config.layout)[layer]

    def _attention(self) -> bool:
        return self.config.sparse is not None and self.config.sparse.module == "attn"

    def sparse_module(self, layer: int) -> nn.Module:
        """The FFN (or, MoA, the attention) of block ``layer``: its sparse layer, or the dense
        module as an expert."""
        block, layout = self.block(layer), self.config.layout
        if self._attention():
            attn = child_module(block, layout.attn)
            return attn.layer if isinstance(attn, HFSparseAttention) else HFAttentionExpert(attn)
        ffn = child_module(block, layout.ffn)
        if isinstance(ffn, HFSparseFFN):
            return ffn.layer
        return HFExpert(ffn, None if layout.ffn_out is None else child_module(block, layout.ffn_out))

    def replace_sparse_module(self, layer: int, module: nn.Module) -> None:
        block, layout = self.block(layer), self.config.layout
        if self._attention():  # experts that see part of the batch cannot share one key-value cache
            setattr(block, layout.attn, HFSparseAttention(module, self._context))
            self.hf.config.use_cache = False
            if getattr(self.hf, "generation_config", None) is not None:
                self.hf.generation_config.use_cache = False
            return
        setattr(block, layout.ffn, HFSparseFFN(module, self._context))
        if layout.ffn_out is not None:  # the experts hold the output projection now
            owner, _, name = layout.ffn_out.rpartition(".")
            setattr(child_module(block, owner) if owner else block, name, nn.Identity())

    @torch.no_grad()
    def module_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers,
                      module: str = "ffn", *, chunk: int = 256) -> dict[int, torch.Tensor]:
        """Sequence embeddings (B, d): the mean over real tokens of each layer's FFN input (or,
        ``module="attn"``, its attention's input)."""
        if module not in ("ffn", "attn"):
            raise UserError(f"SparseHF.module_inputs: module must be 'ffn' or 'attn' (got {module!r})")
        captured: dict[int, list] = {i: [] for i in layers}
        where = self.config.layout.ffn if module == "ffn" else self.config.layout.attn

        def capture(i, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            captured[i].append(sequence_embedding(x, self._context.get("key_mask")))

        hooks = [child_module(self.block(i), where).register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: capture(i, args, kwargs), with_kwargs=True) for i in layers]
        try:
            for start in range(0, input_ids.shape[0], chunk):
                ids = input_ids[start:start + chunk]
                am = None if attention_mask is None else attention_mask[start:start + chunk]
                domains = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
                self(ids, am, domains)
        finally:
            for h in hooks:
                h.remove()
        return {i: torch.cat(parts) for i, parts in captured.items()}

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                domains: torch.Tensor | None = None, positions: slice | None = None,
                targets: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of ``input_ids`` (B, T) (``positions``: a slice of them; with
        ``targets``, the summed next-token loss instead). ``position_ids`` (B, T): passed to the
        model underneath (e.g. from a left-padded batch's mask, as generation does); default its own."""
        T = input_ids.shape[1]
        if T > self.config.block_size:
            raise UserError(f"SparseHF.forward: input_ids has {T} positions, more than the model's "
                            f"context of {self.config.block_size}")
        if targets is not None and self.config.masked:
            raise UserError("SparseHF.forward: targets are next tokens; a masked LM's loss is over its masked "
                            "tokens (take the logits)")
        self._context["domains"] = domains
        try:
            extra = {} if position_ids is None else {"position_ids": position_ids}
            if not self.config.masked:
                extra["use_cache"] = False
            logits = self.hf(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
        finally:
            self._context.clear()
        logits = logits if positions is None else logits[:, positions]
        if targets is None:
            return logits
        return lm_loss(logits if logits.dtype == torch.float64 else logits.float(), targets, reduction="sum")

    # ---- checkpoints ------------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """A dense model (no sparse layers named) as a plain HF checkpoint of its family
        (``transformers``' own ``save_pretrained``, safetensors). Else ``config.json`` of model
        type :data:`MODEL_TYPE` (the base config under ``base``, the
        ``cse_sparse`` section) and ``model.safetensors`` (tied weights once), each written
        atomically: ``transformers.AutoModelForCausalLM.from_pretrained`` (``AutoModelForMaskedLM``
        for a masked LM) reads it after ``import cse_models``, and refuses it without."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.config.sparse is None:
            self.hf.save_pretrained(directory, safe_serialization=True)
            return directory
        with atomic_path(directory / WEIGHTS_NAME) as tmp:
            _save_tensors_of(self, str(tmp), metadata={"format": "pt"})
        write_json(directory / CONFIG_NAME, self.config_json())
        return directory

    def config_json(self) -> dict:
        """The ``config.json`` of the sparse format (:meth:`save_pretrained`); a ``Trainer``
        checkpoint written after a conversion gets it too (:class:`~cse_models.hf_trainer.
        SparseCallback`), beside its weights under the HF model's own names."""
        kind = "MaskedLM" if self.config.masked else "CausalLM"
        loading = f"import cse_models, then transformers.AutoModelFor{kind}.from_pretrained(this directory)"
        base = self.config.hf.to_dict()
        return {
            "model_type": MODEL_TYPE, "architectures": [f"SparseFor{kind}"],
            # the base config's model type apart from it: a concrete class (GPT2LMHeadModel.from_pretrained)
            # would take a sub-dict of its own type as its config and load random weights; it reads the
            # top level instead, validates vocab_size and refuses this text, which names cse_models
            "base_model_type": base.pop("model_type", None), "base": base, SECTION: self.config.section(),
            "loading": loading, "vocab_size": f"a cse_models sparse model: {loading}"}


def key_padding_mask(mask: torch.Tensor) -> torch.Tensor:
    """The (B, T) key padding mask (True: a real token) of an HF call's ``attention_mask``: a
    (B, T) 0/1 mask as it is; a (B, 1, T, T) "may attend" mask (boolean, or additive floats: 0
    where a query may attend) read off its pattern, since a sparse layer routes each sequence by
    its real tokens. Read exactly from masks in which padding attends to itself at most and is
    attended by no other position (:func:`ntkscope.kernel.objectives.hf_mask_4d`'s, which the
    kernels pass): a position is real when its query attends to another key or another query
    attends to it; a row where no position passes (one real token) keeps its first position
    (right padding). Other 4-D masks (HF's own, where pad queries see real keys) read every
    position as real: give a sparse model the (B, T) padding mask."""
    if mask.dim() == 2:
        return mask.bool()
    if mask.dim() != 4:
        raise UserError(f"SparseHF: attention_mask must be (B, T) or (B, 1, T, T) (got shape {tuple(mask.shape)})")
    allowed = mask.bool() if mask.dtype == torch.bool else mask == 0
    allowed = allowed.any(dim=1)  # (B, T, T): query, key
    T = allowed.shape[-1]
    off = allowed & ~torch.eye(T, dtype=torch.bool, device=allowed.device)
    real = off.any(dim=1) | off.any(dim=2)
    first = torch.arange(T, device=real.device) == 0
    return real | (~real.any(dim=1, keepdim=True) & first)  # no branch on values: vmap traces it


def flat_config(data: dict) -> dict:
    """A checkpoint's config.json as the base HF config with the ``cse_sparse`` section beside it,
    from either format (model type :data:`MODEL_TYPE`, or the older one that
    was the base config itself with the section added)."""
    if data.get("model_type") == MODEL_TYPE:
        base = dict(data.get("base") or {})
        if data.get("base_model_type"):  # saved apart from base (save_pretrained's guard against concrete classes)
            base["model_type"] = data["base_model_type"]
        return {**base, SECTION: data.get(SECTION)}
    return data


def _hf_config(directory: Path, func: str):
    transformers = require_transformers()
    data = flat_config(read_json_object(directory / CONFIG_NAME, func))
    data.pop(SECTION, None)
    model_type = data.get("model_type")
    if model_type not in LAYOUTS:
        raise UserError(f"{func}: {directory} holds an HF {model_type!r} model; sparse layers are supported for "
                        f"{sorted(LAYOUTS)}")
    data.pop("auto_map", None)  # never custom code
    return transformers, transformers.AutoConfig.for_model(**data)


def block_count(directory: str | os.PathLike, func: str = "block_count") -> int:
    """The block count of the HF model in ``directory`` (its config.json, a layout this module
    supports; nothing loaded)."""
    return int(_hf_config(Path(directory), func)[1].num_hidden_layers)


def _mask_token_id(directory: Path, hf_config) -> None:
    """A masked LM's mask token id onto ``hf_config`` when it names none: the tokenizer's
    (``tokenizer.json`` beside the weights, by the mask token ``tokenizer_config.json`` names, else
    ``[MASK]`` / ``<mask>``). Left unset when there is no tokenizer (training then asks for one)."""
    if getattr(hf_config, "mask_token_id", None) is not None or not (directory / "tokenizer.json").is_file():
        return
    names = list(MASK_TOKENS)
    if (directory / "tokenizer_config.json").is_file():
        named = read_json_object(directory / "tokenizer_config.json", "load_hf").get("mask_token")
        named = named.get("content") if isinstance(named, dict) else named
        names = [named, *names] if isinstance(named, str) else names
    vocab = Tokenizer.from_file(str(directory / "tokenizer.json"))
    found = [vocab.token_to_id(name) for name in names if vocab.token_to_id(name) is not None]
    if found:
        hf_config.mask_token_id = int(found[0])


def load_hf(directory: str | os.PathLike, sparse: SparseConfig | dict | None = None) -> SparseHF:
    """An HF causal or masked LM directory (``config.json`` + ``model.safetensors``) as a
    :class:`SparseHF` in eval mode: a converted one with its sparse layers, or a dense one with
    ``sparse`` (layers listed, 0 experts: dense until converted). Missing or unexpected tensors are refused (tied
    weights the HF way accepted); a dense checkpoint with only ``pytorch_model.bin`` is read with
    ``torch.load(weights_only=True)``: tensors only, no checkpoint code runs."""
    func = "load_hf"
    check_path("directory", directory, func=func)
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        raise MissingInput(f"{func}: {directory} has no {CONFIG_NAME} (an HF model directory)")
    saved = read_json_object(directory / CONFIG_NAME, func)
    section = flat_config(saved).get(SECTION)
    legacy = section is None and not (directory / WEIGHTS_NAME).is_file() and (directory / LEGACY_WEIGHTS).is_file()
    if not legacy and not (directory / WEIGHTS_NAME).is_file():
        raise MissingInput(f"{func}: {directory} has no {WEIGHTS_NAME}" + (
            "" if section is not None else f" or {LEGACY_WEIGHTS}") + " (an HF model directory)")
    if section is not None and saved.get("model_type") != MODEL_TYPE:
        log.warning("%s: %s was saved by an older cse_models (transformers' Auto classes would build a random model "
                    "from it); re-save it: cse_models.load_hf(DIR).save_pretrained(DIR)", func, directory)
    if section is not None and sparse is not None:
        raise UserError(f"{func}: {directory} is a converted model already ({section['sparse']['kind']}); "
                        "convert a dense checkpoint")
    transformers, hf_config = _hf_config(directory, func)
    masked = bool(section.get("masked")) if section is not None else "MaskedLM" in str(saved.get("architectures"))
    auto = transformers.AutoModelForMaskedLM if masked else transformers.AutoModelForCausalLM
    if masked:
        _mask_token_id(directory, hf_config)
    if legacy:  # transformers reads it with torch.load(weights_only=True): tensors only, never pickled code
        log.info("%s: %s holds %s only: read with torch.load(weights_only=True)", func, directory, LEGACY_WEIGHTS)
    else:
        check_safetensors(directory / WEIGHTS_NAME, func)
    if section is None:  # a dense checkpoint, loaded the HF way (which ties the head to the embedding)
        try:
            with quiet_loading():
                hf, info = from_pretrained(auto, directory, func, config=hf_config, use_safetensors=not legacy,
                                           output_loading_info=True)
        except pickle.UnpicklingError as err:
            raise UserError(f"{func}: {directory / LEGACY_WEIGHTS} holds more than tensors; it is not loaded, since "
                            f"that would run pickled code ({str(err).splitlines()[0][:160]})") from None
        except (RuntimeError, ValueError, OSError) as err:
            raise UserError(f"{func}: the weights in {directory} do not match its config.json "
                            f"({str(err).splitlines()[0][:200]})") from None
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        model = SparseHF(hf, sparse)
    else:
        layout = saved_layout(section, hf_config.model_type, f"{func}: {directory / CONFIG_NAME}")
        model = SparseHF(from_config(auto, hf_config, func), section["sparse"], layout)
        names = saved_names(directory / WEIGHTS_NAME)
        try:
            if names and not any(k.startswith("hf.") for k in names):  # a Trainer checkpoint: the HF model's names
                missing, unexpected = load_named(model.hf, directory / WEIGHTS_NAME)
            else:
                missing, unexpected = _load_tensors_into(model, str(directory / WEIGHTS_NAME), strict=False)
        except RuntimeError as err:
            raise UserError(f"{func}: the weights in {directory} do not match its config.json "
                            f"({str(err).splitlines()[0][:200]})") from None
    if missing or unexpected:
        raise UserError(f"{func}: the weights in {directory} do not match its config.json "
                        f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
    return model.eval()


def architecture(model) -> dict:
    """What a plan measured on ``model`` records of it, and what a training that applies the plan
    compares: ``model_type`` (an HF config's, or "gpt" / "bert" for ``cse_models``), ``n_layer``
    and ``n_embd``."""
    if isinstance(model, TransformerLM):
        config = model.config
        return {"model_type": config.model_type, "n_layer": int(config.n_layer), "n_embd": int(config.n_embd)}
    config = (model.hf if isinstance(model, SparseHF) else model).config  # transformers
    return {"model_type": config.model_type, "n_layer": int(config.num_hidden_layers),
            "n_embd": int(config.hidden_size)}


def load_any_model(directory: str | os.PathLike, sparse: SparseConfig | dict | None = None):
    """A ``cse_models`` checkpoint (:class:`~cse_models.TransformerLM`), or an HF causal or masked LM of a known
    layout as a :class:`SparseHF` (converted, or dense with ``sparse`` to convert later)."""
    check_path("directory", directory, func="load_any_model")
    directory = Path(directory)
    data = read_json_object(directory / CONFIG_NAME, "load_model") if (directory / CONFIG_NAME).is_file() else {}
    own = data.get("model_type") in ("gpt", "bert") and "architectures" not in data  # cse_models' GPT / BERT
    if SECTION in data or "architectures" in data or (data.get("model_type") in LAYOUTS and not own):
        return load_hf(directory, sparse)
    return load_model(directory)
