"""What a command is asked to do, as objects the command line builds once and the commands take.

A kernel command's options come in four objects, each validated where it is built:

- :class:`Sentences`: which sentences are analysed (how many, how long, drawn with which seed,
  tokenized by what);
- :class:`~ntkscope.KernelOptions`: how the kernel is computed (output, parameters, method, dtype,
  device, memory budget);
- :class:`~ntkscope.Resampling`: the statistics' intervals and null bands;
- :class:`GCOptions`: how ``gc`` groups the sentences.

Cache keys and ``result.json`` are made from their fields, so an option added to one of them
reaches the key without being written down a second time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ntkscope.core.checks import InputError, check_choice, check_positive_int
from ntkscope.gc.groups import GROUPINGS
from ntkscope.text.frequency import BINNINGS


@dataclass(frozen=True)
class Sentences:
    """``n`` sentences of the data, at most ``seq_len`` tokens each, drawn with ``seed``;
    ``tokenizer``: a tokenizer file or directory (default: the checkpoint's own)."""

    n: int = 256
    seq_len: int = 64
    seed: int = 0
    tokenizer: str | None = None

    def __post_init__(self):
        check_positive_int("n", self.n)
        check_positive_int("seq_len", self.seq_len)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError("seed", "must be a non-negative integer", self.seed)
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", str(self.tokenizer))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class GCOptions:
    """How ``gc`` reads the sentences.

    On one checkpoint: the subsets are frequency bins (``bins`` of them, ``binning`` "count":
    equal-count, or "width") or the data's labels (``by="label"``); a subset under ``min_count``
    sentences is skipped; ``outputs`` (several scalar output names) puts them side by side. On a run:
    the long tail is the ``tail_fraction`` of sentences with the lowest frequency score. Both: the
    homogeneous null draws from ``homogeneous_label``'s sentences (default: gradient-space
    neighbours)."""

    by: str = "frequency-bins"
    bins: int = 6
    binning: str = "count"
    min_count: int = 4
    outputs: tuple | None = None
    tail_fraction: float = 1 / 3
    homogeneous_label: str | None = None

    def __post_init__(self):
        check_choice("by", self.by, GROUPINGS)
        check_choice("binning", self.binning, BINNINGS)
        check_positive_int("bins", self.bins)
        check_positive_int("min_count", self.min_count)
        if not isinstance(self.tail_fraction, (int, float)) or isinstance(self.tail_fraction, bool) \
                or not 0 < self.tail_fraction < 1:
            raise InputError("tail_fraction", "must be a fraction in (0, 1)", self.tail_fraction)
        if self.outputs is not None:
            object.__setattr__(self, "outputs", (self.outputs,) if isinstance(self.outputs, str)
                               else tuple(self.outputs))

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "outputs": None if self.outputs is None else list(self.outputs)}
