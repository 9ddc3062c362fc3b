"""Corpus loaders on real excerpts (native formats), on the installed sources when present,
and the pack builder: shares, deterministic splits, held-out probes, atomic writes."""

import gzip
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from ntkscope.text.corpus.pack import PROBE_TASKS, SPLITS, build_pack, load_pack, split_of
from ntkscope.text.corpus.sources import SOURCES, SourceMissingError, load_source
from ntkscope.text.corpus.text import count_words, split_sentences

EXCERPTS = Path(__file__).parent / "data" / "sources"
ROOT, DATA = EXCERPTS / "root", EXCERPTS / "data"

# Markup that must never survive a loader.
MARKUP = {
    "gcide": re.compile(r"[{}\\]|\[1913 Webster\]|\[WordNet|\[PJC\]|--[A-Z][a-z]+\.|^\d+\. "),
    "foldoc": re.compile(r"^<[a-z]|[{}]|\(\d{4}-\d\d-\d\d\)"),
    "jargon": re.compile(r"[{}]"),
    "wordnet": re.compile(r"\b\d{8}\b|\s@\s"),
    "python-docs": re.compile(r":(func|class|mod|meth|ref|term):`|``|^\.\. |`_"),
    "fortunes": re.compile(r"^%$"),
    "scancode": re.compile(r"^---|^(key|short_name|category|spdx_license_key|homepage_url): "),
    "go": re.compile(r"^OBSOLETE"),
    "hpo": re.compile(r'^"|\[https?://|^def: '),
}


@pytest.fixture(scope="module")
def excerpt_records():
    return {name: load_source(name, root=ROOT, data_dir=DATA) for name in SOURCES}


@pytest.mark.parametrize("name", list(SOURCES))
def test_each_loader_gives_clean_labelled_records(excerpt_records, name):
    records = excerpt_records[name]
    assert len(records) >= 10
    for r in records:
        assert r.source == name and r.domain == SOURCES[name].domain
        assert r.text == r.text.strip() and "\n" not in r.text and count_words(r.text) >= 3
        assert r.category and r.doc.startswith(f"{name}:")
        assert not MARKUP[name].search(r.text), (name, r.text[:200])


def test_loader_specifics(excerpt_records):
    gcide = excerpt_records["gcide"]
    assert any(r.category == "Law" for r in gcide)  # a field label became the category
    assert any("wrongful using of an animal or chattel distrained" in r.text for r in gcide)  # sub-entry kept
    assert {r.category for r in excerpt_records["go"]} <= {"BP", "MF", "CC"}
    assert all(r.category.startswith(("Abnormality", "Growth", "Neoplasm")) or r.category
               for r in excerpt_records["hpo"])
    assert {r.category for r in excerpt_records["fortunes"]} == {"science", "law", "medicine"}  # .dat and .u8 skipped
    assert all(r.category.split(".")[0] in {"noun", "verb", "adj", "adv"} for r in excerpt_records["wordnet"])


def test_obsolete_hpo_and_deprecated_licences_are_dropped(excerpt_records):
    obo = (DATA / "hp.obo").read_text()
    obsolete = re.findall(r"\nid: (HP:\d+)\n(?:[^\[]*?)is_obsolete: true", obo)
    assert obsolete, "the excerpt holds obsolete terms"
    docs = {r.doc for r in excerpt_records["hpo"]}
    assert not docs & {f"hpo:{t}" for t in obsolete}
    with zipfile.ZipFile(next(DATA.glob("scancode_toolkit-*.whl"))) as zf:
        deprecated = [n for n in zf.namelist() if b"is_deprecated: yes" in zf.read(n)]
    assert deprecated
    keys = {r.doc for r in excerpt_records["scancode"]}
    assert not keys & {f"scancode:{Path(n).stem}" for n in deprecated}


