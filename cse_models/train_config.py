"""A training run's configuration (:class:`TrainConfig`, from JSON or YAML, every number checked),
and the plan it may follow: ``auto`` layers and warm-up resolved from an ``ntkscope plan`` file
(:func:`apply_plan`), the plan's warm-up as a step of this run (:func:`warmup_after`), and the
plan checked against the model it is applied to (:func:`check_plan`)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cse_models.config import from_fields
from cse_models.data import LAYOUTS
from cse_models.hf import architecture
from ntkscope.core.checks import MissingInput, UserError, fail, renamed_keys
from ntkscope.gc.options import GCOptions
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.representation.plan import Plan

log = logging.getLogger("cse_models.train")


@dataclass
class DataConfig:
    """Where the training blocks come from, ``seq_len`` tokens each: a corpus pack (``pack``, None:
    the shipped one; its ``split``; only ``domains``), text files (``text_files``, tokenized by
    ``tokenizer``), or the user's table (``table`` with ``text_column`` and ``label_column``, the one
    ``ntkscope --data`` reads, tokenized by ``tokenizer`` or the one beside ``init_from``). ``routes``:
    a :class:`~cse_models.routes.Routes` file whose experts label the blocks instead of their domains.
    ``layout``: "packed" (each domain's texts as one stream cut into full blocks) or "rows" (one
    text per row, cut at ``seq_len`` and padded; the padding neither attended to nor predicted),
    :data:`cse_models.data.LAYOUTS`; the validation curve (``eval_every``) is scored on packed
    blocks either way.

    ``text_files`` is a list of paths, all one domain, ``"text"`` (as a table without
    ``label_column``), or a mapping ``{domain: [paths]}`` that labels them; paragraphs are
    blank-line separated. Anything else is refused when the config is checked."""

    pack: str | None = None
    split: str = "train"
    domains: list | None = None
    seq_len: int = 64
    tokenizer: str | None = None
    text_files: list | dict | None = None
    table: str | None = None
    text_column: str = "text"
    label_column: str | None = None
    routes: str | None = None
    layout: str = "packed"

    def __post_init__(self):
        _positive("data.seq_len", self.seq_len)
        if self.layout not in LAYOUTS:
            raise fail("TrainConfig", "data.layout", f"must be one of {', '.join(LAYOUTS)}", self.layout)
        self.text_files = _text_files(self.text_files)
        if self.text_files and not self.tokenizer:
            raise UserError("TrainConfig: data.text_files needs data.tokenizer (a tokenizer.json or HF directory)")


@dataclass
class CSEConfig:
    """When and how a CSE model's router is fitted: at step ``convert_at`` (an int, "auto": the
    plan's, or None: never), on ``n_samples`` training blocks, by
    :func:`~cse_models.cse.convert_to_cse` with the rest of the fields."""

    convert_at: int | str | None = None
    n_samples: int = 3000
    rule: str = "hdbscan"
    representation: str = "centred-cosine"
    min_cluster_size: int = 15
    min_samples: int = 5
    max_experts: int | None = 8
    eps: float | dict | None = None
    percentile: float = 10.0
    selection: str = "eom"
    on_no_cluster: str = "single"
    shuffled: bool = False  # the cse-shuffled control: CSE's fit and counts, routed by a hash of the tokens
    n_clusters: list | None = None  # each sparse layer's experts fixed (fit_router's n_clusters); None: the rule's

    def __post_init__(self):
        if not (self.convert_at is None or self.convert_at == "auto" or (
                isinstance(self.convert_at, int) and not isinstance(self.convert_at, bool)
                and self.convert_at >= 0)):
            raise fail("TrainConfig", "cse.convert_at", "must be a step >= 0, 'auto' (the plan's) or null",
                       self.convert_at)
        _positive("cse.n_samples", self.n_samples)
        if not isinstance(self.shuffled, bool):
            raise UserError(f"TrainConfig: cse.shuffled must be true or false (got {self.shuffled!r})")
        counts = self.n_clusters
        if counts is not None and (not isinstance(counts, (list, tuple)) or not counts or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in counts)):
            raise UserError(f"TrainConfig: cse.n_clusters must be null or one positive count per sparse layer (got "
                            f"{self.n_clusters!r})")

    def router_options(self) -> dict:
        """The fields :func:`~cse_models.cse.convert_to_cse` takes."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("convert_at", "n_samples")}


