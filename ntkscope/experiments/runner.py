"""Run a spec's units through an executor, resumably, and rebuild its tables from what finished.

::

    RUN/experiment.json       the spec (canonical), its units, their needs and keys
    RUN/units/NAME.json       each unit's state: running / done / failed, key, attempts, times, last error
    RUN/logs/NAME.err         the traceback of a unit's last failure
    RUN/locks/NAME.lock       held (flock) while a process works on the unit
    RUN/stale/NAME-KEY/       what a unit wrote under an earlier key (the spec changed it): moved, not deleted
    RUN/tables/               the experiment's tables; status.json says whether they are partial

Executors (each unit in a process of its own, one torch thread by default):

- ``local``: ``concurrent.futures.ProcessPoolExecutor`` (spawn), ``workers`` at once;
- ``inline``: in this process, one unit after another (debugging);
- ``submitit-local``: submitit's ``LocalExecutor`` (real subprocesses, logs in RUN/jobs);
- ``slurm``: submitit's ``SlurmExecutor`` (partition, time, GPUs, CPUs and memory from the
  spec's ``[run.slurm]`` or the command line).

A unit runs once its needs are done. A unit that fails is tried again up to ``retries`` times
(training resumes from its last checkpoint); one that still fails is reported and never stops
the others (what needs it waits, reported as blocked). Two drivers may share a run directory:
a unit held by one is left to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import fnmatch
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from ntkscope.core.checks import UserError, fail
from ntkscope.core.files import DirectoryLock, InUse, read_json_object, sha256_file, write_json, write_text
from ntkscope.experiments.adopt import adopt_units
from ntkscope.experiments.kinds import EXPERIMENT_KINDS
from ntkscope.experiments.spec import EXECUTORS, SlurmSpec, Spec
from ntkscope.experiments.units import Unit, execute, is_done, outputs, read_state, units, write_state
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.corpus.table_pack import table_digest, table_pack, tokenizer_file

log = logging.getLogger(__name__)


# ---- one unit, in its worker process -----------------------------------------------------------

def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:400]


def run_unit(spec: Spec, run_dir, unit: Unit, pack=None, threads: int = 1) -> dict:
    """Do one unit in this process, under its lock: ``{"status": "done" | "held"}``. A unit done
    under its key is not done again; one done under another key has its outputs moved to
    RUN/stale first. A failure is recorded (state and RUN/logs/NAME.err) and raised; so is an
    interruption of this process (Ctrl-C, or SIGTERM where the command turns it into one: state
    ``interrupted``, its checkpoints kept for the rerun)."""
    if threads:
        torch.set_num_threads(threads)
    run_dir = Path(run_dir)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lock = DirectoryLock(run_dir / "locks", "experiment", name=f"{unit.name}.lock", subject=unit.name)
    try:
        lock.__enter__()
    except InUse:
        return {"status": "held"}
    try:
        state = read_state(run_dir, unit.name)
        if is_done(state, unit, run_dir):
            return {"status": "done"}
        if state and state.get("key") != unit.key:
            move_aside(spec, run_dir, unit, state["key"])
        attempt = state.get("attempts", 0) + 1 if state and state.get("key") == unit.key else 1
        base = {"name": unit.name, "key": unit.key, "attempts": attempt, "pid": os.getpid(),
                "host": socket.gethostname(), "started": _now()}
        write_state(run_dir, unit.name, {**base, "status": "running"})
        start = time.perf_counter()
        try:
            record = execute(spec, run_dir, unit, pack)
        except KeyboardInterrupt as err:  # Ctrl-C in this process: its checkpoints stay, the next run resumes it
            write_state(run_dir, unit.name, {**base, "status": "interrupted", "error": type(err).__name__,
                                              "seconds": round(time.perf_counter() - start, 1), "finished": _now()})
            raise
        except BaseException as err:
            write_text(run_dir / "logs" / f"{unit.name}.err", traceback.format_exc())
            write_state(run_dir, unit.name, {**base, "status": "failed", "error": _one_line(err),
                                              "seconds": round(time.perf_counter() - start, 1), "finished": _now()})
            raise
        write_state(run_dir, unit.name, {**base, "status": "done", "seconds": round(time.perf_counter() - start, 1),
                                          "finished": _now(), **record})
        return {"status": "done"}
    finally:
        lock.__exit__(None, None, None)


def move_aside(spec: Spec, run_dir: Path, unit: Unit, old_key: str) -> None:
    """The outputs ``unit`` made under ``old_key`` into a new folder RUN/stale/NAME-KEY (then
    NAME-KEY-2, ...: a folder moved aside before is never written into)."""
    stale, n = run_dir / "stale" / f"{unit.name}-{old_key}", 1
    while stale.exists():
        n += 1
        stale = run_dir / "stale" / f"{unit.name}-{old_key}-{n}"
    for path in outputs(spec, run_dir, unit):
        if path.exists():
            stale.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(stale / path.name))
            log.warning("experiment: %s was made under another spec (key %s): moved to %s", path, old_key, stale)


# ---- executors ---------------------------------------------------------------------------------

class _Inline:
    """Each unit in this process, one after another (debugging; what a test steps through)."""

    def submit(self, fn, *args):
        future = cf.Future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 (reported like a worker's failure)
            future.set_exception(err)
        return future


def listen_for_interrupts() -> None:
    """In a worker process: SIGINT raises KeyboardInterrupt, whatever the process inherited. A run
    started in the background (``nohup ... &``) has SIGINT ignored, and its workers inherit that;
    the driver interrupts them with SIGINT (:meth:`_Local.interrupt`), so they must hear it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


