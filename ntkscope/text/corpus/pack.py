"""Build and load a corpus pack: general text as the bulk, legal and biomedical text as a
small long tail, split deterministically, with held-out labelled probe sets.

A pack is a directory::

    manifest.json          format, seed, asked and measured shares, sources (versions,
                           licences, counts), counts per domain/category/split, sha256 of files
    train.jsonl.gz         one record a line: text, source, domain, category, doc
    validation.jsonl.gz
    test.jsonl.gz
    probe.jsonl.gz         probe items: + task, label, probe_split; never in the three splits
    tokenizer.json         byte-level BPE trained on train (HF tokenizers)
    LICENSES.md            each source's licence and attribution

Probe tasks stand in for the paper's downstream sets, which cannot be had offline:
licence category (ScanCode) for Overruling/CaseHOLD, GO ontology and HPO organ system
for GAD/EU-ADR, WordNet lexname for SST-2. Shares are measured in the pack's
tokenizer-free unit (:data:`~ntkscope.text.corpus.text.WORD_RE`) and also reported in BPE tokens.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ntkscope.core.checks import (MissingInput, OutputExists, UserError, check_fraction, check_path, check_positive_int,
                                  entry, fail)
from ntkscope.core.files import atomic_path, read_json_object
from ntkscope.text.tokenization import load_tokenizer, train_bpe
from ntkscope.text.corpus.sources import SOURCES, load_source
from ntkscope.text.corpus.text import Record, count_words, dedupe

log = logging.getLogger(__name__)

PACK_FORMAT = 1
SPLITS = ("train", "validation", "test")
DOMAINS = ("general", "legal", "biomedical")
DEFAULT_PACK = Path(__file__).resolve().parents[2] / "data" / "pack-small"


@dataclass(frozen=True)
class ProbeTask:
    name: str
    source: str
    label: str  # what the record's category means for this task


PROBE_TASKS = (
    ProbeTask("legal-licence-category", "scancode", "ScanCode licence category"),
    ProbeTask("biomedical-go-ontology", "go", "GO ontology (BP/MF/CC)"),
    ProbeTask("clinical-hpo-organ-system", "hpo", "HPO organ system"),
    ProbeTask("general-wordnet-lexname", "wordnet", "WordNet lexicographer file"),
)


def _unit(seed: int, key: str) -> float:
    """A deterministic number in [0, 1) for (seed, key): stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2.0**64


def split_of(doc: str, seed: int, validation: float, test: float) -> str:
    """The split of a document: whole documents go to one split."""
    u = _unit(seed, doc)
    return "validation" if u < validation else "test" if u < validation + test else "train"


def select_probes(records: Sequence[Record], tasks: Sequence[ProbeTask], *, per_class: int,
                  min_class_docs: int, seed: int) -> list[dict]:
    """Per task, up to ``per_class`` documents per label (labels with fewer than
    ``min_class_docs`` documents skipped), one item each: the document's longest record.
    The first 60% of each label's items are ``probe_split="train"``, the rest ``"test"``."""
    items = []
    for task in tasks:
        docs: dict[str, list[Record]] = defaultdict(list)
        for r in records:
            if r.source == task.source:
                docs[r.doc].append(r)
        by_label: dict[str, list[str]] = defaultdict(list)
        for doc, recs in docs.items():
            by_label[recs[0].category].append(doc)
        for label in sorted(by_label):
            chosen = sorted(by_label[label], key=lambda d: _unit(seed, f"probe:{d}"))
            if len(chosen) < min_class_docs:
                continue
            chosen = chosen[:per_class]
            n_train = max(1, round(0.6 * len(chosen)))
            for i, doc in enumerate(chosen):
                best = max(docs[doc], key=lambda r: count_words(r.text))
                items.append({**best._asdict(), "task": task.name, "label": label,
                              "probe_split": "train" if i < n_train else "test"})
    return items


def closest_prefix(sizes: np.ndarray, target: float) -> int:
    """How many of ``sizes``, taken in order, make the sum closest to ``target`` (the shorter
    prefix on a tie)."""
    cumulative = np.cumsum(sizes)
    k = int(np.searchsorted(cumulative, target))
    if k < len(sizes) and (k == 0 or abs(cumulative[k] - target) < abs(cumulative[k - 1] - target)):
        k += 1
    return k


