"""An experiment as a spec: one TOML file that names the trunk, the arms, the seeds, the
evaluation and the pre-registered criteria (docs/experiments.md).

Two kinds of experiment ship with the package (``ntkscope experiment specs``):

- ``kind = "sweep"``: per seed, a dense trunk trains the whole schedule; every arm branches from
  the trunk's checkpoint at its conversion step and trains to the same end on the same batches
  (:mod:`ntkscope.reproduction.sweep`). Its units are the trunks, the trunks' plans and
  (arm, seed, step).
- ``kind = "tables"``: the paper's table rows (dense, tuned, Switch, CSE/MoF, CSE/MoA, DEMix) per
  architecture and pretraining seed (:mod:`ntkscope.reproduction.paper`). Its units are
  (architecture, row, seed).

A spec is read and checked whole before any unit runs; a mistake is one line naming the field::

    name = "sweep"
    kind = "sweep"
    preset = "sweep"             # ReproduceSettings preset; [settings] changes its fields
    seeds = [0, 1, 2]

    [settings]
    steps = 2400

    [trunk]
    layers = [2, 3]              # the sparse layers of every arm (an arm may name its own)
    gc_peak_step = 75            # the "gc-peak" conversion step (kept as a trunk checkpoint)

    [[arms]]
    name = "cse-late"
    kind = "cse"                 # dense | cse | switch | demix | encoder | null (reproduction.arm_kinds)
    convert_at = "late"          # "rule" | "gc-peak" | "late" | a step | a list of steps
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from cse_models.hf import block_count
from ntkscope.core.checks import InputError, MissingInput, UserError, renamed_keys
from ntkscope.experiments.kinds import EXPERIMENT_KINDS
from ntkscope.reproduction.arm_kinds import ARM_KINDS, OPTIONAL_FIELDS, TRUNK
from ntkscope.reproduction.paper import ARCH_NAMES, row_keys
from ntkscope.reproduction.settings import PRESETS, RENAMED_SETTINGS, ReproduceSettings
from ntkscope.reproduction.sweep import NAMED_STEPS, Arm, Rule, Structure
from ntkscope.reproduction.sweep_tables import Criteria

MAX_SETTING = 2**31 - 1  # the largest integer setting (steps, sizes, counts)
MAX_SEED = 2**31 - 1 - 10**6  # a seed plus the offsets units add to it (null_order) stays a 32-bit seed
#: numeric settings that must be above 0 (every other one is at least 0); all must be finite
POSITIVE_SETTINGS = ("steps", "checkpoint_every", "batch_size", "lr", "finetune_lr", "seq_len", "cse_samples", "n",
                     "n_perplexity", "proj_dim", "min_cluster_size", "min_samples", "max_experts", "switch_experts",
                     "sparse_layers", "bins", "min_count", "k_max", "projection_dim", "snapshots",
                     "max_warmup_fraction", "tail_fraction", "seeds")
EXECUTORS = ("local", "submitit-local", "slurm", "inline")


class SpecError(InputError):
    """A spec that cannot run: ``FILE: FIELD RULE (got VALUE)``, one line: an :class:`InputError`
    whose function is the spec's file and whose argument is the field, the value shown as TOML
    would write it (JSON's spelling)."""

    def __init__(self, source: str, where: str, rule: str, value):
        super().__init__(where, rule, value, str(source))
        self.args = (source, where, rule, value)  # what pickling calls the class with

    def __str__(self) -> str:
        shown = json.dumps(self.value, default=str) if not isinstance(self.value, str) else repr(self.value)
        return f"{self.func}: {self.arg} {self.rule} (got {shown})"


@dataclass(frozen=True)
class TrunkSpec:
    """What every arm of a sweep shares: the sparse ``layers`` (an arm may name its own), the
    ``gc_peak_step`` (kept as a trunk checkpoint), the ``null_order`` offset of the null arm's
    data order, the warm-up ``rule``, the frozen-encoder arms' ``encoder`` (an HF encoder
    directory; empty: the shipped MiniLM-L6), given ``[trunk.structure]``, the
    consensus-structure rule that reads every trunk's warm-up and layers (a plan unit per seed),
    and ``model``: the researcher's own HF causal LM directory (config.json, weights and
    tokenizer.json) that every trunk starts from and trains on, in place of the preset's GPT
    (empty: the preset's GPT; given, ``[data]`` is tokenized by the model's own tokenizer);
    ``n_layer``: the trunk model's block count (the model's or the preset's)."""

    layers: tuple = (2, 3)
    gc_peak_step: int = 75
    null_order: int = 1000
    rule: Rule = Rule()
    encoder: str = ""
    structure: Structure | None = None
    model: str = ""
    n_layer: int = 0


@dataclass(frozen=True)
class SlurmSpec:
    """What each unit asks of Slurm (through submitit)."""

    partition: str = ""
    time_min: int = 240
    gpus: int = 0
    cpus: int = 1
    mem_gb: int = 8


@dataclass(frozen=True)
class DataSpec:
    """``[data]``: the researcher's own table (JSONL, CSV, TSV or Parquet; ``table`` relative to
    the spec's folder) in place of a corpus pack: its ``label_column`` gives the domains and
    ``tail`` the long tail's labels (the sweep's tail: ``settings.finetune_domains`` and the
    criteria's tail). The runner builds RUN/pack from it (:func:`ntkscope.text.corpus.table_pack.
    table_pack`), again only when the table's bytes change."""

    table: str
    tail: tuple
    text_column: str = "text"
    label_column: str = "label"
    validation: float = 0.1
    test: float = 0.1
    vocab_size: int = 8192


@dataclass(frozen=True)
class Spec:
    """A whole experiment. ``settings`` is the preset with the spec's changes; ``seeds`` the
    trunks' seeds (initialisation and data order); ``arms`` (kind "sweep"): one
    :class:`~ntkscope.reproduction.sweep.Arm` per conversion step (an ``[[arms]]`` entry of
    several steps is one arm per step, ``NAME-atSTEP``); ``tables`` (kind "tables"): ``archs`` and
    ``rows``; ``retries``: how often a failed unit is tried again; ``source``: where it was read;
    ``text``: the spec's tables as canonical JSON (kept in RUN/experiment.json, read back by
    :func:`parse_spec`)."""

    name: str
    kind: str
    settings: ReproduceSettings
    seeds: tuple
    trunk: TrunkSpec = TrunkSpec()
    arms: tuple = ()
    criteria: Criteria = Criteria()
    archs: tuple = ()
    rows: tuple = ()
    retries: int = 1
    slurm: SlurmSpec = SlurmSpec()
    source: str = "<spec>"
    text: str = ""
    data: DataSpec | None = None


# ---- reading ---------------------------------------------------------------------------------

def shipped() -> dict:
    """{name: path} of the specs that ship with the package."""
    folder = resources.files("ntkscope.experiments") / "specs"
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml")}


def load_spec(spec, **changes) -> Spec:
    """The spec at ``spec`` (a path, or the name of a shipped spec), checked whole. ``changes``
    replace top-level fields of the file first (e.g. ``seeds=[0]``, ``settings={"steps": 40}``:
    a table is merged), as a command line's options do."""
    path, ours = Path(spec), shipped()
    if not path.is_file():
        if str(spec) not in ours:
            raise MissingInput(f"load_spec: spec {str(spec)!r} is neither a file nor a shipped spec "
                               f"({', '.join(sorted(ours))})")
        path = ours[str(spec)]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"load_spec: {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"load_spec: {path} is not valid TOML ({err})") from None
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(data, source=str(path))


def parse_spec(data: dict, *, source: str = "<spec>") -> Spec:
    """A :class:`Spec` from the TOML tables ``data``, every field checked."""
    c = _Checker(source)
    c.only(data, "", {"name", "kind", "preset", "seeds", "settings", "trunk", "arms", "criteria", "tables", "run",
                      "data"})
    name = c.text(data, "name", required=True)
    kind = c.choice(data, "kind", list(EXPERIMENT_KINDS), required=True)
    preset = c.choice(data, "preset", sorted(PRESETS), required=True)
    settings = c.settings(data.get("settings", {}), PRESETS[preset])
    seeds = tuple(c.ints(data, "seeds", minimum=0, maximum=MAX_SEED, required=True))
    if len(set(seeds)) != len(seeds):
        raise SpecError(source, "seeds", "must not repeat a seed", list(seeds))
    run = data.get("run", {})
    c.only(run, "run.", {"retries", "slurm"})
    retries = c.int(run, "retries", minimum=0, default=1, where="run.")
    slurm_data = run.get("slurm", {})
    c.only(slurm_data, "run.slurm.", {f.name for f in dataclasses.fields(SlurmSpec)})
    slurm = SlurmSpec(partition=c.text(slurm_data, "partition", default="", where="run.slurm."),
                      **{k: c.int(slurm_data, k, minimum=0 if k == "gpus" else 1, default=getattr(SlurmSpec, k),
                                  where="run.slurm.") for k in ("time_min", "gpus", "cpus", "mem_gb")})
    common = dict(name=name, kind=kind, settings=settings, seeds=seeds, retries=retries, slurm=slurm,
                  source=source, text=json.dumps(data, sort_keys=True))
    if kind == "tables":
        c.only(data, "", {"name", "kind", "preset", "seeds", "settings", "tables", "run"})
        return Spec(**{**common, **_tables(c, data.get("tables", {}), settings, seeds)})
    c.only(data, "", {"name", "kind", "preset", "seeds", "settings", "trunk", "arms", "criteria", "run", "data"})
    own = _data(c, data["data"]) if "data" in data else None
    if own is not None:  # the table's long tail is the sweep's tail, unless the spec says otherwise
        if "finetune_domains" not in data.get("settings", {}):
            settings = settings.replace(finetune_domains=own.tail)
        common["settings"] = settings
    trunk = _trunk(c, data.get("trunk", {}), settings)
    if trunk.model and own is None:
        raise SpecError(source, "trunk.model", "needs a [data] table (the researcher's text, tokenized by the model's "
                        "own tokenizer; a corpus pack has its own)", trunk.model)
    if trunk.model and ("model" in data.get("settings", {}) or "vocab_size" in data["data"]):
        raise SpecError(source, "trunk.model", "sets the architecture and the tokenizer: leave settings.model and "
                        "data.vocab_size out", sorted({"settings.model", "data.vocab_size"} & {
                            *(f"settings.{k}" for k in data.get("settings", {})), *(f"data.{k}" for k in data["data"])}))
    arms = data.get("arms")
    if not isinstance(arms, list) or not arms:
        raise SpecError(source, "arms", "must be one or more [[arms]] tables", arms)
    parsed = [_arm(c, a, i, trunk, settings) for i, a in enumerate(arms)]  # (name, its arms: one per step)
    for name, group in parsed:
        if set(group[0].seeds) - set(seeds):
            raise SpecError(source, f"arms ({name}).seeds", f"must be seeds of the spec {list(seeds)} (their "
                            "trunks)", list(group[0].seeds))
        if len(set(group[0].seeds)) != len(group[0].seeds):
            raise SpecError(source, f"arms ({name}).seeds", "must not repeat a seed", list(group[0].seeds))
    names = [name for name, _ in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SpecError(source, "arms", "must have distinct names", repeated)
    arms = tuple(arm for _, group in parsed for arm in group)
    expanded = [a.name for a in arms]
    repeated = sorted({n for n in expanded if expanded.count(n) > 1})
    if repeated:  # an arm of several steps becomes NAME-atSTEP: another arm may not be named so
        raise SpecError(source, "arms", "must have distinct names once an arm of several steps becomes one arm per "
                        "step (NAME-atSTEP)", repeated)
    if "plan" in expanded:
        raise SpecError(source, "arms", "must not name an arm 'plan' (the trunks' plan units are plan-seedK)", "plan")
    if sum(a.kind == TRUNK for a in arms) != 1:
        raise SpecError(source, "arms", f"must hold exactly one arm of kind {TRUNK!r} (the trunk every arm branches "
                        "from)", [a.name for a in arms if a.kind == TRUNK])
    criteria = _criteria(c, data.get("criteria", {}))
    if own is not None and "tail" not in data.get("criteria", {}):
        criteria = dataclasses.replace(criteria, tail=own.tail)
    unknown = sorted(_named_criteria(data.get("criteria", {})) - set(expanded))
    if unknown:
        raise SpecError(source, "criteria", f"must name arms of the spec {expanded}", unknown)
    return Spec(**common, trunk=trunk, arms=arms, criteria=criteria, data=own)


def _data(c: "_Checker", data) -> DataSpec:
    """``[data]``, checked: the table a file, the tail one or more labels, the fractions below 1."""
    if not isinstance(data, dict):
        raise SpecError(c.source, "data", "must be a table ([data])", data)
    c.only(data, "data.", {f.name for f in dataclasses.fields(DataSpec)})
    table = c.text(data, "table", required=True, where="data.")
    path = Path(table) if Path(table).is_absolute() else Path(c.source).parent / table
    if not path.is_file():
        raise SpecError(c.source, "data.table", "must name a table file (.jsonl, .csv, .tsv, .parquet), relative to "
                        "the spec's folder", table)
    tail = c.texts(data, "tail", where="data.")
    if not tail:
        raise SpecError(c.source, "data.tail", "must list the long tail's labels (one or more)", tail)
    d = DataSpec("", ())
    out = DataSpec(str(path.resolve()), tuple(tail),
                   text_column=c.text(data, "text_column", default=d.text_column, where="data."),
                   label_column=c.text(data, "label_column", default=d.label_column, where="data."),
                   validation=c.number(data, "validation", low=0.0, high=0.9, default=d.validation, where="data."),
                   test=c.number(data, "test", low=0.0, high=0.9, default=d.test, where="data."),
                   vocab_size=c.int(data, "vocab_size", minimum=300, maximum=MAX_SETTING, default=d.vocab_size,
                                    where="data."))
    if not (0 < out.validation and 0 < out.test and out.validation + out.test < 1):
        raise SpecError(c.source, "data.validation", "and data.test must be above 0, together below 1",
                        [out.validation, out.test])
    return out


def _named_criteria(data) -> set:
    """The arm names a [criteria] table gives itself (not Criteria's defaults): its arms, its
    switch and the arms of switch_for (whose controls a registered verdict may name without their
    having run: the sweep's switch-gc, reported "not run")."""
    if not isinstance(data, dict):
        return set()
    named = set(data.get("arms", [])) | ({data["switch"]} if isinstance(data.get("switch"), str) else set())
    switch_for = data.get("switch_for", {})
    return named | (set(switch_for) if isinstance(switch_for, dict) else set())


def _tables(c: "_Checker", data: dict, settings: ReproduceSettings, seeds: tuple) -> dict:
    c.only(data, "tables.", {"archs", "rows"})
    archs = tuple(c.choices(data, "archs", sorted(ARCH_NAMES), default=list(settings.table_archs), where="tables."))
    rows = tuple(c.choices(data, "rows", row_keys(settings), default=row_keys(settings), where="tables."))
    if not archs:
        raise SpecError(c.source, "tables.archs", "must name one or more architectures", [])
    if "dense" not in rows:
        raise SpecError(c.source, "tables.rows", "must include 'dense' (every row starts from it)", list(rows))
    if list(seeds) != list(range(seeds[0], seeds[0] + len(seeds))):
        raise SpecError(c.source, "seeds", "must be consecutive for kind 'tables'", list(seeds))
    if not settings.table_layers or not settings.table_convert_at:
        raise SpecError(c.source, "settings.table_layers", "and settings.table_convert_at must be set: the rows' "
                        "layers and conversion step are part of the spec",
                        [list(settings.table_layers), settings.table_convert_at])
    return {"archs": archs, "rows": rows,
            "settings": settings.replace(table_archs=archs, seed=seeds[0], seeds=len(seeds))}


def _trunk(c: "_Checker", data: dict, settings: ReproduceSettings) -> TrunkSpec:
    """The [trunk] table; a field left out takes TrunkSpec's (and Rule's) default."""
    c.only(data, "trunk.", {"layers", "gc_peak_step", "null_order", "rule", "encoder", "structure", "model"})
    model = c.text(data, "model", default="", where="trunk.")
    model, n_layer = _own_model(c, model) if model else ("", int(settings.model.get("n_layer", 0)))
    t, r, rule = TrunkSpec(), Rule(), data.get("rule", {})
    c.only(rule, "trunk.rule.", {"horizon", "threshold", "min_persisting"})
    structure = None
    if "structure" in data:
        given, d, where = data["structure"], Structure(), "trunk.structure."
        c.only(given, where, {f.name for f in dataclasses.fields(Structure)})
        structure = Structure(
            n_fits=c.int(given, "n_fits", minimum=2, default=d.n_fits, where=where),
            fraction=c.number(given, "fraction", low=0.0, high=1.0, default=d.fraction, where=where),
            sample=c.int(given, "sample", minimum=20, default=d.sample, where=where),
            level=c.number(given, "level", low=0.0, high=1.0, default=d.level, where=where),
            min_size=c.int(given, "min_size", minimum=2, default=d.min_size, where=where),
            n_boot=c.int(given, "n_boot", minimum=0, default=d.n_boot, where=where),
            confidence=c.number(given, "confidence", low=0.0, high=1.0, default=d.confidence, where=where),
            min_structure=c.number(given, "min_structure", low=0.0, high=1.0, default=d.min_structure, where=where))
    layers = tuple(c.ints(data, "layers", minimum=0, maximum=n_layer - 1, default=list(t.layers), where="trunk."))
    if len(set(layers)) != len(layers):
        raise SpecError(c.source, "trunk.layers", "must not repeat a layer", list(layers))
    return TrunkSpec(
        layers=layers,
        gc_peak_step=c.int(data, "gc_peak_step", minimum=1, maximum=settings.steps - 1, default=t.gc_peak_step,
                           where="trunk."),
        null_order=c.int(data, "null_order", minimum=1, default=t.null_order, where="trunk."),
        encoder=c.text(data, "encoder", default=t.encoder, where="trunk."),
        rule=Rule(horizon=c.int(rule, "horizon", minimum=1, default=r.horizon, where="trunk.rule."),
                  threshold=c.number(rule, "threshold", low=0.0, high=1.0, default=r.threshold, where="trunk.rule."),
                  min_persisting=c.number(rule, "min_persisting", low=0.0, high=1.0, default=r.min_persisting,
                                          where="trunk.rule.")),
        structure=structure, model=model, n_layer=n_layer)


def _own_model(c: "_Checker", model: str) -> tuple[str, int]:
    """``trunk.model`` checked: an HF causal LM directory, relative to the spec's folder, with
    config.json (of a layout :mod:`cse_models.hf` supports), weights and tokenizer.json; its
    resolved path and block count. Loading it is :func:`cse_models.hf.load_hf`'s."""
    path = Path(model) if Path(model).is_absolute() else Path(c.source).parent / model
    rule = ("must name an HF causal LM directory (config.json, model.safetensors, tokenizer.json), relative to the "
            "spec's folder")
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file() or not any(
            (path / w).is_file() for w in ("model.safetensors", "pytorch_model.bin")):
        if any(path.glob("checkpoint-*")):
            rule += "; of a Trainer run, name one of its checkpoint-N or save_model its final model into it"
        raise SpecError(c.source, "trunk.model", rule, model)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        n_layer = block_count(path, "trunk.model")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UserError) as err:
        raise SpecError(c.source, "trunk.model", f"{rule} ({err})", model) from None
    if not isinstance(config, dict) or any("MaskedLM" in str(a) for a in config.get("architectures") or ()):
        raise SpecError(c.source, "trunk.model", "must be a causal LM (the sweep's trunks predict the next token)",
                        config.get("architectures") if isinstance(config, dict) else config)
    return str(path.resolve()), n_layer


def _arm(c: "_Checker", data, i: int, trunk: TrunkSpec, settings: ReproduceSettings) -> tuple[str, tuple]:
    """``[[arms]]`` entry ``i``, checked: its name and its :class:`~ntkscope.reproduction.sweep.Arm`s, one per
    conversion step (``NAME-atSTEP`` for an arm of several steps; the trunk: one, with no step)."""
    where = f"arms[{i}]."
    if not isinstance(data, dict):
        raise SpecError(c.source, f"arms[{i}]", "must be a table ([[arms]])", data)
    data = renamed_keys(data, {"at": "convert_at"}, f"{c.source}: arms[{i}]")
    c.only(data, where, {f.name for f in dataclasses.fields(Arm)})
    name = c.text(data, "name", required=True, where=where)
    if not name.replace("-", "").replace("_", "").isalnum():
        raise SpecError(c.source, f"{where}name", "must be letters, digits, '-' and '_' (it names folders)", name)
    where = f"arms[{i}] ({name})."
    kind = c.choice(data, "kind", list(ARM_KINDS), required=True, where=where)
    at = data.get("convert_at", [] if kind == TRUNK else None)
    steps = at if isinstance(at, list) else [at]
    if kind == TRUNK:
        if steps:
            raise SpecError(c.source, f"{where}convert_at", "must be left out: the trunk is not converted", at)
    elif at is None or not steps:
        raise SpecError(c.source, f"{where}convert_at", f"must be {' | '.join(NAMED_STEPS)}, a step or a list of "
                        "steps", at)
    for step in steps:
        if isinstance(step, str) and step in NAMED_STEPS:
            continue
        if isinstance(step, bool) or not isinstance(step, int):
            raise SpecError(c.source, f"{where}convert_at", f"must be {' | '.join(NAMED_STEPS)}, a step or a list of "
                            "steps", at)
        if not (0 < step < settings.steps and (step % settings.checkpoint_every == 0 or step == trunk.gc_peak_step)):
            raise SpecError(c.source, f"{where}convert_at", "must be steps the trunk keeps: multiples of "
                            f"checkpoint_every ({settings.checkpoint_every}) in (0, {settings.steps}), or the "
                            "gc_peak_step", at)
    if len(set(steps)) != len(steps):
        raise SpecError(c.source, f"{where}convert_at", "must not repeat a step", at)
    layers = tuple(c.ints(data, "layers", minimum=0, maximum=trunk.n_layer - 1, default=list(trunk.layers),
                          where=where))
    if len(set(layers)) != len(layers):
        raise SpecError(c.source, f"{where}layers", "must not repeat a layer", list(layers))
    arm = Arm(name=name, kind=kind, convert_at=None, layers=layers,
              mean_rate=c.number(data, "mean_rate", low=0.0, high=1.0, default=0.0, where=where),
              shuffled=c.flag(data, "shuffled", where=where), fair=c.flag(data, "fair", where=where),
              what=c.text(data, "what", default="", where=where),
              seeds=tuple(c.ints(data, "seeds", minimum=0, default=[], where=where)),
              counts_from=c.int(data, "counts_from", minimum=1, maximum=settings.steps - 1, default=None,
                                where=where))
    for field_name in OPTIONAL_FIELDS:  # each applies to the kinds that read it
        if getattr(arm, field_name) not in (False, None) and field_name not in ARM_KINDS[kind].fields:
            allowed = [k.name for k in ARM_KINDS.values() if field_name in k.fields]
            raise SpecError(c.source, f"{where}{field_name}", f"applies to kind {' or '.join(map(repr, allowed))} "
                            "only", kind)
    if arm.counts_from is not None and arm.counts_from % settings.checkpoint_every:
        raise SpecError(c.source, f"{where}counts_from", f"must be a step the trunk keeps (a multiple of "
                        f"checkpoint_every, {settings.checkpoint_every})", arm.counts_from)
    return name, tuple(dataclasses.replace(arm, name=name if len(steps) <= 1 else f"{name}-at{step}", convert_at=step)
                       for step in steps or (None,))


def _criteria(c: "_Checker", data: dict) -> Criteria:
    c.only(data, "criteria.", {f.name for f in dataclasses.fields(Criteria)})
    d = Criteria()
    switch_for = data.get("switch_for", d.switch_for)
    if not isinstance(switch_for, dict) or not all(isinstance(v, str) for v in switch_for.values()):
        raise SpecError(c.source, "criteria.switch_for", "must be a table of arm = switch arm", switch_for)
    return Criteria(
        arms=tuple(c.texts(data, "arms", default=list(d.arms), where="criteria.")),
        tail=tuple(c.texts(data, "tail", default=list(d.tail), where="criteria.")),
        close_share=c.number(data, "close_share", low=0.0, high=1.0, default=d.close_share, where="criteria."),
        general_tolerance=c.number(data, "general_tolerance", low=0.0, high=1.0, default=d.general_tolerance,
                                   where="criteria."),
        starved_share=c.number(data, "starved_share", low=0.0, high=1.0, default=d.starved_share, where="criteria."),
        switch=c.text(data, "switch", default=d.switch, where="criteria."), switch_for=dict(switch_for))


class _Checker:
    """Typed reads of a spec's tables, each refusal one line naming the field."""

    def __init__(self, source: str):
        self.source = source

    def _bad(self, where, key, rule, value):
        return SpecError(self.source, f"{where}{key}", rule, value)

    def only(self, data, where: str, allowed: set) -> None:
        if not isinstance(data, dict):
            raise SpecError(self.source, where.rstrip(".") or "the spec", "must be a table", data)
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise SpecError(self.source, f"{where}{unknown[0]}", f"is not a field here (fields: "
                            f"{', '.join(sorted(allowed))})", data[unknown[0]])

    def _get(self, data, key, default, required, where):
        if key not in data:
            if required:
                raise self._bad(where, key, "is required", None)
            return default, False
        return data[key], True

    def text(self, data, key, *, default=None, required=False, where=""):
        value, given = self._get(data, key, default, required, where)
        if given and (not isinstance(value, str) or (required and not value.strip())):
            raise self._bad(where, key, "must be a non-empty string" if required else "must be a string", value)
        return value

    def texts(self, data, key, *, default=None, where=""):
        value, given = self._get(data, key, default, False, where)
        if given and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise self._bad(where, key, "must be a list of strings", value)
        return value

    def choice(self, data, key, options, *, default=None, required=False, where=""):
        value, given = self._get(data, key, default, required, where)
        if given and value not in options:
            raise self._bad(where, key, f"must be one of {', '.join(options)}", value)
        return value

    def choices(self, data, key, options, *, default=None, where=""):
        value = self.texts(data, key, default=default, where=where)
        bad = [v for v in value if v not in options]
        if bad:
            raise self._bad(where, key, f"must name items of {', '.join(options)}", bad)
        return value

    def flag(self, data, key, *, where=""):
        value, given = self._get(data, key, False, False, where)
        if given and not isinstance(value, bool):
            raise self._bad(where, key, "must be true or false", value)
        return value

    def int(self, data, key, *, minimum=None, maximum=None, default=None, required=False, where=""):
        value, given = self._get(data, key, default, required, where)
        if given:
            self._check_int(where, key, value, minimum, maximum, value)
        return value

    def ints(self, data, key, *, minimum=None, maximum=None, default=None, required=False, where=""):
        value, given = self._get(data, key, default, required, where)
        if given:
            if not isinstance(value, list) or not value:
                raise self._bad(where, key, "must be a non-empty list of integers", value)
            for v in value:
                self._check_int(where, key, v, minimum, maximum, value)
        return value

    def _check_int(self, where, key, v, minimum, maximum, shown):
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(where, key, "must be integers" if isinstance(shown, list) else "must be an integer", shown)
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            bounds = f"in [{minimum}, {maximum}]" if maximum is not None else f"at least {minimum}"
            raise self._bad(where, key, f"must be {bounds}", shown)

    def number(self, data, key, *, low, high, default=None, where=""):
        value, given = self._get(data, key, default, False, where)
        if given and (isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high):
            raise self._bad(where, key, f"must be a number in [{low}, {high}]", value)
        return float(value)

    def settings(self, data, base: ReproduceSettings) -> ReproduceSettings:
        fields = {f.name: f for f in dataclasses.fields(ReproduceSettings)}
        data = renamed_keys(data, RENAMED_SETTINGS, f"{self.source}: settings")
        self.only(data, "settings.", set(fields) - {"mode", "adopt_from", "seed", "seeds"})
        changes = {}
        for key, value in data.items():
            current = getattr(base, key)
            if isinstance(current, bool):
                ok = isinstance(value, bool)
            elif isinstance(current, (int, float)):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 \
                    and (isinstance(value, int) or isinstance(current, float))
                if isinstance(value, float) and not math.isfinite(value):
                    raise self._bad("settings.", key, "must be a finite number", value)
                if ok and isinstance(value, int) and value > MAX_SETTING:
                    raise self._bad("settings.", key, f"must be at most {MAX_SETTING}",
                                    value if value < 10**30 else f"an integer of {len(str(value))} digits")
                if ok and key in POSITIVE_SETTINGS and not value > 0:
                    raise self._bad("settings.", key, "must be above 0", value)
            elif isinstance(current, (tuple, list)):
                ok, value = isinstance(value, list), tuple(value) if isinstance(value, list) else value
            else:
                ok = isinstance(value, type(current))
            if not ok:
                raise self._bad("settings.", key, f"must be like the preset's value {json.dumps(current)}", value)
            changes[key] = value
        if "model" in changes and not {"n_layer", "n_head", "n_embd"} <= set(changes["model"]):
            raise self._bad("settings.", "model", "must give n_layer, n_head and n_embd", changes["model"])
        for key in ("n_layer", "n_head", "n_embd"):
            size = changes.get("model", {}).get(key, 1)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self._bad("settings.", f"model.{key}", "must be a positive integer", size)
        if changes.get("steps", base.steps) < 1 or changes.get("checkpoint_every", base.checkpoint_every) < 1:
            raise self._bad("settings.", "steps", "and checkpoint_every must be at least 1",
                            [changes.get("steps", base.steps), changes.get("checkpoint_every", base.checkpoint_every)])
        return base.replace(**changes)
