"""How much memory there is, and bytes as a person reads them."""

from __future__ import annotations

import math
import os

import torch


def available_memory_bytes(device=None) -> int:
    """Memory that can be used now: free GPU memory on a CUDA device, else MemAvailable."""
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
