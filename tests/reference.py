"""Obviously correct slow references: one torch.autograd.grad call per sample."""

import torch
import torch.nn.functional as F


def causal_loss(model, ids, mask):
    """Mean next-token CE of one sequence, with the padding cut off (no mask needed)."""
    n = int(mask.sum())
    x = ids[None, :n]
    out = model(input_ids=x)
    logits = out if torch.is_tensor(out) else out.logits
    return F.cross_entropy(logits[0, :-1], x[0, 1:])


def jacobian_loop(model, n, sample_fn, names=None):
    """J (n, P): row i is grad of sample_fn(i) over model.named_parameters() (or ``names``)."""
    params = dict(model.named_parameters())
    chosen = [params[k] for k in (names or params)]
    rows = []
    for i in range(n):
        grads = torch.autograd.grad(sample_fn(i), chosen, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, chosen)]))
    return torch.stack(rows)


def causal_jacobian(model, batch, names=None):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return jacobian_loop(model, ids.shape[0], lambda i: causal_loss(model, ids[i], mask[i]), names)


def masked_jacobian(model, batch, objective, value):
    """J of a masked LM output, one sample at a time with HF's own 2-D attention mask and the
    objective's deterministic mask: ``value(logits (k, V), targets (k,))`` at the masked positions."""
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def f(i):
        prepared = objective.prepare(model, {"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1]})
        logits = model(input_ids=prepared["inputs"]["input_ids"], attention_mask=mask[i : i + 1]).logits[0]
        chosen = prepared["aux"]["mask"][0]
        return value(logits[chosen], ids[i][chosen])

    return jacobian_loop(model, ids.shape[0], f)
