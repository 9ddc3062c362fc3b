"""Training: dense warm-up, CSE conversion, baselines, checkpoints, exact resume, DDP.

Run from a config file (JSON or YAML)::

    cse-train run.json                      # or: python -m cse_models.train run.json
    torchrun --nproc_per_node 2 -m cse_models.train run.json   # data-parallel (gloo on CPU, NCCL on GPU)

AdamW with linear warm-up and cosine decay, gradient clipping, bf16 autocast on GPU.
Batches depend only on (seed, step), so a run resumed from its last checkpoint, and a
data-parallel run on the same global batch, follow the uninterrupted single-process
run. A checkpoint (every ``checkpoint_every`` steps, all kept for later analysis) is a
directory ``checkpoints/step-NNNNNN`` with ``config.json`` + ``model.safetensors``,
``optimizer.safetensors`` and ``trainer_state.json`` (step, scheduler, RNG state):
nothing is pickled. Metrics go to ``metrics.jsonl`` (every step), ``metrics.csv`` (one row
per logging step) and TensorBoard event files (:mod:`cse_models.metrics`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from cse_models.checkpointing import (carry_optimizer_state, latest_checkpoint, load_optimizer_state, param_names,
                                      resume_point, save_checkpoint)
from cse_models.config import GPTConfig
from cse_models.cse import convert_to_cse, upcycle
from cse_models.data import (Blocks, global_batch, make_blocks, mask_tokens, pack_blocks, step_generator,
                             text_file_blocks)
from cse_models.hf import SECTION, load_any_model
from cse_models.metrics import MetricsLog
from cse_models.model import build_model
from cse_models.routes import load_routes_for
from cse_models.validation import ValidationLog
from cse_models.train_config import DataConfig, TrainConfig, apply_plan, check_plan, warmup_after  # noqa: F401 (re-exported)
from ntkscope.core.checks import InputError, MissingInput, UserError
from ntkscope.core.files import DirectoryLock, write_json
from ntkscope.core.lm import lm_loss as token_loss
from ntkscope.core.memory import training_thresholds
from ntkscope.core.progress import logging_redirect_tqdm, progress_bar
from ntkscope.core.requests import differences, listed
from ntkscope.gc.tracker import GCTracker, Probes
from ntkscope.kernel.options import KernelOptions, checked_device
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.inputs import DataSource
from ntkscope.text.tokenization import load_tokenizer
from ntkscope.text.trained_with import tokenizer_near

log = logging.getLogger("cse_models.train")


# ---- pieces -----------------------------------------------------------------------------------


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then ``cfg.lr_schedule``'s decay to ``min_lr_ratio`` at ``steps``
    (cosine, linear, or none: constant); after ``steps``, ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    shape = 1 - progress if cfg.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=tuple(cfg.betas))


def lm_loss(model, ids: torch.Tensor, domains: torch.Tensor, step: int, cfg: TrainConfig,
            special_ids=(), mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and the number of predicted tokens: next token (GPT) or masked tokens
    (BERT). ``mask`` (B, T): the rows' tokens (True) and padding (False; never attended to,
    predicted or masked); None: every position a token."""
    config = model.module.config if hasattr(model, "module") else model.config
    attention = None if mask is None else mask.long()
    if config.model_type == "bert":
        inputs, labels = mask_tokens(ids.cpu(), mask_token_id=config.mask_token_id, vocab_size=config.vocab_size,
                                     generator=step_generator(cfg.seed, step, "mask"), special_ids=special_ids)
        inputs, labels = inputs.to(ids.device), labels.to(ids.device)
        if mask is not None:
            labels = labels.masked_fill(~mask, -100)
        logits = model(inputs, attention, domains)
        keep = labels != -100
        return token_loss(logits.float(), labels, keep, reduction="sum"), keep.sum()
    targets = ids[:, 1:]  # causal_pairs without the last position's logits
    if mask is None:
        loss_sum = model(ids, None, domains, positions=slice(None, -1), targets=targets)
        return loss_sum, torch.tensor(targets.numel(), device=ids.device)
    keep = mask[:, 1:] & mask[:, :-1]  # a token predicted from a token
    logits = model(ids, attention, domains, positions=slice(None, -1))
    return token_loss(logits if logits.dtype == torch.float64 else logits.float(), targets, keep,
                      reduction="sum"), keep.sum()


