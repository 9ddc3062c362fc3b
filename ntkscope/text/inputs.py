"""What ``--data`` names, read one way for every command (docs/design.md §2).

- A corpus pack (a directory with ``manifest.json``, or ``"default"`` for the shipped one):
  the sentences of one split (at least 6 words), label = domain; sentence frequency counts
  over its train split.
- A table, one text per row, read by pandas: JSON lines (``.jsonl``, ``.ndjson``), CSV
  (``.csv``), TSV with a header (``.tsv``), Parquet (``.parquet``); ``.gz`` compressed
  text formats too. The text comes from ``text_column`` (default ``"text"``), the label from
  ``label_column`` (default: a ``"label"`` column when there is one, else ``"text"``).
- A Hugging Face ``datasets`` directory written by ``save_to_disk``, read by
  ``datasets.load_from_disk`` (``pip install 'ntkscope[datasets]'``) with the same columns;
  a ``DatasetDict`` is named by one split's directory (``DIR/validation``).
- A headerless ``.tsv`` (``label<TAB>text`` lines), and a ``.txt`` or other UTF-8 text file
  (each line is a row, split into sentences when it holds several, never joined to the next
  line; label ``"text"``).
- A name that says no format (a pipe such as ``<(zcat rows.jsonl.gz)``, ``/dev/fd/N``, a FIFO,
  a file without a known suffix) is sniffed once (:func:`sniff_format`: gzip and Parquet by
  their magic, JSON lines, a CSV/TSV header naming the text column), never read as text when it
  holds JSON; a pipe that holds none of these is refused unless ``format`` names its format.

A table or a file's frequency counts are over its own texts, unless ``frequency_from``
names other data (e.g. the training set), read by the same rules. Bad files get one line
naming the file and what is wrong: a missing column, a non-text column, an empty file, a
malformed line.
"""

from __future__ import annotations

import atexit
import gzip
import json
import logging
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import InputError, MissingInput, MissingPackage, UserError, entry
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.text import normalise_space, read_text, split_sentences
from ntkscope.text.frequency import TokenCounts, count_tokens

log = logging.getLogger(__name__)

_READERS = {"jsonl": lambda p, z: pd.read_json(p, lines=True, dtype=False, compression=z),
            "csv": lambda p, z: pd.read_csv(p, dtype=str, keep_default_na=False, na_values=[""], compression=z),
            "tsv": lambda p, z: pd.read_csv(p, sep="\t", dtype=str, keep_default_na=False, na_values=[""],
                                            compression=z),
            "parquet": lambda p, z: pd.read_parquet(p)}
#: what a file's name says of its format (``.gz`` set aside); any other name is sniffed (:func:`sniff_format`)
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet",
                  ".txt": "text", ".text": "text"}
TABLE_SUFFIXES = tuple(s for s, f in SUFFIX_FORMATS.items() if f != "text")
FORMATS = ("auto", "jsonl", "csv", "tsv", "parquet", "text")
_GZIP, _PARQUET = b"\x1f\x8b", b"PAR1"
_SNIFFED = 1 << 16  # bytes looked at to tell a format
_COUNTS: dict = {}  # (data identity, tokenizer) -> TokenCounts
_COUNTS_KEPT = 4
_SPOOLED: dict = {}  # a pipe's path -> the regular file it was read into
_TEXT_ROWS: dict = {}  # (path, size, mtime) -> a text file's rows
_FUNC = "analysis data"
_HELP = ("a corpus pack directory, 'default', a table (.jsonl, .csv, .tsv, .parquet; optionally .gz) with a text "
         "column, a datasets save_to_disk directory, or a UTF-8 text file")


def _suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


