"""The exact NTK from per-layer factors, without ever forming a per-sample gradient of a big layer.

For a linear map ``y = x W^T`` applied at every token, sample i's gradient is
``sum_t delta_it a_it^T`` (a: the layer's input, delta: the gradient at its output), so

    <grad_W f_i, grad_W f_j> = sum_{t,s} (a_it . a_js) (delta_it . delta_js)          ("ghost" form)

One forward and one backward of ``sum_i f_i`` over a chunk of samples gives a and delta for
every sample at once: samples are independent in a batch, so ``d(sum_i f_i)/d y_it`` is
sample i's own cotangent. The same holds for an Embedding (``a_it . a_js`` becomes
``[token_it == token_js]``), and for tied weights across uses (the Embedding x tied-head
cross term is ``sum_{t,s} delta^head_js[token_it] (delta^emb_it . x^head_js)``). Biases and
LayerNorm affine parameters have small per-sample gradients (``sum_t delta_it``,
``sum_t delta_it * xhat_it``) that are formed directly ("materialised").

A per-pair cost model picks, for every use pair, the ghost form (``c_a c_b T_a T_b (d_in + d_out)``
multiply-adds) or the materialised one (``(c_a T_a + c_b T_b) d_in d_out + c_a c_b d_in d_out``):
ghost wins for short sequences and wide layers, materialised for long ones (Novak et al. 2022,
"Fast Finite Width NTK"; the same structure as DP-SGD's ghost norms, Bu et al. 2023, and LoGra).

What is covered: ``nn.Linear``, Hugging Face ``Conv1D``, ``nn.Embedding`` (also a position
embedding whose output is broadcast over the batch) and ``nn.LayerNorm``, whose parameters are
selected and whose input carries the sample dimension. Every other selected parameter (a raw
``nn.Parameter`` used functionally, a layer applied to gathered tokens) goes through per-sample
gradients for just that parameter (:func:`~ntkscope.kernel.grads.jacobian_rows`). A probe on
the first samples checks, per parameter, that the captured uses add up to autograd's batch
gradient; a parameter that fails (an uncaptured functional use) falls back too, so the kernel
is always exact. Sparse-expert layers that follow the ``per_sample_dispatch`` protocol
(:func:`~ntkscope.kernel.grads.functional_model`) run every expert on every sample with a
routing mask, so their experts are covered like any layer.

Scalar outputs only (one cotangent per sample). Memory: the factors of a panel of samples,
plus tiles of the pair products; panels that do not fit are streamed like the exact method's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ntkscope.core.checks import InputError
from ntkscope.core.memory import PeakMemory, format_bytes
from ntkscope.core.progress import progress_bar
from ntkscope.kernel.factors import (Dense, Embed, Linear, Summed, empty_rows, is_conv1d, pair_kernel, put_rows,
                                     rows_of, summed, use_products)
from ntkscope.kernel.grads import (VMAP_FACTOR, FunctionalModel, Transient, check_finite, jacobian_rows,
                                   measure_transient, step_cost)
from ntkscope.kernel.kept import keeps_model, kept
from ntkscope.kernel.kernels import kernel_bytes
from ntkscope.kernel.objectives import take
from ntkscope.kernel.padding import length_order, longest, positionwise, trimmed
from ntkscope.kernel.params import ParameterSelection
from ntkscope.kernel.structured_layout import MAX_CHUNK, Probe, layout, work_elements

log = logging.getLogger(__name__)


def _supported(module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):
        return module.max_norm is None and not module.scale_grad_by_freq
    return isinstance(module, (nn.Linear, nn.LayerNorm)) or is_conv1d(module)


# ---- capture: one forward and one backward of a chunk -------------------------------------------


@dataclass
class FactorPlan:
    """Which parameters go through factors, which through per-sample gradients, and why."""

    modules: dict  # module -> {role ("weight"/"bias"): param key}
    structured: list  # param keys
    fallback: list  # param keys
    broadcast: set = field(default_factory=set)  # Embedding modules whose output is broadcast over samples
    reasons: dict = field(default_factory=dict)  # param key -> why it falls back


def _owners(fm: FunctionalModel) -> dict:
    """Supported module -> {role: selected param key} (a tied parameter has several modules)."""
    by_id = {}
    for name, p in fm.module.named_parameters(remove_duplicate=False):
        if name in fm.params:
            by_id.setdefault(id(p), name)
    owners = {}
    for module in fm.module.modules():
        if not _supported(module):
            continue
        roles = {role: by_id[id(p)] for role, p in module._parameters.items()
                 if p is not None and id(p) in by_id and role in ("weight", "bias")}
        if roles:
            owners[module] = roles
    return owners


class _Capture:
    """Forward hooks that record each supported module's input and output during one forward."""

    def __init__(self, plan: FactorPlan, c: int):
        self.records = []
        self.c = c
        self.plan = plan
        self.handles = [m.register_forward_hook(self._hook) for m in plan.modules]

    def _hook(self, module, inputs, output):
        x = inputs[0]
        if module in self.plan.broadcast and (x.dim() == 1 or x.shape[0] != self.c):
            # a position embedding (T,) or (1, T): give every sample its own copy, so its cotangent is per sample
            if x.dim() == 1:
                x, output = x[None], output[None]
            if x.shape[0] == 1:
                x, output = x.expand(self.c, *x.shape[1:]), output.expand(self.c, *output.shape[1:])
                self.records.append((module, x, output))
                return output
        self.records.append((module, x, output))
        return None

    def close(self):
        for h in self.handles:
            h.remove()


