"""How much memory there is, and bytes as a person reads them."""

from __future__ import annotations

import contextlib
import functools
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


# ---- measured peaks -----------------------------------------------------------------------------

_OPEN: list = []  # PeakMemory blocks now open (outermost first): a reset folds the peak so far into each


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so that a peak above now counts new memory."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


_MMAP_THRESHOLD = 1 << 20
_TRIM_THRESHOLD = 128 << 10  # glibc's default, before a freed block of S raised it to 2 S
#: where glibc's dynamic thresholds settle in a training loop on 64-bit (its mmap threshold's ceiling)
_TRAINING_THRESHOLDS = (32 << 20, 64 << 20)
_threshold_fixed = False  # the kernel's 1 MiB threshold holds now
_pinned = False  # hand_back_freed_memory() was called: for the whole process
_heap_checked = False


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library when it has glibc's ``mallopt`` and ``malloc_trim``, else None (looked up once)."""
    try:
        import ctypes  # glibc's malloc settings, looked up only where they are used (Linux)

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's)
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt(mmap_threshold: int, trim_threshold: int):
    """glibc's ``mallopt`` of both thresholds (the trim threshold only once the mmap threshold
    took): the C library, or None where there is none or it refused."""
    libc = _glibc()
    if libc is None or not libc.mallopt(-3, mmap_threshold):  # M_MMAP_THRESHOLD
        return None
    return libc if libc.mallopt(-1, trim_threshold) else None  # M_TRIM_THRESHOLD


def hand_back_freed_memory() -> None:
    """Have glibc's malloc give freed blocks of 1 MiB or more back to the system at once.

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, and keeps
    later blocks below it in its heap, where freed memory stays resident: alternating tensor
    sizes then hold several times what is alive, and no memory budget can be kept. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``, and the trim threshold back at its default) stops
    that, for the whole process, from the first call on. Every kernel computation fixes it too,
    for as long as no training step follows (:func:`training_thresholds`).

    Call it at the start of a program that allocates much before its first kernel computation
    (a training step, say): blocks freed before it stay in a heap that later small allocations
    scatter over, and the resident set then creeps above ``max_memory`` (measured: 2.5 GiB
    against 2 GiB after a training step of GPT-2-small, 1.5 GiB when called first). A first
    call that finds much freed memory in the heap logs a warning. Nothing happens on other C
    libraries."""
    global _pinned
    _pinned = True
    kernel_thresholds()


_kept_depth = 0  # inside training_thresholds_kept(): kernel computations leave the thresholds


@contextlib.contextmanager
def training_thresholds_kept():
    """Kernel computations inside leave malloc's thresholds where training put them (no 1 MiB
    threshold, no budget kept for what is freed): for a small measurement between training steps,
    e.g. a :class:`~ntkscope.GCTracker` probe with no ``max_memory`` asked, where mapping and
    zeroing every large block anew made a probe of 128 sentences 0.90-0.98 s against 0.76 s
    (2026-11-29). Nothing changes after :func:`hand_back_freed_memory` (the process keeps its
    threshold)."""
    global _kept_depth
    _kept_depth += 1
    try:
        yield
    finally:
        _kept_depth -= 1


def kernel_thresholds() -> None:
    """What every kernel computation calls first: the fixed 1 MiB threshold of
    :func:`hand_back_freed_memory`, so that what is freed stops counting against the budget
    (after training under :func:`training_thresholds`, the heap's freed pages are handed back);
    nothing inside :func:`training_thresholds_kept`."""
    global _threshold_fixed, _heap_checked
    if _threshold_fixed or _kept_depth:
        return
    _threshold_fixed = True
    libc = _mallopt(_MMAP_THRESHOLD, _TRIM_THRESHOLD)
    if libc is None:
        return
    log.debug("malloc: blocks of %s or more now go back to the system when freed", format_bytes(_MMAP_THRESHOLD))
    if _heap_checked:  # back from training_thresholds(): what training freed goes back now
        _trim()
        return
    _heap_checked = True
    free = _heap_free_bytes(libc)
    if free is not None and free > _HEAP_WARNING:
        if _trains_first:  # by design: give the freed pages back now rather than advise
            _trim()
            log.info("malloc's heap held %s freed before the first kernel computation (training came first): "
                     "handed back to the system", format_bytes(free))
            return
        log.warning("malloc's heap holds %s freed before ntkscope's first kernel computation; peaks may exceed "
                    "max_memory by part of that. Call ntkscope.hand_back_freed_memory() at the start of the "
                    "program to keep the budget (in a CPU training loop this costs speed: the quick model's "
                    "training took 18 %% longer).", format_bytes(free))