# ---- the run --------------------------------------------------------------------------------


_PACK_BLOCKS: dict = {}  # (pack or table identity, tokenizer, split/columns, seq_len, ...) -> (blocks, tokenizer)


def load_data(cfg: TrainConfig, split: str | None = None):
    """(blocks, tokenizer) from ``cfg.data``: a corpus pack (default: the shipped one), text files
    or a table; with ``data.routes`` (a :class:`~cse_models.routes.Routes` file) each block is
    labelled by its expert instead of its domain."""
    blocks, tokenizer = _load_blocks(cfg, split)
    return load_routes_for(cfg.data.routes, blocks, split or cfg.data.split), tokenizer


def _load_blocks(cfg: TrainConfig, split: str | None = None):
    data = cfg.data
    seq_len = data.seq_len
    if data.table:
        return _table_blocks(data, cfg.init_from, seq_len)
    if data.text_files:
        tokenizer = load_tokenizer(data.tokenizer)
        return text_file_blocks(data.text_files, tokenizer, seq_len, layout=data.layout), tokenizer
    pack = load_pack(data.pack)
    split = split or data.split
    domains = None if data.domains is None else tuple(data.domains)
    key = (str(pack.path), pack.manifest.get("version"), data.tokenizer, split, seq_len, domains, data.layout)
    if key not in _PACK_BLOCKS:  # a reproduction trains dozens of runs on the same blocks: tokenize once
        tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else pack.tokenizer()
        _PACK_BLOCKS[key] = (pack_blocks(pack, tokenizer, split, seq_len, domains, layout=data.layout), tokenizer)
    return _PACK_BLOCKS[key]


def _table_blocks(data: DataConfig, init_from: str | None, seq_len: int):
    """Blocks from the user's rows (a JSONL / CSV / TSV / Parquet table or a ``datasets``
    directory, read as ``ntkscope --data`` reads it): one token stream per label of
    ``label_column`` (or one domain, "text"), tokenized by ``data.tokenizer`` or the tokenizer
    that ships with ``init_from`` (in its directory or beside it)."""
    spec = data.tokenizer
    if not spec and init_from:  # the one init_from goes with (in its directory, its run, or beside it)
        near = tokenizer_near(init_from)
        spec = near.name if near is not None else None
    if not spec:
        raise UserError("TrainConfig: data.table needs data.tokenizer, or an init_from with a tokenizer.json in it or "
                        "beside it (a run of stepN checkpoints)")
    source = DataSource(Path(data.table), text_column=data.text_column, label_column=data.label_column)
    if not source.path.exists():
        raise MissingInput(f"TrainConfig: data.table {source.path} does not exist")
    stat = source.path.stat()
    key = ("table", str(source.path.resolve()), stat.st_size, stat.st_mtime_ns, source.text_column,
           source.label_column, str(spec), seq_len, data.layout)
    if key in _PACK_BLOCKS:  # a comparison trains several arms on the same rows: tokenize once
        return _PACK_BLOCKS[key]
    by_domain: dict[str, list] = {}
    for text, label in source.rows():
        by_domain.setdefault(label if data.label_column else "text", []).append(text)
    tokenizer = load_tokenizer(spec)
    _PACK_BLOCKS[key] = (make_blocks(by_domain, tokenizer, seq_len, layout=data.layout), tokenizer)
    return _PACK_BLOCKS[key]


