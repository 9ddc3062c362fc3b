"""ntkscope: why language models fail to learn long-tail knowledge, measured.

The public API, in pipeline order (the package tree follows it; docs/architecture.md):

- text (:mod:`ntkscope.text`): corpus packs, tokenizers, token frequency, sentence scores,
  analysis sentences;
- kernel (:mod:`ntkscope.kernel`): which parameters -> per-sample gradients -> empirical
  NTK -> top eigenpair -> primary gradient direction -> gradient consistency, all run by one
  :class:`KernelOptions` and one method table;
- representation (:mod:`ntkscope.representation`): clustering estimators, the CSE router's
  fit, layer separation, the CSE plan;
- runs (:mod:`ntkscope.runs`): checkpoints, model-family adapters, embeddings at named
  points, analyses over a run's checkpoints;
- the paper's figures (:class:`Reproduction`; drawing in :mod:`ntkscope.plotting`).

These are the names a researcher calls; the helpers behind them stay importable from their
modules (``from ntkscope.kernel.eigen import top_eigenpair``). Names are imported on first use
(PEP 562), so ``import ntkscope`` is cheap and the lower stages can be imported by
``cse_models`` without the rest.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    # the one type of a user's mistake (a ValueError); every check raises it or a kind of it
    "UserError": "ntkscope.core.checks",
    # text
    "CorpusPack": "ntkscope.text.corpus",
    "Record": "ntkscope.text.corpus",
    "SourceMissingError": "ntkscope.text.corpus",
    "build_pack": "ntkscope.text.corpus",
    "load_pack": "ntkscope.text.corpus",
    "TextTokenizer": "ntkscope.text.tokenization",
    "load_tokenizer": "ntkscope.text.tokenization",
    "train_bpe": "ntkscope.text.tokenization",
    "TokenCounts": "ntkscope.text.frequency",
    "count_tokens": "ntkscope.text.frequency",
    "domain_table": "ntkscope.text.frequency",
    "long_tail_subset": "ntkscope.text.frequency",
    "score_histogram": "ntkscope.text.frequency",
    "sentence_scores": "ntkscope.text.frequency",
    "sentence_table": "ntkscope.text.frequency",
    "token_frequency": "ntkscope.text.frequency",
    "DataSource": "ntkscope.text.inputs",
    "as_source": "ntkscope.text.inputs",
    "AnalysisData": "ntkscope.text.sentences",
    "encode_texts": "ntkscope.text.sentences",
    "load_analysis_data": "ntkscope.text.sentences",
    # kernel
    "KernelOptions": "ntkscope.kernel.options",
    "hand_back_freed_memory": "ntkscope.core.memory",
    "Method": "ntkscope.kernel.options",
    "ParameterSelection": "ntkscope.kernel.params",
    "select_parameters": "ntkscope.kernel.params",
    "LMLoss": "ntkscope.kernel.objectives",
    "register_token_value": "ntkscope.core.lm",
    "sample_outputs": "ntkscope.kernel.objectives",
    "PerSampleGrads": "ntkscope.kernel.grads",
    "per_sample_grads": "ntkscope.kernel.grads",
    "NTKResult": "ntkscope.kernel.ntk",
    "cosine_kernel": "ntkscope.kernel.ntk",
    "empirical_ntk": "ntkscope.kernel.ntk",
    "ntk_top_eigenpair": "ntkscope.kernel.ntk",
    "EigenResult": "ntkscope.kernel.eigen",
    "GCResult": "ntkscope.kernel.uncertainty",
    "Interval": "ntkscope.kernel.uncertainty",
    "NullBand": "ntkscope.kernel.nulls",
    "Controls": "ntkscope.kernel.nulls",
    "PlantedPool": "ntkscope.kernel.calibration",
    "interval_calibration": "ntkscope.kernel.calibration",
    "Resampling": "ntkscope.kernel.uncertainty",
    "kernel_gc": "ntkscope.kernel.uncertainty",
    "ExpertKernel": "ntkscope.kernel.experts",
    "MixtureKind": "ntkscope.kernel.experts",
    "expert_gc": "ntkscope.gc.experts",
    "expert_ntk": "ntkscope.kernel.experts",
    "find_mixtures": "ntkscope.kernel.experts",
    "register_mixture": "ntkscope.kernel.experts",
    "split_half_gc": "ntkscope.gc.experts",
    "DirectionResult": "ntkscope.kernel.consistency",
    "GCGroups": "ntkscope.kernel.consistency",
    "gradient_consistency": "ntkscope.kernel.consistency",
    "gradient_consistency_groups": "ntkscope.kernel.consistency",
    "principal_direction": "ntkscope.kernel.consistency",
    # representation
    "AutoDBSCAN": "ntkscope.representation.clusters",
    "ElbowKMeans": "ntkscope.representation.clusters",
    "layer_separation": "ntkscope.representation.clusters",
    "RouterFit": "ntkscope.representation.router",
    "fit_router": "ntkscope.representation.router",
    "Plan": "ntkscope.representation.plan",
    "make_plan": "ntkscope.representation.plan",
    "gc_peak": "ntkscope.representation.plan",
    # runs
    "family_of": "ntkscope.runs.families",
    "list_checkpoints": "ntkscope.runs.checkpoints",
    "load_checkpoint": "ntkscope.runs.checkpoints",
    "SentenceEncoder": "ntkscope.runs.encoder",
    "LayerEmbeddings": "ntkscope.runs.embeddings",
    "layer_embeddings": "ntkscope.runs.embeddings",
    "cluster_dynamics": "ntkscope.runs.dynamics",
    "cluster_snapshots": "ntkscope.runs.dynamics",
    "gc_series": "ntkscope.runs.dynamics",
    "router_dynamics": "ntkscope.runs.dynamics",
    "router_persistence": "ntkscope.runs.dynamics",
    "cluster_purity": "ntkscope.representation.structure",
    "knn_lift": "ntkscope.representation.structure",
    "domain_silhouette": "ntkscope.representation.structure",
    "GCOptions": "ntkscope.gc.options",
    "gc_by_group": "ntkscope.gc.groups",
    "gc_by_bins": "ntkscope.gc.groups",  # the old name of gc_by_group, deprecated
    "gc_sensitivity": "ntkscope.gc.groups",
    "Probes": "ntkscope.gc.tracker",
    "GCTracker": "ntkscope.gc.tracker",
    "GCCallback": "ntkscope.gc.callbacks",
    "InRunGC": "ntkscope.gc.inrun",
    "InRunTracker": "ntkscope.gc.inrun",
    "token_scores": "ntkscope.gc.tokens",
    # the reproduction
    "ReproduceSettings": "ntkscope.reproduction",
    "Reproduction": "ntkscope.reproduction",
    "reproduce": "ntkscope.reproduction",
    "settings_for": "ntkscope.reproduction",
    "Sweep": "ntkscope.reproduction.sweep",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ntkscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
