"""Exact NTK at language-model scale: the structured method beside exact, panels, matrix-free
and what a user would otherwise run, side by side in one process (issue 16).

Cases (real sentences: Python standard-library docstrings, a byte-level BPE of 8192 tokens):

- ``small``: the 2-layer d=128 GPT of cse_models (1.45M parameters), T = 64, n = 128 and 256.
  Rows: one training step (forward + backward + AdamW); ntkscope exact (vmap per-sample
  gradients + Gram), structured, exact in panels (``max_memory`` a third of J), matrix-free
  (eigenpair only); anchors: the per-sample autograd loop + Gram, the torch.func tutorial's
  vmap(jacrev) contraction, opacus per-sample gradients + Gram (without the position
  embedding, which it cannot take).
- ``mlp``: nngeometry 0.4's ``get_gram_matrix`` takes no Embedding and only (n, d) inputs to
  Linear and LayerNorm, so it cannot run on a token sequence; it runs beside exact and structured
  on an MLP (128 -> 1024 -> 1024 -> 1) of the same sentences' mean embeddings.
- ``long``: the same model at T = 256, n = 64: the cost model's choice against every pair
  forced to ghost or to materialised: where the ghost form stops paying.
- ``hf``: the ``small`` shape as transformers' ``GPT2LMHeadModel`` (no dropout), n = 128 and 256:
  a training step, exact, structured and the per-sample loop (P1 on an HF model).
- ``gpt2``: the GPT-2-small shape (HF ``GPT2LMHeadModel``, 124M parameters, tied head), T = 64,
  n = 64 and 256: a training step and the structured method (the others need J: 32-127 GB).
- ``lanczos``: on the exact kernel of ``small`` at n = 256 (and a planted spectrum with
  lambda_1 / lambda_2 = 2): matvecs and errors of ntkscope's single Krylov run, ARPACK for
  lambda_1 then a deflated lambda_2 (the previous method), ARPACK for both, and LOBPCG
  (a block method) for both.

Targets: P7 exact NTK of the 124M model at n = 256, T = 64 in <= 3 training steps with
<= 2 GB above the model; P1 structured <= 1.5 steps plus the Gram on the small model and its HF twin;
P2 <= 8 matvecs at lambda_1 / lambda_2 >= 2.

Run: python benchmarks/structured.py [--cases small,hf,long,gpt2,lanczos] [--out benchmarks/structured.csv]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time

import numpy as np
import pandas as pd
import scipy.sparse.linalg as sla
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
import ntkscope as ns  # noqa: E402
import ntkscope.kernel.factors as st  # noqa: E402
from cse_models import GPT, GPTConfig  # noqa: E402
from ntk_methods import (PeakRSS, gram_seconds, jacrev_tutorial, loop_and_gram, loss_fn, matmul_rate,  # noqa: E402
                         tokenizer_and_batches, train_step_seconds)
from ntkscope.core.memory import training_thresholds  # noqa: E402
from ntkscope.kernel.eigen import krylov_top_two  # noqa: E402
from ntkscope.kernel.eigen import top_eigenpair

ROWS = []


def _trim():
    """Give freed heap back to the system, so that the next peak is measured from a true baseline."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measure(fn):
    _trim()
    with PeakRSS() as mem:
        t = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t
    return out, seconds, mem.bytes


def record(case, model, n, T, method, seconds, peak, step, note=""):
    ROWS.append(dict(case=case, model=model, n=n, T=T, method=method, seconds=seconds, peak_MiB=peak / 2**20,
                     x_train_step=seconds / step if step else float("nan"), train_step_s=step, note=note))
    print(f"{case:8s} {model:10s} n={n:4d} T={T:3d} {method:26s} {seconds:9.2f} s {peak / 2**20:9.0f} MiB "
          f"{seconds / step if step else float('nan'):7.2f} steps  {note}", flush=True)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


class Logits(nn.Module):
    """An HF causal LM as ``model(**batch) -> logits`` (for the training step and the anchors)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).logits


def opacus_gram(model, batch):
    """opacus: per-sample gradients by its hooks (GradSampleModule), then J J^T."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    gsm.zero_grad(set_to_none=True)
    model.train()  # opacus captures activations in training mode only (dropout is 0 here)
    loss_fn(gsm(**batch), batch).sum().backward()
    model.eval()
    rows = [p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in model.parameters()
            if p.requires_grad and getattr(p, "grad_sample", None) is not None]
    J = torch.cat(rows, 1)
    K = J @ J.T
    gsm._close()
    return K


