"""Progress bars for long loops: tqdm (``tqdm.auto``: a widget in a notebook, a text bar in a
terminal) on stderr. Shown when ntkscope logs at INFO (the command line's default); hidden by
``-q``, by library use at the default WARNING level, under CI (``$CI`` set, as CI services set
it) and by ``NTKSCOPE_PROGRESS=0``. A bar is a context manager; ``.update(k)`` advances it."""

from __future__ import annotations

import logging
import os

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: F401  (re-exported: log lines above a bar)


def progress_shown() -> bool:
    """Whether bars are shown now (see the module docstring)."""
    if os.environ.get("NTKSCOPE_PROGRESS", "").strip() == "0" or os.environ.get("CI", "").strip() not in ("", "0",
                                                                                                         "false"):
        return False
    return logging.getLogger("ntkscope").isEnabledFor(logging.INFO)


def progress_bar(total: int | None, desc: str, unit: str = "it", iterable=None, *, initial: int = 0,
                 hidden: bool = False) -> tqdm:
    """A tqdm bar of ``total`` steps (None: a running count) from ``initial``, or over ``iterable``;
    ``hidden`` hides it whatever the settings (e.g. on every process but the first)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=False, mininterval=1.0,
                dynamic_ncols=True, disable=hidden or not progress_shown())
