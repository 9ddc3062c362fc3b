"""Memory budgets at GPT-2-small shape: the peak above the loaded model against ``max_memory``,
per method, in one process and in each of two ranks (issue 32), and P7.

The model is HF ``GPT2LMHeadModel`` at its default configuration (124.4M parameters, a
50 257-token tied head), seeded: memory and time depend on the shape, not the values. The
batch is real sentences (standard-library docstrings, byte-level BPE), T = 64, float32. Each
process first runs every method once on two sentences (the first call of a code path pages in
library code that stays: not data), then measures each row's peak resident memory above its
start (``ntkscope.core.memory.PeakMemory``: VmHWM reset at the start) and its wall time.

Rows: structured at 2 and 4 GiB (n = 64), exact at 4 GiB (n = 8: a row of J is 475 MiB and a
sample's per-sample gradient holds 1.2 GiB more), projected with k = 32 at 6 GiB (n = 8: on a
CPU its tiles of R, 124M x k, are drawn again for every chunk). With ``--ranks 2`` the same rows
(structured at n = 32) run under two gloo processes, each reporting its own peak.

``--p7`` runs P7 alone (most of an hour here): one AdamW training step of n = 256 sentences
(gradients accumulated over micro-batches of 64), then the structured method on them under
``max_memory`` = 2 GiB, its peak and its time in training steps, and the method table's
estimate beside it. The process fixes malloc's thresholds before the training step
(``ntkscope.hand_back_freed_memory``): without that, the step's freed blocks stay in the heap
and the kernel's peak creeps above its budget (2.91 GiB against 2 GiB in the first P7 run).

Run: python benchmarks/budget.py [--ranks 1,2] [--out benchmarks/budget.csv]
     python benchmarks/budget.py --p7 --out benchmarks/p7.csv
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import ntkscope as ns  # noqa: E402
from ntk_methods import tokenizer_and_batches  # noqa: E402
from ntkscope.core.memory import PeakMemory, hand_back_freed_memory  # noqa: E402

GiB = 2**30
#: (method, max_memory, n, projection_dim)
ROWS = [("structured", 2 * GiB, 64, None), ("structured", 4 * GiB, 64, None),
        ("exact", 4 * GiB, 8, None), ("projected", 6 * GiB, 8, 32)]


def _model():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config()).float().eval()


def _measure(model, batch, rows, label) -> list:
    two = {k: v[:2] for k, v in batch.items()}
    for method in ("structured", "exact", "projected"):
        ns.empirical_ntk(model, two, method=method, projection_dim=32)
    out = []
    for method, budget, n, k in rows:
        sub = {key: v[:n] for key, v in batch.items()}
        extra = {"projection_dim": k} if k else {}
        t = time.perf_counter()
        with PeakMemory() as mem:
            res = ns.empirical_ntk(model, sub, method=method, max_memory=budget, **extra)
        seconds = time.perf_counter() - t
        row = dict(setting=label, method=method, n=n, max_memory_GiB=budget / GiB, peak_GiB=mem.bytes / GiB,
                   within=mem.bytes <= budget, seconds=seconds, passes=res.gradient_passes, estimate_steps=None,
                   note=res.reason[-90:])
        print(row, flush=True)
        out.append(row)
    return out


def _worker(rank, size, port, batch, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        halved = [(m, b, n // 2 if m == "structured" else n, k) for m, b, n, k in ROWS]  # structured: n = 32
        rows = _measure(_model(), batch, halved, f"rank {rank} of {size}")
        every = [None] * size
        dist.all_gather_object(every, rows)
        if rank == 0:
            torch.save(every, path)
    finally:
        dist.destroy_process_group()


def p7_estimate(model, batch) -> dict:
    """The method table's estimate for P7 (n = 256 under 2 GiB): training steps, passes, and how
    they split between the samples' forward and backward passes and the pair products."""
    from ntkscope.kernel.grads import functional_model, step_cost
    from ntkscope.kernel.kernels import kernel_bytes, sample_passes
    from ntkscope.kernel.methods import choose, workload
    from ntkscope.kernel.options import KernelOptions
    from ntkscope.kernel.structured import probe
    from ntkscope.kernel.structured_layout import layout, layout_cost, work_elements

    opts = KernelOptions.build(None, method="auto", max_memory=2 * GiB)
    with functional_model(model, opts) as fm:
        w = workload(fm, batch, None, opts=opts)
        others = choose("kernel", w).reason
        choice = choose("kernel", w, method="structured")
        pr = probe(fm, w.data1, w.n1)
        panel, stream, chunk = layout(pr, w.n1, w.n1, w.budget, None, True, kernel_bytes(fm, w.n1, w.n1))
        step = step_cost(fm, w.data1, w.n1)
        loads = sample_passes(w.n1, w.n1, panel, True)
        total = layout_cost(pr, w.n1, w.n1, panel, stream, True, work_elements(w.budget, fm.itemsize))
        everything = layout_cost(pr, w.n1, w.n1, w.n1, w.n1, True, work_elements(w.budget, fm.itemsize))
        head = _head_recompute(pr, w.n1, w.budget, kernel_bytes(fm, w.n1, w.n1), loads, step)
    products = total - loads * pr.sample_cost
    return dict(setting="P7 estimate", method="structured", n=w.n1, max_memory_GiB=2.0, peak_GiB=None,
                within=None, seconds=None, passes=-(-w.n1 // panel), estimate_steps=choice.steps,
                note=f"panel {panel}, stream {stream}, chunk {chunk}: {loads:.0f} sample loads = "
                     f"{loads * pr.sample_cost / step:.1f} steps, pair products {products / step:.1f} steps; "
                     f"with every factor held at once {everything / step:.1f} steps; factors "
                     f"{pr.sample_bytes / 2**20:.1f} MiB a sample, transient {pr.transient.per_sample / 2**20:.0f} "
                     f"MiB a sample; {head}; {others}")


def _head_recompute(pr, n, budget, kernels, loads, step) -> str:
    """What recomputing the head's cotangents from its input would do (not built): the panel and
    loads without them in the held factors, against recomputing a panel sample's cotangents
    (T d V multiply-adds) for every stream that passes it."""
    import dataclasses

    from ntkscope.kernel.factors import Linear
    from ntkscope.kernel.kernels import sample_passes
    from ntkscope.kernel.structured_layout import layout

    f = max((f for parts in pr.uses.values() for f in parts if isinstance(f, Linear)), key=lambda f: f.delta.shape[-1])
    T, d, V = f.delta.shape[1], f.a.shape[-1], f.delta.shape[-1]
    lighter = dataclasses.replace(pr, sample_bytes=pr.sample_bytes - f.delta[0].numel() * f.delta.element_size())
    panel, stream, _ = layout(lighter, n, n, budget, None, True, kernels)
    saved = (loads - sample_passes(n, n, panel, True)) * pr.sample_cost
    visits = sum(min(panel, n - a0) * -(-max(0, n - a0 - panel) // stream) for a0 in range(0, n, panel))
    return (f"recomputing the head's {T} x {V} cotangents (not built): factors {lighter.sample_bytes / 2**20:.1f} MiB "
            f"a sample, panel {panel}, stream {stream}, saves {saved / step:.1f} steps of loads and costs "
            f"{visits * T * d * V / step:.1f} steps of recomputation")


def train_step(model, batch, micro: int = 64) -> tuple[float, int]:
    """(seconds, peak bytes) of one AdamW training step on ``batch``, gradients accumulated over
    micro-batches of ``micro`` samples (the whole batch's logits, n x T x 50 257, would be 3.3 GB at
    n = 256); timed after one warm-up micro-batch."""
    from ntkscope.core.lm import causal_pairs, lm_loss

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss(part):
        logits, targets, keep = causal_pairs(model(**part).logits, part["input_ids"], part["attention_mask"].bool())
        return lm_loss(logits, targets, keep, reduction="sequence").sum() / len(batch["input_ids"])

    loss({k: v[:micro] for k, v in batch.items()}).backward()
    opt.zero_grad()
    t = time.perf_counter()
    with PeakMemory() as mem:
        for i in range(0, len(batch["input_ids"]), micro):
            loss({k: v[i:i + micro] for k, v in batch.items()}).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t
    model.eval()
    return seconds, mem.bytes


def p7(model, batch) -> list:
    """P7 run: the exact NTK of n = 256 (T = 64) under max_memory = 2 GiB, in training steps."""
    step, step_peak = train_step(model, batch)
    rows = [dict(setting="P7 training step", method="AdamW step", n=len(batch["input_ids"]), max_memory_GiB=None,
                 peak_GiB=step_peak / GiB, within=None, seconds=step, passes=None, estimate_steps=None,
                 note="4 micro-batches of 64")]
    estimate = p7_estimate(model, batch)
    print(estimate, flush=True)
    t = time.perf_counter()
    with PeakMemory() as mem:
        res = ns.empirical_ntk(model, batch, method="structured", max_memory=2 * GiB)
    seconds = time.perf_counter() - t
    rows.append(dict(setting="P7 run", method="structured", n=len(batch["input_ids"]), max_memory_GiB=2.0,
                     peak_GiB=mem.bytes / GiB, within=mem.bytes <= 2 * GiB, seconds=seconds,
                     passes=res.gradient_passes, estimate_steps=seconds / step,
                     note=f"measured steps (estimate column): seconds / training step; {estimate['note']}"))
    rows.append(estimate)
    print(rows[-2], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--p7", action="store_true", help="run P7 (n = 256 under 2 GiB, most of an hour here) alone")
    parser.add_argument("--p7-estimate", action="store_true",
                        help="only the method table's estimate of P7, replacing that row of --out")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    hand_back_freed_memory()  # before the training step: what it frees must not stay in the heap
    _, batch = tokenizer_and_batches(256, 64, 8192)
    rows = []
    if args.p7_estimate:
        rows = pd.read_csv(args.out).to_dict("records") if args.out and os.path.exists(args.out) else []
        rows = [r for r in rows if r["setting"] != "P7 estimate"] + [p7_estimate(_model(), batch)]
    elif args.p7:
        rows += p7(_model(), batch)
    elif "1" in args.ranks.split(","):
        model = _model()
        rows += _measure(model, batch, ROWS, "one process")
        del model
    if "2" in args.ranks.split(",") and not (args.p7 or args.p7_estimate):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = os.path.join(os.path.dirname(args.out or "."), ".budget-ranks.pt")
        mp.spawn(_worker, args=(2, port, batch, path), nprocs=2, join=True)
        for per_rank in torch.load(path):
            rows += per_rank
        os.remove(path)
    frame = pd.DataFrame(rows)
    if args.out:
        tmp = args.out + ".tmp"
        frame.to_csv(tmp, index=False)
        os.replace(tmp, args.out)
    print(frame.to_string())
    return frame


if __name__ == "__main__":
    main()
