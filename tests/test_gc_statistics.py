"""GC's uncertainty (docs/design.md §1.1): planted structure, slow references, the null band's
coverage and the new outputs against per-sample autograd (the warm-up rule built on them:
tests/test_warmup_rule.py)."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ntkscope as ns
from ntkscope.kernel import replicates as R
from ntkscope.kernel import uncertainty as U
from ntkscope.kernel.objectives import resolve_output
from tests.reference import jacobian_loop, masked_jacobian


def _one_direction(n=60, P=12, noise=0.05, seed=0):
    """Inputs x_i = a_i d + noise with a_i > 0: f = w . x has gradients x_i, one strong shared direction."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(P, generator=g)
    a = 0.5 + torch.rand(n, generator=g)
    return a[:, None] * d + noise * torch.randn(n, P, generator=g)


def _linear(P=12):
    torch.manual_seed(0)
    return nn.Linear(P, 1, bias=False)


def _f(m, x):
    return m(x)[:, 0]


def test_one_shared_direction_gives_narrow_intervals_full_sign_confidence_and_no_flag():
    X = _one_direction()
    res = ns.gradient_consistency(_linear(), X, list(range(12)), output=_f, method="exact")
    assert res.score > 0.99 and res.flags == () and not res.ill_defined
    assert res.sign_confidence == 1.0 and res.signed == res.score
    assert res.interval.width < 0.02 and res.abs_interval.width < 0.02
    assert res.eigengap < 0.05 and res.cos_ones > 0.95 and res.mean_gradient > 0.99
    assert res.resampling == ns.Resampling() and res.null.draws == 200


def test_a_doubled_top_eigenvalue_raises_the_flag_and_makes_the_sign_a_coin_toss():
    rng = np.random.default_rng(3)
    n = 60
    V, _ = np.linalg.qr(rng.normal(size=(n, n)))
    K = (V * np.r_[10.0, 10.0, rng.uniform(0, 1, n - 2)]) @ V.T  # lambda_1 = lambda_2
    res, = ns.kernel_gc(K, [np.arange(10)], resampling=ns.Resampling(resamples=400))
    assert res.eigengap == pytest.approx(1.0) and {"eigengap", "sign"} <= set(res.flags) and res.ill_defined
    assert 0.35 < res.sign_confidence < 0.65
    assert res.interval.width > 0.5
    assert np.isnan(res.signed)


def test_resampled_kernels_are_weighted_not_duplicated():
    # the bootstrap's shortcut (distinct samples, weights sqrt(c)) against the kernel with repeated rows
    rng = np.random.default_rng(0)
    J = rng.normal(size=(9, 5))
    K = J @ J.T
    counts = np.array([2, 0, 1, 3, 0, 1, 1, 0, 1])
    members = [np.array([0, 3, 5]), np.array([6, 7, 8])]
    whole, subs = R.statistics(K, counts, members)
    rows = np.repeat(np.arange(9), counts)  # the resample, written out
    Kd = K[np.ix_(rows, rows)]
    vals, vecs = np.linalg.eigh(Kd)
    u = vecs[:, -1] * np.sign(vecs[:, -1].sum())
    assert whole.eigenvalue == pytest.approx(vals[-1]) and whole.eigengap == pytest.approx(vals[-2] / vals[-1])
    assert whole.cos_ones == pytest.approx(u.sum() / np.sqrt(len(rows)))
    for idx, (gc, sub, mean) in zip(members, subs):
        inside = np.flatnonzero(np.isin(rows, idx))
        Ks = Kd[np.ix_(inside, inside)]
        vs, ws = np.linalg.eigh(Ks)
        us = ws[:, -1] * np.sign(ws[:, -1].sum())
        g, gs = u @ J[rows], us @ J[rows[inside]]
        assert gc == pytest.approx(g @ gs / np.linalg.norm(g) / np.linalg.norm(gs), abs=1e-10)
        m, ms = J[rows].mean(0), J[rows[inside]].mean(0)
        assert mean == pytest.approx(m @ ms / np.linalg.norm(m) / np.linalg.norm(ms), abs=1e-10)


