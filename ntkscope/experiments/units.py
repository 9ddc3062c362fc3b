"""A spec's units, what each one needs first, and what each one does.

A unit is the smallest piece of an experiment that runs on its own and leaves a result:

- sweep: ``TRUNK-seedK`` (the dense trunk, whole schedule, every checkpoint kept),
  ``plan-seedK`` (the trunk's small-cluster rule, when an arm converts at "rule") and
  ``ARM-seedK`` for each arm and seed (``ARM-atSTEP-seedK`` for an arm of several steps). An arm
  needs its trunk (and the plan when it converts at the rule's step).
- tables: ``ARCH-ROW-seedK``; every row needs its seed's dense row, a tuned row its parent.

A unit's ``key`` hashes what it computes: its own description, the settings (not the device),
the corpus pack's version and its needs' keys. A unit is done when ``RUN/units/NAME.json`` holds its key and
"done"; a spec that changes what a unit does changes its key, and the unit runs again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ntkscope.core.checks import UserError
from ntkscope.core.files import read_json_object, sha256_file, write_json
from ntkscope.experiments.spec import Spec
from ntkscope.reproduction import paper
from ntkscope.reproduction.pipeline import Reproduction
from ntkscope.reproduction.settings import RUN_LOCAL
from ntkscope.reproduction.arm_kinds import TRUNK, arm_kind
from ntkscope.reproduction.sweep import Arm, Sweep, conversion_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One unit: ``name`` (its folder names), ``seed``, ``what`` (its description: kind, arm or
    row, step, ...), ``needs`` (names of units that finish first) and ``key`` (the hash above)."""

    name: str
    seed: int
    what: dict
    needs: tuple = ()
    key: str = ""


def sweep_arms(spec: Spec) -> list[Arm]:
    """The spec's arms, one per conversion step."""
    return list(spec.arms)


# ---- a unit's state: RUN/units/NAME.json ----------------------------------------------------

def read_state(run_dir, name: str) -> dict | None:
    """RUN/units/NAME.json, or None when there is none. A damaged one (not a JSON object, or
    fields of the wrong type) counts as none, with a warning naming it: the unit runs again (its
    training resumes from its checkpoints), and the rest of the run is not held up."""
    path = Path(run_dir) / "units" / f"{name}.json"
    if not path.is_file():
        return None
    try:
        state = read_json_object(path, "experiment")
    except UserError as err:
        _warn_once(path, f"{err}; the unit runs again")
        return None
    typed = {"key": str, "status": str, "result": str, "attempts": int}
    wrong = [k for k, t in typed.items() if k in state and (not isinstance(state[k], t) or isinstance(state[k], bool))]
    if wrong:
        _warn_once(path, f"experiment: {path} has fields of the wrong type ({wrong}); the unit runs again")
        return None
    return state


_WARNED: set = set()  # damaged records already said (the runner reads every state each poll)


def _warn_once(path: Path, message: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("%s", message)


def write_state(run_dir, name: str, state: dict) -> None:
    write_json(Path(run_dir) / "units" / f"{name}.json", state)


def is_done(state: dict | None, unit: Unit, run_dir=None) -> bool:
    """Whether ``state`` says ``unit`` is done under its key (and, given ``run_dir``, its result
    file is still there: a deleted result makes the unit run again)."""
    if not (bool(state) and state.get("status") == "done" and state.get("key") == unit.key):
        return False
    result = state.get("result")
    return run_dir is None or not isinstance(result, str) or (Path(run_dir) / result).is_file()


def model_digest(directory) -> str:
    """The sha256 of an HF model directory's config.json and weights: a trunk that starts from
    another model (or the same one changed) has another key."""
    files = {name: sha256_file(Path(directory) / name) for name in ("config.json", "model.safetensors",
                                                                      "pytorch_model.bin")
             if (Path(directory) / name).is_file()}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def units(spec: Spec, pack_version) -> list[Unit]:
    """Every unit of ``spec`` in the order they are started (a unit after what it needs), keyed."""
    drafts = _sweep_units(spec) if spec.kind == "sweep" else _table_units(spec)
    # where a unit runs (device) and where models may come from (RUN_LOCAL) are not what it computes
    settings = {k: v for k, v in spec.settings.to_dict().items() if k not in RUN_LOCAL + ("seed", "seeds", "device")}
    keys, out = {}, []
    for name, seed, what, needs in drafts:
        payload = {"experiment": spec.kind, "unit": what, "seed": seed, "settings": settings, "pack": pack_version,
                   "needs": [keys[n] for n in needs]}
        keys[name] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]
        out.append(Unit(name, seed, what, tuple(needs), keys[name]))
    return out


