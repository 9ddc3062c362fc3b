"""Per-sample gradients and Jacobian products with torch.func.

Everything here works on a :class:`FunctionalModel`: the user's model as a pure
function of the selected parameters, in eval mode, in the asked dtype, with
attention on the MATH SDPA backend (forward-mode AD and double backward work
there; the fused CPU kernel has neither, docs/design.md §6). The three primitives:

- :func:`jacobian_rows`: rows of ``J`` for a chunk of samples, by
  ``vmap(grad(f))`` (``vmap(jacrev(f))`` for vector outputs), written straight
  into a caller's buffer of shape ``(c, K, P)``.
- :func:`vjp_rows`: ``J^T v`` for a weight per sample, one weighted backward
  pass per chunk (the primary gradient direction ``g = u^T J`` is this).
- :func:`jvp_rows`: ``J w`` for a direction in parameter space, one forward-mode
  pass per chunk.

Sparse-expert layers: a module with a ``per_sample_dispatch`` attribute (``cse_models``' CSE,
Switch and DEMix layers) has it set to True while the model is analysed: it then runs every
expert on every sample under a 0/1 routing mask, so no shape depends on the data and
``vmap`` (and the structured method's layer hooks) see one sample at a time without a loop.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from ntkscope.core.checks import InputError, entry
from ntkscope.core.memory import PeakMemory, available_memory_bytes, format_bytes
from ntkscope.core.progress import progress_bar
from ntkscope.kernel.kept import kept
from ntkscope.kernel.objectives import (
    CallableOutput,
    Objective,
    CallableModule,
    batch_size,
    resolve_output,
    take,
    to_device_dtype,
)
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.params import ParameterSelection, select_parameters

log = logging.getLogger(__name__)

_MAX_DEFAULT_CHUNK = 8


class FunctionalModel:
    """A model as ``f(params, data)``; built by :func:`functional_model`.

    Attributes
    ----------
    selection : ParameterSelection
        The Jacobian's columns.
    params : dict of str to Tensor
        Selected parameters (detached, in ``dtype``), keyed as ``functional_call`` expects.
    n_outputs : int
        K: 1 for scalar outputs, the vector length otherwise (known after :meth:`prepare`).
    """

    def __init__(self, module, prefix, objective: Objective, selection: ParameterSelection, randomness):
        self.module = module
        self.objective = objective
        self.selection = selection
        self.randomness = randomness
        named = dict(module.named_parameters())
        keys = [prefix + n for n in selection.names]
        self.params = {k: named[k].detach() for k in keys}
        self.frozen = {k: v.detach() for k, v in named.items() if k not in self.params}
        first = next(iter(self.params.values()))
        self.dtype, self.device = first.dtype, first.device
        self.scalar = objective.scalar
        self.n_outputs = 1

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def prepare(self, batch, arg: str = "batch") -> dict:
        """Validate and prepare a batch once; returns prepared data with leading dim n."""
        batch_size(batch, arg)
        model = self.module.model if isinstance(self.module, CallableModule) else self.module
        batch = to_device_dtype(batch, self.device, self.dtype)
        data = self.objective.prepare(model, batch)
        if not self.scalar:
            with torch.no_grad():
                self.n_outputs = int(self.outputs(self.params, take(data, slice(0, 1))).shape[-1])
        return data

    def run(self, params: dict, inputs, frozen: dict | None = None):
        """The module's forward with ``params`` and the rest (``frozen``, default :attr:`frozen`)."""
        args = (inputs,) if torch.is_tensor(inputs) or isinstance(self.objective, CallableOutput) else ()
        kwargs = {} if args else inputs
        return functional_call(self.module, (params, self.frozen if frozen is None else frozen), args, kwargs)

    def outputs(self, params: dict, data: dict, frozen: dict | None = None) -> torch.Tensor:
        """f on prepared rows: (m,) or (m, K)."""
        return self.objective.evaluate(lambda inputs: self.run(params, inputs, frozen), data)

    def sample_output(self, params: dict, sample: dict) -> torch.Tensor:
        """f of one sample (no leading dim): () or (K,)."""
        one = torch.utils._pytree.tree_map(lambda t: t.unsqueeze(0), sample)
        return self.outputs(params, one)[0]

    def flatten(self, tree: dict) -> torch.Tensor:
        """Dict of per-parameter tensors -> flat (P,) vector in selection order."""
        return torch.cat([tree[k].reshape(-1) for k in self.params])

    def unflatten(self, flat: torch.Tensor) -> dict:
        """Flat (P,) vector -> dict shaped like ``params``."""
        return {
            k: flat[o : o + p.numel()].view_as(p)
            for (k, p), o in zip(self.params.items(), self.selection.offsets)
        }


