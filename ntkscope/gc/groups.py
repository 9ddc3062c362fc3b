"""Gradient consistency of frequency bins or labels of analysis sentences, with intervals and
null bands, as a table (the CSE paper's Figure 2(a); ``ntkscope gc``), for one output or
several side by side.

The nulls of analysis sentences (:func:`analysis_controls`): random subsets; homogeneous ones
(one ordinary label's sentences, or nearest neighbours in gradient space); random subsets
matched on length and on loss."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import InputError, check_choice, entry
from ntkscope.gc.options import GCOptions, given_once
from ntkscope.kernel.consistency import gradient_consistency_groups
from ntkscope.kernel.nulls import Controls, KernelLoss
from ntkscope.kernel.objectives import SCALAR_OUTPUTS, LMLoss, sample_outputs
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.text.frequency import bin_edges, bin_of, score_histogram
from ntkscope.text.sentences import AnalysisData

MATCHES = ("length", "loss")
#: the output ``ntkscope gc``, ``plan`` and the reproduction differentiate by default: the
#: best-conditioned of the three measured (docs/gc-outputs.md); the loss's direction is a coin toss
GC_OUTPUT = "centred-true-logit"


def _loss_of(output):
    """The loss under the same objective as ``output`` (an LMLoss keeps its mask settings), or
    None for outputs that are not a language model's (callables, vector outputs)."""
    if isinstance(output, LMLoss):
        return dataclasses.replace(output, value="loss")
    return "loss" if output in SCALAR_OUTPUTS else None


@entry("analysis_controls")
def analysis_controls(model, batch, *, pools=None, match=MATCHES, output="loss", loss_from="forward") -> Controls:
    """The nulls beside the random one for ``batch`` (a dict with ``attention_mask``, or a tensor):
    homogeneous ``pools`` (index arrays of ordinary text; None: gradient-space neighbours) and
    random subsets matched on each of ``match``: "length" (tokens; a dict batch only) and
    "loss" (each sample's loss under ``model`` and ``output``'s objective; not for outputs that
    are not a language model's). ``loss_from``: "forward" (one forward pass now) or "kernel" (a
    :class:`~ntkscope.kernel.nulls.KernelLoss`: the GC functions read it from their kernel's own
    forward, and run the forward only when their method has none)."""
    check_choice("loss_from", loss_from, ("forward", "kernel"))
    covariates = {}
    if "length" in match and isinstance(batch, dict) and "attention_mask" in batch:
        covariates["length"] = batch["attention_mask"].sum(1).double().cpu().numpy()
    loss = _loss_of(output)
    if "loss" in match and loss is not None:
        if loss_from == "kernel":
            covariates["loss"] = KernelLoss(loss)
        else:
            with torch.no_grad():
                covariates["loss"] = sample_outputs(model, batch, output=loss).double().cpu().numpy()
    return Controls(homogeneous=pools, matched=covariates)


def _check_homogeneous(homogeneous) -> None:
    if homogeneous is not None and (isinstance(homogeneous, (bytes, os.PathLike))
                                    or not isinstance(homogeneous, Iterable)):
        raise InputError("homogeneous", "must be a label of the data, pools of indices (a list of index sequences) or "
                         "None", type(homogeneous).__name__)


def homogeneous_pools(data, homogeneous) -> list | None:
    """The homogeneous null's pools: ``homogeneous`` a label of ``data`` (its sentences), index
    arrays (as they are), or None (none: gradient-space neighbours are used)."""
    _check_homogeneous(homogeneous)
    if not isinstance(homogeneous, str):
        return None if homogeneous is None else list(homogeneous)
    labels = data.labels["label"].astype(str).to_numpy()
    if not (labels == homogeneous).any():
        raise InputError("homogeneous", f"must be one of the data's labels {sorted(set(labels))}", homogeneous)
    return [np.flatnonzero(labels == homogeneous)]


def _controls(controls, model, data, homogeneous, output):
    if controls != "auto":
        return controls
    return analysis_controls(model, data.batch, pools=homogeneous_pools(data, homogeneous), output=output,
                             loss_from="kernel")


def group_labels(data, by: str, bins: int, binning: str) -> tuple[np.ndarray, pd.DataFrame]:
    """One group label per sentence of ``data`` ("bin k" of the frequency score, or the data's
    labels: ``by``) and the histogram of the scores; one group only is refused (GC = 1 by construction)."""
    scores = data.labels["score"].to_numpy()
    hist = score_histogram(scores, bins=bins, kind=binning)
    if by == "label":
        labels = data.labels["label"].to_numpy()
        if len(set(labels)) < 2:  # one group is the whole set: GC = 1 by construction, not a finding
            raise InputError("by", "'label' needs data whose rows carry two or more labels (name the column with "
                             "label_column / --label-column)", f"one label: {labels[0]!r}" if len(labels) else "none")
        return labels, hist
    groups = np.array([f"bin {b}" for b in bin_of(scores, bin_edges(scores, bins, kind=binning))])
    if len(set(groups.tolist())) < 2:  # the same: one bin is the whole set
        raise InputError("bins", "must give two or more non-empty frequency bins (one bin is the whole set: GC = 1 "
                         "by construction)", bins)
    return groups, hist


#: the grouping keywords (GCOptions fields) gc_by_group still takes beside ``gc``
_LOOSE = ("by", "bins", "binning", "min_count")


