"""Figure 3(a) of a committed reproduction measured from inside training, by the GC tracker.

    python scripts/track_tail.py [--committed figures/tail] [--work runs/tail-tracked] [--every 25]

The committed runs keep no checkpoints. This trains the dense GPT again with the committed
mode's settings and a :class:`ntkscope.GCTracker` on Figure 3(a)'s sentences (draw 0: the same
sentences, long tail, pools, output and statistics as ``gc_over_steps.csv``) every ``--every``
steps (resumable: the run and the tracker continue from the last checkpoint), then copies its
table (``tables/gc_tracked.csv``) into ``--committed``, draws ``fig3a-tracked`` from it there,
and records both in the manifest under ``tracked``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from ntkscope.core.files import write_json
from ntkscope.core.provenance import environment
from ntkscope.reproduction.pipeline import Reproduction, sha256_file
from ntkscope.reproduction.settings import settings_for

log = logging.getLogger("track")


def track(committed: Path, work: Path, every: int) -> dict:
    mode = json.loads((committed / "settings.json").read_text())["settings"]["mode"]
    settings = settings_for(mode, track_every=every)
    rep = Reproduction(work, mode, settings=settings)
    rep.tables("fig3-tracked")
    shutil.copy(work / "tables" / "gc_tracked.csv", committed / "tables" / "gc_tracked.csv")
    figures = [str(p.relative_to(committed)) for p in
               Reproduction(committed, mode, settings=settings).write_figure("fig3a-tracked")]
    timings = json.loads((work / "timings.json").read_text())
    manifest = json.loads((committed / "manifest.json").read_text())
    manifest["tracked"] = {
        "what": "the dense run trained again with a GC tracker on Figure 3(a)'s sentences (draw 0) every "
                f"{every} steps; gc_tracked.csv is the tracker's table, fig3a-tracked is drawn from it",
        "every": every, "seconds": round(timings.get("train gpt-dense-tracked", 0) + timings.get("fig3 tracked", 0), 1),
        "environment": environment(),
        "files": ["tables/gc_tracked.csv", *figures]}
    for path in manifest["tracked"]["files"]:
        manifest["files"][path] = sha256_file(committed / path)
    write_json(committed / "manifest.json", manifest)
    return manifest["tracked"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--committed", default="figures/tail")
    parser.add_argument("--work", default="runs/tail-tracked")
    parser.add_argument("--every", type=int, default=25)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(track(Path(args.committed), Path(args.work), args.every), indent=2))


if __name__ == "__main__":
    main()
