"""Attention reference models: Transformer base (encoder-decoder), BERT-large, GPT-2 small."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = [
    "BERT_SEQ",
    "BERT_VOCAB",
    "GPT2_SEQ",
    "GPT2_VOCAB",
    "TRANSFORMER_SEQ",
    "TRANSFORMER_VOCAB",
    "bert_large",
    "gpt2_small",
    "transformer_base",
]

TRANSFORMER_VOCAB, TRANSFORMER_SEQ = 32000, 128
BERT_VOCAB, BERT_SEQ = 30522, 128
GPT2_VOCAB, GPT2_SEQ = 50257, 256


class Attention(nn.Module):
    """Multi-head attention from separate q/k/v/out ``nn.Linear`` layers (SFB-eligible weights)."""

    def __init__(self, dim: int, heads: int, causal_len: int = 0) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.scale = heads, 1.0 / math.sqrt(dim // heads)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        if causal_len:
            mask = torch.full((causal_len, causal_len), float("-inf")).triu(1)
            self.register_buffer("mask", mask, persistent=False)
        else:
            self.mask = None

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if memory is None else memory
        q = self.q(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k = self.k(kv).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        v = self.v(kv).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if self.mask is not None:
            scores = scores + self.mask
        attn = torch.softmax(scores, dim=-1)
        return self.out(torch.matmul(attn, v).transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Post-norm (BERT, Transformer) or pre-norm (GPT-2) layer: self-attention, cross-attention, MLP."""

    def __init__(
        self, dim: int, heads: int, ff: int, cross: bool = False, causal_len: int = 0, pre_norm: bool = False
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.attn = Attention(dim, heads, causal_len)
        self.norm1 = nn.LayerNorm(dim)
        self.cross = Attention(dim, heads) if cross else None
        self.norm_c = nn.LayerNorm(dim) if cross else None
        self.mlp = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim), nn.Dropout(0.1))
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        if self.cross is not None:
            x = self.norm_c(x + self.cross(x, memory))
        return self.norm2(x + self.mlp(x))


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos


class Transformer(nn.Module):
    """Encoder-decoder Transformer (Vaswani et al. base: 6+6 layers, 512 wide, 8 heads, FFN 2048)."""

    def __init__(
        self,
        vocab: int = TRANSFORMER_VOCAB,
        seq: int = TRANSFORMER_SEQ,
        dim: int = 512,
        heads: int = 8,
        ff: int = 2048,
        layers: int = 6,
    ) -> None:
        super().__init__()
        self.src_embed = Embedding(vocab, dim, seq)
        self.tgt_embed = Embedding(vocab, dim, seq)
        self.encoder = nn.ModuleList(Block(dim, heads, ff) for _ in range(layers))
        self.decoder = nn.ModuleList(Block(dim, heads, ff, cross=True, causal_len=seq) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.src_embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.tgt_embed(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(x)


class Encoder(nn.Module):
    """BERT/GPT-style stack over one token sequence with a language-model head."""

    def __init__(
        self, vocab: int, seq: int, dim: int, heads: int, ff: int, layers: int, causal: bool
    ) -> None:
        super().__init__()
        self.embed = Embedding(vocab, dim, seq)
        self.layers = nn.Sequential(
            *(Block(dim, heads, ff, causal_len=seq if causal else 0, pre_norm=causal) for _ in range(layers))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(ids))))


def transformer_base() -> nn.Module:
    """Transformer base, encoder-decoder."""
    return Transformer()


def bert_large() -> nn.Module:
    """BERT-large: 24 layers, hidden 1024, 16 heads, FFN 4096, masked-LM head."""
    return Encoder(BERT_VOCAB, BERT_SEQ, 1024, 16, 4096, 24, causal=False)


def gpt2_small() -> nn.Module:
    """GPT-2 small: 12 pre-norm causal layers, hidden 768, 12 heads."""
    return Encoder(GPT2_VOCAB, GPT2_SEQ, 768, 12, 3072, 12, causal=True)
