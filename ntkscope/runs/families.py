"""Model families: everything ntkscope knows about a kind of model, one adapter each.

An adapter says how to recognise a family (from a loaded model or from its ``config.json``),
how to load a checkpoint directory, whether the model is causal or masked, where its layers
are and the named points inside a layer (for sequence embeddings), and its vocabulary size.
The kernel stage needs none of this (it works on any ``nn.Module``); checkpoint loading,
embeddings, the vocabulary check and the commands go through :func:`family_of` and
:func:`family_for_config`.

Supporting a new Hugging Face family is one :class:`Family` in :data:`FAMILIES` and its tests.
Families here: ``cse_models`` GPT/BERT; HF GPT-2, BERT and RoBERTa, GPT-NeoX (Pythia), the Llama layout
(Llama, Mistral, Qwen2, OLMo: pre-norm ``input_layernorm`` / ``post_attention_layernorm``
around ``self_attn`` / ``mlp``) and OLMo-2 (the same modules, normalised after each
sub-layer); any other ``transformers`` model loads and has a kernel, but no layer layout.
Where a causal family keeps its blocks and FFN is :data:`cse_models.hf.LAYOUTS` (the table the
sparse conversions use); each such family has a ``+sparse`` twin for its converted models.

Points (docs/design.md §3): ``"block"`` the block's output; ``"ffn_input"`` / ``"ffn_output"``
the feed-forward module's input / output; ``"attn_input"`` the attention module's input.
Each is ``(submodule path in the block or None for the block itself, read the module's input?)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

import cse_models
from cse_models.hf import LAYOUTS, SECTION, flat_config, layout_blocks, quiet_loading
from cse_models.model import build_model, load_weights
from ntkscope.core.checks import InputError, UserError
from ntkscope.core.files import check_safetensors
from ntkscope.core.memory import check_fits, parameter_count
from ntkscope.core.pretrained import from_config, from_pretrained
from ntkscope.kernel.objectives import is_huggingface
from ntkscope.runs.weights import load_state_dict

log = logging.getLogger(__name__)

POINTS = ("block", "ffn_input", "ffn_output", "attn_input")

_PRE_LN_POINTS = {"block": (None, False), "ffn_input": ("ln_2", False), "ffn_output": ("mlp", False),
                  "attn_input": ("ln_1", False)}
_BERT_POINTS = {"block": (None, False), "ffn_input": ("intermediate", True), "ffn_output": ("output", False),
                "attn_input": (None, True)}
# pre-norm HF decoders (GPT-NeoX, Llama layout): the two norms' outputs are the sub-layers' inputs
_DECODER_POINTS = {"block": (None, False), "ffn_input": ("post_attention_layernorm", False),
                   "ffn_output": ("mlp", False), "attn_input": ("input_layernorm", False)}
# OLMo-2 normalises each sub-layer's output: the sub-layers read the residual stream itself
_POST_NORM_POINTS = {"block": (None, False), "ffn_input": ("mlp", True), "ffn_output": ("mlp", False),
                     "attn_input": (None, True)}
LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "olmo")
ENCODERS = ("bert", "roberta")


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes
    ----------
    name : str
    is_model, is_config : callable
        ``model -> bool`` and ``config dict -> bool``: whether a loaded model / a config.json is of this family.
    load : callable
        ``(directory, config dict, weights file) -> nn.Module`` in eval mode.
    causal : callable
        ``model -> bool``: next-token (True) or masked (False) language model.
    blocks : callable or None
        ``model -> list of block modules``; None when the family has no layer layout here.
    points : dict
        Point name -> (submodule path in a block or None, whether the hook reads the input).
    vocab_size : callable
        ``model -> rows of the input embedding``.
    """

    name: str
    is_model: Callable
    is_config: Callable
    load: Callable
    causal: Callable
    blocks: Callable | None
    points: dict
    vocab_size: Callable


def _hf_vocab(model) -> int:
    return model.get_input_embeddings().num_embeddings


def _transformers():
    try:
        import transformers  # optional: pip install 'ntkscope[hf]'
    except ImportError:
        raise InputError("path", "holds an HF model; install transformers (pip install 'ntkscope[hf]') to "
                         "load it", "transformers missing") from None
    return transformers


