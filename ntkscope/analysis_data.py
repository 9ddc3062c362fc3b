"""Sentences for an analysis: a seeded sample from a corpus pack or a text file, tokenized
with the model's tokenizer, labelled, and scored by sentence frequency (DESIGN §2).

- A pack (a directory, or ``default`` for the shipped one): sentences of its validation
  split; label = domain; frequency counts over its train split.
- A ``.tsv`` file: ``label<TAB>text`` per line; counts over the file itself.
- Any other text file (UTF-8): paragraphs split into sentences, label ``text``; counts
  over the file itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ntkscope._checks import check_positive_int, fail


@dataclass(frozen=True)
class AnalysisData:
    """batch: input_ids / attention_mask (n, T); labels: DataFrame (text, label, score) in batch order."""

    batch: dict
    labels: pd.DataFrame
    source: str


def _pack_rows(pack, split: str) -> list[tuple[str, str]]:
    from ntkscope.corpus.text import split_sentences

    return [(s, r.domain) for r in pack.records(split) for s in split_sentences(r.text) if len(s.split()) >= 6]


def _file_rows(path: Path) -> list[tuple[str, str]]:
    from ntkscope.corpus.text import paragraphs, read_text, split_sentences

    text = read_text(path, func="analysis data")
    if path.suffix == ".tsv":
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            label, sep, sentence = line.partition("\t")
            if not sep or not sentence.strip():
                raise ValueError(f"analysis data: {path} line {i} is not 'label<TAB>text' (got {line[:60]!r})")
            rows.append((sentence.strip(), label.strip()))
        return rows
    return [(s, "text") for p in paragraphs(text) for s in split_sentences(p) if s.split()]


def load_analysis_data(data, tokenizer, *, n: int = 256, seq_len: int = 64, seed: int = 0,
                       split: str = "validation") -> AnalysisData:
    """``n`` sentences of ``data`` (a pack directory, ``"default"``, or a text/TSV file)."""
    from ntkscope.corpus.pack import load_pack
    from ntkscope.frequency import count_tokens, sentence_scores, token_frequency
    from ntkscope.representations import encode_texts

    check_positive_int("load_analysis_data", "n", n)
    path = None if data in (None, "default") else Path(data)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"analysis data: {path} does not exist (a corpus pack directory, 'default', "
                                "or a UTF-8 text / TSV file)")
    if path is None or path.is_dir():
        pack = load_pack(path)
        rows = _pack_rows(pack, split)
        reference = [r.text for r in pack.records("train")]
        source = str(pack.path)
    else:
        rows = _file_rows(path)
        reference = [t for t, _ in rows]
        source = str(path)
    if len(rows) < n:
        raise fail("load_analysis_data", "n", f"must be at most the {len(rows)} sentences of {source}", n)
    pick = np.sort(np.random.default_rng(seed).choice(len(rows), n, replace=False))
    labels = pd.DataFrame([rows[i] for i in pick], columns=["text", "label"])
    phi = token_frequency(count_tokens(reference, tokenizer))
    labels["score"], labels["n_tokens"] = sentence_scores(labels["text"].tolist(), tokenizer, phi)
    return AnalysisData(encode_texts(tokenizer, labels["text"], seq_len), labels, source)
