"""``ntkscope compare``: from one warm-up checkpoint of the researcher's own model, train the dense
continuation, CSE (the plan's layers, router fitted on their data) and Switch with CSE's expert
count at each layer, upcycled so that the model's function is unchanged at conversion (the gate
renormalised to 1, no token dropped in evaluation: the fair capacity control; Switch adds only its
router, d x experts per layer) and, when the training table has two labels or more, DEMix (one
expert per label, routed by the label in training: the labelled upper bound), each for the same
steps and batches (so the same tokens), per seed; then evaluate every arm on their held-out
data, per domain (DEMix by its label-free mixture): the Tables 1-2 analogue for their model and
data.

Every arm continues the run where the checkpoint left it when the checkpoint keeps that
(:mod:`cse_models.continued`: a ``cse-train`` checkpoint, or a transformers ``Trainer``
``checkpoint-N`` with its optimizer, scheduler and arguments): its AdamW state (an expert takes
the state of the dense weights it was copied from) and its learning-rate schedule from that step,
``steps`` more steps, within the run's schedule. Otherwise, or when ``lr`` is given, every arm
starts a fresh warm-up of ``lr`` (default 1e-3) from the checkpoint, the dense arm too, and the
command says why in one line.

Each (arm, seed) is one ``cse_models.train`` run under ``OUT/runs/ARM-seedK`` and resumes where it
stopped; a finished one is not retrained. ``OUT/comparison.csv``: arm, seed, domain, texts, tokens,
ppl and its interval, and the change against dense of the same seed (``vs_dense``, relative).
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import pandas as pd

from cse_models.continued import RunState, branch, run_batch, run_layout, run_state
from cse_models.data import LAYOUTS
from cse_models.domains import evaluate_domains
from cse_models.hf import load_any_model
from cse_models.checkpointing import latest_checkpoint
from cse_models.train import load_data, train
from cse_models.train_config import TrainConfig, apply_plan, warmup_after
from ntkscope.app.commands import data_files
from ntkscope.core.checks import InputError
from ntkscope.core.files import DirectoryLock, Staging, check_output, digest, write_json, write_table
from ntkscope.core.requests import bind_request
from ntkscope.core.provenance import provenance
from ntkscope.plotting import routing_shares, save_figure
from ntkscope.representation.plan import Plan
from ntkscope.runs.checkpoints import checkpoint_tokenizer, is_run_dir, list_checkpoints, load_checkpoint
from ntkscope.runs.families import family_of
from ntkscope.text.inputs import DataSource, as_source

log = logging.getLogger(__name__)

ARMS = ("dense", "cse", "switch", "demix")  # DEMix only when the training table has two labels or more
REQUEST = "compare.json"  # what OUT was asked to hold (:func:`ntkscope.core.requests.bind_request`)
FRESH_LR = 1e-3  # the peak rate of a fresh warm-up, when the run is not continued and no lr is given


def _config(arm: str, run: Path, common: dict, cse: dict, sparse_layers, switch_experts: int | None,
            domains=(), at: int = 0) -> TrainConfig:
    """Arm ``arm``'s training, converting (or upcycling) at step ``at`` (the branch's first)."""
    zeros = [0] * len(sparse_layers) if isinstance(sparse_layers, list) else [0]
    spec = {"dense": {},
            "cse": {"model": {"sparse": {"kind": "cse", "layers": sparse_layers, "n_experts": zeros}},
                    "cse": {"convert_at": at, **cse}},
            "switch": {"model": {"sparse": {"kind": "switch", "layers": sparse_layers, "n_experts": zeros}},
                       "upcycle": {"convert_at": at, "n_experts": switch_experts}},
            "demix": {"model": {"sparse": {"kind": "demix", "layers": sparse_layers, "n_experts": zeros,
                                           "domains": list(domains)}},
                      "upcycle": {"convert_at": at}}}[arm]
    return TrainConfig.from_dict({**common, **spec, "out_dir": str(run)})


def _warmup_checkpoint(run_dir, plan) -> Path:
    """The checkpoint of ``run_dir`` at the plan's warm-up (the latest one at or before it)."""
    if plan is None or Plan.load(plan).convert_at is None:
        raise InputError("init_from", "a run directory needs a plan with a warm-up (else name a checkpoint)",
                         str(run_dir), func="ntkscope compare")
    warmup = int(Plan.load(plan).convert_at)
    before = [(step, path) for step, path in list_checkpoints(run_dir) if step <= warmup]
    if not before:
        raise InputError("init_from", f"must hold a checkpoint at or before the plan's warm-up step {warmup}",
                         str(run_dir), func="ntkscope compare")
    step, path = before[-1]
    if step != warmup:
        log.warning("plan %s: warm-up at step %d; %s has no checkpoint there: starting from step %d", plan, warmup,
                    run_dir, step)
    log.info("compare: every arm starts from %s (the plan's warm-up)", path)
    return path


