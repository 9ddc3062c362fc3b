"""Bad input to ``ntkscope report`` and to the GC tracker: one line naming the function (or the
file), the argument, the rule and the value, never a traceback; and, as a user who is not root,
a run directory and a tracker directory that user may not write."""

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from commandline import one_line_error
import torch

from ntkscope.app.cli import main as ntkscope
from ntkscope.core.checks import InputError
from ntkscope.gc.tracker import GCTracker, Probes
from ntkscope.plotting import routing_shares
from ntkscope.text.corpus.pack import DEFAULT_PACK

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
GC_TABLE = ROOT / "figures" / "tail" / "tables" / "gc_by_bin.csv"  # a real gc table, as `ntkscope gc` writes it




# ---- ntkscope report over a damaged or foreign directory ------------------------------------------


def _gc_result(folder: Path, table: pd.DataFrame | None = None) -> Path:
    """A result directory of `ntkscope gc` (gc.csv and result.json), from the committed tail run's table."""
    folder.mkdir()
    (table if table is not None else pd.read_csv(GC_TABLE)).to_csv(folder / "gc.csv", index=False)
    (folder / "result.json").write_text(json.dumps({"options": {"n": 192}, "provenance": {"command": "ntkscope gc"}}))
    return folder


@pytest.mark.parametrize("name,text,says", [
    ("result.json", "{", "is not valid JSON"),
    ("result.json", "[1, 2]", "must hold a JSON object (got list)"),
    ("plan.json", "[1, 2]", "must hold a JSON object (got list)"),
])
def test_a_damaged_json_file_is_one_line_naming_it(tmp_path, capsys, name, text, says):
    """Row 12: result.json `{` gave a JSONDecodeError, `[1,2]` an AttributeError traceback."""
    folder = _gc_result(tmp_path / "result")
    (folder / name).write_text(text)
    err = one_line_error(capsys, ntkscope, "-q", "report", folder)
    assert err.startswith("ntkscope report: error: report: ") and str(folder / name) in err and says in err, err
    assert not (folder / "report.html").exists()


@pytest.mark.parametrize("damage,says", [
    ("no null_low", "lacks the columns ['null_low']"),
    ("no label, no n_subset", "lacks the columns ['label', 'n_subset']"),
    ("foreign columns", "lacks the columns ['label', 'abs_gc'"),  # another table's columns: one line, not a report without GC
    ("text for numbers", "column abs_gc must hold numbers"),
    ("empty", "is not a readable CSV table"),
    ("header only", "holds no rows"),
])
def test_a_gc_table_without_its_columns_is_one_line_naming_them(tmp_path, capsys, damage, says):
    """Row 12: a gc.csv without null_low gave KeyError: 'null_low'."""
    table = pd.read_csv(GC_TABLE)
    folder = _gc_result(tmp_path / "result", {
        "no null_low": table.drop(columns=["null_low"]),
        "no label, no n_subset": table.drop(columns=["label", "n_subset"]),
        "foreign columns": pd.DataFrame({"x": [1, 2], "y": [3, 4]}),
        "text for numbers": table.assign(abs_gc="high"),
        "empty": table, "header only": table.head(0)}[damage])
    if damage == "empty":
        (folder / "gc.csv").write_text("")
    err = one_line_error(capsys, ntkscope, "-q", "report", folder)
    assert str(folder / "gc.csv") in err and says in err, err


