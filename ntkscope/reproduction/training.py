"""The models of a reproduction, trained with :mod:`cse_models.train` (checkpointed and
resumable): the dense model (GPT, or BERT with ``arch``), its domain-finetuned copies, and,
branched from the dense run at the planned warm-up, CSE (MoF or MoA), Switch and DEMix (both
upcycled) and the dense continuation, one per seed. Each lives in ``RUN/models/NAME``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

from cse_models.checkpointing import branch_from, latest_checkpoint
from cse_models.config import GPTConfig
from cse_models.train import TrainConfig, train
from ntkscope.core.files import sha256_file, write_json
from ntkscope.reproduction.settings import ReproduceSettings
from ntkscope.text.corpus.pack import load_pack

log = logging.getLogger(__name__)


def arch_model(settings: ReproduceSettings, arch: str, mask_token_id: int | None = None) -> dict:
    """The GPTConfig fields of the settings' model as a ``"gpt"`` (causal) or ``"bert"`` (masked,
    ``mask_token_id`` the tokenizer's mask) language model."""
    if arch == "bert":
        return {**settings.model, "model_type": "bert", "mask_token_id": mask_token_id}
    return {**settings.model, "model_type": "gpt"}


#: TrainConfig fields that say where and how often a run saves and logs, not what it trains
BOOKKEEPING = ("out_dir", "checkpoint_every", "checkpoint_steps", "log_every", "eval_every", "tensorboard", "track")


def _config(settings: ReproduceSettings, out_dir: Path, pack: str | None, **changes):
    spec = dict(out_dir=str(out_dir), model=dict(settings.model),
                data={"pack": pack, "seq_len": settings.seq_len}, steps=settings.steps,
                batch_size=settings.batch_size, lr=settings.lr, warmup_steps=settings.warmup_steps,
                checkpoint_every=settings.checkpoint_every, log_every=50, eval_every=settings.eval_every,
                seed=settings.seed, device=settings.device)
    spec.update(changes)
    return TrainConfig.from_dict(spec)


def _trajectory(cfg: dict) -> dict:
    """What a run trains, from its TrainConfig fields: every field but :data:`BOOKKEEPING`, with the
    model's fields completed by :class:`GPTConfig`'s defaults (so ``model_type`` said or not compares
    equal) and the corpus pack named by its version (the shipped pack by None or by its path alike)."""
    full = dataclasses.asdict(TrainConfig.from_record(cfg))  # every section with its defaults, old files alike
    kept = {k: v for k, v in full.items() if k not in BOOKKEEPING}
    if "pack" in kept["data"]:
        kept["data"] = {**kept["data"], "pack": load_pack(kept["data"]["pack"], verify=False).manifest.get("version")}
    kept["model"] = GPTConfig.from_dict({k: v for k, v in cfg["model"].items() if k != "vocab_size"}).to_dict()
    kept["model"]["vocab_size"] = cfg["model"].get("vocab_size")
    return json.loads(json.dumps(kept))


def _adopt(cfg: TrainConfig, adopt_from: str, start: Path | None = None) -> Path | None:
    """A finished run in ``adopt_from`` (a directory of model directories, e.g. a sweep's
    RUN/models) that trained exactly what ``cfg`` would (:func:`_trajectory` equal, every
    checkpoint ``cfg`` asks for present, and for a branch, ``start``'s weights the same as the
    source's first checkpoint, byte for byte), linked into ``cfg.out_dir`` (hard links: nothing copied,
    the source untouched) with ``adopted.json`` saying from where; its last checkpoint, or None."""
    if not adopt_from or Path(cfg.out_dir).exists() and any(Path(cfg.out_dir).iterdir()):
        return None
    wanted = _trajectory(dataclasses.asdict(cfg))
    final = f"step-{cfg.stop_at or cfg.steps:06d}"
    for source in sorted(p for p in Path(adopt_from).iterdir() if (p / "train_config.json").is_file()):
        have = json.loads((source / "train_config.json").read_text())
        steps = {p.name for p in (source / "checkpoints").glob("step-*")}
        needed = {final, *(f"step-{s:06d}" for s in cfg.checkpoint_steps)}
        if _trajectory(have) != wanted or not needed <= steps:
            continue
        if start is not None and not _same_weights(start, source / "checkpoints" / start.name):
            continue
        out = Path(cfg.out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".adopting")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, copy_function=os.link, ignore=shutil.ignore_patterns("analysis", ".ntkscope.lock"))
        write_json(tmp / "adopted.json", {"source": str(source), "compared": "every TrainConfig field but "
                                          + ", ".join(BOOKKEEPING), "checkpoint": final})
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        log.info("%s: the same training as %s (configuration compared field by field): linked, not trained again",
                 out, source)
        return out / "checkpoints" / final
    return None


def _finished(cfg) -> Path | None:
    last = latest_checkpoint(Path(cfg.out_dir))
    return last if last is not None and last.name == f"step-{cfg.stop_at or cfg.steps:06d}" else None


