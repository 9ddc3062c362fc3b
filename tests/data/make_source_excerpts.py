"""Cut small excerpts of the real sources, in their native formats, for the loader tests.

Run once on a machine with the sources installed (see README, "The full corpus pack"):

    NTKSCOPE_SOURCES=... python tests/data/make_source_excerpts.py

It writes tests/data/sources/{root,data}: ``root`` mirrors the system paths of the
Debian packages, ``data`` holds the downloaded files. Every byte comes from the real
files (entries are selected, never edited), so the loaders are tested on the real
formats on machines without the packages. Licences: see tests/data/sources/README.md.
"""

from __future__ import annotations

import gzip
import shutil
import sqlite3
import zipfile
from pathlib import Path

from ntkscope.text.corpus.dictd import _B64
from ntkscope.text.corpus.sources import SCANCODE_PREFIX, SOURCES

OUT = Path(__file__).resolve().parent / "sources"
ROOT, DATA = OUT / "root", OUT / "data"


def b64(n: int) -> str:
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = digits[n % 64] + out
        n //= 64
        if n == 0:
            return out


def dictd(name: str, heads: list[str]) -> None:
    index = Path(f"/usr/share/dictd/{name}.index").read_text(encoding="utf-8").splitlines()
    raw = gzip.open(f"/usr/share/dictd/{name}.dict.dz", "rb").read()
    dec = lambda s: sum(_B64[c] * 64 ** i for i, c in enumerate(reversed(s)))  # noqa: E731
    chosen = [line.split("\t") for line in index if line.split("\t")[0] in heads or line.startswith("00-database-short")]
    body, lines = b"", []
    for head, off, length in chosen:
        entry = raw[dec(off):dec(off) + dec(length)]
        lines.append(f"{head}\t{b64(len(body))}\t{b64(len(entry))}")
        body += entry
    dest = ROOT / "usr/share/dictd"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{name}.index").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.GzipFile(dest / f"{name}.dict.dz", "wb", mtime=0) as fh:
        fh.write(body)


def wordnet() -> None:
    dest = ROOT / "usr/share/wordnet"
    dest.mkdir(parents=True, exist_ok=True)
    for pos in ("noun", "verb", "adj", "adv"):
        lines = Path(f"/usr/share/wordnet/data.{pos}").read_text(encoding="utf-8").splitlines(keepends=True)
        header = [x for x in lines[:40] if x.startswith("  ")]
        body = [x for x in lines if not x.startswith("  ")]
        (dest / f"data.{pos}").write_text("".join(header + body[::max(1, len(body) // 25)][:25]), encoding="utf-8")


def python_docs() -> None:
    src = Path("/usr/share/doc/python3.11/html/_sources")
    for rel in ("library/json.rst.txt", "tutorial/controlflow.rst.txt", "glossary.rst.txt"):
        dest = ROOT / "usr/share/doc/python3.11/html/_sources" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        lines = (src / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        dest.write_text("".join(lines[:160]), encoding="utf-8")


def fortunes() -> None:
    dest = ROOT / "usr/share/games/fortunes"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("science", "law", "medicine"):
        text = Path(f"/usr/share/games/fortunes/{name}").read_text(encoding="utf-8")
        (dest / name).write_text("%\n".join(text.split("%\n")[:12]), encoding="utf-8")
        shutil.copyfile(f"/usr/share/games/fortunes/{name}.dat", dest / f"{name}.dat")  # strfile index: skipped
        (dest / f"{name}.u8").symlink_to(name)


def scancode(wheel: Path) -> None:
    keys = ["mit", "apache-2.0", "gpl-2.0", "bsd-new", "android-sdk-2009", "cc-by-4.0", "lgpl-2.1"]
    with zipfile.ZipFile(wheel) as zf:
        deprecated = next(n for n in sorted(zf.namelist())
                          if n.startswith(SCANCODE_PREFIX) and b"is_deprecated: yes" in zf.read(n))
        DATA.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(DATA / wheel.name, "w", zipfile.ZIP_DEFLATED) as out:
            for name in [f"{SCANCODE_PREFIX}{k}.LICENSE" for k in keys] + [deprecated]:
                out.writestr(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), zf.read(name))


def go(sqlite_path: Path) -> None:
    dest = DATA / "go.db/usr/lib/R/site-library/GO.db/extdata/GO.sqlite"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    src = sqlite3.connect(sqlite_path)
    out = sqlite3.connect(dest)
    for (sql,) in src.execute("SELECT sql FROM sqlite_master WHERE type='table' AND name IN ('go_term','metadata')"):
        out.execute(sql)
    out.executemany("INSERT INTO metadata VALUES (?, ?)", src.execute("SELECT * FROM metadata"))
    rows = src.execute("SELECT * FROM go_term WHERE ontology != 'universal' ORDER BY _id").fetchall()
    picked = rows[::max(1, len(rows) // 30)][:30] + src.execute("SELECT * FROM go_term WHERE ontology='universal'").fetchall()
    out.executemany(f"INSERT INTO go_term VALUES ({','.join('?' * len(rows[0]))})", picked)
    out.commit()
    out.close()


def hpo(obo: Path) -> None:
    text = obo.read_text(encoding="utf-8")
    header, *stanzas = text.split("\n[")
    by_id, parent = {}, {}
    for st in stanzas:
        lines = st.splitlines()
        tid = next((x[4:] for x in lines if x.startswith("id: ")), None)
        if tid:
            by_id[tid] = st
            isa = next((x[6:].split(" ! ")[0] for x in lines if x.startswith("is_a: ")), None)
            if isa:
                parent[tid] = isa
    leaves = [t for t in by_id if "def:" in by_id[t] and "is_obsolete" not in by_id[t]][500::700][:12]
    obsolete = [t for t in by_id if "is_obsolete: true" in by_id[t]][:3]
    keep = set(obsolete)
    for t in leaves:
        while t:
            keep.add(t)
            t = parent.get(t)
    chosen = [by_id[t] for t in by_id if t in keep]
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "hp.obo").write_text(header + "".join("\n[" + st for st in chosen) + "\n", encoding="utf-8")


def main() -> None:
    shutil.rmtree(OUT / "root", ignore_errors=True)
    shutil.rmtree(OUT / "data", ignore_errors=True)
    dictd("gcide", ["Abuse", "Almagra", "Not", "bluejacket", "Ant", "Tort", "Habeas corpus", "Mitosis", "Facade"])
    dictd("foldoc", ["Argus", "Ariel", "cost driver attribute", "ascii", "compiler"])
    dictd("jargon", ["crawling horror", "dead beef attack", "pdp-11", "ascii"])
    wordnet()
    python_docs()
    fortunes()
    scancode(SOURCES["scancode"].locate())
    go(SOURCES["go"].locate())
    hpo(SOURCES["hpo"].locate())


if __name__ == "__main__":
    main()
