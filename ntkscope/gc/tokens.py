"""Token-level scores against a group's primary gradient direction (issue 62, item 2): which
tokens of a group's sentences pull the weights along the direction the group agrees on.

A group's primary direction is ``u = sum_i w_i grad f_i`` over its samples, ``w`` the top
eigenvector of the group's NTK block (the direction GC compares, docs/design.md), so that
``|u|^2`` is that block's top eigenvalue. A token's score is its own value's gradient projected
on the unit direction, ``grad f_(i,t) . u / |u|``: positive where the token's gradient agrees
with the group's consensus direction, negative where it opposes it. With the sequence mean as the sample's
value, a sample's scores average to its own gradient's projection, ``(K w)_i / |u|``.

A group's token scores come from one backward (``u``, weighted by ``w``) and one forward-mode
product along ``u`` (:func:`torch.func.jvp`) over the batch: no per-token gradient is formed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch.func import functional_call, jvp

from ntkscope.core.checks import InputError, entry
from ntkscope.core.lm import causal_targets, token_values
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.kernel.objectives import CausalLMLoss, primary_output, resolve_output
from ntkscope.kernel.params import select_parameters
from ntkscope.kernel.replicates import direction

COLUMNS = ["group", "sample", "position", "token", "target", "score"]


@entry("token_scores")
def token_scores(model: torch.nn.Module, batch, groups: dict, *, output: str = "loss", params=None,
                 method: str = "exact") -> pd.DataFrame:
    """Each scored token's projection on each group's primary gradient direction.

    Parameters
    ----------
    model : a causal language model.
    batch : (n, T) token ids or a dict with ``input_ids`` and ``attention_mask``.
    groups : {name: sample indices} (at least 1 each).
    output : the per-token value (:data:`ntkscope.core.lm.TOKEN_VALUES`: "loss", "true-logit",
        "centred-true-logit", or one registered); a sample's value is their mean, as GC's.
    params : the parameters the gradients are taken over (:func:`ntkscope.select_parameters`).
    method : how the group kernels are computed (:func:`ntkscope.empirical_ntk`'s methods).

    Returns
    -------
    DataFrame of COLUMNS: one row per group, sample of the group and kept position (the token at
    ``position`` predicting ``target``); ``score`` in the value's units per unit of the direction.
    """
    objective = resolve_output(output, model)
    if not isinstance(objective, CausalLMLoss):
        raise InputError("output", "must be a per-token value of a causal language model (token_scores "
                         "scores the tokens of a next-token objective)", output)
    data = objective.prepare(model, batch)
    n = data["aux"]["targets"].shape[0]
    members = {}
    for name, idx in groups.items():
        rows = np.unique(np.asarray(idx, dtype=np.int64))
        if rows.size == 0 or rows.min() < 0 or rows.max() >= n:
            raise InputError("groups", f"must map each name to sample indices in [0, {n})", {name: list(idx)})
        members[name] = rows
    selection = select_parameters(model, params)
    named = dict(model.named_parameters())
    theta = {k: named[k] for k in selection.names}
    K = empirical_ntk(model, batch, output=output, params=params, method=method).matrix.double().cpu().numpy()
    targets, keep = causal_targets(data["aux"]["targets"], data["aux"]["mask"])
    kept = keep if keep is not None else targets != -100
    inputs = data["inputs"]

    def values(p):  # (n, T) per-token values under parameters p, 0 where nothing is predicted
        out = functional_call(model, p, (inputs,)) if torch.is_tensor(inputs) else functional_call(model, p, (), inputs)
        return token_values(primary_output(out), targets, keep, value=objective.name, reduction="none")

    first = next(iter(theta.values()))
    count = kept.sum(1).to(first.dtype)
    mask, ids, tgt = kept.cpu().numpy(), data["aux"]["targets"].cpu().numpy(), targets.cpu().numpy()
    was_training = model.training
    model.eval()
    tables = []
    try:
        for name, idx in members.items():
            w = torch.zeros(n, dtype=first.dtype, device=first.device)
            w[torch.from_numpy(idx).to(first.device)] = torch.from_numpy(direction(K, idx, np.ones(idx.size)).weights).to(w)
            u = torch.autograd.grad((w * values(theta).sum(1) / count).sum(), list(theta.values()))
            u = dict(zip(theta, (g.detach() for g in u)))
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in u.values()))
            _, along = jvp(values, ({k: v.detach() for k, v in theta.items()},), (u,))
            scores = (along.double() / norm).cpu().numpy()
            at, t = np.nonzero(mask[idx])  # the group's kept positions, sample by sample
            i = idx[at]
            tables.append(pd.DataFrame({"group": name, "sample": i, "position": t, "token": ids[i, t],
                                        "target": tgt[i, t], "score": scores[i, t]}, columns=COLUMNS))
    finally:
        model.train(was_training)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=COLUMNS)


EXTREME_COLUMNS = ["group", "end", "rank", "score", "token_text", "target_text", "sample", "position"]


def extreme_tokens(scores: pd.DataFrame, tokenizer, k: int) -> pd.DataFrame:
    """The ``k`` highest ("top") and lowest ("bottom") of each group's :func:`token_scores`, with
    the token and the token it predicts decoded by ``tokenizer`` (a
    :class:`~ntkscope.text.tokenization.Tokenizer`): EXTREME_COLUMNS."""
    rows = []
    for group, part in scores.groupby("group", sort=False):
        ranked = part.sort_values(["score", "sample", "position"], ascending=[False, True, True], kind="stable")
        for end, chosen in (("top", ranked.head(k)), ("bottom", ranked.iloc[::-1].head(k))):
            for rank, r in enumerate(chosen.itertuples(), 1):
                rows.append({"group": group, "end": end, "rank": rank, "score": r.score,
                             "token_text": tokenizer.decode([int(r.token)]), "target_text": tokenizer.decode([int(r.target)]),
                             "sample": r.sample, "position": r.position})
    return pd.DataFrame(rows, columns=EXTREME_COLUMNS)