def _sweep_units(spec: Spec) -> list:
    arms, seeds_of = list(spec.arms), {a.name: a.seeds or spec.seeds for a in spec.arms}
    trunk = next(a for a in arms if a.kind == TRUNK)
    t = spec.trunk
    drafts = []
    own = {"model": model_digest(t.model)} if t.model else {}  # the preset's GPT: no key field (keys unchanged)
    for seed in spec.seeds:
        drafts.append((f"{trunk.name}-seed{seed}", seed, {"kind": "trunk", "arm": trunk.name,
                                                          "gc_peak_step": t.gc_peak_step, **own}, []))
    rule_seeds = sorted({s for a in arms if a.at == "rule" for s in seeds_of[a.name]})
    structure = {} if t.structure is None else {"structure": dataclasses.asdict(t.structure)}
    for seed in spec.seeds if t.structure is not None else rule_seeds:  # the structure rule is judged in every trunk
        drafts.append((f"plan-seed{seed}", seed, {"kind": "plan", "layers": list(t.layers),
                                                  "rule": dataclasses.asdict(t.rule), **structure},
                       [f"{trunk.name}-seed{seed}"]))
    for arm in arms:
        if arm is trunk:
            continue
        for seed in seeds_of[arm.name]:
            what = {"kind": "arm", **dataclasses.asdict(arm), "layers": list(arm.layers or t.layers),
                    "at": conversion_step(arm.at, steps=spec.settings.steps, gc_peak_step=t.gc_peak_step),
                    **arm_kind(arm.kind).key(t)}
            del what["what"], what["seeds"]  # the tables' line and where it runs: not what the unit computes
            if arm.counts_from is None:  # left out when unset, so that an arm without it keeps its key
                del what["counts_from"]
            needs = [f"{trunk.name}-seed{seed}"] + ([f"plan-seed{seed}"] if arm.at == "rule" else [])
            drafts.append((f"{arm.name}-seed{seed}", seed, what, needs))
    return drafts


def _table_units(spec: Spec) -> list:
    drafts = []
    for arch in spec.archs:
        for seed in spec.seeds:
            for row in spec.rows:
                if row == "dense":
                    needs = []
                elif row.startswith(("dense-", "switch-")):
                    needs = [f"{arch}-{row.split('-', 1)[0]}-seed{seed}"]
                else:
                    needs = [f"{arch}-dense-seed{seed}"]
                drafts.append((f"{arch}-{row}-seed{seed}", seed, {"kind": "row", "arch": arch, "row": row}, needs))
    return drafts


# ---- doing a unit ---------------------------------------------------------------------------

def make_sweep(spec: Spec, run_dir, pack=None):
    """The :class:`~ntkscope.reproduction.sweep.Sweep` of a sweep spec in ``run_dir``."""

    t = spec.trunk
    return Sweep(run_dir, spec.settings, sweep_arms(spec), seeds=spec.seeds, layers=t.layers,
                 gc_peak_step=t.gc_peak_step, rule=t.rule, null_order=t.null_order, pack=pack,
                 encoder=t.encoder or None, structure=t.structure, model=t.model or None)


def make_reproduction(spec: Spec, run_dir, pack=None):
    """The :class:`~ntkscope.reproduction.pipeline.Reproduction` of a tables spec in ``run_dir``."""

    return Reproduction(run_dir, spec.settings.mode, settings=spec.settings, pack=pack)


def execute(spec: Spec, run_dir: Path, unit: Unit, pack=None) -> dict:
    """Do ``unit`` (its needs are done): train and evaluate; returns what the unit records."""
    what = unit.what
    if spec.kind == "tables":
        rep = make_reproduction(spec, run_dir, pack)
        rep.timings_path = run_dir / "timings" / f"{unit.name}.json"  # one file per unit: workers run side by side
        rep.timings_path.parent.mkdir(parents=True, exist_ok=True)
        found = paper.evaluate_row(rep, what["arch"], what["row"], unit.seed)
        record = {"arch": what["arch"], "key": what["row"], "model": paper.row_label(what["arch"], what["row"]),
                  "seed": unit.seed, **found}
        write_json(run_dir / "results" / f"{unit.name}.json", record)
        return {"result": f"results/{unit.name}.json"}
    sweep = make_sweep(spec, run_dir, pack)
    if what["kind"] == "plan":
        plan = sweep.plan(unit.seed)
        return {"result": f"plans/seed{unit.seed}.json", "warmup": int(plan.warmup_steps),
                "warmup_rule": plan.warmup_rule}
    arm = sweep.arm(what["arm"] if what["kind"] == "trunk" else what["name"])
    result = sweep.run_unit(arm, unit.seed)
    return {"result": f"results/{arm.name}-seed{unit.seed}.json",
            **{k: v for k, v in result.items() if k.startswith("ppl") or k in ("warmup", "same_as")}}


def outputs(spec: Spec, run_dir: Path, unit: Unit) -> list[Path]:
    """What ``unit`` writes in ``run_dir`` (moved aside when the unit must run again under another key)."""
    if spec.kind == "tables":
        name = paper.model_name(unit.what["arch"], unit.what["row"], unit.seed)
        return [run_dir / "results" / f"{unit.name}.json", run_dir / "models" / name]
    if unit.what["kind"] == "plan":
        return [run_dir / "plans" / f"seed{unit.seed}.json"]
    arm = unit.what["arm"] if unit.what["kind"] == "trunk" else unit.what["name"]
    return [run_dir / "results" / f"{arm}-seed{unit.seed}.json", run_dir / "models" / f"{arm}-seed{unit.seed}"]
