"""Validation helpers for the public entry points.

Every message names the function, the argument, the rule and the value, in the
style of torch.func: ``empirical_ntk: chunk_size must be a positive integer (got 0)``.
Private helpers after the entry point assume valid input.
"""

from __future__ import annotations

import math
import os
from typing import Any


def fail(func: str, arg: str, rule: str, value: Any) -> ValueError:
    """Build the ValueError for ``func``'s argument ``arg`` that broke ``rule``."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return ValueError(f"{func}: {arg} {rule} (got {shown})")


def check_positive_int(func: str, arg: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise fail(func, arg, "must be a positive integer" + (" or None" if allow_none else ""), value)


def check_choice(func: str, arg: str, value: Any, choices) -> None:
    if value not in choices:
        raise fail(func, arg, f"must be one of {sorted(choices)}", value)


def check_fraction(func: str, arg: str, value: Any) -> None:
    """0 < value < 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise fail(func, arg, "must be a number strictly between 0 and 1", value)


def available_memory_bytes(device=None) -> int:
    """Memory that can be used now: free GPU memory on a CUDA device, else MemAvailable."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return str(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