def test_null_band_covers_random_subsets_at_its_level():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    X = torch.randn(48, 6)
    K = ns.empirical_ntk(model, X, output=_f, method="exact").matrix.numpy()
    size = 10
    res, = ns.kernel_gc(K, [np.arange(size)], resampling=ns.Resampling(resamples=0, null_draws=1000, seed=1))
    rng = np.random.default_rng(123)  # fresh subsets, independent of the band's draws
    fresh = ns.kernel_gc(K, [rng.choice(48, size, replace=False) for _ in range(300)], resampling=None)
    inside = np.mean([res.null.low <= abs(r.score) <= res.null.high for r in fresh])
    assert 0.84 <= inside <= 0.96  # nominal 0.90; 300 draws: sd 0.017


def test_every_gc_interval_contains_its_point_and_matches_the_groups_call(gpt, lm_batch):
    labels = np.array(["a", "b", "a", "a", "b", "b", "a", "b"])
    groups = ns.gradient_consistency_groups(gpt, lm_batch, labels, resampling=ns.Resampling(resamples=50, seed=4))
    one = ns.gradient_consistency(gpt, lm_batch, "a", labels=labels, resampling=None)
    assert groups.results["a"].score == pytest.approx(one.score, abs=1e-12)
    for r in groups.results.values():
        assert r.interval.low <= r.score <= r.interval.high
        assert r.abs_interval.low <= abs(r.score) <= r.abs_interval.high
        assert r.mean_gradient_interval.low <= r.mean_gradient <= r.mean_gradient_interval.high
        assert 0 <= r.sign_confidence <= 1 and r.versus_null in ("above", "below", "within")
    frame = groups.to_frame()
    assert {"abs_gc_low", "null_high", "sign_confidence", "mean_gradient", "flags", "seed"} <= set(frame.columns)
    assert one.interval == U._NAN and one.null.draws == 0 and one.flags == ()


def test_mean_gradient_consistency_against_explicit_j_for_every_method(gpt, lm_batch):
    from tests.reference import causal_jacobian

    J = causal_jacobian(gpt, lm_batch)
    subset = [0, 2, 3, 6]
    m, ms = J.mean(0), J[subset].mean(0)
    expected = float(m @ ms / (m.norm() * ms.norm()))
    for method in ("exact", "matrix-free"):
        res = ns.gradient_consistency(gpt, lm_batch, subset, method=method)
        assert res.mean_gradient == pytest.approx(expected, abs=1e-9)
    mf = ns.gradient_consistency(gpt, lm_batch, subset, method="matrix-free")
    assert np.isnan(mf.interval.low) and mf.null.draws == 0  # no kernel: no interval, no band
    ex = ns.gradient_consistency(gpt, lm_batch, subset, method="exact")
    assert mf.cos_ones == pytest.approx(ex.cos_ones, abs=1e-7)


@pytest.mark.parametrize("value", ["true-logit", "centred-true-logit"])
def test_true_logit_outputs_match_per_sample_autograd_causal(gpt, lm_batch, value):
    ids, mask = lm_batch["input_ids"], lm_batch["attention_mask"]

    def f(i):
        n = int(mask[i].sum())
        logits = gpt(input_ids=ids[i : i + 1, :n])[0, :-1]  # (n-1, V): position t predicts token t+1
        true = logits.gather(1, ids[i, 1:n, None])[:, 0]
        return (true - logits.mean(1) if value == "centred-true-logit" else true).mean()

    J = jacobian_loop(gpt, 8, f)
    res = ns.empirical_ntk(gpt, lm_batch, output=value, method="exact")
    torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-9, atol=1e-12)
    values = ns.sample_outputs(gpt, lm_batch, output=value)
    torch.testing.assert_close(values, torch.stack([f(i) for i in range(8)]).detach())


