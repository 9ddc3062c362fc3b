"""The ``ntkscope experiment`` command: run a spec's units through an executor, see where they
stand, rebuild the tables (:mod:`ntkscope.experiments`; docs/experiments.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ntkscope.app.parsing import COUNT, POSITIVE_INT, add_out
from ntkscope.core.checks import InputError, UserError
from ntkscope.core.files import check_output, read_json_object
from ntkscope.experiments import load_spec, parse_spec, run_experiment, shipped, status, summarise_experiment
from ntkscope.experiments.experts import expert_figure
from ntkscope.experiments.map import summarise_map
from ntkscope.experiments.probe import probe_trunks
from ntkscope.experiments.spec import EXECUTORS
from ntkscope.kernel.uncertainty import Resampling


def _seeds(text: str) -> list:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise InputError("--seeds", "must be comma-separated seeds, each at least 0", text,
                         func="ntkscope experiment run")
    return seeds


def _spec(args):
    changes = {"seeds": _seeds(args.seeds)} if args.seeds else {}
    if args.steps:
        changes["settings"] = {"steps": args.steps}
    return load_spec(args.spec, **changes)


def _map(args) -> int:
    for run in args.run_dirs:
        if not (run / "results").is_dir():
            raise InputError("RUN", "must be a run directory with results/", str(run), func="ntkscope experiment map")
    if args.against is not None and not (args.against / "results").is_dir():
        raise InputError("--against", "must be a run directory with results/", str(args.against),
                         func="ntkscope experiment map")
    found = summarise_map(args.run_dirs, args.out, load_spec(args.spec), pack=args.data, against=args.against)
    if "fits_its_data" in found:
        print(f"fits_its_data: {found['fits_its_data']['verdict']} ({found['fits_its_data']['what']})")
    for name in ("clusters_vs_shuffled", "cse_vs_fair", "cse_vs_scratch"):
        if name not in found:
            continue
        v = found[name]
        print(f"{name}: {v['verdict']}" + (f" ({v['why']})" if "why" in v else "")
              + f"; seeds ran {v['seeds_ran']}, wins {v['wins']}")
    for arm, v in found["against_null"].items():
        print(f"{arm} against dense-null: {v['verdict']}" + (f" ({v['why']})" if "why" in v else ""))
    print(f"tables in {args.out / 'tables'}, figure {args.out / 'controls.png'}")
    return 0


def _run(args) -> int:
    spec = _spec(args)
    slurm = dataclasses.replace(spec.slurm, **{k: v for k, v in {
        "partition": args.partition, "time_min": args.time_min, "gpus": args.gpus, "cpus": args.cpus,
        "mem_gb": args.mem_gb}.items() if v is not None})
    out = check_output("ntkscope experiment run", Path(args.out or f"runs/{spec.name}"))
    try:  # before any unit: an output that cannot be made is one line (a file in the path, /proc/x)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"ntkscope experiment run: --out {out} cannot be created ({err.strerror or err})") from None
    if args.adopt is not None and not Path(args.adopt).is_dir():
        raise InputError("--adopt", "must be a directory (an earlier run directory, or committed results such as "
                         "figures/sweep)", str(args.adopt), func="ntkscope experiment run")
    outcome = run_experiment(spec, out, executor=args.executor, workers=args.workers, threads=args.threads,
                             retries=args.retries, adopt=args.adopt, pack=args.data, device=args.device, slurm=slurm,
                             first=[g.strip() for g in args.first.split(",") if g.strip()] if args.first else None)
    print(f"experiment {spec.name} in {out}: {len(outcome.done)} units done, {len(outcome.failed)} failed, "
          f"{len(outcome.blocked)} blocked; tables in {out}/tables" + (" (partial)" if outcome.partial else ""))
    for name, error in outcome.failed.items():
        print(f"  failed {name}: {error}")
    if outcome.blocked:
        print(f"  blocked (a unit they need failed): {', '.join(outcome.blocked)}")
    return 1 if outcome.failed else 0


def _status(args) -> int:
    table = status(args.run_dir)
    counts = table["state"].value_counts()
    print(f"{args.run_dir}: " + ", ".join(f"{n} {state}" for state, n in counts.items()))
    shown = table.assign(seconds=table["seconds"].map(lambda s: "" if s is None or s != s else f"{s:.0f}"))
    print(shown.fillna("").to_string(index=False))
    return 0


def _tables(args) -> int:
    path = Path(args.run_dir) / "experiment.json"
    if not path.is_file():
        raise UserError(f"ntkscope experiment tables: {args.run_dir} holds no experiment (no experiment.json)")
    record = read_json_object(path, "ntkscope experiment tables")
    spec = parse_spec(record["spec"], source=record.get("source", str(path)))
    summarise_experiment(spec, args.run_dir, pack=args.data)
    found = json.loads((Path(args.run_dir) / "tables" / "status.json").read_text())
    print(f"tables in {args.run_dir}/tables" + (f" (partial: {len(found['missing'])} units not done)"
                                            if found["partial"] else ""))
    return 0


def _run_probe_args(parser, out_help: str) -> None:
    """What ``probe`` and ``experts`` both read: a sweep's run directory, its spec and pack, the
    seeds, the probe's blocks per domain, and where the tables go."""
    parser.add_argument("run_dir", metavar="RUN", type=Path, help="the sweep's run directory")
    parser.add_argument("--spec", required=True, help="the spec the run ran (its layers, settings and seeds)")
    add_out(parser, kind="own", type=Path, required=True, help=out_help)
    parser.add_argument("--data", "--pack", dest="data", help="the corpus pack the run used (default: the shipped one)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the spec's)")
    parser.add_argument("--per-domain", type=POSITIVE_INT, default=64,
                        help="validation blocks of each domain in the probe (default 64)")


