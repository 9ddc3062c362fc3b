"""The CSE router of format 2: planted structure on the sphere, normalised routing against a
brute-force argmin, turn-1 checkpoints, and clear errors."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from cse_models import GPT, GPTConfig
from cse_models.cse import convert_to_cse
from cse_models.experts import CSELayer
from cse_models.layers import MLP
from cse_models.model import load_model
from ntkscope.representation.router import fit_router, route_space

TURN1 = Path(__file__).parent / "data" / "turn1-cse"


def planted_sphere(seed=0, d=32, n_big=900, small=(30, 30, 30)):
    """A big diffuse cluster plus small compact clusters far from it, all on the unit sphere
    around a common offset (the raw embeddings share a large mean, as real ones do)."""
    rng = np.random.default_rng(seed)
    offset = rng.normal(size=d) * 3
    big = rng.normal(size=(n_big, d))
    parts, truth = [big], [np.full(n_big, -1)]
    for j, n in enumerate(small):
        direction = rng.normal(size=d)
        parts.append(direction / np.linalg.norm(direction) * 4 + rng.normal(size=(n, d)) * 0.15)
        truth.append(np.full(n, j))
    x = np.concatenate(parts)
    return offset + x / np.linalg.norm(x, axis=1, keepdims=True), np.concatenate(truth)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_router_finds_small_far_clusters_beside_a_diffuse_bulk(seed):
    x, truth = planted_sphere(seed)
    fit = fit_router(x, seed=seed)  # defaults: HDBSCAN on centred cosine
    small = [c for c in range(fit.n_clusters) if (truth[fit.labels == c] >= 0).mean() > 0.5]
    assert len(small) == 3
    routed = fit.predict(x)  # where the router sends each point
    found = np.where(np.isin(routed, small), routed, -1)  # everything else: "the bulk"
    assert adjusted_rand_score(truth, found) >= 0.9  # up to permutation
    clustered = np.where(np.isin(fit.labels, small), fit.labels, -1)  # HDBSCAN's own labels: a few bulk points join
    assert adjusted_rand_score(truth, clustered) >= 0.85


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hdbscan_from_the_distance_matrix_finds_the_clusters_of_the_tree(seed, monkeypatch):
    from ntkscope.representation import router

    x, _ = planted_sphere(seed, n_big=1500)
    z = route_space(x, x.mean(0), np.eye(x.shape[1]), True)
    brute, _ = router.cluster_labels(z)
    monkeypatch.setattr(router, "BRUTE_HDBSCAN_MAX", 0)  # the k-d tree's path
    tree, _ = router.cluster_labels(z)
    assert brute.max() == tree.max() >= 2
    # the same clusters; where mutual-reachability distances tie, the two spanning trees may
    # leave a bulk point or two on the other side of a cluster's edge (6 of 1590 at seed 1)
    assert (brute != tree).mean() < 0.01 and adjusted_rand_score(brute, tree) > 0.95


def test_knee_rule_on_raw_vectors_is_kept_as_an_explicit_choice():
    x, truth = planted_sphere(0)
    fit = fit_router(x, rule="dbscan-knee", representation="raw", proj_dim=32)
    assert fit.rule == "dbscan-knee" and fit.representation == "raw" and not fit.normalise
    np.testing.assert_array_equal(fit.mean, 0)
    assert fit.eps > 0


@pytest.mark.parametrize("normalise", [True, False])
def test_normalised_routing_equals_brute_force_argmin(normalise):
    torch.manual_seed(1)
    C, d, dp = 3, 16, 5
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=d)
    mean, M = torch.randn(d), torch.randn(dp, d)
    centres = torch.nn.functional.normalize(torch.randn(C, dp), dim=-1)
    layer = CSELayer([MLP(config) for _ in range(C)], M, centres, torch.rand(C) + 0.5, mean=mean,
                     normalise=normalise)
    x = torch.randn(6, 10, d)
    key_mask = torch.ones(6, 10, dtype=torch.bool)
    key_mask[2, 6:] = False
    z, assign = layer.route(x, key_mask)
    for b in range(6):
        v = x[b, key_mask[b]].mean(0)
        zb = M @ (v - mean)
        zb = zb / zb.norm() if normalise else zb
        torch.testing.assert_close(z[b], zb)
        scores = [float(torch.linalg.norm(zb - centres[j]) / layer.radii[j]) for j in range(C)]
        assert assign[b].item() == int(np.argmin(scores))


def test_a_fit_routes_in_the_layer_as_it_predicts():
    x, _ = planted_sphere(3)
    fit = fit_router(x, seed=0)
    np.testing.assert_allclose(np.linalg.norm(fit.transform(x), axis=1), 1.0)
    np.testing.assert_allclose(fit.transform(x), route_space(x, fit.mean, fit.projection, True))
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=x.shape[1])
    layer = CSELayer([MLP(config) for _ in range(fit.n_clusters)], torch.as_tensor(fit.projection),
                     torch.as_tensor(fit.centres), torch.as_tensor(fit.radii), mean=torch.as_tensor(fit.mean),
                     normalise=True)
    v = torch.as_tensor(x, dtype=torch.float32)
    _, assign = layer.route(v[:, None, :])
    agree = (assign.numpy() == fit.predict(x)).mean()
    assert agree > 0.999  # float32 in the layer against float64 in predict


def test_projection_comes_after_centring_and_identity_when_not_smaller():
    x, _ = planted_sphere(4)
    full = fit_router(x, proj_dim=64)
    np.testing.assert_array_equal(full.projection, np.eye(32, dtype=np.float32))
    small = fit_router(x, proj_dim=16, seed=3)
    assert small.projection.shape == (16, 32) and small.centres.shape[1] == 16
    np.testing.assert_allclose(small.mean, x.mean(axis=0), rtol=1e-5)


def test_turn1_checkpoint_loads_and_routes_as_before():
    expected = json.loads((TURN1 / "expected.json").read_text())
    model = load_model(TURN1).eval()
    sparse = model.config.sparse
    assert sparse.router_format == 1 and not sparse.normalise
    layer = model.transformer.h[1].mlp
    assert layer.mean is None and len(layer.experts) == 4
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        v = model.module_inputs(ids, None, [1])[1]
        _, assign = layer.route(v[:, None, :])
        logits = model(ids).double()
    assert assign.tolist() == expected["experts"]
    assert len(set(expected["experts"])) >= 3  # the fixture exercises several experts
    torch.testing.assert_close(logits[:, -1], torch.tensor(expected["last_logits"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def test_format2_checkpoint_round_trips(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=12, n_layer=2, n_head=2, n_embd=16,
                          sparse={"kind": "cse", "layers": [1], "n_experts": [0], "proj_dim": 128}))
    ids = torch.randint(0, 40, (60, 10), generator=torch.Generator().manual_seed(0))
    convert_to_cse(model, ids, None, min_cluster_size=5, min_samples=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["sparse"]
    assert saved["router_format"] == 2 and saved["normalise"] is True
    again = load_model(tmp_path).eval()
    model.eval()
    layer, other = model.transformer.h[1].mlp, again.transformer.h[1].mlp
    torch.testing.assert_close(other.mean, layer.mean)
    assert other.projection.shape == (16, 16)
    torch.testing.assert_close(again(ids), model(ids))


def test_bad_router_options_are_clear():
    x, _ = planted_sphere(0)
    with pytest.raises(ValueError, match=r"fit_router: rule must be one of"):
        fit_router(x, rule="kmeans")
    with pytest.raises(ValueError, match=r"fit_router: representation must be one of"):
        fit_router(x, representation="whitened")
    with pytest.raises(ValueError, match=r"fit_router: eps applies to the DBSCAN rules only; rule is 'hdbscan' \(got 0.5\)"):
        fit_router(x, eps=0.5)
    with pytest.raises(ValueError, match=r"fit_router: percentile must be in \(0, 100\) \(got 100\)"):
        fit_router(x, rule="dbscan-percentile", percentile=100)
    with pytest.raises(ValueError, match=r"SparseConfig: router_format must be one of \[1, 2\] \(got 3\)"):
        GPTConfig(n_layer=2, sparse={"kind": "cse", "layers": [1], "n_experts": [0], "router_format": 3})
    with pytest.raises(ValueError, match=r"SparseConfig: normalise needs router_format 2"):
        GPTConfig(n_layer=2, sparse={"kind": "cse", "layers": [1], "n_experts": [0], "normalise": True})


def test_cluster_purity_known_answer():
    from ntkscope.representation.structure import cluster_purity

    labels = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1])
    domains = np.array(["g", "g", "g", "g", "legal", "legal", "legal", "legal", "legal", "g", "legal", "bio"])
    got = cluster_purity(labels, domains, tail=("legal", "bio"), purity=0.8)
    assert got["n_clusters"] == 2 and got["n_noise"] == 2 and got["n_pure"] == 2 and got["n_pure_tail"] == 1
    assert got["tail_share legal"] == pytest.approx(4 / 6) and got["tail_share bio"] == 0.0
    assert got["tail_share"] == pytest.approx(4 / 7) and got["largest_share"] == pytest.approx(5 / 12)
    strict = cluster_purity(labels, domains, tail=("legal",), purity=0.9)
    assert strict["n_pure"] == 0 and strict["tail_share"] == 0.0
    with pytest.raises(ValueError, match=r"cluster_purity: domains must have one label per row \(12,\)"):
        cluster_purity(labels, domains[:5])


def test_knn_lift_and_silhouette_see_a_planted_domain():
    from ntkscope.representation.structure import domain_silhouette, knn_lift

    x, truth = planted_sphere(0)
    domains = np.where(truth == 0, "legal", "general")
    lift = knn_lift(x, domains, k=10)
    assert lift["legal"] > 20 and lift["general"] == pytest.approx(1 / (1 - 30 / 990), rel=0.02)
    sil = domain_silhouette(x, domains)
    assert sil["legal"] > 0.5 and abs(sil["general"]) < 0.5
    shuffled = np.random.default_rng(0).permutation(domains)
    assert knn_lift(x, shuffled)["legal"] < 3


def test_silhouette_k_says_no_clusters_where_the_elbow_still_finds_some():
    from sklearn.datasets import make_blobs

    from ntkscope.representation.clusters import ElbowKMeans

    noise = np.random.default_rng(0).normal(size=(300, 16))
    fit = ElbowKMeans(8).fit(noise)
    assert fit.k_ > 1 and fit.k_silhouette_ == 1  # kneedle finds an elbow in a smooth curve; silhouette says none
    assert np.nanmax(fit.silhouettes_) < 0.25 and 0 < fit.knee_strength_ < 1
    blobs, _ = make_blobs(300, centers=4, n_features=16, cluster_std=1.0, center_box=(-20, 20), random_state=0)
    assert ElbowKMeans(8).fit(blobs).k_silhouette_ == 4