def test_true_logit_outputs_match_per_sample_autograd_masked(hf_bert, lm_batch):
    output = ns.LMLoss(objective="masked", mask_token_id=1, mask_prob=0.3, seed=7, value="centred-true-logit")
    res = ns.empirical_ntk(hf_bert, lm_batch, output=output, method="exact")
    objective = resolve_output(output, hf_bert)
    J = masked_jacobian(hf_bert, lm_batch, objective,
                        lambda logits, targets: (logits.gather(1, targets[:, None])[:, 0] - logits.mean(1)).mean())
    torch.testing.assert_close(res.matrix, J @ J.T, rtol=1e-9, atol=1e-12)
    loss = ns.sample_outputs(hf_bert, lm_batch, output=ns.LMLoss(objective="masked", mask_token_id=1, mask_prob=0.3,
                                                                   seed=7))
    assert not torch.allclose(loss, ns.sample_outputs(hf_bert, lm_batch, output=output))


def test_token_values_reduce_like_the_loss():
    from ntkscope.core.lm import token_values

    logits = torch.randn(2, 4, 5)
    targets = torch.tensor([[1, 2, -100, 4], [0, -100, -100, 3]])
    got = token_values(logits, targets, value="centred-true-logit")
    expected = [torch.stack([logits[b, t, targets[b, t]] - logits[b, t].mean() for t in range(4)
                             if targets[b, t] != -100]).mean() for b in range(2)]
    torch.testing.assert_close(got, torch.stack(expected))
    loss = token_values(logits, targets, value="loss")
    torch.testing.assert_close(loss[0], F.cross_entropy(logits[0, [0, 1, 3]], targets[0, [0, 1, 3]]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(resamples=-1), r"Resampling: resamples must be a non-negative integer \(got -1\)"),
    (dict(confidence=1.0), r"Resampling: confidence must be a number strictly between 0 and 1"),
    (dict(interval="percentile"), r"Resampling: interval must be one of \['basic', 'bca', 'jackknife'\]"),
    (dict(max_eigengap=2), r"Resampling: max_eigengap must be a number in \[0, 1\]"),
])
def test_resampling_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ns.Resampling(**kwargs)


def test_kernel_gc_refuses_bad_input():
    with pytest.raises(ValueError, match=r"kernel_gc: kernel must be symmetric"):
        ns.kernel_gc(np.triu(np.ones((4, 4))), [[0, 1]])
    with pytest.raises(ValueError, match=r"kernel_gc: subsets must each hold at least 2 distinct indices in \[0, 4\)"):
        ns.kernel_gc(np.eye(4), [[0, 0]])
    with pytest.raises(ValueError, match=r"gradient_consistency: resampling must be a Resampling or None"):
        ns.gradient_consistency(_linear(), _one_direction(), [0, 1], output=_f, resampling=100)


# ---- calibration against planted pools, and the controls ----------------------------------------


def test_jackknife_matches_an_explicit_leave_one_out_loop():
    rng = np.random.default_rng(5)
    J = rng.normal(size=(14, 6)) + np.r_[2.0, 1.0, 0, 0, 0, 0]
    K = J @ J.T
    members = [np.arange(0, 5), np.arange(5, 9)]
    jk = R.jackknife(K, members, budget=100, halves=0, seed=0)

    def gc(rows, sub):  # |cos| of the two top right singular vectors, from J itself
        top = lambda A: np.linalg.svd(A)[2][0]  # noqa: E731
        return abs(top(J[rows]) @ top(J[sub]))

    point = np.array([gc(np.arange(14), m) for m in members])
    strata = [np.arange(0, 5), np.arange(5, 9), np.arange(9, 14)]
    var, bias = np.zeros(2), np.zeros(2)
    for unit in strata:
        reps = np.array([[gc(np.delete(np.arange(14), i), np.setdiff1d(m, [i])) for m in members] for i in unit])
        g = len(unit)
        var += (g - 1) / g * ((reps - reps.mean(0)) ** 2).sum(0)
        bias += (g - 1) * (reps.mean(0) - point)
    np.testing.assert_allclose(jk.point[2:4], point, atol=1e-10)
    np.testing.assert_allclose(jk.se[2:4], np.sqrt(var), atol=1e-10)
    np.testing.assert_allclose(jk.bias[2:4], bias, atol=1e-10)
    assert jk.deletions == 14


@pytest.mark.parametrize("pool", [ns.PlantedPool(noise=0.15), ns.PlantedPool(noise=0.4),
                                  pytest.param(ns.PlantedPool(shares=(0.3, 0.35, 0.35), noise=0.3),
                                               marks=pytest.mark.slow)],
                         ids=["high-gc", "noisy", "large-tail"])