def _device(cfg: TrainConfig, rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        return checked_device(cfg.device)
    except InputError as err:
        raise UserError(f"TrainConfig: {err} (or 'auto')") from None


def _build_model(cfg: TrainConfig, vocab_size: int):
    if cfg.init_from:
        config = Path(cfg.init_from) / "config.json"
        is_hf = config.is_file() and "architectures" in json.loads(config.read_text(encoding="utf-8"))
        if is_hf and set(cfg.model) - {"sparse"}:
            raise UserError(f"TrainConfig: with an HF init_from, model may hold only sparse (the architecture is the "
                            f"checkpoint's; got {sorted(cfg.model)})")
        if is_hf and SECTION not in json.loads(config.read_text(encoding="utf-8")):
            model = load_any_model(cfg.init_from, cfg.model.get("sparse"))
            log.info("continuing from the HF model %s, sparse layers %s", cfg.init_from, cfg.model.get("sparse"))
        else:
            model = load_any_model(cfg.init_from)
            log.info("continuing from %s (domain finetuning)", cfg.init_from)
        if model.config.model_type == "bert" and model.config.mask_token_id is None:
            raise UserError(f"TrainConfig: init_from {cfg.init_from} is a masked LM whose mask token is unknown: put its "
                            "tokenizer.json (with [MASK] or <mask>) beside the weights, or mask_token_id in config.json")
        return model
    spec = dict(cfg.model)
    spec.setdefault("vocab_size", vocab_size)
    spec.setdefault("block_size", cfg.data.seq_len)
    return build_model(GPTConfig.from_dict(spec), "TrainConfig: model")


def fitting_sample(n_blocks: int, n: int, seed: int) -> torch.Tensor:
    """The indices (min(n, n_blocks),) of the training blocks a CSE conversion clusters: a
    seeded draw without replacement, the same for every run with this ``seed``."""
    return torch.randperm(n_blocks, generator=step_generator(seed, 0, "cse"))[:min(n, n_blocks)]


def _convert(model, blocks: Blocks, cfg: TrainConfig, device) -> None:
    idx = fitting_sample(len(blocks), cfg.cse.n_samples, cfg.seed)
    start = time.perf_counter()
    mask = None if blocks.mask is None else blocks.mask[idx].long().to(device)
    convert_to_cse(model, blocks.input_ids[idx].to(device), mask, seed=cfg.seed, **cfg.cse.router_options())
    log.info("CSE conversion: %d sequences embedded and clustered in %.1f s", len(idx), time.perf_counter() - start)


def convert_mid_run(model, opt, sched, blocks: Blocks, cfg: TrainConfig, device):
    """The architecture change at the warm-up: CSE's conversion (its router fitted on the fitting
    sample of ``blocks``) or Switch / DEMix upcycling, in place on ``model``; then a new optimizer
    over the new parameters, carrying each old parameter's AdamW state to its copies, and the
    schedule continued where it was. Returns (optimizer, scheduler)."""
    sparse = model.config.sparse
    names = param_names(model)
    old = {names[id(p)]: state for p, state in opt.state.items()}
    if sparse.kind == "cse":
        _convert(model, blocks, cfg, device)
    else:
        upcycle(model, cfg.upcycle.n_experts, preserving=cfg.upcycle.preserving)
    model.to(device)
    new_opt = make_optimizer(model, cfg)
    carry_optimizer_state(old, model, new_opt)
    new_sched = torch.optim.lr_scheduler.LambdaLR(new_opt, lambda s: lr_factor(s, cfg))
    new_sched.load_state_dict(sched.state_dict())
    for group, lr in zip(new_opt.param_groups, new_sched.get_last_lr()):
        group["lr"] = lr
    return new_opt, new_sched


#: TrainConfig fields a resumed run may change: where it stops and runs, how it saves and logs
#: (every other field decides the weights, and a change to one is refused: :func:`_check_rerun`)
RESUMABLE_CHANGES = ("out_dir", "stop_at", "device", "bf16", "checkpoint_every", "checkpoint_steps", "log_every",
                     "eval_every", "tensorboard", "track")
#: what a training writes into its out_dir (``force`` removes these, and nothing else there)
RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.csv", "validation.csv", "tensorboard", "track",
             "train_config.json")


