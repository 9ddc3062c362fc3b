"""The ``ntkscope`` command. The library computes (:mod:`ntkscope.app.commands`); this module
parses arguments and presents what comes back.

Exit codes: 0 success, 1 a user error (a ``UserError``: one clear line on stderr), 2 usage
(argparse; combinations the method table refuses, such as ``ntk --method matrix-free``; options
that mean nothing for what they are given, such as ``gc RUN --bins 3``), 130 interrupted. Any
other exception is a bug and keeps its traceback.
The plotting backend is chosen here (Agg: files, no display), never inside the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading

import matplotlib
import pandas as pd
import torch
import torch.distributed as dist

from ntkscope import __version__
from ntkscope.app import commands, corpus_cli, experiment_cli, own_model, reproduce_cli
from ntkscope.app.parsing import DATA_HELP as _DATA_HELP
from ntkscope.app.parsing import add_column_args as _add_column_args
from ntkscope.app.parsing import print_table as _print_table
from ntkscope.app.parsing import COUNT, FRACTION, POSITIVE_INT, add_out, ranged
from ntkscope.app.parsing import source as _source
from ntkscope.app.demo import perplexity, run_demo
from ntkscope.app.report import report
from ntkscope.gc.options import GROUPINGS, GCOptions
from ntkscope.core.checks import InputError, UserError
from ntkscope.kernel.grads import MEMORY_DEFAULT_TEXT
from ntkscope.core.files import check_output, output_lock, write_table
from ntkscope.core.progress import logging_redirect_tqdm
from ntkscope.core.provenance import set_command
from ntkscope.gc.groups import GC_OUTPUT
from ntkscope.kernel.methods import METHODS, method_names, unsupported
from ntkscope.kernel.objectives import OUTPUTS, SCALAR_OUTPUTS
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.uncertainty import INTERVALS, Resampling
from ntkscope.runs.checkpoints import is_run_dir
from ntkscope.runs.families import POINTS
from ntkscope.text.frequency import BINNINGS, NORMALISATIONS
from ntkscope.text.sentences import Sentences


def _columns(frame, columns):
    """The columns of ``frame`` among ``columns``, in that order (a table holds the controls it measured)."""
    return frame[[c for c in columns if c in frame.columns]]


def _demo(args) -> int:
    check_output("demo", args.out, kind="file", suffixes=(".csv",))  # before the 20 s of work, not after
    result = run_demo(steps=args.steps, n=args.n, seed=args.seed, method=args.method)
    final = sum(result.losses[-20:]) / min(20, len(result.losses))
    print(f"trained a 2-layer GPT on {result.n_blocks} training blocks of the default corpus pack for "
          f"{len(result.losses)} steps: loss {result.losses[0]:.2f} -> {final:.2f} "
          f"(perplexity {perplexity(final):.1f} per BPE token)")
    cols = ["by", "label", "left", "right", "mean_frequency_score", *GC_COLUMNS]
    _print_table(f"gradient consistency of each group against the whole analysis batch (n={args.n}, output "
                 f"{result.output}):", _columns(result.table, cols))
    print(f"\ndone in {result.seconds:.0f} s")
    if args.out:
        write_table(result.table, args.out)
        print(f"wrote {args.out}")
    return 0


def _freq(args) -> int:
    r = commands.freq_command(_source(args), tokenizer=args.tokenizer, normalisation=args.normalisation,
                              bins=args.bins, out=args.out)
    _print_table(f"sentence frequency score by domain ({args.normalisation}, {r['tokenizer'].name}):",
                 r["sentences"].groupby("domain")["score"].describe()[["count", "25%", "50%", "75%"]].reset_index())
    _print_table("percentage of sentences per bin:", r["histogram"])
    if args.out:
        print(f"\nwrote {args.out}/")
    return 0


def _sentences(args) -> Sentences:
    return Sentences(n=args.n, seq_len=args.seq_len, seed=args.seed, tokenizer=args.tokenizer)


def _kernel(args) -> KernelOptions:
    """The kernel options of a kernel command (gc, ntk), built once from its arguments."""
    return KernelOptions(output=args.output, params=args.params, method=args.method, dtype=args.dtype,
                         device=args.device, max_memory=_gib(args.max_memory), seed=args.seed)


def _analysis_options(args) -> dict:
    return dict(sentences=_sentences(args), point=args.point, k_max=args.k_max, projection_dim=args.projection_dim,
                top_k=args.top_k, cache_dir=args.cache_dir)


def _clusters(args) -> int:
    r = commands.clusters_command(args.model, _source(args), **_analysis_options(args), out=args.out)
    if r["run"]:
        _print_table(f"clusters per checkpoint and layer ({args.point}, n={args.n}):", r["table"])
    else:
        table = r["table"]
        _print_table(f"cluster separation per layer ({args.point}, n={args.n}, projected to {args.projection_dim}; "
                     f"JL dimension for distortion 0.1/0.2/0.3/0.5: {list(table.attrs['jl_guidance'].values())}):",
                     table)
        print(f"\nCSE layers by {r['plan'].chosen_by}: {r['plan'].layers}")
    return 0


def _report(args) -> int:
    made = report(args.path, args.out)
    print(f"{made['path']}: {len(made['sections'])} sections of the {made['kind']} in {args.path}")
    return 0


def _plan(args) -> int:
    r = commands.plan_command(args.run_dir, _source(args), **_analysis_options(args), module=args.module,
                              tail_fraction=args.tail_fraction,
                              kernel=KernelOptions(output=args.output, method=args.method, seed=args.seed),
                              overlap=args.overlap, choose_by=args.choose_by, warmup_by=args.warmup_by,
                              schedule_steps=args.schedule_steps,
                              tail_labels=args.tail_labels.split(",") if args.tail_labels else None, out=args.out)
    _print_table("separation per checkpoint and layer:", r["separation"].pivot(
        index="step", columns="layer", values="separation").reset_index())
    _print_table(f"|GC| of the long tail (lowest {args.tail_fraction:.0%} frequency scores, n={r['n_tail']}, output "
                 f"{args.output}):", _columns(r["gc"], ["step", "draw", "excess", "excess_se", *GC_COLUMNS[1:]]))
    plan = r["plan"]
    peak = plan.evidence["gc_peak"]
    print(f"\n|GC| peak at step {peak['step']}: {'shown' if peak['shown'] else 'not shown'} ({peak['why']})")
    at = plan.evidence["scores_at_step"]
    if plan.evidence.get("labels_at_warmup") is not None:
        _print_table(f"at the warm-up, what the router's clusters hold of the tail labels {r['tail_labels']}:",
                     pd.DataFrame(plan.evidence["labels_at_warmup"]))
    if "layers_by_labels" in plan.evidence:
        shares = ", ".join(f"layer {s['layer']} {s['tail_share']:.3f} (step {s['step']})"
                           for s in plan.evidence["tail_share_by_layer"])
        by_labels = plan.evidence["layers_by_labels"] or f"none: {plan.evidence['labels_verdict']}"
        print(f"layers by separation (at step {at}) {plan.evidence['layers_by_separation']}; by the labels' tail "
              f"share {by_labels} (best share per layer: {shares})")
    print(f"\nthe warm-up's record: {plan.evidence['warmup_record']['summary']}")
    print(f"plan: CSE layers {plan.layers} ({plan.chosen_by}; separation scores from the checkpoint at step {at}), "
          f"warm-up {plan.convert_at} steps (rule: {plan.warmup_rule}) -> {args.out}")
    return 0


def _gib(value) -> int | None:
    if value is None:
        return None
    if not value > 0 or not math.isfinite(value):
        raise InputError("max-memory", "must be a positive, finite number of GiB", value)
    return int(value * 2**30)


def _resampling(args) -> Resampling:
    return Resampling(resamples=args.resamples, null_draws=args.null_draws, confidence=args.confidence,
                      interval=args.interval, seed=args.seed)


# gc's options that have no meaning for a run directory, where gc follows the long tail's GC over
# the checkpoints, and for one checkpoint (every other option is honoured for both)
GC_ONE = {k: getattr(GCOptions(), k) for k in ("bins", "binning", "min_count")}  # GCOptions' defaults: one
GC_RUN = {"tail_fraction": GCOptions().tail_fraction}                             # checkpoint only; a run only
_GC_ONE_CHECKPOINT = {"--by label": lambda a: a.by == "label", "--outputs": lambda a: a.outputs,
                      "--tokens": lambda a: a.tokens,
                      **{f"--{k.replace('_', '-')}": (lambda a, k=k: getattr(a, k) is not None) for k in GC_ONE}}
_GC_RUN_ONLY = {"--cache-dir": lambda a: a.cache_dir,
                **{f"--{k.replace('_', '-')}": (lambda a, k=k: getattr(a, k) is not None) for k in GC_RUN}}


GC_COLUMNS = ["n_subset", "abs_gc", "abs_gc_low", "abs_gc_high", "null_low", "null_high", "versus_null",
              "versus_homogeneous", "versus_matched-length", "versus_matched-loss", "gc_signed", "sign_confidence",
              "mean_gradient", "flags"]


def _gc(args) -> int:
    run = is_run_dir(args.target)
    fixed = {**GC_ONE, **GC_RUN}  # an option the target's kind does not take was refused by the parser
    gc = GCOptions(by=args.by, homogeneous_label=args.homogeneous_label,
                   outputs=tuple(o.strip() for o in args.outputs.split(",")) if args.outputs else None,
                   **{k: fixed[k] if getattr(args, k) is None else getattr(args, k) for k in fixed})
    common = dict(sentences=_sentences(args), kernel=_kernel(args), gc=gc, resampling=_resampling(args),
                  out=args.out)
    if run:
        result = commands.gc_run_command(args.target, _source(args), cache_dir=args.cache_dir, **common)
        _print_table(f"GC of the long tail (n_tail={result['n_tail']} of {result['n']}, output {args.output}) at "
                     "each checkpoint:", _columns(pd.DataFrame(result["series"]), ["step", "excess", "excess_se",
                                                                                   *GC_COLUMNS[1:]]))
        peak = result["peak"]
        print(f"\n|GC| peaks at step {peak['step']}: {'shown' if peak['shown'] else 'not shown'} ({peak['why']})")
    else:
        result = commands.gc_command(args.target, _source(args), tokens=args.tokens, **common)
        table = pd.DataFrame(result["groups"])
        cols = [c for c in ("output", "label", "left", "right", *GC_COLUMNS) if c in table]
        _print_table(f"GC of each {'frequency bin' if args.by == 'frequency-bins' else 'label'} against the whole "
                     f"set (n={result['n']}, {result['data']}; {args.confidence:.0%} {args.interval} intervals of "
                     f"{args.resamples} replicates; null bands of {args.null_draws} subsets each: random, "
                     f"homogeneous, matched on length and loss):",
                     table[cols])
        print("\n|GC| is read against each null band (versus_*: random, homogeneous, matched); gc_signed is blank "
              "where the sign is not confident; flags name an ill-defined direction (docs/design.md §1.1)")
        for warning in result["warnings"]:
            print(f"\nwarning: {warning}")
        if result["skipped"]:
            print(f"\nskipped (fewer than --min-count {gc.min_count} sentences): {json.dumps(result['skipped'])}")
    if args.out:
        print(f"\nwrote {args.out}/")
    return 0


def _ntk(args) -> int:
    result = commands.ntk_command(args.target, _source(args), sentences=_sentences(args), kernel=_kernel(args),
                                  blocks=args.blocks, out=args.out)
    print(f"NTK of {result['n']} sentences by {result['method']} ({result['reason']}); trace {result['trace']:.4g}; "
          f"blocks: {len(result['blocks'])}")
    if args.out:
        print(f"wrote {args.out}/ (ntk.npy, ntk.png{', blocks.npz' if result['blocks'] else ''})")
    return 0


# ---- arguments: one vocabulary across commands --------------------------------------------------




def _add_data_args(parser, n_default: int) -> None:
    parser.add_argument("--data", "--pack", dest="data", default="default",
                        help=_DATA_HELP + " (--pack: the same)")
    _add_column_args(parser)
    parser.add_argument("--tokenizer", help="default: the checkpoint's tokenizer.json, its run's pack, else the "
                        "data pack's BPE (checked against the model's vocabulary)")
    parser.add_argument("--n", type=POSITIVE_INT, default=n_default, help=f"sentences to analyse (default {n_default})")
    parser.add_argument("--seq-len", type=POSITIVE_INT, default=64, help="tokens per sentence at most (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="sentence sampling (and projection) seed")


def _add_method_arg(parser, task: str) -> None:
    rows = "; ".join(f"{name}: {spec.summary}" for name, spec in METHODS.items())
    parser.add_argument("--method", default="auto", choices=method_names("eigen"),
                        help=f"how the NTK{' eigenvector' if task == 'eigen' else ''} is computed (default auto: "
                        f"the cheapest estimate that fits in memory, stated in the log). {rows}")


def _add_model_args(parser, n_default: int, task: str, output: str = "loss") -> None:
    parser.add_argument("target", metavar="CHECKPOINT", help="a cse_models checkpoint, an HF model directory, or "
                        "(gc only) a training run directory")
    _add_data_args(parser, n_default)
    parser.add_argument("--params", nargs="+", help="parameter name globs, e.g. 'transformer.h.1.*' (default: all)")
    parser.add_argument("--output", default=output, choices=list(OUTPUTS),
                        help=f"f(x): the sequence's mean token loss, the true token's logit, centred or not (a mean "
                        f"over the sequence), or a vector output (trace reduction); default {output} "
                        "(docs/gc-outputs.md)")
    _add_method_arg(parser, task)
    parser.add_argument("--dtype", choices=["float32", "float64"], help="compute dtype (default: the model's)")
    parser.add_argument("--device", help="compute device, e.g. cuda or cuda:1 (default cpu); the memory budget is "
                        "that device's free memory")
    parser.add_argument("--max-memory", type=float, metavar="GIB",
                        help=f"memory budget in GiB for the kernel computation (default: "
                        f"{MEMORY_DEFAULT_TEXT})".replace("%", "%%"))
    add_out(parser, kind="dir", help="directory for the results (written atomically)")
    parser.set_defaults(task=task)


def _add_analysis_args(parser) -> None:
    _add_data_args(parser, 256)
    parser.add_argument("--point", default="block", choices=POINTS)
    parser.add_argument("--k-max", type=POSITIVE_INT, default=10, help="largest K of the elbow search (default 10)")
    parser.add_argument("--projection-dim", type=POSITIVE_INT, default=64,
                        help="random projection dimension (default 64)")
    parser.add_argument("--top-k", type=POSITIVE_INT, default=2, help="CSE layers to choose (default 2)")
    _add_cache_arg(parser)


def _add_cache_arg(parser) -> None:
    parser.add_argument("--cache-dir", help="where each checkpoint's analysis of a run is cached (default: "
                        "RUN/analysis when the run is yours to write, else under $NTKSCOPE_CACHE or ~/.cache/ntkscope)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ntkscope", description="Why do language models miss long-tail knowledge? Per-sample gradients, the "
        "empirical NTK and gradient consistency of data subsets (gc, ntk, freq), how representations cluster over "
        "training (clusters, plan), and CSE models built from that plan (compare, eval, reproduce).",
        epilog="Exit status: 0 success, 1 a mistake in the input (one line on stderr), 2 a usage error, 130 "
        "interrupted. Each command's --help has an example.")
    parser.add_argument("--version", action="version", version=f"ntkscope {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small GPT on the default corpus pack and print GC per domain and frequency bin",
        description="Example: ntkscope demo --steps 800 --n 128",
    )
    demo.add_argument("--steps", type=POSITIVE_INT, default=800,
                      help="training steps before the analysis (default 800)")
    demo.add_argument("--n", type=POSITIVE_INT, default=128, help="sentences in the analysis batch (default 128)")
    demo.add_argument("--seed", type=int, default=0, help="seed for data sampling, init and training")
    _add_method_arg(demo, "eigen")
    add_out(demo, kind="file", help="also write the GC table to this CSV file")
    demo.set_defaults(run=_demo)
    corpus_cli.add_parsers(sub)
    gc = sub.add_parser("gc", help="gradient consistency of frequency bins or labels against the whole set",
                        description="Examples: ntkscope gc runs/toy-dense/checkpoints/step-001000 --out gc/  |  "
                        "ntkscope gc runs/toy-dense --out gc-over-steps/ (every checkpoint of a run)")
    _add_model_args(gc, 256, "eigen", output=GC_OUTPUT)
    gc.add_argument("--by", default="frequency-bins", choices=GROUPINGS,
                    help="subsets: frequency-score bins (default) or the data's labels")
    gc.add_argument("--bins", type=int, help=f"frequency bins (default {GC_ONE['bins']}; one checkpoint)")
    gc.add_argument("--binning", choices=BINNINGS,
                    help="equal-count bins (default) or equal-width bins of the frequency score (one checkpoint)")
    gc.add_argument("--min-count", type=POSITIVE_INT,
                    help=f"smallest subset analysed (default {GC_ONE['min_count']}; one "
                    "checkpoint)")
    gc.add_argument("--tail-fraction", type=FRACTION, help=f"a run directory: the long tail is this lowest-score share "
                    f"of the sentences (default {GC_RUN['tail_fraction']:.3g})")
    _add_cache_arg(gc)
    gc.add_argument("--outputs", help="several scalar outputs side by side, comma-separated, e.g. "
                    f"{','.join(SCALAR_OUTPUTS)} (a sensitivity view; overrides --output)")
    gc.add_argument("--resamples", type=COUNT, default=200,
                    help="replicates per GC: jackknife deletions at most, or bootstrap resamples (default 200; 0: none)")
    gc.add_argument("--null-draws", type=COUNT, default=200,
                    help="subsets behind each null band (default 200; 0: none)")
    gc.add_argument("--confidence", type=FRACTION, default=0.9, help="interval and null band level (default 0.9)")
    gc.add_argument("--interval", default="jackknife", choices=INTERVALS,
                    help="jackknife (default: the finite-n interval, its bias and the large-sample estimate; "
                    "docs/gc-calibration.md), or the bootstrap's basic or bca, kept for comparison")
    gc.add_argument("--tokens", type=COUNT, default=0, metavar="K",
                    help="also write each group's K highest- and lowest-scoring tokens against its primary gradient "
                    "direction to tokens.csv (one checkpoint, a causal language model; default 0: none)")
    gc.add_argument("--homogeneous-label", metavar="LABEL",
                    help="the label of ordinary text the homogeneous null draws from (default: the nearest "
                    "neighbours of random sentences in gradient space)")
    gc.set_defaults(run=_gc)
    ntk = sub.add_parser("ntk", help="the empirical NTK of a set of sentences, as .npy and a heatmap",
                         description="Example: ntkscope ntk runs/toy-dense/checkpoints/step-001000 --n 64 "
                         "--blocks layer --out ntk/")
    _add_model_args(ntk, 64, "kernel")
    ntk.add_argument("--blocks", choices=["layer", "expert", "param"], help="also keep one kernel per block")
    ntk.set_defaults(run=_ntk)
    freq = sub.add_parser("freq", help="token counts and sentence frequency scores of a pack, a table or a text file",
                          description="Example: ntkscope freq --tokenizer gpt2 --out freq/")
    freq.add_argument("data", nargs="?", default="default", help=_DATA_HELP)
    _add_column_args(freq)
    freq.add_argument("--tokenizer", help="default: the pack's BPE")
    freq.add_argument("--normalisation", default="max", choices=NORMALISATIONS)
    freq.add_argument("--bins", type=int, default=10)
    add_out(freq, kind="dir", help="directory for the tables")
    freq.set_defaults(run=_freq)
    own_model.add_parsers(sub)
    clusters = sub.add_parser("clusters", help="how one model's sequence embeddings cluster, layer by layer",
                              description="Example: ntkscope clusters runs/toy-dense/checkpoints/step-001000")
    clusters.add_argument("model", help="a cse_models checkpoint, an HF model directory, or a training run "
                          "directory (then: elbow K and separation per checkpoint and layer)")
    _add_analysis_args(clusters)
    add_out(clusters, kind="file", help="write the table (.csv or .parquet)")
    clusters.set_defaults(run=_clusters)
    plan = sub.add_parser("plan", help="choose CSE layers and the warm-up length from a run's checkpoints",
                          description="Example: ntkscope plan runs/toy-dense --out plan.json")
    plan.add_argument("run_dir", metavar="RUN", help="a training run directory (checkpoints/step-NNNNNN)")
    _add_analysis_args(plan)
    plan.add_argument("--module", default="ffn", choices=["ffn", "attn"])
    plan.add_argument("--tail-fraction", type=FRACTION, default=GC_RUN["tail_fraction"],
                      help=f"long tail: lowest-score share (default {GC_RUN['tail_fraction']:.3g})")
    plan.add_argument("--output", default=GC_OUTPUT, choices=list(SCALAR_OUTPUTS),
                      help=f"f(x) for GC (default {GC_OUTPUT}; docs/gc-outputs.md)")
    plan.add_argument("--overlap", type=ranged(float, 0, 1, open_low=True), default=0.8,
                      help="adjusted Rand index between neighbouring checkpoints' router clusters above which they "
                      "count as stable (the warm-up's fallback rule; default 0.8)")
    plan.add_argument("--tail-labels", help="comma-separated labels of the long tail, for the labels' evidence "
                      "(default: every label of the data but the most frequent)")
    plan.add_argument("--choose-by", choices=("structure", "labels"), default="structure",
                      help="structure (default, label-free): layers by separation, warm-up from the small clusters' "
                      "persistence; labels: layers where the tail's clusters hold the most tail sentences, warm-up "
                      "at the first checkpoint where one of them holds a pure tail cluster (when no layer holds "
                      "one, the labels choose nothing and the plan says so)")
    plan.add_argument("--warmup-by", choices=commands.WARMUP_BY, default="measured",
                      help="measured (default): the warm-up by the rules above; schedule-fraction: half the run's "
                      "schedule, the signal cross-validation chose on the warm-up map's trunks (it reads no "
                      "measurement; docs/warmup-map.md). The plan records both steps either way")
    plan.add_argument("--schedule-steps", type=POSITIVE_INT, help="the run's schedule length in steps (default: "
                      "the run's train_config.json steps or trainer_state.json max_steps)")
    _add_method_arg(plan, "eigen")
    add_out(plan, kind="file", default="plan.json", help="the plan file (default plan.json)")
    plan.set_defaults(run=_plan)
    report = sub.add_parser("report", help="one self-contained HTML page of an analysis: a result directory, a run, "
                            "or a reproduction", description="Example: ntkscope report figures/tail --out tail.html")
    report.add_argument("path", help="a result directory (of gc, ntk, eval, plan), a training run (cse-train's "
                        "out_dir, with track/ when it tracked GC) or a reproduction (e.g. figures/tail)")
    add_out(report, kind="file", help="the HTML file (default PATH/report.html)")
    report.set_defaults(run=_report)
    reproduce_cli.add_parsers(sub)
    experiment_cli.add_parsers(sub)
    return parser


def _usage_error(args, message: str) -> None:
    print(f"ntkscope {args.command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _refuse_unsupported(args) -> None:
    """Exit 2 with one line when the method table says the asked combination cannot run, or an
    option has no meaning for what it is given (gc over a run directory or one checkpoint)."""
    if args.command == "gc":
        run = is_run_dir(args.target)
        misplaced = [k for k, given in (_GC_ONE_CHECKPOINT if run else _GC_RUN_ONLY).items() if given(args)]
        if misplaced:
            _usage_error(args, f"{', '.join(misplaced)} {'apply' if len(misplaced) > 1 else 'applies'} to "
                         + ("one checkpoint; over a run directory, gc follows the long tail's GC at every "
                            "checkpoint (--tail-fraction)" if run else "a run directory (one checkpoint's result is "
                                                                       "reused from --out)"))
    task = getattr(args, "task", None)
    why = task and unsupported(task, args.method, scalar=OUTPUTS[args.output])
    if why:
        arg, rule = why
        _usage_error(args, f"--{arg} {getattr(args, arg)} {rule}")


_DISTRIBUTED_COMMANDS = ("gc", "ntk")


def _process_group(args) -> bool:
    """Under torchrun (``WORLD_SIZE`` and ``LOCAL_RANK`` set, one process or more): join the process
    group (nccl on a GPU, else gloo), put each rank on its own GPU, and silence every rank's output
    but rank 0's. True when joined."""
    if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
        return False
    if args.command not in _DISTRIBUTED_COMMANDS:
        raise InputError("command", f"must be {' or '.join(_DISTRIBUTED_COMMANDS)} under torchrun", args.command)
    if is_run_dir(args.target):
        raise InputError("target", "must be one checkpoint under torchrun (a run directory is analysed in one "
                         "process)", args.target)
    gpu = str(args.device or "").startswith("cuda")
    if gpu:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if gpu else "gloo")
    if dist.get_rank() != 0:
        args.quiet = True
        sys.stdout = open(os.devnull, "w")  # rank 0 prints; every rank computes
    return True


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    set_command(["ntkscope", *(sys.argv[1:] if argv is None else argv)])
    _refuse_unsupported(args)
    matplotlib.use("Agg")  # the command writes figures to files; no display
    try:
        joined = _process_group(args)
    except InputError as err:
        _error(args, err)
        return 1
    try:
        return _run(args)
    finally:
        if joined:
            dist.destroy_process_group()


