"""The kinds of experiment a spec can be (``kind = "sweep"`` or ``"tables"``): one registered
:class:`ExperimentKind` each, in :data:`EXPERIMENT_KINDS`, holding what the runner asks of it:
its units before their keys (``drafts``), how one unit is done (``execute``), what a unit
writes (``outputs``), how the tables are built from the units that finished (``summarise``)
and what an earlier run's folder gives to adopt (``adopt``). :mod:`ntkscope.experiments.units`
keys the drafts and keeps each unit's state; the runner starts, retries and summarises through
this table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ntkscope.core.files import copy_linked, read_json_object, sha256_file, write_json, write_text
from ntkscope.core.registry import Registry
from ntkscope.reproduction import paper
from ntkscope.reproduction.arm_kinds import TRUNK, arm_kind
from ntkscope.reproduction.pipeline import Reproduction
from ntkscope.reproduction.sweep import Sweep, conversion_step
from ntkscope.reproduction.sweep_tables import summarise


@dataclass(frozen=True)
class ExperimentKind:
    """One kind of experiment: ``drafts(spec)`` its units as (name, seed, what, needs);
    ``execute(spec, run_dir, unit, pack)`` does one (its needs done) and returns what its state
    records; ``outputs(spec, run_dir, unit)`` the paths it writes; ``summarise(spec, run_dir, pack,
    finished)`` writes RUN/tables from the units named in ``finished`` and returns a summary;
    ``adopt(source, run_dir)`` takes what an earlier run's folder ``source`` holds beside its units'
    results into ``run_dir`` and returns {unit name: record} for units whose result is a record
    rather than a file of ``source`` (``ntkscope experiment run --adopt``)."""

    name: str
    drafts: Callable
    execute: Callable
    outputs: Callable
    summarise: Callable
    adopt: Callable


#: every kind of experiment, by name
EXPERIMENT_KINDS = Registry("experiment kind")


def model_digest(directory) -> str:
    """The sha256 of an HF model directory's config.json and weights: a trunk that starts from
    another model (or the same one changed) has another key."""
    files = {name: sha256_file(Path(directory) / name) for name in ("config.json", "model.safetensors",
                                                                      "pytorch_model.bin")
             if (Path(directory) / name).is_file()}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def sweep_drafts(spec) -> list:
    """A sweep's units before their keys: (name, seed, what, needs) for each trunk, plan and arm."""
    arms, seeds_of = list(spec.arms), {a.name: a.seeds or spec.seeds for a in spec.arms}
    trunk = next(a for a in arms if a.kind == TRUNK)
    t = spec.trunk
    drafts = []
    own = {"model": model_digest(t.model)} if t.model else {}  # the preset's GPT: no key field (keys unchanged)
    for seed in spec.seeds:
        drafts.append((f"{trunk.name}-seed{seed}", seed, {"kind": "trunk", "arm": trunk.name,
                                                          "gc_peak_step": t.gc_peak_step, **own}, []))
    rule_seeds = sorted({s for a in arms if a.convert_at == "rule" for s in seeds_of[a.name]})
    structure = {} if t.structure is None else {"structure": dataclasses.asdict(t.structure)}
    for seed in spec.seeds if t.structure is not None else rule_seeds:  # the structure rule is judged in every trunk
        drafts.append((f"plan-seed{seed}", seed, {"kind": "plan", "layers": list(t.layers),
                                                  "rule": dataclasses.asdict(t.rule), **structure},
                       [f"{trunk.name}-seed{seed}"]))
    for arm in arms:
        if arm is trunk:
            continue
        for seed in seeds_of[arm.name]:
            what = {"kind": "arm", **dataclasses.asdict(arm), "layers": list(arm.layers or t.layers),
                    "at": conversion_step(arm.convert_at, steps=spec.settings.steps, gc_peak_step=t.gc_peak_step),
                    **arm_kind(arm.kind).key(t)}
            # the tables' line and where it runs are not what the unit computes; the step is keyed as
            # "at", the name units were first keyed under (a key must not change with a field's name)
            del what["what"], what["seeds"], what["convert_at"]
            if arm.counts_from is None:  # left out when unset, so that an arm without it keeps its key
                del what["counts_from"]
            needs = [f"{trunk.name}-seed{seed}"] + ([f"plan-seed{seed}"] if arm.convert_at == "rule" else [])
            drafts.append((f"{arm.name}-seed{seed}", seed, what, needs))
    return drafts


def table_drafts(spec) -> list:
    """A tables experiment's units before their keys: (name, seed, what, needs) per row."""
    drafts = []
    for arch in spec.archs:
        for seed in spec.seeds:
            for row in spec.rows:
                if row == "dense":
                    needs = []
                elif row.startswith(("dense-", "switch-")):
                    needs = [f"{arch}-{row.split('-', 1)[0]}-seed{seed}"]
                else:
                    needs = [f"{arch}-dense-seed{seed}"]
                drafts.append((f"{arch}-{row}-seed{seed}", seed, {"kind": "row", "arch": arch, "row": row}, needs))
    return drafts


def make_sweep(spec, run_dir, pack=None):
    """The :class:`~ntkscope.reproduction.sweep.Sweep` of a sweep spec in ``run_dir``."""
    t = spec.trunk
    return Sweep(run_dir, spec.settings, list(spec.arms), seeds=spec.seeds, layers=t.layers,
                 gc_peak_step=t.gc_peak_step, rule=t.rule, null_order=t.null_order, pack=pack,
                 encoder=t.encoder or None, structure=t.structure, model=t.model or None)


def make_reproduction(spec, run_dir, pack=None):
    """The :class:`~ntkscope.reproduction.pipeline.Reproduction` of a tables spec in ``run_dir``."""
    return Reproduction(run_dir, spec.settings.mode, settings=spec.settings, pack=pack)


