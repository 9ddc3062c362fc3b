"""The language-model loss and the mean over real tokens: each rule written once.

Used by training and evaluation (``cse_models``), by the kernel's ``output="loss"`` and by
the demo. Shapes: ``logits`` (B, T, V), ``targets`` (B, T) token ids, ``keep`` (B, T) bool.

- Causal LM: position t predicts token t + 1; a pair counts when both tokens are real
  (:func:`causal_pairs` shifts the three tensors).
- Masked LM: the masked positions count; targets elsewhere may be ``-100``
  (``F.cross_entropy``'s ignore index), as :func:`cse_models.data.mask_tokens` writes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("none", "sequence", "sequence-sum", "sum", "mean")


def causal_pairs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None):
    """Shift for next-token prediction: (logits[:, :-1], targets[:, 1:], keep (B, T-1) or None).

    ``mask`` (B, T) marks real tokens; a pair is kept when the predicting and the predicted
    token are both real. ``None`` keeps every pair.
    """
    keep = None if mask is None else (mask[:, 1:] & mask[:, :-1])
    return logits[:, :-1], targets[:, 1:], keep


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
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T); 0 where target is -100
    if keep is not None:
        nll = torch.where(keep, nll, torch.zeros((), dtype=nll.dtype, device=nll.device))
    if reduction == "none":
        return nll
    if reduction == "sequence-sum":
        return nll.sum(1)
    count = keep.sum(1) if keep is not None else (targets != -100).sum(1)
    return nll.sum(1) / count.to(nll.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over real tokens: x (B, T, d), mask (B, T) (bool or 0/1; None: all real) -> (B, d).

    A sequence with no real token gives 0 rather than NaN.
    """
    if mask is None:
        return x.mean(dim=1)
    w = mask.to(x.dtype).unsqueeze(-1)  # (B, T, 1)
    return (x * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