@dataclass
class UpcycleConfig:
    """Switch or DEMix from a dense run (sparse upcycling): at step ``convert_at``, each dense module copied
    into ``n_experts`` experts (Switch: one count, or one per sparse layer, e.g. CSE's; DEMix: one
    per domain). ``preserving`` (Switch, default true): the gate renormalised to 1 and no token
    dropped in evaluation, so the model's function is unchanged at conversion (false: the classic
    softmax-scaled gate). Empty (``convert_at`` None): no upcycling."""

    convert_at: int | None = None
    n_experts: int | list | None = None
    preserving: bool = True

    def __post_init__(self):
        at = self.convert_at
        if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
            raise fail("TrainConfig", "upcycle.convert_at", "must be a step >= 0", at)
        if isinstance(self.n_experts, (list, tuple)):
            if not self.n_experts:
                raise UserError("TrainConfig: upcycle.n_experts must be a count, or one count per sparse layer "
                                "(got [])")
            for k in self.n_experts:
                _positive("upcycle.n_experts", k)
            self.n_experts = list(self.n_experts)
        elif self.n_experts is not None:
            _positive("upcycle.n_experts", self.n_experts)
        if not isinstance(self.preserving, bool):
            raise UserError(f"TrainConfig: upcycle.preserving must be true or false (got {self.preserving!r})")
        if self.convert_at is None and self.n_experts is not None:
            raise UserError(f"TrainConfig: upcycle needs convert_at: STEP (got n_experts {self.n_experts} alone)")

    def __bool__(self) -> bool:
        return self.convert_at is not None


@dataclass
class TrackConfig:
    """Gradient consistency of fixed probe sentences during training (:class:`ntkscope.GCTracker`),
    written to ``OUT/track/gc.csv``: every ``every`` steps (0: off), ``n`` sentences of ``data`` (a
    ``--data`` input; None: the training pack's validation split, or the training table) of at most
    ``seq_len`` tokens (None: ``data.seq_len``), drawn with ``seed``. The subsets: ``by`` "tail" (the
    lowest ``tail_fraction`` of frequency scores), "frequency-bins" (``bins``) or "label";
    ``homogeneous``: a label whose sentences make the homogeneous null. The kernel: ``output``,
    ``method``; the statistics: ``resamples`` (the jackknife's deletions at most; 0: no interval)
    and ``null_draws`` (0: no null band); ``per_layer``: each layer's block too."""

    every: int = 0
    n: int = 128
    data: str | None = None
    seq_len: int | None = None
    seed: int = 0
    by: str = "tail"
    tail_fraction: float = GCOptions.tail_fraction  # the grouping's defaults and checks are GCOptions'
    bins: int = GCOptions.bins
    homogeneous: str | None = None
    output: str = "centred-true-logit"
    method: str = "auto"
    resamples: int = Resampling.resamples  # the statistics' defaults and checks are Resampling's
    null_draws: int = Resampling.null_draws
    per_layer: bool = False

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise UserError(f"TrainConfig: track.every must be a step count >= 0 (0: off) (got {self.every!r})")
        _positive("track.n", self.n)
        if self.seq_len is not None:
            _positive("track.seq_len", self.seq_len)
        if self.by not in ("tail", "frequency-bins", "label"):
            raise UserError(f"TrainConfig: track.by must be 'tail', 'frequency-bins' or 'label' (got {self.by!r})")
        try:
            self.grouping, self.resampling
        except UserError as e:  # "Resampling: resamples must ..." -> "TrainConfig: track.resamples must ..."
            raise UserError(f"TrainConfig: track.{str(e).removeprefix('Resampling: ')}") from None

    def __bool__(self) -> bool:
        return self.every > 0

    @property
    def grouping(self) -> GCOptions:
        """The probes' grouping as the one :class:`~ntkscope.GCOptions` (its defaults and checks)."""
        return GCOptions(bins=self.bins, tail_fraction=self.tail_fraction, homogeneous_label=self.homogeneous)

    @property
    def resampling(self) -> Resampling:
        """The probes' statistics as the one :class:`~ntkscope.Resampling` (its defaults and checks)."""
        return Resampling(resamples=self.resamples, null_draws=self.null_draws, seed=self.seed)