def test_the_interval_covers_the_finite_n_target_on_planted_pools(pool):
    # the target: the mean |GC| of independent draws of the same sizes; 100 draws: sd of coverage 0.03
    table = ns.interval_calibration(pool, 96, draws=100, truth_draws=200,
                                    resampling=ns.Resampling(null_draws=0, resamples=48, half_samples=0))
    assert table["target"].min() < 0.45 and table["target"].max() > 0.75  # low and high GC in every pool
    assert table["coverage"].between(0.80, 0.98).all(), table
    assert (table["median_width_over_sd"] <= 4).all(), table


def test_the_large_sample_estimate_covers_the_known_limit_where_claimed():
    pool = ns.PlantedPool(noise=0.15)  # the limit is known exactly (PlantedPool.large_sample_gc)
    table = ns.interval_calibration(pool, 96, draws=50, truth_draws=100,
                                    resampling=ns.Resampling(null_draws=0, resamples=48, half_samples=20))
    np.testing.assert_allclose(table["large_sample"], pool.large_sample_gc(), atol=1e-12)
    claimed = table["claimed"] * 50
    assert claimed.sum() >= 10, table  # claimed in some draws, refused in the others (bias not O(1/n))
    covered = (table["large_coverage"].fillna(0) * claimed).sum() / claimed.sum()
    assert covered >= 0.8, table


def _sources(n=120, seed=0):
    """Gradients of three sources: ordinary A and B (45 % each, own directions) and a tail T (10 %)."""
    pool = ns.PlantedPool(shares=(0.1, 0.45, 0.45), strength=(2.0, 1.0, 1.0), noise=0.25)
    J = pool.draw(n, np.random.default_rng(seed))
    return J @ J.T, pool.labels(n)


def test_a_homogeneous_group_is_below_the_random_null_and_within_the_homogeneous_one():
    K, labels = _sources(240)  # large enough for the group's interval, not only its point, to clear the band
    a, b = np.flatnonzero(labels == 1), np.flatnonzero(labels == 2)
    rng = np.random.default_rng(1)
    group = np.sort(rng.choice(a, 48, replace=False))  # one ordinary source, no tail
    tail = np.flatnonzero(labels == 0)
    for controls in (ns.Controls(homogeneous=[a, b]), ns.Controls()):  # pools, then gradient neighbours
        res_group, res_tail = ns.kernel_gc(K, [group, tail], controls=controls,
                                           resampling=ns.Resampling(resamples=60, null_draws=100))
        assert res_group.versus_null == "below" and res_group.versus("homogeneous") == "within", res_group.controls
        assert res_tail.versus_null == "below" and res_tail.versus("homogeneous") == "below"
        assert res_group.row()["versus_homogeneous"] == "within"
    with pytest.raises(ValueError, match=r"control must be 'random' or one of this result's controls"):
        res_group.versus("length")


def test_a_matched_null_keeps_the_subsets_counts_per_covariate_bin():
    from ntkscope.kernel.nulls import matched_band

    K, labels = _sources()
    length = np.arange(120) % 10  # a covariate the tail shares with nothing
    tail = np.flatnonzero(labels == 0)
    whole, _ = R.statistics(K, np.ones(120, dtype=np.int64), [tail])
    seen = []
    real_gcs = R.subset_abs_gcs

    def spy(K_, along, norm, subsets):
        seen.extend(subsets)
        gcs = real_gcs(K_, along, norm, subsets)
        for rows, gc in zip(subsets, gcs):  # the band's shortcut against the whole statistics
            _, ((direct, _, _),) = R.statistics(K_, np.ones(len(K_), dtype=np.int64), [rows])
            assert gc == pytest.approx(abs(direct), abs=1e-10)
        return gcs

    import ntkscope.kernel.nulls as N
    N.subset_abs_gcs, before = spy, N.subset_abs_gcs
    try:
        band = matched_band(K, whole, tail, length.astype(float), 5, draws=20, confidence=0.9, seed=0)
    finally:
        N.subset_abs_gcs = before
    bins = np.searchsorted(np.unique(np.quantile(length, np.linspace(0, 1, 6)[1:-1])), length, side="right")
    assert band.draws == 20 and len(seen) == 20
    for drawn in seen:
        np.testing.assert_array_equal(np.bincount(bins[drawn], minlength=5), np.bincount(bins[tail], minlength=5))


