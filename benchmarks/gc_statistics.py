"""What GC's uncertainty costs, against the gradients it is computed from.

Side by side in one process, on the quick reproduction's model shape (a GPT of 4 layers x 128,
BPE 8192; the final dense checkpoint of a run when ``--checkpoint`` is given, else at
initialisation) and real analysis sentences of the shipped pack, 6 equal-count bins,
output ``centred-true-logit``:

- ``kernel``        the exact NTK of the n sentences (per-sample gradients + Gram): what every
                    GC needs anyway
- ``statistics``    :func:`ntkscope.kernel_gc` on that kernel: the default jackknife (at most 200
                    deletions, 40 half-samples) and 200 null draws per bin size, conditioning and
                    flags; "+ controls" adds the homogeneous (gradient neighbours) and matched
                    nulls; the bootstrap's basic (200 resamples) and BCa (n more
                    eigendecompositions) for comparison
- ``statistics (jackknife, batched torch)``  the same default statistics with the jackknife's
                    replicates and the null draws solved as batched torch on ``--device``
                    (:mod:`ntkscope.kernel.device_statistics`; the path a GPU kernel takes), with
                    the largest difference from the host path's numbers (``difference``: the
                    |GC| se, bias, interval, sign confidence and null band of every bin)
- ``naive resample`` anchor: what a user without the kernel identity would do for one
                    bootstrap resample, the exact NTK of a resampled batch; x200 for an interval

Target (issue 13): the statistics are a small fraction of the gradient time.

Run: python benchmarks/gc_statistics.py [--checkpoint CKPT] [--n 192 512] [--device cpu] [--out benchmarks/gc_statistics.csv]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import pandas as pd
import torch

import ntkscope as ns
from cse_models import GPT, GPTConfig
from ntkscope.kernel.objectives import take
from ntkscope.kernel.uncertainty import kernel_statistics
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.frequency import bin_edges, bin_of

OUTPUT = "centred-true-logit"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a cse_models checkpoint (default: the quick shape at initialisation)")
    parser.add_argument("--n", type=int, nargs="+", default=[192, 512])
    parser.add_argument("--device", default="cpu", help="where the batched-torch arm solves its replicates")
    parser.add_argument("--out", default="benchmarks/gc_statistics.csv")
    args = parser.parse_args()
    pack = load_pack()
    tok = pack.tokenizer()
    if args.checkpoint:
        model = ns.load_checkpoint(args.checkpoint)
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=4, n_head=4, n_embd=128)).eval()
    rows = []
    for n in args.n:
        data = ns.load_analysis_data(str(pack.path), tok, n=n, seq_len=48, seed=0)
        scores = data.labels["score"].to_numpy()
        which = bin_of(scores, bin_edges(scores, 6, kind="count"))
        groups = [np.flatnonzero(which == b) for b in range(6)]
        ntk, t_kernel = timed(lambda: ns.empirical_ntk(model, data.batch, output=OUTPUT, method="exact"))
        K = ntk.matrix.double().numpy()
        host, t_jack = timed(lambda: ns.kernel_gc(K, groups))
        members = [np.sort(g) for g in groups]
        batched, t_torch = timed(lambda: kernel_statistics(K, members, ns.Resampling(), device=args.device))
        gap = np.nanmax(np.abs(np.concatenate([np.subtract(getattr(h, name), b[name], dtype=float).ravel()
                                               for h, b in zip(host, batched)
                                               for name in ("abs_se", "abs_bias", "sign_confidence",
                                                            "abs_interval", "null")])))
        lengths = data.batch["attention_mask"].sum(1).double().numpy()
        _, t_controls = timed(lambda: ns.kernel_gc(K, groups, controls=ns.Controls(matched={"length": lengths})))
        _, t_basic = timed(lambda: ns.kernel_gc(K, groups, resampling=ns.Resampling(interval="basic")))
        _, t_bca = timed(lambda: ns.kernel_gc(K, groups, resampling=ns.Resampling(interval="bca")))
        resample = torch.as_tensor(np.random.default_rng(0).integers(0, n, n))
        _, t_naive = timed(lambda: ns.empirical_ntk(model, take(data.batch, resample),
                                                     output=OUTPUT, method="exact"))
        for method, seconds, note in (
                ("kernel", t_kernel, f"P={sum(p.numel() for p in model.parameters()):,}"),
                ("statistics (jackknife, default)", t_jack, f"{t_jack / t_kernel:.1%} of the kernel"),
                (f"statistics (jackknife, batched torch, {args.device})", t_torch,
                 f"{t_torch / t_jack:.2f}x the host path; largest difference {gap:.1e}"),
                ("statistics + controls", t_controls, f"{t_controls / t_kernel:.1%} of the kernel"),
                ("statistics (basic)", t_basic, f"{t_basic / t_kernel:.1%} of the kernel"),
                ("statistics (bca)", t_bca, f"{t_bca / t_kernel:.1%} of the kernel"),
                ("naive resample", t_naive, f"one resample; x200 = {200 * t_naive:.0f} s, "
                                            f"{200 * t_naive / t_jack:.0f}x the default statistics")):
            rows.append({"n": n, "method": method, "seconds": round(seconds, 3), "note": note,
                         "difference": gap if "batched" in method else None})
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out, index=False)
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(table.to_markdown(index=False))


if __name__ == "__main__":
    main()
