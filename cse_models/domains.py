"""Evaluation on the user's own domains: perplexity per domain over whole texts, with intervals
over texts, and where each domain is routed, per sparse layer, in eval mode.

Perplexity of a domain is ``exp`` of the mean next-token negative log-likelihood over all real
next-token pairs of the domain's texts; each text is encoded as its tokenizer encodes it, with no
tokens added, and truncated to the model's context (a text of one token has no pair and adds
nothing). A masked LM (our BERT, an HF BERT / RoBERTa, converted or not) is scored on the masked
tokens instead: BERT's masking (:func:`cse_models.data.mask_tokens`, 15 % of the tokens) of each
text alone, seeded by the text's tokens, so a text is masked the same way in every batch, every
model and every ablation. The interval is a percentile bootstrap over the domain's texts (the ratio of summed
NLL to summed pairs in each resample). A DEMix model is scored by its label-free posterior
mixture (uniform prior, :func:`cse_models.demix.mixture_log_probs`).

Routing (CSE and Switch layers): a CSE layer sends a *sequence* to one expert; a Switch layer
sends each real *token* to its router's top-1 expert (before capacity drops it). The table has one
row per (layer, expert, domain): the count, its share of the domain's units at that layer and its
share of the expert's. Works on :class:`~cse_models.TransformerLM`, :class:`~cse_models.SparseHF`
and any ``transformers`` causal or masked LM (dense: no routing rows).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from cse_models.data import mask_tokens
from cse_models.demix import mixture_log_probs
from cse_models.experts import CSELayer, DEMixLayer, SwitchFFN
from cse_models.hf import SparseHF
from cse_models.model import TransformerLM
from ntkscope.core.checks import UserError, fail

log = logging.getLogger(__name__)

PERPLEXITY_COLUMNS = ["domain", "texts", "tokens", "nll", "ppl", "ppl_low", "ppl_high"]
ROUTING_COLUMNS = ["layer", "expert", "domain", "unit", "count", "share_of_domain", "share_of_expert"]


@dataclass(frozen=True)
class DomainEvaluation:
    """``perplexity``: one row per domain (:data:`PERPLEXITY_COLUMNS`; ``tokens`` = the tokens
    scored: next-token pairs, or a masked LM's masked tokens); ``routing``: one row per (sparse layer, expert, domain) (:data:`ROUTING_COLUMNS`),
    empty for a dense model; ``context``: the length texts were truncated to; ``level``: the
    intervals' coverage."""

    perplexity: pd.DataFrame
    routing: pd.DataFrame
    context: int
    level: float


def context_length(model) -> int:
    """The longest input the model takes."""
    if isinstance(model, (TransformerLM, SparseHF)):
        return int(model.config.block_size)
    config = model.config
    for key in ("max_position_embeddings", "n_positions"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise UserError(f"evaluate_domains: cannot tell the context length of a {type(model).__name__}")


def is_masked(model) -> bool:
    """A masked LM: our BERT, a :class:`~cse_models.SparseHF` around a ``*ForMaskedLM``, or a
    ``transformers`` ``*ForMaskedLM``."""
    if isinstance(model, (TransformerLM, SparseHF)):
        return model.config.model_type == "bert"
    return "MaskedLM" in type(model).__name__


def check_lm(model, func: str = "evaluate_domains") -> None:
    """Refuse what is not a causal or masked LM this module scores."""
    name = type(model).__name__
    if not isinstance(model, (TransformerLM, SparseHF)) and not any(k in name for k in ("CausalLM", "LMHead",
                                                                                         "MaskedLM")):
        raise UserError(f"{func}: model must be a causal or masked LM (got {name})")
    if is_masked(model):
        if getattr(model.config, "mask_token_id", None) is None:
            raise UserError(f"{func}: the masked LM's mask token is unknown (its config has no mask_token_id; put its "
                            "tokenizer.json beside the weights)")
        if any(isinstance(m, DEMixLayer) for m in model.modules()):
            raise UserError(f"{func}: a masked DEMix model is scored by its label-free mixture in cse-eval (the "
                            "masked tokens' marginal likelihood), not here")


def _logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(ids, mask) if isinstance(model, (TransformerLM, SparseHF)) else \
        model(input_ids=ids, attention_mask=mask).logits


def _masked_inputs(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) (B, T): each text's real tokens masked alone, seeded by its tokens
    (module docstring); labels -100 where nothing is predicted."""
    inputs, labels = ids.clone(), torch.full_like(ids, -100)
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        text = ids[r, :n].cpu()
        seed = zlib.crc32(text.numpy().astype("<i8").tobytes())
        masked, target = mask_tokens(text, mask_token_id=int(model.config.mask_token_id),
                                     vocab_size=int(model.config.vocab_size),
                                     generator=torch.Generator().manual_seed(seed))
        inputs[r, :n], labels[r, :n] = masked.to(ids.device), target.to(ids.device)
    return inputs, labels


def scored_log_probs(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each scored token, which tokens are scored), both (B, T') in float64, zero where
    not scored: a causal model's next tokens (T' = T - 1, log p(x_t | x_<t) at real pairs; a
    DEMix model by its mixture), or a masked model's masked tokens (T' = T, module docstring)."""
    if is_masked(model):
        inputs, labels = _masked_inputs(model, ids, mask)
        logp = F.log_softmax(_logits(model, inputs, mask).double(), dim=-1)
        scored = (labels != -100).double()
        return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * scored, scored
    scored = mask[:, 1:].double()
    if any(isinstance(m, DEMixLayer) for m in model.modules()):
        return mixture_log_probs(model, ids, mask)[0].double() * scored, scored
    logp = F.log_softmax(_logits(model, ids, mask)[:, :-1].double(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) * scored, scored


class RoutingRecorder:
    """Forward hooks on the CSE / Switch layers: the expert each sequence (CSE) or real token
    (Switch) is sent to, per batch."""

    def __init__(self, model):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, (CSELayer, SwitchFFN))}
        self.batch: dict[str, torch.Tensor] = {}
        self.hooks = [m.register_forward_hook(self._hook(name)) for name, m in self.layers.items()]

    def _hook(self, name):
        def hook(module, args, _out):
            x, key_mask = args[0], (args[1] if len(args) > 1 else None)
            if isinstance(module, CSELayer):
                self.batch[name] = module.route(x, key_mask)[1].cpu()
            else:  # per token (B, T); padding -1
                choice = module.router(x).argmax(-1)
                self.batch[name] = choice.masked_fill(~key_mask.bool(), -1).cpu() if key_mask is not None \
                    else choice.cpu()
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def padded_batches(texts: list, batch_size: int):
    """Yield (rows, ids (B, T), mask (B, T)) over the texts (lists of token ids) of two tokens or
    more, shortest first, right-padded with 0 to the batch's longest; ``rows`` index ``texts``."""
    order = [i for i in np.argsort([len(t) for t in texts], kind="stable") if len(texts[i]) > 1]
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        T = max(len(texts[i]) for i in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, :len(texts[i])] = torch.tensor(texts[i])
            mask[r, :len(texts[i])] = 1
        yield rows, ids, mask


def _bootstrap(nll: np.ndarray, pairs: np.ndarray, n_boot: int, level: float, rng) -> tuple[float, float]:
    if len(nll) < 2:
        return float("nan"), float("nan")
    idx = rng.integers(0, len(nll), (n_boot, len(nll)))
    ppl = np.exp(nll[idx].sum(1) / np.maximum(pairs[idx].sum(1), 1))
    tail = (1 - level) / 2 * 100
    return float(np.percentile(ppl, tail)), float(np.percentile(ppl, 100 - tail))


@torch.no_grad()
def evaluate_domains(model, token_ids: Sequence[Sequence[int]], labels: Sequence[str], *, batch_size: int = 16,
                     n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> DomainEvaluation:
    """Per-domain perplexity and routing of ``token_ids`` (one list of ids per text, as the
    tokenizer encodes it, no tokens added) labelled ``labels`` (one domain per text). The model is
    put in eval mode for the call and left as it was."""
    if len(token_ids) != len(labels) or not len(labels):
        raise UserError(f"evaluate_domains: token_ids and labels must be non-empty and of one length "
                        f"(got {len(token_ids)} and {len(labels)})")
    unlabelled = next((i for i, label in enumerate(labels) if not isinstance(label, str)), None)
    if unlabelled is not None:  # a missing label (None, NaN) would otherwise be sorted among the names
        raise fail("evaluate_domains", "labels", f"must be strings, one domain per text; text {unlabelled + 1} has "
                   "none", labels[unlabelled])
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"evaluate_domains: batch_size must be a positive integer (got {batch_size!r})")
    if not 0 < level < 1 or n_boot < 1:
        raise UserError(f"evaluate_domains: need 0 < level < 1 and n_boot >= 1 (got {level}, {n_boot})")
    check_lm(model)
    context = context_length(model)
    texts = [list(ids)[:context] for ids in token_ids]
    names = sorted(set(labels))
    domain = np.array([names.index(label) for label in labels])
    device = next(model.parameters()).device
    nll, pairs = np.zeros(len(texts)), np.zeros(len(texts), dtype=np.int64)
    recorder = RoutingRecorder(model)
    counts = {name: {} for name in recorder.layers}
    was_training = model.training
    model.eval()
    try:
        for rows, ids, mask in padded_batches(texts, batch_size):
            recorder.batch.clear()
            logp, scored = (t.cpu() for t in scored_log_probs(model, ids.to(device), mask.to(device)))
            nll[rows], pairs[rows] = -logp.sum(1).numpy(), scored.sum(1).numpy().astype(np.int64)
            for name, assign in recorder.batch.items():
                doms = torch.as_tensor(domain[rows])
                if assign.dim() == 2:  # Switch: tokens
                    doms, assign = doms[:, None].expand_as(assign)[assign >= 0], assign[assign >= 0]
                for (e, d), c in zip(*np.unique(np.stack([assign.numpy(), doms.numpy()], 1), axis=0,
                                               return_counts=True)):
                    counts[name][(int(e), int(d))] = counts[name].get((int(e), int(d)), 0) + int(c)
    finally:
        recorder.remove()
        model.train(was_training)
    skipped = int((pairs == 0).sum())
    if skipped:
        log.info("evaluate_domains: %d texts have no scored token (one token: no next-token pair; a masked LM: "
                 "none masked)", skipped)
    rng = np.random.default_rng(seed)
    rows = []
    for d, name in enumerate(names):
        keep = domain == d
        total_nll, total_pairs = float(nll[keep].sum()), int(pairs[keep].sum())
        mean = total_nll / total_pairs if total_pairs else float("nan")
        low, high = _bootstrap(nll[keep], pairs[keep], n_boot, level, rng)
        rows.append({"domain": name, "texts": int(keep.sum()), "tokens": total_pairs, "nll": mean,
                     "ppl": float(np.exp(mean)), "ppl_low": low, "ppl_high": high})
    return DomainEvaluation(pd.DataFrame(rows, columns=PERPLEXITY_COLUMNS),
                            _routing_frame(recorder, counts, names), context, level)


def _routing_frame(recorder: RoutingRecorder, counts: dict, names: list) -> pd.DataFrame:
    rows = []
    for layer, module in recorder.layers.items():
        unit = "sequences" if isinstance(module, CSELayer) else "tokens"
        table = np.zeros((len(module.experts), len(names)), dtype=np.int64)
        for (e, d), c in counts[layer].items():
            table[e, d] = c
        by_domain, by_expert = table.sum(0), table.sum(1)
        for e in range(table.shape[0]):
            for d, name in enumerate(names):
                rows.append({"layer": layer, "expert": e, "domain": name, "unit": unit, "count": int(table[e, d]),
                             "share_of_domain": table[e, d] / by_domain[d] if by_domain[d] else float("nan"),
                             "share_of_expert": table[e, d] / by_expert[e] if by_expert[e] else float("nan")})
    return pd.DataFrame(rows, columns=ROUTING_COLUMNS)


def routing_table(model, token_ids: Sequence[Sequence[int]], labels: Sequence[str], **kw) -> pd.DataFrame:
    """Where each domain is routed: :attr:`DomainEvaluation.routing` of :func:`evaluate_domains`."""
    return evaluate_domains(model, token_ids, labels, n_boot=1, **kw).routing