def _check_warmup(init_from, plan) -> None:
    """init_from is the warm-up: say so when the plan's warm-up is another step."""
    warmup = Plan.load(plan).convert_at
    if warmup is not None and warmup_after(str(init_from), int(warmup), str(plan)) != 0:
        log.warning("plan %s: its warm-up is step %d of the measured run; every arm starts from %s and converts at "
                    "once (pass that run's step-%d checkpoint to follow the plan)", plan, warmup, init_from, warmup)


DEFAULT_BATCH, DEFAULT_SEQ_LEN = 16, 64


def compare_command(init_from, train_data, eval_data, *, plan=None, layers=None, steps: int = 200,
                    batch_size: int | None = None, seq_len: int | None = None, layout: str | None = None,
                    lr: float | None = None, seeds=(0,), text_column: str = "text",
                    label_column: str | None = None, data_format: str = "auto", tokenizer=None, n_samples: int = 3000,
                    min_cluster_size: int = 15, n_boot: int = 1000, out="compare", force: bool = False) -> dict:
    """Train dense / CSE / Switch (/ DEMix) from ``init_from`` on ``train_data`` and compare them per domain on
    ``eval_data`` (both read as ``--data`` is). ``plan`` (from ``ntkscope plan``) gives the layers
    (and is checked against the model), or ``layers`` names them. ``lr`` None continues the run's
    own schedule and AdamW state where the checkpoint keeps them (module docstring); a number
    starts every arm on a fresh warm-up to it. ``batch_size``, ``seq_len`` and ``layout`` None
    take the run's own (:func:`~cse_models.continued.run_batch`,
    :func:`~cse_models.continued.run_layout`), else 16, 64 and "packed"; every arm trains on
    ``train_data``'s text as packed blocks of ``seq_len`` tokens or (``layout="rows"``) one text
    per row cut at ``seq_len`` and padded, as a padding collator gives a ``Trainer`` run; the
    result's ``start`` line says which batch and layout it used and where they came from.

    Everything is checked before the first arm trains, and a refused comparison leaves nothing
    behind. ``out`` is tied to this request (``OUT/compare.json``): a rerun that asks for anything
    else (another lr, other data, ...) is refused in one line naming the fields, unless ``force``,
    which deletes the old runs and tables and starts over."""
    func = "ntkscope compare"
    if (plan is None) == (layers is None):
        raise InputError("plan", "give a plan file or --layers (not both)", plan or layers, func=func)
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or not all(0 <= s <= 2**31 - 1 for s in seeds):
        raise InputError("seeds", "must list distinct integers in [0, 2^31 - 1]", seeds, func=func)
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len), ("n_boot", n_boot),
                        ("min_cluster_size", min_cluster_size), ("n_samples", n_samples)):
        if value is None and name in ("batch_size", "seq_len"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(name, "must be a positive integer" + (" (or None: the run's own)" if name in (
                "batch_size", "seq_len") else ""), value, func=func)
    if layout is not None and layout not in LAYOUTS:
        raise InputError("layout", f"must be one of {', '.join(LAYOUTS)} (or None: the run's own)", layout, func=func)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                           or lr <= 0):
        raise InputError("lr", "must be a positive, finite number (or None: continue the run's schedule)", lr,
                         func=func)
    out = check_output(func, out)
    train_source = as_source(train_data, columns=DataSource(None, text_column, label_column))
    if train_source.kind not in ("table", "datasets"):
        raise InputError("train_data", "must be a table (.jsonl, .csv, .tsv, .parquet) or a datasets directory",
                         str(train_data), func=func)
    eval_source = as_source(eval_data, columns=DataSource(None, text_column, label_column, None, data_format))
    train_source.rows()  # both read once now: a missing column or a damaged file is said before any arm trains
    eval_source.rows("test") if eval_source.kind == "pack" else eval_source.rows()
    sparse_layers = "auto" if plan is not None else [int(i) for i in layers]
    if is_run_dir(init_from):
        init_from = _warmup_checkpoint(init_from, plan)
    elif plan is not None:
        _check_warmup(init_from, plan)
    model = load_checkpoint(init_from)  # the safe loader: a pickle that would run code is refused here
    blocks = family_of(model).blocks
    if sparse_layers != "auto" and blocks is not None:  # the layers against the model, before any arm trains
        n_layer = len(blocks(model))
        bad = [i for i in sparse_layers if not 0 <= i < n_layer]
        if bad or len(set(sparse_layers)) != len(sparse_layers):
            raise InputError("layers", f"must be distinct block indices in [0, {n_layer}) of this {n_layer}-layer "
                             "model", bad or sparse_layers, func=func)
    del model
    state, start = _continuation(init_from, lr, steps, func)
    batch_size, seq_len, layout, setup = _setup(init_from, batch_size, seq_len, layout)
    start = f"{start}; {setup}"
    if state is None and lr is None:  # nothing to continue: a fresh warm-up (a continued run keeps its own lr)
        lr = FRESH_LR
    tokenizer = checkpoint_tokenizer(init_from, tokenizer).name  # the one resolution, for every arm
    data = {"table": str(train_source.path), "text_column": text_column, "label_column": label_column,
            "seq_len": seq_len, "tokenizer": tokenizer, **({"layout": layout} if layout != "packed" else {})}
    request = {"init_from": str(init_from), "init_weights": digest({}, paths=[init_from]), "train_data": data,
               "train_data_contents": digest({}, paths=train_source.files), "eval_data": eval_source.options(),
               "eval_data_contents": digest({}, paths=eval_source.files), "plan": None if plan is None else str(plan),
               "layers": sparse_layers, "steps": steps, "batch_size": batch_size, "lr": lr, "seeds": seeds,
               "continued": None if state is None else {"step": state.step, **state.schedule},
               "n_samples": n_samples, "min_cluster_size": min_cluster_size, "n_boot": n_boot}
    made = not out.exists()
    with DirectoryLock(out, "compare"):
        if force:
            for name in ("runs", "tables", REQUEST):
                shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
        bind_request(out, request, func, record=REQUEST)
        log.info(start)
        try:
            result = _train_and_evaluate(init_from, data, eval_source, plan, sparse_layers, seeds, steps, batch_size,
                                         lr, state, n_samples, min_cluster_size, tokenizer, n_boot, out, start)
            return {**result, "start": start}
        except BaseException:  # a refusal, a failure or Ctrl-C before any arm saved a step: nothing is left behind
            if made and not any((out / "runs").glob("*/checkpoints/step-*")):
                shutil.rmtree(out)
            raise


