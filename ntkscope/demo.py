"""A small end-to-end GC demo on real text that every Python installation has.

General English: docstrings of the Python standard library's modules, classes
and functions. Long tail: sentences of the licence texts shipped with this
package's own dependencies (numpy, scipy, torch, ...), about 8% of the
sentences, as legal text is in the CSE paper's corpus. Tokens are UTF-8 bytes
(vocabulary 256), so no tokenizer has to be trained or downloaded.

The demo trains a small GPT from :mod:`cse_models` briefly, scores each sentence
by the mean frequency of its tokens (DESIGN.md §2, ``"max"`` normalisation),
and measures the gradient consistency of each domain and frequency bin against
the whole analysis batch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import logging
import math
import re
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ntkscope.consistency import gradient_consistency_groups

log = logging.getLogger(__name__)

LICENSED_DEPENDENCIES = ("numpy", "scipy", "torch", "scikit-learn", "pandas", "matplotlib")
_SENTENCE = re.compile(r"(?<=[.!?;])\s+")


def _sentences(text: str, min_chars: int = 40, max_chars: int = 200) -> list:
    out = []
    for part in _SENTENCE.split(" ".join(text.split())):
        if min_chars <= len(part) <= max_chars and part.isascii() and sum(c.isalpha() for c in part) > 0.6 * len(part):
            out.append(part)
    return out


def stdlib_docstring_sentences() -> list:
    """Sentences of the docstrings in the standard library's top-level modules."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    found.extend(_sentences(doc))
    return found


def licence_sentences(packages=LICENSED_DEPENDENCIES) -> list:
    """Sentences of the licence files in the installed distributions' metadata."""
    found = []
    for name in packages:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in sorted(dist.files or [], key=str):
            lower = str(f).lower()
            if ".dist-info" in lower and ("license" in lower or "copying" in lower):
                try:
                    found.extend(_sentences(Path(dist.locate_file(f)).read_text(encoding="utf-8")))
                except (OSError, UnicodeDecodeError):
                    continue
    return found


def demo_corpus(legal_share: float = 0.08, max_sentences: int = 4000, seed: int = 0) -> pd.DataFrame:
    """DataFrame (text, domain) with about ``legal_share`` legal sentences, duplicates removed, shuffled."""
    general = list(dict.fromkeys(stdlib_docstring_sentences()))
    legal = list(dict.fromkeys(s for s in licence_sentences() if s not in set(general)))
    if len(legal) < 10 or len(general) < 100:
        raise FileNotFoundError(f"demo_corpus: found {len(general)} docstring and {len(legal)} licence sentences; "
                           "the Python installation looks incomplete")
    rng = np.random.default_rng(seed)
    n_legal = min(len(legal), int(round(legal_share * max_sentences)))
    n_general = min(len(general), int(round(n_legal * (1 - legal_share) / legal_share)), max_sentences - n_legal)
    rows = [(t, "general") for t in rng.choice(general, n_general, replace=False)]
    rows += [(t, "legal") for t in rng.choice(legal, n_legal, replace=False)]
    frame = pd.DataFrame(rows, columns=["text", "domain"])
    return frame.iloc[rng.permutation(len(frame))].reset_index(drop=True)


def encode_bytes(texts, length: int) -> dict:
    """UTF-8 bytes as token ids, right-padded with 0: input_ids and attention_mask of shape (n, length)."""
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    mask = torch.zeros(len(texts), length, dtype=torch.long)
    for i, text in enumerate(texts):
        b = list(text.encode("utf-8"))[:length]
        ids[i, : len(b)] = torch.tensor(b)
        mask[i, : len(b)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def byte_frequency_scores(texts, reference) -> np.ndarray:
    """Mean over a sentence's bytes of count(byte) / max count, counts over ``reference``."""
    counts = np.zeros(256)
    for text in reference:
        counts += np.bincount(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), minlength=256)
    phi = counts / counts.max()
    return np.array([phi[np.frombuffer(t.encode("utf-8"), dtype=np.uint8)].mean() for t in texts])


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured: GC per group, the training curve, and timings."""

    table: pd.DataFrame
    losses: list
    n_sentences: int
    seconds: float


def run_demo(*, steps: int = 400, n: int = 128, seq_len: int = 64, seed: int = 0, method: str = "auto") -> DemoResult:
    """Train a small GPT on the demo corpus, then GC per domain and per frequency bin."""
    from cse_models import GPT, GPTConfig

    start = time.perf_counter()
    torch.manual_seed(seed)
    corpus = demo_corpus(seed=seed)
    train, probe = corpus.iloc[n:], corpus.iloc[:n]
    data = encode_bytes(list(train.text), seq_len)
    model = GPT(GPTConfig(vocab_size=256, block_size=seq_len, n_layer=2, n_head=2, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in range(steps):
        rows = torch.randint(0, len(train), (32,), generator=gen)
        ids, mask = data["input_ids"][rows], data["attention_mask"][rows]
        logits = model(ids, mask)
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][valid], ids[:, 1:][valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log.info("demo: step %d/%d, loss %.3f", step + 1, steps, loss.item())
    model.eval()

    batch = encode_bytes(list(probe.text), seq_len)
    scores = byte_frequency_scores(list(probe.text), list(train.text))
    edges = np.linspace(scores.min(), scores.max() + 1e-12, 4)
    bins = np.digitize(scores, edges[1:-1])
    labels = [f"freq {edges[b]:.3f}-{edges[b + 1]:.3f}" for b in bins]
    frames = []
    for by, groups in (("domain", list(probe.domain)), ("frequency bin", labels)):
        res = gradient_consistency_groups(model, batch, groups, method=method)
        frame = res.to_frame()
        frame.insert(0, "by", by)
        frame["mean_frequency_score"] = [float(np.mean(scores[np.array(groups) == lab])) for lab in frame.label]
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    return DemoResult(table, losses, len(corpus), time.perf_counter() - start)


def perplexity(loss: float) -> float:
    return math.exp(loss)
