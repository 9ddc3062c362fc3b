"""How a kernel computation runs: one frozen, validated options object.

Every public function of the kernel stage (``per_sample_grads``, ``empirical_ntk``,
``ntk_top_eigenpair``, ``principal_direction``, ``gradient_consistency``,
``gradient_consistency_groups``) takes these fields as keyword arguments, or a prepared
``options=KernelOptions(...)`` (keywords then override its fields). The object is built and
validated once, at the entry point, and passed down; nothing after it re-checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ntkscope.core.checks import InputError, check_choice, check_fraction, check_positive_int

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROJECTIONS = ("gaussian", "rademacher")


class Method(str, Enum):
    """The ways to compute an NTK or its eigenpairs. What each does, what it costs and what
    it supports is its row of :data:`ntkscope.kernel.methods.METHODS`; ``"auto"`` chooses
    among them by memory (:func:`ntkscope.kernel.methods.choose`)."""

    EXACT = "exact"
    STRUCTURED = "structured"
    PROJECTED = "projected"
    MATRIX_FREE = "matrix-free"


@dataclass(frozen=True)
class KernelOptions:
    """Options shared by the kernel computations.

    Attributes
    ----------
    output : "loss", "true-logit", "centred-true-logit", "logits", "hidden-mean", LMLoss or callable
        What f is (:mod:`ntkscope.kernel.objectives`).
    params : None, glob(s) or module(s)
        The Jacobian's columns (:func:`ntkscope.select_parameters`).
    method : str
        A :class:`Method` name, or ``"auto"`` (chosen by memory: :func:`ntkscope.kernel.methods.choose`).
    dtype : torch.dtype or str, optional
        Compute in this dtype on a cast copy of the model ("float64" for reference runs).
    device : str or torch.device, optional
        Compute on this device ("cuda", "cuda:1", "cpu") on a copy of the model; the batch is
        moved there and the memory budget is that device's free memory. Default: the model's device.
    chunk_size : int, optional
        Samples per vmap call (default up to 8, fewer when memory is short).
    max_memory : int, optional
        Bytes the computation may hold (default: ``ntkscope.kernel.grads.MEMORY_DEFAULT_TEXT``:
        half the free memory of the computation's device, of which layouts keep 15 % for the allocator).
    projection, projection_dim, seed, confidence
        Projected method: ``"gaussian"`` or ``"rademacher"``, k columns per block, the RNG
        seed, and the probability at which its error bound is stated.
    tol, ncv
        Matrix-free method: the top Ritz pair's relative residual at which Lanczos stops
        (ARPACK's criterion). ``ncv`` is accepted and ignored: the single Lanczos run grows its
        basis until both eigenvalues converge (saved options that set it load).
    """

    output: Any = "loss"
    params: Any = None
    method: str = "auto"
    dtype: Any = None
    device: Any = None
    chunk_size: int | None = None
    max_memory: int | None = None
    projection: str = "gaussian"
    projection_dim: int = 1024
    seed: int = 0
    confidence: float = 0.95
    tol: float = 1e-6
    ncv: int = 4

    def __post_init__(self):
        check_choice("method", self.method, {"auto", *(m.value for m in Method)})
        check_positive_int("chunk_size", self.chunk_size, allow_none=True)
        check_positive_int("max_memory", self.max_memory, allow_none=True)
        check_choice("projection", self.projection, set(PROJECTIONS))
        check_positive_int("projection_dim", self.projection_dim)
        check_fraction("confidence", self.confidence)
        check_positive_int("ncv", self.ncv)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InputError("seed", "must be a non-negative integer", self.seed)
        if not isinstance(self.tol, (int, float)) or isinstance(self.tol, bool) or not self.tol > 0:
            raise InputError("tol", "must be a positive number", self.tol)
        object.__setattr__(self, "dtype", _dtype(self.dtype))
        object.__setattr__(self, "device", checked_device(self.device))

    def to_dict(self) -> dict:
        """The fields as JSON values (a dtype by its name, a device as a string, an output or
        parameter selection that is not a name by its ``str``): for cache keys and result files."""
        names = {v: k for k, v in DTYPES.items()}
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype" and value is not None:
                value = names.get(value, str(value))
            elif f.name == "device" and value is not None:
                value = str(value)
            elif f.name in ("output", "params") and not _plain(value):
                value = str(value)
            out[f.name] = value
        return out

    def changed(self, *, leave=()) -> dict:
        """:meth:`to_dict`'s fields that differ from the defaults (``leave``: names to leave out): a
        cache key that options at their defaults leave as it was before a field was added."""
        default = KernelOptions().to_dict()
        return {k: v for k, v in self.to_dict().items() if k not in leave and v != default[k]}

    @classmethod
    def build(cls, options: "KernelOptions | None" = None, *, methods=None, **fields) -> "KernelOptions":
        """``options`` with ``fields`` replaced (or a new object from ``fields``); unknown names are
        refused, and so is a ``method`` outside ``methods`` (the names the caller's task can run)."""
        if options is not None and not isinstance(options, cls):
            raise InputError("options", "must be a KernelOptions or None", type(options).__name__)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise InputError("options", f"must be fields of KernelOptions {sorted(names)}", unknown)
        if methods is not None and "method" in fields:
            check_choice("method", fields["method"], set(methods))
        return dataclasses.replace(options, **fields) if options is not None else cls(**fields)


def _plain(value) -> bool:
    """A value JSON holds as it is: None, a string, or a list or tuple of strings."""
    return value is None or isinstance(value, str) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise InputError("dtype", f"must be None, a floating torch.dtype or one of {sorted(DTYPES)}", dtype)


def checked_device(device) -> torch.device | None:
    """``device`` as a torch.device this machine has (None stays None); else the InputError naming it."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError("device", "must be None, a torch.device or a device string ('cpu', 'cuda', 'cuda:1')",
                         device) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device", "must be a device this machine has; CUDA is not available", str(device))
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError("device", f"must name one of the {torch.cuda.device_count()} CUDA devices", str(device))
    elif device.type != "cpu":
        raise InputError("device", "must be 'cpu' or a CUDA device", str(device))
    return device
