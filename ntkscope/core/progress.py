"""Progress bars for long loops: tqdm on stderr, shown when ntkscope logs at INFO (the command
line's default; ``-q`` and library use at the default WARNING level hide them)."""

from __future__ import annotations

import logging

from tqdm.auto import tqdm


def progress_bar(total: int, desc: str, unit: str = "it") -> tqdm:
    """A tqdm bar of ``total`` steps; ``.update(k)`` advances it, ``.close()`` ends it."""
    hidden = not logging.getLogger("ntkscope").isEnabledFor(logging.INFO)
    return tqdm(total=total, desc=desc, unit=unit, disable=hidden, leave=False, mininterval=1.0, dynamic_ncols=True)
