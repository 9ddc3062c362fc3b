"""Re-make the dense run of a committed reproduction and re-measure the figures that read only it.

    python scripts/remake_dense_figures.py [--committed figures/tail] [--work runs/tail-remade]

The committed runs keep no checkpoints. This trains the dense GPT again with the committed
settings (resumable: an interrupted run continues from its last checkpoint), measures the
stages that read only the dense run (Figure 1, Figure 2a, Figure 3 and Figure 4's tables) with
the current code, writes ``plan_rechecked.json`` (the plan the current rules make from these
tables, beside the committed ``plan.json`` that the CSE and Switch runs were built from),
redraws every panel whose tables it has (the others from the committed tables), and copies
tables, figures, settings and timings into ``--committed``, with a ``remade`` entry in its
manifest saying which files came from the re-made run.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

from ntkscope.core.files import write_json
from ntkscope.reproduction.panels import PANELS, STAGES
from ntkscope.core.provenance import environment
from ntkscope.reproduction.pipeline import Reproduction, sha256_file

DENSE_STAGES = ("fig1", "fig2a", "fig3", "fig4")
log = logging.getLogger("remake")


def remake(committed: Path, work: Path) -> dict:
    settings = json.loads((committed / "settings.json").read_text())
    mode = settings["settings"]["mode"]
    work.mkdir(parents=True, exist_ok=True)
    (work / "settings.json").unlink(missing_ok=True)  # the current preset (it may hold new GC settings)
    rep = Reproduction(work, mode)
    shutil.copy(committed / "plan.json", work / "plan.json")  # Figure 4 draws the committed plan's layer
    rep.dense_run()
    written = []
    for stage in DENSE_STAGES:
        rep.tables(stage)
        written += [f"tables/{name}.{'npz' if name == 'kernels' else 'csv'}" for name in STAGES[stage].names]
    plan = rep.measured_plan()
    plan.save(work / "plan_rechecked.json")
    log.info("plan re-made: layers %s, warm-up %s (%s)", plan.layers, plan.convert_at, plan.warmup_rule)
    for path in written:
        shutil.copy(work / path, committed / path)
    shutil.copy(work / "plan_rechecked.json", committed / "plan_rechecked.json")
    shutil.copy(work / "settings.json", committed / "settings.json")
    # every panel, from the committed folder's tables (the re-made ones and the CSE runs' ones)
    panels = Reproduction(committed, mode)
    figures = []
    for panel in PANELS:
        figures += [str(p.relative_to(committed)) for p in panels.write_figure(panel)]
    timings = json.loads((work / "timings.json").read_text())
    manifest = json.loads((committed / "manifest.json").read_text())
    manifest["settings"] = rep.settings.to_dict()
    manifest["remade"] = {
        "what": "the dense run, trained again with the same settings, and every stage that reads only it",
        "stages": list(DENSE_STAGES), "files": written + ["plan_rechecked.json"],
        "seconds_per_stage": {k: v for k, v in timings.items() if k in DENSE_STAGES or k == "train gpt-dense"},
        "environment": environment(),
        "kept from the original run": "plan.json and every stage that reads the CSE, Switch or finetuned models "
                                      "(routing, fig5bc, tables)",
    }
    for path in written + figures + ["plan_rechecked.json", "settings.json"]:
        manifest["files"][path] = sha256_file(committed / path)
    write_json(committed / "manifest.json", manifest)
    return manifest["remade"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--committed", default="figures/tail")
    parser.add_argument("--work", default="runs/tail-remade")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(remake(Path(args.committed), Path(args.work)), indent=2))


if __name__ == "__main__":
    main()
