"""The GC tracker's overhead inside training: the quick model (the reproduction's GPT, 4 layers
d=128, 48 tokens, batch 32) trained by ``cse_models.train`` for ``--steps`` steps without a
tracker, with one (:class:`ntkscope.GCTracker`: the long tail of ``n`` validation sentences
against the whole set, every ``every`` steps, with the default statistics: jackknife of 200,
200 null draws, the homogeneous and matched nulls; and once with ``per_layer=True``, GC per
block as well), and with in-run GC every step
(:class:`ntkscope.InRunTracker`: each domain of the training batch against the batch, point
values, from the step's own backward; exact, and from gradient sketches of width 16, 32 and 64), one after the
other in one process; and the untracked
run once more at the end, which measures how much the process's training drifts over the arms
whatever the tracker (its wall-time excess over the first).

Columns: the arm; n and every; training seconds (the tracker's own count of the time between
its calls) and probe seconds (all probes), their ratio (the overhead as a share of training
time), the median seconds of one probe and the tracker's estimate before its first probe, the
probe interval at which this probe would cost 5 % of training (its seconds over 5 % of a step); the
wall time of the whole run and its excess over the run without a tracker; and whether the
losses of every step equal the untracked run's.

Run: python benchmarks/tracker.py [--steps 400] [--out benchmarks/tracker.csv]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from cse_models.train import TrainConfig, load_data, train
from ntkscope.gc.inrun import InRunTracker
from ntkscope.gc.tracker import GCTracker, Probes
from ntkscope.kernel.objectives import call_model, resolve_output
from ntkscope.runs.checkpoints import load_checkpoint

#: (arm, n, every): the documented setting (n = 128 every 100 steps), cheaper ones beside it, and
#: in-run GC every step (n: the batch), and the untracked run again last: how much the process's
#: training drifts over the arms, whatever the tracker
ARMS = [("no tracker", 0, 0), ("tracker", 128, 100), ("tracker, per layer", 128, 100), ("tracker", 64, 100),
        ("tracker", 128, 250), ("in-run GC", 32, 1), ("in-run GC, sketch 16", 32, 1),
        ("in-run GC, sketch 32", 32, 1), ("in-run GC, sketch 64", 32, 1), ("no tracker, again", 0, 0)]


def floor_seconds(model, probes: Probes, output: str, repeats: int = 3) -> float:
    """The probe's floor: one forward and one backward of the sum of the probe sentences' outputs
    (``output``, as the tracker measures them) at ``model``, in eval mode; the median of ``repeats``
    after one untimed pass (the first pass of a freshly loaded model pages its code and memory in)."""
    model.eval()
    objective = resolve_output(output, model)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        data = objective.prepare(model, probes.batch)
        objective.evaluate(lambda inputs: call_model(model, inputs), data).sum().backward()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _losses(run_dir: Path) -> list:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", default="benchmarks/tracker.csv")
    args = parser.parse_args()
    torch.set_num_threads(2)
    spec = {"model": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "data": {"seq_len": 48}, "batch_size": 32,
            "steps": args.steps, "checkpoint_every": args.steps, "log_every": 50, "tensorboard": False}
    _, tokenizer = load_data(TrainConfig.from_dict(spec))
    rows, plain = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (arm, n, every) in enumerate(ARMS):
            out = Path(tmp) / f"arm{i}"
            callbacks, tracker, inrun = [], None, None
            if arm.startswith("in-run GC"):
                width = int(arm.rsplit(" ", 1)[1]) if "sketch" in arm else 16
                inrun = InRunTracker(every=every, estimator="sketch" if "sketch" in arm else "exact", width=width)
                callbacks = [inrun]
            elif n:
                probes = Probes.load("default", tokenizer, n=n, seq_len=48, by="tail", tail_fraction=1 / 3,
                                     homogeneous="general")
                tracker = GCTracker(probes, every=every, out=out / "track", per_layer=arm.endswith("per layer"))
                callbacks = [tracker]
            start = time.perf_counter()
            train(TrainConfig.from_dict({**spec, "out_dir": str(out)}), callbacks=callbacks)
            wall = time.perf_counter() - start
            losses = _losses(out)
            plain = (wall, losses) if plain is None else plain
            row = {"arm": arm, "n": n or None, "every": every or None, "steps": args.steps, "wall_s": wall,
                   "wall_excess": wall / plain[0] - 1, "same_losses": losses == plain[1]}
            if inrun is not None:
                measured = len(set(inrun.frame["step"]))
                row.update(probes=measured, train_s=inrun.train_seconds, probe_s=inrun.seconds,
                           overhead=inrun.overhead, s_per_probe=inrun.seconds / max(measured, 1),
                           method=f"in-run {inrun.estimator}" + (f" {width}" if inrun.sketch else ""))
            if tracker is not None:
                probe_s = sum(tracker.probe_seconds)
                row.update(probes=len(tracker.probe_seconds), train_s=tracker.train_seconds, probe_s=probe_s,
                           overhead=probe_s / tracker.train_seconds,
                           s_per_probe=statistics.median(tracker.probe_seconds),
                           estimate_s=tracker.cost.seconds, method=tracker.cost.method,
                           every_for_5pct=statistics.median(tracker.probe_seconds)
                           / (0.05 * tracker.train_seconds / args.steps),
                           floor_s=floor_seconds(load_checkpoint(out / "checkpoints" / f"step-{args.steps:06d}"),
                                                 probes, tracker.options.output))
                row["probe_over_floor"] = row["s_per_probe"] / row["floor_s"]
            rows.append(row)
            print(row, flush=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(args.out, index=False)
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
