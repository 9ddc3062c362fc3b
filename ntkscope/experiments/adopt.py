"""Adopting finished units from elsewhere, and reading a tables experiment's records.

``ntkscope experiment run SPEC --adopt DIR``: DIR is an earlier run directory of the same kind,
or the committed copy of one (``figures/sweep``: results, plans and the load table;
``figures/tables-late``: ``tables/paper_runs.csv``). Each unit of the spec whose result DIR holds
counts as done under the spec's key, with ``adopted_from`` in its state; its model directory is
copied too when DIR has it (hard links where the file system allows), so later units can branch
from it. The sweep's other records in DIR (e.g. re-made trunks) are copied beside them: the
tables are built from every finished record, as the committed ones were.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import MissingInput
from ntkscope.core.files import read_json_object, write_json
from ntkscope.experiments.spec import Spec
from ntkscope.experiments.units import Unit, is_done, outputs, read_state, write_state

log = logging.getLogger(__name__)


def _copy(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        def link(a, b):
            try:
                os.link(a, b)
            except OSError:
                shutil.copy2(a, b)
        shutil.copytree(src, dst, copy_function=link)
    else:
        shutil.copy2(src, dst)


def adopt_units(spec: Spec, run_dir: Path, todo: list[Unit], source: Path) -> list[str]:
    """Mark the units of ``todo`` whose results ``source`` holds as done in ``run_dir``; returns their names."""
    if not source.is_dir():
        raise MissingInput(f"experiment: --adopt {source} is not a directory (an earlier run directory, or "
                           "committed results such as figures/sweep)")
    records = _table_records_from(source) if spec.kind == "tables" else {}
    if spec.kind == "sweep":
        for path in sorted((source / "results").glob("*.json")):  # every record, the spec's units and others
            _copy(path, run_dir / "results" / path.name)
        load = source / "tables" / "load.csv"
        if load.is_file():
            _copy(load, run_dir / "adopted" / "load.csv")
    adopted = []
    for unit in todo:
        if is_done(read_state(run_dir, unit.name), unit, run_dir):
            continue
        result, *model = outputs(spec, run_dir, unit)  # the result, and the model directory if the unit has one
        theirs = source / result.relative_to(run_dir)
        if spec.kind == "tables":
            if unit.name not in records:
                continue
            write_json(result, records[unit.name])
        elif not theirs.is_file() and not result.is_file():
            continue
        if model and (source / model[0].relative_to(run_dir)).is_dir():
            _copy(source / model[0].relative_to(run_dir), model[0])
        if not result.is_file():
            _copy(theirs, result)
        write_state(run_dir, unit.name, {"name": unit.name, "key": unit.key, "status": "done", "attempts": 0,
                                         "adopted_from": str(source), "result": str(result.relative_to(run_dir)),
                                         "model": str(model[0].relative_to(run_dir)) if model and model[0].is_dir()
                                         else None})
        adopted.append(unit.name)
    log.info("experiment: adopted %d units from %s", len(adopted), source)
    return adopted


def _table_records_from(source: Path) -> dict:
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
