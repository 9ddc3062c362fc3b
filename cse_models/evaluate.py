"""Evaluation: test perplexity per domain, linear probes on frozen embeddings, and the
results table in the shape of the CSE paper's Tables 1-2.

- Perplexity: ``exp`` of the mean token loss over the test blocks of each domain (GPT:
  next token; BERT: the masked tokens of a seeded masking, as in training). A DEMix model
  is evaluated without labels, by its posterior mixture (uniform prior).
- Probes: the pack's held-out probe sets stand in for the paper's downstream tasks
  (Overruling/CaseHOLD -> licence category, GAD/EU-ADR -> GO ontology / HPO organ system,
  SST-2 -> WordNet lexname). Each item is embedded by the frozen model (mean of the final
  hidden states over its tokens); a scikit-learn logistic regression is trained on a
  stratified split and scored on the rest, over several seeds: accuracy mean and std.

Command: ``cse-eval NAME=CHECKPOINT ... [--pack DIR] [--out results.csv]``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from cse_models.data import Blocks, mask_tokens, pack_blocks, step_generator
from cse_models.demix import mixture_log_probs
from cse_models.experts import sequence_embedding
from cse_models.model import load_model
from ntkscope.core.files import write_table
from ntkscope.core.lm import causal_pairs, lm_loss
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.sentences import encode_texts

log = logging.getLogger(__name__)

#: The paper's task each probe task stands in for.
STANDS_IN_FOR = {
    "legal-licence-category": "Overruling / CaseHOLD",
    "biomedical-go-ontology": "GAD / EU-ADR",
    "clinical-hpo-organ-system": "GAD / EU-ADR",
    "general-wordnet-lexname": "SST-2",
}


def _is_demix(model) -> bool:
    return model.config.sparse is not None and model.config.sparse.kind == "demix"


@torch.no_grad()
def block_losses(model, blocks: Blocks, *, batch_size: int = 32, seed: int = 0, special_ids=()) -> tuple[np.ndarray, np.ndarray]:
    """Summed token loss and token count of every block: (N,), (N,)."""
    model.eval()
    device = next(model.parameters()).device
    sums, counts = [], []
    for start in range(0, len(blocks), batch_size):
        ids = blocks.input_ids[start:start + batch_size].to(device)
        if model.config.model_type == "bert":
            inputs, labels = mask_tokens(ids.cpu(), mask_token_id=model.config.mask_token_id,
                                         vocab_size=model.config.vocab_size,
                                         generator=step_generator(seed, start, "eval-mask"), special_ids=special_ids)
            doms = torch.zeros(len(ids), dtype=torch.long, device=device)
            logits = model(inputs.to(device), None, doms if _is_demix(model) else None)
            keep = labels.to(device) != -100
            sums.append(lm_loss(logits.float(), labels.to(device), reduction="sequence-sum").cpu())
            counts.append(keep.sum(1).cpu())
            continue
        if _is_demix(model):
            logp, _ = mixture_log_probs(model, ids)
            nll = -logp
        else:
            logits, targets, _ = causal_pairs(model(ids).float(), ids)
            nll = lm_loss(logits, targets, reduction="none")  # (B, T-1)
        sums.append(nll.sum(1).cpu())
        counts.append(torch.full((len(ids),), nll.shape[1]))
    return torch.cat(sums).double().numpy(), torch.cat(counts).numpy()


def perplexity_by_domain(model, blocks: Blocks, **kw) -> pd.DataFrame:
    """Columns: domain, blocks, tokens, loss, perplexity (plus an ``all`` row)."""
    sums, counts = block_losses(model, blocks, **kw)
    rows = []
    for j, name in enumerate(blocks.domain_names):
        keep = blocks.domains.numpy() == j
        rows.append((name, int(keep.sum()), int(counts[keep].sum()), sums[keep].sum() / counts[keep].sum()))
    rows.append(("all", len(blocks), int(counts.sum()), sums.sum() / counts.sum()))
    frame = pd.DataFrame(rows, columns=["domain", "blocks", "tokens", "loss"])
    frame["perplexity"] = np.exp(frame["loss"])
    return frame


@torch.no_grad()
def embed_texts(model, tokenizer, texts, *, batch_size: int = 64) -> np.ndarray:
    """Mean-pooled final hidden states of each text (truncated to the block size): (n, d)."""
    model.eval()
    device = next(model.parameters()).device
    texts = list(texts)
    out = []
    for start in range(0, len(texts), batch_size):
        batch = encode_texts(tokenizer, texts[start:start + batch_size], model.config.block_size)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        doms = torch.zeros(len(ids), dtype=torch.long, device=device) if _is_demix(model) else None
        h = model.hidden_states(ids, mask, doms)
        out.append(sequence_embedding(h, mask.bool()).float().cpu())
    return torch.cat(out).numpy()


def probe_accuracy(model, tokenizer, probes: pd.DataFrame, *, seeds=(0, 1, 2, 3, 4), test_size: float = 0.4) -> pd.DataFrame:
    """Linear probes per task: columns task, stands_in_for, items, classes, accuracy_mean, accuracy_std."""
    rows = []
    for task, items in probes.groupby("task", sort=True):
        counts = items["label"].value_counts()
        items = items[items["label"].isin(counts.index[counts >= 2])]
        x = embed_texts(model, tokenizer, items["text"].tolist())
        y = items["label"].to_numpy()
        scores = []
        for seed in seeds:
            x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, stratify=y, random_state=seed)
            clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
            scores.append(clf.fit(x_tr, y_tr).score(x_te, y_te))
        rows.append((task, STANDS_IN_FOR.get(task, ""), len(items), int(pd.Series(y).nunique()),
                     float(np.mean(scores)), float(np.std(scores))))
    return pd.DataFrame(rows, columns=["task", "stands_in_for", "items", "classes", "accuracy_mean", "accuracy_std"])


def results_table(runs: dict, pack=None, *, seq_len: int | None = None, seeds=(0, 1, 2, 3, 4)) -> pd.DataFrame:
    """The paper's Tables 1-2: a row per run (``{name: checkpoint dir or model}``); columns the
    test perplexity (all domains and per domain), each probe's accuracy, and their average."""
    pack = pack if pack is not None and not isinstance(pack, str) else load_pack(pack)
    tokenizer = pack.tokenizer()
    probes = pack.probes()
    rows = []
    for name, run in runs.items():
        model = load_model(run) if not isinstance(run, torch.nn.Module) else run
        blocks = pack_blocks(pack, tokenizer, "test", seq_len or model.config.block_size)
        ppl = perplexity_by_domain(model, blocks, special_ids=tuple(tokenizer.special_ids))
        acc = probe_accuracy(model, tokenizer, probes, seeds=seeds)
        row = {"model": name, "perplexity": float(ppl.set_index("domain").loc["all", "perplexity"])}
        row.update({f"ppl {d}": float(p) for d, p in zip(ppl.domain, ppl.perplexity) if d != "all"})
        row.update({t: f"{m:.3f} ± {s:.3f}" for t, m, s in zip(acc.task, acc.accuracy_mean, acc.accuracy_std)})
        row["average"] = float(acc.accuracy_mean.mean())
        rows.append(row)
        log.info("evaluated %s: perplexity %.2f, probe average %.3f", name, row["perplexity"], row["average"])
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cse-eval", description="Evaluate checkpoints: test perplexity per "
                                     "domain and linear probes, as one results table.")
    parser.add_argument("runs", nargs="+", help="NAME=CHECKPOINT_DIR")
    parser.add_argument("--pack", help="corpus pack (default: the shipped one)")
    parser.add_argument("--seeds", type=int, default=5, help="probe seeds (default 5)")
    parser.add_argument("--out", help="write the table to this .csv or .parquet")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        runs = dict(r.split("=", 1) if "=" in r else (r, r) for r in args.runs)
        table = results_table(runs, args.pack, seeds=tuple(range(args.seeds)))
    except (ValueError, FileNotFoundError) as err:
        print(f"cse-eval: error: {err}", file=sys.stderr)
        return 1
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.out:
        write_table(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
