"""A corpus pack from the researcher's own table: their rows (JSONL, CSV, TSV or Parquet with a
text and a label column) as a pack, so that every experiment, command and table that reads a
pack reads their data: the labels are the pack's domains, ``tail`` names the long tail.

Rows are split whole by a seeded hash of their text (so a row lands in the same split whatever
else the table holds), repeated texts kept once; a byte-level BPE is trained on the train split
(or, for the researcher's own model, its ``tokenizer.json`` is the pack's, byte for byte);
the manifest records the table's path and sha256, the columns read and the shares measured. The
build is byte for byte reproducible from the same table and options.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path

from ntkscope.core.checks import check_fraction, check_positive_int, entry, fail
from ntkscope.core.files import sha256_file
from ntkscope.text.corpus.pack import (PACK_FORMAT, SPLITS, bpe_record, domain_records, jsonl_gz, sealed, split_of,
                                      write_atomic_dir)
from ntkscope.text.corpus.text import Record, count_words
from ntkscope.text.inputs import DataSource, as_source
from ntkscope.text.tokenization import load_tokenizer, train_bpe

log = logging.getLogger(__name__)


def table_digest(table) -> str:
    """The sha256 of a table file's bytes (what a pack built from it records)."""
    return hashlib.sha256(Path(table).read_bytes()).hexdigest()


def tokenizer_file(tokenizer) -> Path:
    """The ``tokenizer.json`` that ``tokenizer`` names: the file, or the one in that directory."""
    path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    if not path.is_file():
        raise fail("table_pack", "tokenizer", "must be a tokenizer.json or a directory holding one", str(tokenizer))
    return path


@entry("table_pack")
def table_pack(out, table, *, text_column: str = "text", label_column: str = "label", tail=None,
               validation: float = 0.1, test: float = 0.1, vocab_size: int = 8192, seed: int = 0,
               tokenizer=None, overwrite: bool = False) -> Path:
    """Write the pack of ``table``'s rows to ``out`` (module docstring) and return ``out``.
    ``tail``: the long tail's labels (default: every label but the one with the most words);
    ``tokenizer``: a ``tokenizer.json`` or an HF model directory holding one, the pack's tokenizer
    as it is (``vocab_size`` then unused); None: a BPE of ``vocab_size`` trained on the train split."""
    check_fraction("validation", validation)
    check_fraction("test", test)
    check_positive_int("vocab_size", vocab_size)
    if validation + test >= 1:
        raise fail("table_pack", "validation + test", "must be below 1", validation + test)
    source = as_source(table, columns=DataSource(None, text_column, label_column))
    if source.kind != "table":
        raise fail("table_pack", "table", "must be a table file (.jsonl, .csv, .tsv, .parquet)", str(table))
    name, seen, records = Path(table).name, set(), []
    for text, label in source.rows():
        if label is None or str(label) == "":
            raise fail("table_pack", "label_column", "must give every row a label (a domain)", label_column)
        if text in seen:
            continue
        seen.add(text)
        doc = "row-" + hashlib.sha256(text.encode()).hexdigest()[:16]
        records.append(Record(text, name, str(label), str(label), doc))
    words = Counter()
    for r in records:
        words[r.domain] += count_words(r.text)
    labels = sorted(words)
    if len(labels) < 2:
        raise fail("table_pack", "label_column", "must hold two labels or more (a long tail and the rest)", labels)
    tail = sorted(set(labels) - {max(labels, key=lambda d: (words[d], d))}) if tail is None else list(tail)
    if not tail or set(tail) - set(labels) or set(tail) == set(labels):
        raise fail("table_pack", "tail", f"must name some but not all of the table's labels {labels}", tail)
    splits = {s: [r for r in records if split_of(r.doc, seed, validation, test) == s] for s in SPLITS}
    for split, rows in splits.items():
        missing = sorted(set(labels) - {r.domain for r in rows})
        if missing:
            raise fail("table_pack", "table", f"must hold enough rows of each label for every split: {split} has "
                       f"none of {missing} (at validation {validation:g}, test {test:g})",
                       {d: sum(r.domain == d for r in records) for d in labels})
    files = {f"{s}.jsonl.gz": jsonl_gz(r._asdict() for r in splits[s]) for s in SPLITS}
    files["probe.jsonl.gz"] = jsonl_gz([])
    if tokenizer is None:
        trained = train_bpe([r.text for r in splits["train"]], vocab_size=vocab_size)
        files["tokenizer.json"] = trained.backend.to_str().encode()
        tokenizer_record, options = bpe_record(trained), {"vocab_size": vocab_size}
    else:
        given = tokenizer_file(tokenizer)
        files["tokenizer.json"] = given.read_bytes()
        tokenizer_record = {"kind": "given (HF tokenizers)", "from": str(given), "sha256": sha256_file(given),
                            "vocab_size": load_tokenizer(given).vocab_size}
        options = {"tokenizer": tokenizer_record["sha256"]}
    files["LICENSES.md"] = (f"# Licences\n\nEvery text of this pack is a row of `{name}` (sha256 "
                            f"{table_digest(table)}), the researcher's own data under its own terms.\n").encode()
    total = sum(words.values())
    manifest = {
        "format": PACK_FORMAT, "builder": "ntkscope.text.corpus.table_pack", "seed": seed,
        "table": {"path": str(table), "sha256": table_digest(table), "text_column": text_column,
                  "label_column": label_column, "rows_kept": len(records)},
        "options": {"validation": validation, "test": test, **options},
        "tail": tail, "share_measured": sum(words[d] for d in tail) / total,
        "domains": {d: {"tokens": words[d], "share": words[d] / total} for d in labels},
        "splits": {s: {"records": len(splits[s]), "tokens": sum(count_words(r.text) for r in splits[s]),
                       "by_domain": domain_records(splits[s])} for s in SPLITS},
        "probe": {"held_out_docs": 0, "tasks": {}},
        "tokenizer": tokenizer_record,
    }
    write_atomic_dir(Path(out), sealed(manifest, files), overwrite=overwrite)
    log.info("table_pack: wrote %s from %s (%d rows; labels %s; tail %s, %.1f %% of the words)", out, table,
             len(records), labels, tail, 100 * manifest["share_measured"])
    return Path(out)
