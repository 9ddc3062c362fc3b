"""Copy a sweep's finished results into the repository: ``python scripts/commit_sweep.py RUN``.

Writes RUN/tables from the units that finished (:func:`ntkscope.reproduction.sweep_tables.summarise`,
safe while workers run: it reads finished units only) and copies into ``figures/sweep/``: the
tables, the trunks' plans, each finished unit's result and plan file. Checkpoints stay in RUN.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ntkscope.reproduction.settings import settings_for
from ntkscope.reproduction.sweep import Sweep
from ntkscope.reproduction.sweep_tables import summarise

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the sweep's run directory")
    parser.add_argument("--to", default=str(ROOT / "figures" / "sweep"))
    args = parser.parse_args()
    sweep = Sweep(args.run, settings_for("sweep"))
    to = Path(args.to)
    summarise(sweep, earlier_load=to / "tables" / "load.csv")  # units logged by an earlier run directory
    for folder in ("tables", "plans", "results"):
        if (sweep.run_dir / folder).is_dir():
            shutil.copytree(sweep.run_dir / folder, to / folder, dirs_exist_ok=True)
    if (sweep.run_dir / "loads.png").is_file():
        shutil.copy2(sweep.run_dir / "loads.png", to / "loads.png")
    for arm, seed in sweep.units():
        plan = sweep.model_dir(arm.name, seed) / "plan.json"
        if sweep.done(arm.name, seed) and plan.is_file():
            (to / "arm-plans").mkdir(parents=True, exist_ok=True)
            shutil.copy2(plan, to / "arm-plans" / f"{arm.name}-seed{seed}.json")
    print(f"copied {len(list((to / 'results').glob('*.json')))} finished units into {to}")


if __name__ == "__main__":
    main()
