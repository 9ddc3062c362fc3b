"""Sentences for an analysis: a seeded sample of the data's rows (a corpus pack's validation
sentences, a table's texts, a text file's sentences: :mod:`ntkscope.text.inputs`),
tokenized with the model's tokenizer, labelled, and scored by sentence frequency
(docs/design.md §2).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ntkscope.core.checks import InputError, check_choice, check_positive_int, check_seed, entry, fail
from ntkscope.text.corpus.pack import SPLITS
from ntkscope.text.frequency import checked_texts, sentence_scores, token_frequency
from ntkscope.text.inputs import as_source
from ntkscope.text.tokenization import as_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnalysisData:
    """batch: input_ids / attention_mask (n, T); labels: DataFrame (text, label, score) in batch order."""

    batch: dict
    labels: pd.DataFrame
    source: str


@dataclass(frozen=True)
class Sentences:
    """What an analysis reads of the data (every command's ``--n``, ``--seq-len``, ``--seed``,
    ``--tokenizer``): ``n`` sentences of the data, at most ``seq_len`` tokens each, drawn with ``seed``;
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


@entry("encode_texts")
def encode_texts(tokenizer, texts, max_length: int) -> dict:
    """input_ids and attention_mask (n, T<=max_length), right-padded with the tokenizer's pad id
    (``tokenizer``: what :func:`~ntkscope.text.tokenization.as_tokenizer` takes)."""
    tokenizer = as_tokenizer(tokenizer)
    texts = checked_texts("encode_texts", texts)
    check_positive_int("max_length", max_length)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    rows = [ids[:max_length] or [pad] for ids in tokenizer.encode(texts)]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), pad, dtype=torch.long)  # (n, T)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _per_group(rows, per_group: int, seed: int, source: str) -> np.ndarray:
    """Row indices: ``per_group`` of each label, sampled with ``seed``, in the data's order."""
    check_positive_int("per_group", per_group)
    labels = np.array([str(label) for _, label in rows], dtype=object)
    if len(set(labels)) < 2:
        raise fail("load_analysis_data", "per_group", "needs data whose rows carry two or more labels (a label "
                   "column)", per_group)
    rng, picks = np.random.default_rng(seed), []
    for label in sorted(set(labels)):
        members = np.flatnonzero(labels == label)
        if len(members) < per_group:
            log.info("load_analysis_data: label %r has %d rows of %s, fewer than per_group %d: all of them", label,
                     len(members), source, per_group)
        picks.append(rng.choice(members, min(per_group, len(members)), replace=False))
    return np.sort(np.concatenate(picks))


@entry("load_analysis_data")
def load_analysis_data(data, tokenizer, *, n: int = 256, seq_len: int = 64, seed: int = 0,
                       split: str = "validation", per_group: int | None = None) -> AnalysisData:
    """``n`` rows of ``data``, sampled with ``seed``, in their order in the data; with
    ``per_group``, that many rows of each label instead (stratified: a rare domain gets as many
    as a common one; a label with fewer rows gives all it has, logged).

    Parameters
    ----------
    data : DataSource, path, ``"default"`` or None
        A pack, a table (JSONL, CSV, TSV, Parquet), a ``datasets`` directory or a text file
        (:class:`~ntkscope.text.inputs.DataSource`; a path reads a table's ``text`` column).
    tokenizer : TextTokenizer, path, ``tokenizers.Tokenizer`` or transformers fast tokenizer
        (:func:`~ntkscope.text.tokenization.as_tokenizer`)
    split : a pack's split to sample (its train split gives the frequency counts).

    Returns
    -------
    AnalysisData: batch (n, T <= seq_len), labels (text, label, score, n_tokens).
    """
    check_positive_int("n", n)
    check_positive_int("seq_len", seq_len)
    check_seed(seed)
    tokenizer = as_tokenizer(tokenizer)
    data = as_source(data)
    if data.kind == "pack":
        check_choice("split", split, (*SPLITS, "all"))
    rows = data.rows(split)
    source = str(data.pack().path) if data.kind == "pack" else str(data.path)
    if per_group is not None:
        pick = _per_group(rows, per_group, seed, source)
    elif len(rows) < n:
        raise fail("load_analysis_data", "n", f"must be at most the {len(rows)} sentences of {source}", n)
    else:
        pick = np.sort(np.random.default_rng(seed).choice(len(rows), n, replace=False))
    labels = pd.DataFrame([rows[i] for i in pick], columns=["text", "label"])
    phi = token_frequency(data.reference_counts(tokenizer))
    labels["score"], labels["n_tokens"] = sentence_scores(labels["text"].tolist(), tokenizer, phi)
    return AnalysisData(encode_texts(tokenizer, labels["text"], seq_len), labels, source)
