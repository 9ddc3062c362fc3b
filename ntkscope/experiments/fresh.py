"""The fresh trunks' summary (figures/warmup-map/fresh/CRITERIA.md): each family's summarised
folder (``ntkscope experiment map`` output with results/, plans/, tables/gains.csv and
tables/curves.csv, named by its spec: warmup-fresh, warmup-fresh-half, warmup-fresh-mix) judged
by :func:`ntkscope.reproduction.fresh_tables.fresh_verdicts`.

    python -m ntkscope.experiments.fresh figures/warmup-map/fresh/warmup-fresh ... \\
        --out figures/warmup-map/fresh
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from ntkscope.core.files import write_json, write_table
from ntkscope.experiments.spec import load_spec
from ntkscope.reproduction.fresh_tables import Family, fresh_verdicts

#: the signals' thresholds fit on all of the map's trunks, committed before the fresh trunks ran
THRESHOLDS = Path("figures/warmup-map/signals/rule.json")


def load_family(folder: Path) -> Family:
    """A summarised fresh family: FOLDER/tables/gains.csv, FOLDER/plans/seedN.json,
    FOLDER/tables/curves.csv (optional), FOLDER/probe/trunk-seedN.csv (the trunk probe's tables,
    optional) and the ``device`` (or ``gpu``) of FOLDER/device.json,
    else of the fresh set's device.json beside it (optional); its spec is the folder's name."""
    folder = Path(folder)
    spec = load_spec(folder.name)
    gains = pd.read_csv(folder / "tables" / "gains.csv")
    plans = {int(p.stem.removeprefix("seed")): json.loads(p.read_text())
             for p in sorted((folder / "plans").glob("seed*.json"))}
    curves = folder / "tables" / "curves.csv"
    device = next((p for p in (folder / "device.json", folder.parent / "device.json") if p.is_file()),
                  folder / "device.json")  # the family's own record, else the fresh set's (CRITERIA.md)
    probes = {int(p.stem.removeprefix("trunk-seed")): pd.read_csv(p)
              for p in sorted((folder / "probe").glob("trunk-seed*.csv"))}
    return Family(spec.name, gains, plans, int(spec.settings.steps), tuple(spec.seeds),
                  pd.read_csv(curves) if curves.is_file() else None,
                  _device(json.loads(device.read_text())) if device.is_file() else "", probes or None)


def _device(record: dict) -> str:
    return str(record.get("device") or record.get("gpu") or "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("figures/warmup-map/fresh"))
    args = parser.parse_args(argv)
    thresholds = json.loads(THRESHOLDS.read_text())["thresholds"]
    found, trunks = fresh_verdicts([load_family(f) for f in args.folders], thresholds)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(trunks, args.out / "trunks.csv")
    write_json(args.out / "verdicts.json", found)
    print(json.dumps(found["rule_on_fresh_trunks"], indent=1))
    print(json.dumps({k: found["tail_expert"][k] for k in ("verdict", "good", "judged", "planned")}))


if __name__ == "__main__":
    main()
