"""GC of the long tail on a GPT-2-small-shaped model on one CUDA device: time and peak memory per
method (issue 32's GPU path; the goal: n = 1024, T = 64 within 2 minutes and 16 GB on one H100).

    python benchmarks/gpu_gc.py --out DIR                     # 124M GPT-2 shape, n 1024, T 64, every method
    python benchmarks/gpu_gc.py --device cpu --n 32 --layers 1 --width 64 --out DIR   # a smoke run

The model is GPT-2 small's shape (12 x 768, 50 257-token head, transformers' GPT2LMHeadModel,
seeded random weights: time and memory depend on the shape, not the values); the sentences are
the shipped pack's validation sentences, tokenized by its BPE (ids below 8192), and the subset is
the lowest third by frequency score. Per method: wall seconds (after a CUDA synchronise), the peak
of ``torch.cuda.max_memory_allocated`` above the model, GC and its interval. Writes
``DIR/gpu_gc.csv`` row by row (a method that fails records its error) and ``DIR/machine.json``.

With ``--statistics``, two more rows on one structured kernel of the same sentences: the
statistics alone (jackknife interval, random null band) on the host in NumPy, and as batched
torch on the kernel's device (:mod:`ntkscope.kernel.device_statistics`, what ``device="cuda"``
runs), side by side, with the largest difference between their numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import transformers

import ntkscope as ns
from ntkscope.kernel.uncertainty import kernel_statistics
from ntkscope.text.frequency import long_tail_subset
from ntkscope.text.sentences import load_analysis_data
from ntkscope.text.corpus.pack import load_pack

log = logging.getLogger("gpu_gc")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--methods", default="structured,projected,matrix-free")
    parser.add_argument("--max-memory-gb", type=float, default=16.0, help="budget passed as max_memory")
    parser.add_argument("--statistics", action="store_true", help="time the statistics on the host and the device")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers, n_embd=args.width,
                                                                 n_head=max(1, args.width // 64))).eval()
    tok = load_pack().tokenizer()
    data = load_analysis_data("default", tok, n=args.n, seq_len=args.seq_len)
    tail = long_tail_subset(data.labels["score"], 1 / 3)
    machine = {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__,
               "parameters": sum(p.numel() for p in model.parameters()), "n": args.n, "seq_len": args.seq_len,
               "n_tail": len(tail), "max_memory_gb": args.max_memory_gb}
    (out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    log.info("%s", machine)
    rows = []
    for method in args.methods.split(","):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        row = {"method": method}
        try:
            gc = ns.gradient_consistency(model, data.batch, tail, method=method, device=args.device,
                                         max_memory=int(args.max_memory_gb * 2 ** 30))
            if cuda:
                torch.cuda.synchronize()
            interval = gc.abs_interval
            row.update(seconds=time.perf_counter() - start, gc=gc.score, abs_low=interval.low, abs_high=interval.high,
                       null_low=gc.null.low if gc.null is not None else None,
                       null_high=gc.null.high if gc.null is not None else None, flags=" ".join(gc.flags),
                       method_used=gc.method)
        except Exception as err:  # noqa: BLE001 -- a benchmark records the failure and goes on
            row.update(seconds=time.perf_counter() - start, error=f"{type(err).__name__}: {str(err)[:200]}")
        if cuda:
            row["peak_gb_above_model"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        rows.append(row)
        log.info("%s", row)
        pd.DataFrame(rows).to_csv(out / "gpu_gc.csv", index=False)
    if args.statistics:
        rows += statistics_rows(model, data.batch, tail, args)
        pd.DataFrame(rows).to_csv(out / "gpu_gc.csv", index=False)
    return 0


def statistics_rows(model, batch, tail, args) -> list:
    """The statistics of one structured kernel on the host and on ``args.device``: two rows."""
    start = time.perf_counter()
    ntk = ns.empirical_ntk(model, batch, method="structured", device=args.device,
                           max_memory=int(args.max_memory_gb * 2 ** 30))
    kernel_s = time.perf_counter() - start
    K = ntk.matrix.detach().double().cpu().numpy()
    members = [np.sort(np.asarray(tail))]
    rows, found = [], {}
    for where, device in (("host", None), ("device", ntk.matrix.device)):
        start = time.perf_counter()
        [fields] = kernel_statistics(K, members, ns.Resampling(), device=device)
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()
        found[where] = fields
        rows.append({"method": f"statistics on the {where}", "seconds": time.perf_counter() - start,
                     "kernel_s": kernel_s, "gc": fields["score"], "abs_low": fields["abs_interval"].low,
                     "abs_high": fields["abs_interval"].high, "null_low": fields["null"].low,
                     "null_high": fields["null"].high, "flags": " ".join(fields["flags"])})
        log.info("%s", rows[-1])
    gap = max(float(np.nanmax(np.abs(np.subtract(found["host"][name], found["device"][name], dtype=float))))
              for name in ("abs_interval", "null", "abs_se"))
    rows[-1]["note"] = f"largest difference from the host: {gap:.1e}"
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
