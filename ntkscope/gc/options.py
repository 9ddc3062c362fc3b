"""How GC groups an analysis's sentences: the one declaration of ``gc``'s grouping options
(``--by``, ``--bins``, ``--binning``, ``--min-count``, ``--outputs``, ``--tail-fraction``,
``--homogeneous-label``), their defaults and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ntkscope.core.checks import InputError, check_choice, check_positive_int
from ntkscope.text.frequency import BINNINGS

#: the subsets ``gc`` compares with the whole set: frequency-score bins or the data's labels
GROUPINGS = ("frequency-bins", "label")


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


def _same(a, b) -> bool:
    """a == b for values that may be arrays (an array is never a grouping field's value)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def given_once(gc, loose: dict, homogeneous=None) -> tuple[GCOptions, object]:
    """The one GCOptions a call means, and its homogeneous null's label or pools: ``gc`` (a
    GCOptions or None: its defaults), ``loose`` (GCOptions fields given as keywords instead) and
    ``homogeneous`` (pools of indices, or a label: ``gc.homogeneous_label``). A loose value or a
    homogeneous label that differs from ``gc``'s is refused: the grouping is given once."""
    if gc is not None and not isinstance(gc, GCOptions):
        raise InputError("gc", "must be a GCOptions or None", type(gc).__name__)
    if gc is None:
        return GCOptions(**loose, homogeneous_label=homogeneous if isinstance(homogeneous, str) else None), homogeneous
    for key, value in loose.items():
        if not _same(value, getattr(gc, key)):
            raise InputError(key, f"is also set by gc (gc.{key}={getattr(gc, key)!r}): give the grouping once, in "
                             "gc=GCOptions(...)", value)
    if homogeneous is not None and gc.homogeneous_label is not None and not _same(homogeneous, gc.homogeneous_label):
        raise InputError("homogeneous", f"is also set by gc (gc.homogeneous_label={gc.homogeneous_label!r}): give "
                         "the homogeneous null once", homogeneous)
    return gc, gc.homogeneous_label if homogeneous is None else homogeneous
