"""Gradient consistency of frequency bins or labels of analysis sentences, as a table
(the CSE paper's Figure 2(a); ``ntkscope gc``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ntkscope.core.checks import check_choice, entry
from ntkscope.kernel.consistency import gradient_consistency_groups
from ntkscope.text.frequency import bin_edges, bin_of, score_histogram

GROUPINGS = ("frequency-bins", "label")


@entry("gc_by_bins")
def gc_by_bins(model, data, *, by: str = "frequency-bins", bins: int = 6, min_count: int = 4,
               **options) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """GC of each subset of ``data`` (an :class:`~ntkscope.AnalysisData`) against the whole set.

    ``by``: equal-width bins of the frequency score ("bin k") or the data's labels.
    ``options``: :class:`~ntkscope.KernelOptions` fields. Returns (table: label, [left, right,]
    n_subset, gc, eigenvalues, eigengaps, method, mean_frequency_score; the histogram of the
    scores; {skipped label: size}).
    """
    check_choice("by", by, GROUPINGS)
    scores = data.labels["score"].to_numpy()
    hist = score_histogram(scores, bins=bins)
    if by == "label":
        labels = data.labels["label"].to_numpy()
    else:
        labels = np.array([f"bin {b}" for b in bin_of(scores, bin_edges(scores, bins))])
    groups = gradient_consistency_groups(model, data.batch, labels, min_count=min_count, **options)
    table = groups.to_frame().rename(columns={"score": "gc"})
    table["mean_frequency_score"] = [float(scores[labels == lab].mean()) for lab in table["label"]]
    if by == "frequency-bins":
        index = table["label"].str.split().str[1].astype(int)
        table.insert(1, "left", hist["left"].to_numpy()[index])
        table.insert(2, "right", hist["right"].to_numpy()[index])
        table = table.sort_values("left").reset_index(drop=True)
    return table, hist, {str(k): v for k, v in groups.skipped.items()}
