"""Primary gradient direction and GC against explicit J, and cases with known answers."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import ntkscope as ns
from tests.reference import causal_jacobian

SUBSET = [0, 2, 3, 6]


def _reference_gc(J, idx):
    K = (J @ J.T).numpy()
    u = np.linalg.eigh(K)[1][:, -1]
    u_s = np.linalg.eigh(K[np.ix_(idx, idx)])[1][:, -1]
    g = torch.from_numpy(u) @ J
    g_s = torch.from_numpy(u_s) @ J[idx]
    return abs(float(g @ g_s / (g.norm() * g_s.norm()))), g  # eigenvector signs: compare |.| then signs below


@pytest.mark.parametrize("method", ["exact", "matrix-free"])
def test_gc_matches_explicit_jacobian(gpt, lm_batch, method):
    J = causal_jacobian(gpt, lm_batch)
    ref, _ = _reference_gc(J, SUBSET)
    res = ns.gradient_consistency(gpt, lm_batch, SUBSET, method=method, chunk_size=3)
    assert res.method == method and res.n == 8 and res.n_subset == 4
    # both eigenvectors follow sum(u) > 0, so the sign of GC is defined; |GC| is what a sign-free reference fixes
    assert abs(res.score) == pytest.approx(ref, abs=1e-7)


def test_gc_methods_agree(gpt, lm_batch):
    exact = ns.gradient_consistency(gpt, lm_batch, SUBSET, method="exact")
    mf = ns.gradient_consistency(gpt, lm_batch, SUBSET, method="matrix-free")
    proj = ns.gradient_consistency(gpt, lm_batch, SUBSET, method="projected", projection_dim=4000)
    assert mf.score == pytest.approx(exact.score, abs=1e-7)
    assert proj.score == pytest.approx(exact.score, abs=0.05)
    assert exact.eigenvalue == pytest.approx(mf.eigenvalue, rel=1e-8)


@pytest.mark.parametrize("method", ["exact", "matrix-free", "projected"])
def test_gc_of_the_whole_set_is_one(gpt, lm_batch, method):
    res = ns.gradient_consistency(gpt, lm_batch, list(range(8)), method=method, projection_dim=512)
    assert res.score == pytest.approx(1.0, abs=1e-9)


def test_gc_is_one_for_parallel_gradients():
    # f(x) = w . x with every x a multiple of one vector: all per-sample gradients are parallel
    torch.manual_seed(0)
    x0 = torch.randn(5)
    X = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -0.7])[:, None] * x0
    model = nn.Linear(5, 1, bias=False)
    out = lambda m, b: m(b)[:, 0] ** 2  # noqa: E731  (gradient 2 (w.x) x: still parallel to x0)
    for method in ("exact", "matrix-free"):
        res = ns.gradient_consistency(model, X, [1, 4], output=out, method=method)
        assert abs(res.score) == pytest.approx(1.0, abs=1e-9)


def test_principal_direction_is_u_transpose_j(gpt, lm_batch):
    J = causal_jacobian(gpt, lm_batch)
    for method in ("exact", "matrix-free"):
        res = ns.principal_direction(gpt, lm_batch, method=method)
        expected = torch.from_numpy(res.eigen.eigenvector) @ J
        torch.testing.assert_close(res.vector, expected, rtol=1e-6, atol=1e-9)
        assert float(res.vector @ res.vector) == pytest.approx(res.eigen.eigenvalue, rel=1e-6)
    views = res.unflatten()
    assert views["transformer.wte.weight"].shape == (50, 16)


def test_subsets_by_indices_mask_and_label_agree(gpt, lm_batch):
    labels = np.array(["a", "b", "a", "a", "b", "b", "a", "b"])
    by_index = ns.gradient_consistency(gpt, lm_batch, SUBSET)
    mask = np.zeros(8, dtype=bool)
    mask[SUBSET] = True
    by_mask = ns.gradient_consistency(gpt, lm_batch, torch.from_numpy(mask))
    by_label = ns.gradient_consistency(gpt, lm_batch, "a", labels=labels)
    assert by_index.score == by_mask.score == by_label.score
    assert by_label.label == "a"


def test_groups_equal_single_calls_and_report_skipped(gpt, lm_batch):
    labels = [0, 1, 0, 0, 1, 1, 0, 2]
    groups = ns.gradient_consistency_groups(gpt, lm_batch, labels)
    assert set(groups.results) == {0, 1} and groups.skipped == {2: 1}
    single = ns.gradient_consistency(gpt, lm_batch, 1, labels=labels)
    assert groups.results[1].score == pytest.approx(single.score, abs=1e-12)
    frame = groups.to_frame()
    assert list(frame["label"]) == [0, 1] and list(frame["n_subset"]) == [4, 3]


def test_gc_on_hf_gpt2(hf_gpt2, lm_batch):
    J = causal_jacobian(hf_gpt2, lm_batch)
    ref, _ = _reference_gc(J, SUBSET)
    res = ns.gradient_consistency(hf_gpt2, lm_batch, SUBSET, method="matrix-free")
    assert abs(res.score) == pytest.approx(ref, abs=1e-7)