def _factors(module, x, delta, roles: dict, c: int) -> dict:
    """{param key: factor} for one call of ``module`` (input x, output cotangent delta)."""
    out = {}
    if isinstance(module, nn.Embedding):
        tokens = x.reshape(c, -1)
        d = delta.reshape(c, tokens.shape[1], -1)
        if module.padding_idx is not None:
            d = d * (tokens != module.padding_idx).unsqueeze(-1).to(d.dtype)
        out[roles["weight"]] = Embed(tokens, d, module.num_embeddings)
        return out
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        width = math.prod(shape)
        d = delta.reshape(c, -1, width)
        if "weight" in roles:
            xhat = F.layer_norm(x, shape, None, None, module.eps).reshape(c, -1, width)
            out[roles["weight"]] = Dense((d * xhat).sum(1))
        if "bias" in roles:
            out[roles["bias"]] = Dense(d.sum(1))
        return out
    d_in = x.shape[-1]
    a = x.reshape(c, -1, d_in)
    d = delta.reshape(c, a.shape[1], -1)
    if "weight" in roles:
        out[roles["weight"]] = Linear(a, d, io=is_conv1d(module))
    if "bias" in roles:
        out[roles["bias"]] = Dense(d.sum(1))
    return out


def capture(fm: FunctionalModel, plan: FactorPlan, data: dict, c: int, first_row: int = 0, *, check: bool = False):
    """One forward and backward of ``sum_i f_i`` over ``c`` prepared samples.

    Returns ({param key: [factor per use]}, f (c,), and with ``check`` autograd's batch gradient
    {param key: Tensor} for the structured parameters)."""
    keep = set(plan.structured)  # they need a graph, so that the hooked outputs have one
    params = {k: v.detach().requires_grad_(k in keep) for k, v in fm.params.items()}
    cap = _Capture(plan, c)
    try:
        with torch.enable_grad():
            y = fm.outputs(params, data)
            check_finite(y.detach(), first_row, getattr(fm, "row_order", None))
            if fm.objective.recorder is not None:  # the samples' losses from this forward (a loss-matched null)
                fm.objective.recorder.put(first_row, c)
            outs = [r[2] for r in cap.records]
            wrt = outs + ([params[k] for k in plan.structured] if check else [])
            grads = torch.autograd.grad(y.sum(), wrt, allow_unused=True) if wrt else []
    finally:
        cap.close()
    uses: dict = {}
    for (module, x, out), delta in zip(cap.records, grads[: len(outs)]):
        if delta is None:
            delta = torch.zeros_like(out)
        if x.shape[0] != c:
            if not check:
                raise RuntimeError(f"structured NTK: {type(module).__name__} {list(plan.modules[module].values())} "
                                   f"got {x.shape[0]} rows for {c} samples at samples {first_row}..{first_row + c - 1} "
                                   "(data-dependent dispatch); use method='exact'")
            for key in plan.modules[module].values():
                uses.setdefault(key, []).append(None)  # not aligned with the samples
            continue
        for key, f in _factors(module, x.detach(), delta.detach(), plan.modules[module], c).items():
            uses.setdefault(key, []).append(f)
    batch_grad = dict(zip(plan.structured, grads[len(outs):])) if check else {}
    return uses, y.detach(), batch_grad


