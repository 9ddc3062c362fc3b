"""Evaluation: test perplexity per domain, linear probes on frozen embeddings, and the
results table in the shape of the CSE paper's Tables 1-2.

- Perplexity: ``exp`` of the mean token loss over the test blocks of each domain (GPT:
  next token; BERT: the masked tokens of a seeded masking, as in training). A DEMix model
  is evaluated without labels, by its posterior mixture with a cached prior (the mean
  posterior over validation blocks; :mod:`cse_models.demix`); a DEMix model embeds a probe
  item with the expert of its most probable domain under that posterior.
- Probes: the pack's held-out probe sets stand in for the paper's downstream tasks
  (Overruling/CaseHOLD -> licence category, GAD/EU-ADR -> GO ontology / HPO organ system,
  SST-2 -> WordNet lexname). Each item is embedded by the frozen model (mean of the final
  hidden states over its tokens); a scikit-learn logistic regression is trained on a
  stratified split and scored on the rest, over several seeds: accuracy mean and std.

Command: ``cse-eval NAME=CHECKPOINT ... [--pack DIR] [--out results.csv]``; with ``--data ROWS
--label-column COL --out DIR``, perplexity per domain and routing on the user's rows
(:mod:`cse_models.domains`, as ``ntkscope eval``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from cse_models.data import Blocks, mask_tokens, pack_blocks, step_generator
from cse_models.demix import DomainPrior, estimate_prior, mixture_log_probs, sequence_posterior
from cse_models.experts import sequence_embedding
from cse_models.domains import evaluate_domains
from cse_models.hf import load_any_model
from cse_models.model import load_model
from ntkscope.core.checks import UserError
from ntkscope.core.files import Staging, write_table
from ntkscope.core.lm import causal_pairs, lm_loss
from ntkscope.core.memory import training_thresholds
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.inputs import DataSource
from ntkscope.text.tokenization import load_tokenizer
from ntkscope.text.trained_with import tokenizer_near
from ntkscope.text.sentences import encode_texts

log = logging.getLogger(__name__)

#: The paper's task each probe task stands in for.
STANDS_IN_FOR = {
    "legal-licence-category": "Overruling / CaseHOLD",
    "biomedical-go-ontology": "GAD / EU-ADR",
    "clinical-hpo-organ-system": "GAD / EU-ADR",
    "general-wordnet-lexname": "SST-2",
}


def is_demix(model) -> bool:
    """Whether ``model`` holds DEMix layers (scored by its label-free mixture of experts)."""
    return model.config.sparse is not None and model.config.sparse.kind == "demix"


def _masking(model, seed: int, purpose: str, special_ids=()):
    """A BERT's seeded masking of the batch starting at ``start``, ``(ids, start) -> (inputs, labels)``
    on the model's device; None for a causal model."""
    if model.config.model_type != "bert":
        return None
    device = next(model.parameters()).device

    def mask(ids, start):
        inputs, labels = mask_tokens(ids.cpu(), mask_token_id=model.config.mask_token_id,
                                     vocab_size=model.config.vocab_size,
                                     generator=step_generator(seed, start, purpose), special_ids=special_ids)
        return inputs.to(device), labels.to(device)
    return mask


