"""The kinds of arm a sweep trains: one registered :class:`ArmKind` each, in :data:`ARM_KINDS`.

An arm kind holds everything the experiment machinery asks of it: how one of its arms trains from
its trunk's checkpoint at the conversion step (``train``), which of the arm's optional fields
apply to it (``fields``: a spec that sets another is refused in one line), what its units'
keys hold beyond the arm itself (``key``: e.g. the null arm's data-order offset), and its rows of
the sweep's load table (``load_rows``: the sequences each expert received). The spec checks
kinds against this table, the sweep trains through it, the units are keyed by it and the load
table is read through it, so a new kind is one :func:`register_arm_kind` call and its test
(recipe: docs/architecture.md).

The trunk (kind "dense") is the one kind without a training function of its own here: every
other arm branches from it, and the sweep trains it first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cse_models.routes import Routes, window_loads
from ntkscope.core.checks import fail
from ntkscope.core.registry import Registry
from ntkscope.reproduction import training

log = logging.getLogger(__name__)

#: the kind of the trunk every other arm branches from
TRUNK = "dense"
#: the arm fields that apply to some kinds only (an :class:`ArmKind` lists the ones it reads)
OPTIONAL_FIELDS = ("shuffled", "fair", "counts_from")


@dataclass(frozen=True)
class ArmKind:
    """One kind of arm. ``name`` (what a spec's ``kind`` says); ``train(sweep, arm, seed, at,
    every)`` trains the arm of ``seed`` from its trunk's checkpoint at step ``at``, keeping a
    checkpoint every ``every`` steps to resume from, and returns its last checkpoint (None for
    the trunk); ``what``: one line saying what the kind is; ``fields``: the
    :data:`OPTIONAL_FIELDS` it reads; ``key(trunk)``: what its units' keys hold beyond the arm
    (``trunk``: the spec's :class:`~ntkscope.experiments.spec.TrunkSpec`); ``load_rows(sweep, arm,
    seed)``: its rows of the sweep's load table (load.csv: per logged window, layer and expert, the
    sequences received, in all and per domain ``n DOMAIN``) for a finished unit, or None for a kind
    that routes nothing to count."""

    name: str
    train: Callable | None
    what: str
    fields: tuple = ()
    key: Callable = field(default=lambda trunk: {})
    load_rows: Callable | None = None


#: every registered kind, by name, in the order they were registered
ARM_KINDS = Registry("arm kind")


def register_arm_kind(kind: ArmKind, *, replace: bool = False) -> ArmKind:
    """Add ``kind`` to :data:`ARM_KINDS` (``replace``: over a kind of the same name); returns it."""
    if not isinstance(kind, ArmKind):
        raise fail("register_arm_kind", "kind", "must be an ArmKind", type(kind).__name__)
    if set(kind.fields) - set(OPTIONAL_FIELDS):
        raise fail("register_arm_kind", "kind.fields", f"must be among {list(OPTIONAL_FIELDS)}", list(kind.fields))
    if (kind.train is None) != (kind.name == TRUNK):
        raise fail("register_arm_kind", "kind.train", f"must be a function for every kind but the trunk ({TRUNK!r})",
                   kind.train)
    return ARM_KINDS.add(kind.name, kind, replace=replace, func="register_arm_kind")


def arm_kind(name: str) -> ArmKind:
    """The registered kind ``name``."""
    return ARM_KINDS.get_one(name, func="arm_kind")


# ---- the shipped kinds ----------------------------------------------------------------------

def _where(sweep, arm, seed) -> tuple:
    """What every branch passes: the settings, the arm's folder, the pack, the trunk's folder, the layers."""
    return (sweep.settings, sweep.model_dir(arm.name, seed), sweep.pack_arg, sweep.model_dir(sweep.trunk.name, seed),
            sweep.arm_layers(arm))


def train_cse(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, trunk, layers = _where(sweep, arm, seed)
    counts = None if arm.counts_from is None else sweep.cse_counts(seed, arm, arm.counts_from)
    if counts is not None:
        log.info("sweep: %s seed %d converts at %d with the experts of step %d: %s", arm.name, seed, at,
                 arm.counts_from, counts)
    return training.train_cse(s, out, pack, trunk, layers, at, seed, mean_rate=arm.mean_rate, checkpoint_every=every,
                              shuffled=arm.shuffled, n_clusters=counts)


def train_switch(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, trunk, layers = _where(sweep, arm, seed)
    if arm.fair:  # the same step's CSE count at each layer, the function unchanged
        return training.train_switch(s, out, pack, trunk, layers, at, seed, checkpoint_every=every,
                                     experts=sweep.cse_counts(seed, arm, at), preserving=True)
    experts = max(*sweep.cse_counts(seed, arm, at), 2)  # the classic control: the largest count, softmax gate
    return training.train_switch(s.replace(switch_experts=experts), out, pack, trunk, layers, at, seed,
                                 checkpoint_every=every, preserving=False)


def train_demix(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, trunk, layers = _where(sweep, arm, seed)
    return training.train_demix(s, out, pack, trunk, layers, at, sweep.domain_names(), seed, checkpoint_every=every)


def train_encoder(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, trunk, layers = _where(sweep, arm, seed)
    routes = sweep.encoder_routes(seed)
    return training.train_routed(s, out, pack, trunk, layers, at, routes, Routes.load(routes).names, seed,
                                 checkpoint_every=every)


def train_null(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, trunk, _ = _where(sweep, arm, seed)
    return training.train_continued(s, out, pack, trunk, at, seed + sweep.null_order, checkpoint_every=every)


def train_scratch(sweep, arm, seed: int, at: int, every: int) -> Path:
    s, out, pack, _, layers = _where(sweep, arm, seed)
    experts = sweep.cse_counts(seed, arm, at)  # the count CSE converted at this step made at each layer
    log.info("sweep: %s seed %d trains from scratch with the experts of CSE at step %d: %s", arm.name, seed, at,
             experts)
    return training.train_scratch(s, out, pack, layers, experts, seed, checkpoint_every=every)


def logged_load_rows(sweep, arm, seed: int) -> list:
    """The load rows an arm's training logged (``load_domains`` in its metrics.jsonl: CSE's routing)."""
    path = sweep.model_dir(arm.name, seed) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = json.loads(line)
        for layer, counts in (m.get("load_domains") or {}).items():
            for expert, per_domain in enumerate(counts):
                row = {"arm": arm.name, "seed": seed, "step": m["step"], "layer": layer, "expert": expert,
                       "n": int(sum(per_domain))}
                row.update({f"n {d}": int(c) for d, c in zip(sweep.domain_names(), per_domain)})
                rows.append(row)
    return rows


def routed_load_rows(sweep, arm, seed: int) -> list:
    """The frozen-encoder arm's load rows, replayed exactly from its routes and the batches
    (:func:`cse_models.routes.window_loads`): the same routes at every sparse layer. No rows when
    the seed's routes are not in the run (an adopted unit: its rows come from the adopted load.csv)."""
    if not (sweep.run_dir / "routes" / f"seed{seed}.json").is_file():
        return []
    result = json.loads(sweep.result_path(arm.name, seed).read_text())
    frame = window_loads(Routes.load(sweep.encoder_routes(seed)), sweep.blocks(), seed=seed,
                         batch_size=sweep.settings.batch_size, start=int(result["warmup"]), end=sweep.settings.steps)
    return [{"arm": arm.name, "seed": seed, "layer": int(layer), **row}
            for layer in sweep.layers for row in frame.to_dict("records")]


