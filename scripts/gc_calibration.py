"""Do GC's intervals cover what they claim? Planted pools with a known answer, and a real checkpoint.

    python scripts/gc_calibration.py planted [--n 192] [--draws 100] [--out docs/gc-calibration-planted.csv]
    python scripts/gc_calibration.py CHECKPOINT [--pool 768] [--n 192] [--draws 40] [--disjoint]
        [--outputs centred-true-logit,true-logit,loss] [--out docs/gc-calibration.csv]

**planted**: :class:`ntkscope.PlantedPool` pools (low and high GC, small and large tail groups,
few and many noisy dimensions); for each interval method (the jackknife, the bootstrap's basic)
:func:`ntkscope.interval_calibration` gives, per group, the coverage of the finite-n target (the
mean |GC| of independent draws of the same sizes), the median width over the draw-to-draw sd,
the jackknife's bias against the true one and the large-sample estimate's coverage where claimed.

**CHECKPOINT**: a pool of ``--pool`` analysis sentences (the shipped pack's validation split,
seed 7) is scored once: its exact NTK, per output. Each of ``--draws`` random ``--n``-sentence
subsets of the pool stands for a fresh analysis batch: its 6 equal-count bins, their |GC| and
intervals from its own kernel (a sub-matrix of the pool's), as ``ntkscope gc`` computes them.
The finite-n target of a bin is the mean |GC| of that bin over the other draws; coverage is the
share of (draw, bin) pairs whose interval holds it. Draws of one pool overlap, which shrinks the
draw-to-draw spread the intervals are judged against; ``--disjoint`` instead cuts every
validation and test sentence of the pack into disjoint draws of ``--n``, each draw's kernel its
own (independent draws: the target and the spread are what a fresh analysis would see). Results and what they mean: docs/gc-calibration.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import numpy as np
import pandas as pd
import torch

import ntkscope as ns
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.inputs import as_source
from ntkscope.text.frequency import bin_edges, bin_of
from ntkscope.text.frequency import save_table

log = logging.getLogger("gc_calibration")

POOLS = {
    "high GC, 10 % tail": ns.PlantedPool(noise=0.15),
    "noisy, 10 % tail": ns.PlantedPool(noise=0.4),
    "30 % tail": ns.PlantedPool(shares=(0.3, 0.35, 0.35), noise=0.3),
    "512 noisy dimensions": ns.PlantedPool(dim=512, noise=0.1),
    "biased: 256 dimensions": ns.PlantedPool(dim=256, noise=0.25),
    "biased: very noisy": ns.PlantedPool(noise=0.8),
    # beyond the isotropic Gaussian pools the method was chosen on
    "tail GC 0.82, 10 % tail": ns.PlantedPool(strength=(0.2, 1.0, 1.0), noise=0.3),
    "anisotropic noise": ns.PlantedPool(spectrum=1.0, noise=0.3),
    "heavy-tailed noise (t, 5 df)": ns.PlantedPool(df=5, noise=0.3),
    "anisotropic, heavy-tailed (t, 4 df)": ns.PlantedPool(spectrum=1.0, df=4, noise=0.3),
}
METHODS = {"jackknife": ns.Resampling(null_draws=0), "basic": ns.Resampling(null_draws=0, interval="basic")}


def noise_kind(pool: ns.PlantedPool) -> str:
    """The kind of noise a pool plants: "isotropic Gaussian" (the pools the method was chosen
    on), else "anisotropic", "heavy-tailed" or both."""
    kinds = [k for k, on in (("anisotropic", pool.spectrum), ("heavy-tailed", pool.df)) if on]
    return ", ".join(kinds) or "isotropic Gaussian"


def planted(n: int, draws: int, pools=None) -> pd.DataFrame:
    """One row per (pool, interval method, group): interval_calibration's columns (``pools``:
    names of :data:`POOLS`, default all)."""
    frames = []
    for name, pool in POOLS.items():
        if pools and name not in pools:
            continue
        for method, resampling in METHODS.items():
            start = time.perf_counter()
            table = ns.interval_calibration(pool, n, draws=draws, truth_draws=4 * draws, resampling=resampling)
            table.insert(0, "method", method)
            table.insert(0, "noise", noise_kind(pool))
            table.insert(0, "pool", name)
            frames.append(table)
            log.info("%s, %s: %.0f s", name, method, time.perf_counter() - start)
    return pd.concat(frames, ignore_index=True)


def _bins(scores: np.ndarray, bins: int) -> list:
    which = bin_of(scores, bin_edges(scores, bins, kind="count"))
    return [np.flatnonzero(which == b) for b in range(bins)]


def _draw_rows(K: np.ndarray, scores: np.ndarray, bins: int, output: str, draw: int) -> list:
    """One draw's rows: its equal-count bins, their |GC| and intervals from its own kernel ``K`` (n, n)."""
    rows = []
    for method, resampling in METHODS.items():
        for b, r in enumerate(ns.kernel_gc(K, _bins(scores, bins), resampling=dataclasses.replace(resampling, seed=draw))):
            rows.append(dict(output=output, method=method, draw=draw, bin=b, abs_gc=abs(r.score),
                             low=r.abs_interval.low, high=r.abs_interval.high, flags=" ".join(r.flags)))
    return rows


