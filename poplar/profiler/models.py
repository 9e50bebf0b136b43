"""Small built-in workloads for ``poplar profile`` and the profiler's tests and benchmark.

A workload is three module-level functions (they travel to spawned ranks by name): build the
model, make a batch of ``b`` samples, and the mean loss of a batch. ``WORKLOADS`` maps a name to
them. The transformer is a next-token language model (embedding, pre-norm blocks of causal
self-attention and an MLP, tied output head); the MLP is a plain classifier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def transformer_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def transformer_batch(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch_size)
    return torch.randint(0, 256, (batch_size, 33), generator=g)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class ResidualMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """Per-token residual MLP blocks over a short sequence: cheap compute, activations that grow
    with the batch like a transformer's (the profiler's test and benchmark workload)."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 128, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def token_mlp_model() -> nn.Module:
    torch.manual_seed(0)
    return TokenMLP()


def token_batch(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch_size)
    return torch.randint(0, 64, (batch_size, 17), generator=g)


def mlp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def mlp_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    x = torch.randn(batch_size, 64, generator=g)
    return x, torch.randint(0, 10, (batch_size,), generator=g)


def classify_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class Workload:
    name: str
    model_fn: Callable[[], nn.Module]
    sample_fn: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    description: str


WORKLOADS: dict[str, Workload] = {
    "tiny-transformer": Workload("tiny-transformer", transformer_model, transformer_batch, lm_loss,
                                 "4-layer causal LM, dim 64, 4 heads, sequence 32, vocab 256 (~0.22M params)"),
    "token-mlp": Workload("token-mlp", token_mlp_model, token_batch, lm_loss,
                          "3 residual MLP blocks over 16 tokens, dim 32, hidden 128, vocab 64 (~27K params)"),
    "mlp": Workload("mlp", mlp_model, mlp_batch, classify_loss, "4-layer MLP classifier, width 256 (~0.15M params)"),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown model {name!r}; built-in: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
