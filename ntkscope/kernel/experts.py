"""Per-expert kernels: the empirical NTK of one expert's parameters over the units its router
sends there (docs/design.md §1.5).

A *mixture* is a module whose experts share an input and a router; its kind
(:data:`MIXTURE_KINDS`) says which parameters are expert ``e``'s and how the router's choice is
read from a forward. Expert ``e``'s kernel is ``J_e J_e^T`` with ``J_e`` the Jacobian of the
units' outputs over expert ``e``'s parameters only, and the units are those routed to ``e``:

- ``unit="sequence"``: a sample is a sequence with its output (``output``, e.g. its mean token
  loss), and it is routed when the router sends it (a sequence router: CSE, DEMix) or any of its
  real tokens (a token router: Switch, transformers' top-k mixtures) to ``e``;
- ``unit="token"``: a sample is one position's token value (a causal language model: the value
  of the token it predicts) at a position the router sends to ``e`` (every position of a routed
  sequence, for a sequence router); a position that predicts nothing (padding, the last real
  token) is not a unit.

The router's choice is read once and held: the kernel differentiates the model's function at
these routes, the gate's value (a token router's top-k weight) is part of that function, and the
router's own parameters are not columns of ``J_e`` (they are not the expert's). A gradient of a
unit the router never sends to ``e`` can be non-zero (through attention to earlier tokens that
were), but such a unit is not a row.

Two paths, one answer: when every parameter of the expert is a whole tensor (an expert that is
its own module, as ours are) and the units are sequences, the kernel is
:func:`~ntkscope.kernel.ntk.empirical_ntk` on the routed sequences over those tensors (the
structured kernel where it applies). Otherwise (an expert that is a slice of fused tensors, as in
transformers' Mixtral, OLMoE and Qwen-MoE, whose ``gate_up_proj`` is (E, 2I, H); or token units)
each unit's gradient over the expert's slice, the slice standing in for its row of the fused
tensor, is taken by one backward on its own sample's graph (a unit reads its own sample only),
all of a layer's experts in one pass over the samples.

The statistics of an expert's kernel (split-half |GC|, GC of labels inside an expert) are in
:mod:`ntkscope.gc.experts`.

Adding a kind: :func:`register_mixture` a :class:`MixtureKind` whose ``matches`` recognises the
module, ``n_experts`` counts its experts, ``expert_params`` names each expert's parameters
(relative names, with the index along dim 0 of a fused tensor or None) and ``route_hook``
records the router's choice in a forward (docs/architecture.md, "Extension points").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from ntkscope.core.checks import InputError, check_choice, entry, fail
from ntkscope.core.lm import causal_targets, token_values
from ntkscope.core.memory import available_memory_bytes, format_bytes
from ntkscope.core.registry import Registry
from ntkscope.kernel.grads import functional_model
from ntkscope.kernel.ntk import empirical_ntk
from ntkscope.kernel.objectives import CallableModule, CausalLMLoss, primary_output, take
from ntkscope.kernel.options import KernelOptions
from ntkscope.kernel.padding import trimmed

log = logging.getLogger(__name__)

UNITS = ("auto", "sequence", "token")
ROW_COLUMNS = ["sample", "position"]


@dataclass(frozen=True)
class MixtureKind:
    """How the per-expert kernel reads one kind of mixture layer.

    Attributes
    ----------
    name : str
    unit : {"sequence", "token"}
        What the router routes.
    matches : callable module -> bool
    n_experts : callable module -> int
    expert_params : callable (module, e) -> list of (relative name, index or None)
        Expert ``e``'s parameters, named relative to the module; ``index``: the expert's row
        along dim 0 of a fused tensor (None: the whole tensor is the expert's).
    route_hook : callable (module, sink) -> list of hook handles
        Hooks that, in a forward, call ``sink(routed)`` with the router's choice: a (B, E) bool
        (sequence routers) or (B, T, E) bool (token routers) tensor, True where the unit goes.
    """

    name: str
    unit: str
    matches: Callable
    n_experts: Callable
    expert_params: Callable
    route_hook: Callable = field(repr=False)


#: the kinds of mixture layer the per-expert kernel reads, by name
MIXTURE_KINDS = Registry("mixture kind")


def register_mixture(kind: MixtureKind) -> MixtureKind:
    """Add a mixture kind (first match wins, in registration order)."""
    if kind.unit not in ("sequence", "token"):
        raise fail("register_mixture", "kind.unit", "must be 'sequence' or 'token'", kind.unit)
    MIXTURE_KINDS.add(kind.name, kind, func="register_mixture")
    return kind


def is_topk_router(module) -> bool:
    """A transformers top-k router (``MixtralTopKRouter``, ``OlmoeTopKRouter``, ...): tokens (N, d)
    -> (logits (N, E), top-k scores (N, k), top-k indices (N, k))."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "num_experts") and hasattr(module, "top_k")


def _fused(module) -> list:
    """Names of the experts module's parameters with one row per expert along dim 0."""
    experts, E = module.experts, int(module.gate.num_experts)
    return [n for n, p in experts.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == E]


def _topk_matches(module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return gate is not None and is_topk_router(gate) and isinstance(experts, nn.Module) and bool(_fused(module))


def _topk_routes(module, sink) -> list:
    shape = {}

    def before(_m, args, kwargs):
        hidden = args[0] if args else next(iter(kwargs.values()))
        shape["bt"] = hidden.shape[:-1]

    def after(_m, _args, out):
        indices = out[-1]  # (N, k)
        routed = torch.zeros(indices.shape[0], module.gate.num_experts, dtype=torch.bool, device=indices.device)
        routed.scatter_(1, indices, True)
        sink(routed.reshape(*shape["bt"], -1))

    return [module.register_forward_pre_hook(before, with_kwargs=True), module.gate.register_forward_hook(after)]


register_mixture(MixtureKind(
    name="transformers-topk", unit="token", matches=_topk_matches,
    n_experts=lambda m: int(m.gate.num_experts),
    expert_params=lambda m, e: [(f"experts.{n}", e) for n in _fused(m)],
    route_hook=_topk_routes))


def find_mixtures(model: nn.Module) -> dict:
    """The model's mixture layers: {module path: (MixtureKind, module)}, in module order (a
    matched module's own submodules are not searched)."""
    found, inside = {}, []
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        kind = next((k for k in MIXTURE_KINDS.values() if k.matches(module)), None)
        if kind is not None:
            found[path] = (kind, module)
            inside.append(path)
    return found


@dataclass(frozen=True)
class ExpertKernel:
    """One expert's kernel.

    Attributes
    ----------
    layer : str
        The mixture's module path.
    expert : int
    unit : {"sequence", "token"}
    rows : DataFrame
        ROW_COLUMNS, one row per unit in the kernel's order: the sample and, for token units, the
        position whose value it is (-1 for sequence units).
    matrix : Tensor (m, m)
        ``J_e J_e^T`` over the units.
    n_params : int
        The expert's parameter count (columns of ``J_e``).
    method : str
        "engine: <method>" (:func:`empirical_ntk` on the routed sequences) or "per-unit backward"
        (", q panels" where ``J_e`` was made in panels).
    """

    layer: str
    expert: int
    unit: str
    rows: pd.DataFrame
    matrix: torch.Tensor
    n_params: int
    method: str

    def samples(self) -> np.ndarray:
        return self.rows["sample"].to_numpy()


def _routes(model, data: dict, run, layers: dict) -> dict:
    """Each layer's routed units in one forward: {path: (B, E) or (B, T, E) bool on CPU}."""
    got, handles = {}, []
    for path, (kind, module) in layers.items():
        def sink(routed, path=path):
            got[path] = routed.detach().cpu()
        handles += kind.route_hook(module, sink)
    try:
        with torch.no_grad():
            run(data["inputs"])
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(layers) - set(got))
    if missing:
        raise InputError("layer", "names a mixture whose router did not run in the model's forward", missing)
    return got


def _units(routed: torch.Tensor, e: int, unit: str, mask: torch.Tensor, kept: torch.Tensor | None) -> pd.DataFrame:
    """The units routed to expert ``e``: ROW_COLUMNS, in sample then position order. A causal
    language model's sequence is routed when a position with a value (``kept``) is."""
    mask = mask.cpu().bool()
    if routed.dim() == 2:  # a sequence router
        to_e = routed[:, e][:, None] & mask
    else:
        to_e = routed[..., e] & mask
    if unit == "sequence":  # a causal value never reads the last real token: routed there alone, no gradient
        samples = torch.nonzero((to_e if kept is None else to_e & kept.cpu()).any(1)).flatten().numpy()
        return pd.DataFrame({"sample": samples, "position": -1}, columns=ROW_COLUMNS)
    at = torch.nonzero(to_e & kept.cpu()).numpy()
    return pd.DataFrame({"sample": at[:, 0], "position": at[:, 1]}, columns=ROW_COLUMNS)


@entry("expert_ntk")
def expert_ntk(model: nn.Module, batch, *, layer: str | None = None, experts=None, unit: str = "auto",
               min_units: int = 1, options: KernelOptions | None = None, **fields) -> list:
    """Each expert's empirical NTK over its own parameters and the units routed to it.

    Parameters
    ----------
    model : a model with mixture layers (:func:`find_mixtures`; :data:`MIXTURE_KINDS`).
    batch : (n, T) token ids or a dict with ``input_ids`` and ``attention_mask`` (and ``domains``
        for a DEMix model).
    layer : the mixture's module path; None: every mixture layer of the model.
    experts : expert indices (default all).
    unit : "auto" (what the router routes), "sequence" or "token" (a causal language model's
        per-token value of ``output``).
    min_units : experts with fewer routed units are left out.
    options, **fields : :class:`~ntkscope.KernelOptions` or its fields (``output``, ``method``,
        ``dtype``, ``device``, ``max_memory``, ...); ``params`` is set per expert.

    Returns
    -------
    list of ExpertKernel, by layer then expert.
    """
    check_choice("unit", unit, set(UNITS))
    if "params" in fields or (options is not None and options.params is not None):
        raise InputError("params", "is set per expert by expert_ntk (each kernel is over its expert's parameters)",
                         fields.get("params", options.params if options else None))
    opts = KernelOptions.build(options, **fields)
    if isinstance(min_units, bool) or not isinstance(min_units, int) or min_units < 1:
        raise InputError("min_units", "must be a positive integer", min_units)
    found = find_mixtures(model)
    if not found:
        raise InputError("model", f"has no mixture layer (kinds read: {', '.join(MIXTURE_KINDS)})",
                         type(model).__name__)
    if layer is not None:
        if layer not in found:
            raise InputError("layer", f"must be one of the model's mixture layers ({', '.join(found)})", layer)
        found = {layer: found[layer]}
    with functional_model(model, opts) as fm:
        data = fm.prepare(batch)
        mask, kept = _masks(fm, data)
        inner = fm.module.model if isinstance(fm.module, CallableModule) else fm.module  # a copy in another dtype
        found = {path: (kind, inner.get_submodule(path)) for path, (kind, _) in found.items()}
        routed = _routes(inner, data, lambda inputs: fm.run(fm.params, inputs), found)
        out = []
        for path, (kind, module) in found.items():
            own = kind.unit if unit == "auto" else unit
            if own == "token" and not isinstance(fm.objective, CausalLMLoss):
                raise InputError("unit", "token units need a per-token value of a causal language model (output "
                                 "'loss', 'true-logit', ...)", fm.objective.name)
            E = kind.n_experts(module)
            chosen = range(E) if experts is None else _check_experts(experts, E)
            todo = {}
            for e in chosen:
                rows = _units(routed[path], e, own, mask, kept)
                if len(rows) >= min_units:
                    todo[e] = (rows, [(f"{path}.{name}" if path else name, index)
                                      for name, index in kind.expert_params(module, e)])
            out += _layer_kernels(model, batch, fm, data, path, own, todo, opts)
    return out


def _check_experts(experts, E: int) -> list:
    chosen = [experts] if isinstance(experts, (int, np.integer)) else list(experts)
    bad = [e for e in chosen if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or not 0 <= e < E]
    if bad or not chosen:
        raise InputError("experts", f"must be expert indices in [0, {E})", experts)
    return [int(e) for e in chosen]


def _masks(fm, data: dict) -> tuple:
    aux = data["aux"]
    if "mask" in aux:
        mask = aux["mask"]
    else:
        inputs = data["inputs"]
        ids = inputs if torch.is_tensor(inputs) else inputs["input_ids"]
        mask = torch.ones(ids.shape[:2], dtype=torch.bool)
    kept = None
    if isinstance(fm.objective, CausalLMLoss):
        _, kept = causal_targets(aux["targets"], aux["mask"])
    return mask.bool(), kept


def _layer_kernels(model, batch, fm, data, path, unit, todo: dict, opts) -> list:
    """The kernels of one layer's experts ``todo`` ({e: (rows, params)}): by the engine where every
    parameter is a whole tensor and the units are sequences; else from each unit's gradient, all
    the layer's experts in one pass over the samples when their Jacobians fit ``max_memory`` (a
    sample's forward shared by its experts, a unit's one backward by the experts it goes to), or
    expert by expert in panels."""
    out, rest = {}, {}
    for e, (rows, params) in todo.items():
        if unit == "sequence" and all(index is None for _, index in params):
            idx = torch.tensor(rows["sample"].to_numpy())
            sub = take(batch, idx) if isinstance(batch, dict) else batch[idx]
            k = empirical_ntk(model, sub, options=dataclasses.replace(opts, params=[n for n, _ in params]))
            out[e] = ExpertKernel(path, e, unit, rows, k.matrix, k.n_params, f"engine: {k.method}")
        else:
            rest[e] = (rows, params)
    if rest:
        grads = _Gradients(fm, data, unit, rest)
        budget = opts.max_memory or available_memory_bytes(fm.device) // 2
        if sum(len(rows) * grads.P[e] for e, (rows, _) in rest.items()) * fm.itemsize * 2 <= budget:
            with torch.enable_grad():  # a caller's no_grad would leave nothing to differentiate
                J = grads.sweep()
            for e, (rows, _) in rest.items():
                out[e] = ExpertKernel(path, e, unit, rows, J[e] @ J[e].T, grads.P[e], "per-unit backward")
        else:
            for e, (rows, _) in rest.items():
                K, panels = expert_gram(grads, e, budget)
                out[e] = ExpertKernel(path, e, unit, rows, K, grads.P[e],
                                      "per-unit backward" + (f", {panels} panels" if panels > 1 else ""))
    return [out[e] for e in todo]


class _Gradients:
    """Each unit's gradient over its expert's parameters, for experts ``todo`` ({e: (rows,
    params)}) of one layer; a fused tensor's row ``index`` stands in for that row of the tensor.

    A unit's value reads its own sample only (routes and values are per sample: no capacity
    shared across a batch in eval), so each sample runs alone, cut at its last real token where
    the objective allows (as the structured kernel cuts padding), and each unit takes one backward
    on that sample's small graph (about 1/n of a backward through the whole batch's), over the
    parameters of every expert it goes to. The last sample's forward is kept for its next units."""

    def __init__(self, fm, data: dict, unit: str, todo: dict):
        named = dict(fm.module.named_parameters())
        prefix = "model." if isinstance(fm.module, CallableModule) else ""  # a callable output's wrapper
        self.leaves, pieces, full = {}, {}, {}
        for e, (_, params) in todo.items():
            self.leaves[e] = []
            for name, index in params:
                tensor = named[prefix + name].detach()
                leaf = (tensor if index is None else tensor[index]).clone().requires_grad_(True)
                self.leaves[e].append(leaf)
                if index is None:
                    full[prefix + name] = leaf
                else:
                    pieces.setdefault(prefix + name, {})[index] = leaf
        for name, rows in pieces.items():  # a fused tensor: the chosen experts' rows are leaves
            tensor = named[name].detach()
            full[name] = torch.stack([rows.get(j, tensor[j]) for j in range(tensor.shape[0])])
        self.fm, self.data, self.unit, self.todo = fm, data, unit, todo
        self.P = {e: sum(leaf.numel() for leaf in leaves) for e, leaves in self.leaves.items()}
        self.params = {**{k: v for k, v in fm.params.items() if k not in full}, **full}
        self.frozen = {k: v for k, v in fm.frozen.items() if k not in full}  # an expert with requires_grad off
        self.held = (None, None)  # (sample, its values with their graph)

    def _values(self, i: int) -> torch.Tensor:
        if self.held[0] != i:
            self.held = (None, None)  # the previous sample's graph goes before the next is built
            one = take(self.data, torch.tensor([i], device=self.fm.device))
            one, _, _ = trimmed(self.fm.objective, one)
            self.held = (i, _values(self.fm, self.params, self.frozen, one, self.unit)[0])  # () or (L,)
        return self.held[1]

    def _grad(self, sample: int, position: int, experts: list) -> list:
        """One unit's gradient over each of ``experts``' parameters: [(P_e,)]."""
        values = self._values(sample)
        value = values if self.unit == "sequence" else values[position]
        leaves = [leaf for e in experts for leaf in self.leaves[e]]
        grads = torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True)
        flat = [torch.zeros(leaf.numel(), dtype=leaf.dtype, device=leaf.device) if g is None else g.reshape(-1)
                for g, leaf in zip(grads, leaves)]
        out, at = [], 0
        for e in experts:
            k = len(self.leaves[e])
            out.append(torch.cat(flat[at:at + k]))
            at += k
        return out

    def sweep(self) -> dict:
        """Every expert's ``J_e`` (m_e, P_e) in one pass over the samples."""
        J = {e: torch.empty(len(rows), self.P[e], dtype=self.fm.dtype, device=self.fm.device)
             for e, (rows, _) in self.todo.items()}
        where: dict = {}
        for e, (rows, _) in self.todo.items():
            for r, (i, t) in enumerate(zip(rows["sample"].to_numpy(), rows["position"].to_numpy())):
                where.setdefault((int(i), int(t)), []).append((e, r))
        for (i, t), places in sorted(where.items()):
            for (e, r), g in zip(places, self._grad(i, t, [e for e, _ in places])):
                J[e][r] = g
        return J

    def rows(self, e: int, start: int, stop: int) -> torch.Tensor:
        """Units ``start:stop`` of expert ``e``: (c, P_e)."""
        rows = self.todo[e][0]
        out = torch.empty(stop - start, self.P[e], dtype=self.fm.dtype, device=self.fm.device)
        for r in range(start, stop):
            out[r - start] = self._grad(int(rows["sample"].iloc[r]), int(rows["position"].iloc[r]), [e])[0]
        return out


