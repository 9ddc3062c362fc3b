"""The language-model loss and the mean over real tokens: each rule written once.

Used by training and evaluation (``cse_models``), by the kernel's ``output="loss"`` and by
the demo. Shapes: ``logits`` (B, T, V), ``targets`` (B, T) token ids, ``keep`` (B, T) bool.

- Causal LM: position t predicts token t + 1; a pair counts when both tokens are real
  (:func:`causal_pairs` shifts the three tensors;
  :func:`causal_targets` the targets alone, for the kernel's outputs, whose gradient is the logits').
- Masked LM: the masked positions count; targets elsewhere may be ``-100``
  (``F.cross_entropy``'s ignore index), as :func:`cse_models.data.mask_tokens` writes them.

Per token, a language model gives a scalar of the true token, one registered function each in
:data:`TOKEN_VALUES` (:func:`register_token_value`): its cross-entropy (``"loss"``), its logit
(``"true-logit"``), and its logit minus the mean logit over the vocabulary
(``"centred-true-logit"``). Softmax ignores a shift of every logit by the same amount; the
centred logit removes that direction, the plain logit keeps it. Each registered value is an
output every kernel and GC function takes by name (``output="NAME"``), and ``--output NAME`` on
the command line (recipe: docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ntkscope.core.checks import fail
from ntkscope.core.registry import Registry

REDUCTIONS = ("none", "sequence", "sequence-sum", "sum", "mean")

#: the per-token values of the true token, by name: ``fn(logits (B, T, V), targets (B, T)) -> (B, T)``,
#: where a target may be -100 (ignored: its value is set to 0 after the call)
TOKEN_VALUES = Registry("token value")


def register_token_value(name: str, fn: Callable, *, replace: bool = False) -> Callable:
    """Add the per-token value ``fn(logits, targets) -> (B, T)`` to :data:`TOKEN_VALUES` as ``name``
    (``replace``: over one of that name). It must be differentiable in the logits and work under
    ``torch.func.vmap`` (no ``.item()``, no data-dependent shapes). Returns ``fn``."""
    if not callable(fn):
        raise fail("register_token_value", "fn", "must be a function (logits, targets) -> (B, T)", type(fn).__name__)
    return TOKEN_VALUES.add(name, fn, replace=replace, func="register_token_value")


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) cross-entropy of each target, 0 where it is -100. Over rows of (B*T, V): over a
    transposed (B, V, T) the class dimension is strided and the softmax three times slower."""
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.reshape(targets.shape)


def true_logit(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) logit of each target (an ignored -100 gathers token 0)."""
    return logits.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)


def centred_true_logit(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) logit of each target minus the mean logit over the vocabulary."""
    return true_logit(logits, targets) - logits.mean(dim=-1)


register_token_value("loss", token_cross_entropy)
register_token_value("true-logit", true_logit)
register_token_value("centred-true-logit", centred_true_logit)


def causal_pairs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None):
    """Shift for next-token prediction: (logits[:, :-1], targets[:, 1:], keep (B, T-1) or None).

    ``mask`` (B, T) marks real tokens; a pair is kept when the predicting and the predicted
    token are both real. ``None`` keeps every pair.
    """
    keep = None if mask is None else (mask[:, 1:].bool() & mask[:, :-1].bool())
    return logits[:, :-1], targets[:, 1:], keep


def causal_targets(targets: torch.Tensor, mask: torch.Tensor | None = None):
    """:func:`causal_pairs`' targets and keep, (B, T) each, without slicing the logits: position
    t's target is token t + 1, the last position's is -100 (ignored) and it is not kept. The
    values and reductions of :func:`token_values` over the whole logits are those over the
    pairs; the backward of a slice of the (B, T, V) logits would write them whole twice."""
    last = targets.new_full((targets.shape[0], 1), -100)
    keep = None if mask is None else torch.cat([mask[:, 1:].bool() & mask[:, :-1].bool(),
                                                 mask.new_zeros((mask.shape[0], 1), dtype=torch.bool)], 1)
    return torch.cat([targets[:, 1:], last], 1), keep


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None = None, *,
            reduction: str = "sequence") -> torch.Tensor:
    """Token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T) at the ``keep`` positions.

    reduction:
        ``"none"``: (B, T), 0 outside ``keep``; ``"sequence"``: each sequence's mean (B,);
        ``"sequence-sum"``: each sequence's sum (B,); ``"sum"`` / ``"mean"``: over every
        kept token of the batch, a scalar.
    ``keep=None`` keeps every position whose target is not ``-100``.
    """
    if reduction in ("sum", "mean"):
        if keep is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)
        return F.cross_entropy(logits[keep], targets[keep], reduction=reduction)
    return _reduce(token_cross_entropy(logits, targets), targets, keep, reduction)