def _load_hf(path: Path, data: dict, weights: Path):
    transformers = _transformers()
    architectures = str(data.get("architectures"))
    if data.get("model_type") == "gpt2" or "LMHead" in architectures or "CausalLM" in architectures:
        auto = transformers.AutoModelForCausalLM
    elif "MaskedLM" in architectures:
        auto = transformers.AutoModelForMaskedLM
    else:
        auto = transformers.AutoModel
    if data.get("auto_map"):
        log.warning("load_checkpoint: %s/config.json names custom code (auto_map); it is never run: the model is "
                    "built from transformers' own %r classes", path, data.get("model_type"))
    try:  # never the checkpoint's own code, and never a prompt asking whether to run it
        hf_config = from_pretrained(transformers.AutoConfig, path, "load_checkpoint")
        size = parameter_count(lambda: from_config(auto, hf_config, "load_checkpoint"))
    except UserError:  # the helper's own one line (a config naming code transformers has no class for)
        raise
    except Exception as err:  # sizes that are negative, text, ... (huggingface_hub's own validation error too)
        if not isinstance(err, (ValueError, KeyError, OSError, TypeError, RuntimeError)) \
                and "Validation" not in type(err).__name__:
            raise
        raise UserError(f"load_checkpoint: {path}/config.json is not a valid HF config "
                        f"({' '.join(str(err).split())[:160]})") from None
    check_fits(size, 4, f"load_checkpoint: {path}/config.json")
    if weights.suffix == ".safetensors":
        check_safetensors(weights, "load_checkpoint")
        try:
            with quiet_loading():
                model, info = from_pretrained(auto, path, "load_checkpoint", config=hf_config, use_safetensors=True,
                                              output_loading_info=True)
        except (RuntimeError, ValueError, OSError) as err:
            raise UserError(f"load_checkpoint: the weights in {path} do not match its config.json "
                            f"({str(err).splitlines()[0][:200]})") from None
        _check_loaded(path, info["missing_keys"], info["unexpected_keys"], info.get("mismatched_keys", []))
        return model.eval()
    model = from_config(auto, hf_config, "load_checkpoint")
    state = load_state_dict(weights)
    result = model.load_state_dict(state, strict=False)
    tied = {k for k in result.missing_keys if _is_tied(model, k)}  # a tied head saved the HF way: once
    if tied:
        model.tie_weights()
    _check_loaded(weights, sorted(set(result.missing_keys) - tied), result.unexpected_keys, [])
    return model.eval()


def _is_tied(model, key: str) -> bool:
    """Whether parameter ``key`` is the input embedding itself (a tied output head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return key in params and params[key] is model.get_input_embeddings().weight


def _check_loaded(where, missing, unexpected, mismatched) -> None:
    """Refuse weights that do not match the config, in one line naming them."""
    if missing or unexpected or mismatched:
        parts = [f"{what} {len(keys)} ({', '.join(sorted(map(str, keys))[:3])}{', ...' if len(keys) > 3 else ''})"
                 for what, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched))
                 if keys]
        raise UserError(f"load_checkpoint: the weights in {where} do not match its config.json: "
                        f"{'; '.join(parts)}")


def _load_cse(path: Path, data: dict, weights: Path):
    if weights.name == "model.safetensors":
        return cse_models.load_model(path).eval()
    model_cls = cse_models.BERT if data.get("model_type") == "bert" else cse_models.GPT
    model = build_model(model_cls.config_class.from_dict(data), f"load_checkpoint: {path}/config.json")
    return load_weights(model, load_state_dict(weights), "load_checkpoint", path).eval()


def _model_type(model) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _hf_family(name: str, model_types: tuple, blocks: Callable, points: dict) -> Family:
    """A causal HF decoder family recognised by its config's ``model_type``."""
    return Family(name, is_model=lambda m: is_huggingface(m) and _model_type(m) in model_types,
                  is_config=lambda d: d.get("model_type") in model_types, load=_load_hf, causal=lambda m: True,
                  blocks=blocks, points=points, vocab_size=_hf_vocab)


def _sparse_hf_family(base: Family, model_types: tuple) -> Family:
    """An HF model of ``base`` with CSE / Switch / DEMix layers (:class:`cse_models.SparseHF`):
    the same blocks and points, read through the wrapper; recognised by config.json's ``cse_sparse``."""
    return Family(f"{base.name}+sparse",
                  is_model=lambda m: isinstance(m, cse_models.SparseHF) and _model_type(m.hf) in model_types,
                  is_config=lambda d: SECTION in d and d.get("model_type") in model_types,
                  load=lambda path, data, weights: cse_models.load_hf(path), causal=lambda m: not m.config.masked,
                  blocks=lambda m: base.blocks(m.hf), points=base.points, vocab_size=lambda m: _hf_vocab(m.hf))


