"""Does a GC interval cover what more data would give? A calibration on a real checkpoint.

    python scripts/gc_calibration.py CHECKPOINT [--pool 768] [--n 192] [--draws 40]
        [--outputs centred-true-logit,true-logit,loss] [--out calibration.csv]

A pool of ``--pool`` analysis sentences (the shipped pack's validation split, seed 7) is
scored once: its exact NTK, per output. Its per-bin |GC| (6 equal-count bins) is the value to
cover. Each of ``--draws`` random ``--n``-sentence subsets of the pool stands for a fresh
analysis batch: its bins, its |GC| and its interval (basic and BCa) are computed from its own
kernel (a sub-matrix of the pool's) by :func:`ntkscope.kernel_gc`, as ``ntkscope gc`` would.
Coverage is the share of (draw, bin) pairs whose |GC| interval holds the pool's value; the
spread of |GC| over draws is the sampling noise the intervals should describe. The pool's
own value is itself an estimate, closer to the large-sample value (GC rises with the subset
size), so coverage here is of a 4x larger analysis, not of an infinite one.

Measured results and what they mean: docs/gc-outputs.md.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import pandas as pd

import ntkscope as ns
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.frequency import bin_edges, bin_of

log = logging.getLogger("gc_calibration")


def _bins(scores: np.ndarray, bins: int) -> list:
    which = bin_of(scores, bin_edges(scores, bins, kind="count"))
    return [np.flatnonzero(which == b) for b in range(bins)]


def calibrate(checkpoint, *, outputs, pool: int, n: int, draws: int, bins: int = 6, seed: int = 0) -> pd.DataFrame:
    """One row per (output, draw, bin): abs_gc, pool_abs_gc, the basic and BCa |GC| intervals, flags."""
    pack = load_pack()
    data = ns.load_analysis_data(str(pack.path), pack.tokenizer(), n=pool, seq_len=48, seed=7)
    model = ns.load_checkpoint(checkpoint)
    scores = data.labels["score"].to_numpy()
    rows = []
    for output in outputs:
        start = time.perf_counter()
        K = ns.empirical_ntk(model, data.batch, output=output, method="exact").matrix.double().numpy()
        log.info("%s: the pool's kernel (%d x %d) in %.0f s", output, pool, pool, time.perf_counter() - start)
        truth = [abs(r.score) for r in ns.kernel_gc(K, _bins(scores, bins), resampling=None)]
        rng = np.random.default_rng(seed)
        for draw in range(draws):
            idx = np.sort(rng.choice(pool, n, replace=False))
            Ks, groups = K[np.ix_(idx, idx)], _bins(scores[idx], bins)
            basic = ns.kernel_gc(Ks, groups, resampling=ns.Resampling(null_draws=0, seed=draw))
            bca = ns.kernel_gc(Ks, groups, resampling=ns.Resampling(null_draws=0, seed=draw, interval="bca"))
            for b, (r, s) in enumerate(zip(basic, bca)):
                rows.append(dict(output=output, draw=draw, bin=b, abs_gc=abs(r.score), pool_abs_gc=truth[b],
                                 basic_low=r.abs_interval.low, basic_high=r.abs_interval.high,
                                 bca_low=s.abs_interval.low, bca_high=s.abs_interval.high, flags=" ".join(r.flags)))
            log.info("%s: draw %d/%d", output, draw + 1, draws)
    return pd.DataFrame(rows)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per output: coverage of the pool's |GC| by each interval, their mean widths, the spread of |GC|
    over draws (mean over bins of the standard deviation), and the share of flagged (draw, bin) pairs."""
    out = []
    for output, t in table.groupby("output", sort=False):
        row = {"output": output}
        for kind in ("basic", "bca"):
            row[f"{kind}_coverage"] = float(((t[f"{kind}_low"] <= t.pool_abs_gc) & (t.pool_abs_gc <= t[f"{kind}_high"]))
                                            .mean())
            row[f"{kind}_width"] = float((t[f"{kind}_high"] - t[f"{kind}_low"]).mean())
        row["spread_over_draws"] = float(t.groupby("bin")["abs_gc"].std().mean())
        row["flagged"] = float((t["flags"].fillna("") != "").mean())
        out.append(row)
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--pool", type=int, default=768)
    parser.add_argument("--n", type=int, default=192)
    parser.add_argument("--draws", type=int, default=40)
    parser.add_argument("--outputs", default="centred-true-logit,true-logit,loss")
    parser.add_argument("--out", help="the per-draw table (CSV)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    table = calibrate(args.checkpoint, outputs=args.outputs.split(","), pool=args.pool, n=args.n, draws=args.draws)
    if args.out:
        table.to_csv(args.out, index=False)
    print(summary(table).to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
