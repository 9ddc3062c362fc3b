"""Experiments as specs (ntkscope.experiments): a toy spec of 2 arms x 2 seeds x 2 steps runs
through each executor, a unit killed mid-run is retried and resumes, a failing unit is reported
while the others finish, two drivers never train a unit twice, a bad field is one line, and the
shipped specs rebuild the committed tables byte for byte from the committed results."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from commandline import in_process
from experiment_toy import TOY, toy_file
from ntkscope.experiments import load_spec, parse_spec, run_experiment, status, units
from ntkscope.core.checks import UserError
from ntkscope.experiments.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]

TABLES = ("arms", "paired", "load", "routing")
KILL_ARMS = [a for a in TOY["arms"] if a["kind"] != "null"]  # the kill tests' spec: the trunk and CSE (3 units)


def tables(run: Path) -> dict:
    """The tables of a run, less the wall-clock column (``seconds``)."""
    out = {n: pd.read_csv(run / "tables" / f"{n}.csv") for n in TABLES}
    out["arms"] = out["arms"].drop(columns="seconds")
    return out


def assert_same_tables(a: Path, b: Path) -> None:
    ta, tb = tables(a), tables(b)
    for name in TABLES:
        pd.testing.assert_frame_equal(ta[name], tb[name], check_exact=True, obj=name)
    assert (a / "tables" / "verdict.json").read_text() == (b / "tables" / "verdict.json").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The toy spec, uninterrupted, in this process, on one thread as the workers are (another
    thread count sums in another order)."""
    import torch

    run, threads = tmp_path_factory.mktemp("reference"), torch.get_num_threads()
    try:
        outcome = run_experiment(parse_spec(TOY), run, executor="inline", threads=1, poll=0.01)
    finally:
        torch.set_num_threads(threads)
    return run, outcome


@pytest.fixture(scope="module")
def reference_seed0(tmp_path_factory):
    """The toy spec's seed 0 and its trunk and CSE arms alone, uninterrupted, as :func:`reference`
    (the kill tests run it in subprocesses: the same units and paths)."""
    import torch

    run, threads = tmp_path_factory.mktemp("reference-seed0"), torch.get_num_threads()
    try:
        run_experiment(parse_spec({**TOY, "seeds": [0], "arms": KILL_ARMS}), run, executor="inline", threads=1,
                       poll=0.01)
    finally:
        torch.set_num_threads(threads)
    return run


def test_the_toy_spec_expands_into_its_units_and_tabulates_them(reference):
    run, outcome = reference
    names = {f"{a}-seed{s}" for a in ("dense", "cse-at20", "cse-at40", "null-at20", "null-at40") for s in (0, 1)}
    assert set(outcome.done) == names and not outcome.failed and not outcome.partial
    arms = pd.read_csv(run / "tables" / "arms.csv")
    assert sorted(arms["arm"].unique()) == sorted({n.rsplit("-seed", 1)[0] for n in names})
    assert arms.set_index(["arm", "seed"]).loc[("cse-at40", 1), "warmup"] == 40
    assert json.loads((run / "tables" / "status.json").read_text()) == {"partial": False, "missing": [], "units": 10}
    record = json.loads((run / "experiment.json").read_text())
    needs = {u["name"]: u["needs"] for u in record["units"]}
    assert needs["cse-at20-seed1"] == ["dense-seed1"] and needs["dense-seed0"] == []
    assert (status(run)["state"] == "done").all()


def _kill_when(run: Path, unit: str, checkpoint: str, proc) -> int:
    """SIGKILL the worker of ``unit`` once ``checkpoint`` exists in its model directory; its pid."""
    folder = run / "models" / unit / "checkpoints" / checkpoint
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        state = run / "units" / f"{unit}.json"
        if folder.is_dir() and state.is_file():
            pid = json.loads(state.read_text())["pid"]
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.01)
    raise AssertionError(f"{unit} never reached {checkpoint}")