def _hf_blocks(model_type: str) -> Callable:
    """A family's blocks, where :data:`cse_models.hf.LAYOUTS` says they are."""
    return lambda m: layout_blocks(m, LAYOUTS[model_type])


def _bert_encoder(model):
    """The encoder of an HF BERT / RoBERTa (the bare model or one with a head)."""
    return getattr(model, "encoder", None) or getattr(getattr(model, "bert", None), "encoder", None) or \
        getattr(getattr(model, "roberta", None), "encoder", None)


FAMILIES: dict[str, Family] = {
    "cse_models": Family(
        "cse_models",
        is_model=lambda m: isinstance(m, cse_models.TransformerLM),
        is_config=lambda d: d.get("model_type") in ("gpt", "bert") and "architectures" not in d,
        load=_load_cse,
        causal=lambda m: m.config.model_type == "gpt",
        blocks=lambda m: list(m.transformer.h),
        points=_PRE_LN_POINTS,
        vocab_size=lambda m: m.transformer.wte.num_embeddings,
    ),
    "gpt2": Family(
        "gpt2",
        is_model=lambda m: is_huggingface(m) and hasattr(getattr(m, "transformer", None), "h"),
        is_config=lambda d: d.get("model_type") == "gpt2",
        load=_load_hf,
        causal=lambda m: True,
        blocks=_hf_blocks("gpt2"),
        points=_PRE_LN_POINTS,
        vocab_size=_hf_vocab,
    ),
    "bert": Family(
        "bert",
        is_model=lambda m: is_huggingface(m) and hasattr(_bert_encoder(m), "layer"),
        is_config=lambda d: d.get("model_type") in ENCODERS and "architectures" in d,
        load=_load_hf,
        causal=lambda m: False,
        blocks=lambda m: list(_bert_encoder(m).layer),
        points=_BERT_POINTS,
        vocab_size=_hf_vocab,
    ),
    "gpt_neox": _hf_family("gpt_neox", ("gpt_neox",), _hf_blocks("gpt_neox"), _DECODER_POINTS),
    "llama": _hf_family("llama", LLAMA_LAYOUT, _hf_blocks("llama"), _DECODER_POINTS),
    "olmo2": _hf_family("olmo2", ("olmo2",), _hf_blocks("olmo2"), _POST_NORM_POINTS),
    "hf": Family(  # any other transformers model: loads and has a kernel, but no layer layout here
        "hf",
        is_model=is_huggingface,
        is_config=lambda d: "architectures" in d or "model_type" in d,
        load=_load_hf,
        causal=lambda m: bool(getattr(m.config, "is_decoder", False) or "CausalLM" in type(m).__name__),
        blocks=None,
        points={},
        vocab_size=_hf_vocab,
    ),
}


# converted HF models first: their config.json names the base family's model_type too
FAMILIES = {"cse_models": FAMILIES["cse_models"],
            **{f"{name}+sparse": _sparse_hf_family(FAMILIES[name], types) for name, types in
               (("gpt2", ("gpt2",)), ("gpt_neox", ("gpt_neox",)), ("llama", LLAMA_LAYOUT), ("olmo2", ("olmo2",)),
                ("bert", ENCODERS))},
            **{k: v for k, v in FAMILIES.items() if k != "cse_models"}}


def family_of(model: nn.Module) -> Family:
    """The family of a loaded model."""
    for family in FAMILIES.values():
        if family.is_model(model):
            return family
    raise InputError("model", f"must be a model of a known family {sorted(FAMILIES)}", type(model).__name__)


def family_for_config(config: dict) -> Family | None:
    """The family a checkpoint's ``config.json`` (as a dict) names, or None."""
    config = flat_config(config)
    for family in FAMILIES.values():
        if family.is_config(config):
            return family
    return None


def layer_points(model: nn.Module, point: str) -> tuple[list, str | None, bool]:
    """(the model's blocks, the point's submodule path, read its input?) for ``point``."""
    family = family_of(model)
    if family.blocks is None or point not in family.points:
        with_layout = sorted(name for name, f in FAMILIES.items() if f.blocks is not None)
        raise InputError("model", f"must be of a family with a layer layout {with_layout}", type(model).__name__)
    path, use_input = family.points[point]
    return family.blocks(model), path, use_input