def _text_files(value):
    """``data.text_files`` checked: None, a non-empty list of paths, or a non-empty mapping
    {domain: [paths]}, each list non-empty; paths as strings (what train_config.json records)."""
    if value is None:
        return None

    def paths(v):
        ok = isinstance(v, (list, tuple)) and v and all(isinstance(p, (str, os.PathLike)) and str(p) for p in v)
        return [str(p) for p in v] if ok else None

    if isinstance(value, dict) and value and all(isinstance(d, str) and d for d in value):
        checked = {domain: paths(v) for domain, v in value.items()}
        if all(checked.values()):
            return checked
    elif not isinstance(value, dict) and paths(value):
        return paths(value)
    raise fail("TrainConfig", "data.text_files", "must be a non-empty list of paths (one domain, 'text') or a "
               "mapping {domain: [paths]}", value)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"TrainConfig: {name} must be a positive integer (got {value!r})")


#: the conversion step's old names, per section, read as ``convert_at`` with a warning
#: (:meth:`TrainConfig.from_record` reads a recorded config's silently)
RENAMED = {"cse": {"warmup_steps": "convert_at"}, "upcycle": {"at": "convert_at"}}


def _section(cls, name: str, value):
    """A sub-configuration from its mapping (or as it is), unknown keys refused in one line."""
    if isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise UserError(f"TrainConfig: {name} must be a mapping (got {type(value).__name__})")
    value = renamed_keys(value, RENAMED.get(name, {}), f"TrainConfig: {name}")
    return from_fields(cls, value, f"TrainConfig: {name} has")


LR_SCHEDULES = ("cosine", "linear", "constant")  # the decay after the linear warm-up (cse_models.train.lr_factor)