@dataclass(frozen=True)
class DataSource:
    """Analysis data and how to read it.

    Attributes
    ----------
    path : Path or None
        None for the shipped pack.
    text_column, label_column : str, str or None
        For tables and ``datasets`` directories.
    frequency_from : str or None
        Other data whose token counts define sentence frequency (read with the same columns).
    """

    path: Path | None = None
    text_column: str = "text"
    label_column: str | None = None
    frequency_from: str | None = None
    format: str = "auto"

    def __post_init__(self):
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise InputError("path", "must be a path (a str or a pathlib.Path) or None", type(self.path).__name__,
                             func=_FUNC)
        if isinstance(self.path, str):  # DataSource("rows.jsonl") as well as DataSource(Path(...))
            object.__setattr__(self, "path", Path(self.path))
        if self.frequency_from is not None and not isinstance(self.frequency_from, (str, os.PathLike)):
            raise InputError("frequency_from", "must be a path (a str or a pathlib.Path) or None",
                             type(self.frequency_from).__name__, func=_FUNC)
        for name in ("text_column", "label_column"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "label_column" and value is None):
                raise InputError(name, "must be a column name (a str)" + (" or None" if name == "label_column" else ""),
                                 value, func=_FUNC)
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise InputError("format", f"must be one of {list(FORMATS)}", self.format, func=_FUNC)

    @cached_property
    def file_format(self) -> str:
        """A file's format: ``format`` when named, else its name's (:data:`SUFFIX_FORMATS`), else
        sniffed from its first bytes (:func:`sniff_format`; a pipe with plain text is refused)."""
        if self.format != "auto":
            return self.format
        return SUFFIX_FORMATS.get(_suffix(self.path)) or sniff_format(self.path, self.text_column)

    def __str__(self) -> str:
        return "default" if self.path is None else str(self.path)

    @cached_property
    def kind(self) -> str:
        """"pack", "datasets", "table" or "text" (looked at once per DataSource)."""
        if self.path is None:
            return "pack"
        if self.path.is_dir():
            datasets = (self.path / "state.json").is_file() or (self.path / "dataset_dict.json").is_file()
            return "datasets" if datasets else "pack"
        fmt = self.file_format
        if fmt != "text" and not (fmt == "tsv" and _headerless_tsv(self.path, self.text_column)):
            return "table"
        return "text"

    def options(self) -> dict:
        """The settings that define the data (for a result's options)."""
        return {"data": str(self), "text_column": self.text_column, "label_column": self.label_column,
                "frequency_from": self.frequency_from,
                **({"data_format": self.format} if self.format != "auto" else {})}

    @property
    def files(self) -> list[Path]:
        """The files the data comes from (for a result's digest)."""
        return [p for p in (self.path, Path(self.frequency_from) if self.frequency_from else None) if p is not None]

    def pack(self):
        """The corpus pack (loaded and verified once per DataSource)."""
        return self._pack

    @cached_property
    def _pack(self):
        return load_pack(self.path)

    def rows(self, split: str = "validation") -> list[tuple[str, str]]:
        """(text, label) rows: a pack's sentences of ``split``, a table's rows, a text file's sentences."""
        kind = self.kind
        if kind == "pack":
            pack = self.pack()
            return [(s, r.domain) for r in pack.records(split) for s in split_sentences(r.text) if len(s.split()) >= 6]
        if kind in ("table", "datasets"):
            frame = _read_datasets(self.path) if kind == "datasets" else _read_table(self.path, self.file_format)
            return _table_rows(self.path, frame, self.text_column, self.label_column)
        return _text_rows(self.path, tsv=self.file_format == "tsv")

    def _identity(self) -> tuple:
        """What the data's texts depend on: a pack's version, a file's path, size and time."""
        if self.kind == "pack":
            return ("pack", str(self.pack().path), self.pack().manifest.get("version"))
        stat = self.path.stat()
        return (self.kind, str(self.path.resolve()), stat.st_size, stat.st_mtime_ns, self.text_column,
                self.file_format)

    def reference_counts(self, tokenizer) -> TokenCounts:
        """Token counts of :meth:`reference_texts`, kept for the process (a few, by data and tokenizer)."""
        source = self if self.frequency_from is None else \
            as_source(self.frequency_from, columns=replace(self, format="auto"))
        key = (source._identity(), tokenizer.name, tokenizer.vocab_size, tuple(sorted(tokenizer.special_ids)))
        if key not in _COUNTS:
            while len(_COUNTS) >= _COUNTS_KEPT:
                _COUNTS.pop(next(iter(_COUNTS)))
            _COUNTS[key] = count_tokens(source.reference_texts(), tokenizer)
        return _COUNTS[key]

    def reference_texts(self) -> list[str]:
        """The texts whose token counts define sentence frequency."""
        if self.frequency_from is not None:
            return as_source(self.frequency_from, columns=replace(self, format="auto")).reference_texts()
        if self.kind == "pack":
            return [r.text for r in self.pack().records("train")]
        return [text for text, _ in self.rows()]


