"""Text units and cleaning shared by every corpus source.

A :class:`Record` is one paragraph-sized unit of real text with its labels. Loaders
yield records; the pack builder mixes, splits and stores them; the frequency module
scores their sentences.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple

from ntkscope.core.checks import UserError

#: The pack's tokenizer-free unit, used to measure shares before any BPE exists:
#: runs of word characters, or single other non-space characters.
WORD_RE = re.compile(r"\w+|[^\w\s]")

log = logging.getLogger(__name__)

_SPACE_RE = re.compile(r"\s+")
# A sentence ends at . ! or ? (optionally closed by quotes/brackets) before a space
# and an upper-case letter, digit or opening quote. Short abbreviations are guarded.
_SENTENCE_RE = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al mr mrs ms dr st no fig viz approx inc ltd co corp art sec "
    "u.s u.k jr sr prof gen rev ed eds vol pp p".split()
)
MAX_RECORD_WORDS = 160


class Record(NamedTuple):
    """One unit of text. ``doc`` names the document it came from (splits keep documents whole)."""

    text: str
    source: str
    domain: str
    category: str
    doc: str


def normalise_space(text: str) -> str:
    """NFC, every run of whitespace one space, stripped."""
    return _SPACE_RE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def count_words(text: str) -> int:
    return len(WORD_RE.findall(text))


def split_sentences(text: str) -> list[str]:
    """Split a paragraph into sentences (rule-based: no model download is possible here).

    Breaks after ``.``, ``!`` or ``?`` followed by a capital, digit or opening quote,
    except after a short abbreviation (``e.g.``, ``Inc.``, single initials).
    """
    pieces = _SENTENCE_RE.split(text)
    out: list[str] = []
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            continue
        if out:
            last_word = out[-1].rsplit(" ", 1)[-1].rstrip(".").lower()
            if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
                out[-1] = f"{out[-1]} {piece}"
                continue
        out.append(piece)
    return out


def split_long(text: str, max_words: int = MAX_RECORD_WORDS) -> list[str]:
    """Pack the sentences of an over-long paragraph into pieces of at most ~max_words."""
    if count_words(text) <= max_words:
        return [text]
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for sentence in split_sentences(text):
        n = count_words(sentence)
        if current and size + n > max_words:
            pieces.append(" ".join(current))
            current, size = [], 0
        current.append(sentence)
        size += n
    if current:
        pieces.append(" ".join(current))
    return pieces


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each with its whitespace normalised."""
    return [p for p in (normalise_space(b) for b in re.split(r"\n\s*\n", text)) if p]


def is_prose(text: str, min_letters: float = 0.6) -> bool:
    """At least ``min_letters`` of the non-space characters are letters (drops ASCII art, tables, code)."""
    chars = [c for c in text if not c.isspace()]
    return bool(chars) and sum(c.isalpha() for c in chars) >= min_letters * len(chars)


def make_records(texts: Iterable[str], *, source: str, domain: str, category: str, doc: str,
                 min_words: int = 3) -> Iterator[Record]:
    """Records from cleaned paragraphs: long ones split at sentences; fragments and non-prose dropped."""
    for text in texts:
        for piece in split_long(text):
            if count_words(piece) >= min_words and is_prose(piece):
                yield Record(piece, source, domain, category, doc)


def read_text(path: Path, data: bytes | None = None, *, func: str = "load_source",
              max_repairs: int = 10) -> str:
    """Decode UTF-8; an empty file or a non-UTF-8 byte is an error naming the file.

    Real dictionaries carry a few stray Windows-1252 bytes (GCIDE has three in 40 MB:
    ``0x92`` apostrophes and a ``0xe7`` c-cedilla): up to ``max_repairs`` lone bytes
    are decoded as Windows-1252, with a warning. Anything more is refused.
    """
    if data is None:
        data = Path(path).read_bytes()
    if not data.strip():
        raise UserError(f"{func}: {path} is empty")
    pieces: list[str] = []
    start = repairs = 0
    first: tuple[int, int] | None = None  # (offset, byte) of the first invalid byte
    while True:
        try:
            pieces.append(data[start:].decode("utf-8"))
            break
        except UnicodeDecodeError as err:
            pos = start + err.start
            first = first or (pos, data[pos])
            fixed = None
            if repairs < max_repairs and err.end - err.start == 1:
                try:
                    fixed = bytes([data[pos]]).decode("cp1252")
                except UnicodeDecodeError:
                    pass
            if fixed is None:
                raise UserError(f"{func}: {path} is not valid UTF-8 (byte {first[1]:#04x} at offset {first[0]}; "
                                f"at most {max_repairs} stray bytes are repaired)") from None
            pieces.append(data[start:pos].decode("utf-8"))
            pieces.append(fixed)
            repairs += 1
            start = pos + 1
    if repairs:
        log.warning("%s: %s: decoded %d stray byte(s) as Windows-1252", func, path, repairs)
    return "".join(pieces)


def dedupe(records: Iterable[Record]) -> Iterator[Record]:
    """Drop records whose text (case- and space-folded) was seen before; first one wins."""
    seen: set[str] = set()
    for record in records:
        key = record.text.casefold()
        if key not in seen:
            seen.add(key)
            yield record