def nngeometry_gram(model, X):
    """nngeometry 0.4 ``get_gram_matrix`` of a scalar-output model over its Linear layers: (n, n)."""
    from nngeometry.backend import TorchHooksJacobianBackend
    from nngeometry.layercollection import LayerCollection

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=64)
    backend = TorchHooksJacobianBackend(model=model, function=lambda x: model(x),
                                        layer_collection=LayerCollection.from_model(model))
    G = backend.get_gram_matrix(loader)
    return G[0, :, 0, :]


def p1_rows(case, label, model, batch, step):
    """The P1 rows of one model and batch (T = 64): the training step, exact (with the time of the
    Gram of its J alone) and structured against the target of 1.5 steps plus that Gram; returns
    the exact result."""
    n = batch["input_ids"].shape[0]
    record(case, label, n, 64, "train step", step, 0, step)
    exact, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="exact"))
    t_gram = gram_seconds(n, sum(p.numel() for p in model.parameters()))
    record(case, label, n, 64, "exact", t, m, step, f"gram alone {t_gram:.2f} s")
    res, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="structured"))
    target = 1.5 * step + t_gram
    record(case, label, n, 64, "structured", t, m, step, f"rel diff {rel(res.matrix, exact.matrix):.1e}; "
           f"P1 target {target:.2f} s: {'met' if t <= target else 'MISSED'}")
    return exact


def small(n_list, batches):
    vocab, all_batch = batches[64]
    for n in n_list:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=128)).float()
        batch = {k: v[:n] for k, v in all_batch.items()}
        step = train_step_seconds(GPT(model.config).float(), batch)
        model.eval()
        P = sum(p.numel() for p in model.parameters())
        label = "2L d128"
        ref = p1_rows("small", label, model, batch, step).matrix
        res, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="exact", max_memory=n * P * 4 // 3))
        record("small", label, n, 64, "exact in panels (J/3)", t, m, step,
               f"{res.gradient_passes} passes; rel diff {rel(res.matrix, ref):.1e}")
        res, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="structured", max_memory=n * P * 4 // 3))
        record("small", label, n, 64, "structured, same memory", t, m, step,
               f"{res.gradient_passes} passes; rel diff {rel(res.matrix, ref):.1e}")
        dense = top_eigenpair(ref)
        mf, t, m = measure(lambda: ns.ntk_top_eigenpair(model, batch, method="matrix-free"))
        record("small", label, n, 64, "matrix-free (eigenpair)", t, m, step,
               f"{mf.matvecs} matvecs at lambda1/lambda2 {1 / dense.eigengap:.2f}; "
               f"|cos| {abs(float(mf.eigenvector @ dense.eigenvector)):.8f}")
        K, t, m = measure(lambda: loop_and_gram(model, batch))
        record("small", label, n, 64, "anchor: loop+gram", t, m, step, f"rel diff {rel(K, ref):.1e}")
        if n <= 128:
            K, t, m = measure(lambda: jacrev_tutorial(model, batch))
            record("small", label, n, 64, "anchor: jacrev tutorial", t, m, step, f"rel diff {rel(K, ref):.1e}")
        try:
            import opacus  # noqa: F401
        except ImportError:
            record("small", label, n, 64, "anchor: opacus", float("nan"), 0, step, "not installed")
        else:
            model.transformer.wpe.weight.requires_grad_(False)  # opacus: an Embedding input needs a batch dim
            K, t, m = measure(lambda: opacus_gram(model, batch))
            model.transformer.wpe.weight.requires_grad_(True)
            ref_no_wpe = ns.empirical_ntk(model, batch, method="structured",
                                          params=[k for k, _ in model.named_parameters() if "wpe" not in k]).matrix
            record("small", label, n, 64, "anchor: opacus + gram", t, m, step,
                   f"without wpe (a position embedding without a batch dim fails in opacus); "
                   f"rel diff {rel(K.to(ref.dtype), ref_no_wpe):.1e}")
            del K
        mlp_case(n, model, batch, step)


