"""The ``ntkscope reproduce`` command: the paper's figures and tables, the sweep
(:mod:`ntkscope.app.cli` adds it to the command line)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ntkscope.app.parsing import COUNT, POSITIVE_INT, add_out
from ntkscope.core.checks import InputError
from ntkscope.core.files import check_output
from ntkscope.core.memory import trains_before_analysing
from ntkscope.experiments import load_spec, parse_spec, run_experiment
from ntkscope.reproduction import reproduce
from ntkscope.representation.plan import plan_step
from ntkscope.reproduction.settings import settings_for


def _spec(args):
    """The shipped spec of the mode (sweep, tables, tables-late), with --arms and --adopt applied."""

    spec = load_spec(args.mode)
    if args.arms:
        names = [a.strip() for a in args.arms.split(",")]
        known = [a["name"] for a in json.loads(spec.text)["arms"]]  # as the spec names them
        unknown = sorted(set(names) - set(known))
        if unknown or "dense" not in names:
            raise InputError("--arms", f"must name arms of {known}, 'dense' among them (every arm branches from it)",
                             unknown or names, func="ntkscope reproduce")
        data = json.loads(spec.text)
        data["arms"] = [a for a in data["arms"] if a["name"] in names]
        spec = parse_spec(data, source=spec.source)
    return dataclasses.replace(spec, settings=_reproduce_settings(args, spec.settings))


def _units(args, out: Path):
    """Run the mode's spec through the experiment runner (resumable per unit, --workers at once)."""

    outcome = run_experiment(_spec(args), out, workers=args.workers, threads=args.threads or (1 if args.workers > 1 else 0),
                             pack=args.data,
                             executor="local" if args.workers > 1 else "inline")
    for name, error in outcome.failed.items():
        print(f"  failed {name}: {error}")
    return outcome


def _sweep(args, out: Path) -> int:
    outcome = _units(args, out)
    verdict = json.loads((out / "tables" / "verdict.json").read_text())
    print(f"sweep in {out}: tables in {out}/tables (arms.csv, paired.csv, load.csv, routing.csv, verdict.json)"
          + (" (partial)" if outcome.partial else ""))
    for arm, found in verdict.items():
        print(f"  {arm}: {found.get('status')}" + (f", shown: {found['shown']}" if "shown" in found else ""))
    return 1 if outcome.failed else 0


def _reproduce_settings(args, base=None):
    changes = {"adopt_from": str(args.adopt)} if args.adopt else {}
    if args.track_every:
        changes["track_every"] = args.track_every
    return settings_for(args.mode, **changes) if base is None else base.replace(**changes)


def _reproduce(args) -> int:
    func = "ntkscope reproduce"
    out = check_output(func, Path(args.out or f"runs/reproduce-{args.mode}"))  # before any work, not after
    if args.adopt is not None and not Path(args.adopt).is_dir():
        raise InputError("--adopt", "must be a directory of trained model directories (e.g. a sweep's RUN/models)",
                         str(args.adopt), func=func)
    if args.threads:
        torch.set_num_threads(args.threads)
    trains_before_analysing()  # our own program: the heap left by training is handed back, not warned about
    if args.mode == "sweep":
        return _sweep(args, out)
    settings = _reproduce_settings(args)
    if args.mode in SPECS:  # the rows as units of the shipped spec, then the tables and manifest from them
        if _units(args, out).failed:
            return 1
        settings = _spec(args).settings
    manifest = reproduce(out, args.mode, settings=settings, pack=args.data)
    plan = manifest["plan"]
    settings = manifest["settings"]
    print(f"reproduced {manifest['mode']} mode in {out}: {manifest['seconds_total'] / 60:.1f} min of work in all, "
          f"{manifest['seconds_this_call'] / 60:.1f} min this call, on {manifest['environment']['machine']}")
    print(f"CSE layers {plan['layers']}, conversion at step {plan_step(plan)} ({plan['chosen_by']})")
    if settings["figures"]:
        print(f"\nTables 1-2 analogue, the figures' GPT slice ({out}/tables/results.md):\n")
        print((out / "tables" / "results.md").read_text())
        print("figures:", ", ".join(sorted({Path(f).stem for f in manifest["files"] if f.startswith("figures/")})))
    if settings["table_archs"]:
        print(f"\nthe paper's tables ({out}/tables/paper.md):\n")
        print((out / "tables" / "paper.md").read_text())
    print(f"manifest: {out}/manifest.json")
    return 0


