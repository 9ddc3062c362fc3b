"""Columns of a training batch that are not the model's inputs (a DEMix model's domain labels,
in-run GC's group labels): one forward pre-hook per model takes them off its calls, so that the
forward never sees them, and keeps them for every layer or callback that reads them. A
``transformers.Trainer`` passes such a column to the model's call when
``TrainingArguments(remove_unused_columns=False)``."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn


class BatchColumns:
    """The columns that readers asked for, taken off ``model``'s calls by a pre-hook that runs
    before any other. :attr:`current`: those of the call in progress (or the last one, after it);
    :attr:`training`: those of the last training-mode call with gradients on, with that call's
    ``labels`` (the loss's targets, left in the call)."""

    def __init__(self, model: nn.Module):
        self.wanted: Counter = Counter()
        self.current: dict = {}
        self.training: dict = {}
        self.handle = model.register_forward_pre_hook(self._take, with_kwargs=True, prepend=True)

    def _take(self, module, args, kwargs):
        taken = {name: kwargs[name] for name in self.wanted if name in kwargs}
        self.current = taken
        if module.training and torch.is_grad_enabled():
            self.training = {**taken, "labels": kwargs.get("labels")}
        if not taken:
            return None
        return args, {k: v for k, v in kwargs.items() if k not in taken}

    def release(self, name: str) -> None:
        """One reader of ``name`` is done; the column stays taken while another reads it."""
        self.wanted[name] -= 1
        if self.wanted[name] <= 0:
            del self.wanted[name]


def batch_columns(model: nn.Module, *names: str) -> BatchColumns:
    """``model``'s :class:`BatchColumns` (made on first use), taking ``names`` off its calls too."""
    found = model.__dict__.get("_batch_columns")
    if found is None:
        found = BatchColumns(model)
        model.__dict__["_batch_columns"] = found
    found.wanted.update(names)
    return found