@dataclass
class TrainConfig:
    """Everything a run needs. ``model`` holds :class:`GPTConfig` fields (``sparse`` included);
    ``vocab_size`` defaults to the tokenizer's."""

    out_dir: str = "runs/run"
    model: dict = field(default_factory=dict)  # GPTConfig fields, checked when the model is built
    data: DataConfig = field(default_factory=DataConfig)
    cse: CSEConfig = field(default_factory=CSEConfig)
    init_from: str | None = None               # a checkpoint to continue from: cse_models, or an HF causal
    #                                            LM directory (model.sparse then says what to convert)
    upcycle: UpcycleConfig = field(default_factory=UpcycleConfig)
    track: TrackConfig = field(default_factory=TrackConfig)  # GC during training (OUT/track/gc.csv)
    plan: str | None = None                    # an ntkscope plan: sparse.layers / cse.convert_at "auto"
    steps: int = 1000
    stop_at: int | None = None                # stop (with a checkpoint) after this many steps of the `steps` schedule
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50                    # the learning rate's linear warm-up (not the conversion step)
    lr_schedule: str = "cosine"               # after the warm-up, to min_lr_ratio at `steps`: cosine | linear | constant
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    checkpoint_steps: tuple = ()              # extra checkpoints (e.g. dense early ones for GC over training)
    log_every: int = 10
    eval_every: int = 0                       # validation loss per domain every K steps (OUT/validation.csv; 0: off)
    tensorboard: bool = True                  # event files in out_dir/tensorboard when tensorboard is installed
    device: str = "auto"
    bf16: bool = True

    def __post_init__(self):  # the sections typed however the config was made (a file, keywords, replace)
        for name, section in (("data", DataConfig), ("cse", CSEConfig), ("upcycle", UpcycleConfig),
                              ("track", TrackConfig)):
            setattr(self, name, _section(section, name, getattr(self, name)))

    @classmethod
    def load(cls, path: str | Path, **overrides) -> "TrainConfig":
        """A JSON or YAML config file, with ``overrides`` (e.g. ``steps``) applied before it is checked."""
        path = Path(path)
        if not path.is_file():
            raise MissingInput(f"TrainConfig.load: {path} does not exist")
        text = path.read_text(encoding="utf-8")
        try:
            data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
        except (yaml.YAMLError, json.JSONDecodeError) as err:
            where = getattr(err, "problem_mark", None)
            at = f"line {where.line + 1}, column {where.column + 1}: " if where is not None else ""
            what = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise UserError(f"TrainConfig.load: {path} is not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'} "
                            f"({at}{what})") from None
        if not isinstance(data, dict):
            raise UserError(f"TrainConfig.load: {path} must hold a mapping of settings (got {type(data).__name__})")
        return cls.from_dict({**data, **overrides})

    @classmethod
    def from_record(cls, data: dict) -> "TrainConfig":
        """A run's recorded config (``train_config.json``) of any version: a field added since takes
        the value the run's own code had, where that is not today's default (an upcycling recorded
        before ``upcycle.preserving`` existed was the classic softmax gate), and every other one its
        default."""
        data = {k: renamed_keys(v, RENAMED[k], f"TrainConfig: {k}", warn=False) if k in RENAMED else v
                for k, v in data.items()}
        upcycle = data.get("upcycle")
        if isinstance(upcycle, dict) and upcycle.get("convert_at") is not None and "preserving" not in upcycle:
            data["upcycle"] = {**upcycle, "preserving": False}
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        cfg = from_fields(cls, data, "TrainConfig:")
        if not isinstance(cfg.model, dict):
            raise UserError(f"TrainConfig: model must be a mapping of GPTConfig fields (got {type(cfg.model).__name__})")
        for key in ("steps", "batch_size", "checkpoint_every", "log_every"):
            value = getattr(cfg, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"TrainConfig: {key} must be a positive integer (got {value!r})")
        if isinstance(cfg.eval_every, bool) or not isinstance(cfg.eval_every, int) or cfg.eval_every < 0:
            raise UserError(f"TrainConfig: eval_every must be an integer >= 0 (0: no validation log; got "
                            f"{cfg.eval_every!r})")
        if isinstance(cfg.warmup_steps, bool) or not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
            raise UserError(f"TrainConfig: warmup_steps must be an integer >= 0 (got {cfg.warmup_steps!r})")
        extra = cfg.checkpoint_steps
        if not isinstance(extra, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                       for s in extra):
            raise UserError(f"TrainConfig: checkpoint_steps must be a list of positive integer steps (got {extra!r})")
        cfg = dataclasses.replace(cfg, checkpoint_steps=tuple(sorted(set(extra))))
        if cfg.stop_at is not None and (isinstance(cfg.stop_at, bool) or not isinstance(cfg.stop_at, int)
                                        or not 1 <= cfg.stop_at <= cfg.steps):
            raise UserError(f"TrainConfig: stop_at must be a step in [1, steps={cfg.steps}] or null (got {cfg.stop_at!r})")
        numbers = {k: getattr(cfg, k) for k in ("lr", "min_lr_ratio", "weight_decay", "grad_clip")}
        numbers.update({f"betas[{i}]": b for i, b in enumerate(cfg.betas)})
        bad = {k: v for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, (int, float))
               or not math.isfinite(v)}
        if bad:
            raise UserError(f"TrainConfig: {', '.join(bad)} must be finite numbers (got "
                            f"{', '.join(repr(v) for v in bad.values())})")
        if cfg.lr_schedule not in LR_SCHEDULES:
            raise UserError(f"TrainConfig: lr_schedule must be one of {list(LR_SCHEDULES)} (got {cfg.lr_schedule!r})")
        if not cfg.lr > 0 or not 0 <= cfg.min_lr_ratio <= 1 or cfg.warmup_steps < 0 or cfg.grad_clip < 0:
            raise UserError(f"TrainConfig: need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0, grad_clip >= 0 "
                            f"(got {cfg.lr}, {cfg.min_lr_ratio}, {cfg.warmup_steps}, {cfg.grad_clip})")
        return cfg


