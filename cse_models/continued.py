"""A run continued where it stopped, by another arm: the step, the learning-rate schedule and the
AdamW state a checkpoint holds of its run, and a branch that starts from them (``ntkscope
compare``: every arm from the warm-up checkpoint, on the run's own schedule).

Two writers keep what is needed:

- ``cse-train`` (:mod:`cse_models.checkpointing`): ``trainer_state.json`` records the run's
  :class:`~cse_models.TrainConfig` and ``optimizer.safetensors`` the AdamW state by parameter
  name; :func:`~cse_models.checkpointing.branch_from` copies them.
- transformers' ``Trainer`` (``checkpoint-N``): ``optimizer.pt`` and ``scheduler.pt`` (tensors
  and numbers, read with ``torch.load(weights_only=True)``), ``trainer_state.json`` (the step and
  ``max_steps``) and ``training_args.bin`` (the learning rate, the schedule's kind and warm-up,
  AdamW's settings). That last file is a pickle of ``TrainingArguments``; it is read by an
  unpickler that builds inert records of whatever the pickle names and never imports or calls
  anything of it, so no code runs. The AdamW state is matched to parameter names by Trainer's
  own grouping (decay parameters first, then the others, each in ``named_parameters`` order),
  checked shape by shape; the schedule is Trainer's linear, cosine or constant (with warm-up),
  checked against the learning rate ``scheduler.pt`` recorded at that step. What does not match
  is not continued, and :func:`run_state` says why.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cse_models.checkpointing import branch_from, carry_optimizer_state, latest_checkpoint, save_checkpoint
from cse_models.hf import SparseHF, load_any_model
from cse_models.train import lr_factor, make_optimizer
from cse_models.train_config import TrainConfig
from ntkscope.core.checks import UserError
from ntkscope.core.files import read_json_object

log = logging.getLogger(__name__)

#: the TrainConfig fields that make a run's learning-rate schedule and AdamW settings
SCHEDULE = ("lr", "lr_schedule", "min_lr_ratio", "warmup_steps", "steps", "weight_decay", "betas", "grad_clip")
#: Trainer's schedules that lr_factor reproduces (after the warm-up), as TrainConfig.lr_schedule
TRAINER_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                     "constant_with_warmup": "constant"}
TRAINER_ADAMW = ("adamw_torch", "adamw_torch_fused")  # torch.optim.AdamW's state layout
TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "training_args.bin", "trainer_state.json")


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds of its run: the ``step`` it was saved at, the ``schedule``
    (:data:`SCHEDULE`'s TrainConfig fields) and its ``writer`` ("cse-train" or "Trainer")."""

    step: int
    schedule: dict
    writer: str


#: what reading a damaged or foreign Trainer file can raise (each said in one line, never a traceback)
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, pickle.UnpicklingError,
              RuntimeError, EOFError, zipfile.BadZipFile, RecursionError)


class _Inert:
    """What a pickle names, as an inert record: its arguments and its state, nothing run."""

    def __new__(cls, *args, **kwargs):
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # never the named object: an inert record type
        return type(name, (_Inert,), {"qualified": f"{module}.{name}"})

    def persistent_load(self, pid):  # torch.save's tensor storages: not needed here
        return None


def read_training_args(path: Path) -> dict:
    """The fields of a ``training_args.bin`` (``torch.save(TrainingArguments)``) as a dict, enum
    fields by their value; read without importing or calling anything the pickle names."""
    raw = path.read_bytes()
    if zipfile.is_zipfile(io.BytesIO(raw)):
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                raise UserError(f"{path} is a torch archive without data.pkl")
            raw = archive.read(name)
    if any(op.name.startswith("EXT") for op, _, _ in pickletools.genops(raw)):  # copyreg's registry, not find_class
        raise UserError(f"{path} uses pickle extension codes, which are not read")
    record = _InertUnpickler(io.BytesIO(raw)).load()
    state = record.state if isinstance(record, _Inert) else None
    if not isinstance(state, dict):
        raise UserError(f"{path} does not hold TrainingArguments")
    return {k: (v.args[0] if isinstance(v, _Inert) and len(v.args) == 1 else v) for k, v in state.items()}