def mlp_case(n, model, batch, step):
    """nngeometry 0.4 takes (n, d) inputs to Linear / LayerNorm and no Embedding, so it cannot run on a
    token sequence; here it runs where it can: an MLP on the sentences' mean embeddings."""
    try:
        import nngeometry  # noqa: F401
    except ImportError:
        record("mlp", "MLP", n, 1, "anchor: nngeometry gram", float("nan"), 0, step, "not installed")
        return
    with torch.no_grad():
        emb = model.transformer.wte(batch["input_ids"])
        X = (emb * batch["attention_mask"][..., None]).sum(1) / batch["attention_mask"].sum(1, keepdim=True)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(128, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1))
    ref, t, m = measure(lambda: ns.empirical_ntk(mlp, X, output="logits", method="exact"))
    record("mlp", "MLP 1.2M", n, 1, "exact", t, m, step, "the LM's training step as the unit")
    res, t, m = measure(lambda: ns.empirical_ntk(mlp, X, output=lambda m_, x: m_(x)[:, 0], method="structured"))
    record("mlp", "MLP 1.2M", n, 1, "structured", t, m, step, f"rel diff {rel(res.matrix, ref.matrix):.1e}")
    K, t, m = measure(lambda: nngeometry_gram(mlp, X))
    record("mlp", "MLP 1.2M", n, 1, "anchor: nngeometry gram", t, m, step,
           f"rel diff {rel(K.to(ref.matrix.dtype), ref.matrix):.1e}; cannot take the LM (Embedding; (n, T, d) "
           "inputs to Linear/LayerNorm)")


def long(batches):
    vocab, all_batch = batches[256]
    n, T = 64, 256
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=4, n_embd=128)).float()
    batch = {k: v[:n] for k, v in all_batch.items()}
    step = train_step_seconds(GPT(model.config).float(), batch)
    model.eval()
    label = "2L d128"
    record("long", label, n, T, "train step", step, 0, step)
    exact, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="exact"))
    record("long", label, n, T, "exact", t, m, step)
    for form in ("auto", "ghost", "materialised"):
        original = st.pair_choice
        if form != "auto":
            def forced(fa, fb, ca, cb, work, form=form):
                if form == "materialised" or st.ghost_cost(fa, fb) is None:
                    return "materialised", original(fa, fb, ca, cb, work)[1]
                return "ghost", 0.0
            st.pair_choice = forced
        try:
            res, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="structured"))
        finally:
            st.pair_choice = original
        record("long", label, n, T, f"structured ({form})", t, m, step, f"rel diff {rel(res.matrix, exact.matrix):.1e}")


def gpt2(n_list, batches):
    import transformers

    vocab, all_batch = batches[64]
    for n in n_list:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).float()
        P = sum(p.numel() for p in model.parameters())
        batch = {k: v[:n] for k, v in all_batch.items()}
        step = train_step_seconds(Logits(model), batch, repeats=1) if n <= 64 else one_step(Logits(model), batch)
        model.eval()
        label = "GPT-2 124M"
        record("gpt2", label, n, 64, "train step", step, 0, step, f"P={P}; model {P * 4 / 2**30:.2f} GiB")
        res, t, m = measure(lambda: ns.empirical_ntk(model, batch, method="structured", max_memory=2 * 2**30))
        verdict = "met" if t <= 3 * step and m <= 2 * 2**30 else "MISSED"
        record("gpt2", label, n, 64, "structured (2 GiB budget)", t, m, step,
               f"{res.gradient_passes} passes; P7 (<= 3 steps, <= 2 GiB): {verdict}; {res.reason[:120]}")


def hf_small(n_list, batches):
    """P1 on a transformers model: the small shape as HF's ``GPT2LMHeadModel`` (2 layers x 128, tied
    8192-token head, no dropout), a training step, exact, structured and the per-sample loop."""
    import transformers

    vocab, all_batch = batches[64]
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_layer=2, n_head=4, n_embd=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    for n in n_list:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).float()
        batch = {k: v[:n] for k, v in all_batch.items()}
        step = train_step_seconds(Logits(transformers.GPT2LMHeadModel(config).float()), batch)
        model.eval()
        label = "HF 2L d128"
        exact = p1_rows("hf", label, model, batch, step)
        K, t, m = measure(lambda: loop_and_gram(Logits(model), batch))
        record("hf", label, n, 64, "anchor: loop+gram", t, m, step, f"rel diff {rel(K, exact.matrix):.1e}")


