"""The models of a reproduction, trained with :mod:`cse_models.train` (checkpointed and
resumable): the dense GPT, its domain-finetuned copies, Switch, and CSE branched from the
dense run at the planned warm-up. Each lives in ``RUN/models/NAME``."""

from __future__ import annotations

import logging
from pathlib import Path

from cse_models.train import TrainConfig, branch_from, latest_checkpoint, train
from ntkscope.reproduction.settings import ReproduceSettings

log = logging.getLogger(__name__)


def _config(settings: ReproduceSettings, out_dir: Path, pack: str | None, **changes):
    spec = dict(out_dir=str(out_dir), model=dict(settings.model),
                data={"pack": pack, "seq_len": settings.seq_len}, steps=settings.steps,
                batch_size=settings.batch_size, lr=settings.lr, warmup_steps=settings.warmup_steps,
                checkpoint_every=settings.checkpoint_every, log_every=50, seed=settings.seed, device=settings.device)
    spec.update(changes)
    return TrainConfig.from_dict(spec)


def _finished(cfg) -> Path | None:
    last = latest_checkpoint(Path(cfg.out_dir))
    return last if last is not None and last.name == f"step-{cfg.steps:06d}" else None


def _run(cfg) -> Path:
    done = _finished(cfg)
    if done is not None:
        return done
    log.info("training %s (%d steps)", cfg.out_dir, cfg.steps)
    return train(cfg)


def train_dense(settings: ReproduceSettings, out_dir: Path, pack: str | None) -> Path:
    """The dense GPT; returns its last checkpoint (all kept: the analyses walk them), with the
    early checkpoints every ``early_every`` steps through ``early_until``."""
    early = list(range(settings.early_every, settings.early_until + 1, settings.early_every)) \
        if settings.early_every else []
    return _run(_config(settings, out_dir, pack, checkpoint_steps=early))


def train_switch(settings: ReproduceSettings, out_dir: Path, pack: str | None, layers: list) -> Path:
    """Switch (learned top-1 token routing) at ``layers``, from scratch."""
    k = settings.switch_experts
    model = {**settings.model, "sparse": {"kind": "switch", "module": "ffn", "layers": list(layers),
                                          "n_experts": [k] * len(layers)}}
    return _run(_config(settings, out_dir, pack, model=model, checkpoint_every=settings.steps))


def train_cse(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, layers: list,
              warmup: int) -> Path:
    """CSE (MoF) at ``layers``: the dense run's checkpoint at ``warmup`` is copied with a CSE
    spec, so the warm-up is shared exactly; clusters are found there and training goes on."""
    sparse = {"kind": "cse", "module": "ffn", "layers": list(layers), "n_experts": [0] * len(layers),
              "proj_dim": settings.proj_dim}
    cse = {"warmup_steps": int(warmup), "n_samples": settings.cse_samples, "eps": None,
           "min_samples": settings.min_samples, "max_experts": settings.max_experts, "on_no_cluster": "single"}
    cfg = _config(settings, out_dir, pack, model={**settings.model, "sparse": sparse}, cse=cse,
                  checkpoint_every=settings.steps)
    if _finished(cfg) is None:
        branch_from(Path(dense_dir) / "checkpoints" / f"step-{int(warmup):06d}", out_dir, sparse=sparse)
    return _run(cfg)


def train_finetuned(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_last: Path,
                    domain: str) -> Path:
    """The dense model, continued on one long-tail ``domain`` only (the paper's "*/legal", "*/med")."""
    steps = settings.finetune_steps
    return _run(_config(settings, out_dir, pack, init_from=str(dense_last),
                        data={"pack": pack, "seq_len": settings.seq_len, "domains": [domain]}, steps=steps,
                        lr=settings.finetune_lr, warmup_steps=max(1, steps // 10), checkpoint_every=steps))
