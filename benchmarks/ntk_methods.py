"""NTK methods side by side, in one process, against what a user would otherwise write.

For a small GPT (2 layers, d=128; and 4 layers, d=256; 64 tokens; a byte-level
BPE of 8192 tokens trained on real text) and n = 64, 128, 256 sentences, prints
for each method: seconds, peak memory above the baseline (RSS sampled every
5 ms), and the time as a multiple of one training step (forward + backward +
AdamW over the same batch). Methods:

- ``exact``          ntkscope.empirical_ntk(method="exact")
- ``projected``      ntkscope.empirical_ntk(method="projected", projection_dim=256)
- ``matrix-free``    ntkscope.ntk_top_eigenpair(method="matrix-free"): the top eigenvector only
- ``loop+gram``      anchor: torch.autograd.grad per sample, stack J, J @ J.T
- ``jacrev``         anchor: the torch.func NTK tutorial's jacobian contraction
                     (vmap(jacrev) over the whole batch, einsum per parameter)

Targets (issue 2): exact <= 1.5x a training step plus the Gram matrix, with the
Gram at >= 70% of the machine's matmul rate; matrix-free within 8 matvecs when
lambda_1 / lambda_2 >= 2.

Run: python benchmarks/ntk_methods.py [--quick] [--out benchmarks/results.csv]
"""

from __future__ import annotations

import argparse
import ast
import re
import sysconfig
from pathlib import Path
import gc
import os
import platform
import threading
import time

import numpy as np
import pandas as pd
import torch
from torch.func import functional_call, jacrev, vmap

import ntkscope as ns
from cse_models import GPT, GPTConfig
from ntkscope.core.memory import training_thresholds
from ntkscope.kernel.eigen import top_eigenpair


class PeakRSS:
    """Peak resident memory above the level at entry, sampled from /proc/self/statm."""

    def __init__(self, interval=0.005):
        self.interval, self.peak = interval, 0
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self):
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self):
        gc.collect()
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.bytes = self.peak - self.base



