"""Training-step time of CSE and Switch layers as a multiple of the dense step, at equal
active parameters (each expert is a full copy of the dense module, and every token passes
through exactly one), side by side in one process.

Models: the small GPT of cse_models (4 layers, d=256, 64 tokens, batch 32, the shipped
pack's BPE of 8192 tokens) on real blocks of the default corpus pack; sparse layers at
blocks 1 and 3 with 4 experts. CSE routers are fitted on the model's own embeddings of
512 blocks with an eps that gives 4 clusters, so routing is what training would see.
A step is forward + backward + AdamW (+ the CSE centre update / Switch aux loss).

Target (issue 4): CSE <= 1.05x the dense step.

Run: python benchmarks/sparse_step.py [--repeats 20] [--out benchmarks/sparse_step.csv]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from cse_models import GPT, GPTConfig, SparseConfig
from cse_models.cse import convert_to_cse, fit_router
from cse_models.data import pack_blocks
from ntkscope.text.corpus.pack import load_pack


def step_seconds(model, batches, repeats: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    times = []
    for i in range(repeats + 3):
        ids = batches[i % len(batches)]
        start = time.perf_counter()
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)) + model.aux_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.update_routers()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=150, help="dense warm-up steps before the CSE conversion")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    pack = load_pack()
    blocks = pack_blocks(pack, pack.tokenizer(), "train", 64)
    g = torch.Generator().manual_seed(0)
    batches = [blocks.input_ids[torch.randint(0, len(blocks), (32,), generator=g)] for _ in range(8)]
    base = dict(vocab_size=8192, block_size=64, n_layer=4, n_head=4, n_embd=256)
    dense = GPT(GPTConfig(**base))
    switch = GPT(GPTConfig(**base, sparse=SparseConfig(kind="switch", layers=[1, 3], n_experts=[4, 4])))
    warm = torch.optim.AdamW(dense.parameters(), lr=3e-3)
    for i in range(args.warmup):  # the dense warm-up of Algorithm 1: embeddings separate only with training
        ids = blocks.input_ids[torch.randint(0, len(blocks), (32,), generator=g)]
        logits = dense(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        warm.zero_grad()
        loss.backward()
        warm.step()
    switch.load_state_dict(dense.state_dict(), strict=False)
    sample = blocks.input_ids[torch.randperm(len(blocks), generator=g)[:512]]
    embeddings = dense.module_inputs(sample, None, [1, 3])
    chosen = {}
    for layer, z in embeddings.items():  # per layer, the largest eps that gives >= 4 clusters
        for eps in np.geomspace(1.0, 0.05, 40):
            if fit_router(z.numpy(), proj_dim=32, eps=float(eps), min_samples=5, max_experts=4, seed=layer).n_clusters == 4:
                chosen[layer] = float(eps)
                break
    cse = copy.deepcopy(dense)
    cse.config.sparse = SparseConfig(kind="cse", layers=[1, 3], n_experts=[0, 0], proj_dim=32)
    fits = convert_to_cse(cse, sample, None, eps=chosen, min_samples=5, max_experts=4, seed=0)
    print(f"CSE routers: eps {chosen}, cluster sizes {[list(f.sizes) for f in fits.values()]}")
    cse.routing_load(reset=True)
    # The same layers with balanced routing (k-means centres on the projected embeddings): the
    # dispatch cost when every expert gets a quarter of the batch, the worst case for overhead.
    from sklearn.cluster import KMeans

    balanced = copy.deepcopy(cse)
    for layer, m in zip([1, 3], balanced.sparse_layers().values()):
        z = (embeddings[layer] @ m.projection.T).numpy()
        km = KMeans(4, n_init=4, random_state=0).fit(z)
        m.centres.copy_(torch.as_tensor(km.cluster_centers_))
        m.radii.copy_(torch.as_tensor([np.linalg.norm(z[km.labels_ == j] - km.cluster_centers_[j], axis=1).mean()
                                       for j in range(4)]))
    rows = []
    for name, model in (("dense", dense), ("cse", cse), ("cse, balanced routing", balanced), ("switch", switch)):
        secs = step_seconds(model, batches, args.repeats)
        load = model.routing_load()
        active = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n or ".experts.0." in n)
        if name == "switch":
            active -= sum(p.numel() for n, p in model.named_parameters() if n.endswith("router.weight"))
        experts = [len(m.experts) for m in model.sparse_layers().values()]
        rows.append((name, experts, active, secs, load))
    frame = pd.DataFrame(rows, columns=["model", "experts per sparse layer", "active params", "step seconds", "load"])
    frame["× dense"] = frame["step seconds"] / frame.loc[0, "step seconds"]
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(frame.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.out:
        frame.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
