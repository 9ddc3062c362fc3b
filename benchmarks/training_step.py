"""Training speed of the quick model (the sweep's and the reproduction's GPT) on 2 CPU cores:
the training loss as it was (full (B, T, V) logits, sliced for next-token prediction, then
cross-entropy) against the loss as it is (:func:`cse_models.train.lm_loss`: the last
position's logits never built, the LM head and cross-entropy fused in chunks on CPU by
:func:`ntkscope.core.lm.linear_cross_entropy`), side by side in one process.

Both train copies of one model from the same initialisation on the same batches (AdamW,
gradient clipping), their steps interleaved, for ``--steps`` steps; the table gives seconds
per step (median after 5 steps) at 2 threads and at 1 thread (the sweep runs two
single-thread processes side by side), the two loss curves' difference at the first step and
at most, and, as the scale of float32 noise in a training curve, the largest difference of
one path's curve between 1 and 2 threads (the same code, summing in another order).

Run: python benchmarks/training_step.py [--steps 60] [--out benchmarks/training_step.csv]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import pandas as pd
import torch

from cse_models.model import build_model
from cse_models.config import GPTConfig
from cse_models.data import global_batch
from cse_models.train import TrainConfig, load_data, lm_loss, make_optimizer
from ntkscope.core.lm import causal_pairs, lm_loss as token_loss


def loss_before(model, ids, domains, step, cfg):
    """The training loss before the change: every position's logits, then the shift."""
    logits, targets, _ = causal_pairs(model(ids, None, domains), ids)
    return token_loss(logits.float(), targets, reduction="sum"), torch.tensor(targets.numel())


PATHS = {"before: full logits + cross_entropy": loss_before, "after: train.lm_loss (fused, chunked)": lm_loss}


def train_side_by_side(init, blocks, cfg, steps: int) -> dict:
    """Both paths train copies of ``init`` on the same batches, their steps interleaved (so a
    slower or busier machine affects both alike): {path: (losses, step seconds after 5)}."""
    models = {name: copy.deepcopy(init).train() for name in PATHS}
    opts = {name: make_optimizer(m, cfg) for name, m in models.items()}
    out = {name: ([], []) for name in PATHS}
    for step in range(steps):
        idx = global_batch(blocks, step, cfg.batch_size, cfg.seed)
        ids, domains = blocks.input_ids[idx], blocks.domains[idx]
        for name, path in PATHS.items():
            start = time.perf_counter()
            loss_sum, count = path(models[name], ids, domains, step, cfg)
            loss = loss_sum / count
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[name].parameters(), cfg.grad_clip)
            opts[name].step()
            out[name][1].append(time.perf_counter() - start)
            out[name][0].append(loss.item())
    return {name: (losses, times[5:]) for name, (losses, times) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/training_step.csv")
    args = parser.parse_args()
    cfg = TrainConfig(model={"n_layer": 4, "n_head": 4, "n_embd": 128}, data={"seq_len": 48}, batch_size=32)
    blocks, tokenizer = load_data(cfg)
    torch.manual_seed(0)
    init = build_model(GPTConfig.from_dict({**cfg.model, "vocab_size": tokenizer.vocab_size, "block_size": 48}))
    rows, finals = [], {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        runs = train_side_by_side(init, blocks, cfg, args.steps)
        (before, _), (after, _) = runs.values()
        for name, (losses, times) in runs.items():
            finals[(threads, name)] = losses
            rows.append({"threads": threads, "path": name, "s_per_step": statistics.median(times),
                         "steps_per_s": 1 / statistics.median(times), "first_loss": losses[0],
                         "final_loss": losses[-1], "first_step_loss_diff": abs(before[0] - after[0]),
                         "max_abs_loss_diff": max(abs(a - b) for a, b in zip(before, after))})
    # the scale of float noise in a training curve: the same path at 1 and at 2 threads
    for row in rows:
        one, two = finals[(1, row["path"])], finals[(2, row["path"])]
        row["same_path_1_vs_2_threads"] = max(abs(a - b) for a, b in zip(one, two))
    frame = pd.DataFrame(rows)
    base = frame[frame.path.str.startswith("before")].set_index("threads")["s_per_step"]
    frame["speedup"] = [base[t] / s for t, s in zip(frame.threads, frame.s_per_step)]
    frame.to_csv(args.out, index=False)
    print(f"{platform.machine()}, torch {torch.__version__}, {args.steps} steps (median of the last "
          f"{args.steps - 5}):")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
