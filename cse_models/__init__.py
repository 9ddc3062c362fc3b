"""cse_models: small GPT / BERT language models with Cluster-guided Sparse Expert layers,
the baselines (dense, Switch, domain-finetuned, DEMix), training and evaluation."""

from cse_models.config import BERTConfig, GPTConfig, SparseConfig
from cse_models.experts import CSELayer, DEMixLayer, SwitchFFN
from cse_models.hf import SparseHF, load_any_model, load_hf
from cse_models.hf_auto import install as _install_transformers_classes
from cse_models.model import BERT, GPT, SparseHost, SparseRouting, TransformerLM, load_model

__all__ = ["BERT", "BERTConfig", "CSELayer", "DEMixLayer", "GPT", "GPTConfig", "SparseConfig", "SparseHF",
           "SparseHost", "SparseRouting", "SwitchFFN", "TransformerLM", "load_any_model", "load_hf", "load_model"]

_install_transformers_classes()  # AutoModelForCausalLM reads sparse checkpoints (cse_models.hf_auto); free until used