def plan_factors(fm: FunctionalModel, data: dict, n: int) -> FactorPlan:
    """Decide which selected parameters are structured, on a probe of the first (up to 2) samples."""
    owners = _owners(fm)
    broadcast = {m for m in owners if isinstance(m, nn.Embedding)}
    plan = FactorPlan(owners, sorted({k for roles in owners.values() for k in roles.values()}), [], broadcast)
    c = min(n, 2)
    first = take(data, slice(0, c))
    with torch.no_grad():
        plain = fm.outputs(fm.params, first)
    uses, y, batch = capture(fm, plan, first, c, check=True)
    if not torch.allclose(y, plain, rtol=1e-5, atol=1e-6):  # expanding a broadcast embedding changed f
        plan.broadcast = set()
        uses, y, batch = capture(fm, plan, first, c, check=True)
    tol = 1e-8 if fm.dtype == torch.float64 else 1e-4
    scale = max([float(g.abs().max()) for g in batch.values() if g is not None] + [1e-30])
    structured = []
    for key in plan.structured:
        parts = uses.get(key, [])
        if not parts or any(f is None for f in parts):
            plan.reasons[key] = "its layer's input has no sample dimension"
            continue
        total = sum(summed(f) for f in parts)
        g = batch.get(key)
        ref = torch.zeros_like(total) if g is None else g.reshape(-1)
        if not torch.allclose(total, ref, rtol=tol, atol=tol * scale):
            plan.reasons[key] = "used outside its module (captured uses do not add up to its gradient)"
            continue
        structured.append(key)
    plan.structured = structured
    plan.fallback = [k for k in fm.params if k not in set(structured)]
    for k in plan.fallback:
        plan.reasons.setdefault(k, "no structured form for its module")
    if plan.fallback:
        log.info("structured: %d parameters by per-sample gradients: %s", len(plan.fallback),
                 "; ".join(f"{k} ({plan.reasons[k]})" for k in plan.fallback[:6]))
    keep = set(structured)
    plan.modules = {m: {r: k for r, k in roles.items() if k in keep} for m, roles in plan.modules.items()}
    plan.modules = {m: roles for m, roles in plan.modules.items() if roles}
    return plan


def _restricted(fm: FunctionalModel, names: list) -> FunctionalModel:
    """``fm`` over the parameters ``names`` alone (the others frozen): for the per-sample fallback."""
    sub = object.__new__(FunctionalModel)
    sub.__dict__.update(fm.__dict__)
    sub.params = {k: fm.params[k] for k in names}
    sub.frozen = {**fm.frozen, **{k: v for k, v in fm.params.items() if k not in sub.params}}
    shapes = tuple(fm.params[k].shape for k in names)
    offsets = tuple(int(o) for o in np.cumsum([0] + [s.numel() for s in shapes])[:-1])
    total = int(sum(s.numel() for s in shapes))
    sub.selection = ParameterSelection(tuple(names), shapes, offsets, total, {"all": (0, total)})
    return sub


# ---- the kernel ---------------------------------------------------------------------------------


@dataclass
class Chunk:
    """Everything about a run of samples that the kernel needs: factors per structured parameter,
    and per-sample gradients (c, P_fallback) of the fallback parameters."""

    uses: dict
    fallback: torch.Tensor | None


def _chunk(fm, plan, sub, data, rows: slice) -> Chunk:
    c = rows.stop - rows.start
    part = take(data, rows)
    uses = {}
    if plan.structured:
        short, L, T = trimmed(fm.objective, part)  # the chunk cut at its longest sample (kernel/padding.py)
        uses = capture(fm, plan, short, c, rows.start)[0] if L < T else None
        if uses is None or not positionwise(uses, L):  # nothing to trim, or a layer not by position
            uses, _, _ = capture(fm, plan, part, c, rows.start)
    J = None
    if sub is not None:
        J = torch.empty(c, 1, sub.selection.n_params, dtype=fm.dtype, device=fm.device)
        jacobian_rows(sub, part, J, rows.start)
        J = J[:, 0]
    return Chunk(uses, J)