#: the modes that run as a shipped experiment spec (ntkscope/experiments/specs)
SPECS = ("sweep", "tables", "tables-late")

#: each mode's flag (``--MODE``) and what it runs, in the order ``--help`` lists them
MODES = {
    "quick": "2 CPU cores, about 6 minutes (the default)",
    "tail": "2 CPU cores, about an hour: the quick model trained until the long tail clusters, CSE against dense and "
            "Switch over 3 seeds (the committed run)",
    "tables": "the paper's Tables 1-2 and a general-tasks table: every row for BERT and GPT, 3 pretraining seeds, at "
              "the quick model's size (2 CPU cores, see docs/tables.md); no figures",
    "tables-late": "the GPT rows of the tables as the sweep chose them: 2400 steps, every sparse row branched at step "
                   "1200, CSE with drift handling (docs/tables.md; hours of CPU)",
    "full": "sized for one GPU (GPT-2 small shape, 20k steps; hours)",
    "smoke": "every stage and every table row at toy size, a few minutes: checks the pipeline, the results mean "
             "nothing",
    "sweep": "the experiment that decides CSE: 3 seeds x arms (dense, CSE at the small-cluster rule, DEMix, Switch, "
             "CSE at the GC peak, drift handling, ...), each branched from its seed's dense trunk; hours of CPU, "
             "resumable per unit, --workers at once (docs/sweep.md; the spec: ntkscope experiment run sweep)",
}


def add_parsers(sub) -> None:
    """``ntkscope reproduce`` (and its ``--sweep``)."""
    rep = sub.add_parser("reproduce", help="the CSE paper's Figures 1-5 and Tables 1-2, from nothing",
                         description="Trains dense, Switch, CSE and domain-finetuned GPTs on a corpus pack, runs "
                         "every analysis and writes RUN/figures (PNG + PDF), RUN/tables (CSV + Markdown) and "
                         "RUN/manifest.json. Resumes from what RUN holds. Example: ntkscope reproduce --quick")
    size = rep.add_mutually_exclusive_group()
    for mode, text in MODES.items():
        size.add_argument(f"--{mode}", dest="mode", action="store_const", const=mode, help=text)
    rep.set_defaults(mode="quick")
    rep.add_argument("--arms", help="--sweep: a comma-separated subset of the arms (default: all, in order)")
    rep.add_argument("--threads", type=POSITIVE_INT,
                     help="torch threads of this process (default: torch's; --sweep, --tables, --tables-late: of "
                     "each unit, default 1)")
    rep.add_argument("--workers", type=POSITIVE_INT, default=1,
                     help="--sweep, --tables, --tables-late: units at once, each in a process of its own (default 1: "
                     "one after another in this process)")
    add_out(rep, kind="own", help="the run directory (default runs/reproduce-MODE)")
    rep.add_argument("--track-every", type=COUNT, default=0, metavar="STEPS",
                     help="also train the dense model with a GC tracker on Figure 3(a)'s sentences every STEPS steps "
                     "and draw fig3a-tracked from it (default 0: off)")
    rep.add_argument("--adopt", metavar="MODELS", help="a directory of trained model directories (e.g. a sweep's "
                     "RUN/models): a model this run would train is linked from there when one there trained exactly "
                     "the same (configuration compared field by field, a branch's start weights byte for byte)")
    rep.add_argument("--data", "--pack", dest="data", help="a corpus pack directory (default: the shipped one; "
                     "--pack: the same)")
    rep.set_defaults(run=_reproduce)
