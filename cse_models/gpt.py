"""A small GPT (decoder-only causal language model) in plain PyTorch.

The layout follows nanoGPT: attention -> MLP -> Block -> GPT, a dataclass
config saved as ``config.json`` beside ``model.safetensors``. Parameter names
follow GPT-2's (``transformer.wte``, ``transformer.h.{i}.attn.c_attn``, ...).

Attention is written out explicitly (``softmax(q k^T / sqrt(d)) v``) rather than
through ``scaled_dot_product_attention``: the explicit form supports forward-mode
AD and double backward, which the NTK engine's matrix-free path needs, and it is
faster than the fused CPU kernel under ``vmap`` (see DESIGN.md §6).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class GPTConfig:
    """Architecture of a :class:`GPT`.

    The defaults are a CPU-sized toy; ``n_layer=12, n_head=12, n_embd=768,
    vocab_size=50257, block_size=1024`` is GPT-2 small (the CSE paper's size).
    """

    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    model_type: str = "gpt"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive integer (got {value!r})")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd must be divisible by n_head (got n_embd={self.n_embd}, n_head={self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1) (got {self.dropout!r})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"GPTConfig.from_dict: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**data)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        causal = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal", causal.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C); key_mask: (B, T) bool, True where the token is real."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        allowed = self.causal[:, :, :T, :T]
        if key_mask is not None:
            # a pad query still attends to itself, so no softmax row is empty (no NaN)
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            allowed = (allowed & key_mask[:, None, None, :]) | eye
        att = att.masked_fill(~allowed, torch.finfo(att.dtype).min)
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), key_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only LM. ``forward(input_ids (B, T), attention_mask (B, T) | None) -> logits (B, T, V)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.size()
        if T > self.config.block_size:
            raise ValueError(f"GPT.forward: input_ids has {T} positions, more than block_size={self.config.block_size}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))  # (B, T, C)
        key_mask = None if attention_mask is None else attention_mask.bool()
        for block in self.transformer.h:
            x = block(x, key_mask)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)

    # ---- checkpoints: config.json + model.safetensors -------------------------------------

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (tied weights stored once)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.tie_weights:
            state.pop("lm_head.weight")
        tmp_weights = directory / (WEIGHTS_NAME + ".tmp")
        save_file(state, str(tmp_weights), metadata={"format": "pt"})
        tmp_config = directory / (CONFIG_NAME + ".tmp")
        tmp_config.write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        os.replace(tmp_weights, directory / WEIGHTS_NAME)
        os.replace(tmp_config, directory / CONFIG_NAME)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "GPT":
        """Rebuild a model from ``config.json`` and load ``model.safetensors`` (no pickle)."""
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"GPT.from_pretrained: {directory} has no {name}")
        config = GPTConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
        model = cls(config)
        state = load_file(str(directory / WEIGHTS_NAME))
        if config.tie_weights:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"GPT.from_pretrained: weights in {directory} do not match its config "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
        return model
