"""Figures of the analyses (the CSE paper's Figures 1-5, docs/design.md §5). Every function takes
tables that the library returns and gives back a matplotlib Figure; :func:`save_figure`
writes it (PNG, and PDF on request) under a temporary name and renames it.

- :func:`domain_sizes` — Figure 1(a): the largest categories of the corpus, a long tail.
- :func:`gc_vs_frequency` — Figure 2(a): GC per frequency bin over the histogram of sentences.
- :func:`gc_over_steps` — Figure 3(a): GC of the long tail over training.
- :func:`layer_dynamics` — Figure 3(b, c): elbow K and inter-cluster distance per layer over steps.
- :func:`cluster_view` — Figures 2(b), 4(b), 5(a): a 2-D view coloured by cluster or expert.
- :func:`ntk_heatmap` — a kernel with its samples ordered by label.
- :func:`perplexity_vs_frequency` — Figure 1(b): perplexity of each sentence against its score.
- :func:`cse_schematic` — Figure 4(a): the CSE layer, drawn.
- :func:`expert_kernels` — Figure 5(b, c): each CSE expert's NTK beside the dense baseline's.
- :func:`expert_consistency` — Figure 5(b, c) across seeds: each expert's split-half |GC| beside
  the dense FFN's on the same blocks and a random-blocks null.

One stage per module: :mod:`~ntkscope.plotting.corpus`, :mod:`~ntkscope.plotting.gc`,
:mod:`~ntkscope.plotting.representations`, :mod:`~ntkscope.plotting.experts`, and what they
share in :mod:`~ntkscope.plotting.base`; every figure is importable from here.
"""

from ntkscope.plotting.base import DOMAIN_COLOURS, layer_name, save_figure
from ntkscope.plotting.corpus import domain_sizes, perplexity_vs_frequency, score_histogram_bars, training_curve
from ntkscope.plotting.experts import (cse_schematic, expert_consistency, expert_kernels, expert_layers, expert_loads,
                                       routing_shares)
from ntkscope.plotting.gc import gc_by_label, gc_over_steps, gc_per_layer, gc_vs_frequency, inrun_series
from ntkscope.plotting.representations import cluster_view, layer_dynamics, ntk_heatmap

__all__ = ["DOMAIN_COLOURS", "cluster_view", "cse_schematic", "domain_sizes", "expert_consistency", "expert_kernels",
           "expert_layers",
           "expert_loads", "gc_by_label", "gc_over_steps", "gc_per_layer", "gc_vs_frequency", "inrun_series",
           "layer_dynamics", "layer_name", "ntk_heatmap", "perplexity_vs_frequency", "routing_shares",
           "save_figure", "score_histogram_bars", "training_curve"]