def _setup(init_from, batch_size, seq_len, layout) -> tuple[int, int, str, str]:
    """The batch size, length and layout every arm trains with (the run's own where not given and
    the checkpoint records them, else 16, 64 and packed blocks), and the words that say so."""
    run_size, run_length, where = run_batch(init_from)
    run_rows, where_layout = run_layout(init_from)
    said = []
    if batch_size is None:
        batch_size = run_size or DEFAULT_BATCH
        said.append(f"batch {batch_size} ({where})" if run_size else f"batch {batch_size} (the default: {where})")
    else:
        said.append(f"batch {batch_size} (given" + (f"; the run used {run_size})" if run_size and run_size != batch_size
                                                    else ")"))
    if layout is None:
        layout = run_rows or "packed"
        whence = f"; the layout is the run's ({where_layout})" if run_rows else \
            f"; packed is the default ({where_layout}; --layout rows trains on padded rows, one text each)"
    else:
        whence = "; the layout is given" + (f" (the run's was {run_rows})" if run_rows and run_rows != layout else "")
    if seq_len is None:
        seq_len = run_length or DEFAULT_SEQ_LEN
        length = f"{seq_len} tokens" + (f" ({where})" if run_length else " (the default: the run records no length)")
    else:
        length = f"{seq_len} tokens (given" + (f"; the run used {run_length})" if run_length and run_length != seq_len
                                                else ")")
    said.append(("packed blocks of " if layout == "packed" else "padded rows, one text each, of at most ") + length)
    return batch_size, seq_len, layout, "every arm trains at " + ", on ".join(said) + " of the training table's " \
        "text" + whence


def _continuation(init_from, lr, steps: int, func: str) -> tuple[RunState | None, str]:
    """(what of the run ``init_from`` the arms continue (None: a fresh warm-up), the one line that
    says so: logged, printed by the command and kept in ``result.json`` as ``start``)."""
    state, why = run_state(init_from)
    if lr is not None:
        return None, f"compare: lr {lr:g} given: every arm starts a fresh warm-up to it from " \
            f"{init_from}" + ("" if state is None else " (the run's own schedule and AdamW state are not continued)")
    if state is None:
        return None, f"compare: {init_from} cannot be continued ({why}): every arm starts a fresh " \
            f"warm-up of lr {FRESH_LR:g} from it"
    last = int(state.schedule["steps"])
    if state.step + steps > last:
        raise InputError("steps", f"must end within the run's schedule, which is continued from step {state.step} to "
                         f"its last step {last} (at most {max(last - state.step, 0)}); or give --lr for a fresh "
                         "warm-up", steps, func=func)
    return state, f"compare: every arm continues the {state.writer} run from step {state.step} on its " \
        f"own schedule ({state.schedule['lr_schedule']}, lr {state.schedule['lr']:g}, to step {last}) and AdamW " \
        f"state, for {steps} steps"


