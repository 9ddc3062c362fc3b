"""The warm-up map's summary (issue 42): from the finished units of one or more run directories
on the same trunks, the paired gains with their block-bootstrap intervals, the pre-registered
verdicts (figures/warmup-map/CRITERIA.md) and the controls' figure
(:mod:`ntkscope.reproduction.map_tables` computes them)."""

from __future__ import annotations

import json
from pathlib import Path

from ntkscope.core.files import write_json, write_table
from ntkscope.experiments.spec import Spec
from ntkscope.experiments.units import make_sweep, units
from ntkscope.plotting import map_controls, save_figure
from ntkscope.reproduction.map_tables import gains, read_results, verdicts


def summarise_map(runs, out, spec: Spec, *, pack=None) -> dict:
    """The map's tables from the finished units of ``runs`` (run directories of ``spec``'s
    experiment and of its companions on the same trunks; a unit name found in several is taken
    from the first): OUT/tables/gains.csv, OUT/tables/verdicts.json and OUT/controls.png.
    Returns the verdicts."""
    results = {}
    for run in reversed([Path(r) for r in runs]):
        results.update(read_results(run))
    blocks = make_sweep(spec, Path(runs[0]), pack).test_blocks()
    table = gains(results, [blocks.domain_names[int(d)] for d in blocks.domains])
    plans = {int(p.stem.removeprefix("seed")): json.loads(p.read_text())  # the first run's, as for results
             for r in reversed([Path(r) for r in runs]) for p in sorted((r / "plans").glob("seed*.json"))}
    found = verdicts(table, spec.seeds, plans=plans)
    planned = {u.name for u in units(spec, "")}
    found["units"] = {"spec": spec.name, "planned": len(planned), "done": len(planned & set(results))}
    out = Path(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    write_table(table, out / "tables" / "gains.csv")
    write_json(out / "tables" / "verdicts.json", found)
    save_figure(map_controls(table), out / "controls.png")
    return found
