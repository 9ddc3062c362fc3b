"""How a structured kernel is laid out in memory: which samples' factors are held (a panel), how
many are streamed past it at once, how many go through one forward and backward (a chunk), and
what that costs.

Everything is sized from a :class:`Probe` (one sample's factor bytes,
a chunk's measured transient, the multiply-adds of loading a sample) and the budget. A panel and
the stream are held; beside them, the larger of a chunk in flight (its forward and backward, plus
the stream being filled when the stream is longer than a chunk) and the pair products' tiles (a
fixed share of the budget): a chunk's forward and backward end before its pair products start.
Among the layouts that fit, :func:`layout` takes the one of least :func:`layout_cost`
(docs/design.md §1.2.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ntkscope.kernel.factors import use_products
from ntkscope.kernel.grads import Transient
from ntkscope.kernel.kernels import sample_passes

@dataclass(frozen=True)
class Probe:
    """The plan (a :class:`~ntkscope.kernel.structured.FactorPlan`; the layout does not read it),
    one sample's factor bytes, the factors of the probe samples (for the cost model),
    what a chunk's forward and backward hold (:class:`~ntkscope.kernel.grads.Transient`,
    measured, the chunk's own factors included), the multiply-adds of loading one sample
    (its forward and backward, and its per-sample gradients of any fallback parameters), and
    whether the device is an accelerator (:func:`layout` then keeps to one large chunk)."""

    plan: object
    sample_bytes: int
    uses: dict
    fallback_params: int
    transient: Transient
    sample_cost: float
    accelerator: bool = False



WORK_SHARE = 0.25  #: of the budget, for the tiles of pair products
MAX_CHUNK = 64  #: samples per forward/backward on an accelerator, and at most anywhere
#: samples per forward/backward on a CPU: a chunk cut at its own longest sample trims more padding,
#: and its activations stay nearer the cache (a probe of 128 GPT sentences: 1.2x its floor at 16,
#: 1.5x at 64; benchmarks/README.md)
CPU_CHUNK = 16


def max_chunk(accelerator: bool) -> int:
    """Samples per forward/backward at most: :data:`MAX_CHUNK` on an accelerator, :data:`CPU_CHUNK` on a CPU."""
    return MAX_CHUNK if accelerator else CPU_CHUNK


def work_elements(budget: int, itemsize: int) -> int:
    """Elements the tiles of pair products may hold: a fixed share of the budget."""
    return max(1, int(WORK_SHARE * budget) // itemsize)


def _needed(fixed: int, transient: int) -> int:
    """The smallest budget holding ``fixed`` bytes beside the larger of a chunk's ``transient`` and
    the tiles' share of the budget (a chunk's forward and backward end before its pair products
    start, so the two never coexist)."""
    return max(fixed + transient, math.ceil(fixed / (1 - WORK_SHARE)))


def held_bytes(pr: Probe, n1: int, n2: int, symmetric: bool, kernels: int = 0, chunk: int = MAX_CHUNK) -> int:
    """Bytes with no panels: every sample's factors, a chunk of ``chunk`` in flight, the kernels,
    and the tiles' share of the budget that this would make."""
    chunk = min(chunk, n1 + (0 if symmetric else n2))
    fixed = (n1 + 1 + (0 if symmetric else n2)) * pr.sample_bytes + kernels
    return _needed(fixed, pr.transient.bytes(chunk))


def minimum_budget(pr: Probe, n1: int, n2: int, symmetric: bool, kernels: int = 0) -> int:
    """The smallest budget the structured method runs in: one sample held, one streamed, a chunk of
    one in flight, the kernels, and the tiles' share."""
    held = (1 + min(2, n1 + (0 if symmetric else n2))) * pr.sample_bytes  # the probe's sample too
    return _needed(held + kernels, pr.transient.bytes(1)) + 1


