"""Hugging Face files read without running their code and without the hub.

Every ``from_pretrained`` and ``from_config`` of a ``transformers`` class in ntkscope and
cse_models goes through :func:`from_pretrained` or :func:`from_config` (``tests/test_bad_input_security.py``
walks the code for any that does not). Both fix ``trust_remote_code=False`` (and the first
``local_files_only=True``): a checkpoint whose ``config.json`` or ``tokenizer_config.json``
names its own Python code (``auto_map``) is loaded with the library's class where transformers
has one, and refused in one line where it has none; its code is never imported, and
transformers never asks about it on standard input.
"""

from __future__ import annotations

from pathlib import Path

from ntkscope.core.checks import UserError

#: the keywords every load here fixes, and their values
FIXED = {"local_files_only": True, "trust_remote_code": False}


def _fixed(kwargs: dict, func: str, keys) -> dict:
    for key in keys:
        if key in kwargs and kwargs[key] != FIXED[key]:
            raise UserError(f"{func}: {key} is fixed at {FIXED[key]} (a checkpoint's code never runs here, and "
                            f"nothing is downloaded; got {kwargs[key]!r})")
    return {**kwargs, **{k: FIXED[k] for k in keys}}


def _refused(err: Exception, where, func: str) -> UserError | None:
    if isinstance(err, UserError):
        return None
    text = str(err)
    if "trust_remote_code" in text or "custom code" in text:
        return UserError(f"{func}: {where} names its own code (an auto_map in its config.json or "
                         "tokenizer_config.json) where transformers has no class of its own; ntkscope never runs a "
                         "checkpoint's code: use a model and tokenizer that transformers knows")
    return None


def from_pretrained(loader, path, func: str, **kwargs):
    """``loader.from_pretrained(path, **kwargs)`` with local files only and no remote code;
    ``func`` (the caller, as the user knows it) begins any message."""
    kwargs = _fixed(kwargs, func, ("local_files_only", "trust_remote_code"))
    try:
        return loader.from_pretrained(path, **kwargs)
    except ValueError as err:
        refused = _refused(err, Path(path), func)
        if refused is None:
            raise
        raise refused from None


def from_config(loader, config, func: str, **kwargs):
    """``loader.from_config(config, **kwargs)`` with no remote code (a config's ``auto_map``)."""
    kwargs = _fixed(kwargs, func, ("trust_remote_code",))
    try:
        return loader.from_config(config, **kwargs)
    except ValueError as err:
        refused = _refused(err, f"the config of {getattr(config, 'model_type', '?')!r}", func)
        if refused is None:
            raise
        raise refused from None
