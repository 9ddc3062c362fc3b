"""Sparse HF checkpoints as transformers models: after ``import cse_models``,
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` on a directory that
:meth:`cse_models.SparseHF.save_pretrained` wrote returns the sparse model with its weights,
and ``generate()`` and ``pipeline("text-generation")`` run on it.

The directory's ``config.json`` has a model type of its own, :data:`MODEL_TYPE`
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

log = logging.getLogger(__name__)

MODEL_TYPE = "cse_models_sparse"
_AUTO = "transformers.models.auto.modeling_auto"
_classes: dict = {}


def classes() -> tuple:
    """(SparseCausalLMConfig, SparseForCausalLM), built on first use (they subclass transformers')."""
    if _classes:
        return _classes["config"], _classes["model"]
    import torch
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class SparseCausalLMConfig(PretrainedConfig):
        """A sparse model's config: ``base`` (the base HF model's config, a dict) and
        ``cse_sparse`` (the layout and :class:`~cse_models.SparseConfig`)."""

        model_type = MODEL_TYPE

        def __init__(self, base: dict | None = None, cse_sparse: dict | None = None, **kwargs):
            kwargs.setdefault("use_cache", False)
            super().__init__(**kwargs)
            self.base = dict(base or {})
            self.cse_sparse = cse_sparse
            for key in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings",
                        "bos_token_id", "eos_token_id", "pad_token_id"):
                if key in self.base and getattr(self, key, None) is None:
                    setattr(self, key, self.base[key])

    class SparseForCausalLM(PreTrainedModel, GenerationMixin):
        """A :class:`~cse_models.SparseHF` as a transformers causal LM: ``forward(input_ids,
        attention_mask, labels)`` -> ``CausalLMOutputWithPast`` (logits (B, T, V), the mean
        next-token loss with ``labels``), ``generate`` without a key-value cache (module docstring),
        ``save_pretrained`` in :meth:`SparseHF.save_pretrained`'s format. ``sparse`` is the
        wrapped :class:`~cse_models.SparseHF`; its ``hf`` is this model's ``hf``."""

        config_class = SparseCausalLMConfig
        base_model_prefix = "hf"
        main_input_name = "input_ids"
        _supports_cache_class = False

        def __init__(self, config, sparse=None):
            super().__init__(config)
            if sparse is None:  # from a config alone: the base model at random, its sparse layers empty
                from cse_models.hf import Layout, SparseHF, _transformers
                transformers = _transformers()
                base = transformers.AutoModelForCausalLM.from_config(
                    transformers.AutoConfig.for_model(**config.base), trust_remote_code=False)
                section = config.cse_sparse or {}
                sparse = SparseHF(base, section.get("sparse"), Layout(**section["layout"]) if section else None)
            self.hf = sparse.hf
            object.__setattr__(self, "sparse", sparse)  # not a second submodule: its parameters are self.hf's
            self.generation_config.use_cache = False

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
            """The directory through :func:`cse_models.hf.load_hf` (strict, safetensors, no code);
            ``dtype`` / ``torch_dtype`` and ``device_map`` (one device) are applied after."""
            from cse_models.hf import load_hf

            sparse = load_hf(pretrained_model_name_or_path)
            model = cls(sparse_config(sparse), sparse)
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
            if dtype is not None and dtype != "auto":
                model = model.to(dtype)
            device = kwargs.get("device_map")
            if isinstance(device, str) and device != "auto":
                model = model.to(device)
            return model.eval()

        def save_pretrained(self, save_directory, *args, **kwargs):
            return self.sparse.save_pretrained(save_directory)

        def get_input_embeddings(self):
            return self.hf.get_input_embeddings()

        def get_output_embeddings(self):
            return self.hf.get_output_embeddings()

        def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
            return {"input_ids": input_ids, "attention_mask": attention_mask}

        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            logits = self.sparse(input_ids, attention_mask)
            loss = None
            if labels is not None:
                shift, target = logits[:, :-1].float(), labels[:, 1:]
                loss = torch.nn.functional.cross_entropy(shift.reshape(-1, shift.shape[-1]), target.reshape(-1),
                                                         ignore_index=-100)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    _classes.update(config=SparseCausalLMConfig, model=SparseForCausalLM)
    return SparseCausalLMConfig, SparseForCausalLM


def sparse_config(sparse) -> object:
    """The transformers config of a :class:`~cse_models.SparseHF`."""
    config_cls, _ = classes()
    return config_cls(base=sparse.config.hf.to_dict(), cse_sparse=sparse.config.section())


def as_transformers(sparse):
    """A :class:`~cse_models.SparseHF` as a transformers model (:class:`SparseForCausalLM`),
    sharing its modules (no copy)."""
    _, model_cls = classes()
    return model_cls(sparse_config(sparse), sparse)


def register() -> None:
    """Register the config and model with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_cls, model_cls = classes()
    try:
        AutoConfig.register(MODEL_TYPE, config_cls)
        AutoModelForCausalLM.register(config_cls, model_cls)
    except ValueError:  # already registered (a second import of this module's classes)
        pass


class _AfterAuto(importlib.abc.MetaPathFinder):
    """A one-shot import hook: once transformers' ``modeling_auto`` has run, :func:`register`."""

    def find_spec(self, name, path, target=None):
        if name != _AUTO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
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
