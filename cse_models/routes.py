"""Routing by a fixed assignment: the expert of every block, decided before training.

DEMix routes a sequence by its domain label. The same dispatch serves any assignment of
blocks to experts that is fixed in advance; the frozen-encoder router
(:mod:`ntkscope.runs.encoder`, docs/design.md §4.2) gives each block the expert of its
cluster in a frozen encoder's embedding space, computed from the text alone (no labels), so
test blocks are routed the same way. A routes file (JSON) holds, per split, the expert of
every block and a digest of the blocks it was made for, so routes never reach other blocks::

    {"names": ["encoder-0", ...], "source": {...},
     "splits": {"train": {"blocks": N, "digest": "sha256...", "experts": [e_0, ..., e_N-1]}, ...}}

``data.routes`` in a :class:`~cse_models.train.TrainConfig` names such a file: the training
blocks' labels become their experts, and the model is a DEMix model whose ``domains`` are the
file's ``names`` (expert j serves label j). Because the assignment and the batches
(:func:`~cse_models.data.global_batch`, a function of seed and step) are both fixed, what each
expert receives in every window of training is known exactly (:func:`window_loads`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cse_models.data import Blocks, global_batch
from ntkscope.core.checks import MissingInput, UserError
from ntkscope.core.files import read_json_object, write_json


def blocks_digest(blocks: Blocks) -> str:
    """sha256 of the blocks' token ids (int64, row-major): which blocks a route list is for."""
    return hashlib.sha256(blocks.input_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Routes:
    """names: the experts' names (E,); experts: {split: (N,) int64 in [0, E)}; digests: {split:
    :func:`blocks_digest` of the blocks routed}; source: how the assignment was made."""

    names: tuple
    experts: dict
    digests: dict
    source: dict = field(default_factory=dict)

    def __post_init__(self):
        for split, e in self.experts.items():
            if len(e) and (int(np.min(e)) < 0 or int(np.max(e)) >= len(self.names)):
                raise UserError(f"Routes: split {split!r} routes to experts outside [0, {len(self.names)})")

    def save(self, path: str | Path) -> Path:
        """Written atomically as JSON."""
        splits = {s: {"blocks": int(len(e)), "digest": self.digests[s], "experts": [int(x) for x in e]}
                  for s, e in self.experts.items()}
        return write_json(path, {"names": list(self.names), "source": self.source, "splits": splits}, indent=None)

    @classmethod
    def load(cls, path: str | Path) -> "Routes":
        data = read_json_object(path, "Routes.load")
        try:
            splits = data["splits"]
            experts = {s: np.asarray(v["experts"], dtype=np.int64) for s, v in splits.items()}
            digests = {s: str(v["digest"]) for s, v in splits.items()}
            if any(len(experts[s]) != int(v["blocks"]) for s, v in splits.items()):
                raise UserError("a split's block count differs from its experts list")
            return cls(tuple(data["names"]), experts, digests, dict(data.get("source") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"Routes.load: {path} is not a routes file ({err})") from None

    def apply(self, blocks: Blocks, split: str) -> Blocks:
        """``blocks`` labelled by their experts (names: the experts'); refused unless this file
        routes exactly these blocks."""
        if split not in self.experts:
            raise UserError(f"Routes.apply: the routes have no split {split!r} (they have {sorted(self.experts)})")
        if len(blocks) != len(self.experts[split]) or blocks_digest(blocks) != self.digests[split]:
            raise UserError(f"Routes.apply: the routes of split {split!r} were made for other blocks "
                            f"({len(self.experts[split])} blocks, digest {self.digests[split][:12]}; these are "
                            f"{len(blocks)} blocks, digest {blocks_digest(blocks)[:12]}): make them again for this "
                            "data and seq_len")
        return Blocks(blocks.input_ids, torch.as_tensor(self.experts[split], dtype=torch.long), tuple(self.names))

    def crosstab(self, blocks: Blocks, split: str) -> dict:
        """The blocks of ``split`` each expert receives, by the blocks' own domain:
        {expert: {domain: count}} (experts and domains with no block left out)."""
        self.apply(blocks, split)  # the same blocks
        frame = pd.crosstab(self.experts[split], [blocks.domain_names[int(d)] for d in blocks.domains])
        return {str(e): {d: int(n) for d, n in row.items() if n} for e, row in frame.iterrows()}


def window_loads(routes: Routes, blocks: Blocks, *, seed: int, batch_size: int, start: int, end: int,
                 every: int = 50) -> pd.DataFrame:
    """What each expert receives in every ``every``-step window of steps [start, end) of a run
    with data order ``seed``, replayed exactly from the batches: columns step (the window's last
    step), expert, n, and ``n DOMAIN`` for each of the blocks' domains."""
    experts = routes.experts["train"]
    routes.apply(blocks, "train")
    domains = blocks.domains.numpy()
    D, E = len(blocks.domain_names), len(routes.names)
    rows, counts = [], np.zeros((E, D), dtype=np.int64)
    for step in range(start, end):
        idx = global_batch(blocks, step, batch_size, seed).numpy()
        np.add.at(counts, (experts[idx], domains[idx]), 1)
        done = step + 1
        if done % every == 0 or done == end:
            for e in range(E):
                rows.append({"step": done, "expert": e, "n": int(counts[e].sum()),
                             **{f"n {d}": int(c) for d, c in zip(blocks.domain_names, counts[e])}})
            counts[:] = 0
    return pd.DataFrame(rows)


def load_routes_for(routes: str | None, blocks: Blocks, split: str) -> Blocks:
    """The blocks of a TrainConfig's data labelled by ``routes`` (its ``data.routes`` file), or as they are."""
    if not routes:
        return blocks
    path = Path(routes)
    if not path.is_file():
        raise MissingInput(f"TrainConfig: data.routes {path} does not exist")
    return Routes.load(path).apply(blocks, split)