register_arm_kind(ArmKind(TRUNK, None, "the trunk: the dense model over the whole schedule, every checkpoint kept"))
register_arm_kind(ArmKind("cse", train_cse, "CSE: experts from the clusters of the trunk's representations at the "
                          "conversion step", fields=("shuffled", "counts_from"), load_rows=logged_load_rows))
register_arm_kind(ArmKind("switch", train_switch, "Switch upcycled at the conversion step (fair: with CSE's count at "
                          "each layer, the function unchanged)", fields=("fair",)))
register_arm_kind(ArmKind("demix", train_demix, "DEMix: one expert per domain, routed by the label in training"))
register_arm_kind(ArmKind("encoder", train_encoder, "experts routed by a frozen sentence encoder's clusters",
                          key=lambda trunk: {"encoder": trunk.encoder} if trunk.encoder else {},  # shipped: no key
                          load_rows=routed_load_rows))
register_arm_kind(ArmKind("scratch", train_scratch, "a mixture of experts trained from scratch (Switch layers, "
                          "every expert its own init) with the expert counts of CSE at the conversion step, on the "
                          "trunk's tokens from step 0; its conversion step only names whose counts it takes"))
register_arm_kind(ArmKind("null", train_null, "the trunk continued from the conversion step with another data order",
                          key=lambda trunk: {"null_order": trunk.null_order}))
