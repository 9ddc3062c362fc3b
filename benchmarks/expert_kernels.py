"""Per-expert kernels of a transformers mixture (``ntkscope.expert_ntk``, token units) against what a
user would otherwise write: one ``torch.autograd.grad`` per routed token over the fused expert
tensors, then the expert's row, then ``J J^T``. Side by side in one process, on an OLMoE layout
at a small size (hidden 128, 8 experts of 256, top 2, 2 layers, float32), a batch of 8
sequences of 16 tokens; each timed after one untimed call, the median of 3. Also the same kernel
with ``max_memory`` set so that it is made in panels.

Columns: method, layer, experts, units (all experts' routed tokens), seconds, speedup (the loop's
seconds over the method's), max_abs_diff (largest kernel entry difference from the loop, over
the largest entry).

Run: python benchmarks/expert_kernels.py [--out benchmarks/expert_kernels.csv]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import pandas as pd
import torch
import torch.nn.functional as F
import transformers

from ntkscope.kernel.experts import expert_ntk

LAYER = "model.layers.1.mlp"


def _model():
    config = transformers.OlmoeConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, num_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.config._experts_implementation = "eager"
    return model


def _loop(model, ids) -> dict:
    """{expert: J J^T} by a per-token autograd loop over the whole fused tensors."""
    block = model.get_submodule(LAYER)
    seen = {}
    handle = block.experts.register_forward_pre_hook(lambda m, a: seen.update(topk=a[1]) and None)
    logits = model(input_ids=ids).logits
    handle.remove()
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    routed = seen["topk"].reshape(*ids.shape, -1)[:, :-1]
    tensors = [block.experts.gate_up_proj, block.experts.down_proj]
    out = {}
    for e in range(block.gate.num_experts):
        units = torch.nonzero((routed == e).any(-1))
        rows = []
        for i, t in units.tolist():
            grads = torch.autograd.grad(loss[i, t], tensors, retain_graph=True)
            rows.append(torch.cat([g[e].reshape(-1) for g in grads]))
        if rows:
            J = torch.stack(rows)
            out[e] = J @ J.T
    return out


def _timed(fn, repeats: int = 3):
    fn()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/expert_kernels.csv")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = _model()
    ids = torch.randint(0, 1024, (8, 16), generator=torch.Generator().manual_seed(1))
    loop_s, reference = _timed(lambda: _loop(model, ids))
    units = sum(len(k) for k in reference.values())
    rows = [{"method": "per-token autograd loop", "seconds": loop_s}]
    P = None
    for method, options in (("expert_ntk", {}), ("expert_ntk, in panels", "panels")):
        if options == "panels":  # panels of a third of the largest expert's units
            third = -(-max(len(k) for k in reference.values()) // 3)
            options = {"max_memory": 2 * (2 * P * 4) * third}
        seconds, kernels = _timed(lambda: expert_ntk(model, ids, layer=LAYER, unit="token", **options))
        P = kernels[0].n_params
        diff = max(float((k.matrix - reference[k.expert]).abs().max() / reference[k.expert].abs().max())
                   for k in kernels)
        rows.append({"method": method, "seconds": seconds, "max_abs_diff": diff,
                     "panels": max(int(k.method.split(", ")[1].split()[0]) if "panels" in k.method else 1
                                   for k in kernels)})
    frame = pd.DataFrame(rows)
    frame.insert(1, "layer", LAYER)
    frame.insert(2, "experts", len(reference))
    frame.insert(3, "units", units)
    frame["speedup"] = loop_s / frame["seconds"]
    frame.to_csv(args.out, index=False)
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