def stdlib_docstring_sentences(min_chars: int = 40, max_chars: int = 200) -> list:
    """Sentences of the docstrings in the Python standard library's top-level modules."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for part in re.split(r"(?<=[.!?;])\s+", " ".join((ast.get_docstring(node) or "").split())):
                    if min_chars <= len(part) <= max_chars and part.isascii() and \
                            sum(c.isalpha() for c in part) > 0.6 * len(part):
                        found.append(part)
    return found

def tokenizer_and_batches(n_max, seq_len, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = stdlib_docstring_sentences()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>"]))
    rng = np.random.default_rng(0)
    chosen = rng.choice(len(texts), n_max, replace=False)
    ids = torch.zeros(n_max, seq_len, dtype=torch.long)
    mask = torch.zeros(n_max, seq_len, dtype=torch.long)
    for row, i in enumerate(chosen):
        enc = tok.encode(texts[i]).ids[:seq_len]
        ids[row, : len(enc)] = torch.tensor(enc)
        mask[row, : len(enc)] = 1
    return tok.get_vocab_size(), {"input_ids": ids, "attention_mask": mask}


def loss_fn(logits, batch):
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    valid = mask[:, 1:] & mask[:, :-1]
    # as transformers' causal LM loss takes it: the labels shifted (the last position ignored) and the
    # logits whole, over (B*T, V) rows (a slice of them is copied whole; over the transposed (B, V, T)
    # layout the softmax runs three times slower)
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            reduction="none").view(ids.shape[0], -1)[:, :-1]
    return ((nll * valid).sum(1) / valid.sum(1))


def train_step_seconds(model, batch, repeats=3):
    training_thresholds(force=True)  # every step under a training loop's malloc thresholds (docs/design.md 1.2.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        loss = loss_fn(model(**batch), batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def loop_and_gram(model, batch):
    params = list(dict(model.named_parameters()).values())
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        g = torch.autograd.grad(loss_fn(model(**one), one)[0], params)
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    J = torch.stack(rows)
    return J @ J.T


def jacrev_tutorial(model, batch):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f_single(p, ids, mask):
        b = {"input_ids": ids[None], "attention_mask": mask[None]}
        return loss_fn(functional_call(model, p, (), b), b)[0]

    def jac(b):
        j = vmap(jacrev(f_single), (None, 0, 0))(params, b["input_ids"], b["attention_mask"])
        return [t.flatten(1) for t in j.values()]

    j1 = jac(batch)
    j2 = jac(batch)  # the tutorial computes the second Jacobian even when x2 = x1
    return torch.stack([torch.einsum("Nf,Mf->NM", a, b) for a, b in zip(j1, j2)]).sum(0)


def matmul_rate(n=2048, repeats=3):
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - t)


def gram_seconds(n, P, repeats=2):
    J = torch.randn(n, P)
    J @ J.T
    t = time.perf_counter()
    for _ in range(repeats):
        J @ J.T
    return (time.perf_counter() - t) / repeats


def measure(fn):
    with PeakRSS() as mem:
        t = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t
    return out, seconds, mem.bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 2-layer model and n = 64")
    parser.add_argument("--out", default=None, help="write the table as CSV")
    parser.add_argument("--skip-anchors-above", type=float, default=0.35,
                        help="skip an anchor whose J would need more than this fraction of RAM")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    sizes = [(2, 128)] if args.quick else [(2, 128), (4, 256)]
    ns_list = [64] if args.quick else [64, 128, 256]
    seq_len = 64
    vocab, all_batch = tokenizer_and_batches(max(ns_list), seq_len, 8192)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rate = matmul_rate()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{ram / 2**30:.0f} GiB, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"float32 matmul {rate / 1e9:.0f} GFLOP/s; BPE vocab {vocab}")
    rows = []
    for n_layer, d in sizes:
        model = GPT(GPTConfig(vocab_size=vocab, block_size=seq_len, n_layer=n_layer, n_head=4, n_embd=d)).float()
        P = sum(p.numel() for p in model.parameters())
        for n in ns_list:
            batch = {k: v[:n] for k, v in all_batch.items()}
            step = train_step_seconds(GPT(model.config).float(), batch)
            model.eval()
            t_gram = gram_seconds(n, P)
            ref = None
            results = {}
            exact, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="exact"))
            results["exact"] = (t, m, "")
            ref = exact.matrix
            proj, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="projected", projection_dim=256))
            err = float(((proj.matrix - ref).abs() / torch.sqrt(torch.outer(ref.diag(), ref.diag()))).max())
            results["projected"] = (t, m, f"max rel err {err:.3f} (bound {proj.error_bound:.3f})")
            dense = top_eigenpair(ref)
            mf, t, m = measure(lambda: ns.ntk_top_eigenpair(model, batch, method="matrix-free"))
            cos = abs(float(np.dot(mf.eigenvector, dense.eigenvector)))
            results["matrix-free"] = (t, m, f"{mf.matvecs} matvecs, lambda1/lambda2 {1 / dense.eigengap:.2f}, "
                                            f"abs(cos) {cos:.8f}")
            j_bytes = n * P * 4
            if j_bytes <= args.skip_anchors_above * ram:
                K, t, m = measure(lambda: loop_and_gram(model, batch))
                results["loop+gram"] = (t, m, f"max abs diff {float((K - ref).abs().max() / ref.abs().max()):.1e}")
            else:
                results["loop+gram"] = (float("nan"), float("nan"), "skipped: J too large")
            if 2 * j_bytes <= args.skip_anchors_above * ram:
                K, t, m = measure(lambda: jacrev_tutorial(model, batch))
                results["jacrev"] = (t, m, f"max abs diff {float((K - ref).abs().max() / ref.abs().max()):.1e}")
            else:
                results["jacrev"] = (float("nan"), float("nan"), "skipped: 2 J too large")
            exact_t = results["exact"][0]
            target = 1.5 * step + t_gram
            gram_rate = 2 * n * n * P / t_gram
            for method, (t, m, note) in results.items():
                if method == "exact":
                    note = (f"target {target:.2f} s (1.5 step + gram): {'met' if exact_t <= target else 'MISSED'}; "
                            f"gram {t_gram:.2f} s at {gram_rate / rate:.0%} of matmul rate")
                rows.append(dict(model=f"{n_layer}L d{d}", P=P, n=n, method=method, seconds=t,
                                 peak_MiB=m / 2**20, x_train_step=t / step, train_step_s=step, note=note))
                print(f"{n_layer}L d{d} P={P / 1e6:.2f}M n={n:4d} {method:12s} {t:8.2f} s "
                      f"{m / 2**20:8.0f} MiB {t / step:7.2f}x step  {note}", flush=True)
    frame = pd.DataFrame(rows)
    if args.out:
        frame.to_csv(args.out, index=False)
    return frame


if __name__ == "__main__":
    main()
