"""Token frequency over a reference corpus, sentence frequency scores, and the tables
behind Figure 1(a) (domain/category sizes) and the score histogram of Figure 2(a).

Definitions (docs/design.md §2): counts are over the reference corpus tokenized with the model's
own tokenizer, special and padding tokens excluded. Token frequency ``phi(t)`` is
``count/max`` (``"max"``, default), ``log(1+count)/log(1+max)`` (``"log"``),
``count/total`` (``"prob"``) or ``1 - rank percentile`` (``"rank"``); unseen tokens get 0.
A sentence's score is the mean of ``phi`` over its tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ntkscope.core.checks import (InputError, UserError, as_numbers, check_choice, check_fraction, check_positive_int,
                                  entry, fail)
from ntkscope.core.files import write_table
from ntkscope.text.corpus.text import Record, count_words, split_sentences
from ntkscope.text.tokenization import TextTokenizer

log = logging.getLogger(__name__)

NORMALISATIONS = ("max", "log", "prob", "rank")


@dataclass(frozen=True)
class TokenCounts:
    """Counts of each token id over a corpus.

    Attributes
    ----------
    counts : (vocab_size,) int64; special ids are 0.
    tokenizer : the tokenizer's name.
    n_texts : texts counted.
    n_unknown : tokens that were the unknown token (counted in ``counts`` too).
    """

    counts: np.ndarray
    tokenizer: str
    n_texts: int
    n_unknown: int

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def to_frame(self, tokenizer: TextTokenizer | None = None) -> pd.DataFrame:
        """Seen tokens, most frequent first: id, count (and the token's text with ``tokenizer``)."""
        ids = np.flatnonzero(self.counts)
        ids = ids[np.argsort(-self.counts[ids], kind="stable")]
        frame = pd.DataFrame({"id": ids, "count": self.counts[ids]})
        if tokenizer is not None:
            frame.insert(1, "token", [tokenizer.decode([int(i)]) for i in ids])
        return frame


def _check_tokenizer(func: str, tokenizer) -> None:
    if not isinstance(tokenizer, TextTokenizer):
        raise fail(func, "tokenizer", "must be a TextTokenizer (see ntkscope.load_tokenizer)", type(tokenizer).__name__)


def checked_texts(func: str, texts) -> list[str]:
    """``texts`` (strings or Records) as a list of strings, refused in one line naming ``func``
    when it is one string, not a sequence, or holds something else."""
    if isinstance(texts, str):
        raise fail(func, "texts", "must be a sequence of strings, not one string", texts[:50])
    if isinstance(texts, (bytes, os.PathLike)) or not isinstance(texts, Iterable):
        raise fail(func, "texts", "must be a sequence of strings or Records", type(texts).__name__)
    out = [t.text if isinstance(t, Record) else t for t in texts]
    bad = next((t for t in out if not isinstance(t, str)), None)
    if bad is not None:
        raise fail(func, "texts", "must hold strings or Records", type(bad).__name__)
    if not out:
        raise fail(func, "texts", "must not be empty", out)
    return out


def _flat_ids(tokenizer: TextTokenizer, texts: list[str], batch: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """All ids concatenated, and each text's length: (N,), (len(texts),)."""
    ids, lengths = [], []
    for start in range(0, len(texts), batch):
        encoded = tokenizer.encode(texts[start:start + batch])
        lengths.extend(len(e) for e in encoded)
        ids.extend(np.asarray(e, dtype=np.int64) for e in encoded)
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    return flat, np.asarray(lengths, dtype=np.int64)


def _keep_mask(tokenizer: TextTokenizer, ids: np.ndarray) -> np.ndarray:
    special = np.fromiter(tokenizer.special_ids, dtype=np.int64) if tokenizer.special_ids else np.zeros(0, np.int64)
    return ~np.isin(ids, special)


def count_tokens(texts: Sequence[str] | Sequence[Record], tokenizer: TextTokenizer, *,
                 max_unknown: float = 0.5) -> TokenCounts:
    """Count every token of ``texts`` (special and padding tokens excluded).

    Raises when more than ``max_unknown`` of the tokens are the unknown token: the
    tokenizer does not fit this text (e.g. a WordPiece vocabulary of another language).
    """
    func = "count_tokens"
    _check_tokenizer(func, tokenizer)
    texts = checked_texts(func, texts)
    if isinstance(max_unknown, bool) or not isinstance(max_unknown, (int, float)) or not 0 <= max_unknown <= 1:
        raise fail(func, "max_unknown", "must be a number in [0, 1]", max_unknown)
    ids, _ = _flat_ids(tokenizer, texts)
    ids = ids[_keep_mask(tokenizer, ids)]
    if ids.size == 0:
        raise fail(func, "texts", "must hold at least one non-special token", f"{len(texts)} texts")
    n_unknown = int((ids == tokenizer.unk_id).sum()) if tokenizer.unk_id is not None else 0
    if n_unknown > max_unknown * ids.size:
        raise UserError(f"count_tokens: tokenizer {tokenizer.name!r} maps {n_unknown / ids.size:.0%} of the "
                        f"tokens to unknown (at most max_unknown={max_unknown:.0%} allowed): it does not fit this text")
    counts = np.bincount(ids, minlength=tokenizer.vocab_size).astype(np.int64)
    return TokenCounts(counts, tokenizer.name, len(texts), n_unknown)


@entry("token_frequency")
def token_frequency(counts: TokenCounts, normalisation: str = "max") -> np.ndarray:
    """``phi``: (vocab_size,) float64 in [0, 1]; unseen (and special) tokens get 0."""
    if not isinstance(counts, TokenCounts):
        raise fail("token_frequency", "counts", "must be a TokenCounts (ntkscope.count_tokens)", type(counts).__name__)
    check_choice("normalisation", normalisation, NORMALISATIONS)
    c = counts.counts.astype(np.float64)
    if normalisation == "max":
        return c / c.max()
    if normalisation == "log":
        return np.log1p(c) / np.log1p(c.max())
    if normalisation == "prob":
        return c / c.sum()
    seen = c > 0
    phi = np.zeros_like(c)
    # rank percentile over seen tokens, ties sharing their mean rank; the most frequent -> 1
    ranks = pd.Series(-c[seen]).rank(method="average").to_numpy()
    phi[seen] = 1.0 - (ranks - 1) / max(seen.sum(), 1)
    return phi


def sentence_scores(texts: Sequence[str], tokenizer: TextTokenizer, frequency: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``phi`` over each text's non-special tokens: scores (n,), token counts (n,).

    A text with no tokens scores NaN.
    """
    func = "sentence_scores"
    _check_tokenizer(func, tokenizer)
    texts = checked_texts(func, texts)
    frequency = as_numbers("frequency", frequency, func=func)
    if frequency.shape != (tokenizer.vocab_size,):
        raise fail(func, "frequency", f"must have shape ({tokenizer.vocab_size},), one value per token id",
                   frequency.shape)
    ids, lengths = _flat_ids(tokenizer, texts)
    keep = _keep_mask(tokenizer, ids)
    owner = np.repeat(np.arange(len(texts)), lengths)[keep]
    n = np.bincount(owner, minlength=len(texts))
    sums = np.bincount(owner, weights=frequency[ids[keep]], minlength=len(texts))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, sums / np.maximum(n, 1), np.nan), n


@entry("sentence_table")
def sentence_table(records: Sequence[Record], tokenizer: TextTokenizer, *, counts: TokenCounts | None = None,
                   normalisation: str = "max", min_tokens: int = 4, split: bool = True) -> pd.DataFrame:
    """Every sentence of ``records`` (``split=False``: every record whole) with its labels and score.

    Columns: text, source, domain, category, doc, n_tokens, score. ``counts`` default to
    the counts over ``records`` themselves; sentences under ``min_tokens`` tokens are dropped.
    """
    check_positive_int("min_tokens", min_tokens)
    counts = counts if counts is not None else count_tokens(records, tokenizer)
    rows = [(s, *r[1:]) for r in records for s in (split_sentences(r.text) if split else [r.text])]
    if not rows:
        raise fail("sentence_table", "records", "must hold at least one sentence", len(records))
    frame = pd.DataFrame(rows, columns=list(Record._fields))
    frame["score"], frame["n_tokens"] = sentence_scores(frame["text"].tolist(), tokenizer,
                                                        token_frequency(counts, normalisation))
    return frame[frame["n_tokens"] >= min_tokens].reset_index(drop=True)[
        ["text", "source", "domain", "category", "doc", "n_tokens", "score"]]


def bin_edges(scores, bins: int, *, range: tuple[float, float] | None = None, kind: str = "width") -> np.ndarray:
    """The ``bins + 1`` edges of the finite scores: equal-width (``np.histogram``'s) or equal-count (quantiles)."""
    finite = np.asarray(scores, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if kind == "count":
        return np.quantile(finite, np.linspace(0.0, 1.0, bins + 1))
    return np.histogram(finite, bins=bins, range=range)[1]


def bin_of(scores, edges: np.ndarray) -> np.ndarray:
    """The bin of each score (n,), in [0, len(edges) - 2]; scores outside the edges go to the end bins."""
    return np.clip(np.searchsorted(edges, np.asarray(scores, dtype=np.float64), side="right") - 1, 0, len(edges) - 2)


BINNINGS = ("width", "count")


def _check_range(range) -> None:
    """None, or (low, high) finite numbers with low < high (``np.histogram``'s range)."""
    if range is None:
        return
    try:
        low, high = (float(v) for v in range)
        good = np.isfinite(low) and np.isfinite(high) and low <= high
    except (TypeError, ValueError, RuntimeError):
        good = False
    if not good:
        raise InputError("range", "must be None or (low, high), two finite numbers with low <= high", range)


@entry("score_histogram")
def score_histogram(scores: Sequence[float], *, bins: int = 10, range: tuple[float, float] | None = None,
                    kind: str = "width") -> pd.DataFrame:
    """Bins over the scores, equal-width (``kind="width"``) or equal-count (``"count"``,
    quantile edges): bin, left, right, count, percent (of all sentences)."""
    check_positive_int("bins", bins)
    check_choice("kind", kind, BINNINGS)
    scores = as_numbers("scores", scores)
    scores = scores[np.isfinite(scores)]
    if scores.size == 0:
        raise fail("score_histogram", "scores", "must hold at least one finite score", scores.size)
    _check_range(range)
    edges = bin_edges(scores, bins, range=range, kind=kind)
    inside = scores[(scores >= edges[0]) & (scores <= edges[-1])]
    counts = np.bincount(bin_of(inside, edges), minlength=bins)
    return pd.DataFrame({"bin": np.arange(bins), "left": edges[:-1], "right": edges[1:], "count": counts,
                         "percent": 100.0 * counts / scores.size})


@entry("bin_indices")
def bin_indices(scores: Sequence[float], *, bins: int = 10, range: tuple[float, float] | None = None,
                min_count: int = 20, cap: int | None = 256, seed: int = 0) -> dict[int, np.ndarray]:
    """Indices of the sentences in each equal-width bin, for a per-bin statistic (GC, perplexity).

    Bins with fewer than ``min_count`` sentences are left out; larger ones are sub-sampled to
    ``cap`` with ``seed``. Returns {bin: sorted indices}.
    """
    check_positive_int("bins", bins)
    check_positive_int("min_count", min_count)
    check_positive_int("cap", cap, allow_none=True)
    scores = np.asarray(scores, dtype=np.float64)
    edges = bin_edges(scores, bins, range=range)
    which = bin_of(scores, edges)
    inside = np.isfinite(scores) & (scores >= edges[0]) & (scores <= edges[-1])
    rng = np.random.default_rng(seed)
    out = {}
    for b in np.arange(bins):
        idx = np.flatnonzero(inside & (which == b))
        if idx.size < min_count:
            continue
        if cap is not None and idx.size > cap:
            idx = np.sort(rng.choice(idx, size=cap, replace=False))
        out[int(b)] = idx
    return out


@entry("domain_table")
def domain_table(records: Sequence[Record], *, by: str = "category", top: int | None = 20) -> pd.DataFrame:
    """Sizes of the domains or categories: the long tail of Figure 1(a).

    Columns: domain, [source, category,] records, tokens, percent (of all tokens), sorted by
    tokens, largest first; ``top`` keeps the largest rows.
    """
    check_choice("by", by, ("domain", "source", "category"))
    keys = {"domain": ["domain"], "source": ["domain", "source"], "category": ["domain", "source", "category"]}[by]
    frame = pd.DataFrame(records, columns=list(Record._fields))
    frame["tokens"] = [count_words(t) for t in frame["text"]]
    table = frame.groupby(keys, sort=False).agg(records=("text", "size"), tokens=("tokens", "sum")).reset_index()
    table["percent"] = 100.0 * table["tokens"] / table["tokens"].sum()
    table = table.sort_values("tokens", ascending=False, kind="stable").reset_index(drop=True)
    return table.head(top) if top is not None else table


def save_table(frame: pd.DataFrame, path: str | Path) -> Path:
    """Write a table to ``.csv`` or ``.parquet`` under a temporary name, then rename it."""
    return write_table(frame, path)


@entry("long_tail_subset")
def long_tail_subset(scores, fraction: float = 1 / 3) -> np.ndarray:
    """Indices of the lowest-frequency ``fraction`` of the sentences (the long tail), sorted."""
    scores = as_numbers("scores", scores, ndim=1)
    check_fraction("fraction", fraction)
    k = max(2, int(round(fraction * len(scores))))
    return np.sort(np.argsort(scores, kind="stable")[:k])
