"""Dictionaries in dictd format: GCIDE (Webster 1913 + additions), FOLDOC, the Jargon File.

A dictd dictionary is an index (``headword<TAB>offset<TAB>length``, offset and length
written in base-64 digits ``A-Za-z0-9+/``) and a dictzip file (gzip-compatible) that
the offsets point into. Entries are read through the index; several headwords can
point at one entry, which is read once. Markup is stripped the way a reader of the
printed dictionary would expect: cross-reference braces, pronunciations, etymologies,
source tags (``[1913 Webster]``), quotation attributions (``--Shak.``) and dates go;
sense numbers go; a field label such as ``(Zool.)`` or ``<language>`` becomes the
record's category.
"""

from __future__ import annotations

import codecs
import gzip
import re
from pathlib import Path
from typing import Iterator

from ntkscope.core.checks import UserError
from ntkscope.text.corpus.text import Record, make_records, normalise_space, read_text

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
UNLABELLED = "none"


def _slice_errors(err: UnicodeDecodeError) -> tuple[str, int]:
    """A stray byte that read_text accepted decodes as Windows-1252; a cut character is dropped."""
    byte = err.object[err.start]
    if err.end - err.start == 1:
        try:
            return bytes([byte]).decode("cp1252"), err.end
        except UnicodeDecodeError:
            pass
    return "", err.end


codecs.register_error("ntkscope-dictd", _slice_errors)


def decode_b64_number(digits: str) -> int:
    """dictd's base-64 numbers: ``"Fz"`` -> 5*64 + 51."""
    value = 0
    for c in digits:
        value = value * 64 + _B64[c]
    return value


def read_entries(index: Path, dict_dz: Path) -> Iterator[tuple[str, str]]:
    """(headword, entry text) for each distinct entry, in file order; metadata entries skipped."""
    index_text = read_text(index)
    raw = gzip.open(dict_dz, "rb").read()
    read_text(dict_dz, raw)  # the whole file is checked (and its stray bytes counted) once
    spans: dict[int, tuple[str, int]] = {}
    for line_no, line in enumerate(index_text.splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 3:
            raise UserError(f"load_source: {index} line {line_no} is not 'headword<TAB>offset<TAB>length' "
                            f"(got {line[:80]!r})")
        head, offset, length = fields[0], decode_b64_number(fields[1]), decode_b64_number(fields[2])
        if head.startswith(("00-", "00database")):  # dictd's metadata entries
            continue
        if offset not in spans or length > spans[offset][1]:
            spans[offset] = (head, length)
    for offset in sorted(spans):
        head, length = spans[offset]
        # Some indexes count lengths in characters: a span can end inside a character.
        yield head, raw[offset:offset + length].decode("utf-8", errors="ntkscope-dictd")


# --- GCIDE -----------------------------------------------------------------------------

_BRACKETS = re.compile(r"\[[^\[\]]*\]")  # etymologies, source tags, usage labels: editorial
_ATTRIBUTION = re.compile(r"\s--\s?[A-Z(][^\[]*?(?=$|\[)")
_SENSE = re.compile(r"^(?:\d+\.|\([a-z]\))\s+")
_FIELD = re.compile(r"^(?:\{[^}]*\}\s*,?\s*)?\(([A-Z][A-Za-z.&' -]{0,40}?\.?)\)[,:]?\s+")
_BRACES = re.compile(r"\{\s*([^{}]*?)\s*\}")
_PRONUNCIATION = re.compile(r"\\[^\\]*\\")


def _gcide_header_end(lines: list[str]) -> int:
    """The headword line, plus continuation lines while its pronunciation or etymology is open."""
    depth = slashes = i = 0
    for i, line in enumerate(lines):
        depth += line.count("[") - line.count("]")
        slashes += line.count("\\")
        if depth <= 0 and slashes % 2 == 0:
            return i + 1
    return i + 1


def gcide_records(index: Path, dict_dz: Path, *, source: str = "gcide") -> Iterator[Record]:
    """One record per sense (or quotation, or usage note); category = the sense's field label."""
    for head, entry in read_entries(index, dict_dz):
        lines = entry.splitlines()
        body = "\n".join(lines[_gcide_header_end(lines):])
        for block in re.split(r"\n\s*\n", body):
            text = normalise_space(block)
            if not text or text.startswith(("Syn:", "Syn.")):
                continue
            text = _ATTRIBUTION.sub("", _BRACKETS.sub("", _BRACKETS.sub("", text)))
            text = _SENSE.sub("", normalise_space(_PRONUNCIATION.sub("", text)))
            category = UNLABELLED
            field = _FIELD.match(text)
            if field:
                category = field.group(1)
                text = text[:field.start(1) - 1] + text[field.end():]
            text = normalise_space(_BRACES.sub(r"\1", text).replace("{", "").replace("}", ""))
            text = text.strip(" ,;:")
            yield from make_records([text], source=source, domain="general", category=category,
                                    doc=f"{source}:{head}")


# --- FOLDOC and the Jargon File ----------------------------------------------------------

_CATEGORY_TAG = re.compile(r"^<([A-Za-z][\w ,.+/-]*)>")
_EMAIL = re.compile(r"<[^<>\s]+@[^<>\s]+>")
_BOX_DRAWING = re.compile("[\u2500-\u257f]")
_DATE = re.compile(r"\(\d{4}-\d{2}-\d{2}\)")
_URL = re.compile(r"\{?\(?(?:https?|ftp)://[^\s)}]+\)?\}?")


def _body_paragraphs(entry: str) -> list[str]:
    """Drop the headword block (everything up to the first blank line)."""
    parts = re.split(r"\n\s*\n", entry, maxsplit=1)
    return re.split(r"\n\s*\n", parts[1]) if len(parts) == 2 else []


def glossary_records(index: Path, dict_dz: Path, *, source: str, tags: bool) -> Iterator[Record]:
    """FOLDOC / Jargon entries: one record per paragraph; category = FOLDOC's first ``<tag>``."""
    for head, entry in read_entries(index, dict_dz):
        category = UNLABELLED
        texts = []
        for block in _body_paragraphs(entry):
            text = normalise_space(block)
            if _BOX_DRAWING.search(text):
                continue  # a drawn table, not prose
            text = _SENSE.sub("", text)
            tag = _CATEGORY_TAG.match(text) if tags else None
            if tag:
                if category == UNLABELLED:
                    category = tag.group(1).split(",")[0].strip().lower()
                text = text[tag.end():]
            text = _EMAIL.sub("", _URL.sub("", _DATE.sub("", text))).strip()
            if text.startswith('["') or re.fullmatch(r"\[[^\]]*\]\.?", text):
                continue  # bibliography entries
            text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # a leading provenance note
            texts.append(normalise_space(_BRACES.sub(r"\1", text).replace("{", "").replace("}", "")))
        yield from make_records(texts, source=source, domain="general", category=category,
                                doc=f"{source}:{head}")
