"""Layer factors and their pair products: the arithmetic of the structured NTK.

A *factor* is what one use of a parameter (one call of its module) contributes to the
per-sample gradients of a run of c samples, without forming them:

- :class:`Linear`: inputs a (c, T, d_in) and output cotangents delta (c, T, d_out);
  ``grad_i = sum_t delta_it a_it^T`` (``io``: HF Conv1D's (d_in, d_out) layout).
- :class:`Embed`: token ids (c, T) and cotangents (c, T, d); ``grad_i = sum_t e_{token_it} delta_it^T``.
- :class:`Dense`: per-sample gradients formed directly (c, numel): biases, LayerNorm.

:func:`pair_kernel` gives ``<grad^u_i, grad^v_j>`` for every sample pair of two uses of one
parameter, in the form :func:`pair_choice` (the cost model) says is cheaper: "ghost",
``sum_{t,s} (a_it . a_js)(delta_it . delta_js)`` as two token-pair Gram matrices, or
"materialised", the per-sample gradients formed and multiplied. Pairs with an Embedding are
formed over the vocabulary rows it touches (:func:`_compact`). Everything here takes valid
factors; :mod:`ntkscope.kernel.structured` captures them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

SYMMETRIC_TILES = 4  # a factor against itself: at least this many tiles a side, lower ones mirrored
WIDE = 1024  # a linear layer with this many outputs (a vocabulary) is checked for columns to merge
MERGE_BYTES = 1 << 20  # bytes of flags for comparing a cotangent's rows with their reference column at once
MERGE_CHECK_ROWS = 1024  # rows compared between two checks that a merge still keeps under half the columns
MERGE_SAMPLE = 64  # rows that turn a dense cotangent down before every row is compared
#: on a CPU, a product's per-sample gradients are formed this many elements at a time (a block of
#: output units for all the samples of its tile together) and multiplied as soon as each block is
#: formed: the whole (c, numel) is never held, and each block is still in cache when it is
#: multiplied. Profiled on the small GPT's tied 8192-token head at n = 128: 0.38 s whole, 0.24 s
#: in blocks of 2**21 elements; 1.3-1.8x on three other head shapes, and blocks of 2**23 were slower
BLOCK_ELEMENTS = 1 << 21


# ---- factors: what one use of a parameter contributes to the per-sample gradients of a chunk ----


def is_conv1d(module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x W + b`` with W of shape (d_in, d_out), a
    :class:`Linear` factor with ``io``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


@dataclass
class Linear:
    """``grad_i = sum_t delta_it a_it^T``; a (c, T, d_in), delta (c, T, d_out); ``io``: W is (d_in, d_out)."""

    a: torch.Tensor
    delta: torch.Tensor
    io: bool = False

    def materialise(self) -> torch.Tensor:  # (c, numel)
        eq = "cti,cto->cio" if self.io else "cti,cto->coi"
        return torch.einsum(eq, self.a, self.delta).reshape(self.a.shape[0], -1)


@dataclass
class Embed:
    """``grad_i = sum_t e_{token_it} delta_it^T``; tokens (c, T) long, delta (c, T, d) (padding rows zeroed)."""

    tokens: torch.Tensor
    delta: torch.Tensor
    vocab: int

    def materialise(self) -> torch.Tensor:  # (c, V * d)
        return self.add_to(self.delta.new_zeros(self.delta.shape[0], self.vocab * self.delta.shape[-1]))

    def add_to(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` (c, V * d) plus these per-sample gradients, in place (scattered rows)."""
        c, T, d = self.delta.shape
        rows = (torch.arange(c, device=self.tokens.device)[:, None] * self.vocab + self.tokens).reshape(-1)
        total.view(c * self.vocab, d).index_add_(0, rows, self.delta.reshape(-1, d))
        return total


@dataclass
class Dense:
    """A per-sample gradient formed directly: (c, numel)."""

    grads: torch.Tensor

    def materialise(self) -> torch.Tensor:
        return self.grads


