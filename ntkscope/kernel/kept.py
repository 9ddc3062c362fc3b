"""What a kernel call measures about a model and its data, kept across calls.

A method's plan and its memory measurements (the structured method's probe, the per-sample
gradients' transient) follow the architecture and the data's shapes, not the weights' values. A
tracker that probes the same model on the same sentences every few hundred steps would otherwise
plan and measure again at every probe (a forward and backward of a few samples, three times over,
per method that "auto" weighs). :func:`kept` gives each (model, signature) one dictionary that lives
as long as the model does.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ntkscope.core.files import digest

#: per model (weakly: the entries go with it), per :func:`signature`, per kind of measurement
_KEPT: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
#: signatures kept per model, the most recently used (a structured probe holds one sample's factors)
PER_MODEL = 4


def _leaves(data, path: str = ""):
    """(path, tensor) of every tensor in nested dicts, lists and tuples (prepared data), in order."""
    if torch.is_tensor(data):
        yield path, data
    elif isinstance(data, dict):
        for k in sorted(data, key=str):
            yield from _leaves(data[k], f"{path}/{k}")
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            yield from _leaves(v, f"{path}/{i}")


def signature(fm, data, rows: int) -> tuple:
    """What a measurement of ``fm`` (a :class:`~ntkscope.kernel.grads.FunctionalModel`) on prepared
    ``data`` depends on: the modules (by identity, so that a replaced or converted layer makes a
    new entry), the selected parameters' names and shapes, the output, dtype and device, and the
    data's shapes with the content of the ``rows`` first samples (those a plan is made on). Not the
    weights' values."""
    leaves = dict(_leaves(data))
    content = digest({path: [list(v.shape), str(v.dtype)] for path, v in leaves.items()},
                     arrays={path: (v[:rows] if v.dim() else v).detach() for path, v in leaves.items()})
    modules = tuple((name, id(m)) for name, m in fm.module.named_modules())
    params = tuple((k, tuple(v.shape)) for k, v in fm.params.items())
    output = (type(fm.objective).__name__, fm.objective.name, fm.n_outputs)
    mode = (fm.module.training, str(fm.randomness))  # dropout on or off changes what a pass holds
    return modules, params, output, mode, str(fm.dtype), str(fm.device), rows, content


def kept(fm, data, rows: int, kind: str) -> dict:
    """The dictionary of ``kind`` measurements kept for ``fm``'s model and :func:`signature` (the
    :data:`PER_MODEL` most recently used per model; a value must not refer to the model itself,
    or the entry would keep it alive: :func:`keeps_model` checks)."""
    per_model = _KEPT.setdefault(fm.module, {})
    key = (kind, signature(fm, data, rows))
    entry = per_model.pop(key, {})
    per_model[key] = entry  # the most recent last
    while len(per_model) > PER_MODEL:
        per_model.pop(next(iter(per_model)))
    return entry


def keeps_model(fm, modules) -> bool:
    """Whether ``modules`` (a plan's) include ``fm``'s model itself: then nothing is kept across
    calls (a strong reference from the value to its weak key would keep the model alive)."""
    return any(m is fm.module for m in modules)