def test_controls_refuse_bad_input():
    K, _ = _sources()
    with pytest.raises(ValueError, match=r"kernel_gc: controls.homogeneous must be pools of at least 2 indices"):
        ns.kernel_gc(K, [[0, 1]], controls=ns.Controls(homogeneous=[[0, 500]]))
    with pytest.raises(ValueError, match=r"kernel_gc: controls.matched\['length'\] must hold one finite value"):
        ns.kernel_gc(K, [[0, 1]], controls=ns.Controls(matched={"length": np.ones(3)}))
    with pytest.raises(ValueError, match=r"Controls: quantiles must be a positive integer"):
        ns.Controls(quantiles=0)


def test_the_experts_mean_cosine_and_its_jackknife_against_a_leave_one_out_loop():
    from ntkscope.reproduction.analyses import mean_cosine

    rng = np.random.default_rng(2)
    J = rng.normal(size=(9, 4)) + 1.0
    K = J @ J.T
    C = K / np.sqrt(np.outer(np.diag(K), np.diag(K)))

    def off(M):
        return (M.sum() - np.trace(M)) / (len(M) * (len(M) - 1))

    left = np.array([off(np.delete(np.delete(C, i, 0), i, 1)) for i in range(9)])
    point, se = mean_cosine(K)
    assert point == pytest.approx(off(C), abs=1e-12)
    assert se == pytest.approx(np.sqrt(8 / 9 * ((left - left.mean()) ** 2).sum()), abs=1e-12)
    assert np.isnan(mean_cosine(K[:2, :2])[1]) and np.isnan(mean_cosine(K[:1, :1])[0])


def test_analysis_controls_match_on_length_and_the_outputs_own_loss(hf_bert, gpt, lm_batch):
    from ntkscope.gc.groups import analysis_controls

    masked = ns.LMLoss(objective="masked", mask_token_id=1, mask_prob=0.3, seed=7, value="centred-true-logit")
    controls = analysis_controls(hf_bert, lm_batch, output=masked)  # the masked objective's own mask settings
    expected = ns.sample_outputs(hf_bert, lm_batch, output=ns.LMLoss(objective="masked", mask_token_id=1,
                                                                      mask_prob=0.3, seed=7))
    np.testing.assert_allclose(controls.matched["loss"], expected.double().numpy())
    np.testing.assert_array_equal(controls.matched["length"], lm_batch["attention_mask"].sum(1).numpy())
    assert controls.names() == ["homogeneous", "matched-length", "matched-loss"]
    assert "loss" not in analysis_controls(gpt, lm_batch, output=_f).matched  # not a language model's output
    res = ns.gradient_consistency(gpt, lm_batch, [0, 2, 3, 6], controls=analysis_controls(gpt, lm_batch),
                                  resampling=ns.Resampling(resamples=20, null_draws=20))
    assert set(res.controls) == {"homogeneous", "matched-length", "matched-loss"}


