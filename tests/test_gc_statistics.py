"""GC's uncertainty (docs/design.md §1.1): planted structure, slow references, the null band's
coverage, the new outputs against per-sample autograd, and the warm-up rule built on them."""

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ntkscope as ns
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
    whole, subs = U._statistics(K, counts, members)
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
    (dict(interval="percentile"), r"Resampling: interval must be one of \['basic', 'bca'\]"),
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


# ---- the warm-up rule ----------------------------------------------------------------------------


def _series(abs_gc, se=0.01, null_median=0.5, flags=""):
    steps = [10 * (i + 1) for i in range(len(abs_gc))]
    return pd.DataFrame({"step": steps, "abs_gc": abs_gc, "abs_gc_se": se, "null_median": null_median,
                         "flags": flags})


def test_gc_peak_is_shown_only_beyond_the_noise_against_the_null_and_well_defined():
    clear = _series([0.6, 0.9, 0.6])
    assert ns.gc_peak(clear) == {"step": 20, "shown": True,
                                 "why": "rise and fall beyond the noise and against the null, direction well defined"}
    noisy = ns.gc_peak(_series([0.6, 0.9, 0.85], se=[0.01, 0.02, 0.03]))  # fall 0.05 < 1.645 * 0.036
    assert not noisy["shown"] and "the fall to the last (0.050) is within 1.645 standard errors (0.059)" in noisy["why"]
    trend = ns.gc_peak(_series([0.6, 0.9, 0.6], null_median=[0.5, 0.95, 0.5]))  # random subsets peak too, more
    assert not trend["shown"] and "against the null's median, the rise from the first checkpoint is not seen" \
        in trend["why"]
    flagged = ns.gc_peak(_series([0.6, 0.9, 0.6], flags=["", "eigengap sign", ""]))
    assert not flagged["shown"] and "its direction is flagged (eigengap sign)" in flagged["why"]
    rising = ns.gc_peak(_series([0.6, 0.7, 0.9]))
    assert not rising["shown"] and "at the last checkpoint" in rising["why"]
    with pytest.raises(ValueError, match=r"gc_peak: gc must be a gc_series table with columns"):
        ns.gc_peak(pd.DataFrame({"step": [1], "gc": [0.5]}))


def test_plan_falls_back_to_stable_clusters_then_to_the_window_end():
    separation = pd.DataFrame({"step": [10, 10, 20, 20, 30, 30], "layer": [0, 1] * 3,
                               "separation": [1.0, 2.0, 2.0, 1.0, 1.0, 3.0]})
    noisy = _series([0.6, 0.9, 0.6], se=0.2)
    stability = pd.DataFrame({"step": [10, 20, 30], "layer": [1] * 3, "n_clusters": [2, 3, 3],
                              "n_noise": [0, 0, 0], "overlap_next": [0.9, 0.85, np.nan]})
    seen = []
    plan = ns.make_plan(separation, noisy, top_k=1, stability=lambda layers: (seen.append(layers), stability)[1])
    assert seen == [[1]] and plan.layers == [1] and plan.evidence["scores_at_step"] == 30
    assert plan.warmup_steps == 20 and plan.warmup_rule == "stable-clusters"  # step 10: 2 clusters, then 3
    assert plan.evidence["gc_peak"]["shown"] is False and plan.evidence["overlap"] == 0.8
    assert ns.stable_step(stability, [1], overlap=0.88) is None
    loose = ns.make_plan(separation, noisy, top_k=1, stability=stability, overlap=0.95)
    assert loose.warmup_steps == 30 and loose.warmup_rule == "window-end"
    clear = ns.make_plan(separation, _series([0.6, 0.9, 0.6]), top_k=1,
                         stability=lambda layers: pytest.fail("not needed when the peak is shown"))
    assert clear.warmup_steps == 20 and clear.warmup_rule == "gc-peak" and clear.layers == [0]
