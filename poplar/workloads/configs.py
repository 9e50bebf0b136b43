"""Configs of the reference models (``poplar.workloads.models``): named sizes, parameter counts
without building a model, and a JSON-safe form for checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from poplar.workloads.text import VOCAB_SIZE

@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = VOCAB_SIZE
    dim: int = 48
    n_layers: int = 3
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    hidden_dim: int = 128  # SwiGLU inner size
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _check_positive(self, "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head size {self.dim // self.n_heads} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must divide by n_kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @classmethod
    def named(cls, size: str, **overrides: Any) -> "LlamaConfig":
        return _named(LLAMA_SIZES, "llama", size, overrides)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = VOCAB_SIZE
    dim: int = 48
    n_layers: int = 3
    n_heads: int = 4
    hidden_dim: int = 192  # GELU MLP inner size (4·dim in BERT)
    max_seq_len: int = 128  # number of learned positions
    norm_eps: float = 1e-12
    dropout: float = 0.0  # BERT used 0.1; 0 keeps a step a function of the batch alone
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _check_positive(self, "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must divide by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def named(cls, size: str, **overrides: Any) -> "BertConfig":
        return _named(BERT_SIZES, "bert", size, overrides)


def _check_positive(cfg: Any, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(cfg).__name__}.{n} must be an int >= 1, got {v!r}")


def _named(table: dict, family: str, size: str, overrides: dict) -> Any:
    if size not in table:
        raise ValueError(f"unknown {family} size {size!r}; choose one of {sorted(table)}")
    return replace(table[size], **overrides)


LLAMA_SIZES: dict[str, LlamaConfig] = {
    # ~96k parameters: unit tests
    "tiny": LlamaConfig(dim=48, n_layers=3, n_heads=4, hidden_dim=128, max_seq_len=128),
    # ~1.9M parameters: the CPU demo
    "small": LlamaConfig(dim=160, n_layers=6, n_heads=5, hidden_dim=432, max_seq_len=256),
    # the paper's main model, ~0.52B (untied, 32k vocabulary)
    "0.5b": LlamaConfig(vocab_size=32000, dim=1280, n_layers=24, n_heads=20, hidden_dim=3072, max_seq_len=2048,
                        tie_embeddings=False),
    # ~1.1B, the TinyLlama shape (grouped-query attention with 4 KV heads)
    "1.1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden_dim=5632,
                        max_seq_len=2048, tie_embeddings=False),
}

BERT_SIZES: dict[str, BertConfig] = {
    "tiny": BertConfig(dim=48, n_layers=3, n_heads=4, hidden_dim=192, max_seq_len=128),
    "small": BertConfig(dim=160, n_layers=6, n_heads=4, hidden_dim=640, max_seq_len=256),
    "base": BertConfig(vocab_size=30522, dim=768, n_layers=12, n_heads=12, hidden_dim=3072, max_seq_len=512),
    "large": BertConfig(vocab_size=30522, dim=1024, n_layers=24, n_heads=16, hidden_dim=4096, max_seq_len=512),
    # ~1.1B, the paper's BERT: a wider and deeper BERT-large
    "1.1b": BertConfig(vocab_size=30522, dim=1920, n_layers=24, n_heads=30, hidden_dim=7680, max_seq_len=512),
}


def count_params(config: LlamaConfig | BertConfig) -> int:
    """Number of distinct parameters (tied weights once), without building the model."""
    c = config
    if isinstance(c, LlamaConfig):
        kv = c.kv_heads * c.head_dim
        attn = 2 * c.dim * c.dim + 2 * c.dim * kv
        block = attn + 3 * c.dim * c.hidden_dim + 2 * c.dim
        head = 0 if c.tie_embeddings else c.vocab_size * c.dim
        return c.vocab_size * c.dim + c.n_layers * block + c.dim + head
    if isinstance(c, BertConfig):
        d, h = c.dim, c.hidden_dim
        block = 4 * (d * d + d) + (d * h + h) + (h * d + d) + 2 * 2 * d
        emb = (c.vocab_size + c.max_seq_len) * d + 2 * d
        head = (d * d + d) + 2 * d + c.vocab_size + (0 if c.tie_embeddings else c.vocab_size * d)
        return emb + c.n_layers * block + head
    raise TypeError(f"not a model config: {type(config).__name__}")
