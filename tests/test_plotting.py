"""Every figure function returns a Figure with labelled axes, built from the library's own tables."""

import numpy as np
import pandas as pd
import pytest

import ntkscope as ns
from ntkscope import plotting
from ntkscope.text.corpus.pack import load_pack
from ntkscope.text.frequency import domain_table, score_histogram


def _labelled(fig):
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            continue
        assert ax.get_xlabel() or ax.get_xticklabels(), "x axis unlabelled"
        assert ax.get_ylabel() or ax.get_yticklabels(), "y axis unlabelled"
    return True


@pytest.fixture(scope="module")
def pack():
    return load_pack()


def test_every_figure_is_labelled_and_saves(pack, tmp_path):
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.05, 0.35, 200)
    hist = score_histogram(scores, bins=6)
    J = rng.normal(size=(200, 3)) @ rng.normal(size=(3, 20)) + 0.3 * rng.normal(size=(200, 20))
    rows = [r.row() for r in ns.kernel_gc(J @ J.T, [np.arange(20 * i, 20 * i + 20) for i in range(6)],
                                          resampling=ns.Resampling(resamples=30, null_draws=30))]
    table = pd.DataFrame(rows).assign(left=hist["left"], right=hist["right"])
    series = pd.DataFrame(rows[:3]).assign(step=[100, 200, 300])
    dynamics = pd.DataFrame([(s, l, 2 + l, 1 + (s > 100) * l, 0.1 + 0.1 * l, 1.0 + 0.1 * s / 100 * l)
                             for s in (100, 200, 300) for l in range(3)],
                            columns=["step", "layer", "k", "k_silhouette", "silhouette", "inter_distance"])
    router = pd.DataFrame([(s, l, 3 + l, l, 0.1 * l * s / 300, 1 + l * s / 300, 2.0) for s in (100, 200, 300)
                           for l in range(3)], columns=["step", "layer", "n_clusters", "n_pure_tail", "tail_share",
                                                        "knn_lift legal", "knn_lift biomedical"])
    router["tail_share legal"] = router["tail_share"]
    points = pd.DataFrame({"step": [1] * 40 + [2] * 40, "x": rng.normal(size=80), "y": rng.normal(size=80),
                           "cluster": rng.integers(0, 3, 80), "domain": rng.choice(["general", "legal"], 80)})
    figures = {
        "fig1a": plotting.domain_sizes(domain_table(pack.records("all"), top=20)),
        "fig2a": plotting.gc_vs_frequency(table, hist),
        "fig3a": plotting.gc_over_steps(series, warmup=200, rule="gc-peak"),
        "fig2a-outputs": plotting.gc_vs_frequency(pd.concat([table.assign(output="loss"),
                                                             table.assign(output="true-logit")]), hist),
        "fig3bc": plotting.layer_dynamics(dynamics),
        "fig3bc-router": plotting.layer_dynamics(dynamics, router),
        "fig4b": plotting.cluster_view(points),
        "fig5b": plotting.ntk_heatmap(rng.normal(size=(10, 10)), ["a"] * 4 + ["b"] * 6),
        "fig5bc": plotting.expert_kernels(pd.DataFrame(
            {"expert": ["0", "1", "all"], "n": [12, 8, 20], "output": "centred-true-logit",
             "cse_expert_cosine": [0.4, 0.2, np.nan], "cse_expert_cosine_se": [0.05, 0.04, np.nan],
             "dense_cosine": [0.3, 0.25, 0.28], "dense_cosine_se": [0.03, 0.05, 0.02]})),
    }
    for name, fig in figures.items():
        assert _labelled(fig), name
        paths = plotting.save_figure(fig, tmp_path / name, formats=("png", "pdf"))
        assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)
    assert not list(tmp_path.glob(".*tmp*"))


def test_layer_names_read_as_layers():
    from ntkscope.plotting import layer_name

    assert layer_name("hf.gpt_neox.layers.2.mlp.layer") == "layer 2 (mlp)"
    assert layer_name("transformer.h.0") == "layer 0"
    assert layer_name("model.layers.11.self_attn") == "layer 11 (self_attn)"
    assert layer_name("all") == "all" and layer_name(3) == "3"
