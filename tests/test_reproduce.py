"""`ntkscope reproduce`: every stage at smoke size from nothing, its files and manifest, caching
and resume, wrong settings; per-sentence losses against a loop; the cosine kernel."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import ntkscope
from ntkscope import Reproduction, cosine_kernel, reproduce, sample_outputs
from ntkscope.reproduction import PANELS, paper

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    run = tmp_path_factory.mktemp("reproduce") / "smoke"
    return run, reproduce(run, "smoke")


def test_smoke_run_writes_every_figure_table_and_the_manifest(smoke):
    run, manifest = smoke
    for panel in PANELS:
        for fmt in ("png", "pdf"):
            path = run / "figures" / f"{panel}.{fmt}"
            assert path.stat().st_size > 1000, path
            assert manifest["files"][f"figures/{panel}.{fmt}"] == ntkscope.reproduction.pipeline.sha256_file(path)
    results = pd.read_csv(run / "tables" / "results.csv")
    assert list(results["model"]) == ["GPT dense", "GPT/legal", "GPT/biomedical", "Switch", "CSE/MoF"]
    assert np.isfinite(results["perplexity"]).all() and (results["perplexity"] > 1).all()
    assert (run / "tables" / "results.md").read_text().startswith("| model")
    seeds = pd.read_csv(run / "tables" / "seeds_summary.csv")
    assert list(seeds["model"]) == ["GPT dense", "Switch", "CSE/MoF"] and (seeds["seeds"] == 1).all()
    first = pd.read_csv(run / "tables" / "seeds.csv").query("seed == 0").set_index("model")  # seed 0: the main runs
    by_model = results.set_index("model")
    np.testing.assert_allclose(first["perplexity"], by_model.loc[first.index, "perplexity"])
    plan = manifest["plan"]
    s = manifest["settings"]
    assert 0 < plan["convert_at"] <= s["max_warmup_fraction"] * s["steps"]
    assert len(plan["layers"]) == s["sparse_layers"]
    assert set(manifest["seconds_per_stage"]) >= {"train gpt-dense", "train gpt-cse", "train gpt-switch", "fig3",
                                                  "tables"}
    assert "CPU cores" in manifest["environment"]["machine"]
    cse = ntkscope.load_checkpoint(run / "models" / "gpt-cse" / "checkpoints" / f"step-{s['steps']:06d}")
    assert cse.config.sparse.kind == "cse" and cse.config.sparse.layers == plan["layers"]


def test_every_json_file_of_a_whole_run_is_strict(smoke):
    """Every JSON and JSON-lines file a whole reproduction writes (manifest, plan, caches, each
    run's metrics, trainer states, configs) parses without NaN or Infinity (RFC 8259)."""
    run, _ = smoke
    refuse = lambda c: pytest.fail(f"{c} in a JSON file")  # noqa: E731
    files = [p for p in run.rglob("*") if p.suffix in (".json", ".jsonl")]
    assert len(files) > 50 and any(p.name == "metrics.jsonl" for p in files)
    for path in files:
        text = path.read_text()
        for line in (text.splitlines() if path.suffix == ".jsonl" else [text]):
            json.loads(line, parse_constant=refuse)


def test_every_row_of_the_papers_tables_at_smoke_size(smoke):
    """Tables 1-2 analogues: every row for BERT and GPT (one seed at smoke size: the statistics
    are tested in test_tables.py), equal extra tokens for the tuned rows, equal active
    parameters; one row's evaluation redone alone."""
    run, manifest = smoke
    s = manifest["settings"]
    keys = paper.row_keys(ntkscope.settings_for("smoke"))
    runs = pd.read_csv(run / "tables" / "paper_runs.csv")
    assert len(runs) == 2 * s["seeds"] * len(keys) and np.isfinite(runs["perplexity"]).all()
    for arch in ("gpt", "bert"):
        table = pd.read_csv(run / "tables" / f"table_{arch}.csv").set_index("key")
        assert list(table.index) == keys and (table["seeds"] == s["seeds"]).all()
        assert np.isfinite(table["perplexity mean"]).all() and table["average mean"].between(0, 1).all()
        tuned = [k for k in keys if "-" in k and not k.startswith("cse")]
        assert table.loc[tuned, "tuning_tokens"].eq(s["finetune_steps"] * s["batch_size"] * s["seq_len"]).all()
        assert (table.drop(index=tuned)["tuning_tokens"] == 0).all()
        dense = table.loc["dense", "params"]
        assert (table.loc[["cse-mof", "cse-moa", "demix"], "active_params"] == dense).all()
        width = s["model"]["n_embd"]
        assert table.loc["switch", "active_params"] == dense + width * s["switch_experts"] * len(manifest["plan"]["layers"])
        assert table.loc["demix", "experts"] == "3+3"  # biomedical, general, legal
    md = (run / "tables" / "paper.md").read_text()
    assert "## Table 1 analogue: BERT" in md and "## Table 2 analogue: GPT" in md and "## General tasks" in md
    assert manifest["files"]["tables/paper.md"]
    tests = pd.read_csv(run / "tables" / "table_tests.csv")
    assert set(tests["verdict"]) == {"not shown"}  # one seed: no spread, no difference is called
    # one row redone alone: its evaluation and the tables, nothing trained
    evaluation = run / "models" / "table-gpt-demix-seed0" / "eval.json"
    before = json.loads(evaluation.read_text())
    want = pd.read_csv(run / "tables" / "table_gpt.csv")
    evaluation.unlink()
    for name in ("paper_runs", "table_gpt", "table_bert", "general_tasks", "table_tests"):
        (run / "tables" / f"{name}.csv").unlink()
    trained = {p: p.stat().st_mtime_ns for p in (run / "models").glob("table-*/metrics.jsonl")}
    Reproduction(run, "smoke").tables("paper")
    assert json.loads(evaluation.read_text()) == before
    pd.testing.assert_frame_equal(pd.read_csv(run / "tables" / "table_gpt.csv"), want)
    assert {p: p.stat().st_mtime_ns for p in trained} == trained  # no model trained a step


def test_tables_hold_the_measurements(smoke):
    run, manifest = smoke
    rep = Reproduction(run, "smoke")
    gc = rep.tables("fig3")["gc_over_steps"]
    steps = [int(p.name.split("-")[1]) for p in sorted((run / "models" / "gpt-dense" / "checkpoints").iterdir())]
    assert list(gc["step"]) == steps and gc["gc"].between(-1, 1).all()
    router = rep.tables("fig3")["router_dynamics"]
    every = manifest["settings"]["checkpoint_every"]
    assert set(router["step"]) == {s for s in steps if s % every == 0} and set(router["layer"]) == {0, 1}
    assert {"n_pure_tail", "tail_share legal", "knn_lift legal", "silhouette general"} <= set(router.columns)
    assert router["ari"].between(-1, 1).all() and (router["knn_lift general"] > 0).all()
    routing = rep.tables("fig5")
    held_out = len(rep.held_out()["domains"])
    assert len(routing["routing"]) == held_out and routing["routing_summary"]["n"].sum() == held_out
    assert len(routing["fit_points"]) == manifest["settings"]["cse_samples"]
    shares = routing["routing_summary"].filter(like="share ").sum(axis=1)
    np.testing.assert_allclose(shares, 1.0)
    n = manifest["settings"]["n"]
    kernels = routing["kernels"]
    assert kernels["dense"].shape == (n, n)
    np.testing.assert_allclose(kernels["dense"], kernels["dense"].T, rtol=1e-5, atol=1e-8)
    for e in routing["expert_ntk"]["expert"]:
        if e != "all":
            idx = kernels[f"index {e}"]
            assert kernels[f"expert {e}"].shape == (len(idx), len(idx))
    by_bin = rep.tables("fig1")["perplexity_by_bin"]
    assert (by_bin["n"] >= manifest["settings"]["min_count"]).all()


def test_a_second_call_reuses_everything_and_a_deleted_table_is_remade(smoke):
    run, manifest = smoke
    tables = run / "tables"
    stage = ("gc_by_bin.csv", "histogram.csv", "gc_outputs.csv")  # the tables of Figure 2(a), computed together
    kept = {p.name: p.stat().st_mtime_ns for p in tables.glob("*.csv") if p.name not in stage}
    want = pd.read_csv(tables / "gc_by_bin.csv")
    (tables / "gc_by_bin.csv").unlink()
    trained = {p: p.stat().st_mtime_ns for p in (run / "models").glob("*/metrics.jsonl")}
    again = reproduce(run, "smoke")
    assert again["files"] == manifest["files"]  # the same numbers, the same figure bytes
    pd.testing.assert_frame_equal(pd.read_csv(tables / "gc_by_bin.csv"), want)
    assert {p.name: p.stat().st_mtime_ns for p in tables.glob("*.csv") if p.name in kept} == kept
    assert {p: p.stat().st_mtime_ns for p in trained} == trained  # no model was trained again


def test_a_run_directory_refuses_other_settings(smoke):
    run, _ = smoke
    with pytest.raises(ValueError, match=r"Reproduction: run_dir holds a reproduction with other settings"):
        Reproduction(run, "quick")
    rep = Reproduction(run, "smoke")
    with pytest.raises(ValueError, match=r"Reproduction.tables: figure must be one of .* \(got 'fig9'\)"):
        rep.tables("fig9")
    with pytest.raises(ValueError, match=r"Reproduction.figure: panel must be one of"):
        rep.figure("fig1c")
    with pytest.raises(ValueError, match=r"settings_for: mode must be one of"):
        ntkscope.settings_for("huge")


def test_the_command_says_one_line_on_a_wrong_run_directory(smoke, capsys):
    from ntkscope.app.cli import main

    run, _ = smoke
    assert main(["-q", "reproduce", "--quick", "--out", str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("ntkscope reproduce: error: Reproduction: run_dir holds a reproduction with other settings")


def test_notebooks_run_on_the_committed_run(tmp_path):
    """CI runs every notebook against a copy of the committed run (figures/tail): each reads the
    cached tables and must write its figures."""
    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parent.parent
    run, tables = tmp_path / "tail", tmp_path / "tables"
    shutil.copytree(root / "figures" / "tail", run)
    shutil.rmtree(run / "figures")
    shutil.copytree(root / "figures" / "tables", tables)
    (tables / "tables" / "paper.md").unlink()
    notebooks = sorted((root / "notebooks").glob("*.ipynb"))
    assert {p.stem for p in notebooks} >= {"fig1_long_tail", "fig5_experts", "tables_results", "tables_paper"}
    # every notebook's cells in order, in one kernel (one start, one torch import); `%reset -f`
    # empties the namespace between notebooks, so none can lean on another's variables
    combined = nbformat.v4.new_notebook()
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, path
        where, mode = (tables, "tables") if path.stem == "tables_paper" else (run, "tail")
        params[0].source = f"RUN_DIR = {str(where)!r}\nMODE = {mode!r}"
        combined.cells += [nbformat.v4.new_code_cell("%reset -f"), *(c for c in nb.cells if c.cell_type == "code")]
    # a researcher's notebook: CI's own `$CI` (which hides bars) is not part of it
    bar = nbformat.v4.new_code_cell("import os\nfor name in ('CI', 'NTKSCOPE_PROGRESS'):\n    os.environ.pop(name, None)\n"
                                    "from ntkscope.core.progress import progress_bar\n"
                                    "with progress_bar(3, 'in a notebook') as bar:\n    bar.update(3)")
    combined.cells.append(bar)
    NotebookClient(combined, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = {mime for out in bar.outputs for mime in out.get("data", {})}  # a progress bar shows as a widget
    assert "application/vnd.jupyter.widget-view+json" in shown, bar.outputs
    for panel in PANELS:
        for fmt in ("png", "pdf"):
            assert (run / "figures" / f"{panel}.{fmt}").stat().st_size > 1000, (panel, fmt)
    assert (run / "tables" / "results.md").stat().st_size > 100
    assert "## Table 1 analogue: BERT" in (tables / "tables" / "paper.md").read_text()
    assert not (run / "models").exists() and not (tables / "models").exists()  # nothing was trained


def test_sample_outputs_match_a_loop_in_float64():
    from cse_models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=12, n_layer=1, n_head=2, n_embd=16)).double()
    ids = torch.randint(0, 50, (5, 12))
    mask = torch.ones(5, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[3, 4:] = 0
    got = sample_outputs(model, {"input_ids": ids, "attention_mask": mask}, chunk_size=2)
    for i in range(5):
        n = int(mask[i].sum())
        logits = model(ids[i:i + 1, :n])[0]
        want = torch.nn.functional.cross_entropy(logits[:-1], ids[i, 1:n])
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="sample_outputs: chunk_size must be a positive integer"):
        sample_outputs(model, ids, chunk_size=0)


def test_cosine_kernel_known_answer():
    g = np.array([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    got = cosine_kernel(g @ g.T)
    want = np.array([[1, 1, 1 / math.sqrt(2)], [1, 1, 1 / math.sqrt(2)], [1 / math.sqrt(2), 1 / math.sqrt(2), 1]])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match=r"cosine_kernel: matrix must be a square \(n, n\) kernel"):
        cosine_kernel(np.ones((2, 3)))


def test_the_committed_notebooks_show_the_calls_the_panels_make():
    """Each panel's call is written once (panels.PANELS); the committed notebooks' cells are what
    scripts/make_notebooks.py writes from it, so a comment cannot drift from what is drawn."""
    import importlib.util

    import nbformat

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_notebooks", root / "scripts" / "make_notebooks.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    for name, cells in make.NOTEBOOKS.items():
        committed = nbformat.read(root / "notebooks" / f"{name}.ipynb", as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in make.build(name, cells).cells], name
