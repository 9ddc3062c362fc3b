"""Adopting finished units from elsewhere; each experiment kind reads its own records
(:attr:`~ntkscope.experiments.kinds.ExperimentKind.adopt`).

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
from pathlib import Path

from ntkscope.core.checks import MissingInput
from ntkscope.core.files import copy_linked, write_json
from ntkscope.experiments.kinds import EXPERIMENT_KINDS
from ntkscope.experiments.spec import Spec
from ntkscope.experiments.units import Unit, is_done, outputs, read_state, write_state

log = logging.getLogger(__name__)


def adopt_units(spec: Spec, run_dir: Path, todo: list[Unit], source: Path) -> list[str]:
    """Mark the units of ``todo`` whose results ``source`` holds as done in ``run_dir``; returns their names."""
    if not source.is_dir():
        raise MissingInput(f"experiment: --adopt {source} is not a directory (an earlier run directory, or "
                           "committed results such as figures/sweep)")
    records = EXPERIMENT_KINDS.get_one(spec.kind, func="adopt_units").adopt(source, run_dir)
    adopted = []
    for unit in todo:
        if is_done(read_state(run_dir, unit.name), unit, run_dir):
            continue
        result, *model = outputs(spec, run_dir, unit)  # the result, and the model directory if the unit has one
        theirs = source / result.relative_to(run_dir)
        if unit.name in records:
            write_json(result, records[unit.name])
        elif not theirs.is_file():  # the source does not hold it
            continue
        if model and (source / model[0].relative_to(run_dir)).is_dir():
            copy_linked(source / model[0].relative_to(run_dir), model[0])
        if not result.is_file():
            copy_linked(theirs, result)
        write_state(run_dir, unit.name, {"name": unit.name, "key": unit.key, "status": "done", "attempts": 0,
                                         "adopted_from": str(source), "result": str(result.relative_to(run_dir)),
                                         "model": str(model[0].relative_to(run_dir)) if model and model[0].is_dir()
                                         else None})
        adopted.append(unit.name)
    log.info("experiment: adopted %d units from %s", len(adopted), source)
    return adopted