@contextlib.contextmanager
def functional_model(model, opts: KernelOptions, *, blocks=None, train=False):
    """Context giving a :class:`FunctionalModel` of ``model`` for ``opts.output`` over
    ``opts.params``; the user's model is left as it was.

    The model runs in eval mode (dropout off) unless ``train=True``; a different
    ``opts.dtype`` or ``opts.device`` is applied to a copy of the model.
    """
    if not isinstance(model, nn.Module):
        raise InputError("model", "must be a torch.nn.Module", type(model).__name__)
    first = next(model.parameters(), None)
    if first is None:
        raise InputError("model", "must have at least one parameter", type(model).__name__)
    dtype, device = opts.dtype, opts.device
    if dtype is None and first.dtype in (torch.float16, torch.bfloat16):  # the eigensolvers take float32/64
        dtype = torch.float32
        log.warning("the model is %s: computing in float32 on a copy (pass dtype= to choose)",
                    str(first.dtype).replace("torch.", ""))
    same = (dtype is None or dtype == first.dtype) and (device is None or _same_device(device, first.device))
    target = model if same else copy.deepcopy(model).to(device=device, dtype=dtype)
    modes = {m: m.training for m in target.modules()}
    dispatch = {m: m.per_sample_dispatch for m in target.modules() if hasattr(m, "per_sample_dispatch")}
    target.train(train)
    for m in dispatch:
        m.per_sample_dispatch = True
    experts = _eager_experts(target)
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            objective = resolve_output(opts.output, target)
        selection = select_parameters(target, opts.params, blocks)
        module, prefix = target, ""
        if isinstance(objective, CallableOutput):
            module, prefix = CallableModule(target, objective.fn), "model."
        fm = FunctionalModel(module, prefix, objective, selection, "different" if train else "error")
        with sdpa_kernel(SDPBackend.MATH):
            yield fm
    finally:
        for m, mode in modes.items():
            m.train(mode)
        for m, flag in dispatch.items():
            m.per_sample_dispatch = flag
        for config, implementation in experts:
            config._experts_implementation = implementation