#: the TrainingArguments fields a continuation reads: (default, lowest, highest, highest excluded)
ARG_RANGES = {"learning_rate": (None, 0.0, math.inf, True), "adam_beta1": (0.9, 0.0, 1.0, True),
              "adam_beta2": (0.999, 0.0, 1.0, True), "adam_epsilon": (1e-8, 0.0, math.inf, True),
              "weight_decay": (0.0, 0.0, math.inf, True), "max_grad_norm": (0.0, 0.0, math.inf, True),
              "warmup_steps": (0.0, 0.0, math.inf, True), "warmup_ratio": (0.0, 0.0, 1.0, False)}


def _checked_args(args: dict) -> tuple[dict, str]:
    """The numeric fields of ``training_args.bin`` that a continuation reads, as finite floats in
    their ranges (``ARG_RANGES``), or ({}, why not): a huge integer, inf, text or a beta of 2 is
    a reason in one line, never an OverflowError or a failure mid-training."""
    out = {}
    for key, (default, low, high, open_high) in ARG_RANGES.items():
        value = args.get(key, default)
        if value is None and default is not None:
            value = default
        if key == "learning_rate" and value is None:
            return {}, "its training_args.bin records no learning_rate"
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not (math.isfinite(number) and low <= number and (number < high if open_high else number <= high)) \
                or (key == "learning_rate" and number <= 0):
            shown = repr(value) if isinstance(value, bool) or not isinstance(value, int) or abs(value) < 10**12 \
                else f"an integer of {len(str(abs(value)))} digits"
            end = ")" if open_high else "]"
            return {}, f"its training_args.bin's {key} must be a finite number in [{low}, {high}{end} (got {shown})"
        out[key] = number
    return out, ""


def _trainer_schedule(checkpoint: Path) -> tuple[RunState | None, str]:
    args = read_training_args(checkpoint / "training_args.bin")
    numbers, why = _checked_args(args)
    if not numbers:
        return None, why
    args = {**args, **numbers}
    state = read_json_object(checkpoint / "trainer_state.json", "run_state")
    step, total = int(state.get("global_step") or 0), int(state.get("max_steps") or 0)
    kind, optim = str(args.get("lr_scheduler_type")), str(args.get("optim"))
    if kind not in TRAINER_SCHEDULES or args.get("lr_scheduler_kwargs"):
        return None, f"its schedule {kind!r} ({args.get('lr_scheduler_kwargs') or 'no options'}) is not one of " \
                     f"{sorted(TRAINER_SCHEDULES)} without options"
    if optim not in TRAINER_ADAMW:
        return None, f"its optimizer {optim!r} is not torch's AdamW ({', '.join(TRAINER_ADAMW)})"
    if float(args.get("adam_epsilon", 1e-8)) != 1e-8:
        return None, f"its AdamW epsilon {args['adam_epsilon']} is not torch's default 1e-8, which cse_models uses"
    warmup = float(args.get("warmup_steps") or 0)
    if warmup < 1 and (warmup or args.get("warmup_ratio")):  # a ratio of the run's steps
        warmup = math.ceil(total * (warmup or float(args["warmup_ratio"])))
    schedule = {"lr": float(args["learning_rate"]), "lr_schedule": TRAINER_SCHEDULES[kind], "min_lr_ratio": 0.0,
                "warmup_steps": 0 if kind == "constant" else int(warmup), "steps": max(total, 1),
                "weight_decay": float(args.get("weight_decay") or 0.0),
                "betas": [float(args.get("adam_beta1", 0.9)), float(args.get("adam_beta2", 0.999))],
                "grad_clip": float(args.get("max_grad_norm") or 0.0)}
    if step < schedule["warmup_steps"]:
        return None, f"step {step} is inside its warm-up of {schedule['warmup_steps']} steps, which cse_models' " \
                     "warm-up does not reproduce step for step"
    saved = torch.load(checkpoint / "scheduler.pt", map_location="cpu", weights_only=True)
    recorded = saved.get("_last_lr") if isinstance(saved, dict) else None
    if not isinstance(recorded, (list, tuple)) or not recorded or isinstance(recorded[0], bool) \
            or not isinstance(recorded[0], (int, float)):
        return None, f"its scheduler.pt records no learning rate (a {type(saved).__name__}, _last_lr " \
                     f"{str(recorded)[:40]})"
    ours = schedule["lr"] * lr_factor(step, TrainConfig(**schedule))
    if recorded[0] is None or not math.isclose(float(recorded[0]), ours, rel_tol=1e-5, abs_tol=1e-12):
        return None, f"its learning rate at step {step} ({recorded[0]}) is not its {kind} schedule's ({ours:.6g})"
    try:  # the AdamW state must map onto this model's parameters, before any arm starts
        _trainer_adam(checkpoint, load_any_model(checkpoint))
    except ValueError as err:
        return None, " ".join(str(err).split())[:200]
    return RunState(step, schedule, "Trainer"), ""