@entry("as_source")
def as_source(data, *, columns: DataSource | None = None) -> DataSource:
    """``data`` (a DataSource, a path, ``"default"`` or None) as a :class:`DataSource` that
    exists; ``columns`` lends its text / label columns to a bare path."""
    if columns is not None and not isinstance(columns, DataSource):
        raise InputError("columns", "must be a DataSource or None", type(columns).__name__)
    if isinstance(data, DataSource):
        source = data
    else:
        if data is not None and not isinstance(data, (str, os.PathLike)):
            raise InputError("data", "must be a DataSource, a path, 'default' or None", type(data).__name__)
        path = None if data is None or data == "default" else Path(data)
        source = DataSource(path) if columns is None else replace(columns, path=path, frequency_from=None)
    if source.path is not None and not source.path.exists():
        if source.path.is_symlink():  # exists() follows the link: say what is really wrong
            raise MissingInput(f"{_FUNC}: {source.path} is a symbolic link to nothing, or a loop of links")
        raise MissingInput(f"{_FUNC}: {source.path} does not exist ({_HELP})")
    if source.path is not None and not source.path.is_dir() and not source.path.is_file():
        pipe = source.path
        source = replace(source, path=_spooled(pipe))  # a pipe (FIFO, <(zcat ...)) can be read only once
        if source.format == "auto" and _suffix(source.path) not in SUFFIX_FORMATS:
            source = replace(source, format=sniff_format(source.path, source.text_column, pipe=pipe))
    elif source.path is not None and source.path.is_file():
        source.file_format  # noqa: B018 (a file of unknown format is refused here, before any work)
    if source.frequency_from is not None and not Path(source.frequency_from).exists():
        raise MissingInput(f"{_FUNC}: frequency_from {source.frequency_from} does not exist ({_HELP})")
    return source


def pipe_limit() -> tuple[int, str]:
    """The most bytes a pipe is read into a temporary file, and which limit that is (what raises
    it): ``$NTKSCOPE_MAX_PIPE_GIB`` GiB (default 16), and never more than 90 % of the space free
    where temporary files go."""
    try:
        gib = float(os.environ.get("NTKSCOPE_MAX_PIPE_GIB", "16"))
    except ValueError:
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise UserError(f"{_FUNC}: NTKSCOPE_MAX_PIPE_GIB must be a positive number of GiB (got "
                        f"{os.environ.get('NTKSCOPE_MAX_PIPE_GIB')!r})")
    space = int(0.9 * shutil.disk_usage(tempfile.gettempdir()).free)
    if space < gib * 2**30:
        return space, (f"{space / 2**30:.3g} GiB, 90 % of the space free in {tempfile.gettempdir()} (free some, or "
                       "point TMPDIR elsewhere)")
    return int(gib * 2**30), (f"{gib:.3g} GiB, the most a pipe is read into a temporary file (raise "
                              "NTKSCOPE_MAX_PIPE_GIB)")


