"""The warm-up rule: small router clusters that persist (ntkscope.representation.persistence)."""

import numpy as np
import pandas as pd
import pytest

from ntkscope.representation.persistence import cluster_persistence, persistence_summary, persistent_step
from ntkscope.representation.router import fit_router


def test_best_match_jaccard_by_hand():
    # step 0: {0,1,2,3} big, {4,5} small; step 1: {0,1,2} and {3,4,5}: J({4,5}, {3,4,5}) = 2/3
    labels = {0: np.array([0, 0, 0, 0, 1, 1]), 1: np.array([0, 0, 0, 1, 1, 1]), 2: np.array([0, 0, 0, 1, 1, -1])}
    table = cluster_persistence(labels, horizon=1, threshold=0.6)
    small = table[(table.step == 0) & table.small].iloc[0]
    assert small["size"] == 2 and small["jaccard_1"] == pytest.approx(2 / 3) and small["persists"]
    assert table[(table.step == 1) & (table.cluster == 1)]["jaccard_1"].item() == pytest.approx(2 / 3)
    assert np.isnan(table[table.step == 2]["jaccard_1"]).all() and not table[table.step == 2]["persists"].any()
    summary = persistence_summary(table, 6)
    assert summary.loc[0, "small_share"] == pytest.approx(2 / 6) and summary.loc[0, "persisting_share"] == 1.0
    assert np.isnan(summary.loc[2, "persisting_share"])


def _planted(step: int, appear: int, rng) -> np.ndarray:
    """600 sequences: 540 ordinary ones in one big blob whose centre drifts with the step; the
    60 tail sequences sit inside it before ``appear`` and form two small clusters from then on
    (at fixed offsets from the drifting centre: the common shift moves them too)."""
    d = 16
    drift = np.zeros(d)
    drift[0] = 0.5 * step / 100
    centre = np.full(d, 3.0) + drift
    X = centre + rng.normal(size=(600, d))
    if step >= appear:
        for j, block in enumerate((slice(540, 570), slice(570, 600))):
            offset = np.zeros(d)
            offset[1 + j] = 8.0
            X[block] = centre + offset + 0.3 * rng.normal(size=(30, d))
    return X


def test_rule_picks_the_planted_step_at_which_small_clusters_appear():
    rng = np.random.default_rng(0)
    steps = list(range(100, 1300, 100))
    labels = {s: fit_router(_planted(s, 700, rng), min_cluster_size=15, min_samples=5, seed=0).labels
              for s in steps}
    summary = persistence_summary(cluster_persistence(labels, horizon=2, threshold=0.5), 600)
    assert persistent_step({2: summary}) == 700
    # before the tail appears, whatever small clusters HDBSCAN finds in the blob do not persist
    early = summary[summary.step < 700]
    assert (early["n_small"] == 0).all() or (early["persisting_share"].fillna(0) < 0.8).all()


def test_persistent_step_needs_every_layer_and_checks_its_arguments():
    a = pd.DataFrame({"step": [1, 2], "n_clusters": [2, 2], "n_small": [1, 1], "small_share": [0.1, 0.1],
                      "persisting_share": [1.0, 1.0], "min_jaccard": [0.9, 0.9]})
    b = a.assign(persisting_share=[0.5, 0.9])
    assert persistent_step({0: a}) == 1 and persistent_step({0: a, 1: b}) == 2
    assert persistent_step({0: a.assign(n_small=0)}) is None
    with pytest.raises(ValueError, match="persistent_step.*min_persisting"):
        persistent_step({0: a}, min_persisting=0)
    with pytest.raises(ValueError, match="cluster_persistence.*labels.*same sequences"):
        cluster_persistence({0: np.zeros(3, int), 1: np.zeros(4, int)})
