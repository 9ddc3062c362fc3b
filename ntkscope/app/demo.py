"""The end-to-end GC demo on the shipped corpus pack.

Data: the default pack (``ntkscope/data/pack-small``): real general text (GCIDE,
WordNet, Python docs, FOLDOC, Jargon, fortunes) with legal (ScanCode licences) and
biomedical (GO, HPO) text as a 7% long tail; its byte-level BPE of 8192 tokens.

The demo trains a small GPT from :mod:`cse_models` on the train split's blocks (the same
training as ``cse-train``), scores held-out validation sentences by their sentence frequency score (docs/design.md §2,
``"max"``, counts over the train split) and measures the gradient consistency of each
domain and of each frequency bin against the whole analysis batch. The analysis batch is
stratified, so that each long-tail domain has enough sentences for its own eigenvector:
``n_tail`` legal and ``n_tail`` biomedical sentences, the rest general.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cse_models.model import load_model
from cse_models.train import TrainConfig, load_data, train
from ntkscope.core.checks import InputError, check_positive_int, entry
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.gc.groups import gc_by_group
from ntkscope.gc.options import GCOptions
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.text import split_sentences
from ntkscope.text.frequency import count_tokens, sentence_scores, token_frequency
from ntkscope.text.sentences import AnalysisData, encode_texts

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
    used, the training curve (the loss at each step), the training blocks and the time."""

    table: pd.DataFrame
    losses: list
    n_blocks: int
    seconds: float
    output: str = "centred-true-logit"


@entry("run_demo")
def run_demo(*, steps: int = 800, n: int = 128, n_tail: int = 12, seq_len: int = 48, seed: int = 0,
             method: str = "auto", output: str = "centred-true-logit", pack=None) -> DemoResult:
    """Train a small GPT on the pack's training blocks (:func:`cse_models.train.train`, in a
    temporary directory), then GC per domain and per frequency bin (:func:`~ntkscope.gc_by_group`,
    the ``ntkscope gc`` table: "bin k" with its edges; ``output``: the centred true-token logit by
    default, the reproduction's choice: see docs/gc-outputs.md)."""
    check_positive_int("steps", steps)
    if isinstance(n, bool) or not isinstance(n, int) or n < 8:
        raise InputError("n", "must be an integer >= 8 (two long-tail domains, general text, 3 frequency bins)", n)
    start = time.perf_counter()
    pack = load_pack(pack)
    tokenizer = pack.tokenizer()
    with tempfile.TemporaryDirectory(prefix="ntkscope-demo-") as run:
        cfg = TrainConfig.from_dict({
            "out_dir": run, "model": {"n_layer": 2, "n_head": 2, "n_embd": 64},
            "data": {"pack": str(pack.path), "seq_len": seq_len}, "steps": steps, "batch_size": 32, "lr": 3e-3,
            "warmup_steps": min(50, steps // 10), "checkpoint_every": steps, "log_every": max(1, steps // 8),
            "seed": seed, "tensorboard": False, "device": "cpu"})
        last = train(cfg)
        model = load_model(last).eval()
        losses = [json.loads(line)["loss"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        n_blocks = len(load_data(cfg)[0])
    train_records = pack.records("train")
    probe = analysis_batch(_sentences(pack.records("validation")), n, n_tail, seed)
    phi = token_frequency(count_tokens(train_records, tokenizer))
    scores, _ = sentence_scores(list(probe.text), tokenizer, phi)
    data = AnalysisData(encode_texts(tokenizer, probe.text, seq_len),
                        pd.DataFrame({"text": probe.text, "label": probe.domain, "score": scores}),
                        "the pack's validation sentences, stratified")
    frames = []
    for by, name in (("label", "domain"), ("frequency-bins", "frequency bin")):
        frame, _, _ = gc_by_group(model, data, gc=GCOptions(by=by, bins=3, min_count=2),
                                 resampling=Resampling(seed=seed), controls=None, method=method, output=output)
        frame.insert(0, "by", name)
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    return DemoResult(table, losses, n_blocks, time.perf_counter() - start, output)


def perplexity(loss: float) -> float:
    return math.exp(loss)
