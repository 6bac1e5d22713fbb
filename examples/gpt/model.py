"""A llama-style decoder-only transformer: token embedding, blocks of RMSNorm -> causal
self-attention with rotary position embeddings -> RMSNorm -> SwiGLU feed-forward, a final RMSNorm
and an output projection (tied to the embedding with ``tie_embeddings``).

Written so that tensor parallelism can split it as torchtitan does: the attention's ``wq``, ``wk``,
``wv`` and the feed-forward's ``w1``, ``w3`` column-wise, ``wo`` and ``w2`` row-wise; the number of
heads a rank holds is read from its projection's output, so the same code runs whole or split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    dim: int = 512
    n_layers: int = 6
    n_heads: int = 8
    ffn_hidden: int = 1408  # about 8/3 of dim, a multiple of 64, as llama's
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair: [max_seq_len, head_dim / 2] each."""
    frequencies = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    angles = torch.outer(torch.arange(config.max_seq_len).float(), frequencies)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of ``x`` [batch, seq, heads, head_dim] by its position's angle."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q = apply_rotary(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(config)
        # Not state: recomputed on every build, so they are neither saved nor restored.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self) -> None:
        """Normal(0, 0.02) for the embedding and projections, scaled by depth for the residual
        outputs (as GPT-2 and torchtitan do); ones for the norms."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Compute the rotary tables (a model built on the meta device has none)."""
        cos, sin = rotary_tables(self.config)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def count_parameters(model: nn.Module) -> int:
    """Global parameter count (a DTensor counts its global size; a tied weight once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
