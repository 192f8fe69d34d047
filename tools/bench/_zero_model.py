"""The GPT-style model and token batches the `zero.py` race trains.

A decoder-only transformer: token and position embeddings, pre-norm blocks (causal
self-attention through ``scaled_dot_product_attention``, a 4x GELU MLP), a final LayerNorm and
an output head tied to the token embedding. The full size has about 10.5M parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GptShape:
    """Sizes of the model and its batches."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    micro_batch: int


FULL = GptShape(vocab=2048, dim=320, layers=8, heads=5, seq=64, micro_batch=4)
QUICK = GptShape(vocab=128, dim=32, layers=2, heads=2, seq=16, micro_batch=2)


class _Block(torch.nn.Module):
    def __init__(self, shape: GptShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm1 = torch.nn.LayerNorm(shape.dim)
        self.qkv = torch.nn.Linear(shape.dim, 3 * shape.dim)
        self.proj = torch.nn.Linear(shape.dim, shape.dim)
        self.norm2 = torch.nn.LayerNorm(shape.dim)
        self.up = torch.nn.Linear(shape.dim, 4 * shape.dim)
        self.down = torch.nn.Linear(4 * shape.dim, shape.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Gpt(torch.nn.Module):
    """The decoder; ``forward(ids)`` returns the next-token cross-entropy loss."""

    def __init__(self, shape: GptShape) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(shape.vocab, shape.dim)
        self.positions = torch.nn.Embedding(shape.seq, shape.dim)
        self.blocks = torch.nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.norm = torch.nn.LayerNorm(shape.dim)
        for embedding in (self.tokens, self.positions):
            torch.nn.init.normal_(embedding.weight, std=0.02)  # GPT-2's initialisation

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.tokens.weight.t()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def make_model(shape: GptShape, seed: int = 0) -> Gpt:
    """The model with the same initial weights on every rank and for every competitor."""
    torch.manual_seed(seed)
    return Gpt(shape)


def batch(shape: GptShape, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at step ``step`` (different on every rank and step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=gen)
