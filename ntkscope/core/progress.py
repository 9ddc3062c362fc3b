"""Progress bars for long loops: tqdm (``tqdm.auto``: a widget in a notebook, a text bar in a
terminal) on stderr. Shown when ntkscope logs at INFO (the command line's default), and in a
Jupyter notebook unless the ``ntkscope`` logger's level was set above INFO; hidden by ``-q``,
by library use in a script at the default WARNING level, under CI (``$CI`` set, as CI services
set it) and by ``NTKSCOPE_PROGRESS=0``; ``NTKSCOPE_PROGRESS=1`` shows them whatever the rest.
A bar is a context manager; ``.update(k)`` advances it."""

from __future__ import annotations

import logging
import os
import sys

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["logging_redirect_tqdm", "progress_bar", "progress_shown"]  # logging_redirect_tqdm: log lines above a bar


def progress_shown() -> bool:
    """Whether bars are shown now (see the module docstring)."""
    switch = os.environ.get("NTKSCOPE_PROGRESS", "").strip()
    if switch in ("0", "1"):
        return switch == "1"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    logger = logging.getLogger("ntkscope")
    return logger.isEnabledFor(logging.INFO) or (logger.level == logging.NOTSET and _in_notebook())


def _in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int | None, desc: str, unit: str = "it", iterable=None, *, initial: int = 0,
                 hidden: bool = False) -> tqdm:
    """A tqdm bar of ``total`` steps (None: a running count) from ``initial``, or over ``iterable``;
    ``hidden`` hides it whatever the settings (e.g. on every process but the first)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=False, mininterval=1.0,
                dynamic_ncols=True, disable=hidden or not progress_shown())
