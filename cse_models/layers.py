"""Transformer pieces in plain PyTorch: attention, MLP, block.

Attention is written out (``softmax(q k^T / sqrt(d)) v``) rather than through
``scaled_dot_product_attention``: the explicit form supports forward-mode AD and double
backward, which ntkscope's matrix-free path needs, and it is faster than the fused CPU
kernel under ``vmap`` (docs/design.md §6). Every module takes ``(x, key_mask)`` so that a sparse
layer can stand in for any of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cse_models.experts import CSELayer, DEMixLayer


class SelfAttention(nn.Module):
    """Multi-head self-attention; causal for GPT, bidirectional for BERT."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.is_causal = config.model_type == "gpt"
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
        allowed = self.causal[:, :, :T, :T] if self.is_causal else None
        if key_mask is not None:
            # a pad query still attends to itself, so no softmax row is empty (no NaN)
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            keys = key_mask[:, None, None, :]
            allowed = ((keys if allowed is None else allowed & keys) | eye)
        if allowed is not None:
            att = att.masked_fill(~allowed, torch.finfo(att.dtype).min)
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``. ``attn``/``mlp`` may be sparse layers."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None,
                domains: torch.Tensor | None = None) -> torch.Tensor:
        x = x + _apply(self.attn, self.ln_1(x), key_mask, domains)
        return x + _apply(self.mlp, self.ln_2(x), key_mask, domains)


def _apply(module: nn.Module, h: torch.Tensor, key_mask, domains) -> torch.Tensor:
    if isinstance(module, (DEMixLayer, CSELayer)):
        return module(h, key_mask, domains)
    return module(h, key_mask)
