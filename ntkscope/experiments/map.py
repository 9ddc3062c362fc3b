"""The warm-up map's summary: from the finished units of one or more run directories,
each a build of the trunks (its units paired with its own trunks), the paired gains with their block-bootstrap intervals, the pre-registered
verdicts (figures/warmup-map/CRITERIA.md) and the controls' figure
(:mod:`ntkscope.reproduction.map_tables` computes them, :mod:`ntkscope.reproduction.map_figures` draws them)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ntkscope.core.checks import UserError
from ntkscope.core.files import write_json, write_table
from ntkscope.experiments.runner import spec_pack
from ntkscope.experiments.spec import Spec
from ntkscope.experiments.kinds import make_sweep
from ntkscope.experiments.units import units
from ntkscope.plotting import save_figure
from ntkscope.representation.plan import plan_step
from ntkscope.reproduction.map_figures import map_controls, map_curve, trunk_curves
from ntkscope.reproduction.map_tables import (count_verdicts, fits_its_data, gains, read_results, trunk_perplexities,
                                              verdicts)


#: the count question's margin, registered before its units ran (figures/warmup-map/count/CRITERIA.md):
#: sqrt(2) x the warm-up map's null spread at step 1200, in log perplexity
COUNT_MARGIN = 0.0416


def trunks_label(run: Path) -> str:
    """A run directory's build of the trunks: ``device.json``'s ``gpu`` when it has one (a trunk
    re-made on another GPU kind is another model), else the directory's name."""
    path = Path(run) / "device.json"
    return str(json.loads(path.read_text())["gpu"]) if path.is_file() else Path(run).name


def verdict_step(spec: Spec) -> int:
    """The step the verdicts pair arms at: the conversion step of the spec's first criteria arm
    (``cse-at1200`` in the map's specs), or 1200 when that arm's step is not a number."""
    named = {a.name: a for a in spec.arms}
    first = named.get(spec.criteria.arms[0]) if spec.criteria.arms else None
    return first.convert_at if first is not None and isinstance(first.convert_at, int) else 1200


def summarise_map(runs, out, spec: Spec, *, pack=None, against=None) -> dict:
    """The map's tables from the finished units of ``runs`` (run directories of ``spec``'s
    experiment and of its companions; a unit name found in several is taken from the first): each
    unit is paired with the trunks of its own run directory (``trunks`` in the table: its build,
    :func:`trunks_label`), the verdicts say which pairs crossed builds. Writes
    OUT/tables/gains.csv, OUT/tables/verdicts.json, OUT/controls.png, when an arm converted at
    several steps OUT/map.png, and when OUT/tables/curves.csv holds the trunks' validation curves
    OUT/curves.png; ``against``: another run directory whose dense trunks were tested on the same
    blocks (e.g. a smaller model's), compared trunk by trunk per domain in OUT/tables/trunks.csv
    and the verdict ``fits_its_data``; returns the verdicts."""
    runs = [Path(r) for r in runs]
    blocks = make_sweep(spec, runs[0], spec_pack(spec, runs[0], pack, build=False, func="summarise_map")).test_blocks()
    domains = [blocks.domain_names[int(d)] for d in blocks.domains]
    tables, taken = [], set()
    for run in runs:
        results = read_results(run)
        mine = {n: r for n, r in results.items() if n not in taken or n.startswith("dense-seed")}
        tables.append(gains(mine, domains, trunks=trunks_label(run), tail=spec.settings.finetune_domains))
        taken |= set(results)
    table = pd.concat([t for t in tables if len(t)] or tables[:1], ignore_index=True)
    plans = {}
    for run in reversed(runs):  # the first run's, as for results
        for p in sorted((run / "plans").glob("seed*.json")):
            plans[int(p.stem.removeprefix("seed"))] = {**json.loads(p.read_text()), "trunks": trunks_label(run)}
    found = verdicts(table, spec.seeds, step=verdict_step(spec), plans=plans)
    if {"cse-at1200-k300", "cse-at300-k1200"} <= {a.name for a in spec.arms}:  # the count question, its margin
        found["count"] = count_verdicts(table, spec.seeds, COUNT_MARGIN)
    if against is not None:
        mine, theirs = read_results(runs[0]), read_results(against)
        check_same_blocks(mine, theirs, against)
        trunk_table = pd.concat([trunk_perplexities(mine, domains, spec.name),
                                 trunk_perplexities(theirs, domains, Path(against).name)], ignore_index=True)
        found["fits_its_data"] = fits_its_data(trunk_table, spec.name, Path(against).name)
    planned = {u.name for u in units(spec, "")}
    done = taken | {f"plan-seed{s}" for s in plans}
    found["units"] = {"spec": spec.name, "planned": len(planned), "done": len(planned & done)}
    out = Path(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    write_table(table, out / "tables" / "gains.csv")
    write_json(out / "tables" / "verdicts.json", found)
    if against is not None:
        write_table(trunk_table, out / "tables" / "trunks.csv")
    save_figure(map_controls(table, step=found["step"]), out / "controls.png")
    rule = {s: plan_step(p) for s, p in plans.items() if p.get("warmup_rule") == "consensus-structure"}
    if len(table) and table.groupby("arm")["step"].nunique().max() > 1:  # a curve needs two conversion steps
        save_figure(map_curve(table, plan_structure(plans), rule, total_steps=spec.settings.steps),
                    out / "map.png")
    else:
        (out / "map.png").unlink(missing_ok=True)  # an earlier summary's curve is not this one's
    curves = out / "tables" / "curves.csv"  # the trunks' validation curves, when a run logged them
    trunk = pd.read_csv(curves) if curves.is_file() else None
    if trunk is not None and (trunk["arm"] == "dense").any():
        cse = table[(table["domain"] == "tail") & (table["arm"] == "cse")]
        best = cse.loc[cse.groupby("seed")["gain"].idxmin(), "step"].tolist() if len(cse) else []
        save_figure(trunk_curves(trunk, best_steps=best), out / "curves.png")
    return found


def check_same_blocks(mine: dict, theirs: dict, against) -> None:
    """Refuse to compare trunks whose results were not measured on the same test blocks (their
    per-block token counts differ)."""
    tokens = [next((r["blocks"]["tokens"] for n, r in sorted(res.items()) if n.startswith("dense-seed")
                    and "blocks" in r), None) for res in (mine, theirs)]
    if None in tokens or tokens[0] != tokens[1]:
        raise UserError(f"experiment map: --against {against}: its dense trunks were not tested on the same blocks "
                        "as this run's (their per-block token counts differ, or one has no trunk with per-block "
                        "losses)")


def plan_structure(plans: dict) -> pd.DataFrame:
    """step, seed, structure: each plan's consensus structure over the checkpoints of its rule's
    window (the later ones cannot show persistence yet), averaged over the layers the rule judged
    (its ``judged_at_layers``)."""
    rows = []
    for seed, plan in sorted(plans.items()):
        evidence = plan.get("evidence") or {}
        rule = evidence.get("structure_rule", {})
        layers, window = rule.get("judged_at_layers", []), set(rule.get("window", []))
        tables = [pd.DataFrame(evidence["structure"][str(L)]) for L in layers if str(L) in evidence.get("structure", {})]
        if tables:
            mean = pd.concat(tables).groupby("step")["structure"].mean()
            rows += [{"step": int(s), "seed": seed, "structure": float(v)} for s, v in mean.items()
                     if not window or int(s) in window]
    return pd.DataFrame(rows, columns=["step", "seed", "structure"])