def _eager_experts(model: nn.Module) -> list:
    """Set transformers' mixture experts to their eager loop (``config._experts_implementation``)
    while the model is analysed: the fused kernels (``grouped_mm``) take no float64 and no
    ``vmap``; the eager loop is the same function in any dtype. Returns (config, what it was) to restore."""
    configs = {id(c): c for m in model.modules() for c in [getattr(m, "config", None)]
               if c is not None and getattr(c, "_experts_implementation", None) not in (None, "eager")}
    saved = [(c, c._experts_implementation) for c in configs.values()]
    for c, _ in saved:
        c._experts_implementation = "eager"
    return saved


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def default_chunk_size(n: int, fm: FunctionalModel, budget: int) -> int:
    """Samples per vmap chunk: 8 at most (4-8 measured fastest on CPU, benchmarks/README.md), fewer if memory is short."""
    per_row = 4 * fm.n_outputs * fm.selection.n_params * fm.itemsize
    return int(max(1, min(n, _MAX_DEFAULT_CHUNK, budget // max(per_row, 1))))


#: ``max_memory``'s default: this share of the free memory of the computation's device
DEFAULT_MEMORY_SHARE = 0.5
#: The share of ``max_memory`` that layouts leave to the allocator: the heap's small blocks and
#: their fragmentation, which no tensor count sees (measured: 6-8 % over a budget without it, in a
#: long-lived test process at tens of MB)
ALLOCATOR_RESERVE = 0.15
#: the one description of the default, for docstrings and the command line's help
MEMORY_DEFAULT_TEXT = (f"{DEFAULT_MEMORY_SHARE:.0%} of the device's free memory; layouts keep "
                       f"{ALLOCATOR_RESERVE:.0%} of the budget for the allocator")


def asked_memory(max_memory, device) -> int:
    """``max_memory`` in bytes, else :data:`DEFAULT_MEMORY_SHARE` of the free memory of ``device``."""
    return int(DEFAULT_MEMORY_SHARE * available_memory_bytes(device)) if max_memory is None else int(max_memory)


def memory_budget(asked: int) -> int:
    """Bytes a computation's tensors may hold of the ``asked`` memory: all but :data:`ALLOCATOR_RESERVE`."""
    return int(asked * (1 - ALLOCATOR_RESERVE))


#: A per-sample gradient by vmap costs about two batched forward+backward passes per sample
#: (measured, benchmarks/README.md: exact = 1.9-2.3 training steps)
VMAP_FACTOR = 2.0


def tokens_per_sample(data: dict) -> int:
    """T: the length of a sample's token ids (1 for inputs without token ids, e.g. features)."""
    inputs = data["inputs"]
    ids = inputs if torch.is_tensor(inputs) else inputs.get("input_ids") if isinstance(inputs, dict) else None
    if torch.is_tensor(ids) and ids.dim() >= 2 and not ids.is_floating_point():
        return int(ids.shape[1])
    return 1


def step_cost(fm: FunctionalModel, data: dict, n: int) -> float:
    """Multiply-adds of one forward and backward over n samples: 3 T P per sample."""
    return 3.0 * n * tokens_per_sample(data) * fm.selection.n_params


def check_finite(values: torch.Tensor, first_row: int, order=None) -> None:
    """Refuse a non-finite output, naming the samples (``order``: the batch's index of each row,
    where the rows run in another order)."""
    bad = ~torch.isfinite(values.reshape(values.shape[0], -1)).all(1)
    if bool(bad.any()):
        rows = (torch.nonzero(bad).flatten() + first_row).tolist()[:5]
        rows = rows if order is None else [int(order[r]) for r in rows]
        raise InputError("batch", "must give a finite output for every sample; NaN/inf at samples", rows)


def jacobian_rows(fm: FunctionalModel, data: dict, out: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """Write J's rows for the prepared samples ``data`` (c of them) into ``out`` of shape (c, K, P).

    Returns f at those samples, (c,) or (c, K). Raises ValueError on a non-finite output.
    """

    def f(params, sample):
        y = fm.sample_output(params, sample)
        return y, y.detach()

    transform = grad(f, has_aux=True) if fm.scalar else jacrev(f, has_aux=True)
    try:
        grads, values = vmap(transform, in_dims=(None, 0), randomness=fm.randomness)(fm.params, data)
    except RuntimeError as err:
        if not any(s in str(err) for s in ("data-dependent", ".item()", "dynamic shape")):
            raise
        # e.g. HF masks branching on values, or sequence-level expert dispatch (CSE, DEMix)
        log.warning("the model has data-dependent control flow or shapes that vmap cannot trace; "
                    "computing per-sample gradients one sample at a time (slower)")
        rows = [transform(fm.params, take(data, i)) for i in range(out.shape[0])]
        grads = {k: torch.stack([r[0][k] for r in rows]) for k in fm.params}
        values = torch.stack([r[1] for r in rows])
    check_finite(values, first_row, getattr(fm, "row_order", None))
    c, K = out.shape[0], out.shape[1]
    for (k, p), offset in zip(fm.params.items(), fm.selection.offsets):
        out[:, :, offset : offset + p.numel()] = grads[k].reshape(c, K, -1)
    return values


@dataclass(frozen=True)
class Transient:
    """Bytes that one chunk's computation holds beyond what it returns (activations, the graph,
    autograd's buffers), per sample, measured on a probe; ``measured`` False where no peak could
    be read and the figure is a stated guess."""

    per_sample: int
    measured: bool

    #: measured peaks of the same call vary by 10-15 % (pages, the allocator): the estimate takes this much more
    MARGIN = 1.25

    def bytes(self, chunk: int) -> int:
        """The peak of a chunk of ``chunk`` samples."""
        return int(self.MARGIN * chunk * self.per_sample)


def measure_transient(run, rows: int, guess: int, device, *, warmed: bool = False) -> tuple[Transient, object]:
    """(:class:`Transient` of ``run()``, one chunk of ``rows`` samples; what the last run returned).

    ``run`` is called three times: once to warm up (the first call of a code path in a process
    pages in library code and allocates caches that stay: not the chunk's; not when the caller
    ran it already, ``warmed``), then twice measured, the larger peak taken. ``guess`` bytes a
    sample where the peak cannot be read (no ``/proc``)."""
    out = None if warmed else run()
    peaks = []
    for _ in range(2):
        out = None  # the last result is freed before the next measurement starts
        with PeakMemory(device) as mem:
            out = run()
        peaks.append(mem.bytes)
    if None in peaks:
        return Transient(guess, False), out
    return Transient(-(-max(peaks) // rows), True), out


def vmap_transient(fm: FunctionalModel, data: dict) -> Transient:
    """What ``jacobian_rows`` holds per sample beyond its output rows (the per-sample gradients
    inside vmap, the forward's activations), probed on the first sample; cached on ``fm``, and
    across calls on the same model and shapes (:func:`~ntkscope.kernel.kept.kept`)."""
    cache = fm.__dict__.setdefault("_vmap_transients", {})
    if id(data) in cache:
        return cache[id(data)]
    across = kept(fm, data, 1, "per-sample gradients")  # the same model and shapes: measured once
    if "transient" not in across:
        one = take(data, slice(0, 1))
        out = torch.empty(1, fm.n_outputs, fm.selection.n_params, dtype=fm.dtype, device=fm.device)
        row = fm.n_outputs * fm.selection.n_params * fm.itemsize
        try:
            across["transient"], _ = measure_transient(lambda: jacobian_rows(fm, one, out), 1, 3 * row, fm.device)
        except InputError:  # a non-finite output: the computation itself reports every such sample
            return Transient(3 * row, False)
        log.info("per-sample gradients: %s a sample beyond its row of J (%s)",
                 format_bytes(across["transient"].per_sample),
                 "measured" if across["transient"].measured else "a guess: no peak memory to read here")
    cache[id(data)] = across["transient"]
    return cache[id(data)]


def vjp_rows(fm: FunctionalModel, data: dict, weights: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``J^T v`` = gradient of ``sum_i v_i f(x_i)``, as a flat (P,) vector; weights: (n,)."""
    n = weights.shape[0]
    total = torch.zeros(fm.selection.n_params, dtype=fm.dtype, device=fm.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(n, start + chunk_size))
        values, pullback = vjp(lambda p: fm.outputs(p, take(data, rows)), fm.params)
        check_finite(values.detach(), start)
        (g,) = pullback(weights[rows].to(values.dtype))
        total += fm.flatten(g)
    return total


def jvp_rows(fm: FunctionalModel, data: dict, direction: torch.Tensor, chunk_size: int, n: int) -> torch.Tensor:
    """``J w`` for a flat (P,) direction, as an (n,) vector: one forward-mode pass per chunk."""
    tangent = fm.unflatten(direction)
    result = torch.empty(n, dtype=fm.dtype, device=fm.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(n, start + chunk_size))
        _, push = jvp(lambda p: fm.outputs(p, take(data, rows)), (fm.params,), (tangent,))
        result[rows] = push
    return result


@dataclass(frozen=True)
class PerSampleGrads:
    """Per-sample gradients of ``f`` over the selected parameters.

    Attributes
    ----------
    grads : dict of str to Tensor
        Each of shape (n, *param.shape) for scalar outputs, (n, K, *param.shape)
        for vector outputs. Views into one (n, K, P) buffer.
    outputs : Tensor of shape (n,) or (n, K)
        f(x_i) at the current parameters.
    names : tuple of str
        Parameter names, in the column order of :meth:`flatten`.
    """

    grads: dict
    outputs: torch.Tensor
    names: tuple
    _flat: torch.Tensor

    def flatten(self) -> torch.Tensor:
        """The Jacobian J: (n, P) for scalar outputs, (n, K, P) for vector outputs."""
        return self._flat[:, 0] if self.outputs.dim() == 1 else self._flat


@entry("per_sample_grads")
def per_sample_grads(model, batch, *, train=False, options: KernelOptions | None = None, **fields) -> PerSampleGrads:
    """Per-sample gradients ``grad_theta f(x_i)`` with ``vmap(grad(f))``, chunk by chunk.

    Parameters
    ----------
    model : nn.Module
        Taking a tensor batch, or a dict batch as keyword arguments.
    batch : Tensor of shape (n, ...) or dict of such tensors
        ``input_ids`` (n, T) and ``attention_mask`` (n, T) for language models.
    train : bool
        Keep train mode (dropout on, a different mask per sample): the result is random.
    options, **fields
        :class:`~ntkscope.KernelOptions`, or its fields as keywords: ``output``, ``params``,
        ``dtype``, ``chunk_size``, ``max_memory`` matter here. ``max_memory`` bounds the result.

    Returns
    -------
    PerSampleGrads
    """
    if not isinstance(train, bool):
        raise InputError("train", "must be True or False", train)
    opts = KernelOptions.build(options, **fields)
    with functional_model(model, opts, train=train) as fm:
        data = fm.prepare(batch)
        n = batch_size(batch)
        K, P = fm.n_outputs, fm.selection.n_params
        asked = asked_memory(opts.max_memory, fm.device)
        budget = memory_budget(asked)
        need = n * K * P * fm.itemsize
        if need > budget:
            raise InputError("batch", f"needs {format_bytes(need)} for all per-sample gradients, more than the "
                             f"{format_bytes(budget)} that max_memory={format_bytes(asked)} leaves beside the "
                             f"allocator's {ALLOCATOR_RESERVE:.0%}; use empirical_ntk (streams chunks) or fewer "
                             "params; n", n)
        chunk = opts.chunk_size or default_chunk_size(n, fm, budget)
        flat = torch.empty(n, K, P, dtype=fm.dtype, device=fm.device)  # (n, K, P): J
        outputs = []
        with progress_bar(n, "per-sample gradients", "sample") as bar:
            for start in range(0, n, chunk):
                rows = slice(start, min(n, start + chunk))
                outputs.append(jacobian_rows(fm, take(data, rows), flat[rows], start))
                bar.update(rows.stop - rows.start)
        values = torch.cat(outputs)
        grads = {}
        for name, shape, offset in zip(fm.selection.names, fm.selection.shapes, fm.selection.offsets):
            block = flat[:, :, offset : offset + shape.numel()]
            grads[name] = block.reshape(n, *shape) if fm.scalar else block.reshape(n, K, *shape)
        return PerSampleGrads(grads, values, fm.selection.names, flat)