def _train_and_evaluate(init_from, data, eval_source, plan, sparse_layers, seeds, steps, batch_size, lr, state,
                        n_samples, min_cluster_size, tokenizer, n_boot, out: Path, start_line: str) -> dict:
    """Every (seed, arm) run, each resumed or skipped when done, then the evaluation."""
    results = []
    start = 0 if state is None else state.step
    schedule = {"steps": steps, "lr": lr, "warmup_steps": max(1, steps // 20)} if state is None else \
        {**state.schedule, "stop_at": start + steps}
    for seed in seeds:
        common = {"init_from": str(init_from), "data": data, "batch_size": batch_size, **schedule, "seed": seed,
                  "checkpoint_every": max(1, steps // 4), "tensorboard": False,
                  "plan": None if plan is None else str(plan)}
        cse = {"n_samples": n_samples, "min_cluster_size": min_cluster_size}
        last = {}
        domains = load_data(_config("dense", out, common, cse, sparse_layers, None))[0].domain_names
        arms = ARMS if len(domains) > 1 else ARMS[:3]
        if len(domains) < 2 and seed == seeds[0]:
            log.info("compare: no DEMix arm: it needs two labels or more in the training table (--label-column)")
        for arm in arms:
            run = out / "runs" / f"{arm}-seed{seed}"
            experts = None
            if arm == "switch":  # CSE's expert count at each layer, upcycled so the function is unchanged
                experts = list(load_any_model(last["cse"]).config.sparse.n_experts)
            cfg = _config(arm, run, common, cse, sparse_layers, experts, domains, at=start)
            done = latest_checkpoint(run)
            if done is not None and done.name == f"step-{start + steps:06d}":
                last[arm] = done
                continue
            if state is not None:
                branch(init_from, run, apply_plan(cfg).model.get("sparse"), cfg, state)
            last[arm] = train(cfg)
        results.append((seed, last))
    return _evaluate(results, eval_source, tokenizer, n_boot, out, start_line)


def _evaluate(results, source: DataSource, tokenizer, n_boot, out: Path, start_line: str) -> dict:
    rows = source.rows("test") if source.kind == "pack" else source.rows()
    texts, labels = [t for t, _ in rows], [label for _, label in rows]
    frames, routing = [], {}
    for seed, last in results:
        tok = checkpoint_tokenizer(last["dense"], tokenizer)
        ids = tok.encode(texts)
        for arm, checkpoint in last.items():
            ev = evaluate_domains(load_any_model(checkpoint), ids, labels, n_boot=n_boot, seed=seed)
            frames.append(ev.perplexity.assign(arm=arm, seed=seed, checkpoint=str(checkpoint)))
            if len(ev.routing):
                routing[(arm, seed)] = ev.routing.assign(arm=arm, seed=seed)
    table = pd.concat(frames, ignore_index=True)
    dense = table[table["arm"] == "dense"].set_index(["seed", "domain"])["ppl"]
    table["vs_dense"] = [row.ppl / dense[(row.seed, row.domain)] - 1 for row in table.itertuples()]
    columns = ["arm", "seed", "domain", "texts", "tokens", "ppl", "ppl_low", "ppl_high", "vs_dense", "checkpoint"]
    table = table[columns]
    with Staging(out / "tables") as files:
        write_table(table, files.path("comparison.csv"))
        if routing:
            frame = pd.concat(routing.values(), ignore_index=True)
            write_table(frame, files.path("routing.csv"))
            for (arm, seed), part in routing.items():
                save_figure(routing_shares(part, title=f"{arm}, seed {seed}"), files.path(f"routing-{arm}-seed{seed}"))
        weights = {f"{arm} seed {seed}": checkpoint for seed, last in results for arm, checkpoint in last.items()}
        write_json(files.path("result.json"), {"arms": list(ARMS), "seeds": [s for s, _ in results],
                                               "eval_data": str(source), "n_boot": n_boot, "start": start_line,
                                               "comparison": table.to_dict("records"),
                                               "provenance": provenance(weights=weights, data_files=data_files(source))})
    return {"table": table, "files": files.written}