def mix(pools: dict[str, list[Record]], *, share: float, weights: dict[str, float],
        max_tokens: int | None, seed: int) -> list[Record]:
    """Sample records so that the domains in ``weights`` make up ``share`` of the tokens.

    ``pools`` maps a domain to its records. The total is ``max_tokens`` when given, else as
    large as the pools allow. Within a domain, records are taken in a seeded random order
    until the domain's target is reached, so sources enter in proportion to their size.
    """
    tokens = {d: np.array([count_words(r.text) for r in pools.get(d, [])], dtype=np.int64) for d in DOMAINS}
    available = {d: int(t.sum()) for d, t in tokens.items()}
    total = float(max_tokens) if max_tokens else float("inf")
    total = min(total, available["general"] / (1 - share))
    for d, w in weights.items():
        if w > 0:
            total = min(total, available[d] / (share * w))
    if not np.isfinite(total) or total <= 0:
        raise UserError(f"build_pack: sources hold no text to mix (tokens available: {available})")
    targets = {"general": (1 - share) * total, **{d: share * w * total for d, w in weights.items()}}
    rng = np.random.default_rng(seed)
    chosen: list[Record] = []
    for d in DOMAINS:
        if targets.get(d, 0) <= 0:
            continue
        order = rng.permutation(len(pools[d]))
        chosen.extend(pools[d][i] for i in order[:closest_prefix(tokens[d][order], targets[d])])
    return [chosen[i] for i in rng.permutation(len(chosen))]


