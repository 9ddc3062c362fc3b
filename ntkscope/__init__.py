"""ntkscope: why language models fail to learn long-tail knowledge, measured.

The public API, in pipeline order: real text (corpus packs, tokenizers, frequency
scores) -> which parameters -> per-sample gradients -> empirical NTK -> top eigenpair
-> primary gradient direction -> gradient consistency -> representations and clusters
over checkpoints -> the CSE plan -> the paper's figures (:class:`Reproduction`; drawing in
:mod:`ntkscope.plotting`).
"""

from ntkscope.consistency import (
    DirectionResult,
    GCGroups,
    GCResult,
    gradient_consistency,
    gradient_consistency_groups,
    principal_direction,
)
from ntkscope.analysis_data import AnalysisData, load_analysis_data
from ntkscope.checkpoints import list_checkpoints, load_checkpoint
from ntkscope.clusters import AutoDBSCAN, ClusterGeometry, ElbowKMeans, cluster_geometry, jl_guidance, random_projection
from ntkscope.corpus import CorpusPack, Record, SourceMissingError, build_pack, load_pack, load_source
from ntkscope.eigen import (
    EigenResult,
    IllDefinedEigenvectorWarning,
    NTKOperator,
    ntk_top_eigenpair,
    top_eigenpair,
)
from ntkscope.dynamics import (
    cluster_dynamics,
    cluster_snapshots,
    gc_series,
    layer_separation,
    long_tail_subset,
)
from ntkscope.frequency import (
    TokenCounts,
    bin_indices,
    count_tokens,
    domain_table,
    save_table,
    score_histogram,
    sentence_scores,
    sentence_table,
    token_frequency,
)
from ntkscope.grads import PerSampleGrads, per_sample_grads
from ntkscope.ntk import NTKResult, cosine_kernel, empirical_ntk, jl_error_bound
from ntkscope.objectives import LMLoss, sample_outputs
from ntkscope.params import ParameterSelection, select_parameters
from ntkscope.plan import Plan, choose_layers, make_plan, warmup_at_gc_peak
from ntkscope.reproduction import ReproduceSettings, Reproduction, reproduce, settings_for
from ntkscope.representations import LayerEmbeddings, encode_texts, layer_embeddings
from ntkscope.tokenization import TextTokenizer, gpt2_tokenizer, load_tokenizer, train_bpe

__version__ = "0.1.0"

__all__ = [
    "AnalysisData",
    "AutoDBSCAN",
    "ClusterGeometry",
    "ElbowKMeans",
    "LayerEmbeddings",
    "Plan",
    "load_analysis_data",
    "choose_layers",
    "cluster_dynamics",
    "cluster_geometry",
    "cluster_snapshots",
    "encode_texts",
    "gc_series",
    "jl_guidance",
    "layer_embeddings",
    "layer_separation",
    "list_checkpoints",
    "load_checkpoint",
    "long_tail_subset",
    "make_plan",
    "ReproduceSettings",
    "Reproduction",
    "reproduce",
    "settings_for",
    "random_projection",
    "warmup_at_gc_peak",
    "CorpusPack",
    "Record",
    "SourceMissingError",
    "TextTokenizer",
    "TokenCounts",
    "bin_indices",
    "build_pack",
    "count_tokens",
    "domain_table",
    "gpt2_tokenizer",
    "load_pack",
    "load_source",
    "load_tokenizer",
    "save_table",
    "score_histogram",
    "sentence_scores",
    "sentence_table",
    "token_frequency",
    "train_bpe",
    "DirectionResult",
    "EigenResult",
    "GCGroups",
    "GCResult",
    "IllDefinedEigenvectorWarning",
    "LMLoss",
    "NTKOperator",
    "NTKResult",
    "ParameterSelection",
    "PerSampleGrads",
    "cosine_kernel",
    "empirical_ntk",
    "gradient_consistency",
    "gradient_consistency_groups",
    "jl_error_bound",
    "ntk_top_eigenpair",
    "per_sample_grads",
    "sample_outputs",
    "principal_direction",
    "select_parameters",
    "top_eigenpair",
]
