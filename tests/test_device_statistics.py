"""GC's statistics as batched torch (ntkscope.kernel.device_statistics) against the host path:
the same jackknife, null bands and result fields to float rounding in float64, on CPU torch here
and on CUDA behind the gpu marker."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ntkscope as ns
from ntkscope.kernel import device_statistics, replicates
from ntkscope.kernel.device_statistics import DeviceStatistics, orient_rows
from ntkscope.kernel.nulls import Controls, check_controls
from ntkscope.kernel.uncertainty import Resampling, kernel_statistics, statistics_device

TOL = 1e-9


def planted_kernel(n: int, seed: int, tail: int = 0, rank: int = 40) -> np.ndarray:
    """A PSD kernel of n gradients in ``rank`` dimensions around a shared mean; the first
    ``tail`` of them pulled along a direction of their own (a group that differs from the bulk)."""
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(n, rank)) + 0.3
    J[:tail] += 2 * rng.normal(size=rank)
    return J @ J.T


def same(a, b, path=""):
    """Fields of two results equal: floats to TOL relative (NaN where NaN), the rest exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, tuple) and hasattr(a, "_fields"):
        for name, x, y in zip(a._fields, a, b):
            same(x, y, f"{path}.{name}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= TOL * max(1.0, abs(a)), (path, a, b)
    elif isinstance(a, np.ndarray):
        np.testing.assert_allclose(b, a, rtol=TOL, atol=TOL, equal_nan=True, err_msg=path)
    else:
        assert a == b, (path, a, b)


def test_jackknife_equals_the_host_one_delete_one_groups_and_halves():
    K = planted_kernel(90, 0, tail=20)
    members = [np.arange(20), np.arange(10, 50), np.sort(np.random.default_rng(1).choice(90, 12, replace=False))]
    device = DeviceStatistics(K, "cpu")
    for budget, halves in [(500, 20), (30, 7), (30, 1), (30, 0)]:  # delete-1; delete-a-group; one or no half
        host = replicates.jackknife(K, members, budget=budget, halves=halves, seed=4)
        batched = device.jackknife(members, budget=budget, halves=halves, seed=4)
        assert batched.deletions == host.deletions
        for name in host._fields:
            same(np.asarray(getattr(host, name), dtype=float), np.asarray(getattr(batched, name), dtype=float), name)


def test_jackknife_without_a_stratum_of_two_is_none():
    K = planted_kernel(3, 0)
    members = [np.array([0, 1]), np.array([1, 2])]  # strata {0}, {1}, {2}: nothing to leave out
    assert replicates.jackknife(K, members, budget=10, halves=2, seed=0) is None
    assert DeviceStatistics(K, "cpu").jackknife(members, budget=10, halves=2, seed=0) is None


def test_half_samples_whose_top_direction_leaves_the_whole_sets_match_the_host():
    """Two groups of gradients in orthogonal coordinates, of nearly equal strength: a half-sample's
    top eigenvector can be the other group's, orthogonal to the whole set's, which a power iteration
    started from the whole set's direction would never reach. The device solves half-samples exactly,
    as the host does."""
    rng = np.random.default_rng(0)
    J = np.zeros((60, 20))
    J[:30, :10] = rng.normal(size=(30, 10)) + 1.0
    J[30:, 10:] = rng.normal(size=(30, 10)) + 0.97
    K = J @ J.T
    members = [np.arange(30, 60)]
    host = replicates.jackknife(K, members, budget=100, halves=20, seed=0)
    assert host.half_bias[0] > 0.1  # some half-samples' top direction is the subset's own group
    same(host.half_bias, DeviceStatistics(K, "cpu").jackknife(members, budget=100, halves=20, seed=0).half_bias)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint8, np.uint32, np.uint64])
def test_subset_indices_of_any_integer_type(dtype):
    K = planted_kernel(40, 4, tail=10)
    members = [np.arange(10).astype(dtype), np.arange(5, 25).astype(dtype)]
    r = Resampling(resamples=30, null_draws=20, half_samples=4)
    for a, b in zip(kernel_statistics(K, members, r), kernel_statistics(K, members, r, device="cpu")):
        same(a, b)


def test_unconverged_power_iterations_fall_back_to_eigh(monkeypatch):
    """With one power step allowed no replicate converges: every whole set is solved by eigh,
    and the numbers stay the host's."""
    K = planted_kernel(60, 2, tail=15)
    members = [np.arange(15)]
    host = replicates.jackknife(K, members, budget=40, halves=5, seed=0)
    monkeypatch.setattr(device_statistics, "MAX_POWER", 1)
    batched = DeviceStatistics(K, "cpu").jackknife(members, budget=40, halves=5, seed=0)
    for name in ("point", "se", "bias", "half_bias", "half_sd"):
        same(getattr(host, name), getattr(batched, name), name)


def test_small_batches_give_the_same_numbers(monkeypatch):
    K = planted_kernel(50, 3, tail=10)
    members = [np.arange(10), np.arange(5, 30)]
    whole = replicates.direction(K, np.arange(50), np.ones(50))
    along, norm = whole.weights @ K, math.sqrt(whole.eigenvalue)
    rng = np.random.default_rng(0)
    subsets = [np.sort(rng.choice(50, size, replace=False)) for size in (3, 3, 20, 20, 20, 40)]
    wide = DeviceStatistics(K, "cpu")
    reference = wide.abs_gcs(along, norm, subsets), wide.jackknife(members, budget=60, halves=4, seed=1)
    monkeypatch.setattr(device_statistics, "BATCH_BYTES", 1)  # one block a batch
    narrow = DeviceStatistics(K, "cpu")
    same(reference[0], narrow.abs_gcs(along, norm, subsets))
    same(reference[1].se, narrow.jackknife(members, budget=60, halves=4, seed=1).se)


