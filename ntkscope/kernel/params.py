"""Which parameters: the columns of the Jacobian and how they group into blocks.

``select_parameters(model, params=None, blocks=None)`` resolves a user's choice
into a :class:`ParameterSelection`: the selected names in the model's order,
their shapes, their offsets in a flat parameter vector of length P, and the
blocks (named, contiguous ranges of that vector) whose NTKs add up to the whole:
``Theta = sum_b Theta_b``.

Tied parameters (GPT-2's ``wte`` and ``lm_head``) appear once, under their
first name, as ``model.named_parameters()`` lists them; the engine passes them
to ``torch.func.functional_call`` in that form (docs/design.md §6).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch.nn as nn

from ntkscope.core.checks import InputError, entry

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True)
class ParameterSelection:
    """Selected parameters, flattened in order, and their blocks.

    Attributes
    ----------
    names : tuple of str
        Selected parameter names, in ``model.named_parameters()`` order.
    shapes : tuple of torch.Size
    offsets : tuple of int
        Start of each parameter in the flat vector; ``offsets[i] + numel(shapes[i])``
        is its end.
    n_params : int
        P, the length of the flat vector (the number of Jacobian columns).
    blocks : dict of str to (start, stop)
        Contiguous column ranges, in order, covering ``[0, P)`` exactly once.
        A single block named ``"all"`` when no grouping was asked for.
    """

    names: tuple
    shapes: tuple
    offsets: tuple
    n_params: int
    blocks: dict

    @property
    def block_names(self) -> list:
        return list(self.blocks)


def _layer_key(name: str) -> str:
    """Module path up to and including the first integer component, else the owning module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _expert_key(name: str) -> str:
    """Module path up to the deepest integer component: one block per expert of a ModuleList."""
    parts = name.split(".")
    last = None
    for i, part in enumerate(parts[:-1]):
        if _INDEX.match(part):
            last = i
    return ".".join(parts[: last + 1]) if last is not None else _layer_key(name)


_GROUPINGS: dict = {
    "param": lambda name: name,
    "layer": _layer_key,
    "expert": _expert_key,
}


def _match_globs(arg: str, patterns: Sequence[str], names: Sequence[str]) -> list:
    chosen = []
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise InputError(arg, f"has a pattern that matches no parameter (available: {sample})", pattern)
        chosen.extend(hits)
    keep = set(chosen)
    return [n for n in names if n in keep]


@entry("select_parameters")
def select_parameters(
    model: nn.Module,
    params=None,
    blocks=None,
) -> ParameterSelection:
    """Resolve which parameters the Jacobian is taken over, and their blocks.

    Parameters
    ----------
    model : nn.Module
    params : None, str, sequence of str, nn.Module or sequence of nn.Module
        ``None``: every parameter with ``requires_grad``. A string or strings are
        ``fnmatch`` globs on parameter names (``"transformer.h.1.*"``); each must
        match at least one parameter. Modules select their own parameters.
    blocks : None, {"param", "layer", "expert"}, mapping or callable
        ``None``: one block. ``"param"``: one block per tensor. ``"layer"``: per
        module path up to the first index (``transformer.h.3``); parameters
        outside indexed lists form a block per owning module. ``"expert"``: per
        deepest indexed module (``...mlp.experts.2``), falling back to the
        layer rule. A mapping ``{block_name: glob or globs}`` (unmatched
        parameters go to ``"rest"``), or a callable ``name -> block_name``.

    Returns
    -------
    ParameterSelection
    """
    if not isinstance(model, nn.Module):
        raise InputError("model", "must be a torch.nn.Module", type(model).__name__)
    named = dict(model.named_parameters())  # tied tensors appear once
    all_names = list(named)
    if not all_names:
        raise InputError("model", "must have at least one parameter", type(model).__name__)

    if params is None:
        names = [n for n in all_names if named[n].requires_grad]
        if not names:
            raise InputError("params", "is None but the model has no trainable parameter", params)
    elif isinstance(params, str):
        names = _match_globs("params", [params], all_names)
    elif isinstance(params, nn.Module):
        names = _names_of_modules(model, [params], named)
    elif isinstance(params, Iterable):
        items = list(params)
        if not items:
            raise InputError("params", "must not be empty", params)
        if all(isinstance(p, str) for p in items):
            names = _match_globs("params", items, all_names)
        elif all(isinstance(p, nn.Module) for p in items):
            names = _names_of_modules(model, items, named)
        else:
            raise InputError("params", "must be globs (str) or modules, not a mix", [type(p).__name__ for p in items])
    else:
        raise InputError("params", "must be None, a glob, a list of globs, or modules", type(params).__name__)

    keys = _block_keys(names, blocks)
    # order parameters so each block is one contiguous column range, blocks in first-seen order
    order: dict = {}
    for name, key in zip(names, keys):
        order.setdefault(key, []).append(name)
    ordered = [n for members in order.values() for n in members]
    shapes, offsets, ranges = [], [], {}
    offset = 0
    for key, members in order.items():
        start = offset
        for n in members:
            shapes.append(named[n].shape)
            offsets.append(offset)
            offset += named[n].numel()
        ranges[key] = (start, offset)
    return ParameterSelection(tuple(ordered), tuple(shapes), tuple(offsets), offset, ranges)


def _names_of_modules(model, modules, named) -> list:
    ids = {id(p) for m in modules for p in m.parameters()}
    names = [n for n, p in named.items() if id(p) in ids]
    if not names:
        raise InputError("params", "names modules that own no parameter of the model", [type(m).__name__ for m in modules])
    return names


def _block_keys(names: list, blocks) -> list:
    if blocks is None:
        return ["all"] * len(names)
    if isinstance(blocks, str):
        if blocks not in _GROUPINGS:
            raise InputError("blocks", f"must be one of {sorted(_GROUPINGS)}, a mapping or a callable", blocks)
        return [_GROUPINGS[blocks](n) for n in names]
    if isinstance(blocks, Mapping):
        keys = []
        for n in names:
            key = "rest"
            for block, patterns in blocks.items():
                patterns = [patterns] if isinstance(patterns, str) else list(patterns)
                if any(fnmatch.fnmatchcase(n, p) for p in patterns):
                    key = str(block)
                    break
            keys.append(key)
        for block, patterns in blocks.items():
            if str(block) not in keys:
                raise InputError("blocks", f"has block {block!r} whose patterns match no selected parameter", patterns)
        return keys
    if isinstance(blocks, Callable):
        return [str(blocks(n)) for n in names]
    raise InputError("blocks", "must be None, 'param', 'layer', 'expert', a mapping or a callable", type(blocks).__name__)