@pytest.mark.parametrize("which", ["gpt", "hf_bert"])
def test_the_loss_matched_null_reads_its_losses_from_the_kernels_own_forward(which, request, lm_batch):
    """The structured kernel's forward keeps each sample's loss: equal to a forward of its own, so
    the matched band is the same band; a method with no such forward (exact) runs that forward."""
    from ntkscope.gc.groups import analysis_controls
    from ntkscope.kernel.nulls import KernelLoss

    model = request.getfixturevalue(which)
    masked = dict(objective="masked", mask_token_id=1, mask_prob=0.3, seed=7)
    output = "centred-true-logit" if which == "gpt" else ns.LMLoss(**masked, value="centred-true-logit")
    loss = ns.sample_outputs(model, lm_batch, output="loss" if which == "gpt" else ns.LMLoss(**masked))
    ntk = ns.empirical_ntk(model, lm_batch, output=output, method="structured", sample_loss=True)
    np.testing.assert_allclose(ntk.sample_loss, loss.double().numpy(), rtol=1e-5)
    assert ns.empirical_ntk(model, lm_batch, output=output, method="exact", sample_loss=True).sample_loss is None
    assert ns.empirical_ntk(model, lm_batch, output=output, method="structured").sample_loss is None
    lazy = analysis_controls(model, lm_batch, output=output, loss_from="kernel")
    assert isinstance(lazy.matched["loss"], KernelLoss)
    r = ns.Resampling(resamples=20, null_draws=30)
    for method in ("structured", "exact"):
        read = ns.gradient_consistency(model, lm_batch, [0, 2, 3, 6], output=output, method=method, resampling=r,
                                       controls=lazy)
        own = ns.gradient_consistency(model, lm_batch, [0, 2, 3, 6], output=output, method=method, resampling=r,
                                      controls=analysis_controls(model, lm_batch, output=output))
        assert read.controls["matched-loss"] == pytest.approx(own.controls["matched-loss"], abs=1e-9, nan_ok=True)
        assert read.score == own.score
    with pytest.raises(ValueError, match="kernel_gc: controls must give each covariate as values"):
        ns.kernel_gc(ntk.matrix, [[0, 2, 3]], controls=lazy)
    with pytest.raises(ValueError, match="analysis_controls: loss_from must be one of"):
        analysis_controls(model, lm_batch, loss_from="probe")


def test_planted_pools_refuse_bad_settings():
    with pytest.raises(ValueError, match=r"PlantedPool: shares must be positive and sum to 1"):
        ns.PlantedPool(shares=(0.5, 0.6), strength=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"PlantedPool: dim must be a positive integer \(got 0\)"):
        ns.PlantedPool(dim=0)
    with pytest.raises(ValueError, match=r"interval_calibration: n must be an integer of at least 2 samples per group"):
        ns.interval_calibration(ns.PlantedPool(), 4)


def test_a_verdict_needs_the_interval_to_clear_the_band():
    from ntkscope.kernel.nulls import NullBand

    band = NullBand(0.91, 0.93, 0.95, 200)
    assert band.versus(0.89) == "below"  # a point alone
    assert band.versus(0.89, (0.82, 0.96)) == "within"  # the interval reaches into the band (a tail bin of the committed run)
    assert band.versus(0.84, (0.80, 0.88)) == "below" and band.versus(0.97, (0.96, 0.99)) == "above"
    assert band.versus(0.89, (float("nan"), float("nan"))) == "below"  # no interval: the point
    assert NullBand(float("nan"), float("nan"), float("nan"), 0).versus(0.5, (0.4, 0.6)) == "n/a"


def test_the_committed_verdicts_follow_the_interval_rule():
    """Every versus_* of the committed GC tables is its interval against its band."""
    from pathlib import Path

    from ntkscope.kernel.nulls import NullBand

    root = Path(__file__).resolve().parents[1]
    for path in [*(root / "figures" / "tail" / "tables").glob("gc_*.csv"), *(root / "docs").glob("gc-*-quick.csv")]:
        table = pd.read_csv(path)
        for column in [c for c in table.columns if c.startswith("versus_")]:
            name = column.removeprefix("versus_")
            low, high = ("null_low", "null_high") if name == "null" else (f"null_{name}_low", f"null_{name}_high")
            for _, r in table[table[low].notna() & table[column].notna()].iterrows():
                band = NullBand(r[low], np.nan, r[high], 1)
                assert r[column] == band.versus(r["abs_gc"], (r["abs_gc_low"], r["abs_gc_high"])), (path.name, column)