def test_missing_source_names_package_and_command(tmp_path):
    with pytest.raises(SourceMissingError, match=r"source 'gcide'.*gcide.index is missing; install it with: "
                                                 r"apt-get update && apt-get install -y dict-gcide"):
        load_source("gcide", root=tmp_path)
    with pytest.raises(SourceMissingError, match=r"source 'scancode'.*pip download --no-deps"):
        load_source("scancode", root=tmp_path, data_dir=tmp_path)
    with pytest.raises(ValueError, match=r"load_source: name must be one of .* \(got 'wikipedia'\)"):
        load_source("wikipedia")


def _copy_root(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(ROOT, root, symlinks=True)
    return root


def test_empty_file_is_an_error_naming_it(tmp_path):
    root = _copy_root(tmp_path)
    (root / "usr/share/wordnet/data.verb").write_bytes(b"")
    with pytest.raises(ValueError, match=r"load_source: .*data.verb is empty"):
        load_source("wordnet", root=root)


def test_non_utf8_file_is_an_error_naming_byte_and_offset(tmp_path):
    root = _copy_root(tmp_path)
    path = root / "usr/share/games/fortunes/law"
    path.write_bytes("Caveat emptor, ".encode() + "déjà vu à la française ".encode("latin-1") * 20)
    with pytest.raises(ValueError, match=r"law is not valid UTF-8 \(byte 0xe9 at offset 16; at most 10 stray bytes"):
        load_source("fortunes", root=root)


def test_a_few_stray_cp1252_bytes_are_repaired_with_a_warning(tmp_path, caplog):
    root = _copy_root(tmp_path)
    path = root / "usr/share/games/fortunes/law"
    path.write_bytes(path.read_bytes().replace(b"'", b"\x92", 2))
    records = load_source("fortunes", root=root)
    assert any("\u2019" in r.text for r in records)
    assert "decoded 2 stray byte(s) as Windows-1252" in caplog.text


def test_sentence_splitter_keeps_abbreviations():
    text = "The product of e.g. two primes is used. Mr. Smith agreed! Is it (U.S.) law? Yes. 3 cases remain."
    assert split_sentences(text) == ["The product of e.g. two primes is used.", "Mr. Smith agreed!",
                                     "Is it (U.S.) law?", "Yes.", "3 cases remain."]


# --- the pack builder -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def excerpt_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("packs") / "p"
    return load_pack(build_pack(out, share=0.1, seed=3, validation=0.1, test=0.1, probe_per_class=3,
                                probe_min_docs=2, vocab_size=400, root=ROOT, data_dir=DATA))


def test_build_is_deterministic_and_checksummed(excerpt_pack, tmp_path):
    again = load_pack(build_pack(tmp_path / "q", share=0.1, seed=3, validation=0.1, test=0.1, probe_per_class=3,
                                 probe_min_docs=2, vocab_size=400, root=ROOT, data_dir=DATA))
    assert again.manifest["version"] == excerpt_pack.manifest["version"]
    for name in excerpt_pack.manifest["files"]:
        assert (again.path / name).read_bytes() == (excerpt_pack.path / name).read_bytes()
    other = build_pack(tmp_path / "r", share=0.1, seed=4, validation=0.1, test=0.1, probe_per_class=3,
                       probe_min_docs=2, vocab_size=400, root=ROOT, data_dir=DATA)
    assert load_pack(other).manifest["version"] != excerpt_pack.manifest["version"]


def test_excerpt_pack_share_and_manifest(excerpt_pack):
    records = excerpt_pack.records("all")
    tail = sum(count_words(r.text) for r in records if r.domain != "general")
    total = sum(count_words(r.text) for r in records)
    assert abs(tail / total - 0.1) < 0.01  # excerpts are tiny: one record moves the share
    m = excerpt_pack.manifest
    assert m["share_measured"] == pytest.approx(tail / total)
    assert set(m["sources"]) == set(SOURCES)
    assert all(v["version"] for v in m["sources"].values())
    assert "GPL" in (excerpt_pack.path / "LICENSES.md").read_text()


def test_damaged_pack_is_refused(excerpt_pack, tmp_path):
    copy = tmp_path / "damaged"
    shutil.copytree(excerpt_pack.path, copy)
    data = gzip.decompress((copy / "test.jsonl.gz").read_bytes()) + b'{"text": "injected"}\n'
    (copy / "test.jsonl.gz").write_bytes(gzip.compress(data))
    with pytest.raises(ValueError, match="test.jsonl.gz does not match its sha256"):
        load_pack(copy)
    with pytest.raises(FileNotFoundError, match="is not a corpus pack"):
        load_pack(tmp_path)


@pytest.mark.parametrize("share", [0, 1, 1.5, -0.1, "0.07"])
def test_share_outside_unit_interval_is_refused_and_nothing_written(tmp_path, share):
    with pytest.raises(ValueError, match=rf"build_pack: share must be a number strictly between 0 and 1 \(got {share!r}\)"):
        build_pack(tmp_path / "p", share=share, root=ROOT, data_dir=DATA)
    assert list(tmp_path.iterdir()) == []


def test_missing_source_mid_build_leaves_nothing(tmp_path):
    root = _copy_root(tmp_path)
    (root / "usr/share/dictd/jargon.dict.dz").unlink()
    with pytest.raises(SourceMissingError, match="jargon.dict.dz is missing; install it with: apt-get install dict-jargon"):
        build_pack(tmp_path / "p", root=root, data_dir=DATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_failure_while_writing_keeps_the_old_pack(excerpt_pack, tmp_path, monkeypatch):
    out = tmp_path / "p"
    shutil.copytree(excerpt_pack.path, out)
    write_bytes, calls = Path.write_bytes, []

    def disk_fills_up(self, data):
        calls.append(self)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", disk_fills_up)
    with pytest.raises(OSError, match="No space left"):
        build_pack(out, share=0.1, root=ROOT, data_dir=DATA, overwrite=True, vocab_size=400, probe_min_docs=2)
    monkeypatch.undo()
    assert len(calls) == 3
    assert load_pack(out).manifest["version"] == excerpt_pack.manifest["version"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no temporary directory left
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        build_pack(out, root=ROOT, data_dir=DATA)


# --- the shipped default pack -------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_pack():
    return load_pack()


def test_default_pack_share_within_half_a_point(default_pack):
    records = default_pack.records("all")
    by_domain = {d: sum(count_words(r.text) for r in records if r.domain == d) for d in ("general", "legal", "biomedical")}
    share = (by_domain["legal"] + by_domain["biomedical"]) / sum(by_domain.values())
    assert abs(share - default_pack.manifest["share_asked"]) < 0.005
    assert default_pack.manifest["share_measured_bpe"] < 0.08  # "under 8% of tokens" in BPE tokens too
    assert {r.source for r in records} == set(SOURCES)


def test_default_pack_split_is_deterministic_by_document(default_pack):
    seed = default_pack.manifest["seed"]
    seen = {}
    for split in SPLITS:
        for r in default_pack.records(split):
            assert split_of(r.doc, seed, 0.05, 0.05) == split
            assert seen.setdefault(r.doc, split) == split  # a document never straddles splits
    sizes = {s: default_pack.manifest["splits"][s]["records"] for s in SPLITS}
    assert sizes["validation"] > 0.03 * sum(sizes.values()) and sizes["test"] > 0.03 * sum(sizes.values())


def test_default_pack_probes_are_held_out(default_pack):
    probes = default_pack.probes()
    assert set(probes["task"]) == {t.name for t in PROBE_TASKS}
    pretraining = default_pack.records("all")
    assert not set(probes["doc"]) & {r.doc for r in pretraining}
    assert not set(probes["text"].str.casefold()) & {r.text.casefold() for r in pretraining}
    legal = default_pack.probes("legal-licence-category")
    assert legal["label"].nunique() >= 5 and set(legal["probe_split"]) == {"train", "test"}
    with pytest.raises(ValueError, match="CorpusPack.probes: task must be one of"):
        default_pack.probes("sst-2")


def test_default_pack_records_are_clean(default_pack):
    for r in default_pack.records("validation") + default_pack.records("test"):
        assert not MARKUP[r.source].search(r.text), (r.source, r.text[:200])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SOURCES))
def test_installed_sources_load_clean(name):
    try:
        records = load_source(name)
    except SourceMissingError as err:
        pytest.skip(str(err))
    assert len(records) > 1000
    dirty = [r.text for r in records if MARKUP[name].search(r.text)]
    assert len(dirty) < 0.001 * len(records), dirty[:5]


def test_a_pack_of_the_researchers_table_is_reproducible_and_checked(tmp_path):
    import json

    from ntkscope.core.checks import UserError
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.corpus.table_pack import table_digest, table_pack

    records = load_pack().records("train")
    rows = [{"text": r.text, "domain": "prose"} for r in records if r.domain == "general"][:300]
    rows += [{"text": r.text, "domain": "licence"} for r in records if r.domain == "legal"][:80]
    rows += rows[:5]  # repeated texts are kept once
    table = tmp_path / "rows.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = load_pack(table_pack(tmp_path / "a", table, label_column="domain", vocab_size=600))
    b = load_pack(table_pack(tmp_path / "b", table, label_column="domain", vocab_size=600))
    assert a.manifest["version"] == b.manifest["version"] and a.manifest["table"]["sha256"] == table_digest(table)
    assert a.manifest["tail"] == ["licence"] and a.manifest["table"]["rows_kept"] == 380
    assert sum(len(a.records(s)) for s in ("train", "validation", "test")) == 380
    assert {r.domain for r in a.records("test")} == {"licence", "prose"}
    with pytest.raises(UserError, match="tail must name some but not all of the table's labels"):
        table_pack(tmp_path / "c", table, label_column="domain", tail=["poetry"])
    with pytest.raises(UserError, match="validation has none of"):
        table_pack(tmp_path / "d", table, label_column="domain", validation=0.001)


def test_a_table_pack_takes_the_researchers_own_tokenizer(tmp_path):
    """`corpus from-table --tokenizer`: the pack's tokenizer.json is the one given, byte for byte,
    the manifest says so, and a path that holds none is one line."""
    import json

    from commandline import in_process

    from ntkscope.text.corpus.pack import load_pack

    records = load_pack().records("train")
    rows = [{"text": r.text, "domain": "prose"} for r in records if r.domain == "general"][:200]
    rows += [{"text": r.text, "domain": "licence"} for r in records if r.domain == "legal"][:60]
    table = tmp_path / "rows.jsonl"
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    given = load_pack().path / "tokenizer.json"
    made = in_process("corpus", "from-table", tmp_path / "pack", table, "--label-column", "domain", "--tokenizer",
                      given)
    assert made.returncode == 0, made.stderr[-2000:]
    pack = load_pack(tmp_path / "pack")
    assert (tmp_path / "pack" / "tokenizer.json").read_bytes() == given.read_bytes()
    assert pack.manifest["tokenizer"]["kind"].startswith("given") and "tokenizer" in pack.manifest["options"]
    bad = in_process("corpus", "from-table", tmp_path / "other", table, "--label-column", "domain", "--tokenizer",
                     tmp_path)
    assert bad.returncode == 1 and "tokenizer must be a tokenizer.json or a directory holding one" in bad.stderr


# --- a grown pack: more training text, the held-out files as they are ----------------------------


@pytest.fixture(scope="module")
def small_excerpt_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("packs") / "small"
    return load_pack(build_pack(out, share=0.1, seed=3, validation=0.1, test=0.1, probe_per_class=3,
                                probe_min_docs=2, vocab_size=400, max_tokens=3000, root=ROOT, data_dir=DATA))


def _grow(small, out, **kw):
    from ntkscope.text.corpus.grow import grow_pack
    return load_pack(grow_pack(out, **{"train_tokens": 5000, "pack": small.path, "seed": 1, "root": ROOT,
                                       "data_dir": DATA, **kw}))


def test_grown_pack_keeps_held_out_files_and_adds_only_unseen_training_text(small_excerpt_pack, tmp_path):
    small = small_excerpt_pack
    grown = _grow(small, tmp_path / "grown")
    for name in ("validation.jsonl.gz", "test.jsonl.gz", "probe.jsonl.gz", "tokenizer.json", "LICENSES.md"):
        assert (grown.path / name).read_bytes() == (small.path / name).read_bytes(), name
    before, after = small.records("train"), grown.records("train")
    assert set(before) < set(after) and len(after) > 1.5 * len(before)
    held = small.records("validation") + small.records("test")
    held_docs = {r.doc for r in held} | set(small.probes()["doc"])
    held_texts = {r.text.casefold() for r in held} | {t.casefold() for t in small.probes()["text"]}
    added = set(after) - set(before)
    assert not {r.doc for r in added} & held_docs
    assert not {r.text.casefold() for r in added} & held_texts
    words = {d: sum(count_words(r.text) for r in after if r.domain == d) for d in ("general", "legal", "biomedical")}
    assert sum(words.values()) == pytest.approx(5000, rel=0.02)
    m = grown.manifest
    assert m["share_measured_train"] == pytest.approx((words["legal"] + words["biomedical"]) / sum(words.values()))
    assert abs(m["share_measured_train"] - small.manifest["share_measured"]) < 0.01  # the pack's share by default
    assert m["derived_from"]["version"] == small.manifest["version"]
    card = (grown.path / "CARD.md").read_text()
    assert "ntkscope corpus grow" in card and "GPL" in card and f"{m['splits']['train']['bpe_tokens']:,}" in card


def test_grown_pack_rebuilds_byte_for_byte_and_another_seed_differs(small_excerpt_pack, tmp_path):
    one = _grow(small_excerpt_pack, tmp_path / "a")
    again = _grow(small_excerpt_pack, tmp_path / "b")
    for name in one.manifest["files"]:
        assert (again.path / name).read_bytes() == (one.path / name).read_bytes(), name
    assert _grow(small_excerpt_pack, tmp_path / "c", seed=2).manifest["version"] != one.manifest["version"]


def test_grown_pack_refuses_sizes_it_cannot_reach_and_writes_nothing(small_excerpt_pack, tmp_path):
    from ntkscope.text.corpus.grow import grow_pack
    with pytest.raises(ValueError, match=r"grow_pack: train_tokens must exceed the pack's training words \(\d+\) "
                                         r"\(got 100\)"):
        grow_pack(tmp_path / "x", train_tokens=100, pack=small_excerpt_pack.path, root=ROOT, data_dir=DATA)
    with pytest.raises(ValueError, match=r"grow_pack: train_tokens asks \d+ general words of training text; the pack "
                                         r"and the installed sources hold \d+ .*\(got 10000000\)"):
        grow_pack(tmp_path / "x", train_tokens=10_000_000, pack=small_excerpt_pack.path, root=ROOT, data_dir=DATA)
    assert not (tmp_path / "x").exists()


def test_a_pack_of_ones_own_table_is_not_grown(tmp_path):
    from ntkscope.text.corpus.grow import grow_pack
    from ntkscope.text.corpus.table_pack import table_pack

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"text": "sentence number {i} of the {d} rows", "label": "{d}"}}\n'
                            for i in range(40) for d in ("bulk", "tail")))
    own = table_pack(tmp_path / "own", rows, label_column="label", tail=["tail"], vocab_size=300)
    with pytest.raises(ValueError, match=r"grow_pack: pack must be a pack built from the installed sources"):
        grow_pack(tmp_path / "x", train_tokens=10_000, pack=own, root=ROOT, data_dir=DATA)
