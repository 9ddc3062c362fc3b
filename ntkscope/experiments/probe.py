"""``ntkscope experiment probe``: a sweep's dense trunks measured at every kept checkpoint by the
trunk probe (:mod:`ntkscope.runs.trunk_probe`), one table per trunk, ``OUT/trunk-seedK.csv``.

The probe is at most ``per_domain`` validation blocks of each domain (the first ones, the same
at every step and in every trunk of a pack); the router is fitted on the seed's CSE fitting
sample with CSE's options, at the spec's sparse layers; the tail is the settings'
``finetune_domains``. A trunk whose table is written is not probed again (delete its file to
redo it), so an interrupted probe resumes trunk by trunk.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cse_models.evaluate import at_most_per_domain
from ntkscope.core.checks import MissingInput
from ntkscope.core.files import write_table
from ntkscope.experiments.kinds import make_sweep
from ntkscope.experiments.runner import spec_pack
from ntkscope.experiments.spec import Spec
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.reproduction.analyses import router_options
from ntkscope.runs.checkpoints import list_checkpoints
from ntkscope.runs.trunk_probe import probe_trunk

log = logging.getLogger(__name__)


def logged_lrs(model_dir: Path) -> dict:
    """step -> learning rate, from a training's metrics.jsonl (empty when it logged none)."""
    path = Path(model_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {int(m["step"]): float(m["lr"]) for m in map(json.loads, lines) if "lr" in m and "step" in m}


def probe_trunks(spec: Spec, run_dir, out, *, pack=None, seeds=None, per_domain: int = 64,
                 resampling: Resampling = Resampling(resamples=100, null_draws=0)) -> list[Path]:
    """Probe the trunk of each of ``seeds`` (default: the spec's) of the sweep in ``run_dir``, GC's
    statistics by ``resampling`` (default: the jackknife's interval, no null band: the null's draws
    cost more than the rest of a step); returns the tables written (or already there)."""
    run_dir, out = Path(run_dir), Path(out)
    sweep = make_sweep(spec, run_dir, spec_pack(spec, run_dir, pack, build=False, func="probe_trunks"))
    probe = at_most_per_domain(sweep.blocks("validation"), per_domain)
    domains = [probe.domain_names[int(d)] for d in probe.domains]
    router = {k: v for k, v in router_options(sweep.settings).items() if k != "seed"}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for seed in seeds or spec.seeds:
        path = out / f"trunk-seed{seed}.csv"
        trunk = sweep.model_dir(sweep.trunk.name, seed)
        if not (trunk / "checkpoints").is_dir():
            raise MissingInput(f"probe_trunks: {trunk} holds no checkpoints (the trunk of seed {seed} has not "
                               "trained in this run directory)")
        if not path.is_file():
            table = probe_trunk(list_checkpoints(trunk), sweep.fitting(seed)["batch"]["input_ids"], probe.input_ids,
                                domains, lrs=logged_lrs(trunk), device=sweep.analysis_device(),
                                layers=list(sweep.layers), tail=tuple(sweep.settings.finetune_domains), router=router,
                                seed=seed, resampling=resampling)
            write_table(table, path)
            log.info("probe: trunk of seed %d, %d checkpoints -> %s", seed, table["step"].nunique(), path)
        written.append(path)
    return written
