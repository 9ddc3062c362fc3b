"""An expert count fixed apart from the representation: fit_router's
n_clusters on planted clusters, and a sweep arm converted with another step's counts."""

import json

import numpy as np
import pytest

from ntkscope.core.checks import InputError
from ntkscope.representation.router import fit_router


def _blobs(sizes, d=16, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sizes), d)) * 10
    x = np.concatenate([c + rng.normal(size=(n, d)) for c, n in zip(centres, sizes)])
    return x, np.repeat(np.arange(len(sizes)), sizes)


def _recovered(labels, truth, blobs) -> bool:
    """Each of ``blobs`` is one fitted cluster, up to permutation (noise left out)."""
    return all(len(set(labels[(truth == b) & (labels >= 0)])) == 1 for b in blobs) and \
        len({int(np.bincount(labels[(truth == b) & (labels >= 0)]).argmax()) for b in blobs}) == len(blobs)


def test_fewer_experts_than_the_rule_finds_keep_the_largest_clusters():
    x, truth = _blobs([300, 250, 200, 120, 80])
    free = fit_router(x, representation="raw", proj_dim=16, min_cluster_size=30, max_experts=None)
    assert free.n_clusters == 5 and _recovered(free.labels, truth, range(5))
    fixed = fit_router(x, representation="raw", proj_dim=16, min_cluster_size=30, n_clusters=3)
    assert fixed.n_clusters == 3 and sorted(fixed.sizes, reverse=True) == sorted(free.sizes, reverse=True)[:3]
    assert _recovered(fixed.labels, truth, range(3)) and (fixed.labels[truth >= 3] == -1).all()


def test_more_experts_than_the_rule_finds_come_from_finer_fits():
    # two groups of three sub-clusters: at min_cluster_size 400 HDBSCAN sees the two groups
    rng = np.random.default_rng(1)
    tops = rng.normal(size=(2, 16)) * 40
    x = np.concatenate([t + s * 4 + rng.normal(size=(200, 16)) for t in tops for s in rng.normal(size=(3, 16))])
    truth = np.repeat(np.arange(6), 200)
    coarse = fit_router(x, representation="raw", proj_dim=16, min_cluster_size=400, max_experts=None)
    assert coarse.n_clusters < 6
    fixed = fit_router(x, representation="raw", proj_dim=16, min_cluster_size=400, n_clusters=6, max_experts=2)
    assert fixed.n_clusters == 6 and _recovered(fixed.labels, truth, range(6))  # max_experts does not apply


def test_a_count_hdbscan_cannot_reach_is_refused():
    x, _ = _blobs([40, 40])
    with pytest.raises(InputError, match=r"fit_router: n_clusters is more clusters than HDBSCAN finds"):
        fit_router(x, representation="raw", proj_dim=16, n_clusters=30)
    with pytest.raises(InputError, match=r"fit_router: n_clusters applies to rule 'hdbscan' only"):
        fit_router(x, rule="dbscan-knee", n_clusters=2)
    with pytest.raises(InputError, match=r"fit_router: n_clusters must be a positive integer"):
        fit_router(x, n_clusters=0)


def test_a_sweep_arm_converts_with_another_steps_counts(tmp_path):
    import tomli_w

    from ntkscope.experiments import load_spec, run_experiment

    spec = {"name": "toy-count", "kind": "sweep", "preset": "smoke", "seeds": [0],
            "settings": {"steps": 40, "checkpoint_every": 10, "early_every": 0, "cse_samples": 128,
                         "min_cluster_size": 5, "min_samples": 3, "eval_max_blocks": 20},
            "trunk": {"layers": [0, 1], "gc_peak_step": 10},
            "arms": [{"name": "dense", "kind": "dense"}, {"name": "cse", "kind": "cse", "convert_at": [10, 30]},
                     {"name": "cse-at10-k30", "kind": "cse", "convert_at": 10, "counts_from": 30}],
            "criteria": {"arms": ["cse-at10"]}}
    path = tmp_path / "toy.toml"
    path.write_text(tomli_w.dumps(spec))
    run = tmp_path / "run"
    run_experiment(load_spec(path), run, executor="inline")
    config = lambda name: json.loads((run / "models" / f"{name}-seed0" / "train_config.json").read_text())  # noqa: E731
    own = json.loads(next((run / "models" / "cse-at30-seed0" / "checkpoints").glob("step-*/config.json")).read_text())
    fixed = config("cse-at10-k30")
    assert fixed["cse"]["convert_at"] == 10 and fixed["cse"]["n_clusters"] == own["sparse"]["n_experts"]
    last = sorted((run / "models" / "cse-at10-k30-seed0" / "checkpoints").glob("step-*"))[-1]
    assert json.loads((last / "config.json").read_text())["sparse"]["n_experts"] == own["sparse"]["n_experts"]
    assert config("cse-at10")["cse"].get("n_clusters") is None
