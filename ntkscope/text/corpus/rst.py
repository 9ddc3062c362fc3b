"""The Python documentation's reStructuredText sources, read as prose.

Sphinx's roles and directives are not plain docutils, so the markup is stripped with
rules a reader would agree with: code (literal blocks after ``::``, doctest blocks,
``code-block``/``testcode``/``productionlist`` directives), tables, tables of contents,
index entries, labels and comments are dropped; admonitions (``note``, ``warning``,
``versionchanged``, ...) and API descriptions (``function``, ``class``, ...) keep their
prose; inline roles keep their text (``:func:`~os.path.join``` -> ``join``), links keep
their title, emphasis markers go. The category is the top-level section of the docs
(``library``, ``reference``, ``tutorial``, ...).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from ntkscope.core.checks import UserError
from ntkscope.text.corpus.text import Record, make_records, paragraphs, read_text

#: Directives whose indented body is prose worth keeping.
PROSE_DIRECTIVES = frozenset(
    "note warning tip hint important caution attention danger seealso versionadded versionchanged "
    "deprecated deprecated-removed impl-detail function method class attribute data exception "
    "describe decorator classmethod staticmethod opcode cmdoption envvar option availability topic "
    "sidebar admonition glossary".split()
)
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:([\w:-]+)::)?")
_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+_.:])\1{2,}\s*$")
_TABLE = re.compile(r"^\s*(\+[-=+]+\+|=+(\s+=+)+|\|.*\|)\s*$")
_BULLET = re.compile(r"^(?:[*+-]|#\.|\d+\.)\s+")
_ROLE = re.compile(r":[\w:+.-]+:`(?:[^`<]*?<)?~?([^`>]*?)>?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
_REF = re.compile(r"`([^`]+)`_{1,2}")
_LITERAL = re.compile(r"``(.+?)``")
_EMPHASIS = re.compile(r"(\*{1,2})(\S(?:.*?\S)?)\1")
_FOOTNOTE = re.compile(r"\s*\[#?[\w-]*\]_")
_SUBSTITUTION = re.compile(r"\|(\w[\w ]*)\|")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _strip_blocks(lines: list[str]) -> list[str]:
    """Drop code, tables and non-prose directives; keep prose directive bodies."""
    out: list[str] = []
    skip_deeper_than: int | None = None
    literal_next = False
    for line in lines:
        if skip_deeper_than is not None:
            if not line.strip() or _indent(line) > skip_deeper_than:
                continue
            skip_deeper_than = None
        if literal_next and line.strip():
            literal_next = False
            if out and _indent(line) > _indent(out[-1] if out[-1].strip() else line) - 1:
                skip_deeper_than = _indent(out[-1]) if out[-1].strip() else _indent(line) - 1
                continue
        directive = _DIRECTIVE.match(line)
        if directive:
            name = (directive.group(2) or "").split(":")[-1]
            if name in PROSE_DIRECTIVES:
                out.append("")  # the directive line itself (a signature or a label) is not prose
                continue
            skip_deeper_than = len(directive.group(1))
            continue
        if _ADORNMENT.match(line) or _TABLE.match(line) or line.lstrip().startswith((">>>", "...", ":")):
            out.append("")
            continue
        if line.rstrip().endswith("::"):
            literal_next = True
            line = line.rstrip()[:-1] if not line.rstrip().endswith(" ::") else line.rstrip()[:-3]
        out.append(line)
    return out


def _strip_inline(text: str) -> str:
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    text = _LINK.sub(r"\1", text)
    text = _REF.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\2", text)
    text = _FOOTNOTE.sub("", text)
    return _SUBSTITUTION.sub(r"\1", text).replace("\\", "")


def rst_records(root: Path, *, source: str = "python-docs") -> Iterator[Record]:
    """Every ``*.rst.txt`` under ``root``; one record per prose paragraph."""
    files = sorted(root.rglob("*.rst.txt"))
    if not files:
        raise UserError(f"load_source: {root} has no *.rst.txt files")
    for path in files:
        rel = path.relative_to(root)
        category = rel.parts[0] if len(rel.parts) > 1 else "front-matter"
        text = "\n".join(_strip_blocks(read_text(path).splitlines()))
        texts = [_BULLET.sub("", _strip_inline(p)) for p in paragraphs(text)]
        yield from make_records(texts, source=source, domain="general", category=category,
                                doc=f"{source}:{rel.as_posix()}")
