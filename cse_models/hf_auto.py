"""Sparse HF checkpoints as transformers models: after ``import cse_models``,
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` on a directory that
:meth:`cse_models.SparseHF.save_pretrained` wrote returns the sparse model with its weights,
and ``generate()`` and ``pipeline("text-generation")`` run on it; a sparse encoder (BERT,
RoBERTa) is read by ``AutoModelForMaskedLM`` the same way (``pipeline("fill-mask")``). Each
Auto class refuses the other kind's directory in one line.

The directory's ``config.json`` has a model type of its own, :data:`~cse_models.hf.MODEL_TYPE`
(``"cse_models_sparse"``), with the base model's whole config under ``base`` and the sparse
layers under ``cse_sparse``. Plain transformers, without ``cse_models``, does not know that type
and refuses the directory with an error that names it, so it never builds a random model.

Registration costs nothing at ``import cse_models``: the Auto classes are registered when
transformers' ``modeling_auto`` module is first imported (a one-shot import hook), or at once
when it already is. Loading goes through :func:`cse_models.hf.load_hf`: strict, safetensors,
no checkpoint code.

How CSE routes while generating: a CSE layer routes each sequence by the mean of its FFN
input over the sequence's tokens, as in training. :class:`SparseForCausalLM` therefore runs
without a key-value cache, so each generated token is predicted with the whole sequence so
far (prompt and continuation) routed as one; a Switch layer routes per token either way.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

import torch

from cse_models.hf import MODEL_TYPE, SparseHF, load_hf, require_transformers, saved_layout
from ntkscope.core.checks import UserError
from ntkscope.core.pretrained import from_config

log = logging.getLogger(__name__)

_AUTO = "transformers.models.auto.modeling_auto"
_classes: dict = {}


def classes() -> tuple:
    """(SparseCausalLMConfig, SparseForCausalLM, SparseForMaskedLM), built on first use (they
    subclass transformers')."""
    if _classes:
        return _classes["config"], _classes["model"], _classes["masked"]
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel  # optional; on first use
    from transformers.modeling_outputs import CausalLMOutputWithPast, MaskedLMOutput  # as above

    class SparseCausalLMConfig(PretrainedConfig):
        """A sparse model's config: ``base`` (the base HF model's config, a dict) and
        ``cse_sparse`` (the layout and :class:`~cse_models.SparseConfig`)."""

        model_type = MODEL_TYPE

        def __init__(self, base: dict | None = None, cse_sparse: dict | None = None, base_model_type=None, **kwargs):
            if isinstance(kwargs.get("vocab_size"), str):  # save_pretrained's guard against concrete classes
                kwargs.pop("vocab_size")
            kwargs.setdefault("use_cache", False)
            super().__init__(**kwargs)
            self.base = dict(base or {})
            if base_model_type and "model_type" not in self.base:
                self.base["model_type"] = base_model_type
            self.cse_sparse = cse_sparse
            for key in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings",
                        "bos_token_id", "eos_token_id", "pad_token_id"):
                if key in self.base and getattr(self, key, None) is None:
                    setattr(self, key, self.base[key])

    class _SparsePreTrained(PreTrainedModel):
        """What both kinds share: the wrapped :class:`~cse_models.SparseHF` (``sparse``; its
        ``hf`` is this model's ``hf``), loading through :func:`cse_models.hf.load_hf` and saving in
        :meth:`~cse_models.SparseHF.save_pretrained`'s format."""

        config_class = SparseCausalLMConfig
        base_model_prefix = "hf"
        main_input_name = "input_ids"
        masked = False

        def __init__(self, config, sparse=None):
            super().__init__(config)
            if sparse is None:  # from a config alone: the base model at random, its sparse layers empty
                transformers = require_transformers()
                auto = transformers.AutoModelForMaskedLM if self.masked else transformers.AutoModelForCausalLM
                base = from_config(auto, transformers.AutoConfig.for_model(**config.base), "from_config")
                section = config.cse_sparse or {}
                layout = saved_layout(section, config.base.get("model_type"), "from_config: cse_sparse") if section \
                    else None
                sparse = SparseHF(base, section.get("sparse"), layout)
            self.hf = sparse.hf
            object.__setattr__(self, "sparse", sparse)  # not a second submodule: its parameters are self.hf's

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
            """The directory through :func:`cse_models.hf.load_hf` (strict, safetensors, no code);
            ``dtype`` / ``torch_dtype`` and ``device_map`` (one device) are applied after."""
            dtype = _dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))
            device = _device(kwargs.get("device_map"))
            sparse = load_hf(pretrained_model_name_or_path)
            if sparse.config.masked != cls.masked:
                kind, other = ("a masked LM", "AutoModelForMaskedLM") if sparse.config.masked else \
                    ("a causal LM", "AutoModelForCausalLM")
                raise UserError(f"{cls.__name__}.from_pretrained: {pretrained_model_name_or_path} holds {kind}; "
                                 f"load it with transformers.{other}")
            model = cls(sparse_config(sparse), sparse)
            if dtype is not None:
                model = model.to(dtype)
            if device is not None:
                model = model.to(device)
            return model.eval()

        def save_pretrained(self, save_directory, *args, **kwargs):
            return self.sparse.save_pretrained(save_directory)

        def get_input_embeddings(self):
            return self.hf.get_input_embeddings()

        def get_output_embeddings(self):
            return self.hf.get_output_embeddings()

    class SparseForMaskedLM(_SparsePreTrained):
        """A sparse encoder (:class:`~cse_models.SparseHF` around a ``*ForMaskedLM``) as a
        transformers masked LM: ``forward(input_ids, attention_mask, labels, domains)`` ->
        ``MaskedLMOutput`` (logits (B, T, V), the mean loss over tokens whose label is not -100)."""

        masked = True

        def forward(self, input_ids=None, attention_mask=None, labels=None, domains=None, **kwargs):
            logits = self.sparse(input_ids, attention_mask, domains)
            loss = None
            if labels is not None:
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         labels.reshape(-1), ignore_index=-100)
            return MaskedLMOutput(loss=loss, logits=logits)

    class SparseForCausalLM(_SparsePreTrained, GenerationMixin):
        """A :class:`~cse_models.SparseHF` as a transformers causal LM: ``forward(input_ids,
        attention_mask, labels, domains)`` (``domains`` (B,): a DEMix model's labels) -> ``CausalLMOutputWithPast`` (logits (B, T, V), the mean
        next-token loss with ``labels``), ``generate`` without a key-value cache (module docstring),
        ``save_pretrained`` in :meth:`SparseHF.save_pretrained`'s format. ``sparse`` is the
        wrapped :class:`~cse_models.SparseHF`; its ``hf`` is this model's ``hf``."""

        _supports_cache_class = False

        def __init__(self, config, sparse=None):
            super().__init__(config, sparse)
            self.generation_config.use_cache = False

        def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
            """The whole sequence so far (no cache); with a mask, positions counted over the real
            tokens, so a left-padded prompt is placed as an unpadded one (transformers' rule)."""
            position_ids = None
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

        def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, domains=None, **kwargs):
            logits = self.sparse(input_ids, attention_mask, domains, position_ids=position_ids)
            loss = None
            if labels is not None:
                shift, target = logits[:, :-1].float(), labels[:, 1:]
                loss = torch.nn.functional.cross_entropy(shift.reshape(-1, shift.shape[-1]), target.reshape(-1),
                                                         ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    _classes.update(config=SparseCausalLMConfig, model=SparseForCausalLM, masked=SparseForMaskedLM)
    return SparseCausalLMConfig, SparseForCausalLM, SparseForMaskedLM


def _dtype(value):
    """``dtype`` / ``torch_dtype`` as transformers takes it: a torch dtype, its name
    ("bfloat16", "torch.float16"), or "auto" / None (the checkpoint's own)."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return None if value == "auto" else value
    found = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise UserError(f"SparseForCausalLM.from_pretrained: dtype must be a torch dtype or its name "
                         f"(e.g. 'bfloat16'), not {value!r}")
    return found


def _device(device_map):
    """``device_map`` on one device: a device or its name, a CUDA index, a dict whose values
    name one device, or "auto" (the first GPU, else the CPU); a model split across devices is
    refused (the sparse layers route whole sequences on one device)."""
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = {str(torch.device(v if not isinstance(v, int) else f"cuda:{v}")) for v in device_map.values()}
        if len(devices) != 1:
            raise UserError(f"SparseForCausalLM.from_pretrained: device_map must place the model on one device "
                             f"(the sparse layers route whole sequences), not {sorted(devices)}")
        return torch.device(devices.pop())
    if device_map == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device(f"cuda:{device_map}")
    try:
        return torch.device(device_map)
    except (RuntimeError, TypeError):
        raise UserError(f"SparseForCausalLM.from_pretrained: device_map must be a device, a CUDA index, a dict "
                         f"of one device or 'auto', not {device_map!r}") from None


def sparse_config(sparse) -> object:
    """The transformers config of a :class:`~cse_models.SparseHF`."""
    config_cls = classes()[0]
    return config_cls(base=sparse.config.hf.to_dict(), cse_sparse=sparse.config.section())


def register() -> None:
    """Register the config and model with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM  # optional; on first use

    config_cls, causal, masked = classes()
    for auto, args in ((AutoConfig, (MODEL_TYPE, config_cls)), (AutoModelForCausalLM, (config_cls, causal)),
                       (AutoModelForMaskedLM, (config_cls, masked))):
        try:
            auto.register(*args)
        except ValueError:  # already registered (a second import of this module's classes)
            pass


class _AfterAuto(importlib.abc.MetaPathFinder):
    """A one-shot import hook: once transformers' ``modeling_auto`` has run, :func:`register`."""

    busy = False

    def find_spec(self, name, path, target=None):
        """Wrap the loader of ``modeling_auto``; the hook stays until the module has run (a
        ``find_spec`` probe that imports nothing leaves it in place)."""
        if name != _AUTO or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return spec
        inner, finder = spec.loader, self

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                try:
                    register()
                except Exception as err:  # never break the user's transformers import
                    log.warning("cse_models: could not register the sparse models with transformers (%s: %s)",
                                type(err).__name__, err)

        spec.loader = Loader()
        return spec


def install() -> None:
    """Register now if transformers' Auto classes are loaded, else when they are."""
    if _AUTO in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None and not any(
            isinstance(f, _AfterAuto) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterAuto())