# the driver retries a killed worker's unit whatever the executor: this scenario runs through submitit's
# in the default suite and through the local one's (which test_sigterm_... below also signals) in the slow one
@pytest.mark.parametrize("executor", [pytest.param("local", marks=pytest.mark.slow), "submitit-local"])
def test_a_unit_killed_mid_run_is_retried_and_the_tables_equal_an_uninterrupted_run(reference_seed0, tmp_path,
                                                                                    executor):
    """Real subprocesses: the trunk of seed 0 is killed after its step-20 checkpoint; the driver
    tries it again, it resumes, and every table and each unit's test losses equal the
    uninterrupted run's. The spec is the trunk and CSE alone (3 units, for time)."""
    pytest.importorskip("submitit")
    run = tmp_path / "run"
    arms = KILL_ARMS
    proc = subprocess.Popen([sys.executable, "-m", "ntkscope", "experiment", "run",
                             str(toy_file(tmp_path, seeds=[0], arms=arms)), "--out", str(run), "--executor", executor,
                             "--workers", "2", "--retries", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    _kill_when(run, "dense-seed0", "step-000020", proc)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    state = json.loads((run / "units" / "dense-seed0.json").read_text())
    assert state["status"] == "done" and state["attempts"] == 2, state
    assert f"{2 * len(arms) - 1} units done, 0 failed" in out
    assert_same_tables(run, reference_seed0)
    for unit in ("dense-seed0", "cse-at20-seed0", "cse-at40-seed0"):
        mine, reference = (json.loads((r / "results" / f"{unit}.json").read_text())["blocks"]
                           for r in (run, reference_seed0))
        assert mine == reference, unit


def _started(tmp_path, executor: str, sigint=signal.SIG_DFL) -> tuple:
    """`ntkscope experiment run` of a trunk alone in a subprocess, once it has its step-20
    checkpoint: (run directory, command, process). The trunk trains 240 steps, so that the signal
    reaches it training even on a loaded machine (at 60 steps it could finish before the test
    process was scheduled again). ``sigint``: the disposition of SIGINT it starts with (a terminal's
    foreground job: the default; a job started in the background, ``nohup ... &``: ignored)."""
    run = tmp_path / "run"
    spec = toy_file(tmp_path, seeds=[0], arms=KILL_ARMS[:1], criteria={"arms": []},
                    settings={**TOY["settings"], "steps": 240})
    command = [sys.executable, "-m", "ntkscope", "experiment", "run", str(spec), "--out", str(run),
               "--executor", executor]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    folder, deadline = run / "models" / "dense-seed0" / "checkpoints" / "step-000020", time.monotonic() + 240
    while not folder.is_dir() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    return run, command, proc


def test_ctrl_c_leaves_the_unit_interrupted_and_says_what_was_kept(tmp_path):
    """Ctrl-C in `ntkscope experiment run` (inline: the unit trains in the driver) once the trunk
    has a checkpoint: exit 130, a message that says the checkpoints are kept, and status
    `interrupted` (not `failed`); the same command then finishes the unit."""
    run, command, proc = _started(tmp_path, "inline")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; the units done are kept" in err and "no partial results" not in err
    assert json.loads((run / "units" / "dense-seed0.json").read_text())["status"] == "interrupted"
    assert status(run).set_index("unit").loc["dense-seed0", "state"] == "interrupted"
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (status(run)["state"] == "done").all()


def test_sigterm_to_the_driver_alone_interrupts_its_workers_too(tmp_path):
    """`kill PID` of `ntkscope experiment run` (local executor: the unit trains in a spawned
    worker, which the signal does not reach): the driver passes the interruption on, so the worker
    records the unit interrupted and ends with it; no process trains on orphaned. Started as a
    background job (SIGINT ignored, which the workers inherit): the workers hear the driver's
    SIGINT all the same."""
    run, _, proc = _started(tmp_path, "local", sigint=signal.SIG_IGN)
    worker = json.loads((run / "units" / "dense-seed0.json").read_text())["pid"]
    assert worker != proc.pid
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "interrupted" in err, err[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{worker}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists(), "the worker trains on after the driver was stopped"
    assert json.loads((run / "units" / "dense-seed0.json").read_text())["status"] == "interrupted"


def test_a_failing_unit_is_retried_reported_and_the_others_finish(reference, tmp_path):
    """A unit whose trunk checkpoint is gone fails every try; it is reported with its error, and
    every other unit finishes."""
    spec = parse_spec({**TOY, "seeds": [0]})
    run = tmp_path / "run"
    run_experiment(spec, run, executor="inline", threads=0, poll=0.01)
    shutil.rmtree(run / "models" / "dense-seed0" / "checkpoints" / "step-000040")
    for unit in ("cse-at40-seed0", "null-at40-seed0"):  # made again: they branch from the missing checkpoint
        for path in (run / "units" / f"{unit}.json", run / "results" / f"{unit}.json"):
            path.unlink()
        shutil.rmtree(run / "models" / unit)
    outcome = run_experiment(spec, run, executor="inline", threads=0, retries=1, poll=0.01)
    assert set(outcome.failed) == {"cse-at40-seed0", "null-at40-seed0"} and outcome.partial
    assert all("step-000040" in e for e in outcome.failed.values()), outcome.failed
    table = status(run).set_index("unit")
    assert table.loc["cse-at40-seed0", "state"] == "failed" and table.loc["cse-at40-seed0", "attempts"] == 2
    assert (table.drop(["cse-at40-seed0", "null-at40-seed0"])["state"] == "done").all()
    assert "Traceback" in (run / "logs" / "cse-at40-seed0.err").read_text()
    assert json.loads((run / "tables" / "status.json").read_text())["missing"] == ["cse-at40-seed0",
                                                                                    "null-at40-seed0"]


def test_two_drivers_on_one_directory_never_train_a_unit_twice(tmp_path):
    """Two `ntkscope experiment run` processes on one run directory: every unit is trained by one
    of them (each training writes its train_config.json once)."""
    spec = toy_file(tmp_path, seeds=[0], arms=KILL_ARMS)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "ntkscope", "experiment", "run", str(spec), "--out", str(run),
               "--executor", "inline"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    started = [line for out in outs for line in out.splitlines() if "experiment: starting" in line]
    trained = [line for out in outs for line in out.splitlines() if "sweep: " in line and " done in " in line]
    assert len(trained) == 3, trained  # each of the 3 units once, by one process or the other
    assert len(started) >= 3
    assert (status(run)["state"] == "done").all()


@pytest.mark.parametrize("change, message", [
    ({"kind": "grid"}, "toy.toml: kind must be one of sweep, tables (got 'grid')"),
    ({"seeds": [0, 0]}, "toy.toml: seeds must not repeat a seed (got [0, 0])"),
    ({"settings": {"stpes": 60}}, "toy.toml: settings.stpes is not a field here"),
    ({"settings": {"steps": "60"}}, "toy.toml: settings.steps must be like the preset's value 40 (got '60')"),
    ({"trunk": {"layers": [0, 5]}}, "toy.toml: trunk.layers must be in [0, 1] (got [0, 5])"),
    ({"arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [25]}]},
     "toy.toml: arms[1] (cse).convert_at must be steps the trunk keeps: multiples of checkpoint_every (10) in (0, 60), or "
     "the gc_peak_step (got [25])"),
    ({"arms": [{"name": "cse", "kind": "cse", "convert_at": "late"}]},
     "toy.toml: arms must hold exactly one arm of kind 'dense'"),
    ({"arms": [{"name": "dense", "kind": "dense"}, {"name": "x", "kind": "cse", "convert_at": "late", "fair": True}]},
     "toy.toml: arms[1] (x).fair applies to kind 'switch' only (got 'cse')"),
    ({"arms": [{"name": "dense", "kind": "dense"}, {"name": "x", "kind": "cse", "convert_at": "late", "seeds": [7]}]},
     "toy.toml: arms (x).seeds must be seeds of the spec [0, 1] (their trunks) (got [7])"),
    ({"run": {"retries": -1}}, "toy.toml: run.retries must be at least 0 (got -1)"),
    ({"trunk": {"structure": {"n_fits": 1}}}, "toy.toml: trunk.structure.n_fits must be at least 2 (got 1)"),
    ({"trunk": {"structure": {"min_structre": 0.1}}}, "toy.toml: trunk.structure.min_structre is not a field here"),
])
def test_a_spec_with_a_bad_field_is_refused_in_one_line(tmp_path, change, message):
    """Every refusal names the file and the field; the run directory is not made."""
    path = toy_file(tmp_path, **change)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path.parent}/{message}") and "\n" not in str(err.value)
    proc = in_process("experiment", "run", path, "--out", tmp_path / "run")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message.split(" (got")[0] in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_structure_rule_plans_every_trunk():
    """With [trunk.structure], each seed gets a plan unit (the rule is judged in every trunk), keyed
    by the rule's fields; without it, only seeds whose arms convert at the rule's step do."""
    plain = {u.name for u in units(parse_spec(TOY), "v")}
    spec = parse_spec({**TOY, "trunk": {**TOY["trunk"], "structure": {"n_fits": 4}}})
    found = units(spec, "v")
    assert {u.name for u in found} - plain == {"plan-seed0", "plan-seed1"}
    other = units(parse_spec({**TOY, "trunk": {**TOY["trunk"], "structure": {"n_fits": 5}}}), "v")
    assert {u.name: u.key for u in found}["plan-seed0"] != {u.name: u.key for u in other}["plan-seed0"]


@pytest.mark.parametrize("name, committed", [("sweep", "figures/sweep"), ("tables-late", "figures/tables-late"),
                                             ("tables", "figures/tables")])
def test_the_shipped_specs_rebuild_the_committed_tables_byte_for_byte(tmp_path, name, committed):
    """Adopting the committed results (the models are gone with the first sweep's machine): every
    unit the committed run finished counts as done, nothing trains, and the tables are the
    committed files byte for byte."""
    source = ROOT / committed
    run = tmp_path / name
    spec = load_spec(name)
    outcome = run_experiment(spec, run, executor="inline", adopt=source, poll=0.01)
    assert not outcome.failed and not outcome.partial
    files = sorted(p.name for p in (source / "tables").iterdir() if p.suffix in (".csv", ".json", ".md"))
    assert files
    for file in files:
        assert (run / "tables" / file).read_bytes() == (source / "tables" / file).read_bytes(), file


def test_a_unit_is_done_by_its_key_and_a_changed_arm_runs_again(reference, tmp_path):
    """Changing what an arm computes (here CSE's drift rate) changes its units' keys: they train
    again, what they wrote before is moved to RUN/stale (never deleted), and every other unit
    stays done without work."""
    run = tmp_path / "run"
    shutil.copytree(reference[0], run)
    before = {p.name: p.read_text() for p in (run / "units").glob("*.json")}
    arms = [dict(a, mean_rate=0.1) if a["name"] == "cse" else a for a in TOY["arms"]]
    outcome = run_experiment(parse_spec({**TOY, "arms": arms}), run, executor="inline", threads=0, poll=0.01)
    assert not outcome.failed and not outcome.partial
    after = {p.name: p.read_text() for p in (run / "units").glob("*.json")}
    changed = sorted(n for n in after if after[n] != before[n])
    assert changed == [f"cse-at{s}-seed{k}.json" for s in (20, 40) for k in (0, 1)]
    stale = sorted(p.name.rsplit("-", 1)[0] for p in (run / "stale").iterdir())
    assert stale == sorted(n[:-5] for n in changed)
    assert (next((run / "stale").glob("cse-at20-seed0-*")) / "cse-at20-seed0" / "checkpoints").is_dir()
    config = json.loads((run / "models" / "cse-at20-seed0" / "train_config.json").read_text())
    assert config["model"]["sparse"]["mean_rate"] == 0.1


def test_a_run_directory_copied_elsewhere_resumes_there(reference, tmp_path):
    """A run moved to another path (the original gone), one trunk cut back to step 30: the
    trunk resumes there, its arms stay done, and the tables equal the uninterrupted run's."""
    import torch

    first, moved = tmp_path / "first", tmp_path / "elsewhere" / "run"
    shutil.copytree(reference[0], first)
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    for path in ("units/dense-seed1.json", "results/dense-seed1.json"):
        (moved / path).unlink()
    for checkpoint in (moved / "models" / "dense-seed1" / "checkpoints").iterdir():
        if checkpoint.name > "step-000030":
            shutil.rmtree(checkpoint)
    threads = torch.get_num_threads()
    try:
        outcome = run_experiment(parse_spec(TOY), moved, executor="inline", threads=1, poll=0.01)
    finally:
        torch.set_num_threads(threads)
    assert not outcome.failed and not outcome.partial
    assert (moved / "models" / "dense-seed1" / "checkpoints" / "step-000060").is_dir()
    assert_same_tables(moved, reference[0])


def test_every_shipped_spec_reads_and_expands():
    """The shipped specs: the sweep's 28 units (cse-gc-drift at seed 0 only, as it ran), the
    tables' rows, the warm-up map's 84 units (5 trunks, a plan per trunk for the structure rule,
    the arms), its second mix's 14, the controls re-run on re-made trunks (13) and the medium-scale
    hint's 12 (2 trunks, 5 arms each), the count question's 15 (3 trunks, CSE at 300 and 1200 with
    its own and the other step's counts), the calibration's one dense model and issue 60's 24 (3 trunks,
    7 arms each, the mixture of experts from scratch among them); the device is not
    part of a unit's key."""
    import dataclasses

    from ntkscope.experiments import shipped

    counts = {name: len(units(load_spec(name), "v")) for name in shipped()}
    assert counts == {"sweep": 28, "tables": 54, "tables-late": 27, "warmup-map": 84, "warmup-map-mix": 14,
                      "warmup-map-b": 13, "warmup-map-scale": 12, "warmup-map-count": 15, "tail-dense": 1,
                      "warmup-fresh": 40, "warmup-fresh-half": 24, "warmup-fresh-mix": 24, "scale-grown": 24}
    spec = load_spec("sweep")
    on_gpu = dataclasses.replace(spec, settings=spec.settings.replace(device="cuda"))
    assert [u.key for u in units(spec, "v")] == [u.key for u in units(on_gpu, "v")]
    proc = subprocess.run([sys.executable, "-m", "ntkscope", "experiment", "specs"], capture_output=True, text=True)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 13 and "warmup-map-count" in proc.stdout


@pytest.mark.parametrize("folder, name, pack", [("figures/warmup-map", "warmup-map", None),
                                                ("figures/warmup-map/count", "warmup-map-count", None),
                                                ("figures/warmup-map/scale", "warmup-map-scale", None),
                                                ("figures/warmup-map/fresh/warmup-fresh-half", "warmup-fresh-half", None),
                                                # on packs/bio-quarter (corpus thin --keep biomedical=0.25)
                                                ("figures/warmup-map/fresh/warmup-fresh-mix", "warmup-fresh-mix",
                                                 "f09095a1b64b"),
                                                # on packs/scale (corpus grow --train-tokens 9000000)
                                                ("figures/warmup-map/scale-grown", "scale-grown", "025152843bef")])
def test_the_committed_units_keep_their_keys(folder, name, pack):
    """The key of every committed unit is the one its shipped spec gives it today (the shipped pack,
    or the version ``pack`` the family ran on): a change to how arms are parsed, expanded or keyed
    cannot silently make finished units run again."""
    from ntkscope.text.corpus.pack import load_pack

    root = Path(__file__).resolve().parents[1] / folder
    committed = {s["name"]: s["key"] for s in map(json.loads, map(Path.read_text, (root / "units").glob("*.json")))}
    keys = {u.name: u.key for u in units(load_spec(name), pack or load_pack().manifest["version"])}
    assert committed and {n: keys.get(n) for n in committed} == committed


def test_a_registered_arm_kind_runs_through_a_spec(tmp_path):
    """The recipe in docs/architecture.md: one register_arm_kind call makes a kind a spec can
    name; its units run, its key holds what the kind adds, its fields are checked."""
    from ntkscope.reproduction import training
    from ntkscope.reproduction.arm_kinds import ARM_KINDS, ArmKind, register_arm_kind

    def train_same_order(sweep, arm, seed, at, every):  # the trunk continued from `at` in its own data order
        return training.train_continued(sweep.settings, sweep.model_dir(arm.name, seed), sweep.pack_arg,
                                        sweep.model_dir(sweep.trunk.name, seed), at, seed, checkpoint_every=every)

    def one_expert(sweep, arm, seed):  # its load rows: every block to one expert, at the last step
        return [{"arm": arm.name, "seed": seed, "step": sweep.settings.steps, "layer": 0, "expert": 0, "n": 7}]

    register_arm_kind(ArmKind("same-order", train_same_order, "the trunk again from the step",
                              key=lambda trunk: {"order": "the trunk's"}, load_rows=one_expert))
    try:
        with pytest.raises(UserError, match="is a registered arm kind already"):
            register_arm_kind(ArmKind("same-order", train_same_order, "twice"))
        arms = [{"name": "dense", "kind": "dense"}, {"name": "again", "kind": "same-order", "convert_at": [20]}]
        spec = load_spec(toy_file(tmp_path, seeds=[0], arms=arms, criteria={"arms": []},
                                  settings={**TOY["settings"], "steps": 30, "eval_max_blocks": 8}))
        unit = next(u for u in units(spec, "v") if u.name == "again-seed0")
        assert unit.what["order"] == "the trunk's" and unit.what["kind"] == "same-order"
        outcome = run_experiment(spec, tmp_path / "run", executor="inline", threads=0, poll=0.01)
        assert not outcome.failed, outcome.failed
        again = json.loads((tmp_path / "run" / "results" / "again-seed0.json").read_text())
        trunk = json.loads((tmp_path / "run" / "results" / "dense-seed0.json").read_text())
        assert again["kind"] == "same-order" and again["ppl"] == pytest.approx(trunk["ppl"], rel=1e-6)
        load = pd.read_csv(tmp_path / "run" / "tables" / "load.csv")
        assert load[["arm", "step", "layer", "expert", "n", "share"]].values.tolist() == [["again", 30, 0, 0, 7, 1.0]]
        with pytest.raises(SpecError, match=r"arms\[1\] \(again\).shuffled applies to kind 'cse' only"):
            load_spec(toy_file(tmp_path, arms=[arms[0], {**arms[1], "shuffled": True}]))
    finally:
        ARM_KINDS.pop("same-order", None)


def test_the_trunk_probe_measures_a_runs_trunk_at_every_checkpoint(reference_seed0, tmp_path):
    """`ntkscope experiment probe` over a finished toy run: one table per trunk, a row group per
    kept checkpoint, the domains' rows the same probe blocks at every step; a second call keeps
    the table it finds."""
    from ntkscope.experiments.probe import probe_trunks
    from ntkscope.kernel.uncertainty import Resampling

    spec = parse_spec({**TOY, "seeds": [0], "arms": KILL_ARMS})
    out = tmp_path / "probe" / "nested"
    [path] = probe_trunks(spec, reference_seed0, out, per_domain=6, resampling=Resampling(resamples=0, null_draws=0))
    table = pd.read_csv(path)
    assert path == out / "trunk-seed0.csv" and sorted(set(table.step)) == list(range(10, 70, 10))
    domains = table[table.kind == "domain"]
    assert set(domains.group) == {"general", "legal", "biomedical"} and (domains.n == 6).all()
    assert table.lr.notna().all() and set(table.layer.dropna()) == {0, 1}
    before = path.stat().st_mtime_ns
    assert probe_trunks(spec, reference_seed0, out, per_domain=6) == [path] and path.stat().st_mtime_ns == before


def test_first_moves_the_chosen_units_and_their_needs_ahead():
    """``experiment run --first``: the criteria arm's units of every seed, with the trunks and plans
    they need, come before the rest; every unit is still there, each after its needs."""
    from ntkscope.experiments.runner import prioritised

    todo = units(load_spec("warmup-fresh"), "v")
    ordered = prioritised(todo, ["cse-at1200-*"])
    names = [u.name for u in ordered]
    assert sorted(names) == sorted(u.name for u in todo)
    head = names[:15]  # 5 trunks, 5 plans, 5 criteria units
    assert {n for n in head if n.startswith("cse-")} == {f"cse-at1200-seed{s}" for s in range(5, 10)}
    assert {n.split("-seed")[0] for n in head} == {"dense", "plan", "cse-at1200"}
    position = {n: i for i, n in enumerate(names)}
    assert all(position[need] < position[u.name] for u in ordered for need in u.needs)
    assert prioritised(todo, None) == todo
    with pytest.raises(UserError, match="run_experiment: first must be globs that match units"):
        prioritised(todo, ["nothing-*"])


def test_the_expert_figure_measures_a_runs_cse_models_against_its_trunk(reference_seed0, tmp_path, capsys):
    """`ntkscope experiment experts` over a finished toy run: a row per expert of each CSE layer,
    split-half |GC| bands in [0, 1] with the paired difference between its ends; verdicts open
    with 1 of 5 seeds; a second call keeps the seed's rows."""
    from ntkscope.app.cli import main as ntkscope

    spec = toy_file(tmp_path, seeds=[0], arms=KILL_ARMS)
    out = tmp_path / "experts"
    args = ["-q", "experiment", "experts", str(reference_seed0), "--spec", str(spec), "--arm", "cse-at20",
            "--per-domain", "6", "--min-units", "4", "--draws", "20", "--out", str(out)]
    assert ntkscope(args) == 0, capsys.readouterr().err
    table = pd.read_csv(out / "experts.csv")
    assert set(table["seed"]) == {0} and set(table["step"]) == {60} and set(table["layer"]) <= {0, 1}
    assert table.groupby("layer")["units"].sum().eq(18).all()  # every probe block routed once per layer
    measured = table[table["units"] >= 4]
    for name in ("expert", "dense", "null"):
        assert measured[f"{name}_low"].between(0, 1).all() and measured[f"{name}_high"].le(1 + 1e-9).all()
        assert (measured[f"{name}_low"] <= measured[f"{name}_median"]).all()
    assert (measured["diff_low"] <= measured["diff_high"]).all()
    verdicts = json.loads((out / "verdicts.json").read_text())
    assert verdicts["experts_more_consistent"]["seeds_ran"] == 1
    assert verdicts["experts_more_consistent"]["verdict"] in {"open", "not shown"}
    assert "experts more consistent than the dense FFN" in capsys.readouterr().out
    before = (out / "experts.csv").stat().st_mtime_ns
    assert ntkscope(args) == 0 and (out / "experts.csv").stat().st_mtime_ns == before
    assert (out / "experts.png").stat().st_size > 0 or not measured["judged"].any()


def test_the_expert_verdicts_follow_criteria_on_planted_tables():
    """verdicts() on planted expert tables: 4 wins of 4 seeds measured is shown; a measured seed
    with no judged expert counts as measured without a win; open while missing seeds could decide
    it; the tail verdict counts seeds with a judged tail expert."""
    from ntkscope.experiments.experts import EXPERT_COLUMNS, verdicts

    def row(seed, more, judged=True, tail=0.0):
        values = {c: 0.5 for c in EXPERT_COLUMNS}
        values.update(seed=seed, step=2400, layer=2, expert=0, units=20, judged=judged, top_domain="general",
                      top_share=0.6, tail_share=tail, draws=200, more_consistent=more, coherent_in_dense=False)
        return values

    seeds = [5, 6, 7, 8, 9]
    four = pd.DataFrame([row(s, True, tail=0.9) for s in (5, 6, 7, 8)])
    v = verdicts(four, seeds)
    assert v["experts_more_consistent"]["verdict"] == "shown" and v["experts_more_consistent"]["seeds_ran"] == 4
    assert v["tail_experts"]["verdict"] == "shown"
    mixed = pd.DataFrame([row(5, True), row(6, False), row(7, True, judged=False)])
    v = verdicts(mixed, seeds)
    assert v["experts_more_consistent"]["seeds_ran"] == 3 and v["experts_more_consistent"]["wins"] == 1
    assert v["experts_more_consistent"]["verdict"] == "not shown"  # 1 win + 2 seeds to come < 4
    v = verdicts(pd.DataFrame([row(5, True), row(6, True)]), seeds)
    assert v["experts_more_consistent"]["verdict"] == "open"
    assert v["tail_experts"]["verdict"] == "not enough tail experts"  # 2 seeds without one: at most 3 can have one