def token_values(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None = None, *,
                 value: str = "loss", reduction: str = "sequence") -> torch.Tensor:
    """The registered value ``value`` (:data:`TOKEN_VALUES`) of the true token at the ``keep``
    positions, reduced as :func:`lm_loss` reduces (``"none"``, ``"sequence"`` or ``"sequence-sum"``).

    ``"loss"`` is :func:`lm_loss`; ``"true-logit"`` is ``logits[b, t, targets[b, t]]``;
    ``"centred-true-logit"`` subtracts ``logits[b, t].mean()``. Shapes as for :func:`lm_loss`.
    """
    values = TOKEN_VALUES.get_one(value, func="token_values")(logits, targets)  # (B, T)
    values = torch.where(targets == -100, torch.zeros((), dtype=values.dtype, device=values.device), values)
    return _reduce(values, targets, keep, reduction)


def _reduce(values: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor | None, reduction: str) -> torch.Tensor:
    """(B, T) per-token values, 0 where the target is -100 -> "none" (B, T), "sequence-sum" or "sequence" (B,)."""
    if keep is not None:
        values = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if reduction == "none":
        return values
    if reduction == "sequence-sum":
        return values.sum(1)
    count = keep.sum(1) if keep is not None else (targets != -100).sum(1)
    return values.sum(1) / count.to(values.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real tokens: x (B, T, d), mask (B, T) (bool or 0/1; None: all real) -> (B, d).

    A sequence with no real token gives 0 rather than NaN.
    """
    if mask is None:
        return x.mean(dim=1)
    w = mask.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
    return (x * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i W^T, y_i) with both gradients formed in the forward pass, ``chunk`` rows at a
    time, so the (N, V) logits are never held whole: each chunk's logits become its softmax in
    place (one exp pass; the loss is max + log(sum) - true logit), then ``g = p - onehot``, then
    ``dh = g W`` and ``dW += g^T h``."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk):
        loss = h.new_zeros(())
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight)
        for i in range(0, h.shape[0], chunk):
            x, y = h[i:i + chunk], targets[i:i + chunk]
            logits = x @ weight.T  # (c, V)
            true = logits.gather(1, y[:, None]).squeeze(1)
            top = logits.amax(dim=-1, keepdim=True)
            probs = logits.sub_(top).exp_()  # one exp pass: softmax numerators, then their sum
            total = probs.sum(dim=-1, keepdim=True)
            loss += (top.squeeze(1) + total.log().squeeze(1) - true).sum()
            probs.div_(total)
            probs[torch.arange(len(y), device=y.device), y] -= 1
            torch.mm(probs, weight, out=grad_h[i:i + chunk])
            grad_w.addmm_(probs.T, x)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad, grad_w * grad, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int = 256) -> torch.Tensor:
    """The summed token cross-entropy of the logits ``h @ weight.T`` against ``targets``, without
    the (N, V) logits: h (N, d), weight (V, d) (an LM head), targets (N,) ids (no ignored ones)
    -> a scalar. Equals ``lm_loss(h @ weight.T, targets, reduction="sum")`` and its gradients (to
    float rounding: tests/test_core.py compares them in float64). For a small model on CPU the
    V-wide logits' memory traffic (softmax, its backward, the zero-filled NLL gradient) costs as
    much as the head's matmuls; chunks of ``chunk`` rows stay in cache (benchmarks/bench_training.py).
    Gradients are formed whether or not they are asked for: a training-only path."""
    return _LinearCrossEntropy.apply(h, weight, targets, chunk)