def training_thresholds(*, force: bool = False) -> None:
    """Before training steps, or forward passes that keep no budget, that follow a kernel
    computation (a tracker's probe between steps, a training run or the layer embeddings of
    checkpoints after an analysis in one process): malloc's thresholds where a training
    loop's dynamic ones settle (mmap 32 MiB, trim 64 MiB), not the kernel's fixed 1 MiB, under
    which every large block of a step is mapped and zeroed anew: 150 steps of the quick model took
    23.1-24.1 s after a kernel computation, 20.4-20.7 s before one and 19.8-20.5 s with these
    thresholds (2 cores, 2026-11-27); the router's layer embeddings of 12 checkpoints (3000
    sequences each) after Figure 3's GC series 48 s, 36 s with them (2026-11-29). Nothing happens
    after :func:`hand_back_freed_memory` (the caller asked for the budget's threshold for the
    whole process) or, unless ``force`` (a
    benchmark's training steps, all under one setting), before any kernel computation. Not
    thread-safe: a kernel computation in another thread keeps its budget only between such calls."""
    global _threshold_fixed
    if _pinned or not (_threshold_fixed or force):
        return
    _threshold_fixed = False  # also where the C library has no mallopt: nothing to put back then
    if _mallopt(*_TRAINING_THRESHOLDS) is not None:
        log.debug("malloc: a training loop's thresholds again (mmap %s)", format_bytes(_TRAINING_THRESHOLDS[0]))


_HEAP_WARNING = 256 << 20
_trains_first = False


def trains_before_analysing() -> None:
    """Say that this program trains before its first kernel computation by design, with budgets
    that are not tight (``ntkscope reproduce``): fixing malloc's thresholds at its start would slow
    its training (the quick model's 600 dense steps took 18 % longer: 65 -> 77 s, two runs each on
    2 cores), so the first kernel computation instead hands the heap's freed pages back to the
    system (``malloc_trim``) and logs that, rather than advise a call the user cannot make."""
    global _trains_first
    _trains_first = True


def _heap_free_bytes(libc) -> int | None:
    """Bytes free inside malloc's heaps (glibc's ``mallinfo2().fordblks``), or None."""
    import ctypes  # glibc's malloc settings, looked up only where they are used (Linux)

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc.mallinfo2.restype = _MallInfo2
        return int(libc.mallinfo2().fordblks)
    except AttributeError:  # glibc before 2.33
        return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current size (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """The peak memory above the start of a ``with`` block, in bytes (``.bytes``; None where it
    cannot be read).

    On a CUDA device: the caching allocator's peak of allocated bytes. On the CPU: the
    process's peak resident set (``VmHWM``, reset at the start through ``/proc/self/clear_refs``;
    Linux only) above its size at the start, after freed heap memory is given back. Blocks may
    nest: an inner block's reset is folded into the outer ones' peaks. Other threads' memory
    counts too. Resetting the peak also lowers what ``getrusage``'s ``ru_maxrss`` reports later.
    """

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bytes: int | None = None
        self._base = None
        self._peak = 0

    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> "PeakMemory":
        if self._cuda():
            torch.cuda.synchronize(self.device)
            for outer in _OPEN:
                if outer._cuda() and outer._base is not None:
                    outer._peak = max(outer._peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _trim()
            hwm = _status_bytes("VmHWM")
            for outer in _OPEN:
                if not outer._cuda() and outer._base is not None and hwm is not None:
                    outer._peak = max(outer._peak, hwm)
            self._base = _status_bytes("VmRSS") if _reset_peak_rss() else None
        self._peak = 0
        _OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN.remove(self)
        if self._base is None:
            return
        if self._cuda():
            torch.cuda.synchronize(self.device)
            peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))
        else:
            hwm = _status_bytes("VmHWM")
            if hwm is None:
                return
            peak = max(self._peak, hwm)
        self.bytes = max(0, int(peak - self._base))
