"""Sentences for an analysis: a seeded sample from a corpus pack or a text file, tokenized
with the model's tokenizer, labelled, and scored by sentence frequency (docs/design.md §2).

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
import torch

from ntkscope.core.checks import check_positive_int, entry, fail
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.text import paragraphs, read_text, split_sentences
from ntkscope.text.frequency import count_tokens, sentence_scores, token_frequency


@dataclass(frozen=True)
class AnalysisData:
    """batch: input_ids / attention_mask (n, T); labels: DataFrame (text, label, score) in batch order."""

    batch: dict
    labels: pd.DataFrame
    source: str


def encode_texts(tokenizer, texts, max_length: int) -> dict:
    """input_ids and attention_mask (n, T<=max_length), right-padded with the tokenizer's pad id."""
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    rows = [ids[:max_length] or [pad] for ids in tokenizer.encode(list(texts))]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), pad, dtype=torch.long)  # (n, T)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _pack_rows(pack, split: str) -> list[tuple[str, str]]:
    return [(s, r.domain) for r in pack.records(split) for s in split_sentences(r.text) if len(s.split()) >= 6]


def file_rows(path: Path) -> list[tuple[str, str]]:
    """(sentence, label) rows of a text file: ``label<TAB>text`` lines of a .tsv, else sentences labelled "text"."""
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


@entry("load_analysis_data")
def load_analysis_data(data, tokenizer, *, n: int = 256, seq_len: int = 64, seed: int = 0,
                       split: str = "validation") -> AnalysisData:
    """``n`` sentences of ``data`` (a pack directory, ``"default"``, or a text/TSV file)."""
    check_positive_int("n", n)
    check_positive_int("seq_len", seq_len)
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
        rows = file_rows(path)
        reference = [t for t, _ in rows]
        source = str(path)
    if len(rows) < n:
        raise fail("load_analysis_data", "n", f"must be at most the {len(rows)} sentences of {source}", n)
    pick = np.sort(np.random.default_rng(seed).choice(len(rows), n, replace=False))
    labels = pd.DataFrame([rows[i] for i in pick], columns=["text", "label"])
    phi = token_frequency(count_tokens(reference, tokenizer))
    labels["score"], labels["n_tokens"] = sentence_scores(labels["text"].tolist(), tokenizer, phi)
    return AnalysisData(encode_texts(tokenizer, labels["text"], seq_len), labels, source)
