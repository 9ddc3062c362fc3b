"""Token-level scores against a group's primary gradient direction (ntkscope.gc.tokens), against a
per-token autograd loop in float64: the explicit J J^T of the group, its top eigenvector by
numpy.linalg.eigh, and each token's own gradient projected on the unit direction."""

import numpy as np
import pytest
import torch

from ntkscope.core.lm import causal_targets, token_values
from ntkscope import token_scores


def _reference(model, batch, idx, value):
    params = [p for p in model.parameters() if p.requires_grad]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    targets, keep = causal_targets(ids, mask)

    def per_token():
        logits = model(input_ids=ids, attention_mask=mask)
        return token_values(logits, targets, keep, value=value, reduction="none")

    def flat_grad(y):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(y, params)])

    count = keep.sum(1).double()
    J = torch.stack([flat_grad(per_token()[i].sum() / count[i]) for i in idx])  # the group's per-sample gradients
    vals, vecs = np.linalg.eigh((J @ J.T).numpy())
    w = vecs[:, -1] * np.sign(vecs[:, -1].sum())
    u = torch.from_numpy(w) @ J
    scores = {(i, t): float(flat_grad(per_token()[i, t]) @ u / u.norm())
              for i in idx for t in torch.nonzero(keep[i]).flatten().tolist()}
    return scores, (J @ u / u.norm()).numpy()  # the tokens' scores, and each sample's own projection


@pytest.mark.parametrize("value", ["loss", "centred-true-logit"])
def test_token_scores_equal_a_per_token_autograd_loop_in_float64(gpt, lm_batch, value):
    model = gpt.double()
    groups = {"a": [0, 2, 3], "b": [1, 4, 5, 6, 7]}
    table = token_scores(model, lm_batch, groups, output=value)
    _, keep = causal_targets(lm_batch["input_ids"], lm_batch["attention_mask"])
    assert len(table) == sum(int(keep[i].sum()) for idx in groups.values() for i in idx)  # padding never scored
    for name, idx in groups.items():
        want, projection = _reference(model, lm_batch, idx, value)
        mine = table[table["group"] == name]
        got = {(int(r.sample), int(r.position)): r.score for r in mine.itertuples()}
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-9, atol=1e-12)
        # a sample's token scores average to its own gradient's projection on the direction
        np.testing.assert_allclose(mine.groupby("sample")["score"].mean().loc[idx].to_numpy(), projection,
                                   rtol=1e-9, atol=1e-12)
    row = table[(table["sample"] == 0) & (table["position"] == 0)].iloc[0]
    assert row["token"] == lm_batch["input_ids"][0, 0] and row["target"] == lm_batch["input_ids"][0, 1]


def test_token_scores_refuse_what_they_cannot_score(gpt, lm_batch):
    with pytest.raises(ValueError, match=r"token_scores: groups must map each name to sample indices in \[0, 8\)"):
        token_scores(gpt, lm_batch, {"a": [3, 9]})
    with pytest.raises(ValueError, match=r"token_scores: output must be a per-token value of a causal language"):
        token_scores(gpt, lm_batch, {"a": [0, 1]}, output=lambda out: out.sum(dim=(1, 2)))
