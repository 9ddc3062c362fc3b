"""A spec's units, what each one needs first, their keys and their states; what each kind of
experiment's units are and do is its :class:`~ntkscope.experiments.kinds.ExperimentKind`'s.

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

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ntkscope.core.checks import UserError
from ntkscope.core.files import read_json_object, write_json
from ntkscope.experiments.kinds import EXPERIMENT_KINDS
from ntkscope.experiments.spec import Spec
from ntkscope.reproduction.settings import RUN_LOCAL, keyed_settings

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


def units(spec: Spec, pack_version) -> list[Unit]:
    """Every unit of ``spec`` in the order they are started (a unit after what it needs), keyed."""
    drafts = EXPERIMENT_KINDS.get_one(spec.kind, func="units").drafts(spec)
    # where a unit runs (device) and where models may come from (RUN_LOCAL) are not what it computes
    settings = {k: v for k, v in keyed_settings(spec.settings).items()
                if k not in RUN_LOCAL + ("seed", "seeds", "device")}
    keys, out = {}, []
    for name, seed, what, needs in drafts:
        payload = {"experiment": spec.kind, "unit": what, "seed": seed, "settings": settings, "pack": pack_version,
                   "needs": [keys[n] for n in needs]}
        keys[name] = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:20]
        out.append(Unit(name, seed, what, tuple(needs), keys[name]))
    return out


def execute(spec: Spec, run_dir: Path, unit: Unit, pack=None) -> dict:
    """Do ``unit`` (its needs are done) through its experiment's kind; returns what the unit records."""
    return EXPERIMENT_KINDS.get_one(spec.kind, func="execute").execute(spec, Path(run_dir), unit, pack)


def outputs(spec: Spec, run_dir: Path, unit: Unit) -> list[Path]:
    """What ``unit`` writes in ``run_dir`` (moved aside when the unit must run again under another key)."""
    return EXPERIMENT_KINDS.get_one(spec.kind, func="outputs").outputs(spec, Path(run_dir), unit)
