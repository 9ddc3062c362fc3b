"""The structure measure behind the warm-up rule (ntkscope.representation.consensus): consensus
over resampled router fits finds the step at which a planted small cluster forms, on data where
the single-fit rule (ntkscope.representation.persistence) flickers."""

import numpy as np
import pytest

from ntkscope.representation.consensus import (coassociation, consensus_labels, resampled_fits, structure_series,
                                               structure_step)
from ntkscope.representation.persistence import cluster_persistence, persistence_summary, persistent_step
from ntkscope.representation.router import fit_router

STEPS = list(range(100, 1500, 100))
FORMS = 700
ROUTER = {"min_cluster_size": 15, "min_samples": 5}


def _planted(step: int, rng, n: int = 600, d: int = 16, tail: int = 60) -> np.ndarray:
    """n sequences around a centre that drifts with the step. From step FORMS on, the last
    ``tail`` of them form a small cluster (5 units from the centre, spread 0.6). At every
    checkpoint two fresh sets of 20 ordinary sequences are pulled into transient clumps: small
    clusters that a single fit finds and that never persist (the flicker)."""
    centre = np.full(d, 3.0)
    centre[0] += 0.5 * step / 100
    X = centre + rng.normal(size=(n, d))
    if step >= FORMS:
        offset = np.zeros(d)
        offset[1] = 5.0
        X[n - tail:] = centre + offset + 0.6 * rng.normal(size=(tail, d))
    for _ in range(2):
        idx = rng.choice(n - tail, 20, replace=False)
        X[idx] = centre + 1.5 * rng.normal(size=d) + 0.35 * rng.normal(size=(20, d))
    return X


@pytest.mark.parametrize("draw", [0, 1])
def test_the_consensus_finds_the_planted_step_where_the_single_fit_rule_flickers(draw):
    rng = np.random.default_rng(draw)
    X = {s: _planted(s, rng) for s in STEPS}
    # the old rule: one fit per checkpoint. Its small clusters come and go (transient clumps), so
    # no step has 80 % of small-cluster members persisting, although the planted cluster is there
    single = {s: fit_router(X[s], **ROUTER, seed=0).labels for s in STEPS}
    summary = persistence_summary(cluster_persistence(single, horizon=2, threshold=0.5), 600)
    assert persistent_step({2: summary}) is None
    assert summary["n_small"].nunique() >= 2  # the count of small clusters jumps between checkpoints
    assert all((single[s][540:] >= 0).mean() > 0.8 for s in STEPS if s >= FORMS)  # the planted one is found
    # the consensus over resampled fits: nothing before the cluster forms, the planted share after
    fits = {s: resampled_fits(X[s], n_fits=8, fraction=0.8, seed=draw, router=ROUTER) for s in STEPS}
    series, labels = structure_series(fits, horizon=2, threshold=0.5, n_boot=20, seed=draw)
    series = series.set_index("step")
    assert structure_step({2: series.reset_index()}, min_structure=0.05) == FORMS
    before = series.loc[[s for s in STEPS if s < FORMS]]
    assert (before["structure_high"] < 0.05).all()
    after = series.loc[[s for s in STEPS if FORMS <= s <= STEPS[-3]]]
    assert (after["structure"] > 0.08).all() and (after["structure"] < 0.15).all()  # 60 of 600, +- strays
    assert (after["structure_low"] <= after["structure"]).all() and (after["structure"] <= after["structure_high"]).all()
    # the persisting consensus cluster is the planted one
    planted = labels[FORMS][540:]
    assert (planted >= 0).all() and len(set(planted.tolist())) == 1


def test_coassociation_and_consensus_by_hand():
    fits = np.array([[0, 0, 1, 1, -1], [0, 0, 0, 1, 1], [0, 0, 1, 1, -2]])
    C = coassociation(fits)
    assert C[0, 1] == 1.0 and C[2, 3] == pytest.approx(2 / 3) and C[3, 4] == pytest.approx(1 / 2)
    assert C[0, 4] == 0.0 and C[4, 4] == pytest.approx(1 / 2)  # drawn twice, clustered once
    assert coassociation(fits, weights=[0, 1, 0])[2, 3] == 0.0  # only the second fit counts
    labels = consensus_labels(C, level=0.5, min_size=2)
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]


def test_structure_arguments_are_checked():
    fits = {1: np.zeros((2, 5), dtype=int), 2: np.zeros((3, 5), dtype=int)}
    with pytest.raises(ValueError, match="structure_series.*fits.*one shape"):
        structure_series(fits)
    with pytest.raises(ValueError, match="resampled_fits.*fraction"):
        resampled_fits(np.zeros((5, 2)), fraction=0)
    with pytest.raises(ValueError, match="structure_step.*min_structure"):
        structure_step({0: None}, min_structure=0)