def run_batch(checkpoint) -> tuple[int | None, int | None, str]:
    """(sequences per optimizer step of one process, tokens per sequence, where they were read) of
    the run that wrote ``checkpoint``: a ``cse_models`` run's train_config (its packed blocks'
    length), a ``Trainer`` run's trainer_state.json ``train_batch_size`` times training_args.bin's
    ``gradient_accumulation_steps`` (per process: a data-parallel run's global batch is that
    times its processes, which the checkpoint does not record; its rows' length is not recorded
    either: None); (None, None, why) when the checkpoint says neither."""
    checkpoint = Path(checkpoint)
    try:
        state = read_json_object(checkpoint / "trainer_state.json", "run_batch")
    except (UserError, OSError):
        return None, None, "no readable trainer_state.json"
    if isinstance(state.get("train_config"), dict):
        config = state["train_config"]
        data = config.get("data") if isinstance(config.get("data"), dict) else {}
        size, length = config.get("batch_size"), data.get("seq_len", config.get("seq_len"))
        if _positive(size):
            return int(size), int(length) if _positive(length) else None, "the run's train_config"
    size = state.get("train_batch_size")
    if not _positive(size):
        return None, None, "its trainer_state.json records no train_batch_size"
    try:
        accumulation = read_training_args(checkpoint / "training_args.bin").get("gradient_accumulation_steps", 1)
    except UNREADABLE + (OSError,):
        accumulation = 1
    accumulation = int(accumulation) if _positive(accumulation) else 1
    return int(size) * accumulation, None, "the Trainer run's train_batch_size x gradient_accumulation_steps, " \
                                           "per process"