def test_the_jackknife_interval_uses_t_on_satterthwaite_degrees_of_freedom():
    rng = np.random.default_rng(0)
    J = rng.normal(size=(30, 8)) + np.array([2.0] + [0.0] * 7)
    K = J @ J.T
    members = [np.arange(30)]  # one stratum, delete-1: df = n - 1 exactly
    jk = R.jackknife(K, members, budget=200, halves=0, seed=0)
    assert np.allclose(jk.df[np.isfinite(jk.df)], 29)
    sub = np.arange(10)
    jk2 = R.jackknife(K, [sub], budget=200, halves=0, seed=0)  # two strata of 10 and 20: df between 9 and 28
    assert np.all((jk2.df[np.isfinite(jk2.df)] >= 9 - 1e-9) & (jk2.df[np.isfinite(jk2.df)] <= 28 + 1e-9))
    res = ns.kernel_gc(K, [sub], resampling=ns.Resampling(null_draws=0, half_samples=0))[0]
    import scipy.stats

    t = scipy.stats.t.ppf(0.95, jk2.df[1])  # the abs statistic of subset 0 of 1
    lo, hi = res.abs_interval
    if 0 < lo and hi < 1:
        assert hi - lo == pytest.approx(2 * t * res.abs_se)
    assert t > 1.645


def test_planted_noise_that_is_anisotropic_or_heavy_tailed_keeps_its_exact_large_sample_value():
    pool = ns.PlantedPool(dim=16, spectrum=1.0, df=5, noise=0.3)
    J = pool.draw(200_000, np.random.default_rng(0))
    labels = pool.labels(200_000)

    def top(A):
        return np.linalg.eigh(A.T @ A)[1][:, -1]

    whole = top(J)
    measured = [abs(whole @ top(J[labels == k])) for k in range(3)]
    assert np.allclose(measured, pool.large_sample_gc(), atol=0.02)
    e = (J - pool.means()[labels]) / pool.noise
    assert np.allclose(e.T @ e / len(e), pool.covariance(), atol=0.03)
    with pytest.raises(ValueError, match="PlantedPool.*df.*above 2"):
        ns.PlantedPool(df=2)
    with pytest.raises(ValueError, match="PlantedPool.*spectrum"):
        ns.PlantedPool(spectrum=-1)