@entry("gc_by_group")
def gc_by_group(model, data, *, gc: GCOptions | None = None, resampling: Resampling | None = Resampling(),
               controls="auto", homogeneous=None, **options) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """GC of each subset of ``data`` (an :class:`~ntkscope.AnalysisData`) against the whole set.

    ``gc``: the grouping (a :class:`~ntkscope.GCOptions`; None: its defaults): ``gc.by`` frequency
    bins of the score ("bin k"; ``gc.bins`` of them, ``gc.binning`` "count": equal-count, the
    default, or "width": equal-width) or the data's labels; a subset under ``gc.min_count``
    sentences is skipped; ``gc.homogeneous_label``: the label whose sentences the homogeneous null
    draws from (``gc.outputs`` is :func:`gc_sensitivity`'s; ``gc.tail_fraction`` is a run's). The
    keywords ``by``, ``bins``, ``binning`` and ``min_count`` still work without ``gc``, as
    shorthand for its fields; beside a ``gc`` whose field differs, they are refused.
    ``resampling``: the intervals and random null (:class:`~ntkscope.Resampling`). ``controls``:
    "auto" (the homogeneous null from ``gc.homogeneous_label`` or ``homogeneous``: pools of
    indices, one ordinary source each; without either, from gradient-space neighbours; and nulls
    matched on length and loss: :func:`analysis_controls`), a :class:`~ntkscope.Controls`, or
    None. ``options``: :class:`~ntkscope.KernelOptions` fields. Returns (table: one
    :meth:`~ntkscope.GCResult.row` per group, with left and right for bins and
    mean_frequency_score; the histogram of the scores in the same bins; {skipped label: size}).

    >>> table, hist, skipped = gc_by_group(model, data, gc=GCOptions(bins=4, min_count=8))  # doctest: +SKIP
    """
    if not isinstance(data, AnalysisData):
        raise InputError("data", "must be an AnalysisData (ntkscope.load_analysis_data)", type(data).__name__)
    _check_homogeneous(homogeneous)
    gc, homogeneous = given_once(gc, {k: options.pop(k) for k in list(options) if k in _LOOSE}, homogeneous)
    if gc.outputs:
        raise InputError("gc", "must name no outputs here: gc_by_group computes one output (output=...); several side "
                         "by side are gc_sensitivity's", f"outputs={list(gc.outputs)}")
    labels, hist = group_labels(data, gc.by, gc.bins, gc.binning)
    scores = data.labels["score"].to_numpy()
    given = options.get("options")
    output = options.get("output", given.output if given is not None else "loss")
    controls = _controls(controls, model, data, homogeneous, output) if resampling is not None else None
    groups = gradient_consistency_groups(model, data.batch, labels, min_count=gc.min_count, resampling=resampling,
                                         controls=controls, **options)
    table = groups.to_frame()
    table["mean_frequency_score"] = [float(scores[labels == lab].mean()) for lab in table["label"]]
    if gc.by == "frequency-bins":
        index = table["label"].str.split().str[1].astype(int)
        table.insert(1, "left", hist["left"].to_numpy()[index])
        table.insert(2, "right", hist["right"].to_numpy()[index])
        table = table.sort_values("left").reset_index(drop=True)
    return table, hist, {str(k): v for k, v in groups.skipped.items()}


def gc_by_bins(model, data, **kwargs) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The old name of :func:`gc_by_group` (which groups by frequency bins or by labels): the same
    call, with a DeprecationWarning."""
    warnings.warn("gc_by_bins is now gc_by_group (it groups by frequency bins or by labels); the old name will "
                  "be removed", DeprecationWarning, stacklevel=2)
    return gc_by_group(model, data, **kwargs)


@entry("gc_sensitivity")
def gc_sensitivity(model, data, *, outputs=None, **kwargs) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """:func:`gc_by_group` for each of ``outputs`` (built-in scalar output names; None:
    ``gc.outputs`` when ``gc=`` names some, else every one of them), stacked with an ``output``
    column: does a conclusion depend on what ``f`` is? Same bins, same resampling seed for every
    output. ``kwargs``: :func:`gc_by_group`'s. Returns (table, histogram, {output: skipped})."""
    gc = kwargs.get("gc")
    named = tuple(gc.outputs or ()) if isinstance(gc, GCOptions) else ()
    if outputs is None:
        outputs = named or SCALAR_OUTPUTS
    if not isinstance(outputs, Iterable):
        raise InputError("outputs", "must be a scalar output's name or a list of them", outputs)
    outputs = [outputs] if isinstance(outputs, str) else list(outputs)
    if not all(isinstance(name, str) for name in outputs):
        raise InputError("outputs", "must be a scalar output's name or a list of them", outputs)
    if named and outputs != list(named):
        raise InputError("outputs", f"is also set by gc (gc.outputs={list(named)}): give the outputs once", outputs)
    if not outputs or len(set(outputs)) != len(outputs):
        raise InputError("outputs", "must name at least one output, each once", outputs)
    for name in outputs:
        check_choice("outputs", name, SCALAR_OUTPUTS)
    if "output" in kwargs:
        raise InputError("output", "is set per table by outputs= here", kwargs["output"])
    if named:
        kwargs["gc"] = dataclasses.replace(gc, outputs=None)
    tables, skipped, hist = [], {}, None
    for name in outputs:
        table, hist, skipped[name] = gc_by_group(model, data, output=name, **kwargs)
        table.insert(0, "output", name)
        tables.append(table)
    return pd.concat(tables, ignore_index=True), hist, skipped
