"""The command line of "your model, your data": ``ntkscope eval`` and ``ntkscope compare``
(argument parsing and printing only; the work is :func:`ntkscope.app.commands.eval_command` and
:func:`ntkscope.app.compare.compare_command`)."""

from __future__ import annotations

import argparse

from cse_models.data import LAYOUTS
from ntkscope.app import commands
from ntkscope.app.compare import compare_command
from ntkscope.app.parsing import (DATA_HELP, POSITIVE, POSITIVE_INT, add_column_args, add_out, print_table, ranged,
                                   source)


def _eval(args) -> int:
    r = commands.eval_command(args.checkpoint, source(args), tokenizer=args.tokenizer, batch_size=args.batch_size,
                              n_boot=args.n_boot, seed=args.seed, out=args.out, ablate=not args.no_ablation,
                              expert_kernels=args.expert_kernels)
    if r["experts"] is not None:
        print("what the experts learned:")
        for finding in r["experts"].findings:
            print(f"  - {finding}")
        print_table("per sparse layer (90% intervals over texts):", r["experts"].layers.drop(columns="name"))
    if r["expert_kernels"] is not None:
        print_table("inside the experts (split-half |GC| of each expert's kernel on its routed units, 90% of halves):",
                    r["expert_kernels"][0])
    print_table(f"perplexity per domain (texts truncated to {r['context']} tokens; 95% intervals over texts):",
                r["perplexity"])
    if len(r["routing"]):
        shares = r["routing"].pivot_table(index=["layer", "domain"], columns="expert", values="share_of_domain")
        print_table("share of each domain's sequences (CSE) or tokens (Switch) per expert:", shares.reset_index())
    if args.out:
        print(f"\nwrote {args.out}/")
    return 0


def _compare(args) -> int:
    r = compare_command(args.init_from, args.train_data, args.data, plan=args.plan, layers=args.layers,
                        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, layout=args.layout,
                        lr=args.lr,
                        seeds=args.seeds,
                        text_column=args.text_column, label_column=args.label_column, data_format=args.format,
                        tokenizer=args.tokenizer, min_cluster_size=args.min_cluster_size, out=args.out,
                        force=args.force)
    table = r["table"].pivot_table(index=["domain"], columns=["arm", "seed"], values="ppl")
    print_table("perplexity per domain on the evaluation data (arm x seed):", table.reset_index())
    print(f"\n{r['start'].removeprefix('compare: ')}\nwrote {args.out}/tables/comparison.csv")
    return 0


def _int_list(text: str) -> list:
    """``"2,3"`` -> [2, 3]; anything else is a usage error (exit 2)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers (got {text!r})") from None


def add_parsers(sub) -> None:
    """``eval`` and ``compare`` under the ``ntkscope`` command's subparsers ``sub``."""
    ev = sub.add_parser("eval", help="perplexity per domain of your data, and where each domain is routed",
                        description="Example: ntkscope eval myrun/cse/checkpoints/step-000200 --data eval.jsonl "
                        "--label-column domain --out eval/")
    ev.add_argument("checkpoint", help="a checkpoint directory: HF causal LM (dense, converted, or a mixture of "
                    "experts such as Mixtral or OLMoE), HF BERT / RoBERTa (scored on seeded masked tokens), or "
                    "cse_models GPT / BERT")
    ev.add_argument("--data", default="default", help=DATA_HELP)
    add_column_args(ev)
    ev.add_argument("--tokenizer", help="default: the checkpoint's tokenizer.json, its run's tokenizer or pack")
    ev.add_argument("--batch-size", type=POSITIVE_INT, default=16)
    ev.add_argument("--n-boot", type=POSITIVE_INT, default=1000, help="bootstrap resamples of the intervals")
    ev.add_argument("--seed", type=int, default=0)
    add_out(ev, kind="dir", help="directory for perplexity.csv, routing.csv, routing.png, result.json, and for a "
                    "sparse model expert_layers.csv, experts.csv, ablation.csv (and expert_kernels.csv, expert_gc.csv)")
    ev.add_argument("--no-ablation", action="store_true", help="skip ablating each expert (one pass over the data "
                    "per expert)")
    ev.add_argument("--expert-kernels", type=POSITIVE_INT, default=0, metavar="N",
                    help="the per-expert view on N texts: each expert's NTK over its own parameters and routed units, "
                    "its split-half |GC| and each label's GC among its units (expert_kernels.csv, expert_gc.csv)")
    ev.set_defaults(run=_eval)
    cmp_ = sub.add_parser("compare", help="train dense, CSE and Switch from your warm-up checkpoint and compare "
                          "them per domain", description="Example: ntkscope compare myrun/step200 --plan plan.json "
                          "--train-data train.jsonl --data test.jsonl --label-column domain --steps 300 --out cmp/")
    cmp_.add_argument("init_from", help="the warm-up checkpoint (an HF causal or masked LM directory, or a cse_models "
                      "one), or "
                      "a run directory of checkpoints: its checkpoint at the plan's warm-up")
    cmp_.add_argument("--train-data", required=True, help="training rows: a .jsonl/.csv/.tsv/.parquet table or a "
                      "datasets directory")
    cmp_.add_argument("--data", required=True, help="evaluation rows, read as --data always is")
    add_column_args(cmp_)
    where = cmp_.add_mutually_exclusive_group(required=True)
    where.add_argument("--plan", help="a plan from ntkscope plan: its layers (checked against the model)")
    where.add_argument("--layers", type=_int_list, help="comma-separated block indices of the sparse layers")
    cmp_.add_argument("--steps", type=POSITIVE_INT, default=200, help="training steps of every arm (default 200)")
    cmp_.add_argument("--batch-size", type=POSITIVE_INT, default=None,
                      help="sequences per step of every arm (default: the run's own where its checkpoint records "
                      "it, else 16)")
    cmp_.add_argument("--seq-len", type=POSITIVE_INT, default=None,
                      help="tokens per training block or row (default: the run's own where it records it, else 64)")
    cmp_.add_argument("--layout", choices=LAYOUTS, default=None,
                      help="packed: each domain's text as one stream cut into full blocks; rows: one text per row, "
                      "cut and padded, as a padding collator gives Trainer (default: the run's own where it "
                      "records it, else packed)")
    cmp_.add_argument("--lr", type=POSITIVE, default=None,
                      help="a fresh warm-up to this rate for every arm (default: continue the run's own schedule "
                           "and AdamW state where the checkpoint keeps them, else a fresh warm-up to 1e-3)")
    cmp_.add_argument("--seeds", type=_int_list, default=[0], help="comma-separated seeds (data order; default 0)")
    cmp_.add_argument("--min-cluster-size", type=ranged(int, 2), default=15,
                      help="CSE router: HDBSCAN's smallest cluster")
    cmp_.add_argument("--tokenizer", help="default: init_from's tokenizer.json")
    add_out(cmp_, kind="own", default="compare", help="directory for the runs and tables/ (default compare)")
    cmp_.add_argument("--force", action="store_true", help="OUT holds a comparison asked with other options: delete "
                      "its runs and tables and start over (without it, such a rerun is refused)")
    cmp_.set_defaults(run=_compare)
