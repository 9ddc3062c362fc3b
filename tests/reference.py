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
