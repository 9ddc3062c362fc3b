"""Gradient consistency of frequency bins or labels of analysis sentences, with intervals and
the null band, as a table (the CSE paper's Figure 2(a); ``ntkscope gc``), for one output or
several side by side."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ntkscope.core.checks import InputError, check_choice, entry
from ntkscope.kernel.consistency import gradient_consistency_groups
from ntkscope.kernel.objectives import SCALAR_OUTPUTS
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.text.frequency import BINNINGS, bin_edges, bin_of, score_histogram

GROUPINGS = ("frequency-bins", "label")


def _groups(data, by: str, bins: int, binning: str) -> tuple[np.ndarray, pd.DataFrame]:
    scores = data.labels["score"].to_numpy()
    hist = score_histogram(scores, bins=bins, kind=binning)
    if by == "label":
        return data.labels["label"].to_numpy(), hist
    return np.array([f"bin {b}" for b in bin_of(scores, bin_edges(scores, bins, kind=binning))]), hist


@entry("gc_by_bins")
def gc_by_bins(model, data, *, by: str = "frequency-bins", bins: int = 6, binning: str = "count", min_count: int = 4,
               resampling: Resampling | None = Resampling(), **options) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """GC of each subset of ``data`` (an :class:`~ntkscope.AnalysisData`) against the whole set.

    ``by``: frequency bins of the score ("bin k"; ``binning`` "count": equal-count, the
    default, or "width": equal-width) or the data's labels. ``resampling``: the intervals and
    null band (:class:`~ntkscope.Resampling`). ``options``: :class:`~ntkscope.KernelOptions`
    fields. Returns (table: one :meth:`~ntkscope.GCResult.row` per group, with left and right
    for bins and mean_frequency_score; the histogram of the scores in the same bins;
    {skipped label: size}).
    """
    check_choice("by", by, GROUPINGS)
    check_choice("binning", binning, BINNINGS)
    labels, hist = _groups(data, by, bins, binning)
    scores = data.labels["score"].to_numpy()
    groups = gradient_consistency_groups(model, data.batch, labels, min_count=min_count, resampling=resampling,
                                         **options)
    table = groups.to_frame()
    table["mean_frequency_score"] = [float(scores[labels == lab].mean()) for lab in table["label"]]
    if by == "frequency-bins":
        index = table["label"].str.split().str[1].astype(int)
        table.insert(1, "left", hist["left"].to_numpy()[index])
        table.insert(2, "right", hist["right"].to_numpy()[index])
        table = table.sort_values("left").reset_index(drop=True)
    return table, hist, {str(k): v for k, v in groups.skipped.items()}


@entry("gc_sensitivity")
def gc_sensitivity(model, data, *, outputs=SCALAR_OUTPUTS, **kwargs) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """:func:`gc_by_bins` for each of ``outputs`` (built-in scalar output names), stacked with
    an ``output`` column: does a conclusion depend on what ``f`` is? Same bins, same resampling
    seed for every output. Returns (table, histogram, {output: skipped})."""
    outputs = [outputs] if isinstance(outputs, str) else list(outputs)
    if not outputs or len(set(outputs)) != len(outputs):
        raise InputError("outputs", "must name at least one output, each once", outputs)
    for name in outputs:
        check_choice("outputs", name, SCALAR_OUTPUTS)
    if "output" in kwargs:
        raise InputError("output", "is set per table by outputs= here", kwargs["output"])
    tables, skipped, hist = [], {}, None
    for name in outputs:
        table, hist, skipped[name] = gc_by_bins(model, data, output=name, **kwargs)
        table.insert(0, "output", name)
        tables.append(table)
    return pd.concat(tables, ignore_index=True), hist, skipped