def jsonl_gz(rows: Iterable[dict]) -> bytes:
    """Rows as gzipped JSON lines, the same bytes for the same rows (keys sorted, no timestamp)."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz:  # mtime=0: same bytes each build
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n").encode())
    return buf.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def domain_records(records: Sequence[Record]) -> dict:
    """{domain: {category: {"records", "tokens"}}} of ``records`` (a split's sizes in the manifest)."""
    out: dict = {}
    for r in records:
        entry = out.setdefault(r.domain, {}).setdefault(r.category, [0, 0])
        entry[0] += 1
        entry[1] += count_words(r.text)
    return {d: {c: {"records": n, "tokens": t} for c, (n, t) in sorted(cats.items())} for d, cats in out.items()}


def _licenses_md(used: dict[str, dict]) -> str:
    lines = ["# Sources of this corpus pack and their licences", "",
             "Each record keeps its `source`; text derived from a source is under that source's licence.", ""]
    for name, info in used.items():
        s = SOURCES[name]
        lines.append(f"- **{name}** — {s.description}, version {info['version']}. Licence: {s.licence}. "
                     f"Installed with `{s.install}`.")
    return "\n".join(lines) + "\n"


def bpe_record(tokenizer) -> dict:
    """A pack manifest's record of its byte-level BPE, trained on the train split."""
    return {"kind": "byte-level BPE (HF tokenizers)", "vocab_size": tokenizer.vocab_size, "trained_on": "train",
            "special_tokens": ["<|endoftext|>", "<pad>", "<mask>", "<unk>"]}


def sealed(manifest: dict, files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` with ``manifest.json``: ``manifest`` given every file's sha256 and size and the
    pack's version (a hash of those)."""
    manifest["files"] = {name: {"sha256": _sha256(data), "bytes": len(data)} for name, data in files.items()}
    manifest["version"] = _sha256(json.dumps(manifest["files"], sort_keys=True).encode())[:12]
    return {**files, "manifest.json": (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode()}


def write_atomic_dir(out: Path, files: dict[str, bytes], *, overwrite: bool) -> None:
    """Write ``files`` into a temporary sibling directory, then rename it to ``out``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExists(f"build_pack: out {out} exists; pass overwrite=True (--force) to replace it")
    with atomic_path(out, overwrite=True) as tmp:
        tmp.mkdir(parents=True)
        for name, data in files.items():
            (tmp / name).write_bytes(data)


@entry("build_pack")
def build_pack(out: str | Path, *, sources: Sequence[str] | None = None, share: float = 0.07,
               weights: dict[str, float] | None = None, max_tokens: int | None = None, seed: int = 0,
               validation: float = 0.05, test: float = 0.05, probe_per_class: int = 40,
               probe_min_docs: int = 10, vocab_size: int = 8192, root: str | Path = "/",
               data_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Read the sources, hold out probes, mix, split, train a BPE and write a pack.

    Parameters
    ----------
    out : the pack directory to create (written under a temporary name, then renamed).
    sources : source names (default: all of :data:`SOURCES`); every one must be installed.
    share : the fraction of tokens that are legal + biomedical, in (0, 1). Default 0.07.
    weights : how ``share`` divides among the long-tail domains (default equal).
    max_tokens : total tokens of train+validation+test (default: as many as the sources allow).
    seed : fixes sampling, the split and the probes.
    validation, test : fractions of documents in those splits.
    probe_per_class : probe items per label and task; ``probe_min_docs``: labels with fewer
        documents are left out of the probe.
    vocab_size : of the byte-level BPE trained on the train split.

    Returns
    -------
    Path
        The pack's directory.
    """
    func = "build_pack"
    check_fraction("share", share)
    check_fraction("validation", validation)
    check_fraction("test", test)
    check_positive_int("max_tokens", max_tokens, allow_none=True)
    check_positive_int("probe_per_class", probe_per_class)
    check_positive_int("probe_min_docs", probe_min_docs)
    if validation + test >= 1:
        raise fail(func, "validation + test", "must be below 1", validation + test)
    names = list(sources) if sources is not None else list(SOURCES)
    for name in names:
        if name not in SOURCES:
            raise fail(func, "sources", f"must name sources among {sorted(SOURCES)}", name)
    present = {SOURCES[n].domain for n in names}
    weights = dict(weights) if weights is not None else {d: 1.0 for d in DOMAINS[1:] if d in present}
    if not weights or any(d not in DOMAINS[1:] or w < 0 for d, w in weights.items()) or sum(weights.values()) <= 0:
        raise fail(func, "weights", "must map 'legal'/'biomedical' to non-negative weights with a positive sum",
                   weights)
    missing = [d for d, w in weights.items() if w > 0 and d not in present] + (["general"] if "general" not in present else [])
    if missing:
        raise fail(func, "sources", f"must include a source of each mixed domain (none for {missing})", names)
    weights = {d: w / sum(weights.values()) for d, w in weights.items()}

    used: dict[str, dict] = {}
    everything: list[Record] = []
    for name in names:
        path = SOURCES[name].locate(root, data_dir)
        records = load_source(name, root=root, data_dir=data_dir)
        used[name] = {"domain": SOURCES[name].domain, "description": SOURCES[name].description,
                      "licence": SOURCES[name].licence, "version": SOURCES[name].version(path),
                      "records_available": len(records)}
        log.info("build_pack: %s: %d records", name, len(records))
        everything.extend(records)
    everything = list(dedupe(everything))

    tasks = [t for t in PROBE_TASKS if t.source in names]
    probes = select_probes(everything, tasks, per_class=probe_per_class, min_class_docs=probe_min_docs, seed=seed)
    held_out = {p["doc"] for p in probes}
    pools: dict[str, list[Record]] = defaultdict(list)
    for r in everything:
        if r.doc not in held_out:
            pools[r.domain].append(r)
    mixed = mix(pools, share=share, weights=weights, max_tokens=max_tokens, seed=seed)
    splits: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for r in mixed:
        splits[split_of(r.doc, seed, validation, test)].append(r)

    tokenizer = train_bpe([r.text for r in splits["train"]], vocab_size=vocab_size)
    n_bpe = Counter()
    for r, ids in zip(mixed, tokenizer.encode([r.text for r in mixed])):
        n_bpe[r.domain != "general"] += len(ids)
    counts = Counter()
    for r in mixed:
        counts[r.domain] += count_words(r.text)
        used[r.source]["records_used"] = used[r.source].get("records_used", 0) + 1
        used[r.source]["tokens_used"] = used[r.source].get("tokens_used", 0) + count_words(r.text)
    total = sum(counts.values())

    files = {f"{s}.jsonl.gz": jsonl_gz(r._asdict() for r in splits[s]) for s in SPLITS}
    files["probe.jsonl.gz"] = jsonl_gz(probes)
    files["tokenizer.json"] = tokenizer.backend.to_str().encode()
    files["LICENSES.md"] = _licenses_md(used).encode()
    task_info = {}
    for t in tasks:
        mine = [p for p in probes if p["task"] == t.name]
        task_info[t.name] = {"source": t.source, "label": t.label, "items": len(mine),
                             "classes": dict(sorted(Counter(p["label"] for p in mine).items()))}
    manifest = {
        "format": PACK_FORMAT,
        "builder": "ntkscope.text.corpus.build_pack",
        "seed": seed,
        "share_asked": share,
        "share_measured": 1 - counts["general"] / total,
        "share_measured_bpe": n_bpe[True] / (n_bpe[True] + n_bpe[False]),
        "weights": weights,
        "max_tokens": max_tokens,
        "token_unit": r"regex \w+|[^\w\s] (BPE shares reported separately)",
        "domains": {d: {"tokens": counts[d], "share": counts[d] / total} for d in DOMAINS if counts[d]},
        "sources": used,
        "splits": {s: {"records": len(splits[s]), "tokens": sum(count_words(r.text) for r in splits[s]),
                       "by_domain": domain_records(splits[s])} for s in SPLITS},
        "probe": {"held_out_docs": len(held_out), "tasks": task_info},
        "tokenizer": bpe_record(tokenizer),
    }
    write_atomic_dir(Path(out), sealed(manifest, files), overwrite=overwrite)
    log.info("build_pack: wrote %s (%d records, %d tokens, long-tail share %.4f)", out, len(mixed), total,
             manifest["share_measured"])
    return Path(out)


@dataclass
class CorpusPack:
    """A pack on disk, checked against its manifest. ``records(split)`` reads one split."""

    path: Path
    manifest: dict
    _cache: dict = field(default_factory=dict, repr=False)

    def _rows(self, name: str) -> list[dict]:
        if name not in self._cache:
            file = self.path / name
            try:
                text = gzip.decompress(file.read_bytes()).decode("utf-8")
            except (OSError, EOFError, UnicodeDecodeError) as err:  # truncated or not gzip
                raise UserError(f"CorpusPack: {file} is damaged ({type(err).__name__}: {err})") from None
            rows = []
            for i, line in enumerate(text.splitlines(), 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"CorpusPack: {file} line {i} is not valid JSON ({err.msg})") from None
                if not isinstance(row, dict) or (name != "probe.jsonl.gz" and set(Record._fields) - set(row)):
                    raise UserError(f"CorpusPack: {file} line {i} is not a record with the fields "
                                    f"{list(Record._fields)}")
                rows.append(row)
            self._cache[name] = rows
        return self._cache[name]

    def records(self, split: str = "train") -> list[Record]:
        """The records of ``split`` (``train``, ``validation``, ``test`` or ``all``)."""
        if not isinstance(split, str) or split not in (*SPLITS, "all"):
            raise fail("CorpusPack.records", "split", f"must be one of {list(SPLITS) + ['all']}", split)
        if split == "all":
            return [r for s in SPLITS for r in self.records(s)]
        return [Record(**{k: row[k] for k in Record._fields}) for row in self._rows(f"{split}.jsonl.gz")]

    def frame(self, split: str = "train"):
        """The records of ``split`` as a DataFrame (columns text, source, domain, category, doc)."""
        return pd.DataFrame(self.records(split), columns=list(Record._fields))

    def probes(self, task: str | None = None):
        """Held-out probe items as a DataFrame (+ task, label, probe_split), optionally one task."""
        frame = pd.DataFrame(self._rows("probe.jsonl.gz"))
        if task is not None:
            tasks = sorted(self.manifest["probe"]["tasks"])
            if task not in tasks:
                raise fail("CorpusPack.probes", "task", f"must be one of {tasks}", task)
            frame = frame[frame["task"] == task].reset_index(drop=True)
        return frame

    def tokenizer(self):
        """The byte-level BPE trained on this pack's train split."""
        return dataclasses.replace(load_tokenizer(self.path / "tokenizer.json"), name=f"BPE of pack {self.path.name}")


def load_pack(path: str | Path | None = None, *, verify: bool = True) -> CorpusPack:
    """Open a pack (default: the small pack shipped with ntkscope), checking every file's sha256."""
    check_path("path", path, allow_none=True, func="load_pack")
    path = Path(path) if path is not None else DEFAULT_PACK
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise MissingInput(f"load_pack: path {path} is not a corpus pack (no manifest.json); "
                           "build one with: ntkscope corpus build OUT")
    manifest = read_json_object(manifest_path, "load_pack")
    if manifest.get("format") != PACK_FORMAT:
        raise fail("load_pack", "path", f"must hold a pack of format {PACK_FORMAT}", manifest.get("format"))
    missing = [k for k in ("files", "splits", "version") if k not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        raise UserError(f"load_pack: {manifest_path} lacks {missing or ['files']}: the pack is damaged")
    if verify:
        for name, info in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise MissingInput(f"load_pack: {file} is missing from the pack")
            if _sha256(file.read_bytes()) != (info.get("sha256") if isinstance(info, dict) else None):
                raise UserError(f"load_pack: {file} does not match its sha256 in the manifest: the pack is damaged")
    return CorpusPack(path, manifest)
