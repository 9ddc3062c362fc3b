"""In-run GC's overhead inside training (issue 45): a model trained on the shipped pack's blocks
for ``--steps`` steps without and with :class:`ntkscope.gc.inrun.InRunGC` computing, after every
backward, the GC of each domain of the batch against the batch (the point values), side by side
in one process from the same initial weights and batches; the arms alternate in rounds so that a
slower spell of the machine falls on both.

Models: ``quick`` (the reproduction's GPT, 4 layers d=128, 48 tokens, batch 32, AdamW) and
``gpt2-small`` (transformers' GPT2LMHeadModel at GPT-2 small's shape, 12 x 768 and a 50 257-token
head, seeded; 64 tokens, batch 32; for a GPU: ``--device cuda``; ``--layers``, ``--width``: a smaller
shape for a smoke run).

Columns: model, arm, steps, median seconds of a step (forward, backward, the in-run GC if any, the
optimizer step; after a CUDA synchronise on a GPU), the in-run GC's median seconds, the overhead
(the median step's excess over the plain arm's, as a share of it), whether every step's loss
equals the plain arm's, the layers hooked, and the machine.

Run: python benchmarks/inrun.py [--model quick] [--steps 60] [--rounds 3] [--device cpu]
     [--out benchmarks/inrun.csv]
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

SEQ_LEN = {"quick": 48, "gpt2-small": 64}


def _model(name: str, vocab: int, layers: int = 12, width: int = 768):
    if name == "quick":
        model = GPT(GPTConfig(vocab_size=vocab, block_size=48, n_layer=4, n_head=4, n_embd=128))
        return model, lambda ids: model(ids, positions=slice(None, -1), targets=ids[:, 1:]) / ids[:, 1:].numel()
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64))  # 50 257 tokens
    model = transformers.GPT2LMHeadModel(config)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _run(step_loss, model, batches, domains, inrun: InRunGC | None, device) -> tuple[list, list, list]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3 if isinstance(model, GPT) else 3e-4)
    steps, gcs, losses = [], [], []
    for ids, labels in zip(batches, domains):
        _sync(device)
        start = time.perf_counter()
        loss = step_loss(ids)
        loss.backward()
        if inrun is not None:
            _sync(device)
            t = time.perf_counter()
            inrun.gc(labels)
            gcs.append(time.perf_counter() - t)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        steps.append(time.perf_counter() - start)
        losses.append(loss.item())
    return steps, gcs, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SEQ_LEN), default="quick")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=12, help="gpt2-small: layers (12; fewer for a smoke run)")
    parser.add_argument("--width", type=int, default=768, help="gpt2-small: width (768)")
    parser.add_argument("--out", default="benchmarks/inrun.csv")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    seq_len = SEQ_LEN[args.model]
    blocks, tokenizer = load_data(TrainConfig(data=DataConfig(seq_len=seq_len)))
    g = torch.Generator().manual_seed(0)
    order = torch.randint(0, len(blocks), (args.steps, 32), generator=g)
    batches = [blocks.input_ids[i].to(device) for i in order]
    domains = [[blocks.domain_names[int(d)] for d in blocks.domains[i]] for i in order]
    torch.manual_seed(0)
    shape = (tokenizer.vocab_size, args.layers, args.width)
    init = _model(args.model, *shape)[0].state_dict()
    arms = ("plain", "in-run GC")
    times = {arm: [] for arm in arms}
    gc_times = {arm: [] for arm in arms}
    losses, hooked = {}, 0
    for _ in range(args.rounds):
        for arm in arms:
            model, step_loss = _model(args.model, *shape)
            model.load_state_dict(init)
            model.to(device).train()
            torch.manual_seed(1)  # the same dropout masks in every arm
            if arm == "plain":
                steps, _, loss = _run(step_loss, model, batches, domains, None, device)
            else:
                with InRunGC(model) as inrun:
                    hooked = len(inrun.modules)
                    steps, gcs, loss = _run(step_loss, model, batches, domains, inrun, device)
                gc_times[arm] += gcs[5:]
            times[arm] += steps[5:]  # the first steps warm the allocator
            losses[arm] = loss
            del model
    plain = statistics.median(times["plain"])
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.machine()}, {torch.get_num_threads()} threads") + f", torch {torch.__version__}"
    table = []
    for arm, steps in times.items():
        step = statistics.median(steps)
        table.append({"model": args.model, "arm": arm, "steps": args.steps, "rounds": args.rounds,
                      "s_per_step": step, "gc_s": statistics.median(gc_times[arm]) if gc_times[arm] else None,
                      "overhead": step / plain - 1, "same_losses": losses[arm] == losses["plain"],
                      "layers_hooked": hooked if arm != "plain" else None,
                      "machine": machine})
    frame = pd.DataFrame(table)
    write_table(frame, args.out)
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
