"""Copy a sweep's finished results into the repository: ``python scripts/commit_sweep.py RUN``.

Writes the tables from every finished unit, the committed ones and RUN's
(:func:`ntkscope.reproduction.sweep_tables.summarise`, safe while workers run: it reads finished
units only), and copies into ``figures/sweep/``: the tables, the trunks' plans, each finished
unit's result and plan file. Checkpoints stay in RUN.

``--trunk NAME``: RUN's trunks are the seeds' trunks trained again (the first ones are gone with
their run directory). They are committed as arm NAME (kind dense), each of RUN's other units
records ``trunk: NAME`` and is paired with it, and their plans go to ``plans/NAME/``; units whose
arm is already committed are left out (the committed result stays).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from ntkscope.core.files import write_json
from ntkscope.reproduction.settings import settings_for
from ntkscope.reproduction.sweep import Sweep
from ntkscope.reproduction.sweep_tables import summarise

ROOT = Path(__file__).resolve().parents[1]


def _renamed(run: Path, to: Path, trunk: str) -> dict:
    """RUN's finished results as they are committed: {file name: result}."""
    committed = {json.loads(p.read_text())["arm"] for p in (to / "results").glob("*.json")}
    out = {}
    for path in sorted((run / "results").glob("*.json")):
        result = json.loads(path.read_text())
        if result["arm"] == "dense":
            result.update(arm=trunk, note=f"the seed's trunk trained again (run {run.name}): the trunk of this run's "
                                          "other units")
        elif result["arm"] in committed:
            continue
        else:
            result["trunk"] = trunk
        out[f"{result['arm']}-seed{result['seed']}.json"] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the sweep's run directory")
    parser.add_argument("--to", default=str(ROOT / "figures" / "sweep"))
    parser.add_argument("--trunk", help="commit RUN's trunks as this arm, a re-made set (see above)")
    args = parser.parse_args()
    run, to = Path(args.run), Path(args.to)
    if args.trunk:  # a merged run directory: the committed results, RUN's renamed, RUN's logs and routes
        merged = Path(tempfile.mkdtemp(prefix="sweep-commit-"))
        shutil.copytree(to / "results", merged / "results")
        for name, result in _renamed(run, to, args.trunk).items():
            write_json(merged / "results" / name, result)
        for folder in ("models", "routes", "encoder"):
            if (run / folder).is_dir():
                (merged / folder).symlink_to((run / folder).resolve())
        shutil.copy2(run / "settings.json", merged / "settings.json")
        sweep = Sweep(merged, settings_for("sweep"))
    else:
        sweep = Sweep(run, settings_for("sweep"))
    summarise(sweep, earlier_load=to / "tables" / "load.csv")  # units logged by an earlier run directory
    shutil.copytree(sweep.run_dir / "tables", to / "tables", dirs_exist_ok=True)
    shutil.copytree(sweep.run_dir / "results", to / "results", dirs_exist_ok=True)
    if (run / "plans").is_dir():
        shutil.copytree(run / "plans", to / "plans" / args.trunk if args.trunk else to / "plans", dirs_exist_ok=True)
    if (sweep.run_dir / "loads.png").is_file():
        shutil.copy2(sweep.run_dir / "loads.png", to / "loads.png")
    for arm, seed in sweep.units():
        plan = run / "models" / f"{arm.name}-seed{seed}" / "plan.json"
        if sweep.done(arm.name, seed) and plan.is_file():
            (to / "arm-plans").mkdir(parents=True, exist_ok=True)
            shutil.copy2(plan, to / "arm-plans" / f"{arm.name}-seed{seed}.json")
    for seed_routes in sorted((run / "routes").glob("seed*.json")) if (run / "routes").is_dir() else []:
        routes = json.loads(seed_routes.read_text())  # the router, not the 30k routes: they are remade from it
        (to / "routes").mkdir(parents=True, exist_ok=True)
        write_json(to / "routes" / seed_routes.name, {
            "names": routes["names"], "source": routes["source"],
            "blocks": {s: v["blocks"] for s, v in routes["splits"].items()},
            "digests": {s: v["digest"] for s, v in routes["splits"].items()}})
    print(f"copied {len(list((to / 'results').glob('*.json')))} finished units into {to}")


if __name__ == "__main__":
    main()