def _check_models(args, command: str) -> None:
    if not (args.run_dir / "models").is_dir():
        raise InputError("RUN", "must be a sweep's run directory with models/ (its units' checkpoints)",
                         str(args.run_dir), func=f"ntkscope experiment {command}")


def _probe(args) -> int:
    _check_models(args, "probe")
    written = probe_trunks(load_spec(args.spec), args.run_dir, args.out, pack=args.data,
                           seeds=_seeds(args.seeds) if args.seeds else None, per_domain=args.per_domain,
                           resampling=Resampling(resamples=args.resamples, null_draws=args.null_draws))
    print(f"trunk probe tables: {', '.join(str(p) for p in written)}")
    return 0


def _experts(args) -> int:
    _check_models(args, "experts")
    found = expert_figure(load_spec(args.spec), args.run_dir, args.out, arm=args.arm, pack=args.data,
                          seeds=_seeds(args.seeds) if args.seeds else None, per_domain=args.per_domain,
                          min_units=args.min_units, draws=args.draws)
    v = found["experts_more_consistent"]
    print(f"experts more consistent than the dense FFN on their own blocks: {v['verdict']} "
          f"(a majority of them in {v['wins']} of the {v['seeds_ran']} seeds measured)"
          + (f"; {v['why']}" if "why" in v else ""))
    print(f"tail experts: {found['tail_experts']['verdict']}")
    print(f"table {args.out / 'experts.csv'}, verdicts {args.out / 'verdicts.json'}")
    return 0


def _specs(args) -> int:
    for name, path in sorted(shipped().items()):
        spec = load_spec(path)
        parts = [f"{len(spec.arms)} arms" if spec.kind == "sweep" else f"{len(spec.rows)} rows x {len(spec.archs)} "
                 "architectures", f"seeds {list(spec.seeds)}", f"{spec.settings.steps} steps"]
        print(f"{name:12s} {spec.kind:7s} {', '.join(parts)}  ({path})")
    return 0


