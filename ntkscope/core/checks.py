"""Input errors and the checks that raise them.

Every message names the function, the argument, the rule and the value, in the style of
torch.func: ``empirical_ntk: chunk_size must be a positive integer (got 0)``.

Checks run at a public entry point and raise :class:`InputError` without knowing which
function called them; the entry point is decorated with :func:`entry`, which puts its name
in front of the message. Private helpers after the entry point assume valid input and never
carry the caller's name.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import numbers
import os
from typing import Any

import numpy as np

log = logging.getLogger("ntkscope")

_ENTERED = contextvars.ContextVar("ntkscope_entry", default=None)


def _shown(value: Any) -> str:
    shown = repr(value).replace("\n", " ")  # one line: a tensor's or a module's repr spans several
    return shown[:197] + "..." if len(shown) > 200 else shown


class UserError(ValueError):
    """A mistake in what the user gave (an argument, a file, a setting, the data), said in one line
    that names the function, what was wrong and the value. Both command lines (``ntkscope``,
    ``cse-train``/``cse-eval``) print it as one line and exit 1; any other exception is a bug in
    ntkscope or below it and keeps its traceback. A ``ValueError``, so code that catches those
    keeps working."""


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the user named is not there, or is not what it must be."""


class OutputExists(UserError, FileExistsError):
    """An output the user named exists and is not to be replaced without being asked."""


class MissingPackage(UserError, ImportError):
    """An optional package that the asked work needs is not installed (the message says which)."""


class InputError(UserError):
    """A bad argument: ``func: arg rule (got value)``; ``func`` is filled in by :func:`entry`."""

    def __init__(self, arg: str, rule: str, value: Any, func: str | None = None):
        super().__init__(arg, rule, value)
        self.arg, self.rule, self.value, self.func = arg, rule, value, func

    def __str__(self) -> str:
        text = f"{self.arg} {self.rule} (got {_shown(self.value)})"
        return f"{self.func}: {text}" if self.func else text


def fail(func: str, arg: str, rule: str, value: Any) -> InputError:
    """The InputError for ``func``'s argument ``arg`` that broke ``rule`` (for code that names itself)."""
    return InputError(arg, rule, value, func)


def entry(name: str):
    """Decorate a public function: an :class:`InputError` raised inside it, by a check or a
    helper, gets ``name`` as the function its message names. When one public function calls
    another, the outer one is named: it is the one the user called."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if _ENTERED.get() is not None:
                return fn(*args, **kwargs)
            token = _ENTERED.set(name)
            try:
                return fn(*args, **kwargs)
            except InputError as err:
                if err.func is None:
                    err.func = name
                raise
            finally:
                _ENTERED.reset(token)

        return inner

    return wrap


def check_positive_int(arg: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(arg, "must be a positive integer" + (" or None" if allow_none else ""), value)


def check_seed(value: Any, arg: str = "seed") -> None:
    """A random seed: a non-negative integer, a numpy one too (numpy's generators take no other)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(arg, "must be a non-negative integer", value)


def check_choice(arg: str, value: Any, choices) -> None:
    try:
        known = value in choices
    except (TypeError, ValueError, RuntimeError):  # unhashable (a list, a dict), or an array's truth value
        known = False
    if not known:
        raise InputError(arg, f"must be one of {sorted(choices)}", value)


def check_path(arg: str, value: Any, *, allow_none: bool = False, func: str | None = None) -> None:
    """A file or directory name: a str or an ``os.PathLike`` (a ``pathlib.Path``); None where allowed.
    ``func``: the function to name, for one that is not an :func:`entry`."""
    if value is None and allow_none:
        return
    if not isinstance(value, (str, os.PathLike)):
        raise InputError(arg, "must be a path (a str or a pathlib.Path)" + (" or None" if allow_none else ""),
                         type(value).__name__, func)


def as_numbers(arg: str, value: Any, *, ndim: int | None = None, what: str | None = None, func: str | None = None):
    """``value`` as a float64 numpy array (of ``ndim`` dimensions where given); else the InputError
    naming ``arg`` and saying it must be ``what`` (``func``: the function to name, for one that is
    not an :func:`entry`)."""
    what = what or ("a sequence of numbers" if ndim in (None, 1) else f"a {ndim}-dimensional array of numbers")
    try:
        out = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(arg, f"must be {what}", type(value).__name__, func) from None
    if ndim is not None and out.ndim != ndim:
        raise InputError(arg, f"must be {what}", f"{type(value).__name__} of shape {out.shape}", func)
    return out


def check_fraction(arg: str, value: Any) -> None:
    """0 < value < 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise InputError(arg, "must be a number strictly between 0 and 1", value)


def renamed_keys(data: dict, renames: dict, where: str, *, warn: bool = True) -> dict:
    """``data`` (a mapping of settings) with each old key of ``renames`` (old -> new) read under its
    new name; ``warn``: one warning line per old key met (a record written before the rename is
    read silently with ``warn=False``). Both names at once are refused: ``where: old and new ...``."""
    if not isinstance(data, dict) or not any(old in data for old in renames):
        return data
    out = dict(data)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise UserError(f"{where}: {old} and {new} are the same setting (the old name and the new); give {new} "
                            "only")
        out[new] = out.pop(old)
        if warn:
            log.warning("%s: %s is deprecated, read as %s; write %s", where, old, new, new)
    return out