def test_null_draws_equal_the_host_ones_stacked_and_not():
    K = planted_kernel(120, 5, tail=30)
    whole = replicates.direction(K, np.arange(120), np.ones(120))
    along, norm = whole.weights @ K, math.sqrt(whole.eigenvalue)
    rng = np.random.default_rng(3)
    subsets = [np.sort(rng.choice(120, size, replace=False)) for size in [2, 5, 16, 17, 40, 40, 100] * 3]
    host = replicates.subset_abs_gcs(K, along, norm, subsets)
    same(host, DeviceStatistics(K, "cpu").abs_gcs(along, norm, subsets))
    one_by_one = [abs(replicates.subset_gc(K, along, norm, s)) for s in subsets]
    same(np.array(one_by_one), DeviceStatistics(K, "cpu").abs_gcs(along, norm, subsets))


@pytest.mark.parametrize("controls", [None, "neighbours", "pools"])
def test_kernel_statistics_fields_equal_the_host_ones(controls):
    n = 100
    K = planted_kernel(n, 7, tail=25)
    members = [np.arange(25), np.arange(25, 60), np.arange(40, 90)]
    rng = np.random.default_rng(2)
    checked = None
    if controls is not None:
        pools = [np.arange(30, 100)] if controls == "pools" else None
        checked = check_controls(Controls(homogeneous=pools, neighbours=controls == "neighbours",
                                          matched={"length": rng.normal(size=n)}), n)
    r = Resampling(resamples=80, null_draws=60, half_samples=10)
    host = kernel_statistics(K, members, r, checked)
    batched = kernel_statistics(K, members, r, checked, device="cpu")
    for a, b in zip(host, batched):
        same(a, b)
    assert host[0]["null"].draws == 60 and not math.isnan(host[0]["interval"].low)


def test_a_planted_opposing_group_keeps_its_sign_and_interval_on_the_device():
    """A group whose gradients oppose the bulk: negative GC with a confident sign, on both paths."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=30)
    J = np.concatenate([base + 0.3 * rng.normal(size=(80, 30)), -base + 0.3 * rng.normal(size=(20, 30))])
    K = J @ J.T
    members = [np.arange(80, 100)]
    [host] = kernel_statistics(K, members, Resampling(resamples=60, null_draws=40, half_samples=8))
    [batched] = kernel_statistics(K, members, Resampling(resamples=60, null_draws=40, half_samples=8), device="cpu")
    assert host["score"] < -0.9 and batched["interval"].high < 0
    same(host, batched)


def test_bootstrap_and_no_resampling_ignore_the_device():
    K = planted_kernel(40, 1, tail=8)
    members = [np.arange(8)]
    for r in (None, Resampling(interval="basic", resamples=30, null_draws=10)):
        same(kernel_statistics(K, members, r)[0], kernel_statistics(K, members, r, device="cpu")[0])


def test_sign_convention_matches_the_host():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, -1.0, 1.0], [0.0, 1.0, -1.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    out = orient_rows(w)
    assert out.sum(1).ge(0).all()
    assert out[1].tolist() == [0.0, 1.0, -1.0] and out[2].tolist() == [0.0, 1.0, -1.0]  # a zero sum: first nonzero > 0


def test_statistics_run_where_the_kernel_is():
    assert statistics_device(np.eye(3)) is None
    assert statistics_device(torch.eye(3)) is None  # a CPU tensor: the host path, the reference

    class On:
        def __init__(self, device):
            self.device = torch.device(device)

    assert statistics_device(On("cuda:0")) == torch.device("cuda", 0)
    assert statistics_device(On("mps")) is None  # no float64 there: the host path


@settings(max_examples=15, deadline=None)
@given(n=st.integers(8, 40), seed=st.integers(0, 10_000), size=st.integers(2, 7), budget=st.integers(4, 60))
def test_any_kernel_and_subset_match_the_host(n, seed, size, budget):
    rng = np.random.default_rng(seed)
    J = rng.normal(size=(n, 6)) + rng.uniform(0, 1)
    K = J @ J.T
    members = [np.sort(rng.choice(n, size, replace=False))]
    r = Resampling(resamples=budget, null_draws=12, half_samples=3, seed=seed)
    for a, b in zip(kernel_statistics(K, members, r), kernel_statistics(K, members, r, device="cpu")):
        same(a, b)


@pytest.mark.gpu
def test_cuda_statistics_equal_the_host_ones():
    K = planted_kernel(300, 11, tail=100)
    members = [np.arange(100)]
    kernel = torch.as_tensor(K, device="cuda")
    [host] = ns.kernel_gc(K, members)
    [cuda] = ns.kernel_gc(kernel, members)
    for name in ("score", "interval", "abs_interval", "null", "abs_bias", "abs_se", "sign_confidence"):
        same(getattr(host, name), getattr(cuda, name), name)