def test_the_real_kernel_calibration_draws_are_disjoint():
    """scripts/gc_calibration.py --disjoint: every validation and test sentence at most once,
    draws of exactly n, as many as the splits hold."""
    import importlib.util
    from pathlib import Path

    from ntkscope.text.corpus.pack import load_pack
    from ntkscope.text.inputs import as_source

    path = Path(__file__).resolve().parents[1] / "scripts" / "gc_calibration.py"
    spec = importlib.util.spec_from_file_location("gc_calibration", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pack = load_pack()
    draws = script.disjoint_draws(pack, 192)
    seen = [(split, int(i)) for split, rows, _, _ in draws for i in rows]
    assert len(seen) == len(set(seen)) == 192 * len(draws)
    sizes = {s: len(as_source(str(pack.path)).rows(s)) for s in ("validation", "test")}
    assert len(draws) == sum(n // 192 for n in sizes.values())
    assert all(b["input_ids"].shape[0] == len(s) == 192 for _, _, b, s in draws)
    # each draw is the sentences it names: its rows of the split's own encoding
    split, rows, batch, _ = draws[-1]
    whole = ns.load_analysis_data(str(pack.path), pack.tokenizer(), n=sizes[split], seq_len=48, seed=7, split=split)
    T = batch["input_ids"].shape[1]
    assert torch.equal(whole.batch["input_ids"][rows, :T], batch["input_ids"])


def test_the_jackknife_reuses_a_subset_no_deletion_touches_with_the_same_numbers(monkeypatch):
    """A deletion outside a subset leaves its block as it was: its direction is reused, and every
    number of the jackknife is the one that solving it again gives."""
    K, members = _planted_groups()
    calls = []
    top = R._top
    monkeypatch.setattr(R, "_top", lambda block, counts: calls.append(1) or top(block, counts))
    fast = R.jackknife(K, members, budget=200, halves=6, seed=3)
    reused = len(calls)
    calls.clear()
    values = R.values
    monkeypatch.setattr(R, "values", lambda K, counts, members, kept=None, whole=None: values(K, counts, members,
                                                                                              None, whole))
    slow = R.jackknife(K, members, budget=200, halves=6, seed=3)
    assert len(calls) > reused
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)


def _planted_groups(n=36, P=10, seed=4):
    """A kernel of three disjoint groups of gradients with their own mean directions, and the groups."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(3, P))
    labels = np.repeat([0, 1, 2], n // 3)
    G = means[labels] + 0.8 * rng.normal(size=(n, P))
    return G @ G.T, [np.flatnonzero(labels == j) for j in range(3)]


def test_the_jackknifes_batched_whole_set_directions_give_the_one_by_one_numbers(monkeypatch):
    """The deletions' whole-set directions by one batched power iteration: the jackknife's numbers
    equal solving each replicate by dsyevr, to float tolerance; one that does not converge in the
    iterations allowed is solved by dsyevr."""
    K, members = _planted_groups(n=45)
    batched = R.jackknife(K, members, budget=200, halves=6, seed=3)
    present = np.ones((3, len(K)), dtype=bool)
    present[0, 4] = present[1, 20] = present[2, [7, 8]] = False
    found = R.deletion_directions(K, present, R._top(K, np.ones(len(K))).weights)
    for r, d in enumerate(found):
        rows = np.flatnonzero(present[r])
        ref = R._top(K[np.ix_(rows, rows)], np.ones(rows.size))
        np.testing.assert_allclose(d.weights, ref.weights, atol=1e-9)
        assert d.eigenvalue == pytest.approx(ref.eigenvalue, rel=1e-12)
    monkeypatch.setattr(R, "MAX_POWER", 1)  # nothing converges in one product: every replicate by dsyevr
    assert all(d is None for d in R.deletion_directions(K, present, np.ones(len(K))))
    one_by_one = R.jackknife(K, members, budget=200, halves=6, seed=3)
    for a, b in zip(batched, one_by_one):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


def test_a_deletion_whose_top_direction_is_orthogonal_to_the_whole_sets_is_still_found():
    """Two groups of gradients in orthogonal coordinates with nearly equal top eigenvalues: leaving
    out a sample of the stronger group makes the other group's direction the top one, orthogonal
    to the whole set's. From the nudged start (R.power_start) every deletion's whole-set direction
    is the exact one; from the whole set's direction alone one of them was not."""
    rng = np.random.default_rng(0)
    J = np.zeros((60, 20))
    J[:30, :10] = rng.normal(size=(30, 10)) + 1.0
    J[30:, 10:] = rng.normal(size=(30, 10)) + 0.97
    K = J @ J.T
    plan = R.jackknife_plan(60, [np.arange(30, 60)], budget=100, halves=0, seed=0)
    whole = R._top(K, np.ones(60)).weights
    found = R.deletion_directions(K, plan.present, R.power_start(whole))
    switched = 0
    for present, d in zip(plan.present, found):
        rows = np.flatnonzero(present)
        ref = R._top(K[np.ix_(rows, rows)], np.ones(rows.size))
        switched += abs(ref.weights[30:].sum()) > 0.5  # the top direction is the other group's
        assert d is None or (np.allclose(d.weights, ref.weights, atol=1e-8)
                             and d.eigenvalue == pytest.approx(ref.eigenvalue, rel=1e-10))
    assert switched >= 1


def test_a_null_bands_draws_solved_together_equal_them_one_by_one():
    """subset_abs_gcs (one stacked eigh per size, up to STACKED_UP_TO) against subset_gc per draw:
    the same |GC| to rounding, on a kernel with a near-double top eigenvalue, sizes mixed, a
    degenerate subset (zero gradients) NaN in both, and a size above the stacked limit."""
    g = np.random.default_rng(4)
    G = g.normal(size=(150, 60))
    G[:, 0] *= 6
    G[:, 1] *= 5.9
    G[7] = 0
    G[11] = 0
    K = G @ G.T
    whole = R.direction(K, np.arange(150), np.ones(150))
    along, norm = whole.weights @ K, np.sqrt(whole.eigenvalue)
    subsets = [np.sort(g.choice(150, size=k, replace=False)) for k in (2, 5, 16, 16, 40) for _ in range(7)]
    subsets.append(np.array([7, 11]))
    stacked = R.subset_abs_gcs(K, along, norm, subsets)
    single = np.array([abs(R.subset_gc(K, along, norm, s)) for s in subsets])
    assert np.isnan(stacked[-1]) and np.isnan(single[-1])
    np.testing.assert_allclose(stacked[:-1], single[:-1], rtol=0, atol=1e-10)
