"""Train and evaluate some rows of a tables run in a process of their own, beside others.

``ntkscope reproduce --tables...`` trains its rows one after another in one process and holds
the run directory's lock. To use two cores with one thread each, train disjoint sets of rows in
two processes of this script, then run the command: it finds every row evaluated and writes the
tables::

    python scripts/table_rows.py RUN --mode tables-late --adopt SWEEP/models --seeds 0 --prepare
    python scripts/table_rows.py RUN --mode tables-late --rows dense,dense-legal,... --seeds 0,1,2 &
    python scripts/table_rows.py RUN --mode tables-late --rows cse-mof,cse-moa,demix --seeds 0,1,2 &
    wait; python scripts/table_rows.py RUN --mode tables-late --merge-timings
    ntkscope reproduce --tables-late --out RUN --adopt SWEEP/models

``--prepare`` trains (or adopts) the dense row of each seed first, so that the two processes do
not both make it. Each process adds its stage times to ``RUN/timings-ROWS-seedSEEDS.json``;
``--merge-timings`` adds those into ``RUN/timings.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import torch

from ntkscope.core.files import write_json
from ntkscope.reproduction import paper
from ntkscope.reproduction.pipeline import Reproduction
from ntkscope.reproduction.settings import settings_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--mode", default="tables-late")
    parser.add_argument("--arch", default="gpt", choices=sorted(paper.ARCH_NAMES))
    parser.add_argument("--rows", default="", help="comma-separated row keys (paper.row_keys)")
    parser.add_argument("--seeds", default="", help="comma-separated pretraining seeds")
    parser.add_argument("--adopt", default="", help="as ntkscope reproduce --adopt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prepare", action="store_true", help="only the dense row of each seed")
    parser.add_argument("--merge-timings", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.merge_timings:
        total = json.loads((args.run / "timings.json").read_text()) if (args.run / "timings.json").is_file() else {}
        for side in sorted(args.run.glob("timings-*.json")):
            for stage, seconds in json.loads(side.read_text()).items():
                total[stage] = round(total.get(stage, 0.0) + seconds, 1)
            side.unlink()
        write_json(args.run / "timings.json", total)
        return
    torch.set_num_threads(args.threads)
    rep = Reproduction(args.run, args.mode, settings=settings_for(args.mode, adopt_from=args.adopt))
    keys = paper.row_keys(rep.settings)
    rows = ["dense"] if args.prepare else [k.strip() for k in args.rows.split(",") if k.strip()]
    unknown = sorted(set(rows) - set(keys))
    if unknown or not rows:
        parser.error(f"--rows must name rows of {keys} (got {unknown or rows})")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(
        range(rep.settings.seed, rep.settings.seed + rep.settings.seeds))
    tag = re.sub(r"[^a-z0-9]+", "-", f"{','.join(rows)}-seed{'-'.join(map(str, seeds))}")
    rep.timings_path = args.run / f"timings-{tag}.json"
    for seed in seeds:
        for key in rows:
            if args.prepare:
                paper.train_row(rep, args.arch, key, seed)
            else:
                paper.evaluate_row(rep, args.arch, key, seed)


if __name__ == "__main__":
    main()