def add_parsers(sub) -> None:
    """``ntkscope experiment run | status | tables | map | specs``."""

    exp = sub.add_parser("experiment", help="run an experiment spec's units (arms x seeds x steps) on local workers, "
                         "submitit or Slurm; resumable, with status and tables as units finish",
                         description="An experiment is a TOML spec (docs/experiments.md); the shipped ones are "
                         "listed by `ntkscope experiment specs`. Example: ntkscope experiment run sweep --out runs/sweep "
                         "--workers 2")
    ex = exp.add_subparsers(dest="experiment_command", required=True)
    run = ex.add_parser("run", help="run every unit not yet done, then write the tables")
    run.add_argument("spec", help="a spec file, or the name of a shipped spec (sweep, tables, tables-late)")
    add_out(run, kind="own", help="the run directory (default runs/NAME)")
    run.add_argument("--executor", choices=EXECUTORS, default="local",
                     help="local: worker processes (default); submitit-local: submitit's local executor; slurm: "
                     "sbatch through submitit; inline: this process, one unit at a time")
    run.add_argument("--workers", type=POSITIVE_INT, default=1, help="units at once (default 1)")
    run.add_argument("--threads", type=COUNT, default=1, help="torch threads per unit (default 1; 0: torch's)")
    run.add_argument("--retries", type=COUNT, help="tries again for a failed unit (default: the spec's [run] retries)")
    run.add_argument("--adopt", metavar="DIR", help="an earlier run directory (or committed results such as "
                     "figures/sweep) whose finished units count as done")
    run.add_argument("--seeds", help="comma-separated seeds in place of the spec's")
    run.add_argument("--first", help="comma-separated unit-name globs (e.g. 'cse-at1200-*') whose units, and "
                     "every unit they need, start before the others; every unit still runs")
    run.add_argument("--steps", type=POSITIVE_INT, help="the schedule's length in place of the spec's")
    run.add_argument("--device", help="where units train: cpu, cuda, auto (default: the spec's settings)")
    run.add_argument("--data", "--pack", dest="data", help="a corpus pack directory (default: the shipped one)")
    slurm = run.add_argument_group("Slurm (--executor slurm; default: the spec's [run.slurm])")
    slurm.add_argument("--partition")
    slurm.add_argument("--time-min", type=POSITIVE_INT, help="minutes per unit")
    slurm.add_argument("--gpus", type=COUNT, help="GPUs per unit")
    slurm.add_argument("--cpus", type=POSITIVE_INT, help="CPUs per unit")
    slurm.add_argument("--mem-gb", type=POSITIVE_INT, help="memory per unit, GB")
    run.set_defaults(run=_run, interrupted_note="the units done are kept, and a unit this machine was training "
                     "keeps its checkpoints (experiment status: interrupted; jobs already submitted to submitit or "
                     "Slurm go on); the same command resumes it")
    st = ex.add_parser("status", help="each unit: done, running, failed, interrupted, ready or waiting, with its "
                       "times and last error")
    st.add_argument("run_dir", metavar="RUN", type=Path, help="the run directory")
    st.set_defaults(run=_status)
    tb = ex.add_parser("tables", help="rebuild the tables from the units that finished (partial until all are)")
    tb.add_argument("run_dir", metavar="RUN", type=Path, help="the run directory")
    tb.add_argument("--data", "--pack", dest="data", help="the corpus pack the run used (default: the shipped one)")
    tb.set_defaults(run=_tables)
    mp = ex.add_parser("map", help="the warm-up map's gains (block-bootstrap intervals), pre-registered verdicts and "
                       "figures from the units that finished in one or more run directories (each a build of the "
                       "trunks: its units pair with its own trunks)")
    mp.add_argument("run_dirs", metavar="RUN", type=Path, nargs="+", help="run directories (a unit in several is "
                    "taken from the first)")
    mp.add_argument("--spec", default="warmup-map", help="the spec whose seeds the verdicts count (default warmup-map)")
    add_out(mp, kind="own", type=Path, required=True, help="where tables/ and controls.png go")
    mp.add_argument("--data", "--pack", dest="data", help="the corpus pack the runs used (default: the shipped one)")
    mp.add_argument("--against", type=Path, help="another run directory whose dense trunks were tested on the same "
                    "blocks (e.g. a smaller model's): per-domain perplexities side by side in tables/trunks.csv")
    mp.set_defaults(run=_map)
    pr = ex.add_parser("probe", help="measure a sweep's dense trunks at every kept checkpoint: per domain, per "
                       "expert of the router CSE would fit there and for the small experts together, the validation "
                       "loss, GC against the whole probe (interval, null), tail share, expert count (one table per "
                       "trunk, OUT/trunk-seedK.csv)")
    _run_probe_args(pr, "where the tables go")
    pr.add_argument("--resamples", type=COUNT, default=100, help="GC's jackknife deletions at most (default 100; 0: "
                    "no interval)")
    pr.add_argument("--null-draws", type=COUNT, default=0, help="GC's random-null draws per group size (default 0: "
                    "none; each draw costs about a kernel's statistics)")
    pr.set_defaults(run=_probe)
    xp = ex.add_parser("experts", help="Figure 5(b, c) on a sweep's converted models: each expert's split-half "
                       "|GC| on the probe blocks routed to it against the dense trunk's FFN on the same blocks at the "
                       "same step, paired over the same halves, with a random-blocks null (OUT/experts.csv, "
                       "OUT/verdicts.json; a seed already measured is kept)")
    _run_probe_args(xp, "where the table, the verdicts and the figure go")
    xp.add_argument("--arm", default="cse-at1200", help="the CSE arm measured (default cse-at1200)")
    xp.add_argument("--min-units", type=POSITIVE_INT, default=8, help="blocks an expert needs to be judged (default 8)")
    xp.add_argument("--draws", type=POSITIVE_INT, default=200, help="random halves per expert (default 200)")
    xp.set_defaults(run=_experts)
    sp = ex.add_parser("specs", help="the specs that ship with ntkscope")
    sp.set_defaults(run=_specs)