class _Local:
    """Each unit in a fresh spawned process of its own pool: a unit that is killed breaks only its own."""

    def __init__(self):
        self.pools = []

    def submit(self, fn, *args):
        pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=listen_for_interrupts)
        future = pool.submit(fn, *args)
        future.add_done_callback(lambda _: pool.shutdown(wait=False))
        self.pools = [p for p in self.pools if p._processes] + [pool]  # the pools whose unit may still run
        return future

    def interrupt(self, timeout: float = 60.0) -> None:
        """Pass an interruption of this process (Ctrl-C, or SIGTERM to it alone) on to the units
        still running: each gets SIGINT, records itself interrupted with its checkpoints kept, and
        ends while this process still reads its result, so that none trains on orphaned."""
        workers = [w for pool in self.pools for w in list((pool._processes or {}).values())]  # no public handle
        for worker in workers:
            if worker.is_alive():
                os.kill(worker.pid, signal.SIGINT)
        for worker in workers:
            worker.join(timeout)


class _Submitit:
    """submitit's local or Slurm executor; a job is polled like a future."""

    def __init__(self, kind: str, folder: Path, slurm: SlurmSpec):
        try:
            import submitit  # optional: only the submitit and Slurm executors need it
        except ImportError:
            raise UserError("experiment: executor submitit-local and slurm need submitit: pip install submitit "
                            "(or ntkscope[cluster])") from None
        if kind == "slurm":
            self.executor = submitit.SlurmExecutor(folder=folder)
            params = {"time": slurm.time_min, "cpus_per_task": slurm.cpus, "mem": f"{slurm.mem_gb}GB",
                      "ntasks_per_node": 1}
            if slurm.partition:
                params["partition"] = slurm.partition
            if slurm.gpus:
                params["gpus_per_node"] = slurm.gpus
            self.executor.update_parameters(**params)
        else:
            self.executor = submitit.LocalExecutor(folder=folder)
            self.executor.update_parameters(timeout_min=slurm.time_min)

    def submit(self, fn, *args):
        return self.executor.submit(fn, *args)  # a submitit Job: done(), result()


def make_executor(kind: str, run_dir: Path, slurm: SlurmSpec):
    if kind == "local":
        return _Local()
    if kind == "inline":
        return _Inline()
    return _Submitit(kind, run_dir / "jobs", slurm)