@torch.no_grad()
def block_losses(model, blocks: Blocks, *, batch_size: int = 32, seed: int = 0, special_ids=(),
                 prior: DomainPrior | None = None, routes: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed token loss and token count of every block: (N,), (N,). A DEMix model is scored by its
    label-free mixture under ``prior`` (its P(D), default uniform), or, given ``routes`` (N,), with
    each block sent to that expert (a fixed assignment, :mod:`cse_models.routes`)."""
    model.eval()
    training_thresholds()  # forward passes, no budget: not under a kernel's 1 MiB malloc threshold
    device = next(model.parameters()).device
    masking = _masking(model, seed, "eval-mask", special_ids)
    routed = routes is not None and is_demix(model)
    sums, counts = [], []
    for start in range(0, len(blocks), batch_size):
        ids = blocks.input_ids[start:start + batch_size].to(device)
        experts = routes[start:start + batch_size].to(device) if routed else None
        if masking is not None:
            inputs, labels = masking(ids, start)
            if is_demix(model) and not routed:  # the masked tokens' marginal likelihood under the prior
                loglik, _ = sequence_posterior(model, inputs, None, prior, labels)
                sums.append(-loglik.cpu())
            else:
                sums.append(lm_loss(model(inputs, None, experts).float(), labels, reduction="sequence-sum").cpu())
            counts.append((labels != -100).sum(1).cpu())
            continue
        if is_demix(model) and not routed:
            logp, _ = mixture_log_probs(model, ids, prior=prior)
            nll = -logp
        else:
            logits, targets, _ = causal_pairs(model(ids, None, experts).float(), ids)
            nll = lm_loss(logits, targets, reduction="none")  # (B, T-1)
        sums.append(nll.sum(1).cpu())
        counts.append(torch.full((len(ids),), nll.shape[1]))
    return torch.cat(sums).double().numpy(), torch.cat(counts).numpy()


def demix_prior(model, blocks: Blocks, *, n: int = 256, seed: int = 0, special_ids=()) -> DomainPrior:
    """DEMix's cached prior: the mean posterior over ``n`` held-out blocks (a seeded draw)."""
    idx = torch.randperm(len(blocks), generator=step_generator(seed, 0, "prior"))[:n]
    device = next(model.parameters()).device
    return estimate_prior(model.eval(), blocks.input_ids[idx].to(device),
                          masking=_masking(model, seed, "prior-mask", special_ids))


def perplexity_by_domain(model, blocks: Blocks, **kw) -> pd.DataFrame:
    """Columns: domain, blocks, tokens, loss, perplexity (plus an ``all`` row)."""
    return domain_table(blocks, *block_losses(model, blocks, **kw))


def domain_table(blocks: Blocks, sums: np.ndarray, counts: np.ndarray) -> pd.DataFrame:
    """:func:`perplexity_by_domain`'s table from :func:`block_losses`' per-block sums and counts (N,)."""
    rows = []
    for j, name in enumerate(blocks.domain_names):
        keep = blocks.domains.numpy() == j
        rows.append((name, int(keep.sum()), int(counts[keep].sum()), sums[keep].sum() / counts[keep].sum()))
    rows.append(("all", len(blocks), int(counts.sum()), sums.sum() / counts.sum()))
    frame = pd.DataFrame(rows, columns=["domain", "blocks", "tokens", "loss"])
    frame["perplexity"] = np.exp(frame["loss"])
    return frame


@torch.no_grad()
def embed_texts(model, tokenizer, texts, *, batch_size: int = 64, prior: DomainPrior | None = None,
                seed: int = 0) -> np.ndarray:
    """Mean-pooled final hidden states of each text (truncated to the block size): (n, d). A DEMix
    model embeds each text with the expert of its most probable domain (posterior from ``prior``)."""
    model.eval()
    training_thresholds()  # forward passes, no budget: not under a kernel's 1 MiB malloc threshold
    device = next(model.parameters()).device
    texts = list(texts)
    out = []
    masking = _masking(model, seed, "embed-mask", tuple(tokenizer.special_ids))
    for start in range(0, len(texts), batch_size):
        batch = encode_texts(tokenizer, texts[start:start + batch_size], model.config.block_size)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        doms = None
        if is_demix(model):
            inputs, labels = (ids, None) if masking is None else masking(ids, start)
            if labels is not None:
                labels = labels.masked_fill(~mask.bool(), -100)
            doms = sequence_posterior(model, inputs, mask, prior, labels)[1].argmax(dim=1)
        h = model.hidden_states(ids, mask, doms)
        out.append(sequence_embedding(h, mask.bool()).float().cpu())
    return torch.cat(out).numpy()


def _probe_tasks(probes: pd.DataFrame):
    """(task, items) per probe task, in name order, without labels that have one item (no stratified split)."""
    for task, items in probes.groupby("task", sort=True):
        counts = items["label"].value_counts()
        yield task, items[items["label"].isin(counts.index[counts >= 2])]


def probe_scores(model, tokenizer, probes: pd.DataFrame, *, seeds=(0, 1, 2, 3, 4), test_size: float = 0.4,
                 prior: DomainPrior | None = None) -> pd.DataFrame:
    """Linear probes per task and seed: columns task, seed, accuracy (a stratified split per seed,
    a scikit-learn logistic regression on standardised frozen embeddings). The fits use one BLAS
    thread: L-BFGS stops at a tolerance, so its solution (and an item or two of a test split)
    would otherwise follow the machine's thread count; on these small problems one thread is
    also about twice as fast as two."""
    rows = []
    for task, items in _probe_tasks(probes):
        x = embed_texts(model, tokenizer, items["text"].tolist(), prior=prior)
        y = items["label"].to_numpy()
        for seed in seeds:
            x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, stratify=y, random_state=seed)
            clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
            with threadpool_limits(1, user_api="blas"):
                rows.append((task, seed, float(clf.fit(x_tr, y_tr).score(x_te, y_te))))
    return pd.DataFrame(rows, columns=["task", "seed", "accuracy"])


