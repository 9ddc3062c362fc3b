"""Memory budgets at GPT-2-small shape: the peak above the loaded model against ``max_memory``,
per method, in one process and in each of two ranks (issue 32), and P7's estimate.

The model is HF ``GPT2LMHeadModel`` at its default configuration (124.4M parameters, a
50 257-token tied head), seeded: memory and time depend on the shape, not the values. The
batch is real sentences (standard-library docstrings, byte-level BPE), T = 64, float32. Each
process first runs every method once on two sentences (the first call of a code path pages in
library code that stays: not data), then measures each row's peak resident memory above its
start (``ntkscope.core.memory.PeakMemory``: VmHWM reset at the start) and its wall time.

Rows: structured at 2 and 4 GiB (n = 64), exact at 4 GiB (n = 8: a row of J is 475 MiB and a
sample's per-sample gradient holds 1.2 GiB more), projected with k = 32 at 6 GiB (n = 8: on a
CPU its tiles of R, 124M x k, are drawn again for every chunk). With ``--ranks 2`` the same rows
(structured at n = 32) run under two gloo processes, each reporting its own peak. The P7
row is the method table's estimate at n = 256 under 2 GiB (steps, passes), not a run: at the
measured speed it would take most of an hour on this machine.

Run: python benchmarks/budget.py [--ranks 1,2] [--out benchmarks/budget.csv]
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
from ntkscope.core.memory import PeakMemory  # noqa: E402

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
    """The method table's estimate for P7 (n = 256 under 2 GiB): training steps and passes."""
    from ntkscope.kernel.grads import functional_model
    from ntkscope.kernel.kernels import kernel_bytes
    from ntkscope.kernel.methods import choose, workload
    from ntkscope.kernel.options import KernelOptions
    from ntkscope.kernel.structured import layout, probe

    opts = KernelOptions.build(None, method="structured", max_memory=2 * GiB)
    with functional_model(model, opts) as fm:
        w = workload(fm, batch, None, opts=opts)
        choice = choose("kernel", w)
        pr = probe(fm, w.data1, w.n1)
        panel, stream, chunk = layout(pr, w.n1, w.n1, w.budget, None, True, kernel_bytes(fm, w.n1, w.n1))
    panels = -(-w.n1 // panel)
    return dict(setting="P7 estimate", method="structured", n=w.n1, max_memory_GiB=2.0, peak_GiB=None,
                within=None, seconds=None, passes=panels, estimate_steps=choice.steps,
                note=f"factors {pr.sample_bytes / 2**20:.1f} MiB a sample, transient "
                     f"{pr.transient.per_sample / 2**20:.0f} MiB a sample; panel {panel}, stream {stream}, "
                     f"chunk {chunk}")


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
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    _, batch = tokenizer_and_batches(256, 64, 8192)
    rows = []
    if args.p7:
        rows += p7(_model(), batch)
    elif "1" in args.ranks.split(","):
        model = _model()
        rows += _measure(model, batch, ROWS, "one process")
        rows.append(p7_estimate(model, batch))
        del model
    if "2" in args.ranks.split(",") and not args.p7:
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
