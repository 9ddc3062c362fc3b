"""The end-to-end GC demo on the shipped corpus pack.

Data: the default pack (``ntkscope/data/pack-small``): real general text (GCIDE,
WordNet, Python docs, FOLDOC, Jargon, fortunes) with legal (ScanCode licences) and
biomedical (GO, HPO) text as a 7% long tail; its byte-level BPE of 8192 tokens.

The demo trains a small GPT from :mod:`cse_models` on sentences of the train split,
scores held-out validation sentences by their sentence frequency score (docs/design.md §2,
``"max"``, counts over the train split) and measures the gradient consistency of each
domain and of each frequency bin against the whole analysis batch. The analysis batch is
stratified, so that each long-tail domain has enough sentences for its own eigenvector:
``n_tail`` legal and ``n_tail`` biomedical sentences, the rest general.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from cse_models import GPT, GPTConfig
from ntkscope.core.checks import InputError, check_positive_int, entry
from ntkscope.core.lm import causal_pairs, lm_loss
from ntkscope.kernel.consistency import gradient_consistency_groups
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.text import split_sentences
from ntkscope.text.frequency import bin_edges, bin_of, count_tokens, sentence_scores, token_frequency
from ntkscope.text.sentences import encode_texts

log = logging.getLogger(__name__)


def _sentences(records, min_words: int = 6) -> pd.DataFrame:
    rows = [(s, r.domain) for r in records for s in split_sentences(r.text) if len(s.split()) >= min_words]
    return pd.DataFrame(rows, columns=["text", "domain"]).drop_duplicates("text").reset_index(drop=True)


def analysis_batch(frame: pd.DataFrame, n: int, n_tail: int, seed: int) -> pd.DataFrame:
    """``n_tail`` sentences (at most n/4) of each long-tail domain and general ones to make ``n``, shuffled."""
    rng = np.random.default_rng(seed)
    n_tail = min(n_tail, n // 4)
    parts = []
    for domain in ("legal", "biomedical"):
        pool = frame.index[frame.domain == domain]
        parts.append(rng.choice(pool, min(n_tail, len(pool)), replace=False))
    general = frame.index[frame.domain == "general"]
    parts.append(rng.choice(general, max(0, min(len(general), n - sum(map(len, parts)))), replace=False))
    chosen = np.concatenate(parts)
    return frame.loc[chosen[rng.permutation(len(chosen))]].reset_index(drop=True)


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured: GC per group (with intervals and the null band), the output it
    used, the training curve, sizes and timings."""

    table: pd.DataFrame
    losses: list
    n_sentences: int
    seconds: float
    output: str = "centred-true-logit"


@entry("run_demo")
def run_demo(*, steps: int = 800, n: int = 128, n_tail: int = 12, seq_len: int = 48, seed: int = 0,
             method: str = "auto", output: str = "centred-true-logit", pack=None) -> DemoResult:
    """Train a small GPT on the pack's train sentences, then GC per domain and per frequency bin
    (``output``: the centred true-token logit by default, the reproduction's choice: see
    docs/gc-outputs.md)."""
    check_positive_int("steps", steps)
    if isinstance(n, bool) or not isinstance(n, int) or n < 8:
        raise InputError("n", "must be an integer >= 8 (two long-tail domains, general text, 3 frequency bins)", n)
    start = time.perf_counter()
    torch.manual_seed(seed)
    pack = load_pack(pack)
    tokenizer = pack.tokenizer()
    train_records = pack.records("train")
    train = _sentences(train_records)
    probe = analysis_batch(_sentences(pack.records("validation")), n, n_tail, seed)
    data = encode_texts(tokenizer, train.text, seq_len)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=seq_len, n_layer=2, n_head=2, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        rows = torch.randint(0, len(train), (32,), generator=gen)
        ids, mask = data["input_ids"][rows], data["attention_mask"][rows]
        logits, targets, keep = causal_pairs(model(ids, mask), ids, mask.bool())
        loss = lm_loss(logits, targets, keep, reduction="mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log.info("demo: step %d/%d, loss %.3f", step + 1, steps, loss.item())
    model.eval()

    batch = encode_texts(tokenizer, probe.text, seq_len)
    phi = token_frequency(count_tokens(train_records, tokenizer))
    scores, _ = sentence_scores(list(probe.text), tokenizer, phi)
    edges = bin_edges(scores, 3, kind="count")
    bins = bin_of(scores, edges)
    labels = [f"freq {edges[b]:.3f}-{edges[b + 1]:.3f}" for b in bins]
    frames = []
    for by, groups in (("domain", list(probe.domain)), ("frequency bin", labels)):
        frame = gradient_consistency_groups(model, batch, groups, method=method, output=output,
                                            resampling=Resampling(seed=seed)).to_frame()
        frame.insert(0, "by", by)
        frame["mean_frequency_score"] = [float(np.mean(scores[np.array(groups) == lab])) for lab in frame.label]
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    return DemoResult(table, losses, len(train), time.perf_counter() - start, output)


def perplexity(loss: float) -> float:
    return math.exp(loss)