def probe_accuracy(model, tokenizer, probes: pd.DataFrame, *, seeds=(0, 1, 2, 3, 4), test_size: float = 0.4,
                   prior: DomainPrior | None = None) -> pd.DataFrame:
    """Linear probes per task: columns task, stands_in_for, items, classes, accuracy_mean, accuracy_std."""
    scores = probe_scores(model, tokenizer, probes, seeds=seeds, test_size=test_size, prior=prior)
    rows = []
    for task, items in _probe_tasks(probes):
        acc = scores.loc[scores["task"] == task, "accuracy"]
        rows.append((task, STANDS_IN_FOR.get(task, ""), len(items), items["label"].nunique(), float(acc.mean()),
                     float(np.std(acc))))
    return pd.DataFrame(rows, columns=["task", "stands_in_for", "items", "classes", "accuracy_mean", "accuracy_std"])


def at_most_per_domain(blocks: Blocks, n: int | None) -> Blocks:
    """At most ``n`` blocks of each domain (the first ones), or all when ``n`` is None."""
    if n is None:
        return blocks
    keep = torch.cat([(blocks.domains == j).nonzero().squeeze(1)[:n] for j in range(len(blocks.domain_names))])
    keep = keep.sort().values
    return Blocks(blocks.input_ids[keep], blocks.domains[keep], blocks.domain_names)


def evaluate_model(model, pack, *, seq_len: int | None = None, seeds=(0, 1, 2, 3, 4), max_blocks: int | None = None,
                   max_items: int | None = None) -> dict:
    """Everything the tables show of one model, as plain numbers: ``perplexity`` (test, all
    domains), ``ppl DOMAIN``, ``acc TASK`` (mean over probe seeds), ``acc TASK seed K``,
    ``average`` (of the task means), and for DEMix its cached ``prior DOMAIN``. ``max_blocks``
    test blocks per domain and ``max_items`` probe items per task (a seeded draw) at most: for
    smoke runs; None: all."""
    tokenizer = pack.tokenizer()
    special = tuple(tokenizer.special_ids)
    prior = None
    out = {}
    if is_demix(model):
        held_out = pack_blocks(pack, tokenizer, "validation", seq_len or model.config.block_size)
        prior = demix_prior(model, held_out, special_ids=special)
        out.update({f"prior {d}": float(p) for d, p in zip(model.config.sparse.domains, prior.probs)})
    blocks = at_most_per_domain(pack_blocks(pack, tokenizer, "test", seq_len or model.config.block_size), max_blocks)
    ppl = perplexity_by_domain(model, blocks, special_ids=special, prior=prior)
    out["perplexity"] = float(ppl.set_index("domain").loc["all", "perplexity"])
    out.update({f"ppl {d}": float(p) for d, p in zip(ppl.domain, ppl.perplexity) if d != "all"})
    probes = pack.probes()
    if max_items is not None:
        probes = probes.sample(frac=1.0, random_state=0).groupby("task", sort=True).head(max_items)
    scores = probe_scores(model, tokenizer, probes, seeds=seeds, prior=prior)
    means = scores.groupby("task", sort=True)["accuracy"].mean()
    out.update({f"acc {t}": float(m) for t, m in means.items()})
    out.update({f"acc {t} seed {s}": a for t, s, a in scores.itertuples(index=False)})
    out["average"] = float(means.mean())
    return out