def disjoint_draws(pack, n: int, draws: int | None = None) -> list:
    """Disjoint ``n``-sentence draws: every validation and test sentence of the pack, shuffled
    (seed 7) within its split and cut into blocks of ``n``; at most ``draws``. Each is (split,
    rows: the sentences' indices in the split (n,), batch (n, T), scores (n,))."""
    out = []
    for split in ("validation", "test"):
        every = len(as_source(str(pack.path)).rows(split))
        data = ns.load_analysis_data(str(pack.path), pack.tokenizer(), n=every, seq_len=48, seed=7, split=split)
        order = np.random.default_rng(7).permutation(len(data.labels))
        for start in range(0, len(order) - n + 1, n):
            idx = torch.as_tensor(np.sort(order[start:start + n]))
            out.append((split, idx.numpy(), {k: v[idx] for k, v in data.batch.items()},
                        data.labels["score"].to_numpy()[idx.numpy()]))
    return out[:draws] if draws else out


def real(checkpoint, *, outputs, pool: int, n: int, draws: int | None, bins: int = 6, seed: int = 0,
         disjoint: bool = False) -> pd.DataFrame:
    """One row per (output, method, draw, bin): abs_gc, its interval, flags, and the target.
    ``disjoint``: each draw is its own ``n`` sentences (:func:`disjoint_draws`, every draw's
    kernel computed alone) instead of ``n`` of a ``pool`` scored once."""
    pack = load_pack()
    model = ns.load_checkpoint(checkpoint)
    rows = []
    if disjoint:
        sets = disjoint_draws(pack, n, draws)
        log.info("%d disjoint draws of %d sentences", len(sets), n)
        for output in outputs:
            start = time.perf_counter()
            for draw, (_, _, batch, scores) in enumerate(sets):
                K = ns.empirical_ntk(model, batch, output=output, method="exact").matrix.double().numpy()
                rows += _draw_rows(K, scores, bins, output, draw)
            log.info("%s: %d draws in %.0f s", output, len(sets), time.perf_counter() - start)
    else:
        data = ns.load_analysis_data(str(pack.path), pack.tokenizer(), n=pool, seq_len=48, seed=7)
        scores = data.labels["score"].to_numpy()
        for output in outputs:
            start = time.perf_counter()
            K = ns.empirical_ntk(model, data.batch, output=output, method="exact").matrix.double().numpy()
            log.info("%s: the pool's kernel (%d x %d) in %.0f s", output, pool, pool, time.perf_counter() - start)
            rng = np.random.default_rng(seed)
            for draw in range(draws or 40):
                idx = np.sort(rng.choice(pool, n, replace=False))
                rows += _draw_rows(K[np.ix_(idx, idx)], scores[idx], bins, output, draw)
    table = pd.DataFrame(rows)
    jk = table[table["method"] == "jackknife"]
    sums = jk.groupby(["output", "bin"])["abs_gc"].agg(["sum", "count"])
    key = pd.MultiIndex.from_frame(table[["output", "bin"]])
    total, count = sums["sum"].reindex(key).to_numpy(), sums["count"].reindex(key).to_numpy()
    table["target"] = (total - table["abs_gc"].to_numpy()) / (count - 1)  # the mean over the other draws
    return table


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per output and method: coverage of the target, median width over the draw-to-draw sd, the
    share of intervals of the form [point, 1], and the share of flagged (draw, bin) pairs."""
    out = []
    for (output, method), t in table.groupby(["output", "method"], sort=False):
        sd = t.groupby("bin")["abs_gc"].transform("std")
        out.append({"output": output, "method": method,
                    "coverage": float(((t["low"] <= t["target"]) & (t["target"] <= t["high"])).mean()),
                    "median_width_over_sd": float(((t["high"] - t["low"]) / sd).median()),
                    "point_to_1": float(((t["low"] == t["abs_gc"]) & (t["high"] >= 1.0)).mean()),
                    "flagged": float((t["flags"].fillna("") != "").mean())})
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="'planted', or a checkpoint")
    parser.add_argument("--pool", type=int, default=768)
    parser.add_argument("--n", type=int, default=192)
    parser.add_argument("--draws", type=int)
    parser.add_argument("--outputs", default="centred-true-logit,true-logit,loss")
    parser.add_argument("--disjoint", action="store_true",
                        help="CHECKPOINT: disjoint draws (every validation and test sentence, each draw's own kernel)")
    parser.add_argument("--pools", help="planted: pool names, comma-separated (default all)")
    parser.add_argument("--append", action="store_true", help="planted: add the rows to --out's table")
    parser.add_argument("--out", help="the table (CSV)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.checkpoint == "planted":
        table = planted(args.n, args.draws or 100, args.pools.split(",") if args.pools else None)
        if args.append and args.out:
            table = pd.concat([pd.read_csv(args.out), table], ignore_index=True)
        shown = table
    else:
        table = real(args.checkpoint, outputs=args.outputs.split(","), pool=args.pool, n=args.n,
                     draws=args.draws, disjoint=args.disjoint)
        shown = summary(table)
    if args.out:
        save_table(table, args.out)
    print(shown.to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