def _empty(ch: Chunk, n: int, length: int | None = None) -> Chunk:
    """Room for the factors (and fallback gradients) of ``n`` samples, shaped like ``ch``'s, with at
    least ``length`` positions for its factors by position (at least ``ch``'s own)."""
    def room(f):
        own = _positions(f)
        return empty_rows(f, n, None if own is None or length is None else max(own, length))
    uses = {k: [room(f) for f in parts] for k, parts in ch.uses.items()}
    J = None if ch.fallback is None else ch.fallback.new_empty((n, *ch.fallback.shape[1:]))
    return Chunk(uses, J)


def _positions(f) -> int | None:
    return f.a.shape[1] if isinstance(f, Linear) else f.tokens.shape[1] if isinstance(f, Embed) else None


def _put_chunk(dst: Chunk, src: Chunk, start: int) -> None:
    for k, parts in src.uses.items():
        for d, f in zip(dst.uses[k], parts):
            put_rows(d, f, start)
    if src.fallback is not None:
        dst.fallback[start : start + src.fallback.shape[0]] = src.fallback


#: Where no peak can be read: a chunk's forward and backward hold about this many times its
#: factors (measured 2.9-4.7 on GPT-2 shapes, benchmarks/README.md)
_TRANSIENT_GUESS = 5


#: a workload that fits the budget this many times over, with a chunk's transient read from its
#: first (warm-up) run, is not measured again: the warm-up's peak holds more than the chunk's own
#: (the library code a first call pages in), so it errs high; the two measured runs are a fixed
#: cost that small workloads feel
CLEAR_FIT = 4


def _clearly_fits(per_sample: int, transient: Transient, n: int, budget: int | None) -> bool:
    """Whether ``n`` samples' factors (and as many streamed past them) and a chunk of
    :data:`~ntkscope.kernel.structured_layout.MAX_CHUNK` at ``transient`` fit ``budget``
    :data:`CLEAR_FIT` times over."""
    return budget is not None and CLEAR_FIT * ((2 * n + 1) * per_sample + transient.bytes(MAX_CHUNK)) <= budget


