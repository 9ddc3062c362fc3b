"""In-run GC's overhead inside training (issue 45): the quick model (the reproduction's GPT, 4
layers d=128, 48 tokens, batch 32, AdamW) trained on the shipped pack's blocks for ``--steps``
steps without and with :class:`ntkscope.gc.inrun.InRunGC` computing, after every backward, the
GC of each domain of the batch against the batch (the point values), side by side in one process
from the same initial weights and batches; the arms alternate in rounds so that a slower spell
of the machine falls on both.

Columns: arm, steps, median seconds of a step (forward, backward, the in-run GC if any, the
optimizer step), the in-run GC's median seconds, the overhead (the median step's excess over the
plain arm's, as a share of it), whether every step's loss equals the plain arm's, the layers
hooked, and the machine.

Run: python benchmarks/inrun.py [--steps 60] [--rounds 3] [--out benchmarks/inrun.csv]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import pandas as pd
import torch

from cse_models import GPT
from cse_models.config import GPTConfig
from cse_models.train import TrainConfig, load_data
from cse_models.train_config import DataConfig
from ntkscope.core.files import write_table
from ntkscope.gc.inrun import InRunGC


def _run(model, batches, domains, inrun: InRunGC | None) -> tuple[list, list, list]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps, gcs, losses = [], [], []
    for ids, labels in zip(batches, domains):
        start = time.perf_counter()
        loss = model(ids, positions=slice(None, -1), targets=ids[:, 1:]) / ids[:, 1:].numel()
        loss.backward()
        if inrun is not None:
            t = time.perf_counter()
            inrun.gc(labels)
            gcs.append(time.perf_counter() - t)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - start)
        losses.append(loss.item())
    return steps, gcs, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/inrun.csv")
    args = parser.parse_args()
    torch.set_num_threads(2)
    blocks, tokenizer = load_data(TrainConfig(data=DataConfig(seq_len=48)))
    g = torch.Generator().manual_seed(0)
    order = torch.randint(0, len(blocks), (args.steps, 32), generator=g)
    batches = [blocks.input_ids[i] for i in order]
    domains = [[blocks.domain_names[int(d)] for d in blocks.domains[i]] for i in order]
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=48, n_layer=4, n_head=4, n_embd=128)
    torch.manual_seed(0)
    init = GPT(config).state_dict()
    times = {"plain": [], "in-run GC": []}
    gc_times, losses, hooked = [], {}, 0
    for _ in range(args.rounds):
        for arm in times:
            model = GPT(config)
            model.load_state_dict(init)
            model.train()
            if arm == "plain":
                steps, _, loss = _run(model, batches, domains, None)
            else:
                with InRunGC(model) as inrun:
                    hooked = len(inrun.modules)
                    steps, gcs, loss = _run(model, batches, domains, inrun)
                gc_times += gcs
            times[arm] += steps[5:]  # the first steps warm the allocator
            losses[arm] = loss
    plain = statistics.median(times["plain"])
    rows = []
    for arm, steps in times.items():
        step = statistics.median(steps)
        rows.append({"arm": arm, "steps": args.steps, "rounds": args.rounds, "s_per_step": step,
                     "gc_s": statistics.median(gc_times) if arm != "plain" else None,
                     "overhead": step / plain - 1, "same_losses": losses[arm] == losses["plain"],
                     "layers_hooked": hooked if arm != "plain" else None,
                     "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"})
    table = pd.DataFrame(rows)
    write_table(table, args.out)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
