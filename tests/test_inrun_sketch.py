"""Sketched in-run GC (ntkscope.gc.sketch): the sketches' inner products average to the exact
in-run kernel over projection seeds; the matrix-free directions equal kernel_gc's on the
sketches' own kernel in float64; a planted group whose gradients oppose the bulk gets a negative
GC; where the solve starts changes nothing."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from ntkscope import kernel_gc
from ntkscope.core.checks import UserError
from ntkscope.gc.inrun import InRunGC, InRunTracker
from ntkscope.gc import sketch
from ntkscope.gc.sketch import GradientSketch, SketchedGC

LABELS = np.array(["a"] * 5 + ["b"] * 4 + ["c"] * 3)


class TwoLayer(nn.Module):
    """A token-wise two-layer regression: (B, T, 6) -> (B, T, 1); widths 6 -> 10 -> 1."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 10, bias=False), nn.Linear(10, 1, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _step(model, x, y):
    """One training step's backward of the per-sample mean squared error, summed over samples."""
    loss = ((model(x).squeeze(-1) - y) ** 2).mean(1).sum()
    loss.backward()


def _data(seed=0, B=12, T=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 6, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                                  dtype=torch.float64)


def _stepped(seed=0) -> tuple:
    """A float64 TwoLayer after one step's backward: (its factors, the exact in-run kernel)."""
    torch.manual_seed(seed)
    model = TwoLayer().double()
    with InRunGC(model) as inrun:
        _step(model, *_data(seed))
        return inrun.factors(), inrun.kernel(dtype=torch.float64)


def _sketched_kernel(factors, **kw) -> np.ndarray:
    S = GradientSketch(**kw).sketch(factors, dtype=torch.float64)
    return (S @ S.T).numpy()


def test_sketched_inner_products_average_to_the_exact_kernel():
    factors, K = _stepped()
    mean = np.mean([_sketched_kernel(factors, width=4, seed=s) for s in range(400)], axis=0)
    scale = np.sqrt(np.outer(np.diag(K), np.diag(K)))
    # 400 seeds: each entry's relative error is about sqrt(2 / (4 * 400)) = 3.5 % of the diagonal scale
    assert np.abs(mean - K).max() / scale.max() < 0.12
    assert np.abs(mean - K).max() / scale.max() > 1e-4  # a sketch, not the kernel itself


def test_a_side_no_wider_than_the_sketch_is_kept_whole_and_the_kernel_is_exact():
    factors, K = _stepped()
    np.testing.assert_allclose(_sketched_kernel(factors, width=10), K, rtol=1e-10, atol=1e-12)


def test_the_projection_is_a_signed_sum_over_equal_blocks():
    sk = GradientSketch(width=4, seed=1)
    signs, pad = sk.projection(0, 10, "cpu")
    assert set(signs.tolist()) == {-1, 1} and pad == 2
    x = torch.randn(3, 10, dtype=torch.float64)
    dense = torch.zeros(10, 4, dtype=torch.float64)  # the same projection as a matrix: coordinate -> its bucket
    for coordinate in range(10):
        dense[coordinate, coordinate // 3] = float(signs[coordinate])
    torch.testing.assert_close(sk.project(x, (signs, pad)), x @ dense)


@pytest.mark.parametrize("gram_up_to", [256, 0])  # the B x B kernel, and the matrix-free solve
def test_the_directions_equal_kernel_gc_on_the_sketches_kernel(gram_up_to, monkeypatch):
    monkeypatch.setattr(sketch, "GRAM_UP_TO", gram_up_to)
    torch.manual_seed(1)
    model = TwoLayer().double()
    x, y = _data(1)
    with InRunGC(model) as inrun:
        _step(model, x, y)
        S = GradientSketch(width=3, seed=2).sketch(inrun.factors(), dtype=torch.float64)
    groups = [(lab, np.flatnonzero(LABELS == lab)) for lab in "abc"]
    found = SketchedGC().gc(S, groups)
    reference = kernel_gc((S @ S.T).numpy(), [idx for _, idx in groups], resampling=None)
    for f, r in zip(found, reference):
        assert f.score == pytest.approx(r.score, abs=1e-6)
        assert f.eigenvalue == pytest.approx(r.eigenvalue, rel=1e-9)
        assert f.eigengap_subset == pytest.approx(r.eigengap_subset, abs=1e-6)
        assert f.mean_gradient == pytest.approx(r.mean_gradient, abs=1e-9)
        assert f.cos_ones_subset == pytest.approx(r.cos_ones_subset, abs=1e-6)
        assert f.method == "sketch"


def test_a_kept_direction_changes_no_value(monkeypatch):
    """The matrix-free solve starts from the last call's directions; where it starts does not change
    what it finds."""
    monkeypatch.setattr(sketch, "GRAM_UP_TO", 0)
    torch.manual_seed(2)
    model = TwoLayer().double()
    x, y = _data(2, B=40)
    labels = np.array(["a", "b"] * 20)
    groups = [(lab, np.flatnonzero(labels == lab)) for lab in "ab"]
    with InRunGC(model) as inrun:
        _step(model, x, y)
        S = GradientSketch(width=6).sketch(inrun.factors(), dtype=torch.float64)
        _step(model, *_data(5, B=40))
        S_other = GradientSketch(width=6).sketch(inrun.factors(), dtype=torch.float64)
    kept = SketchedGC()
    kept.gc(S_other, groups)  # another batch's directions kept
    assert kept.direction is not None and set(kept.group_directions) == {"a", "b"}
    warm, cold = kept.gc(S, groups), SketchedGC().gc(S, groups)
    assert [r.score for r in warm] == pytest.approx([r.score for r in cold], abs=1e-6)
    assert [r.eigenvalue_subset for r in warm] == pytest.approx([r.eigenvalue_subset for r in cold], rel=1e-9)


def test_a_planted_group_opposing_the_bulk_gets_a_negative_gc_exact_and_sketched():
    """A linear model at w: the bulk's residuals pull w one way along e1, the planted group's the
    other way; both estimators find the planted group's GC negative and the bulk's positive."""
    torch.manual_seed(3)
    model = nn.Linear(16, 1, bias=False).double()
    g = torch.Generator().manual_seed(4)
    B, T = 24, 6
    x = 0.3 * torch.randn(B, T, 16, generator=g, dtype=torch.float64)
    x[..., 0] += 1.0
    with torch.no_grad():
        base = model(x).squeeze(-1)
    y = base - 1.0  # residual +1: the bulk's gradient is +e1-ish
    y[:6] = base[:6] + 1.0  # the planted group: residual -1, its gradients opposite
    labels = np.array(["planted"] * 6 + ["bulk"] * 18)
    exact = InRunTracker(model, estimator="exact")
    sketched = InRunTracker(model, estimator="sketch", width=4)
    _step(model, x, y)
    rows = {r.label: r.score for r in exact.step(model, 0, labels)}
    rows_sketch = {r.label: r.score for r in sketched.step(model, 0, labels)}
    exact.close()
    sketched.close()
    assert rows["planted"] < -0.5 and rows["bulk"] > 0.5
    assert rows_sketch["planted"] < -0.5 and rows_sketch["bulk"] > 0.5


def test_sketch_options_are_checked():
    with pytest.raises(UserError, match="estimator"):
        InRunTracker(estimator="approximate")
    with pytest.raises(UserError, match="width"):
        InRunTracker(estimator="sketch", width=0)
    with pytest.raises(UserError, match="seed"):
        GradientSketch(seed=-1)
