"""Top eigenpairs: dense and matrix-free against numpy.linalg.eigh, sign convention, eigengap."""

import numpy as np
import pytest
import torch

import ntkscope as ns
from ntkscope.kernel.eigen import orient, top_eigenpair


def _psd(n, seed=0):
    A = np.random.default_rng(seed).standard_normal((n, n + 3))
    return A @ A.T


def test_dense_matches_numpy_eigh_and_sign_convention():
    K = _psd(12)
    res = top_eigenpair(K)
    w, V = np.linalg.eigh(K)
    assert res.eigenvalue == pytest.approx(w[-1], rel=1e-12)
    assert res.second_eigenvalue == pytest.approx(w[-2], rel=1e-12)
    assert res.eigengap == pytest.approx(w[-2] / w[-1], rel=1e-12)
    assert abs(res.eigenvector @ V[:, -1]) == pytest.approx(1.0, abs=1e-12)
    assert res.eigenvector.sum() > 0 and np.linalg.norm(res.eigenvector) == pytest.approx(1.0)


def test_sign_convention_when_the_sum_is_zero():
    assert list(orient(np.array([-1.0, 1.0]))) == pytest.approx([2 ** -0.5, -(2 ** -0.5)])
    assert list(orient(np.array([0.0, 3.0, -4.0]))) == pytest.approx([0.0, -0.6, 0.8])  # sum -1: flipped
    assert list(orient(np.array([0.0, -1.0, 1.0]))) == pytest.approx([0.0, 2 ** -0.5, -(2 ** -0.5)])


def test_eigengap_is_reported_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the 0.99 warning is gone: GC's statistics judge the direction
        res = top_eigenpair(np.diag([1.0, 0.995, 0.1]))
    assert res.eigengap == pytest.approx(0.995)


def test_matrix_free_matches_dense(gpt, lm_batch):
    K = ns.empirical_ntk(gpt, lm_batch, method="exact").matrix
    dense = top_eigenpair(K)
    w, V = np.linalg.eigh(K.numpy())
    mf = ns.ntk_top_eigenpair(gpt, lm_batch, method="matrix-free", chunk_size=3)
    assert mf.method == "matrix-free" and mf.matvecs > 0
    assert abs(mf.eigenvector @ V[:, -1]) > 0.9999
    assert np.allclose(mf.eigenvector, dense.eigenvector, atol=1e-6)  # same sign convention
    assert mf.eigenvalue == pytest.approx(w[-1], rel=1e-8)
    assert mf.eigengap == pytest.approx(w[-2] / w[-1], abs=1e-2)  # lambda_2 residual <= gap_tol lambda_1


def test_matrix_free_on_a_tiny_batch(gpt, lm_batch):
    small = {k: v[:3] for k, v in lm_batch.items()}
    K = ns.empirical_ntk(gpt, small).matrix.numpy()
    mf = ns.ntk_top_eigenpair(gpt, small, method="matrix-free")
    assert mf.matvecs == 3
    assert abs(mf.eigenvector @ np.linalg.eigh(K)[1][:, -1]) > 1 - 1e-10


def test_exact_and_projected_eigenpairs(gpt, lm_batch):
    exact = ns.ntk_top_eigenpair(gpt, lm_batch, method="exact")
    proj = ns.ntk_top_eigenpair(gpt, lm_batch, method="projected", projection_dim=4000)
    assert abs(exact.eigenvector @ proj.eigenvector) > 0.99
    assert proj.eigenvalue == pytest.approx(exact.eigenvalue, rel=0.1)


def test_matrix_free_with_float32_parameters(lm_batch):
    from cse_models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16)).float()
    mf = ns.ntk_top_eigenpair(model, lm_batch, method="matrix-free")
    ref = ns.ntk_top_eigenpair(model, lm_batch, method="exact", dtype="float64")
    assert abs(mf.eigenvector @ ref.eigenvector) > 0.9999


def test_one_krylov_space_gives_both_eigenvalues():
    """Known spectrum: lambda_1 to tol, lambda_2 within gap_tol * lambda_1, in fewer matvecs than n."""
    from ntkscope.kernel.eigen import krylov_top_two

    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.standard_normal((200, 200)))
    spectrum = np.concatenate([[10.0, 4.0], rng.uniform(0, 1.0, 198)])
    A = (Q * spectrum) @ Q.T
    calls = []

    def matvec(v):
        calls.append(1)
        return A @ v

    lam1, lam2, u, steps = krylov_top_two(matvec, 200, np.ones(200), tol=1e-10, gap_tol=1e-3)
    assert steps == len(calls) < 60
    assert lam1 == pytest.approx(10.0, rel=1e-9) and abs(lam2 - 4.0) <= 1e-3 * 10
    assert abs(u @ Q[:, 0]) == pytest.approx(1.0, abs=1e-9)