def _spooled(path: Path) -> Path:
    """A regular file holding what the pipe ``path`` gives, read once per process (same base name,
    so its suffix still says its format), at most :func:`pipe_limit` bytes: an endless pipe
    (``/dev/zero``, ``<(yes)``) is refused in one line and its copy deleted."""
    key = str(path)
    if key not in _SPOOLED:
        limit, said = pipe_limit()
        folder = tempfile.mkdtemp(prefix="ntkscope-data-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # any exit, SIGTERM included (the command's handler)
        copy = Path(folder) / path.name
        read = 0
        with open(path, "rb") as src, open(copy, "wb") as dst:
            while chunk := src.read(1 << 20):
                read += len(chunk)
                if read > limit:
                    break
                dst.write(chunk)
        if read > limit:
            shutil.rmtree(folder, ignore_errors=True)
            raise UserError(f"{_FUNC}: {path} gave more than {said}; a pipe without end? Write it "
                            "to a file first")
        log.info("%s: %s is a pipe: read once into %s", _FUNC, path, copy)
        _SPOOLED[key] = copy
    return _SPOOLED[key]


def _gzipped(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP


def sniff_format(path: Path, text_column: str = "text", *, pipe: Path | None = None) -> str:
    """The format of a file whose name does not say it, from its first bytes (gzip's are
    decompressed first): Parquet's magic; JSON lines when the first line is a JSON object; CSV or
    TSV when the first line is a header naming ``text_column``; else plain text for a file, while a
    pipe (``pipe``: its name; ``path`` is where it was read into) that holds neither is refused:
    name its format (``--format``). Bytes that are not UTF-8 text are refused either way."""
    shown = pipe or path
    with open(path, "rb") as f:
        head = f.read(_SNIFFED)
    if head[:2] == _GZIP:
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(_SNIFFED)
        except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as err:
            raise UserError(f"{_FUNC}: {shown} is a truncated or damaged gzip file ({err})") from None
    if head[:4] == _PARQUET:
        return "parquet"
    text = head.decode("utf-8", errors="replace")
    if "\ufffd" in text[:-4]:  # (the cut may split the last character)
        raise UserError(f"{_FUNC}: cannot tell the format of {shown} (not UTF-8 text, nor gzip or Parquet); name the "
                        f"format with --format ({', '.join(FORMATS[1:])})")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except json.JSONDecodeError:
            pass
    for fmt, sep in (("tsv", "\t"), ("csv", ",")):
        if text_column in [c.strip().strip('"') for c in first.split(sep)] and sep in first:
            return fmt
    if pipe:
        raise UserError(f"{_FUNC}: cannot tell the format of {shown}, a pipe (no JSON lines, no header naming "
                        f"{text_column!r}, not Parquet); name the format with --format ({', '.join(FORMATS[1:])})")
    return "text"


def _headerless_tsv(path: Path, text_column: str) -> bool:
    """A TSV whose first line does not name ``text_column``: ``label<TAB>text`` lines."""
    if _gzipped(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return text_column not in f.readline().rstrip("\r\n").split("\t")


def _read_table(path: Path, fmt: str) -> pd.DataFrame:
    if path.stat().st_size == 0:
        raise UserError(f"{_FUNC}: {path} is empty")
    try:
        return _READERS[fmt](path, "gzip" if _gzipped(path) else None)
    except pd.errors.EmptyDataError:
        raise UserError(f"{_FUNC}: {path} is empty") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # a download cut short
        raise UserError(f"{_FUNC}: {path} is a truncated or damaged gzip file ({err})") from None
    except (ValueError, OSError, UnicodeDecodeError, pd.errors.ParserError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0][:160]
        where = _bad_json_line(path) if fmt == "jsonl" else None
        raise UserError(f"{_FUNC}: {path} is not a readable {fmt} table ({where or first})") from None


def _bad_json_line(path: Path) -> str | None:
    """Where a JSON-lines file first breaks: the line that is not a JSON object."""
    opener = gzip.open if _gzipped(path) else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                return f"line {i} is not JSON: {err.msg} ({line.strip()[:40]!r})"
            if not isinstance(value, dict):
                return f"line {i} is not a JSON object ({line.strip()[:40]!r})"
    return None


def _read_datasets(path: Path) -> pd.DataFrame:
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise UserError(f"{_FUNC}: {path} is a datasets DatasetDict; name one split's directory "
                        f"({', '.join(str(path / s) for s in splits)})")
    try:
        import datasets  # optional: pip install 'ntkscope[datasets]'
    except ImportError:
        raise MissingPackage(f"{_FUNC}: {path} is a datasets directory; install datasets to read it "
                             "(pip install 'ntkscope[datasets]')") from None
    return datasets.load_from_disk(str(path)).to_pandas()


def _table_rows(path: Path, frame: pd.DataFrame, text_column: str, label_column: str | None) -> list[tuple[str, str]]:
    """(text, label) of each row with text; every command reads a table through here. A row with no
    text, or with no label in the label column (the key absent from a JSON line, null, or empty),
    is left out, with one warning for each kind that names the file, the column, how many rows and
    the first; a label column that labels no row with text is refused in one line."""
    columns = [str(c) for c in frame.columns]
    for arg, column in (("text_column", text_column), ("label_column", label_column)):
        if column is not None and column not in columns:
            raise InputError(arg, f"must name a column of {path} ({', '.join(columns) or 'none'}; --{arg.replace('_', '-')})",
                             column, func=_FUNC)
    if label_column is None and "label" in columns and text_column != "label":
        label_column = "label"
    if frame.empty:
        raise UserError(f"{_FUNC}: {path} has no rows")
    texts = frame[text_column]
    missing = texts.isna()
    bad = [(i, v) for i, (v, m) in enumerate(zip(texts, missing)) if not m and not isinstance(v, str)]
    if bad:
        row, value = bad[0]
        raise UserError(f"{_FUNC}: {path} column {text_column!r} must hold text; row {row + 1} holds "
                        f"{type(value).__name__} {str(value)[:60]!r} ({len(bad)} such rows in all)")
    keep = ~missing & texts.fillna("").str.strip().astype(bool)
    if not keep.any():
        raise UserError(f"{_FUNC}: {path} column {text_column!r} has no non-empty text")
    if not keep.all():
        log.warning("%s: %s: %d of %d rows have no text in %r and are left out", _FUNC, path, int((~keep).sum()),
                    len(frame), text_column)
    if not label_column:
        return [(t.strip(), "text") for t in texts[keep]]
    labels = frame[label_column]
    unlabelled = keep & (labels.isna() | labels.map(lambda v: isinstance(v, str) and not v.strip()))
    if unlabelled.sum() == keep.sum():
        raise UserError(f"{_FUNC}: {path} column {label_column!r} has no label in any of its {int(keep.sum())} rows "
                        "with text; name a column that labels the rows (--label-column)")
    if unlabelled.any():
        first = int(unlabelled.to_numpy().nonzero()[0][0]) + 1
        log.warning("%s: %s: %d of %d rows have no label in %r (the first: row %d) and are left out", _FUNC, path,
                    int(unlabelled.sum()), len(frame), label_column, first)
        keep = keep & ~unlabelled
    _warn_mixed_labels(path, label_column, labels[keep])
    return [(t.strip(), label) for t, label in zip(texts[keep], labels[keep].astype(str))]


def _warn_mixed_labels(path, column: str, labels: pd.Series) -> None:
    """One warning when a label column mixes types (1, "1", 1.0, True in JSON lines): labels are
    compared as text, so some spellings become one label ("1" and 1) and others stay apart (1.0)."""
    kinds = sorted({type(v).__name__ for v in labels})
    if len(kinds) < 2:
        return
    spelled: dict[str, set] = {}
    for value in labels:
        spelled.setdefault(str(value), set()).add(f"{value!r} ({type(value).__name__})")
    merged = [sorted(v) for v in spelled.values() if len(v) > 1]
    log.warning("%s: %s column %r mixes labels of types %s; they are compared as text, so %s; write each label one "
                "way (all text, or all integers)", _FUNC, path, column, kinds,
                f"{' and '.join(merged[0])} are one label" if merged else "1 and 1.0 would be two labels")


def _text_rows(path: Path, *, tsv: bool = False) -> list[tuple[str, str]]:
    """``label<TAB>text`` lines of a headerless .tsv, else each line's sentences labelled ``"text"`` (a line is
    never joined to the next; ``.gz``: decompressed);
    read once per file version in a process (its warnings said once)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, tsv)
    if key not in _TEXT_ROWS:
        if len(_TEXT_ROWS) >= _COUNTS_KEPT:
            _TEXT_ROWS.pop(next(iter(_TEXT_ROWS)))
        _TEXT_ROWS[key] = _read_text_rows(path, tsv)
    return list(_TEXT_ROWS[key])


def _read_text_rows(path: Path, tsv: bool) -> list[tuple[str, str]]:
    data = None
    if _gzipped(path):
        try:
            data = gzip.decompress(path.read_bytes())
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise UserError(f"{_FUNC}: {path} is a truncated or damaged gzip file ({err})") from None
    text = read_text(path, data, func=_FUNC)
    if tsv:
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            label, sep, sentence = line.partition("\t")
            if not sep or not sentence.strip():
                raise UserError(f"{_FUNC}: {path} line {i} is not 'label<TAB>text' (got {line[:60]!r})")
            rows.append((sentence.strip(), label.strip()))
        return rows
    # a line is a row (its sentences, if it holds several): never joined to the next line
    return [(s, "text") for line in text.splitlines() for s in split_sentences(normalise_space(line)) if s.split()]
