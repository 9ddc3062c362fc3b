"""cse_models: small GPT / BERT language models with Cluster-guided Sparse Expert layers."""

from cse_models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
