"""The built-in workloads, by name: a model, batches of any size for it, and its loss.

A ``Workload`` bundles three functions that travel to spawned ranks, so each is a module-level
function (or a ``functools.partial`` of one) and pickles by name:

- ``model_fn()`` builds the model, with the same weights on every call;
- ``sample_fn(b)`` makes a batch of ``b`` samples (samples on dim 0), the same batch for the same
  ``b``: ``b`` seeds the choice of samples;
- ``loss_fn(model, batch)`` is the mean loss over the batch's samples (what the engine's scaling
  needs, docs/design.md §2).

``llama-<size>`` and ``bert-<size>`` are ``poplar.workloads.models`` at its small sizes, trained on blocks of
the corpus shipped with Poplar (next-token blocks for Llama; BERT-masked blocks, dicts with
``input_ids`` and ``labels``, for BERT). ``token-mlp`` is a much cheaper model (per-token residual
MLP blocks, no attention) whose activations still grow with the batch like a transformer's: the
profiler's tests and accuracy benchmark time hundreds of steps on it.

``poplar profile --model NAME`` and ``bench/profile_accuracy.py --model NAME`` take these names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from poplar.workloads.models import BERT_SIZES, LLAMA_SIZES, bert_loss_fn, count_params, create_model, llama_loss_fn
from poplar.workloads.text import MaskedTextBlocks, TextBlocks

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOAD", "get_workload", "TokenMLP", "ResidualMLP"]


@dataclass(frozen=True)
class Workload:
    """A built-in workload: ``name`` in ``WORKLOADS``, its three functions, and one line on what it is."""

    name: str
    model_fn: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    sample_fn: Callable[[int], Any]
    description: str


# ====================================================================== the token MLP
class ResidualMLP(nn.Module):
    """x + down(gelu(up(norm(x)))): a pre-norm residual MLP block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """tokens (B, T) → logits (B, T, vocab): an embedding, per-token residual MLP blocks, a final
    norm and an (untied) head. Initialised by PyTorch's defaults under ``seed``, leaving the global
    RNG untouched."""

    block_class = ResidualMLP

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 128, layers: int = 3, *, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(ResidualMLP(dim, hidden) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TOKEN_MLP_VOCAB, TOKEN_MLP_SEQ = 64, 16


def token_mlp_model() -> TokenMLP:
    return TokenMLP(vocab=TOKEN_MLP_VOCAB)


def token_mlp_batch(batch_size: int) -> torch.Tensor:
    """``batch_size`` random token sequences of ``TOKEN_MLP_SEQ + 1`` (inputs and next-token targets)."""
    g = torch.Generator().manual_seed(batch_size)
    return torch.randint(0, TOKEN_MLP_VOCAB, (batch_size, TOKEN_MLP_SEQ + 1), generator=g)


# ====================================================================== Llama and BERT on the corpus
@functools.lru_cache(maxsize=8)
def _corpus_blocks(family: str, seq_len: int) -> dict[str, torch.Tensor]:
    """Every block of the shipped corpus, stacked (built once per process)."""
    if family == "llama":
        data = TextBlocks(seq_len=seq_len)
        return {"tokens": torch.stack([data[i] for i in range(len(data))])}
    data = MaskedTextBlocks(seq_len=seq_len)
    items = [data[i] for i in range(len(data))]
    return {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "labels")}


def _pick(n: int, batch_size: int) -> torch.Tensor:
    """``batch_size`` block indices seeded by ``batch_size``: distinct while there are enough blocks,
    then the same permutation again."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    g = torch.Generator().manual_seed(batch_size)
    order = torch.randperm(n, generator=g)
    return order.repeat(-(-batch_size // n))[:batch_size]


def llama_batch(seq_len: int, batch_size: int) -> torch.Tensor:
    """(batch_size, seq_len + 1) int64 corpus tokens: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    tokens = _corpus_blocks("llama", seq_len)["tokens"]
    return tokens[_pick(len(tokens), batch_size)]


def bert_batch(seq_len: int, batch_size: int) -> dict[str, torch.Tensor]:
    """``{"input_ids", "labels"}``, each (batch_size, seq_len): masked corpus blocks (labels -100
    where no loss)."""
    blocks = _corpus_blocks("bert", seq_len)
    idx = _pick(len(blocks["input_ids"]), batch_size)
    return {k: v[idx] for k, v in blocks.items()}


# Sequence lengths: short enough that a CPU profiles a size in seconds to minutes.
_SEQ_LEN = {"tiny": 32, "small": 64}


_FAMILIES = {  # family: (sizes, loss, batches, what it is, what it learns)
    "llama": (LLAMA_SIZES, llama_loss_fn, llama_batch, "Llama-style decoder", "next-token"),
    "bert": (BERT_SIZES, bert_loss_fn, bert_batch, "BERT-style encoder", "masked-LM"),
}


def _corpus_workload(family: str, size: str) -> Workload:
    sizes, loss_fn, batch_fn, kind, task = _FAMILIES[family]
    cfg, seq, name = sizes[size], _SEQ_LEN[size], f"{family}-{size}"
    return Workload(name, functools.partial(create_model, name), loss_fn, functools.partial(batch_fn, seq),
                    f"{kind}, {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads, {task} loss on "
                    f"{seq}-token corpus blocks ({count_params(cfg) / 1e6:.2g}M params)")


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    *(_corpus_workload(family, size) for family in _FAMILIES for size in _SEQ_LEN),
    Workload("token-mlp", token_mlp_model, llama_loss_fn, token_mlp_batch,
             f"3 residual MLP blocks per token, dim 32, hidden 128, vocab {TOKEN_MLP_VOCAB}, next-token loss on "
             f"{TOKEN_MLP_SEQ} random tokens (~29K params; the profiler tests' fast model)"),
]}

# the smallest Llama size
DEFAULT_WORKLOAD = "llama-tiny"


def get_workload(name: str) -> Workload:
    """The built-in workload ``name``, or a ValueError listing the known names."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
