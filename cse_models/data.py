"""Training data: fixed-length token blocks from a corpus pack or text files, each labelled
with its domain, and batches that depend only on (seed, step) — so a resumed run and a
data-parallel run see exactly the batches a single uninterrupted run sees.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ntkscope.core.checks import MissingInput, UserError
from ntkscope.text.corpus.text import read_text


#: how texts become training rows: "packed" (each domain's texts joined into one stream, cut into
#: full blocks) or "rows" (one text per row, cut at the block length, padded: a padding collator's)
LAYOUTS = ("packed", "rows")


@dataclass(frozen=True)
class Blocks:
    """input_ids (N, T) long; domains (N,) long, indices into ``domain_names``; ``mask`` (N, T)
    bool, True on a row's tokens and False on its padding (None: every position a token, packed)."""

    input_ids: torch.Tensor
    domains: torch.Tensor
    domain_names: tuple
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def select(self, domain: str) -> "Blocks":
        if domain not in self.domain_names:
            raise UserError(f"Blocks.select: domain must be one of {list(self.domain_names)} (got {domain!r})")
        keep = self.domains == self.domain_names.index(domain)
        return Blocks(self.input_ids[keep], self.domains[keep], self.domain_names,
                      None if self.mask is None else self.mask[keep])


def _stream_blocks(token_lists: Sequence[Sequence[int]], seq_len: int, sep: int) -> np.ndarray:
    """Concatenate token lists with a separator and cut into (n, seq_len) blocks (remainder dropped)."""
    flat = np.fromiter((t for ids in token_lists for t in (*ids, sep)), dtype=np.int64)
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len)


def _row_blocks(token_lists: Sequence[Sequence[int]], seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """One row per token list of two tokens or more (a shorter one predicts nothing), its first
    ``seq_len`` tokens then ``pad``; (ids, mask), each (n, seq_len)."""
    kept = [list(ids)[:seq_len] for ids in token_lists if len(ids) >= 2]
    ids = np.full((len(kept), seq_len), pad, dtype=np.int64)
    mask = np.zeros((len(kept), seq_len), dtype=bool)
    for i, row in enumerate(kept):
        ids[i, :len(row)], mask[i, :len(row)] = row, True
    return ids, mask


def make_blocks(texts_by_domain: dict[str, Sequence[str]], tokenizer, seq_len: int, *,
                layout: str = "packed") -> Blocks:
    """Each domain's texts as rows of ``seq_len`` tokens: "packed", one stream per domain (texts
    joined by end-of-text) cut into full blocks; "rows", one text per row, cut at ``seq_len`` and
    padded, with the mask saying which positions are tokens (:data:`LAYOUTS`)."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise UserError(f"make_blocks: seq_len must be an integer >= 2 (got {seq_len!r})")
    if layout not in LAYOUTS:
        raise UserError(f"make_blocks: layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")
    sep = tokenizer.backend.token_to_id("<|endoftext|>") if hasattr(tokenizer.backend, "token_to_id") else None
    sep = sep if sep is not None else (tokenizer.pad_id or 0)
    names, ids, doms, masks = [], [], [], []
    for domain in sorted(texts_by_domain):
        encoded = tokenizer.encode(list(texts_by_domain[domain]))
        if layout == "rows":
            blocks, mask = _row_blocks(encoded, seq_len, tokenizer.pad_id if tokenizer.pad_id is not None else sep)
        else:
            blocks, mask = _stream_blocks(encoded, seq_len, sep), None
        if len(blocks):
            names.append(domain)
            ids.append(blocks)
            masks.append(mask)
            doms.append(np.full(len(blocks), len(names) - 1))
    if not ids:
        raise UserError(f"make_blocks: the texts hold fewer than {'2' if layout == 'rows' else f'seq_len={seq_len}'} "
                        "tokens in every domain")
    return Blocks(torch.from_numpy(np.concatenate(ids)), torch.from_numpy(np.concatenate(doms)), tuple(names),
                  None if layout == "packed" else torch.from_numpy(np.concatenate(masks)))


def pack_blocks(pack, tokenizer, split: str, seq_len: int, domains: Sequence[str] | None = None, *,
                layout: str = "packed") -> Blocks:
    """Blocks of a corpus pack's split, optionally only some domains (domain finetuning)."""
    by_domain: dict[str, list[str]] = {}
    for r in pack.records(split):
        if domains is None or r.domain in domains:
            by_domain.setdefault(r.domain, []).append(r.text)
    if domains is not None and set(domains) - set(by_domain):
        raise UserError(f"pack_blocks: domains {sorted(set(domains) - set(by_domain))} have no records in "
                        f"split {split!r} (the pack has {sorted({r.domain for r in pack.records(split)})})")
    return make_blocks(by_domain, tokenizer, seq_len, layout=layout)


def text_file_blocks(files: Sequence[str] | dict[str, Sequence[str]], tokenizer, seq_len: int, *,
                     layout: str = "packed") -> Blocks:
    """Blocks from plain UTF-8 text files: a list of paths, one domain ``"text"``, or ``{domain:
    [paths]}`` (``data.text_files``); paragraphs are blank-line separated. A file that is missing,
    empty or not UTF-8 is refused in one line naming it."""
    by_domain = {}
    for domain, paths in (files.items() if isinstance(files, dict) else [("text", files)]):
        texts = []
        for path in paths:
            if not Path(path).is_file():
                raise MissingInput(f"text_file_blocks: {path} does not exist or is not a file (data.text_files)")
            text = read_text(Path(path), func="text_file_blocks")
            texts.extend(p.strip() for p in text.split("\n\n") if p.strip())
        by_domain[domain] = texts
    return make_blocks(by_domain, tokenizer, seq_len, layout=layout)


def step_generator(seed: int, step: int, purpose: str = "batch") -> torch.Generator:
    """A CPU generator seeded by (seed, step, purpose) only."""
    digest = hashlib.sha256(f"{seed}:{step}:{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def global_batch(blocks: Blocks, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Indices of the global batch of ``step`` (batch_size,), sampled with replacement."""
    return torch.randint(0, len(blocks), (batch_size,), generator=step_generator(seed, step))


def mask_tokens(ids: torch.Tensor, *, mask_token_id: int, vocab_size: int, generator: torch.Generator,
                special_ids=(), prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: ``prob`` of the non-special tokens are targets; of those 80% become the
    mask token, 10% a random token, 10% stay. Returns (inputs, labels), labels -100 elsewhere."""
    special = torch.zeros_like(ids, dtype=torch.bool)
    for s in special_ids:
        special |= ids == s
    target = (torch.rand(ids.shape, generator=generator) < prob) & ~special
    r = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=generator)
    inputs = torch.where(target & (r < 0.8), torch.full_like(ids, mask_token_id), ids)
    inputs = torch.where(target & (r >= 0.8) & (r < 0.9), random_ids, inputs)
    labels = torch.where(target, ids, torch.full_like(ids, -100))
    return inputs, labels
