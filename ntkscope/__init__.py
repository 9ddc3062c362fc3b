"""ntkscope: why language models fail to learn long-tail knowledge, measured.

The public API, in pipeline order: real text (corpus packs, tokenizers, frequency
scores) -> which parameters -> per-sample gradients -> empirical NTK -> top eigenpair
-> primary gradient direction -> gradient consistency.
"""

from ntkscope.consistency import (
    DirectionResult,
    GCGroups,
    GCResult,
    gradient_consistency,
    gradient_consistency_groups,
    principal_direction,
)
from ntkscope.corpus import CorpusPack, Record, SourceMissingError, build_pack, load_pack, load_source
from ntkscope.eigen import (
    EigenResult,
    IllDefinedEigenvectorWarning,
    NTKOperator,
    ntk_top_eigenpair,
    top_eigenpair,
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
from ntkscope.ntk import NTKResult, empirical_ntk, jl_error_bound
from ntkscope.objectives import LMLoss
from ntkscope.params import ParameterSelection, select_parameters
from ntkscope.tokenization import TextTokenizer, gpt2_tokenizer, load_tokenizer, train_bpe

__version__ = "0.1.0"

__all__ = [
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
    "empirical_ntk",
    "gradient_consistency",
    "gradient_consistency_groups",
    "jl_error_bound",
    "ntk_top_eigenpair",
    "per_sample_grads",
    "principal_direction",
    "select_parameters",
    "top_eigenpair",
]
