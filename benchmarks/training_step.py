"""Training speed of the quick model (the sweep's and the reproduction's GPT) on 2 CPU cores:
the training loss as it was (full (B, T, V) logits, sliced for next-token prediction, then
cross-entropy) against the loss as it is (:func:`cse_models.train.lm_loss`: the last
position's logits never built, the LM head and cross-entropy fused in chunks on CPU by
:func:`ntkscope.core.lm.linear_cross_entropy`), side by side in one process.

Both train the same model from the same initialisation on the same batches (AdamW, the
training schedule's optimizer, gradient clipping) for ``--steps`` steps; the table gives
seconds per step (median of the timed steps) at 2 threads and at 1 thread (the sweep runs
two single-thread processes side by side), and the largest difference between the two loss
curves (float32: the two paths sum in different orders).

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


def run(path, model, blocks, cfg, steps: int) -> tuple[list, list]:
    opt = make_optimizer(model, cfg)
    losses, times = [], []
    for step in range(steps):
        idx = global_batch(blocks, step, cfg.batch_size, cfg.seed)
        ids, domains = blocks.input_ids[idx], blocks.domains[idx]
        start = time.perf_counter()
        loss_sum, count = path(model, ids, domains, step, cfg)
        loss = loss_sum / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, times[5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/training_step.csv")
    args = parser.parse_args()
    cfg = TrainConfig(model={"n_layer": 4, "n_head": 4, "n_embd": 128}, data={"seq_len": 48}, batch_size=32)
    blocks, tokenizer = load_data(cfg)
    torch.manual_seed(0)
    init = build_model(GPTConfig.from_dict({**cfg.model, "vocab_size": tokenizer.vocab_size, "block_size": 48}))
    rows = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        curves = {}
        for name, path in PATHS.items():
            losses, times = run(path, copy.deepcopy(init).train(), blocks, cfg, args.steps)
            curves[name] = losses
            rows.append({"threads": threads, "path": name, "s_per_step": statistics.median(times),
                         "steps_per_s": 1 / statistics.median(times), "final_loss": losses[-1]})
        before, after = curves.values()
        gap = max(abs(a - b) for a, b in zip(before, after))
        for row in rows[-2:]:
            row["max_abs_loss_diff"] = gap
    frame = pd.DataFrame(rows)
    base = frame[frame.path.str.startswith("before")].set_index("threads")["s_per_step"]
    frame["speedup"] = [base[t] / s for t, s in zip(frame.threads, frame.s_per_step)]
    frame.to_csv(args.out, index=False)
    print(f"{platform.machine()}, torch {torch.__version__}, {args.steps} steps (median of the last "
          f"{args.steps - 5}):")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