@dataclass
class Summed:
    """The uses of one parameter added up (a tied embedding and output head): ``grad_i`` is the
    sum of every use's, formed per sample in the parameter's own layout, so that one product over
    the weight replaces one per pair of uses (:func:`use_products` picks whichever is cheaper)."""

    parts: list

    def materialise(self) -> torch.Tensor:  # (c, numel)
        first, *rest = sorted(self.parts, key=lambda f: isinstance(f, Embed))  # embeddings scatter into the others
        total = first.materialise()
        if isinstance(first, Dense):
            total = total.clone(memory_format=torch.contiguous_format)  # not the factor's own; rows viewable
        for f in rest:
            if isinstance(f, Embed):
                f.add_to(total)
            else:
                total += f.materialise()
        return total


def _parts(f) -> list:
    return f.parts if isinstance(f, Summed) else [f]


def blockable(f) -> bool:
    """Whether ``f``'s per-sample gradients can be formed a block of output units at a time: a
    :class:`Linear` or :class:`Embed`, or a sum of them that agree on which weight entry is output
    unit o's input i (Linear uses all in one layout; Embeddings only beside (V, d) Linear uses)."""
    parts = _parts(f)
    if any(isinstance(p, Dense) for p in parts):
        return False
    layouts = {p.io for p in parts if isinstance(p, Linear)}
    return len(layouts) < 2 and not (True in layouts and any(isinstance(p, Embed) for p in parts))


def _units(f) -> tuple[int, int]:
    """(output units, elements per unit) of a blockable factor: (d_out, d_in) or (V, d)."""
    p = _parts(f)[0]
    return (p.delta.shape[-1], p.a.shape[-1]) if isinstance(p, Linear) else (p.vocab, p.delta.shape[-1])


class _Sorted(NamedTuple):
    """An Embedding use's tokens in order, so that the tokens of a block of units are a slice."""

    tokens: torch.Tensor  # (c T,) sorted
    order: torch.Tensor  # (c T,) their positions in the flat (c T) tokens
    delta: torch.Tensor  # (c T, d) the cotangents, in the flat order
    T: int
    edges: list  # the slice of each block: edges[b]:edges[b + 1]


