"""What a directory was asked to hold: a rerun that asks for something else is refused, never mixed.

A command that resumes into its output (``compare``, ``cse-train``, ``reproduce``) records
its request, a JSON object of the settings that decide what it writes, the first time.
A later call compares its own request with the record field by field (nested objects by their
dotted names) and refuses in one line naming each field that differs, with both values, so the
record always describes what the directory holds. ``--force`` is the caller's: it deletes what
the old request made and records the new one. (An experiment's units are keyed instead: a
changed unit runs again, :mod:`ntkscope.experiments.units`.)
"""

from __future__ import annotations

import json
from pathlib import Path

from ntkscope.core.checks import UserError
from ntkscope.core.files import write_json


def flatten(request: dict, prefix: str = "") -> dict:
    """``{"model": {"n_embd": 32}}`` -> ``{"model.n_embd": 32}`` (lists and scalars are leaves)."""
    flat = {}
    for key, value in request.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def differences(have: dict, want: dict, *, ignore=()) -> list[str]:
    """``"field (old -> new)"`` for each field of two requests that differs (JSON-normalised: a
    tuple equals a list), in field order; fields in ``ignore`` (dotted names or their prefixes) are
    not compared."""
    have, want = flatten(_normal(have)), flatten(_normal(want))
    changed = []
    for key in [*want, *(k for k in have if k not in want)]:
        if any(key == s or key.startswith(f"{s}.") for s in ignore):
            continue
        old, new = have.get(key, "unset"), want.get(key, "unset")
        if old != new:
            changed.append(f"{key} ({_short(old)} -> {_short(new)})")
    return changed


def listed(changed: list[str], at_most: int = 6) -> str:
    """The first ``at_most`` differences, ``; ``-joined, and how many more."""
    more = f"; and {len(changed) - at_most} more" if len(changed) > at_most else ""
    return "; ".join(changed[:at_most]) + more


def bind_request(directory, request: dict, func: str, *, record: str, ignore=(), flag: str = "--force") -> bool:
    """Tie ``directory`` to ``request``: the first call writes ``directory/record`` and returns True;
    a later one returns False when the request is the recorded one, and otherwise raises a one-line
    :class:`UserError` naming the fields that differ (``ignore``: fields a rerun may change, e.g.
    where it stops)."""
    path = Path(directory) / record
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, request)
        return True
    try:
        have = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{func}: {path} is damaged ({err}); use another output, or {flag} to start over") from None
    changed = differences(have if isinstance(have, dict) else {}, request, ignore=ignore)
    if changed:
        raise UserError(f"{func}: {directory} holds a run asked with other settings ({listed(changed)}); use "
                        f"another output directory, or {flag} to start over")
    return False


def _normal(value):
    return json.loads(json.dumps(value, default=str))


def _short(value) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