def one_step(model, batch):
    """One training step, timed once (at 124M parameters and n = 256 a warm-up step would take minutes)."""
    training_thresholds(force=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = time.perf_counter()
    loss_fn(model(**batch), batch).mean().backward()
    opt.step()
    return time.perf_counter() - t


def lanczos(batches):
    vocab, all_batch = batches[64]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=128)).float().eval()
    batch = {k: v[:256] for k, v in all_batch.items()}
    K_real = ns.empirical_ntk(model, batch, method="structured").matrix.double().numpy()
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((256, 256)))
    planted = (Q * np.concatenate([[2.0, 1.0], rng.uniform(0, 0.5, 254)])) @ Q.T
    for label, K in (("GPT 2L n=256", K_real), ("planted 2:1", planted)):
        w, V = np.linalg.eigh(K)
        lam1, lam2, u1 = w[-1], w[-2], V[:, -1]
        v0 = np.ones(len(K))
        gap = lam1 / lam2

        def errors(l1, l2, u):
            return f"lambda1 rel err {abs(l1 - lam1) / lam1:.1e}, lambda2 rel err {abs(l2 - lam2) / lam1:.1e}, " \
                   f"1-|cos| {1 - abs(float(u @ u1)):.1e}"

        count = [0]

        def op(v):
            count[0] += 1
            return K @ v

        A = sla.LinearOperator(K.shape, matvec=op, dtype=np.float64)
        count[0] = 0
        l1, l2, u, _ = krylov_top_two(op, len(K), v0, tol=1e-6, gap_tol=1e-2)
        record("lanczos", label, len(K), 0, "single Krylov (ntkscope)", count[0], 0, 0,
               f"matvecs (seconds column); lambda1/lambda2 {gap:.2f}; {errors(l1, l2, u)}")
        count[0] = 0
        vals, vecs = sla.eigsh(A, k=1, which="LA", ncv=4, tol=1e-6, v0=v0)
        u = vecs[:, 0]
        defl = sla.LinearOperator(K.shape, matvec=lambda v: op(v) - vals[0] * u * (u @ v), dtype=np.float64)
        start = v0 - u * (u @ v0)
        (l2,), _ = sla.eigsh(defl, k=1, which="LA", ncv=4, tol=1e-2, v0=start)
        record("lanczos", label, len(K), 0, "ARPACK k=1 + deflated", count[0], 0, 0, errors(vals[0], l2, u))
        count[0] = 0
        vals, vecs = sla.eigsh(A, k=2, which="LA", tol=1e-6, v0=v0)
        record("lanczos", label, len(K), 0, "ARPACK k=2 (thick restart)", count[0], 0, 0,
               errors(vals[-1], vals[-2], vecs[:, -1]))
        count[0] = 0
        X = np.stack([v0, rng.standard_normal(len(K))], 1)
        vals, vecs = sla.lobpcg(A, X, tol=1e-6 * lam1, maxiter=200, largest=True)
        order = np.argsort(vals)
        record("lanczos", label, len(K), 0, "LOBPCG block 2", count[0], 0, 0,
               f"{errors(vals[order[-1]], vals[order[-2]], vecs[:, order[-1]])} (each block iteration = 2 matvecs)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="small,hf,long,gpt2,lanczos")
    parser.add_argument("--n", default="128,256", help="sample counts of the small case")
    parser.add_argument("--gpt2-n", default="64,256", help="sample counts of the GPT-2-small case")
    parser.add_argument("--out", default=None, help="write the table as CSV")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cases = args.cases.split(",")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {ram / 2**30:.0f} GiB, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; float32 matmul "
          f"{matmul_rate() / 1e9:.0f} GFLOP/s", flush=True)
    batches = {64: tokenizer_and_batches(256, 64, 8192)}
    if "long" in cases:
        batches[256] = tokenizer_and_batches(64, 256, 8192)
    if "small" in cases:
        small([int(x) for x in args.n.split(",")], batches)
    if "hf" in cases:
        hf_small([int(x) for x in args.n.split(",")], batches)
    if "long" in cases:
        long(batches)
    if "lanczos" in cases:
        lanczos(batches)
    if "gpt2" in cases:
        gpt2([int(x) for x in args.gpt2_n.split(",")], batches)
    frame = pd.DataFrame(ROWS)
    if args.out:
        frame.to_csv(args.out, index=False)
    return frame


if __name__ == "__main__":
    main()
