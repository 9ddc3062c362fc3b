"""A training run's checkpoints: everything to resume exactly (weights, AdamW state, schedule,
RNG), written under a temporary name and renamed; nothing is pickled. ``checkpoints/step-NNNNNN``
holds ``config.json`` + ``model.safetensors``, ``optimizer.safetensors`` and ``trainer_state.json``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from cse_models.config import GPTConfig
from cse_models.hf import SECTION, load_any_model
from ntkscope.core.checks import MissingInput, UserError
from ntkscope.core.files import atomic_path, load_safetensors, read_json_object, strict_json, write_json

log = logging.getLogger(__name__)


def param_names(model) -> dict:
    """{id(parameter): its name in ``model``}."""
    return {id(p): n for n, p in model.named_parameters()}


_EXPERT = ((re.compile(r"\.intermediate\.layer\.experts\.\d+\.out\."), ".output.dense."),
           (re.compile(r"\.layer\.experts\.\d+\.(?:mlp|attn)\."), "."), (re.compile(r"\.experts\.\d+\."), "."))


def expert_source(name: str) -> str:
    """The dense parameter an expert's parameter was copied from: ``X.mlp.layer.experts.j.mlp.Y``
    (an HF block's FFN, :class:`~cse_models.SparseHF`; ``.attn.`` for its attention) or ``X.experts.j.Y`` (cse_models) -> ``X.mlp.Y``
    / ``X.Y``; an HF encoder's output projection ``X.intermediate.layer.experts.j.out.Y`` ->
    ``X.output.dense.Y``; any other name is its own."""
    for pattern, into in _EXPERT:
        if pattern.search(name):
            return pattern.sub(into, name, count=1)
    return name


def carry_optimizer_state(old_state: dict, new_model, new_opt) -> None:
    """Copy AdamW state by parameter name into ``new_opt``; an expert's parameter takes the
    state of the dense parameter it was copied from (:func:`expert_source`)."""
    names = param_names(new_model)
    for group in new_opt.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            source = old_state.get(name) or old_state.get(expert_source(name))
            if source is not None:
                new_opt.state[p] = {k: v.clone() for k, v in source.items()}


def save_checkpoint(directory: Path, model, opt, sched, step: int, cfg) -> Path:
    """Everything to resume exactly, written under a temporary name and renamed."""
    names = param_names(model)
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    tensors = {}
    for p, state in opt.state.items():
        for key, value in state.items():
            tensors[f"{names[id(p)]}::{key}"] = value.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    state = {"step": step, "param_order": order, "param_groups": groups, "scheduler": sched.state_dict(),
             "rng_cpu": torch.get_rng_state().tolist(),
             "rng_cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
             "train_config": asdict(cfg)}
    with atomic_path(directory) as tmp:
        model.save_pretrained(tmp)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "trainer_state.json").write_text(strict_json(state) + "\n")
    return directory


def checkpoints_of(out_dir: Path) -> list[Path]:
    """A run's complete checkpoint directories, oldest first."""
    return sorted(p for p in (Path(out_dir) / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file()
                  and not p.name.endswith(".tmp"))


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = checkpoints_of(out_dir)
    return found[-1] if found else None


def resume_point(out_dir: Path):
    """(checkpoint, model, optimizer tensors, trainer state) of the newest checkpoint that reads
    whole, or (None, None, None, None); a damaged one is reported and the one before it tried."""
    for path in reversed(checkpoints_of(out_dir)):
        try:
            state = read_json_object(path / "trainer_state.json", "resume")
            return path, load_any_model(path), load_safetensors(path / "optimizer.safetensors", "resume"), state
        except (ValueError, FileNotFoundError) as err:
            log.warning("checkpoint %s is damaged (%s); falling back to the one before it", path.name,
                        " ".join(str(err).split()))
    return None, None, None, None


def branch_from(checkpoint: str | Path, out_dir: str | Path, *, sparse: dict | None) -> Path:
    """Start run ``out_dir`` from another run's checkpoint (model, optimizer, schedule, RNG),
    with ``sparse`` as its model's sparse spec: a CSE run that shares a dense run's warm-up
    exactly (``sparse`` kind "cse" with 0 experts per layer, converted at that step by
    :func:`train`). Does nothing when ``out_dir`` has checkpoints already; returns the copy."""
    src, out_dir = Path(checkpoint), Path(out_dir)
    if not (src / "trainer_state.json").is_file():
        raise MissingInput(f"branch_from: {src} is not a training checkpoint (no trainer_state.json)")
    if latest_checkpoint(out_dir) is not None:
        return latest_checkpoint(out_dir)
    config = json.loads((src / "config.json").read_text())
    target = out_dir / "checkpoints" / src.name
    if "architectures" in config or SECTION in config:  # an HF model trained by cse-train
        model = load_any_model(src, sparse) if sparse is not None else None  # refuses a converted one
        with atomic_path(target) as tmp:
            shutil.copytree(src, tmp)
            if model is not None:  # the sparse format, its layers listed with 0 experts (the same tensors)
                (tmp / "config.json").unlink()
                model.save_pretrained(tmp)
        log.info("run %s starts from %s (step %s)", out_dir, src, src.name)
        return target
    if config.get("sparse") is not None:
        raise UserError(f"branch_from: {src} is a sparse model already ({config['sparse']['kind']}); "
                        "branch from a dense checkpoint")
    config["sparse"] = sparse
    GPTConfig.from_dict(config)  # validates the spec against the model
    with atomic_path(target) as tmp:
        shutil.copytree(src, tmp)
        write_json(tmp / "config.json", config)
    log.info("run %s starts from %s (step %s)", out_dir, src, src.name)
    return target


def load_optimizer_state(directory: Path, model, opt, sched, tensors=None, state=None) -> int:
    """Put a checkpoint's optimizer, schedule and RNG state in place; returns its step."""
    state = state if state is not None else read_json_object(directory / "trainer_state.json", "resume")
    tensors = tensors if tensors is not None else load_safetensors(directory / "optimizer.safetensors", "resume")
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        name, slot = key.split("::")
        opt.state[params[name]][slot] = value.to(params[name].device)
    for group, saved in zip(opt.param_groups, state["param_groups"]):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(torch.tensor(state["rng_cpu"], dtype=torch.uint8))
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["rng_cuda"]])
    return int(state["step"])