def _check_rerun(cfg: TrainConfig, out_dir: Path, force: bool) -> None:
    """A run in ``out_dir`` that holds weights resumes only under the config it recorded (bar
    :data:`RESUMABLE_CHANGES`); ``force`` deletes what the old run wrote and starts over."""
    recorded = out_dir / "train_config.json"
    if force:
        for name in RUN_FILES:
            path = out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        return
    if recorded.is_file() and latest_checkpoint(out_dir) is not None:
        try:
            have = json.loads(recorded.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            have = {}
        try:  # a field added since the run was recorded takes its default, as the run's own code had it
            have = asdict(TrainConfig.from_record(have))
        except (ValueError, TypeError):
            pass
        changed = differences(have, asdict(cfg), ignore=RESUMABLE_CHANGES)
        if changed:
            raise UserError(f"train: out_dir {out_dir} holds a run trained with another config ("
                            f"{listed(changed)}); "
                            "use another out_dir, or --force (train(..., force=True)) to start over")


def train(cfg: TrainConfig, *, callbacks=(), force: bool = False) -> Path:
    """Run (or resume) the training that ``cfg`` describes; returns the last checkpoint's directory.

    ``callbacks``: functions ``(step, metrics, model)`` called after each step (step = steps done,
    after that step's checkpoint is written: ``model`` holds the checkpoint's weights; ``metrics``
    also holds the batch's ``domains``), e.g. an :class:`ntkscope.GCTracker` or an
    :class:`ntkscope.InRunTracker`; a callback's ``begin(model)``, if it has one, is called before
    the first step, its ``close()`` after the last. ``cfg.track`` adds a tracker that writes
    ``OUT/track/gc.csv``.
    One process writes a run: the first rank holds ``out_dir``'s lock, and a second training
    into the same directory is refused with the holder's PID. A run that holds checkpoints resumes
    only under the config it recorded (``train_config.json``), bar where it stops, runs, saves and
    logs (:data:`RESUMABLE_CHANGES`); any other change is refused in one line naming the fields,
    and ``force`` deletes what the old run wrote (:data:`RUN_FILES`) and starts over.
    """
    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        raise UserError(f"train: out_dir {cfg.out_dir} exists and is not a directory")
    if int(os.environ.get("RANK", "0")) != 0:
        return _train(cfg, callbacks)
    with DirectoryLock(cfg.out_dir, "train"):
        _check_rerun(apply_plan(cfg), Path(cfg.out_dir), force)
        return _train(cfg, callbacks)


def _train(cfg: TrainConfig, callbacks) -> Path:
    cfg = apply_plan(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    distributed = world > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo")
    if cfg.batch_size % world:
        raise UserError(f"train: batch_size must divide among the {world} processes (got {cfg.batch_size})")
    device = _device(cfg, rank)
    out_dir = Path(cfg.out_dir)
    blocks, tokenizer = load_data(cfg)
    if len(blocks) < cfg.batch_size:
        raise UserError(f"train: the corpus is too small for the batch: {len(blocks)} blocks of "
                        f"{cfg.data.seq_len} tokens, batch_size={cfg.batch_size}")
    torch.manual_seed(cfg.seed)
    resume, model, opt_tensors, trainer_state = resume_point(out_dir)
    model = model if resume else _build_model(cfg, tokenizer.vocab_size)
    model.to(device).train()
    if model.config.vocab_size < tokenizer.vocab_size:
        raise UserError(f"train: the model's vocab_size {model.config.vocab_size} is below the tokenizer's "
                        f"{tokenizer.vocab_size}")
    check_plan(cfg, model, tokenizer)
    callbacks = [*callbacks, *([_tracker(cfg, tokenizer, world)] if cfg.track and rank == 0 else [])]
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    start = load_optimizer_state(resume, model, opt, sched, opt_tensors, trainer_state) if resume else 0
    if resume:
        _check_finite(model, f"train: {resume} holds non-finite weights; resume from an earlier checkpoint (delete "
                             "this one)")
        log.info("resuming from %s (step %d)", resume, start)
    sparse = model.config.sparse
    upcyclable = sparse is not None and sparse.kind in ("switch", "demix")
    if cfg.upcycle and (not upcyclable or (sparse.kind == "switch" and not cfg.upcycle.n_experts)):
        raise UserError(f"train: upcycle needs a Switch or DEMix model (n_experts 0 until then) and upcycle = "
                        f"{{convert_at: STEP, n_experts: K >= 1 (Switch)}} (got sparse "
                        f"{None if sparse is None else sparse.kind!r}, upcycle {asdict(cfg.upcycle)!r})")
    if upcyclable and not cfg.upcycle and sparse.experts_at(sparse.layers[0]) == 0:
        raise UserError(f"train: a {sparse.kind} model with n_experts 0 is dense until upcycled; give upcycle = "
                        "{convert_at: STEP, n_experts: K} or n_experts >= 1")
    if sparse is not None and sparse.kind == "demix" and list(sparse.domains) != list(blocks.domain_names):
        raise UserError(f"train: a DEMix model's domains must be the data's domains in order "
                        f"{list(blocks.domain_names)} (expert j serves domain label j; got {sparse.domains!r})")
    if cfg.cse.n_clusters is not None and sparse is not None and sparse.kind == "cse" and (
            len(cfg.cse.n_clusters) != len(sparse.layers) or cfg.cse.rule != "hdbscan"):
        raise UserError(f"train: cse.n_clusters needs one count per sparse layer {list(sparse.layers)} and rule "
                        f"'hdbscan' (got {cfg.cse.n_clusters!r} with rule {cfg.cse.rule!r})")
    convert_at = (cfg.cse.convert_at if sparse is not None and sparse.kind == "cse" else
                  cfg.upcycle.convert_at if upcyclable else None)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "train_config.json", asdict(cfg))
    metrics_log = MetricsLog(out_dir, start, write=rank == 0, tensorboard=cfg.tensorboard)
    validation = None
    if cfg.eval_every and rank == 0:
        if cfg.data.table or cfg.data.text_files:
            raise UserError(f"train: eval_every={cfg.eval_every} needs a corpus pack's validation split (data.pack, or "
                            "the shipped pack); data.table and data.text_files have none")
        packed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, layout="packed"))  # scored whole
        validation = ValidationLog(out_dir, load_data(packed, "validation")[0], start,
                                   special_ids=tuple(tokenizer.special_ids))

    def wrap(m):
        if not distributed:
            return m
        return torch.nn.parallel.DistributedDataParallel(
            m, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=m.config.sparse is not None)

    net = wrap(model)
    per_rank = cfg.batch_size // world
    special = tuple(tokenizer.special_ids)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and cfg.bf16)
    last = None
    end = cfg.stop_at or cfg.steps
    bar = progress_bar(end, "train", "step", initial=start, hidden=rank != 0)
    for callback in callbacks:
        if hasattr(callback, "begin"):  # e.g. ntkscope.InRunTracker hooks the model before its first step
            callback.begin(model)
    training_thresholds()  # after an analysis earlier in this process (ntkscope reproduce): a training loop's malloc
    for step in range(start, end):
        if convert_at is not None and step == convert_at and sparse.experts_at(sparse.layers[0]) == 0:
            opt, sched = convert_mid_run(model, opt, sched, blocks, cfg, device)
            net = wrap(model)
        idx = global_batch(blocks, step, cfg.batch_size, cfg.seed)[rank * per_rank:(rank + 1) * per_rank]
        ids, doms = blocks.input_ids[idx].to(device), blocks.domains[idx].to(device)
        mask = None if blocks.mask is None else blocks.mask[idx].to(device)
        with autocast:
            loss_sum, count = lm_loss(net, ids, doms, step, cfg, special, mask)
        total = count.to(torch.float64)
        if distributed:
            dist.all_reduce(total)
        aux = model.aux_loss()
        objective = loss_sum * (world / total.to(loss_sum.dtype)) + aux
        opt.zero_grad(set_to_none=True)
        objective.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        lr = opt.param_groups[0]["lr"]  # the rate this step used
        opt.step()
        sched.step()
        model.update_routers()
        loss_all = loss_sum.detach().to(torch.float64)
        if distributed:
            dist.all_reduce(loss_all)
        loss = float(loss_all / total)
        if not math.isfinite(loss):  # diverged: stop here; the checkpoints so far hold finite weights
            raise UserError(f"train: the loss is not finite at step {step + 1} ({loss}); training stopped, the last "
                            f"checkpoint is {last or latest_checkpoint(out_dir) or 'none'}; lower lr (now {cfg.lr})")
        metrics = {"step": step + 1, "loss": loss, "ppl": math.exp(min(loss, 50.0)), "lr": lr,
                   "aux": float(aux.detach()), "grad_norm": None if norm is None else float(norm)}
        done = step + 1
        logging_step = done % cfg.log_every == 0 or done == end
        if logging_step:
            by_domain = model.routing_domains()
            if by_domain:
                metrics["load_domains"] = by_domain
            metrics["load"] = model.routing_load()
        metrics_log.step(metrics, (ids.numel() if mask is None else int(mask.sum())) * world)
        bar.update(1)
        if logging_step:
            row = metrics_log.row(metrics["load"])
            bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
            if rank == 0:
                log.info("step %d/%d loss %.4f ppl %.1f lr %.2e | %.0f tokens/s%s", done, cfg.steps, row["loss"],
                         row["ppl"], row["lr"], row["tokens_per_s"],
                         f" | load {metrics['load']}" if metrics["load"] else "")
        if rank == 0:
            if done % cfg.checkpoint_every == 0 or done == end or done in cfg.checkpoint_steps:
                _check_finite(model, f"train: the weights are not finite after step {done}; training stopped, the "
                              f"last checkpoint is {last or latest_checkpoint(out_dir) or 'none'}")
                last = save_checkpoint(out_dir / "checkpoints" / f"step-{done:06d}", model, opt, sched, done, cfg)
        if validation is not None and (done % cfg.eval_every == 0 or done == end):
            validation.score(model, done, lr)
        if callbacks:  # a callback may read the batch's domains (ntkscope.InRunTracker)
            metrics["domains"] = [blocks.domain_names[d] for d in doms.tolist()]
        for callback in callbacks:
            callback(done, metrics, model)
    bar.close()
    for callback in callbacks:
        if hasattr(callback, "close"):
            callback.close()
    metrics_log.close()
    if distributed:
        dist.barrier()
    return last if last is not None else latest_checkpoint(out_dir)


