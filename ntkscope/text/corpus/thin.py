"""A second corpus mix from a pack: the same pack with some domains' training records thinned
(e.g. out-of-sample trunks on another mix: the long tail's training share halved). Validation, test,
probes and the tokenizer are the source pack's, so models trained on either are evaluated on the
same test blocks; the manifest records what was thinned and the shares measured after it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ntkscope.core.checks import entry, fail
from ntkscope.text.corpus.pack import jsonl_gz, load_pack, sealed, write_atomic_dir
from ntkscope.text.corpus.text import count_words

log = logging.getLogger(__name__)


@entry("thin_pack")
def thin_pack(out, keep: dict, *, pack=None, seed: int = 0, overwrite: bool = False) -> Path:
    """Write to ``out`` the pack ``pack`` (default: the shipped one) with, in its train split, a
    seeded random ``keep[domain]`` share of each named domain's records (e.g. {"legal": 0.5,
    "biomedical": 0.5}); everything else as it is. Returns ``out``."""
    source = load_pack(pack)
    domains = set(source.manifest["domains"])
    for domain, share in keep.items():
        if domain not in domains:
            raise fail("thin_pack", "keep", f"must name domains of the pack ({sorted(domains)})", domain)
        if not 0 < share <= 1:
            raise fail("thin_pack", "keep", "must map each domain to a share in (0, 1]", {domain: share})
    rows = source._rows("train.jsonl.gz")
    rng = np.random.default_rng(seed)
    kept = []
    for domain in sorted({r["domain"] for r in rows}):
        mine = [r for r in rows if r["domain"] == domain]
        if domain in keep:
            idx = np.sort(rng.permutation(len(mine))[:int(round(keep[domain] * len(mine)))])
            mine = [mine[i] for i in idx]
        kept.extend(mine)
    order = {id(r): i for i, r in enumerate(rows)}
    kept.sort(key=lambda r: order[id(r)])  # the source's order
    files = {name: (source.path / name).read_bytes() for name in source.manifest["files"] if name != "train.jsonl.gz"}
    files["train.jsonl.gz"] = jsonl_gz(kept)
    counts = {}
    for r in kept:
        counts[r["domain"]] = counts.get(r["domain"], 0) + count_words(r["text"])
    total = sum(counts.values())
    manifest = json.loads(json.dumps(source.manifest))
    manifest.update({"derived_from": {"version": source.manifest["version"], "thinned": "train", "keep": keep,
                                      "seed": seed},
                     "share_measured_train": 1 - counts.get("general", 0) / total})
    manifest["splits"]["train"] = {"records": len(kept), "tokens": total,
                                   "by_domain": {d: {"tokens": n} for d, n in sorted(counts.items())}}
    write_atomic_dir(Path(out), sealed(manifest, files), overwrite=overwrite)
    log.info("thin_pack: wrote %s: train keeps %s; long-tail share of train %.4f", out, keep,
             manifest["share_measured_train"])
    return Path(out)