# ---- the driver --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What a run of :func:`run_experiment` left: ``done``, ``failed`` ({name: last error}),
    ``blocked`` (units whose needs failed), ``tables`` (the summary written, or None when
    nothing finished) and ``partial`` (whether any unit is not done)."""

    done: tuple
    failed: dict
    blocked: tuple
    tables: dict | None
    partial: bool


def run_experiment(spec: Spec, run_dir, *, executor: str = "local", workers: int = 1, threads: int = 1,
                   retries: int | None = None, adopt=None, pack=None, device: str | None = None,
                   slurm: SlurmSpec | None = None, poll: float = 0.5, first=None) -> Outcome:
    """Run every unit of ``spec`` not yet done in ``run_dir`` through ``executor`` (EXECUTORS),
    at most ``workers`` at once with ``threads`` torch threads each, trying a failed unit again
    up to ``retries`` times (default: the spec's); then rebuild the tables from what finished.
    ``adopt``: an earlier run directory (or committed results) whose finished units count as done.
    ``device``: where units train ("cpu", "cuda", "auto"; default: the spec's settings).
    ``first``: unit-name globs whose units, and every unit they need, start before the others
    (every unit still runs)."""
    if executor not in EXECUTORS:
        raise fail("run_experiment", "executor", f"must be one of {', '.join(EXECUTORS)}", executor)
    if workers < 1 or threads < 0:
        raise fail("run_experiment", "workers", "must be at least 1 (threads at least 0)", [workers, threads])
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise fail("run_experiment", "run_dir", "must be a directory (or not exist yet)", str(run_dir))
    if device:
        spec = replace(spec, settings=spec.settings.replace(device=device))
    retries = spec.retries if retries is None else int(retries)

    run_dir.mkdir(parents=True, exist_ok=True)
    pack = spec_pack(spec, run_dir, pack)
    version = load_pack(pack).manifest.get("version")
    todo = prioritised(units(spec, version), first)
    write_json(run_dir / "experiment.json", {"name": spec.name, "kind": spec.kind, "source": spec.source,
                                             "spec": json.loads(spec.text), "pack": version,
                                             "units": [{"name": u.name, "seed": u.seed, "needs": list(u.needs),
                                                        "key": u.key, "what": u.what} for u in todo]})
    if adopt is not None:
        adopt_units(spec, run_dir, todo, Path(adopt))
    pool = make_executor(executor, run_dir, slurm or spec.slurm)
    try:
        return _run_units(spec, run_dir, todo, pool, workers, threads, retries, pack, poll)
    except KeyboardInterrupt:
        if hasattr(pool, "interrupt"):
            pool.interrupt()
        raise


def prioritised(todo: list, first) -> list:
    """``todo`` with the units matching the globs ``first`` and all they need (transitively) moved
    ahead, each part in its own order (a unit still after its needs); each glob must match a unit."""
    if not first:
        return todo
    patterns = [first] if isinstance(first, str) else list(first)
    names = [u.name for u in todo]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise fail("run_experiment", "first", f"must be globs that match units ({', '.join(names[:6])}, ...)",
                       pattern)
    by_name = {u.name: u for u in todo}
    wanted = {n for p in patterns for n in fnmatch.filter(names, p)}
    stack = list(wanted)
    while stack:
        for need in by_name[stack.pop()].needs:
            if need not in wanted:
                wanted.add(need)
                stack.append(need)
    return [u for u in todo if u.name in wanted] + [u for u in todo if u.name not in wanted]


def _run_units(spec: Spec, run_dir: Path, todo: list, pool, workers: int, threads: int, retries: int, pack,
               poll: float) -> Outcome:
    """:func:`run_experiment`'s loop: start what is ready, retry what failed, until nothing can start."""
    tries, failed, inflight, held_until = {}, {}, {}, {}
    while True:
        done = {u.name for u in todo if is_done(read_state(run_dir, u.name), u, run_dir)}
        for name, handle in list(inflight.items()):
            if not handle.done():
                continue
            del inflight[name]
            try:
                if handle.result()["status"] == "held":
                    held_until[name] = time.monotonic() + 5 * poll  # another process works on it
            except Exception as err:  # noqa: BLE001 (a unit's failure is reported, never stops the others)
                tries[name] = tries.get(name, 0) + 1
                state = read_state(run_dir, name) or {}
                error = state.get("error") if state.get("status") == "failed" else _one_line(err)
                if tries[name] > retries:
                    failed[name] = error
                    log.error("experiment: %s failed %d times; last: %s", name, tries[name], error)
                else:
                    log.warning("experiment: %s failed (%s); trying again (%d of %d)", name, error, tries[name],
                                retries)
        blocked = _blocked(todo, failed)
        now = time.monotonic()
        ready = [u for u in todo if u.name not in done | set(inflight) | set(failed) | blocked
                 and all(n in done for n in u.needs) and held_until.get(u.name, 0) <= now]
        for unit in ready[:max(0, workers - len(inflight))]:
            log.info("experiment: starting %s", unit.name)
            inflight[unit.name] = pool.submit(run_unit, spec, str(run_dir), unit, pack, threads)
        if not [u for u in todo if u.name not in done | set(failed) | blocked]:
            break
        if not inflight and not ready and not held_until:
            break  # nothing runs and nothing can start (cannot happen while a need is unfinished)
        time.sleep(poll)
        held_until = {n: t for n, t in held_until.items() if n not in done}
    done = tuple(u.name for u in todo if is_done(read_state(run_dir, u.name), u, run_dir))
    tables = summarise_experiment(spec, run_dir, pack=pack) if done else None
    return Outcome(done, failed, tuple(sorted(_blocked(todo, failed))), tables, len(done) < len(todo))


def _blocked(todo: list, failed: dict) -> set:
    """Units that need (directly or not) a unit that failed."""
    out = set()
    for unit in todo:  # in order: a unit after its needs
        if any(n in failed or n in out for n in unit.needs):
            out.add(unit.name)
    return out


# ---- what finished -------------------------------------------------------------------------------

def spec_pack(spec: Spec, run_dir, pack=None, *, build: bool = True, func: str = "run_experiment"):
    """The pack a spec's units read: ``pack`` (``--data``; None: the shipped one), or for a spec
    with ``[data]`` RUN/pack, built from its table (tokenized by the trunk model's tokenizer when
    ``[trunk] model`` names one) and built again only when the table's bytes, the tokenizer or
    the spec's reading of it change (the pack's version is part of every unit's key, so the units
    of another table run again). ``build=False`` (a summary of what ran): RUN/pack as the units
    read it, never rebuilt under their results."""
    if spec.data is None:
        return pack
    d, target = spec.data, Path(run_dir) / "pack"
    if pack is not None and Path(pack).resolve() != target.resolve():
        raise fail(func, "pack", "must not be given for a spec that names its own table ([data] table = "
                   f"{spec.data.table})", str(pack))

    if not build:
        if not (target / "manifest.json").is_file():
            raise fail(func, "run_dir", "must hold the pack its units read (RUN/pack, built by experiment run)",
                       str(run_dir))
        return target
    wanted = {"table": {"sha256": table_digest(d.table), "text_column": d.text_column, "label_column": d.label_column},
              "options": {"validation": d.validation, "test": d.test,
                          **({"tokenizer": sha256_file(tokenizer_file(spec.trunk.model))} if spec.trunk.model
                             else {"vocab_size": d.vocab_size})},
              "tail": list(d.tail)}
    if (target / "manifest.json").is_file():
        made = load_pack(target).manifest
        if {"table": {k: made.get("table", {}).get(k) for k in wanted["table"]}, "options": made.get("options"),
                "tail": made.get("tail")} == wanted:
            return target
    return table_pack(target, d.table, text_column=d.text_column, label_column=d.label_column, tail=d.tail,
                      validation=d.validation, test=d.test, vocab_size=d.vocab_size,
                      tokenizer=spec.trunk.model or None, overwrite=True)


def summarise_experiment(spec: Spec, run_dir, *, pack=None) -> dict:
    """Rebuild RUN/tables from the units that finished, and RUN/tables/status.json: whether the
    tables are partial (a unit of the spec is not done) and which units are missing."""
    run_dir = Path(run_dir)
    experiment = read_json_object(run_dir / "experiment.json", "summarise_experiment")
    pack = spec_pack(spec, run_dir, pack, build=False, func="summarise_experiment")
    missing = [u["name"] for u in experiment["units"]
               if not is_done(read_state(run_dir, u["name"]), Unit(u["name"], u["seed"], u["what"], key=u["key"]),
                              run_dir)]
    finished = {u["name"] for u in experiment["units"]
                if (read_state(run_dir, u["name"]) or {}).get("status") == "done"}
    found = EXPERIMENT_KINDS.get_one(spec.kind, func="summarise_experiment").summarise(spec, run_dir, pack, finished)
    write_json(run_dir / "tables" / "status.json", {"partial": bool(missing), "missing": missing,
                                                     "units": len(experiment["units"])})
    return found


def status(run_dir) -> pd.DataFrame:
    """One row per unit of the experiment in ``run_dir``: ``unit``, ``state`` (done, running,
    failed, interrupted: its process is gone; stale: done under another spec; result missing: done,
    its result file deleted since; ready; waiting: on a need), ``attempts``, ``seconds``, ``started``,
    ``finished`` and ``error`` (the last one)."""
    run_dir = Path(run_dir)
    path = run_dir / "experiment.json"
    if not path.is_file():
        raise UserError(f"experiment status: {run_dir} holds no experiment (no experiment.json); start one with "
                        "ntkscope experiment run SPEC --out DIR")
    experiment = read_json_object(path, "experiment status")
    rows, done = [], set()
    for u in experiment["units"]:
        state = read_state(run_dir, u["name"]) or {}
        unit = Unit(u["name"], u["seed"], u["what"], key=u["key"])
        if is_done(state, unit, run_dir):
            label = "done"
            done.add(u["name"])
        elif is_done(state, unit):
            label = "result missing"  # its result file was deleted: the next run makes it again
        elif _held(run_dir / "locks" / f"{u['name']}.lock"):
            label = "running"
        elif state.get("status") == "failed" and state.get("key") == u["key"]:
            label = "failed"
        elif state.get("status") in ("running", "interrupted"):  # stopped, or its process is gone
            label = "interrupted"
        elif state.get("status") == "done":
            label = "stale"
        else:
            label = "ready" if all(n in done for n in u["needs"]) else "waiting"
        rows.append({"unit": u["name"], "state": label, "attempts": state.get("attempts", 0),
                     "seconds": state.get("seconds"), "started": state.get("started"),
                     "finished": state.get("finished"), "error": state.get("error", "")})
    return pd.DataFrame(rows)


def _held(path: Path) -> bool:
    """Whether a process holds the lock file ``path`` now."""
    if not path.is_file():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False
