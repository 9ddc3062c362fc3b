"""ntkscope: why language models fail to learn long-tail knowledge, measured.

The public API, in pipeline order: which parameters -> per-sample gradients ->
empirical NTK -> top eigenpair -> primary gradient direction -> gradient consistency.
"""

from ntkscope.consistency import (
    DirectionResult,
    GCGroups,
    GCResult,
    gradient_consistency,
    gradient_consistency_groups,
    principal_direction,
)
from ntkscope.eigen import (
    EigenResult,
    IllDefinedEigenvectorWarning,
    NTKOperator,
    ntk_top_eigenpair,
    top_eigenpair,
)
from ntkscope.grads import PerSampleGrads, per_sample_grads
from ntkscope.ntk import NTKResult, empirical_ntk, jl_error_bound
from ntkscope.objectives import LMLoss
from ntkscope.params import ParameterSelection, select_parameters

__version__ = "0.1.0"

__all__ = [
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
