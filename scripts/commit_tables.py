"""Copy a tables run's results into the repository: ``python scripts/commit_tables.py RUN DEST``
(e.g. ``runs/tables-late figures/tables-late``).

Copies what ``ntkscope reproduce --tables...`` wrote (``tables/*.csv``, ``tables/paper.md``,
``settings.json``, ``manifest.json``, ``timings.json``) and writes ``adopted.json``: each model that
was linked from another run rather than trained (``--adopt``), with its source. Models stay in RUN.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ntkscope.core.files import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    if not (args.run / "manifest.json").is_file():
        parser.error(f"{args.run} has no manifest.json: run ntkscope reproduce on it first")
    (args.dest / "tables").mkdir(parents=True, exist_ok=True)
    for path in [*sorted((args.run / "tables").glob("*.csv")), args.run / "tables" / "paper.md"]:
        shutil.copy2(path, args.dest / "tables" / path.name)
    for name in ("settings.json", "manifest.json", "timings.json"):
        shutil.copy2(args.run / name, args.dest / name)
    adopted = {p.parent.name: json.loads(p.read_text())["source"]
               for p in sorted((args.run / "models").glob("*/adopted.json"))}
    write_json(args.dest / "adopted.json", adopted)
    print(f"copied {args.run} into {args.dest} ({len(adopted)} models adopted from another run)")


if __name__ == "__main__":
    main()