def _tracker(cfg: TrainConfig, tokenizer, world: int):
    """The :class:`ntkscope.GCTracker` that ``cfg.track`` describes, writing to ``OUT/track``."""
    track = cfg.track
    if world > 1:
        raise UserError(f"train: track runs in a single process (got {world}); train without torchrun, or measure "
                        "the checkpoints afterwards with ntkscope gc RUN_DIR")
    if track.data is not None:
        data = track.data
    elif cfg.data.table:
        data = DataSource(Path(cfg.data.table), text_column=cfg.data.text_column, label_column=cfg.data.label_column)
    elif cfg.data.text_files:
        raise UserError("train: track.data must name the probe sentences when training on data.text_files")
    else:
        data = cfg.data.pack or "default"
    probes = Probes.load(data, tokenizer, n=track.n, seq_len=track.seq_len or cfg.data.seq_len, seed=track.seed,
                         by=track.by, gc=track.grouping)
    return GCTracker(probes, every=track.every, out=Path(cfg.out_dir) / "track", per_layer=track.per_layer,
                     options=KernelOptions(output=track.output, method=track.method), resampling=track.resampling,
                     tensorboard=cfg.tensorboard)


def _check_finite(model, message: str) -> None:
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise UserError(f"{message} ({len(bad)} tensors, first {bad[0]})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cse-train", description="Train a GPT/BERT (dense, CSE, Switch or DEMix) "
                                     "from a config file; resumes from the last checkpoint in out_dir.")
    parser.add_argument("config", help="JSON or YAML TrainConfig")
    parser.add_argument("--out-dir", help="override out_dir")
    parser.add_argument("--steps", type=int, help="override steps")
    parser.add_argument("--force", action="store_true", help="out_dir holds a run of another config: delete what "
                        "it wrote (checkpoints, metrics, train_config.json) and start over")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = {k: v for k, v in (("out_dir", args.out_dir), ("steps", args.steps)) if v is not None}
        cfg = TrainConfig.load(args.config, **overrides)  # checked with the overrides (--steps 2 over steps: 0)
        with logging_redirect_tqdm():  # log lines print above the progress bar
            last = train(cfg, force=args.force)
    except UserError as err:
        print(f"cse-train: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # checkpoints are written whole (temporary name, then renamed)
        print("cse-train: interrupted; run the same command again to resume from the last checkpoint", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"last checkpoint: {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
