"""The sketched in-run GC against the exact one on the same steps (issue 61): the quick model (the
reproduction's GPT, 4 layers d=128, 48 tokens, batch 32) trained by ``cse_models.train`` on the
shipped pack for ``--steps`` steps with an exact :class:`ntkscope.InRunTracker` and sketched ones
(widths ``--widths``) measuring together every ``--every`` steps: each row is one domain of one
measured step's batch, its GC against the batch from the exact kernel and from each sketch.

Writes ``--out`` (default benchmarks/inrun_sketch.csv: step, label, n_subset, the exact GC, its
eigengap, cos(u, 1) and the subset's, the conditioning flags the exact values raise at the
default thresholds (:class:`ntkscope.Resampling`: an eigengap over 0.5, or |cos(u, 1)| under 0.3:
the direction or its sign is not defined by the data), and per width ``gc_sketch_K``) and
``--summary`` (default benchmarks/inrun_sketch_summary.csv: per width, on every row and on the
rows no flag marks, Pearson's correlation with the exact GC, signed and of |GC|, Spearman's, the
largest and the median absolute difference, the share of rows whose sign agrees, and how many
rows differ by more than 0.1 and how many of those the exact values flag).

Run: python benchmarks/inrun_sketch.py [--steps 300] [--every 2] [--widths 8,16,32,64]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cse_models.train import TrainConfig, train
from ntkscope.core.files import write_table
from ntkscope.gc.inrun import InRunTracker
from ntkscope.kernel.uncertainty import Resampling, conditioning_flags

def summarise(frame: pd.DataFrame, widths: list) -> pd.DataFrame:
    """Per width and row set (every row; the rows whose exact direction no conditioning flag
    marks), the agreement of the sketched GC with the exact one, signed and as |GC|."""
    rows = []
    for k in widths:
        for subset, part in (("all", frame), ("not flagged", frame[frame["flags"] == ""])):
            exact, sketch = part["gc_exact"], part[f"gc_sketch_{k}"]
            diff = (sketch - exact).abs()
            rows.append({"width": k, "rows": subset, "n": len(part), "pearson": exact.corr(sketch),
                         "pearson_abs": exact.abs().corr(sketch.abs()),
                         "spearman": exact.corr(sketch, method="spearman"), "max_abs_diff": diff.max(),
                         "median_abs_diff": diff.median(),
                         "max_abs_diff_of_abs": (sketch.abs() - exact.abs()).abs().max(),
                         "same_sign": float((np.sign(exact) == np.sign(sketch)).mean()),
                         "over_0.1": int((diff > 0.1).sum()), "over_0.1_flagged": int(((diff > 0.1)
                                                                                     & (part["flags"] != "")).sum())})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--widths", default="8,16,32,64")
    parser.add_argument("--out", default="benchmarks/inrun_sketch.csv")
    parser.add_argument("--summary", default="benchmarks/inrun_sketch_summary.csv")
    args = parser.parse_args()
    widths = [int(k) for k in args.widths.split(",")]
    torch.set_num_threads(2)
    spec = {"model": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "data": {"seq_len": 48}, "batch_size": 32,
            "steps": args.steps, "checkpoint_every": args.steps, "log_every": 50, "tensorboard": False}
    exact = InRunTracker(every=args.every)
    sketches = {k: InRunTracker(every=args.every, estimator="sketch", width=k) for k in widths}
    with tempfile.TemporaryDirectory() as tmp:
        train(TrainConfig.from_dict({**spec, "out_dir": str(Path(tmp) / "run")}),
              callbacks=[exact, *sketches.values()])
    frame = exact.frame[["step", "label", "n_subset", "gc", "eigengap", "eigengap_subset", "cos_ones",
                         "cos_ones_subset"]].rename(columns={"gc": "gc_exact"})
    frame["flags"] = [" ".join(conditioning_flags(*r, Resampling())) for r in
                      frame[["eigengap", "cos_ones", "eigengap_subset", "cos_ones_subset"]].itertuples(index=False)]
    for k, tracker in sketches.items():
        frame = frame.merge(tracker.frame[["step", "label", "gc"]].rename(columns={"gc": f"gc_sketch_{k}"}),
                            on=["step", "label"], how="left")
    frame["flags"] = frame["flags"].fillna("")
    write_table(frame, args.out)
    summary = summarise(frame, widths)
    write_table(summary, args.summary)
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(summary.to_string(index=False))


if __name__ == "__main__":
    main()