def _same_weights(a: Path, b: Path) -> bool:
    files = [p / "model.safetensors" for p in (a, b)]
    return all(f.is_file() for f in files) and sha256_file(files[0]) == sha256_file(files[1])


def _run(cfg: TrainConfig, adopt_from: str = "", callbacks=()) -> Path:
    """``cfg``'s last checkpoint: found, adopted (:func:`_adopt`) or trained (with ``callbacks``)."""
    done = _finished(cfg) or _adopt(cfg, adopt_from)
    if done is not None:
        return done
    log.info("training %s (%d steps)", cfg.out_dir, cfg.steps)
    return train(cfg, callbacks=callbacks)


def train_dense(settings: ReproduceSettings, out_dir: Path, pack: str | None, *, seed: int | None = None,
                base: dict | None = None, checkpoints: tuple = (), callbacks=(), init_from=None) -> Path:
    """The dense model (``base``: its fields, default ``settings.model``, a GPT) from scratch with
    init and data order ``seed`` (default the settings'), or ``init_from`` (an HF model directory:
    its architecture and weights, trained with data order ``seed``); returns its last checkpoint (all kept:
    the analyses walk them), with the early checkpoints every ``early_every`` steps through
    ``early_until`` and at ``checkpoints``; ``callbacks`` run when it trains (not when found)."""
    early = list(range(settings.early_every, settings.early_until + 1, settings.early_every)) \
        if settings.early_every else []
    return _run(_config(settings, out_dir, pack, checkpoint_steps=sorted({*early, *checkpoints}),
                        model=dict(base or settings.model), seed=settings.seed if seed is None else seed,
                        init_from=None if init_from is None else str(init_from)),
                settings.adopt_from, callbacks)


def train_scratch(settings: ReproduceSettings, out_dir: Path, pack: str | None, layers: list, experts: list,
                  seed: int, checkpoint_every: int | None = None) -> Path:
    """A mixture of experts trained from scratch (the sparse-upcycling literature's control):
    Switch layers (learned top-1 token routing, load-balancing loss, the classic softmax gate) at
    ``layers`` with ``experts`` per layer, every expert initialised on its own, and the dense
    model's init, data order ``seed`` and whole schedule; nothing is shared with a trunk."""
    sparse = {"kind": "switch", "module": "ffn", "layers": list(layers), "n_experts": [int(k) for k in experts]}
    return _run(_config(settings, out_dir, pack, model={**settings.model, "sparse": sparse}, seed=seed,
                        checkpoint_every=checkpoint_every or settings.steps), settings.adopt_from)


def _branch(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, warmup: int,
            sparse: dict | None, seed: int, stop_at: int | None = None, base: dict | None = None,
            checkpoint_every: int | None = None, **changes) -> Path:
    """A run that starts from the dense run's checkpoint at ``warmup`` (so the warm-up is shared
    exactly) and trains on the ``settings.steps`` schedule with data order ``seed``, to the end
    or to ``stop_at``; ``base``: the model's fields (default ``settings.model``, a GPT);
    ``checkpoint_every``: intermediate checkpoints to resume from (default: the last step only)."""
    model = {**(base or settings.model), "sparse": sparse}
    cfg = _config(settings, out_dir, pack, model=model, checkpoint_every=checkpoint_every or settings.steps, seed=seed,
                  stop_at=stop_at, **changes)
    start = Path(dense_dir) / "checkpoints" / f"step-{int(warmup):06d}"
    done = _finished(cfg) or _adopt(cfg, settings.adopt_from, start)
    if done is not None:
        return done
    branch_from(start, out_dir, sparse=sparse)
    return _run(cfg)


def train_continued(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, warmup: int,
                    seed: int, stop_at: int | None = None, checkpoint_every: int | None = None) -> Path:
    """The dense model continued from the warm-up with data order ``seed``: the dense baseline of
    one seed of the CSE-against-baselines comparison (seed ``settings.seed`` is the dense run itself),
    or, with another order than the trunk's, the sweep's null arm."""
    return _branch(settings, out_dir, pack, dense_dir, warmup, None, seed, stop_at, None, checkpoint_every)


def train_switch(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, layers: list,
                 warmup: int, seed: int | None = None, stop_at: int | None = None, base: dict | None = None,
                 checkpoint_every: int | None = None, experts: list | None = None,
                 preserving: bool = True) -> Path:
    """Switch (learned top-1 token routing; ``experts`` per layer, default ``switch_experts`` at
    each) at ``layers``, upcycled from the dense run at the warm-up (experts copied from the
    warmed-up FFN, a fresh router): the same shared warm-up and remaining steps as CSE, so the two
    differ only in routing. ``preserving``: the model's function unchanged at conversion
    (:func:`cse_models.cse.upcycle`); False: the classic softmax gate."""
    sparse = {"kind": "switch", "module": "ffn", "layers": list(layers), "n_experts": [0] * len(layers)}
    upcycle = {"convert_at": int(warmup), "n_experts": list(experts) if experts else settings.switch_experts,
               "preserving": bool(preserving)}
    return _branch(settings, out_dir, pack, dense_dir, warmup, sparse, settings.seed if seed is None else seed,
                   stop_at, base, checkpoint_every, upcycle=upcycle)


