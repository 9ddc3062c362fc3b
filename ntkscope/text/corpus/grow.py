"""A larger pack from a pack: more training text from the installed sources, everything held out
kept as it is. Validation, test, probes and the tokenizer are the source pack's, byte for byte, so
a model trained on the larger pack is evaluated on the same blocks as one trained on the small
one (issue 60: a model that is not starved of data, compared with the map's).

A source record joins the training split only when its document is in none of the held-out
splits (validation, test, probes) and its text (case- and space-folded, as :func:`dedupe` folds
it) is none of theirs; per domain, records are added in a seeded random order until the domain
reaches its target share of the asked training size (the prefix closest to it, as
:func:`~ntkscope.text.corpus.pack.mix` samples). The source pack's training records are all kept.
The pack's card (``CARD.md``) gives its sizes per domain and source, in the pack's word unit and
in the pack's BPE tokens, the licences and the command that rebuilds it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from ntkscope.core.checks import check_fraction, check_positive_int, entry, fail
from ntkscope.text.corpus.pack import DOMAINS, closest_prefix, jsonl_gz, load_pack, sealed, write_atomic_dir
from ntkscope.text.corpus.sources import SOURCES, load_source
from ntkscope.text.corpus.text import Record, count_words, dedupe

log = logging.getLogger(__name__)

HELD_OUT = ("validation.jsonl.gz", "test.jsonl.gz", "probe.jsonl.gz")


@entry("grow_pack")
def grow_pack(out, *, train_tokens: int, pack=None, share: float | None = None, seed: int = 0,
              sources: Sequence[str] | None = None, root: str | Path = "/", data_dir: str | Path | None = None,
              command: str | None = None, overwrite: bool = False) -> Path:
    """Write to ``out`` the pack ``pack`` (default: the shipped one) with its training split grown
    to about ``train_tokens`` (the pack's word unit) from the installed ``sources`` (default: the
    pack's own), the long-tail domains ``share`` of them (default: the pack's measured share)
    divided as the pack's ``weights``. ``command``: the command line recorded in the card (default:
    the equivalent ``ntkscope corpus grow``, its paths named OUT and PACK: the card does not depend on them). Returns ``out``."""
    func = "grow_pack"
    check_positive_int("train_tokens", train_tokens)
    source = load_pack(pack)
    m = source.manifest
    if not isinstance(m.get("sources"), dict):  # a pack of a researcher's own table has no sources to grow from
        raise fail(func, "pack", "must be a pack built from the installed sources (ntkscope corpus build), not one "
                   "of your own table", str(source.path))
    share = float(m["share_measured"]) if share is None else share
    check_fraction("share", share)
    names = list(sources) if sources is not None else [n for n in m["sources"] if n in SOURCES]
    for name in names:
        if name not in SOURCES:
            raise fail(func, "sources", f"must name sources among {sorted(SOURCES)}", name)
    train = source._rows("train.jsonl.gz")
    have = Counter()
    for r in train:
        have[r["domain"]] += count_words(r["text"])
    if train_tokens <= sum(have.values()):
        raise fail(func, "train_tokens", f"must exceed the pack's training words ({sum(have.values())})",
                   train_tokens)
    weights = m.get("weights") or {d: 1.0 for d in DOMAINS[1:]}
    targets = {"general": (1 - share) * train_tokens, **{d: share * w * train_tokens for d, w in weights.items()}}
    held_docs, held_texts = set(), set()
    for name in HELD_OUT:
        for r in source._rows(name):
            held_docs.add(r["doc"])
            held_texts.add(r["text"].casefold())
    taken = {r["text"].casefold() for r in train}  # a text the pack trains on already, under any document

    records: list[Record] = []
    for name in names:
        records.extend(load_source(name, root=root, data_dir=data_dir))
    pools: dict[str, list[Record]] = defaultdict(list)
    for r in dedupe(records):
        if r.doc not in held_docs and r.text.casefold() not in held_texts and r.text.casefold() not in taken:
            pools[r.domain].append(r)
    rng = np.random.default_rng(seed)
    added: list[Record] = []
    for domain in DOMAINS:
        need = targets.get(domain, 0) - have[domain]
        pool = pools.get(domain, [])
        sizes = np.array([count_words(r.text) for r in pool], dtype=np.int64)
        if need > sizes.sum():
            raise fail(func, "train_tokens", f"asks {targets[domain]:.0f} {domain} words of training text; the pack "
                       f"and the installed sources hold {have[domain] + int(sizes.sum())} that are held out nowhere",
                       train_tokens)
        if need <= 0:
            continue
        order = rng.permutation(len(pool))
        added.extend(pool[i] for i in order[:closest_prefix(sizes[order], need)])
    rows = list(train) + [r._asdict() for r in added]
    rows = [rows[i] for i in rng.permutation(len(rows))]

    tokenizer = source.tokenizer()
    words, bpe, by_source = Counter(), Counter(), defaultdict(Counter)
    for row, ids in zip(rows, tokenizer.encode([r["text"] for r in rows])):
        n = count_words(row["text"])
        words[row["domain"]] += n
        bpe[row["domain"]] += len(ids)
        by_source[row["source"]]["records"] += 1
        by_source[row["source"]]["words"] += n
        by_source[row["source"]]["bpe"] += len(ids)
    total, total_bpe = sum(words.values()), sum(bpe.values())
    files = {name: (source.path / name).read_bytes() for name in m["files"] if name != "train.jsonl.gz"}
    files["train.jsonl.gz"] = jsonl_gz(rows)
    manifest = json.loads(json.dumps(m))
    manifest["derived_from"] = {"version": m["version"], "grown": "train", "train_tokens": train_tokens,
                                "share": share, "seed": seed, "sources": names,
                                "added_records": len(added), "kept_records": len(train)}
    manifest["share_measured_train"] = 1 - words["general"] / total
    manifest["share_measured_train_bpe"] = 1 - bpe["general"] / total_bpe
    manifest["splits"]["train"] = {
        "records": len(rows), "tokens": total, "bpe_tokens": total_bpe,
        "by_domain": {d: {"tokens": words[d], "bpe_tokens": bpe[d]} for d in sorted(words)},
        "by_source": {s: dict(c) for s, c in sorted(by_source.items())}}
    for name in names:  # what each source gives the grown train split
        manifest["sources"].setdefault(name, {"domain": SOURCES[name].domain, "licence": SOURCES[name].licence})
    command = command or (f"ntkscope corpus grow OUT --train-tokens {train_tokens} --share {share} --seed {seed}"
                          + ("" if pack is None else f" --pack PACK (the pack {m['version']})")
                          + ("" if sources is None else " --sources " + " ".join(names)))
    files["CARD.md"] = card(manifest, command).encode()
    write_atomic_dir(Path(out), sealed(manifest, files), overwrite=overwrite)
    log.info("grow_pack: wrote %s: %d training records (%d added), %d words, %d BPE tokens, long-tail share %.4f",
             out, len(rows), len(added), total, total_bpe, manifest["share_measured_train"])
    return Path(out)


def card(manifest: dict, command: str) -> str:
    """A grown pack's card: what it holds, where from, under which licences, how to rebuild it."""
    d, train = manifest["derived_from"], manifest["splits"]["train"]
    lines = [
        "# A grown corpus pack", "",
        f"The pack {d['version']}'s validation, test and probe files and its tokenizer, byte for byte, with its "
        f"training split grown from the installed sources: {d['kept_records']} records kept and {d['added_records']} "
        "added, none of them from a held-out document or with a held-out record's text.", "",
        f"Rebuild (the same bytes from the same source versions): `{command}`", "",
        "## Training split", "",
        "| domain | words | BPE tokens | share of BPE tokens |", "|---|---|---|---|"]
    for dom, n in train["by_domain"].items():
        lines.append(f"| {dom} | {n['tokens']:,} | {n['bpe_tokens']:,} | {n['bpe_tokens'] / train['bpe_tokens']:.2%} |")
    lines += [f"| all | {train['tokens']:,} | {train['bpe_tokens']:,} | |", "",
              "Words are the pack's tokenizer-free unit (`\\w+|[^\\w\\s]`); BPE tokens are the pack's tokenizer's.", "",
              "## Sources", "", "| source | domain | version | records | words | BPE tokens | licence |",
              "|---|---|---|---|---|---|---|"]
    for name, n in train["by_source"].items():
        s = manifest["sources"].get(name, {})
        lines.append(f"| {name} | {s.get('domain', '')} | {s.get('version', '')} | {n['records']:,} | {n['words']:,} | "
                     f"{n['bpe']:,} | {s.get('licence', '')} |")
    held = {k: manifest["splits"][k]["records"] for k in ("validation", "test")}
    lines += ["", "## Held out (as in the source pack)", "",
              f"Validation {held['validation']:,} records, test {held['test']:,}, probes "
              f"{sum(t['items'] for t in manifest['probe']['tasks'].values()):,} items "
              f"({manifest['probe']['held_out_docs']:,} documents). Each source's licence and attribution: LICENSES.md.", ""]
    return "\n".join(lines)