def _compare_tables(folder: Path) -> pd.DataFrame:
    """The tables/ folder of `ntkscope compare` with two sparse arms and two seeds, written by hand
    with compare's columns: comparison.csv, routing.csv (routing_table's rows, plus arm and seed)
    and result.json. Each (arm, seed, layer) gets its own counts. Returns the routing table."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    layers, domains = ["hf.gpt_neox.layers.1.mlp.layer", "hf.gpt_neox.layers.2.mlp.layer"], ["general", "legal"]
    rows = []
    for arm, unit in (("cse", "sequences"), ("switch", "tokens")):
        for seed in (0, 1):
            for layer in layers:
                counts = rng.integers(1, 50, size=(3, len(domains)))
                for e in range(3):
                    for d, domain in enumerate(domains):
                        rows.append({"layer": layer, "expert": e, "domain": domain, "unit": unit,
                                     "count": int(counts[e, d]), "share_of_domain": counts[e, d] / counts[:, d].sum(),
                                     "share_of_expert": counts[e, d] / counts[e].sum(), "arm": arm, "seed": seed})
    routing = pd.DataFrame(rows)
    routing.to_csv(folder / "routing.csv", index=False)
    comparison = pd.DataFrame([{"arm": arm, "seed": seed, "domain": domain, "texts": 10, "tokens": 200, "ppl": 50.0,
                                "ppl_low": 45.0, "ppl_high": 55.0, "vs_dense": 0.0,
                                "checkpoint": f"runs/{arm}-seed{seed}"}
                               for arm in ("dense", "cse", "switch") for seed in (0, 1) for domain in domains])
    comparison.to_csv(folder / "comparison.csv", index=False)
    (folder / "result.json").write_text(json.dumps({"arms": ["dense", "cse", "switch"], "seeds": [0, 1],
                                                    "comparison": comparison.to_dict("records"),
                                                    "provenance": {"command": "ntkscope compare ..."}}))
    return routing


def test_routing_of_several_arms_and_seeds_is_drawn_per_arm_and_seed(tmp_path):
    """Row 12: routing_shares of compare's routing.csv (two arms, two seeds) failed with
    'Index contains duplicate entries'; each (arm, seed, layer) is now its own panel, with its own shares."""
    import matplotlib.pyplot as plt

    routing = _compare_tables(tmp_path / "tables")
    fig = routing_shares(routing)
    drawn = [ax.images[0].get_array().data for ax in fig.axes if ax.images]
    assert len(drawn) == 2 * 2 * 2  # arms x seeds x layers
    for _, part in routing.groupby(["arm", "seed", "layer"]):
        expected = part.pivot(index="domain", columns="expert", values="share_of_domain").to_numpy()
        assert sum(np.allclose(image, expected) for image in drawn) == 1
    titles = " ".join(ax.get_title() + " " + ax.get_ylabel() for ax in fig.axes)
    assert all(f"{arm}, seed {seed}" in titles for arm in ("cse", "switch") for seed in (0, 1)), titles
    assert "layer 1 (mlp)" in titles and "gpt_neox" not in titles  # named by block, not "hf.gpt_neoxs.1"
    plt.close(fig)
    one = routing[(routing["arm"] == "cse") & (routing["seed"] == 0)].drop(columns=["arm", "seed"])
    fig = routing_shares(one)  # eval's table of one model: one row of panels, as before
    assert len([ax for ax in fig.axes if ax.images]) == 2
    plt.close(fig)


def test_report_of_a_compare_output_draws_its_routing(tmp_path, capsys):
    """Row 12: `ntkscope report CMP/tables` said 'this is a bug ... Index contains duplicate entries'."""
    _compare_tables(tmp_path / "cmp" / "tables")
    assert ntkscope(["-q", "report", str(tmp_path / "cmp" / "tables"), "--out", str(tmp_path / "cmp.html")]) == 0
    page = (tmp_path / "cmp.html").read_text()
    assert ">Routing</h2>" in page and ">Perplexity</h2>" in page and page.count("<img") == 1  # no probes here
    assert "ntkscope compare ..." in page
    summary = page.split("<h2>What was found</h2>", 1)[1].split("</section>", 1)[0]
    assert "Perplexity: general: cse +0.0 %, switch +0.0 % perplexity against dense (2 seeds, mean)." in summary
    assert page.count("cse +0.0 %, switch +0.0 % perplexity against dense") == 2  # general and legal, once each
    assert "<td>+0.0 %</td>" in page  # vs_dense as a percent, not a fraction


def test_routing_with_repeated_rows_is_one_line_naming_the_file(tmp_path, capsys):
    """A routing.csv with two rows for one (layer, expert, domain) of one arm and seed (two tables
    concatenated by hand) is refused by name, not drawn as one of them."""
    folder = tmp_path / "tables"
    routing = _compare_tables(folder)
    pd.concat([routing, routing.head(1)]).to_csv(folder / "routing.csv", index=False)
    err = one_line_error(capsys, ntkscope, "-q", "report", folder)
    assert str(folder / "routing.csv") in err and "more than one row" in err, err


# ---- GCTracker and GCCallback ------------------------------------------------------------------


@pytest.fixture
def probes(lm_batch):
    return Probes(lm_batch, {"a": [0, 1, 2, 3]})


def test_a_tracker_out_under_a_file_is_refused_at_construction(probes, tmp_path):
    """Row 13: out="a-file/track" with a-file a regular file gave a raw NotADirectoryError."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    under = r"^GCTracker: out must be a directory that can be made \(.*a-file is a file.*\(got '.*a-file/track'\)$"
    with pytest.raises(InputError, match=under):
        GCTracker(probes, every=1, out=a_file / "track")
    with pytest.raises(InputError, match=r"^GCTracker: out must be a directory .*\(got '.*a-file'\)$"):
        GCTracker(probes, every=1, out=a_file)
    assert a_file.read_text() == "not a directory"


def test_a_tracker_step_refuses_a_name_for_a_model_and_a_fractional_step(gpt, probes):
    """Row 13: step("gpt2", 1) gave AttributeError; step(model, 2.5) silently did nothing."""
    tracker = GCTracker(probes, every=1)
    with pytest.raises(InputError, match=r"^GCTracker.step: model must be .*torch.nn.Module.* \(got 'gpt2'\)$"):
        tracker.step("gpt2", 1)
    for bad in (2.5, -1, True, "3"):
        with pytest.raises(InputError, match=r"^GCTracker.step: step must be an integer >= 0"):
            tracker.step(gpt, bad)
    with pytest.raises(InputError, match=r"^GCTracker.probe: model must be .*torch.nn.Module"):
        tracker.probe(None, 1)
    with pytest.raises(InputError, match=r"^GCTracker.step: model must be .*torch.nn.Module"):
        tracker(1, {}, "gpt2")  # as a cse_models.train callback
    assert tracker.cost is None and tracker.rows == []  # refused before any work


def test_gc_callback_checks_what_it_is_given(gpt, probes):
    """GCCallback names itself for a tracker that is not one, a model that is not one, and a step
    that is not a step count."""
    pytest.importorskip("transformers")
    from ntkscope.gc.callbacks import GCCallback

    with pytest.raises(InputError, match=r"^GCCallback: tracker must be a GCTracker or an InRunTracker \(got 'type'\)$"):
        GCCallback(GCTracker)
    callback = GCCallback(GCTracker(probes, every=1))
    args, control = SimpleNamespace(world_size=1), SimpleNamespace()
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    with pytest.raises(InputError, match=r"^GCCallback.on_step_end: model must be .*torch.nn.Module.*\(got None\)$"):
        callback.on_step_end(args, state, control, model=None)
    with pytest.raises(InputError, match=r"^GCCallback.on_step_end: state.global_step must be an integer >= 0"):
        callback.on_step_end(args, SimpleNamespace(global_step=1.5, is_world_process_zero=True), control, model=gpt)
    with pytest.raises(InputError, match=r"^GCCallback.on_train_begin: args must be the Trainer's TrainingArguments"):
        callback.on_train_begin("args", state, control)
    assert callback.tracker.cost is None


# ---- as a user who is not root ------------------------------------------------------------------


def _nobody() -> pwd.struct_passwd:
    """User nobody, or skip: becoming another user needs root and util-linux's setpriv."""
    if os.geteuid() != 0:
        pytest.skip("becoming user nobody needs root; as a user, these permissions are tested by being one")
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user nobody")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    return user


def _as(user: pwd.struct_passwd, code: str, home: Path, timeout: int = 60) -> subprocess.CompletedProcess:
    """``python -c code`` as ``user``, in ``home`` (its HOME, TMPDIR and working directory).

    The interpreter and its packages may lie in root's home (mode 700 here), so the process keeps
    one capability, CAP_DAC_READ_SEARCH: it may read and search what root may, while every write,
    and ``os.access`` (the real user's permission bits, capabilities cleared), is checked as that
    user's: the permissions under test."""
    command = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
               "--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search", "--no-new-privs",
               sys.executable, "-c", textwrap.dedent(code)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NTKSCOPE_", "PYTEST_"))}
    env.update(HOME=str(home), TMPDIR=str(home), MPLCONFIGDIR=str(home / ".mpl"), PYTHONDONTWRITEBYTECODE="1")
    probe = subprocess.run([*command[:-3], "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot keep CAP_DAC_READ_SEARCH for {user.pw_name} here: {probe.stderr.strip()}")
    return subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def shared_tmp():
    """A folder that other users may read (pytest's tmp_path lies under a folder only root may open)."""
    folder = Path(tempfile.mkdtemp(prefix="ntkscope-nobody-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _own(path: Path, user: pwd.struct_passwd, *, writable: bool) -> None:
    """``path`` and everything under it owned by ``user``, readable by all, writable by the owner or by nobody."""
    for p in [path, *path.rglob("*")]:
        os.chown(p, user.pw_uid, user.pw_gid)
        p.chmod((0o755 if p.is_dir() else 0o644) & (~0o222 if not writable else 0o777))


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_mode)
            for p in [folder, *folder.rglob("*")]}


def test_gc_and_clusters_over_a_read_only_run_write_nothing_into_it(shared_tmp):
    """README, "a run directory we may not write": a run read-only for its user (here, nobody, who
    owns it) is analysed and its analyses cached under ~/.cache/ntkscope/runs/, never into it; and
    where that cache cannot be written either, one line saying so, not a PermissionError traceback."""
    user = _nobody()
    from cse_models import GPT, GPTConfig

    run, home = shared_tmp / "run", shared_tmp / "home"
    torch.manual_seed(0)
    checkpoint = run / "checkpoints" / "step-000002"
    GPT(GPTConfig(vocab_size=8192, block_size=32, n_layer=1, n_head=2, n_embd=16)).save_pretrained(checkpoint)
    shutil.copy(DEFAULT_PACK / "tokenizer.json", checkpoint / "tokenizer.json")
    home.mkdir()
    _own(run, user, writable=False)
    _own(home, user, writable=True)
    before = _snapshot(run)
    small = ["--n", "8", "--seq-len", "16"]
    clusters = ["clusters", str(run), *small, "--k-max", "3", "--projection-dim", "4"]
    proc = _as(user, f"""
        import contextlib, io, json, os
        from ntkscope.app.cli import main
        codes = [main(["-q", "gc", {str(run)!r}, *{small!r}, "--resamples", "8", "--null-draws", "8"]),
                 main(["-q", *{clusters!r}])]
        os.environ["NTKSCOPE_CACHE"] = {str(shared_tmp / "cache")!r}  # in a folder of root's
        with contextlib.redirect_stderr(io.StringIO()) as err:
            codes.append(main(["-q", *{clusters!r}]))
        print(json.dumps([codes, err.getvalue()]))
    """, home)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    codes, err = json.loads(proc.stdout.splitlines()[-1])
    assert codes == [0, 0, 1], proc.stderr[-4000:]
    assert _snapshot(run) == before  # nothing written, nothing touched
    cached = list((home / ".cache" / "ntkscope" / "runs").glob("run-*/step-000002-*.json"))
    assert len(cached) == 2, proc.stderr  # one GC, one cluster result
    assert len(err.strip().splitlines()) == 1 and f"run_dir {run} is not ours to write" in err, err
    assert f"{shared_tmp / 'cache'}/runs/run-" in err and "cannot be written (Permission denied)" in err, err
    assert not (shared_tmp / "cache").exists()


def test_a_tracker_into_a_read_only_directory_is_one_line(shared_tmp):
    """A tracker whose out is (or is under) a directory its user may not write: one line naming the
    directory when it is made, before any probe; a PermissionError traceback, at the first write, before."""
    user = _nobody()
    locked, home = shared_tmp / "locked", shared_tmp / "home"
    locked.mkdir()
    home.mkdir()
    _own(locked, user, writable=False)
    _own(home, user, writable=True)
    proc = _as(user, f"""
        import json
        import torch
        from ntkscope.core.checks import UserError
        from ntkscope.gc.tracker import GCTracker, Probes

        probes = Probes({{"input_ids": torch.randint(0, 50, (6, 8)), "attention_mask": torch.ones(6, 8)}},
                        {{"a": [0, 1, 2]}})
        for out in ({str(locked / "track")!r}, {str(locked)!r}):
            try:
                GCTracker(probes, every=1, out=out)
                print(json.dumps(["made", out]))
            except Exception as err:
                print(json.dumps([type(err).__name__, isinstance(err, UserError), str(err)]))
    """, home)
    assert proc.returncode == 0, proc.stderr[-4000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines()[-2:]]
    for (kind, user_error, message), out in zip(answers, (locked / "track", locked)):
        assert user_error and kind == "InputError", (kind, message)
        assert message.startswith("GCTracker: out must be a directory") and f"(got '{out}')" in message, message
        assert f"{locked} is not writable" in message and "\n" not in message, message
    assert list(locked.iterdir()) == []