# ---- a sweep ------------------------------------------------------------------------------------

def execute_sweep_unit(spec, run_dir: Path, unit, pack=None) -> dict:
    """A sweep's unit: a trunk, a plan or an arm of one seed, trained and evaluated."""
    what = unit.what
    sweep = make_sweep(spec, run_dir, pack)
    if what["kind"] == "plan":
        plan = sweep.plan(unit.seed)
        return {"result": f"plans/seed{unit.seed}.json", "warmup": int(plan.convert_at),
                "warmup_rule": plan.warmup_rule}
    arm = sweep.arm(what["arm"] if what["kind"] == "trunk" else what["name"])
    result = sweep.run_unit(arm, unit.seed)
    return {"result": f"results/{arm.name}-seed{unit.seed}.json",
            **{k: v for k, v in result.items() if k.startswith("ppl") or k in ("warmup", "same_as")}}


def sweep_outputs(spec, run_dir: Path, unit) -> list[Path]:
    if unit.what["kind"] == "plan":
        return [run_dir / "plans" / f"seed{unit.seed}.json"]
    arm = unit.what["arm"] if unit.what["kind"] == "trunk" else unit.what["name"]
    return [run_dir / "results" / f"{arm}-seed{unit.seed}.json", run_dir / "models" / f"{arm}-seed{unit.seed}"]


def summarise_sweep(spec, run_dir: Path, pack, finished: set) -> dict:
    """The sweep's tables and verdict (:func:`ntkscope.reproduction.sweep_tables.summarise`)."""
    adopted = run_dir / "adopted" / "load.csv"
    return summarise(make_sweep(spec, run_dir, pack), earlier_load=adopted if adopted.is_file() else None,
                     criteria=spec.criteria)


def adopt_sweep(source: Path, run_dir: Path) -> dict:
    """Every result record in ``source`` (the spec's units and others, e.g. re-made trunks: the
    tables are built from every finished record, as the committed ones were) and its load table
    (for units whose training logs are not there) copied into ``run_dir``; no records by name."""
    for path in sorted((source / "results").glob("*.json")):
        copy_linked(path, run_dir / "results" / path.name)
    if (source / "tables" / "load.csv").is_file():
        copy_linked(source / "tables" / "load.csv", run_dir / "adopted" / "load.csv")
    return {}


# ---- the paper's tables -------------------------------------------------------------------------

def execute_table_row(spec, run_dir: Path, unit, pack=None) -> dict:
    """A tables experiment's unit: one row of one architecture and seed, trained and evaluated."""
    what = unit.what
    rep = make_reproduction(spec, run_dir, pack)
    rep.timings_path = run_dir / "timings" / f"{unit.name}.json"  # one file per unit: workers run side by side
    rep.timings_path.parent.mkdir(parents=True, exist_ok=True)
    found = paper.evaluate_row(rep, what["arch"], what["row"], unit.seed)
    record = {"arch": what["arch"], "key": what["row"], "model": paper.row_label(what["arch"], what["row"]),
              "seed": unit.seed, **found}
    write_json(run_dir / "results" / f"{unit.name}.json", record)
    return {"result": f"results/{unit.name}.json"}


def table_outputs(spec, run_dir: Path, unit) -> list[Path]:
    name = paper.model_name(unit.what["arch"], unit.what["row"], unit.seed)
    return [run_dir / "results" / f"{unit.name}.json", run_dir / "models" / name]


def table_records(spec, run_dir: Path, finished: set) -> pd.DataFrame:
    """The rows of a tables experiment named in ``finished``, one per model and seed, in the
    paper's order (architecture, seed, row)."""
    rows = []
    for arch in spec.archs:
        for seed in spec.seeds:
            for row in spec.rows:
                name = f"{arch}-{row}-seed{seed}"
                path = run_dir / "results" / f"{name}.json"
                if name in finished and path.is_file():
                    rows.append(json.loads(path.read_text()))
    return pd.DataFrame(rows)


def summarise_tables(spec, run_dir: Path, pack, finished: set) -> dict:
    """The paper's tables (CSV and paper.md) from the rows that finished."""
    runs = table_records(spec, run_dir, finished)
    tables = paper.tables_from_runs(runs, spec.settings)
    for name, frame in tables.items():
        write_text(run_dir / "tables" / f"{name}.csv", frame.to_csv(index=False))
    write_text(run_dir / "tables" / "paper.md", paper.markdown(tables, spec.settings))
    return {"rows": len(runs)}


def adopt_tables(source: Path, run_dir: Path) -> dict:
    """{unit name: record} from a tables run's results (RUN/results/*.json) or its committed
    ``tables/paper_runs.csv`` (floats read back exactly; an absent measurement stays absent)."""
    out = {p.stem: read_json_object(p, "experiment") for p in sorted((source / "results").glob("*.json"))}
    csv = source / "tables" / "paper_runs.csv"
    if csv.is_file():
        frame = pd.read_csv(csv)  # pandas reads floats back exactly (round trip)
        frame["experts"] = frame["experts"].fillna("")
        for row in frame.to_dict("records"):
            record = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
            out.setdefault(f"{row['arch']}-{row['key']}-seed{row['seed']}", record)
    return out


EXPERIMENT_KINDS.add("sweep", ExperimentKind("sweep", sweep_drafts, execute_sweep_unit, sweep_outputs,
                                             summarise_sweep, adopt_sweep), func="EXPERIMENT_KINDS")
EXPERIMENT_KINDS.add("tables", ExperimentKind("tables", table_drafts, execute_table_row, table_outputs,
                                              summarise_tables, adopt_tables), func="EXPERIMENT_KINDS")