def pair_cost(pr: Probe, n1: int, n2: int, work: int) -> float:
    """Multiply-adds of all the pair products of an (n1, n2) kernel, by the cost model
    (``work``: :func:`work_elements`)."""
    total = sum(use_products(parts, parts, n1, n2, work, same=False)[1] for parts in pr.uses.values())
    return total + n1 * n2 * pr.fallback_params


def layout_cost(pr: Probe, n1: int, n2: int, panel: int, stream: int, symmetric: bool, work: int) -> float:
    """Multiply-adds of a layout: every sample's forward and backward, each time it is loaded
    (:func:`~ntkscope.kernel.kernels.sample_passes`), and the pair products of its blocks (a
    panel against itself, and against each stream: the materialised form forms a panel's
    gradients again for every stream; ``work``: :func:`work_elements`)."""
    loads = sample_passes(n1, n2, panel, symmetric) * pr.sample_cost
    panels = math.ceil(n1 / panel)
    if symmetric:
        own = panels * pair_cost(pr, panel, panel, work) / 2
        rest = max(0, n1 * n1 - panels * panel * panel) / 2  # sample pairs across panels
        stream = min(stream, max(1, n1 - panel))
        return loads + own + rest / (panel * stream) * pair_cost(pr, panel, stream, work)
    return loads + panels * math.ceil(n2 / stream) * pair_cost(pr, panel, stream, work)


def layout(pr: Probe, n1: int, n2: int, budget: int, chunk: int | None = None,
           symmetric: bool = True, kernels: int = 0) -> tuple[int, int, int]:
    """(panel, stream, chunk): samples whose factors are held, samples streamed past each panel at
    once, and samples per forward/backward. Everything at once when it fits; else the layout
    of least :func:`layout_cost` among chunks of ``chunk`` (or :func:`max_chunk`, half that, ... 1
    samples) and streams of 1, 2, 4 ... chunks, each with the largest panel that then fits. What
    they hold, with the ``kernels`` bytes and the tiles' share, stays within ``budget`` whenever
    it is at least :func:`minimum_budget`.

    On an accelerator (``pr.accelerator``) only one chunk is considered, the largest that keeps a
    panel at least half as large as the smallest chunk would: there a forward and backward of a
    few samples, and the pair products of a short stream, are bound by kernel launches rather than
    multiply-adds, which the cost model does not count (docs/design.md §1.2.1; benchmarks/README.md,
    GC on a GPU)."""
    work = int(WORK_SHARE * budget)
    fixed, s = kernels + pr.sample_bytes, pr.sample_bytes  # the probe's sample, kept for the cost model
    first = int(chunk or max(1, min(max_chunk(pr.accelerator), work // max(1, pr.transient.per_sample))))
    chunks = [first] if chunk else sorted({max(1, first >> k) for k in range(7)}, reverse=True)

    def panel_room(c: int, stream: int) -> int:  # a stream of one chunk is that chunk's factors: no copy
        loading = pr.transient.bytes(c) + (stream * s if stream > c else 0)
        return max(0, budget - fixed - max(loading, work + stream * s)) // s

    for c in chunks:
        if symmetric and panel_room(c, 0) >= n1:
            return n1, n1, min(c, n1)
        if not symmetric and panel_room(c, n2) >= n1:
            return n1, n2, c
    if pr.accelerator and not chunk:  # the largest chunk that keeps at least half the panel the smallest would
        room = max(1, panel_room(chunks[-1], chunks[-1]) // 2)
        chunks = [next((c for c in chunks if panel_room(c, c) >= room), chunks[-1])]
    best = None
    other = (n1 - 1) if symmetric else n2
    for c in chunks:
        stream = c
        while True:
            panel = min(n1, panel_room(c, stream))
            if panel >= 1:
                cost = layout_cost(pr, n1, n2, panel, stream, symmetric, work)
                if best is None or cost < best[0]:
                    best = (cost, panel, stream, c)
            if stream >= other or panel < 1:
                break
            stream = min(2 * stream, other)
    if best is None:  # below the minimum budget: the least that runs
        return 1, 1, 1
    return best[1], best[2], best[3]  # a stream is at least one chunk