def run_layout(checkpoint) -> tuple[str | None, str]:
    """(how the run that wrote ``checkpoint`` laid its text out, :data:`cse_models.data.LAYOUTS`;
    where that was read): a ``cse_models`` run's train_config ("packed" for one saved before runs
    recorded it); a ``Trainer`` run records no layout (its collator is not saved): (None, why)."""
    try:
        state = read_json_object(Path(checkpoint) / "trainer_state.json", "run_layout")
    except (UserError, OSError):
        return None, "no readable trainer_state.json"
    config = state.get("train_config")
    if isinstance(config, dict):
        data = config.get("data") if isinstance(config.get("data"), dict) else {}
        return str(data.get("layout", "packed")), "the run's train_config"
    return None, "the run records no layout: a Trainer checkpoint keeps no collator"


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def run_state(checkpoint) -> tuple[RunState | None, str]:
    """(what ``checkpoint`` holds of its run, "") or (None, why it cannot be continued)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "optimizer.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file():
        state = read_json_object(checkpoint / "trainer_state.json", "run_state")
        if not isinstance(state.get("train_config"), dict) or not isinstance(state.get("step"), int):
            return None, "its trainer_state.json records no train_config or step"
        config = TrainConfig.from_record(state["train_config"])
        return RunState(int(state["step"]), {k: getattr(config, k) for k in SCHEDULE}, "cse-train"), ""
    if not (checkpoint / "optimizer.pt").is_file():
        return None, "it holds no optimizer state (a model directory, or a checkpoint saved without it)"
    missing = [name for name in TRAINER_FILES if not (checkpoint / name).is_file()]
    if missing:
        return None, f"it lacks {', '.join(missing)} of a Trainer checkpoint"
    for name in ("training_args.bin", "scheduler.pt"):  # each named when it cannot be read (optimizer.pt: below)
        try:
            read_training_args(checkpoint / name) if name == "training_args.bin" else \
                torch.load(checkpoint / name, map_location="cpu", weights_only=True)
        except UNREADABLE as err:
            return None, f"its {name} could not be read ({' '.join(str(err).split())[:120]})"
    try:
        state = read_json_object(checkpoint / "trainer_state.json", "run_state")
    except UserError as err:
        return None, f"its trainer_state.json could not be read ({' '.join(str(err).split())[:120]})"
    for key in ("global_step", "max_steps"):
        value = state.get(key) or 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None, f"its trainer_state.json's {key} must be a step, an integer >= 0 (got {value!r})"
    try:
        return _trainer_schedule(checkpoint)
    except UNREADABLE as err:
        return None, f"its training_args.bin, scheduler.pt or trainer_state.json holds what a Trainer does not write " \
                     f"({' '.join(str(err).split())[:120]})"


def _trainer_adam(checkpoint: Path, model: SparseHF) -> dict:
    """{our parameter name: its AdamW state} from a Trainer's ``optimizer.pt``, matched by
    Trainer's grouping and checked shape by shape (ValueError where they differ)."""
    from transformers import Trainer  # optional: a Trainer checkpoint implies transformers

    try:
        saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    except UNREADABLE as err:
        raise UserError(f"its optimizer.pt could not be read ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        raise UserError("its optimizer.pt does not hold an optimizer's state_dict (param_groups and state)")
    decay = set(Trainer.get_decay_parameter_names(None, model.hf))
    named = [(n, p) for n, p in model.hf.named_parameters() if p.requires_grad]
    differ = [n for n, p in named if (n in decay) != (p.dim() >= 2)]
    if differ:  # cse_models decays the matrices only
        raise UserError(f"Trainer's weight-decay grouping differs from cse_models' (matrices) at {differ[:3]}")
    groups = [[(n, p) for n, p in named if n in decay], [(n, p) for n, p in named if n not in decay]]
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g) for g in groups]:
        raise UserError(f"its optimizer groups hold {[len(g['params']) for g in saved['param_groups']]} parameters, "
                         f"Trainer's grouping of this model {[len(g) for g in groups]}")
    state = {}
    for group, ours in zip(saved["param_groups"], groups):
        for index, (name, param) in zip(group["params"], ours):
            found = saved["state"].get(index)
            if found is None:
                continue
            if not isinstance(found, dict) or any(not isinstance(found.get(k), torch.Tensor)
                                                  or tuple(found[k].shape) != tuple(param.shape)
                                                  for k in ("exp_avg", "exp_avg_sq")):
                shapes = {k: tuple(found[k].shape) for k in ("exp_avg", "exp_avg_sq")
                          if isinstance(found, dict) and isinstance(found.get(k), torch.Tensor)}
                raise UserError(f"its state for {name} has shapes {shapes}, the parameter {tuple(param.shape)}")
            state["hf." + name] = found
    return state


def branch(checkpoint, out_dir, sparse: dict | None, cfg: TrainConfig, state: RunState) -> Path:
    """Start the run ``cfg`` (``out_dir``) from ``checkpoint`` as its run left it: the model (with
    ``sparse``'s layers listed, 0 experts, converted by :func:`~cse_models.train.train` at
    ``state.step``), its AdamW state and its schedule at ``state.step``. ``cfg`` must hold the
    run's :data:`SCHEDULE` fields. Does nothing when ``out_dir`` has checkpoints already."""
    if state.writer == "cse-train":
        return branch_from(checkpoint, out_dir, sparse=sparse)
    if latest_checkpoint(out_dir) is not None:
        return latest_checkpoint(out_dir)
    checkpoint = Path(checkpoint)
    model = load_any_model(checkpoint, sparse)
    try:
        adam = _trainer_adam(checkpoint, model)
    except ValueError as err:  # run_state checked it: the checkpoint changed since
        raise UserError(f"branch: {checkpoint}: {' '.join(str(err).split())[:200]}") from None
    opt = make_optimizer(model, cfg)
    for group in opt.param_groups:
        group["initial_lr"] = cfg.lr
    carry_optimizer_state(adam, model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg), last_epoch=state.step - 1)
    target = Path(out_dir) / "checkpoints" / f"step-{state.step:06d}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        save_checkpoint(target, model, opt, sched, state.step, cfg)
    log.info("run %s starts from the Trainer checkpoint %s (step %d; %d parameters' AdamW state)", out_dir,
             checkpoint, state.step, len(adam))
    return target


