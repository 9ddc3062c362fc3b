"""How much memory there is, and bytes as a person reads them."""

from __future__ import annotations

import logging
import math
import os

import torch

from ntkscope.core.checks import UserError

log = logging.getLogger(__name__)


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
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} EiB"


def parameter_count(build) -> float:
    """Parameters of the module ``build()`` would make, counted on PyTorch's meta device:
    shapes only, nothing allocated (tied tensors once). ``inf`` when one tensor alone would
    need more than 2^63 bytes (PyTorch cannot even describe it)."""
    try:
        with torch.device("meta"):
            module = build()
    except RuntimeError as err:
        if "overflow" in str(err):
            return math.inf
        raise
    return sum(p.numel() for p in module.parameters())


def check_fits(n_params: int, itemsize: int, what: str, *, device=None, share: float = 1.0) -> int:
    """Refuse a model of ``n_params`` parameters (``itemsize`` bytes each) that would not fit in
    ``share`` of the memory free on ``device``; returns the bytes it needs.

    ``what`` begins the message, e.g. "load_checkpoint: runs/x/config.json".
    """
    need = n_params * itemsize
    free = available_memory_bytes(device)
    if need > share * free:
        if not math.isfinite(need):
            raise UserError(f"{what} asks for a tensor of more than 2^63 bytes; this machine has "
                            f"{format_bytes(free)} free")
        dtype = {8: "float64", 4: "float32", 2: "16-bit floats"}.get(itemsize, f"{itemsize}-byte numbers")
        raise UserError(f"{what} asks for {n_params:.1e} parameters ({format_bytes(need)} in {dtype}); this "
                        f"machine has {format_bytes(free)} free")
    log.info("%s: %s parameters, %s before loading; %s free", what, f"{n_params:,}", format_bytes(need),
             format_bytes(free))
    return need