def probe(fm: FunctionalModel, data: dict, n: int, budget: int | None = None) -> Probe:
    """Plan the structured method on the first samples of ``data`` and measure a chunk of them
    (from its first run alone when the workload clearly fits ``budget``: :func:`_clearly_fits`);
    cached on ``fm`` per data, and across calls on the same model and data shapes
    (:func:`~ntkscope.kernel.kept.kept`): a training run's tracker plans and measures once, not at
    every probe."""
    cache = fm.__dict__.setdefault("_structured_probes", {})
    if id(data) in cache:
        return cache[id(data)]
    across = kept(fm, data, min(n, 2), "structured")
    if "probe" in across:
        cache[id(data)] = across["probe"]
        return across["probe"]
    plan = plan_factors(fm, data, n)
    c = min(n, 2)
    sub = _sub(fm, plan)

    def run():
        return _chunk(fm, plan, sub, data, slice(0, c))

    with PeakMemory(fm.device) as first:  # also the measurement's warm-up
        ch = run()
    total = sum(t.numel() * t.element_size() for parts in ch.uses.values() for f in parts
                for t in vars(f).values() if torch.is_tensor(t))
    if ch.fallback is not None:
        total += ch.fallback.numel() * ch.fallback.element_size()
    per_sample = max(1, total // c)
    transient = Transient(-(-first.bytes // c), True) if first.bytes is not None else None
    fits = transient is not None and _clearly_fits(per_sample, transient, n, budget)
    if not fits:
        del ch
        transient, ch = measure_transient(run, c, 0, fm.device, warmed=True)
    if not transient.measured:
        transient = Transient(_TRANSIENT_GUESS * per_sample, False)
    # one sample's factors, copied (a view would keep the probe's chunk alive), for the cost model
    uses = {k: [empty_rows(f, 1) for f in parts] for k, parts in ch.uses.items()}
    for k, parts in ch.uses.items():
        for dst, f in zip(uses[k], parts):
            put_rows(dst, rows_of(f, slice(0, 1)), 0)
    del ch
    n_fallback = int(sum(fm.params[k].numel() for k in plan.fallback))
    load = step_cost(fm, data, 1) * (1 + (VMAP_FACTOR if plan.fallback else 0))
    result = Probe(plan, per_sample, uses, n_fallback, transient, load, fm.device.type != "cpu")
    log.info("structured: factors %s a sample; a chunk's forward and backward hold %s a sample (%s)",
             format_bytes(per_sample), format_bytes(transient.per_sample),
             f"its first run's peak: the workload fits max_memory {CLEAR_FIT} times over" if fits
             else "measured" if transient.measured else "a guess: no peak memory to read here")
    cache[id(data)] = result
    if not keeps_model(fm, plan.modules):
        across["probe"] = result
    return result


def _sub(fm, plan):
    return _restricted(fm, plan.fallback) if plan.fallback else None


@dataclass(frozen=True)
class Costs:
    """What the structured method did: pair products by form, passes over the samples."""

    forms: dict
    passes: int
    panel: int
    chunk: int


@dataclass
class Setup:
    """What every chunk and pair product of one structured kernel shares: the probe and plan, the
    restricted model of the fallback parameters, which block each parameter feeds, the work size,
    and the pair products done so far by form."""

    probe: Probe
    sub: FunctionalModel | None
    block_of: dict
    fallback_slices: dict
    work: int
    forms: dict = field(default_factory=dict)


def setup(fm: FunctionalModel, data, n: int, budget: int) -> Setup:
    """The plan of the structured method for ``data`` (probed on its first samples)."""
    if not fm.scalar:
        raise InputError("output", "must be a scalar output for method='structured'", fm.objective.name)
    pr = probe(fm, data, n, budget)
    sub = _sub(fm, pr.plan)
    sel = fm.selection
    block_of = {key: next(b for b, (s, e) in sel.blocks.items() if s <= offset < e)
                for key, offset in zip(fm.params, sel.offsets)}
    slices = {}
    if sub is not None:
        for k, o, shape in zip(sub.params, sub.selection.offsets, sub.selection.shapes):
            slices[k] = slice(o, o + shape.numel())
    return Setup(pr, sub, block_of, slices, work_elements(budget, fm.itemsize))


def load_factors(fm: FunctionalModel, st: Setup, data, a0: int, a1: int, chunk: int, bar=None) -> Chunk:
    """The factors (and fallback gradients) of samples ``a0:a1`` of ``data``, ``chunk`` at a time,
    each chunk copied into room for all of them as soon as it is made."""
    held, length = None, longest(fm.objective, data, slice(a0, a1))
    for c0 in range(a0, a1, chunk):
        part = _chunk(fm, st.probe.plan, st.sub, data, slice(c0, min(a1, c0 + chunk)))
        if held is None and c0 + chunk >= a1:
            held = part  # one chunk: nothing to copy (its factors at its own length)
        else:  # room at the run's longest sample (a chunk captured uncut: at the batch's length)
            held = _empty(part, a1 - a0, length) if held is None else held
            _put_chunk(held, part, c0 - a0)
        del part
        if bar is not None:
            bar.update(1)
    return held


def accumulate(out: dict, st: Setup, A: Chunk, B: Chunk, rows: slice, cols: slice, mirror: bool) -> None:
    """Add the kernel blocks of the samples of ``A`` against those of ``B`` at ``out[block][rows, cols]``
    (and their transpose at ``[cols, rows]`` with ``mirror``)."""
    same = A is B  # a panel against itself: each use pair once, each product's lower tiles mirrored
    for key, parts_a in A.uses.items():
        parts_b = B.uses[key]
        if len(parts_a) != len(parts_b):
            raise RuntimeError(f"structured NTK: {key} was used {len(parts_a)} and {len(parts_b)} times by "
                               "two runs of samples (data-dependent control flow); use method='exact'")
        total = None
        how = "pairs" if len(parts_a) < 2 else use_products(parts_a, parts_b, rows.stop - rows.start,
                                                            cols.stop - cols.start, st.work, same)[0]
        if how == "summed":  # a parameter used more than once (a tied head): one product of the summed uses
            sa = Summed(parts_a)
            total, _ = pair_kernel(sa, sa if same else Summed(parts_b), st.work, symmetric=same)
            st.forms["summed"] = st.forms.get("summed", 0) + 1
        for u, fa in enumerate(parts_a if how == "pairs" else []):
            for v, fb in enumerate(parts_b):
                if same and v < u:
                    continue
                k, form = pair_kernel(fa, fb, st.work, symmetric=same and u == v)
                if same and v > u:
                    k = k + k.T
                st.forms[form] = st.forms.get(form, 0) + 1
                total = k if total is None else total + k
        _put(out[st.block_of[key]], total, rows, cols, mirror)
    for key, cols_fb in st.fallback_slices.items():
        _put(out[st.block_of[key]], A.fallback[:, cols_fb] @ B.fallback[:, cols_fb].T, rows, cols, mirror)
        st.forms["per-sample"] = st.forms.get("per-sample", 0) + 1


def structured_kernels(fm: FunctionalModel, data1, data2, n1: int, n2: int, budget: int,
                       chunk: int | None = None, _ordered: bool = False) -> tuple[dict, Costs]:
    """Exact NTK blocks from layer factors; returns ({block: (n1, n2)}, Costs). A kernel of one
    batch whose padding can be trimmed (:mod:`ntkscope.kernel.padding`) runs on its samples
    ordered by length, and is put back in the batch's order."""
    symmetric = data2 is None
    order = length_order(fm.objective, data1) if symmetric and not _ordered else None
    if order is not None:
        fm.row_order = order  # the batch's index of each row, for the errors that name samples
        try:
            out, costs = structured_kernels(fm, take(data1, torch.as_tensor(order, device=fm.device)), None, n1, n2,
                                            budget, chunk, _ordered=True)
        finally:
            del fm.row_order
        back = torch.as_tensor(np.argsort(order), device=fm.device)
        if fm.objective.recorder is not None:  # its rows were filed in length order
            fm.objective.recorder.loss = fm.objective.recorder.loss[np.argsort(order)]
        return {b: k[back][:, back] for b, k in out.items()}, costs
    st = setup(fm, data1, n1, budget)
    panel, stream, chunk = layout(st.probe, n1, n2, budget, chunk, symmetric, kernel_bytes(fm, n1, n2))
    out = {b: torch.zeros(n1, n2, dtype=fm.dtype, device=fm.device) for b in fm.selection.blocks}
    passes = np.zeros(n1 + (0 if symmetric else n2), dtype=int)
    panels = [(a0, min(n1, a0 + panel)) for a0 in range(0, n1, panel)]

    def streams(a1):
        start, stop = (a1, n1) if symmetric else (0, n2)
        return [(b0, min(stop, b0 + stream)) for b0 in range(start, stop, stream)]

    loads = sum(math.ceil((a1 - a0) / chunk) + sum(math.ceil((b1 - b0) / chunk) for b0, b1 in streams(a1))
                for a0, a1 in panels)
    bar = progress_bar(loads, "structured NTK", "chunk")
    src, offset = (data1, 0) if symmetric else (data2, n1)
    for a0, a1 in panels:
        A = load_factors(fm, st, data1, a0, a1, chunk, bar)
        passes[a0:a1] += 1
        rows = slice(a0, a1)
        if symmetric:
            accumulate(out, st, A, A, rows, rows, False)
        for b0, b1 in streams(a1):
            B = load_factors(fm, st, src, b0, b1, chunk, bar)
            passes[offset + b0 : offset + b1] += 1
            accumulate(out, st, A, B, rows, slice(b0, b1), symmetric)
            del B
        del A  # before the next panel is loaded
    bar.close()
    log.info("structured: panel %d, stream %d, chunk %d, %d passes at most; pair products %s", panel, stream,
             chunk, int(passes.max()), st.forms)
    return out, Costs(st.forms, int(passes.max()), panel, chunk)


def _put(target: torch.Tensor, G: torch.Tensor, rows: slice, cols: slice, mirror: bool) -> None:
    target[rows, cols] += G
    if mirror:
        target[cols, rows] += G.T