class _Blocks:
    """The per-sample gradients of a blockable factor, output units ``o0:o1`` at a time: (c, (o1 - o0) w).

    The entries come in (unit, input) order whatever the weight's layout, so a block's products
    are those of the same entries of the materialised gradients (a Gram does not see the order)."""

    def __init__(self, f, step: int):
        parts = _parts(f)
        self.c, self.step = _leading(f), step
        self.units, self.width = _units(f)
        self.linear = [p for p in parts if isinstance(p, Linear)]
        self.embeds = []
        for e in (p for p in parts if isinstance(p, Embed)):
            tokens, order = torch.sort(e.tokens.reshape(-1))
            edges = torch.searchsorted(tokens, torch.arange(0, self.units + step, step, device=tokens.device))
            self.embeds.append(_Sorted(tokens, order, e.delta.reshape(-1, self.width), e.tokens.shape[1],
                                       edges.tolist()))
        like = self.linear[0].delta if self.linear else self.embeds[0].delta
        # one block's room, reused: under the kernel's malloc thresholds (core.memory) a fresh one
        # per block is mapped and zeroed anew, 1.6x slower
        self.room = like.new_empty(self.c * step * self.width)

    def block(self, o0: int) -> torch.Tensor:
        o1 = min(self.units, o0 + self.step)
        g = self.room[: self.c * (o1 - o0) * self.width].view(self.c, o1 - o0, self.width)
        if self.linear:
            first, *rest = self.linear
            torch.bmm(first.delta[..., o0:o1].transpose(1, 2), first.a, out=g)
            for f in rest:
                g.baddbmm_(f.delta[..., o0:o1].transpose(1, 2), f.a)
        else:
            g.zero_()
        for e in self.embeds:
            lo, hi = e.edges[o0 // self.step], e.edges[o0 // self.step + 1]
            at = e.order[lo:hi]
            g.view(-1, self.width).index_add_(0, at // e.T * (o1 - o0) + e.tokens[lo:hi] - o0, e.delta[at])
        return g.reshape(self.c, -1)


def blocked_product(fa, fb, same: bool, work: int | None = None) -> torch.Tensor:
    """``G_a G_b^T`` (ca, cb) of two blockable uses of one weight (``same``: ``fa`` is ``fb``, each
    block formed once), their per-sample gradients formed a block of output units at a time. A
    block of all the samples holds :data:`BLOCK_ELEMENTS` on a CPU, at most half of ``work``
    (the two blocks' room; one unit a block at least); on an accelerator, where each block costs
    kernel launches, half of ``work`` (all units when None). The products of half-precision
    blocks are added up in float32 and rounded once, as one matmul of the whole would."""
    units, width = _units(fa)
    room = work // 2 if work is not None else None
    if _parts(fa)[0].delta.device.type == "cpu":
        room = BLOCK_ELEMENTS if room is None else min(BLOCK_ELEMENTS, room)
    step = units if room is None else max(1, min(units, room // (max(_leading(fa), _leading(fb)) * width)))
    A = _Blocks(fa, step)
    B = A if same else _Blocks(fb, step)
    out = None
    for o0 in range(0, units, step):
        ga = A.block(o0)
        gb = ga if same else B.block(o0)
        if out is None:
            out = (ga @ gb.T).to(torch.promote_types(ga.dtype, torch.float32))
        elif out.dtype == ga.dtype:
            out.addmm_(ga, gb.T)
        else:
            out += ga @ gb.T
    return out.to(ga.dtype)


def _tensors(f) -> dict:
    return {k: v for k, v in vars(f).items() if torch.is_tensor(v)}


def empty_rows(f, n: int, length: int | None = None):
    """A factor like ``f`` with room for ``n`` samples (every tensor field has the samples first)
    and, for a factor by position (:class:`Linear`, :class:`Embed`), ``length`` positions (default
    ``f``'s)."""
    def shape(v):
        positions = length if length is not None and isinstance(f, (Linear, Embed)) else v.shape[1]
        return (n, positions, *v.shape[2:]) if v.dim() > 1 else (n,)
    return dataclasses.replace(f, **{k: v.new_empty(shape(v)) for k, v in _tensors(f).items()})


def put_rows(dst, src, start: int) -> None:
    """Copy the samples of factor ``src`` into ``dst`` from row ``start`` on; a factor by position
    shorter than ``dst``'s goes in with zero rows after its own positions."""
    for k, v in _tensors(src).items():
        rows = getattr(dst, k)[start : start + v.shape[0]]
        if isinstance(src, (Linear, Embed)) and v.shape[1] < rows.shape[1]:
            rows[:, : v.shape[1]] = v
            rows[:, v.shape[1]:] = 0
        else:
            rows[...] = v


def rows_of(f, rows: slice):
    if isinstance(f, Summed):
        return Summed([rows_of(part, rows) for part in f.parts])
    if isinstance(f, Linear):
        return Linear(f.a[rows], f.delta[rows], f.io)
    if isinstance(f, Embed):
        return Embed(f.tokens[rows], f.delta[rows], f.vocab)
    return Dense(f.grads[rows])


def _numel(f) -> int:
    if isinstance(f, Summed):
        return _numel(f.parts[0])
    if isinstance(f, Linear):
        return f.a.shape[-1] * f.delta.shape[-1]
    if isinstance(f, Embed):
        return f.vocab * f.delta.shape[-1]
    return f.grads.shape[-1]


def _tokens(f) -> int:
    return f.a.shape[1] if isinstance(f, Linear) else f.tokens.shape[1] if isinstance(f, Embed) else 0


# ---- the pair products --------------------------------------------------------------------------


def _tied_head(fa, fb) -> bool:
    """An Embedding use against a Linear use of the same (V, d) weight (a tied output head)."""
    return isinstance(fa, Embed) and isinstance(fb, Linear) and not fb.io


def ghost_cost(fa, fb) -> float | None:
    """Multiply-adds of the ghost form for one sample pair, or None when the pair has no ghost form."""
    Ta, Tb = _tokens(fa), _tokens(fb)
    if isinstance(fa, Linear) and isinstance(fb, Linear):
        return Ta * Tb * (fa.a.shape[-1] + fa.delta.shape[-1])
    if isinstance(fa, Embed) and isinstance(fb, Embed):
        return Ta * Tb * (fa.delta.shape[-1] + 1)
    if _tied_head(fa, fb):
        return Ta * Tb * (fa.delta.shape[-1] + 1)
    if _tied_head(fb, fa):
        return Ta * Tb * (fb.delta.shape[-1] + 1)
    return None


def _row_elements(f) -> int:
    """Elements a materialised sample's gradient holds while its tile is formed (a sum holds one
    use's beside the total); a blockable factor's sample holds one output unit's at least
    (:func:`blocked_product` keeps its blocks within the tiles' work share)."""
    if blockable(f):
        return _units(f)[1]
    return _numel(f) * (2 if isinstance(f, Summed) else 1)


def _form_cost(f) -> float:
    """Multiply-adds to materialise one sample's gradient from ``f`` (an Embedding's rows are scattered)."""
    if isinstance(f, Summed):
        return sum(_form_cost(part) for part in f.parts)
    if isinstance(f, Linear):
        return f.a.shape[1] * f.a.shape[-1] * f.delta.shape[-1]
    if isinstance(f, Embed):
        return f.tokens.shape[1] * f.delta.shape[-1]
    return 0.0


def _compact(fa, fb) -> tuple:
    """A pair with an Embedding use, over the vocabulary rows the Embedding touches (its gradient is zero
    elsewhere, so the products are the same): both Embeddings' tokens renumbered, or a tied head's
    cotangent restricted to those rows. Other pairs unchanged."""
    if isinstance(fa, Embed) and isinstance(fb, Embed):
        tokens = torch.cat([fa.tokens.reshape(-1), fb.tokens.reshape(-1)])
        used, inverse = torch.unique(tokens, return_inverse=True)
        ta, tb = inverse[: fa.tokens.numel()].view_as(fa.tokens), inverse[fa.tokens.numel():].view_as(fb.tokens)
        return Embed(ta, fa.delta, len(used)), Embed(tb, fb.delta, len(used))
    if _tied_head(fb, fa):
        b, a = _compact(fb, fa)
        return a, b
    if _tied_head(fa, fb):
        used, inverse = torch.unique(fa.tokens, return_inverse=True)
        return Embed(inverse, fa.delta, len(used)), Linear(fb.a, fb.delta[..., used], fb.io)
    return fa, fb


def _merge_plan(deltas: list, touched: torch.Tensor | None) -> tuple | None:
    """(kept columns, reference column, scale) for output cotangents ``deltas`` (each (..., width))
    that are, in every row, one value outside a few columns; ``touched``: columns that must be
    kept (an embedding's rows). None where that would keep more than half of them.

    The reference is a background column: of a few candidates (the column the sampled rows touch
    least, and columns spread over the others), the one the fewest columns of the sampled rows
    differ from; a dense cotangent (a softmax's) is turned down on the sample. Where every row
    makes a candidate keep more than half the columns (it differs in a row the sample skipped),
    the next is tried, three at most."""
    width = deltas[0].shape[-1]
    rows = [d.reshape(-1, width) for d in deltas]
    some = rows[0][:: max(1, rows[0].shape[0] // MERGE_SAMPLE)]
    forced = torch.zeros(width, dtype=torch.bool, device=some.device)
    if touched is not None:
        forced[touched] = True
    free = torch.nonzero(~forced).squeeze(1)
    if free.numel() == 0:
        return None
    least = int(torch.linalg.vector_norm(some, 1, dim=0).masked_fill(forced, math.inf).argmin())
    candidates = dict.fromkeys([least, *free[:: max(1, free.numel() // 4)][:4].tolist()])
    differ = {ref: int((forced | (some != some[:, ref : ref + 1]).any(0)).sum()) for ref in candidates}
    for ref in sorted(differ, key=differ.get)[:3]:
        if 2 * (differ[ref] + 1) > width:
            return None  # dense: turned down on the sample
        keep = _differing(rows, ref, forced)
        if keep is not None:
            return keep, ref, math.sqrt(width - keep.numel())  # the columns equal to the reference, itself included
    return None


def _differing(rows: list, ref: int, forced: torch.Tensor) -> torch.Tensor | None:
    """Columns of ``rows`` (each (r, width)) that differ from column ``ref`` in some row, with the
    ``forced`` ones: (k,) indices, or None once they are more than half (checked every
    :data:`MERGE_CHECK_ROWS` rows: on an accelerator each check waits for the device). Rows are
    compared :data:`MERGE_BYTES` of flags at a time, into one reused buffer (a fresh one per
    block is mapped anew under the kernel's malloc thresholds)."""
    width = forced.numel()
    differs = forced.clone()
    step = max(1, min(max(r.shape[0] for r in rows), MERGE_BYTES // width))
    buf = torch.empty(step, width, dtype=torch.bool, device=forced.device)
    unchecked = 0
    for r in rows:
        for blk in r.split(step):
            out = buf[: blk.shape[0]]
            torch.ne(blk, blk[:, ref : ref + 1], out=out)
            differs |= out.any(0)
            unchecked += blk.shape[0]
            if unchecked >= MERGE_CHECK_ROWS:
                unchecked = 0
                if 2 * (int(differs.sum()) + 1) > width:  # dense, or not worth a copy
                    return None
    return None if 2 * (int(differs.sum()) + 1) > width else torch.nonzero(differs).squeeze(1)


def merge_constant_columns(fa, fb, work: int | None = None) -> tuple:
    """Two uses of a wide linear layer (an output head; or the sums of a tied head's and its
    embedding's uses, :class:`Summed`) whose output cotangents are, in every row, one value
    outside a few columns: those columns kept, the others merged into one, scaled by the square
    root of their number; the pair's products are the same. Else ``(fa, fb)`` unchanged.

    A column ``v`` of ``delta`` is row ``v`` of every per-sample gradient (column with ``io``), so
    columns equal to one reference column in every row give equal gradient rows, and their
    inner products sum to (their number) x (the reference's). The centred true-token logit has
    ``delta = e_y - 1/V`` per token: only the targets' columns differ from -1/V (the loss's
    softmax differs everywhere, and is left as it is). An embedding's tokens are rows of the same
    weight: they are kept, and renumbered. The merged cotangents are copies: they are made only
    where they fit ``work`` elements (None: no limit). ``fa is fb`` stays one object."""
    parts = [*_parts(fa), *([] if fb is fa else _parts(fb))]
    if any(isinstance(f, Summed) and not blockable(f) for f in (fa, fb)):
        return fa, fb  # an embedding's rows would not be the head's columns
    embeds = [p.tokens.reshape(-1) for p in parts if isinstance(p, Embed)]
    plan = _merge_plan([p.delta for p in parts if isinstance(p, Linear)],
                       torch.unique(torch.cat(embeds)) if embeds else None)
    if plan is None:
        return fa, fb
    keep, ref, scale = plan
    columns = torch.cat([keep, keep.new_tensor([ref])])
    copies = sum(p.delta[..., 0].numel() for p in parts if isinstance(p, Linear)) * columns.numel()
    if work is not None and copies > work:
        return fa, fb
    if embeds:
        position = torch.full((_units(parts[0])[0],), -1, dtype=torch.long, device=keep.device)
        position[keep] = torch.arange(keep.numel(), device=keep.device)

    def merged_part(f):
        if isinstance(f, Embed):
            return Embed(position[f.tokens], f.delta, keep.numel() + 1)
        # one gather of rows' columns (index_select on the last dimension was 4x slower)
        delta = f.delta.reshape(-1, f.delta.shape[-1])[:, columns]
        delta[:, -1] *= scale
        return Linear(f.a, delta.view(*f.delta.shape[:-1], columns.numel()), f.io)

    def merged(f):
        return Summed([merged_part(p) for p in f.parts]) if isinstance(f, Summed) else merged_part(f)

    out = merged(fa)
    return out, (out if fb is fa else merged(fb))


def _wide(f) -> bool:
    """A use (or sum of uses) with a linear output of :data:`WIDE` or more: its columns may merge."""
    return any(isinstance(p, Linear) and p.delta.shape[-1] >= WIDE for p in _parts(f))


def pair_choice(fa, fb, ca: int, cb: int, work: int) -> tuple[str, float]:
    """("ghost" or "materialised", multiply-adds) for the ``ca x cb`` product of two uses: the cost model.

    Materialised counts the tiles that ``work`` elements allow (B's gradients are formed again for
    every tile of A's rows); a pair with an Embedding is formed over the vocabulary rows it touches."""
    fa_m, fb_m = _compact(fa, fb)
    numel = _numel(fa_m)
    ta, _ = _tile(0, _row_elements(fa_m), ca, cb, work)
    materialised = ca * _form_cost(fa_m) + math.ceil(ca / ta) * cb * _form_cost(fb_m) + ca * cb * numel
    ghost = ghost_cost(fa, fb)
    if ghost is not None and ca * cb * ghost < materialised:
        return "ghost", ca * cb * ghost
    return "materialised", materialised


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() > 2 else t.reshape(-1)


def _ghost(fa, fb) -> torch.Tensor:
    """The (ca, cb) ghost product of two uses, as (ca Ta, cb Tb) token-pair products summed per sample pair."""
    if _tied_head(fb, fa):
        return _ghost(fb, fa).T
    ca, Ta = fa.delta.shape[:2]
    cb, Tb = fb.delta.shape[:2]
    if isinstance(fa, Linear) and isinstance(fb, Linear):
        left = _flat(fa.a) @ _flat(fb.a).T  # (ca Ta, cb Tb): a_at . a_bs
        right = _flat(fa.delta) @ _flat(fb.delta).T  # delta_at . delta_bs
    elif isinstance(fa, Embed) and isinstance(fb, Embed):
        left = (_flat(fa.tokens)[:, None] == _flat(fb.tokens)[None, :]).to(fa.delta.dtype)
        right = _flat(fa.delta) @ _flat(fb.delta).T
    else:  # fa: Embed, fb: the tied head (V, d): sum_{t,s} delta^head_bs[token_at] (delta^emb_at . x^head_bs)
        left = _flat(fb.delta)[:, _flat(fa.tokens)].T  # (ca Ta, cb Tb)
        right = _flat(fa.delta) @ _flat(fb.a).T
    return (left * right).view(ca, Ta, cb, Tb).sum((1, 3))


def _tile(per_pair: float, per_row: float, ca: int, cb: int, work: int) -> tuple[int, int]:
    """Row tiles (ta, tb) whose work tensors (``ta tb per_pair + (ta + tb) per_row`` elements) fit ``work``."""
    ta, tb = ca, cb
    while ta * tb * per_pair + (ta + tb) * per_row > work and (ta > 1 or tb > 1):
        if ta >= tb:
            ta = (ta + 1) // 2
        else:
            tb = (tb + 1) // 2
    return ta, tb


def pair_kernel(fa, fb, work_elements: int, *, symmetric: bool = False) -> tuple[torch.Tensor, str]:
    """``<grad^a_i, grad^b_j>`` for every pair of rows of two uses of one parameter: (ca, cb) and the form used.

    ``symmetric``: ``fa`` is ``fb`` (a use against itself on the same samples): only the tiles on and
    above the diagonal are computed, the others mirrored."""
    ca, cb = _leading(fa), _leading(fb)
    form, _ = pair_choice(fa, fb, ca, cb, work_elements)
    if form == "materialised":
        fa, fb = (_compact(fa, fb) if fa is not fb else (_compact(fa, fa)[0],) * 2)
        if isinstance(fa, (Linear, Summed)) and type(fb) is type(fa) and _wide(fa):
            fa, fb = merge_constant_columns(fa, fb, work_elements)
    if form == "ghost":
        per_pair, per_row = 3 * _tokens(fa) * _tokens(fb), 0
    else:
        per_pair, per_row = 0, _row_elements(fa)
    ta, tb = _tile(per_pair, per_row, ca, cb, work_elements)
    if symmetric:  # ghost: at least 4 tiles a side, so that the mirrored lower tiles save ~40 %
        ta = tb = min(ta, tb) if form == "materialised" else max(1, min(ta, tb, math.ceil(ca / SYMMETRIC_TILES)))
    blocks = form == "materialised" and blockable(fa) and blockable(fb)
    out = None
    for a0 in range(0, ca, ta):
        A = rows_of(fa, slice(a0, a0 + ta))
        GA = A.materialise() if form == "materialised" and not blocks else None
        for b0 in range(a0 if symmetric else 0, cb, tb):
            if symmetric and b0 == a0:
                B, GB = A, GA
            else:
                GB = None  # the last tile's gradients go before the next are formed
                B = rows_of(fb, slice(b0, b0 + tb))
                GB = B.materialise() if form == "materialised" and not blocks else None
            if form == "ghost":
                block = _ghost(A, B)
            else:
                block = blocked_product(A, B, same=B is A, work=work_elements) if blocks else GA @ GB.T
            if out is None:
                out = block.new_zeros(ca, cb)
            out[a0 : a0 + ta, b0 : b0 + tb] = block
            if symmetric and b0 != a0:
                out[b0 : b0 + tb, a0 : a0 + ta] = block.T
    return out, form


def use_products(parts_a: list, parts_b: list, ca: int, cb: int, work: int, same: bool) -> tuple[str, float]:
    """("pairs" or "summed", multiply-adds) for one parameter's kernel block between the uses
    ``parts_a`` of ``ca`` samples and ``parts_b`` of ``cb`` (``same``: one run of samples against
    itself, each pair of uses once): a product per pair of uses (each in its own form), or, for a
    parameter used more than once, one materialised product of the summed uses (:class:`Summed`).
    For the 8192-token head tied to its embedding at n = 256 and the loss, the pairs took 1.7 s
    (the head's 1.1 s, the embedding's against the head 0.4 s), their sum about 1.0 s."""
    pairs = sum(pair_choice(fa, fb, ca, cb, work)[1] for u, fa in enumerate(parts_a)
                for v, fb in enumerate(parts_b) if not (same and v < u))
    if len(parts_a) < 2:
        return "pairs", pairs
    summed = pair_choice(Summed(parts_a), Summed(parts_b), ca, cb, work)[1]
    return ("summed", summed) if summed < pairs else ("pairs", pairs)


def _leading(f) -> int:
    if isinstance(f, Summed):
        return _leading(f.parts[0])
    return (f.a if isinstance(f, Linear) else f.tokens if isinstance(f, Embed) else f.grads).shape[0]


def summed(f) -> torch.Tensor:
    """Sum over samples of a factor's per-sample gradients, flat (numel,), without forming them one by one."""
    if isinstance(f, Linear):
        a, d = f.a.reshape(-1, f.a.shape[-1]), f.delta.reshape(-1, f.delta.shape[-1])
        return (a.T @ d if f.io else d.T @ a).reshape(-1)
    if isinstance(f, Embed):
        return Embed(f.tokens.reshape(1, -1), f.delta.reshape(1, -1, f.delta.shape[-1]), f.vocab).materialise()[0]
    return f.grads.sum(0)