def train_demix(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, layers: list,
                warmup: int, domains: list, seed: int | None = None, base: dict | None = None,
                checkpoint_every: int | None = None) -> Path:
    """DEMix (Gururangan et al., 2022) at ``layers``' FFN: one expert per domain of ``domains``
    (the data's domain names, in label order), each trained only on its domain's sequences,
    upcycled from the dense run at the warm-up like Switch (the same shared warm-up and steps)."""
    sparse = {"kind": "demix", "module": "ffn", "layers": list(layers), "n_experts": [0] * len(layers),
              "domains": list(domains)}
    return _branch(settings, out_dir, pack, dense_dir, warmup, sparse, settings.seed if seed is None else seed,
                   None, base, checkpoint_every, upcycle={"convert_at": int(warmup)})


def train_cse(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, layers: list,
              warmup: int, seed: int | None = None, stop_at: int | None = None, base: dict | None = None,
              module: str = "ffn", mean_rate: float = 0.0, checkpoint_every: int | None = None,
              shuffled: bool = False, n_clusters: list | None = None) -> Path:
    """CSE on ``module`` ("ffn": MoF, "attn": MoA) at ``layers``: from the dense run at
    ``warmup``; the router is fitted there on ``cse_samples`` training blocks
    (:func:`ntkscope.fit_router` with the settings' rule and representation) and training goes on.
    ``mean_rate``: the router's drift handling (:class:`cse_models.config.SparseConfig`; 0:
    Algorithm 1 as written). ``shuffled``: the cse-shuffled control (routed by a hash of each
    sequence in the clusters' proportions, :func:`cse_models.cse.convert_to_cse`). ``n_clusters``:
    each layer's expert count fixed (e.g. another step's), the rest of the fit as usual."""
    sparse = {"kind": "cse", "module": module, "layers": list(layers), "n_experts": [0] * len(layers),
              "proj_dim": settings.proj_dim, "router_format": 2, "mean_rate": float(mean_rate)}
    cse = {"convert_at": int(warmup), "n_samples": settings.cse_samples, "rule": settings.router_rule,
           "representation": settings.router_representation, "min_cluster_size": settings.min_cluster_size,
           "min_samples": settings.min_samples, "max_experts": settings.max_experts, "on_no_cluster": "single",
           **({"shuffled": True} if shuffled else {}), **({"n_clusters": list(n_clusters)} if n_clusters else {})}
    return _branch(settings, out_dir, pack, dense_dir, warmup, sparse, settings.seed if seed is None else seed,
                   stop_at, base, checkpoint_every, cse=cse)


def train_finetuned(settings: ReproduceSettings, out_dir: Path, pack: str | None, base_last: Path,
                    domain: str, seed: int | None = None) -> Path:
    """A trained model (dense or Switch: ``base_last``, its last checkpoint) continued for
    ``finetune_steps`` on one long-tail ``domain`` only (the paper's "*/legal", "*/med"): every
    tuned row spends the same extra tokens, ``finetune_steps x batch_size x seq_len``."""
    steps = settings.finetune_steps
    return _run(_config(settings, out_dir, pack, init_from=str(base_last),
                        data={"pack": pack, "seq_len": settings.seq_len, "domains": [domain]}, steps=steps,
                        lr=settings.finetune_lr, warmup_steps=max(1, steps // 10), checkpoint_every=steps,
                        seed=settings.seed if seed is None else seed), settings.adopt_from)


def train_routed(settings: ReproduceSettings, out_dir: Path, pack: str | None, dense_dir: Path, layers: list,
                 warmup: int, routes: Path, names: tuple, seed: int, checkpoint_every: int | None = None) -> Path:
    """Experts at ``layers``' FFN routed by a fixed assignment of blocks (a routes file,
    :mod:`cse_models.routes`, e.g. the frozen-encoder router's): DEMix's dispatch with the experts'
    ``names`` as its labels, upcycled from the dense run at the warm-up like DEMix (the same shared
    warm-up and steps); every block goes to the same expert at every layer."""
    sparse = {"kind": "demix", "module": "ffn", "layers": list(layers), "n_experts": [0] * len(layers),
              "domains": list(names)}
    data = {"pack": pack, "seq_len": settings.seq_len, "routes": str(routes)}
    return _branch(settings, out_dir, pack, dense_dir, warmup, sparse, seed, None, None, checkpoint_every,
                   upcycle={"convert_at": int(warmup)}, data=data)