def expert_gram(grads: _Gradients, e: int, budget: int) -> tuple[torch.Tensor, int]:
    """Expert ``e``'s ``J_e J_e^T`` without holding ``J_e``: its units in panels of at most half the
    budget each, a panel's gradients against every later panel's, each later panel taken again
    (``q (q + 1) / 2`` panels' backwards for q panels). Returns (K (m, m), panels)."""
    fm = grads.fm
    m, P, item = len(grads.todo[e][0]), grads.P[e], fm.itemsize
    unit_bytes = 2 * P * item  # a unit's gradient, and its backward's own
    if 2 * unit_bytes > budget:
        raise InputError("max_memory", f"is below the {format_bytes(2 * unit_bytes)} that expert_gram needs for two "
                         f"units' gradients over {P} parameters; raise it", format_bytes(budget))
    panel = max(1, budget // (2 * unit_bytes))
    K = torch.empty(m, m, dtype=fm.dtype, device=fm.device)
    starts = list(range(0, m, panel))
    with torch.enable_grad():  # a caller's no_grad would leave nothing to differentiate
        for i, a0 in enumerate(starts):
            a1 = min(m, a0 + panel)
            A = grads.rows(e, a0, a1)
            K[a0:a1, a0:a1] = A @ A.T
            for b0 in starts[i + 1:]:
                b1 = min(m, b0 + panel)
                block = A @ grads.rows(e, b0, b1).T
                K[a0:a1, b0:b1] = block
                K[b0:b1, a0:a1] = block.T
    return K, len(starts)


def _values(fm, params: dict, frozen: dict, data: dict, unit: str) -> torch.Tensor:
    """The units' outputs: each sample's (n,), or each position's token value (n, T)."""
    if unit == "sequence":
        return fm.outputs(params, data, frozen)
    logits = primary_output(fm.run(params, data["inputs"], frozen))
    targets, keep = causal_targets(data["aux"]["targets"], data["aux"]["mask"])
    return token_values(logits, targets, keep, value=fm.objective.name, reduction="none")