def _run(args) -> int:
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.quiet:  # transformers (imported later, if at all) reads these: no loading bars, errors only
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        with logging_redirect_tqdm(), _terminated_as_interrupt(), _out_lock(args):  # log lines above a progress bar
            return args.run(args)
    except UserError as err:  # the user's mistake: one line; anything else is a bug and keeps its traceback
        _error(args, err)
        return 1
    except Exception:
        if os.environ.get("RANK", "0") == "0":
            print(f"ntkscope {args.command}: this is a bug in ntkscope, not a mistake in what you gave; please report "
                  f"it with the traceback that follows, the command and `pip show ntkscope torch`", file=sys.stderr)
        raise
    except KeyboardInterrupt as err:  # results are staged and moved only when whole: nothing half-written remains
        if os.environ.get("RANK", "0") == "0":
            kept = getattr(args, "interrupted_note", None) or "no partial results were written"
            print(f"ntkscope {args.command}: {'terminated' if isinstance(err, Terminated) else 'interrupted'}; {kept}",
                  file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds as Ctrl-C does: its lock released,
    its staged files and temporary copies deleted."""


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM raises :class:`Terminated` for the duration (main thread only; the old handler back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _out_lock(args):
    """The one lock on the command's ``--out``, held from before the work to the last write: a
    second process writing the same output is refused in one line, never silently lost. Under
    torchrun, rank 0 holds it (it is the one that writes)."""
    kind = getattr(args, "out_kind", None)  # declared beside the command's parser (parsing.add_out)
    out = getattr(args, "out", None)
    if kind in (None, "own") or out is None or os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    check_output(args.command, out, kind=kind)
    return output_lock(out, args.command)


def _error(args, err: Exception) -> None:
    """A user error as one line on stderr (under torchrun, from rank 0 only: every rank has it)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"ntkscope {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