def apply_plan(cfg: TrainConfig) -> TrainConfig:
    """Resolve ``sparse.layers: auto``, ``sparse.module: auto`` and ``cse.convert_at: auto``
    from the plan file (written by ``ntkscope plan``)."""
    sparse = (cfg.model or {}).get("sparse") or {}
    wants = [k for k in ("layers", "module") if sparse.get(k) == "auto"] + \
        (["convert_at"] if cfg.cse.convert_at == "auto" else [])
    if not wants:
        return cfg
    if not cfg.plan:
        raise UserError(f"TrainConfig: {wants} are 'auto' but no plan file is given (plan: PLAN.json, "
                        "from: ntkscope plan RUN_DIR --out PLAN.json)")
    plan = Plan.load(cfg.plan)
    cfg = copy.deepcopy(cfg)
    sparse = cfg.model["sparse"]
    if sparse.get("layers") == "auto":
        sparse["layers"] = list(plan.layers)
        sparse["n_experts"] = [0] * len(plan.layers)
    if sparse.get("module") == "auto":
        sparse["module"] = plan.module
    if cfg.cse.convert_at == "auto":
        if plan.convert_at is None:
            raise UserError(f"TrainConfig: cse.convert_at is 'auto' but plan {cfg.plan} has no conversion step "
                            "(it was made without a GC series)")
        cfg.cse.convert_at = warmup_after(cfg.init_from, int(plan.convert_at), cfg.plan)
    said = (str(cfg.plan), tuple(sparse["layers"]), cfg.cse.convert_at)
    warmup = cfg.cse.convert_at
    # info once per plan and outcome in a process (compare applies one plan to every arm), debug after
    log.log(logging.DEBUG if said in _PLANS_SAID else logging.INFO, "plan %s: CSE layers %s (%s), %s", cfg.plan,
            sparse["layers"], plan.chosen_by,
            f"converting at step {warmup}" if isinstance(warmup, int) else "its conversion step not used (none asked)")
    _PLANS_SAID.add(said)
    return cfg


_PLANS_SAID: set = set()


def warmup_after(init_from: str | None, warmup: int, plan: str) -> int:
    """The plan's warm-up (a step of the run it was measured on) as a step of this training: less
    the step ``init_from`` was saved at (its name, ``stepN`` or ``step-NNNNNN``), at least 0."""
    found = re.search(r"step-?(\d+)$", Path(init_from).name) if init_from else None
    start = int(found.group(1)) if found else 0
    if start > warmup:
        log.warning("plan %s: warm-up at step %d of the measured run, but init_from %s is step %d: converting at "
                    "once", plan, warmup, init_from, start)
    return max(warmup - start, 0)


def check_plan(cfg: TrainConfig, model, tokenizer) -> None:
    """Refuse a plan measured on a model with another number of layers (its layer indices do not
    transfer), and warn, one line each, where the architecture or tokenizer differs from what the
    plan was measured on, or where the conversion falls at or after the run's last step."""
    warmup, sparse = cfg.cse.convert_at, model.config.sparse
    if sparse is not None and sparse.kind == "cse" and isinstance(warmup, int) and warmup >= cfg.steps \
            and not any(sparse.n_experts):
        log.warning("cse.convert_at %d is at or beyond the run's %d steps: this run stays dense (the CSE layers "
                    "are never built)", warmup, cfg.steps)
    if not cfg.plan:
        return
    source = Plan.load(cfg.plan).source
    if not source:
        log.warning("plan %s does not record what it was measured on (an older plan): applied unchecked", cfg.plan)
        return
    arch = architecture(model)
    if source.get("n_layer") != arch["n_layer"]:
        raise UserError(f"train: plan {cfg.plan} was measured on a {source.get('n_layer')}-layer "
                        f"{source.get('model_type')} model and this one has {arch['n_layer']} layers: its layer "
                        "indices do not transfer; measure a plan on this model's own checkpoints")
    differ = [f"{key} {source.get(key)!r} (plan) vs {arch[key]!r}" for key in ("model_type", "n_embd")
              if source.get(key) != arch[key]]
    if source.get("vocab_size") not in (None, tokenizer.vocab_size):
        differ.append(f"tokenizer {source.get('tokenizer')} ({source.get('vocab_size')} tokens, plan) vs "
                      f"{tokenizer.name} ({tokenizer.vocab_size})")
    if differ:
        log.warning("plan %s was measured on another model: %s; its layers and warm-up may not apply", cfg.plan,
                    "; ".join(differ))