def results_table(runs: dict, pack=None, *, seq_len: int | None = None, seeds=(0, 1, 2, 3, 4),
                  max_blocks: int | None = None, max_items: int | None = None) -> pd.DataFrame:
    """The paper's Tables 1-2: a row per run (``{name: checkpoint dir or model}``); columns the
    test perplexity (all domains and per domain), each probe's accuracy, and their average
    (``max_blocks``, ``max_items``: :func:`evaluate_model`'s)."""
    pack = pack if pack is not None and not isinstance(pack, str) else load_pack(pack)
    rows = []
    for name, run in runs.items():
        model = load_model(run) if not isinstance(run, torch.nn.Module) else run
        found = evaluate_model(model, pack, seq_len=seq_len, seeds=seeds, max_blocks=max_blocks, max_items=max_items)
        row = {"model": name, "perplexity": found["perplexity"]}
        row.update({k: v for k, v in found.items() if k.startswith("ppl ")})
        for key in sorted(k for k in found if k.startswith("acc ") and " seed " not in k):
            per_seed = [found[f"{key} seed {s}"] for s in seeds]
            row[key[4:]] = f"{np.mean(per_seed):.3f} ± {np.std(per_seed):.3f}"
        row["average"] = found["average"]
        rows.append(row)
        log.info("evaluated %s: perplexity %.2f, probe average %.3f", name, row["perplexity"], row["average"])
    return pd.DataFrame(rows)


def _tokenizer_of(checkpoint: Path, spec=None):
    """``spec``, else the tokenizer the checkpoint goes with, else the shipped pack's BPE."""
    return load_tokenizer(spec) if spec else tokenizer_near(checkpoint) or load_pack().tokenizer()


def domains_tables(runs: dict, data, *, text_column: str = "text", label_column: str | None = None,
                   tokenizer=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-domain perplexity and routing (:mod:`cse_models.domains`) of each NAME=CHECKPOINT on
    the user's rows (``data`` read as ``ntkscope --data`` reads it), with a ``name`` column."""
    source = DataSource(Path(data), text_column, label_column)
    rows = source.rows("test") if source.kind == "pack" else source.rows()
    texts, labels = [t for t, _ in rows], [label for _, label in rows]
    ppl, routing = [], []
    for name, path in runs.items():
        ids = _tokenizer_of(Path(path), tokenizer).encode(texts)
        result = evaluate_domains(load_any_model(path), ids, labels)
        ppl.append(result.perplexity.assign(name=name))
        routing.append(result.routing.assign(name=name))
    return pd.concat(ppl, ignore_index=True), pd.concat(routing, ignore_index=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cse-eval", description="Evaluate checkpoints: test perplexity per "
                                     "domain and linear probes, as one results table; or, with --data, perplexity "
                                     "per domain and routing on your own rows (as ntkscope eval).")
    parser.add_argument("runs", nargs="+", help="NAME=CHECKPOINT_DIR")
    parser.add_argument("--pack", help="corpus pack (default: the shipped one)")
    parser.add_argument("--seeds", type=int, default=5, help="probe seeds (default 5)")
    parser.add_argument("--data", help="your rows: a .jsonl/.csv/.tsv/.parquet table, a datasets directory or a pack")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", help="the domain of each row")
    parser.add_argument("--tokenizer", help="--data: default the checkpoint's (in or beside it) or its run's")
    parser.add_argument("--out", help="write the table to this .csv or .parquet; with --data, a directory for "
                        "perplexity.csv and routing.csv")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        runs = dict(r.split("=", 1) if "=" in r else (r, r) for r in args.runs)
        if args.data:
            table, routing = domains_tables(runs, args.data, text_column=args.text_column,
                                            label_column=args.label_column, tokenizer=args.tokenizer)
        else:
            table = results_table(runs, args.pack, seeds=tuple(range(args.seeds)))
    except UserError as err:  # the user's mistake: one line; anything else keeps its traceback
        print(f"cse-eval: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.out and args.data:
        with Staging(args.out) as files:
            write_table(table, files.path("perplexity.csv"))
            if len(routing):
                write_table(routing, files.path("routing.csv"))
    elif args.out:
        write_table(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
