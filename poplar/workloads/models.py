"""Two reference models: a Llama-style decoder and a BERT-style encoder, with named sizes.

- ``LlamaModel``: token embedding, ``LlamaBlock`` x n (pre-RMSNorm; causal attention with rotary
  embeddings through ``scaled_dot_product_attention``, optional grouped KV heads; SwiGLU MLP),
  final RMSNorm, output head tied to the embedding or not. No biases.
- ``BertModel``: word + learned position embeddings with LayerNorm, ``BertBlock`` x n
  (post-LayerNorm as in BERT; bidirectional attention; GELU MLP), masked-LM head (dense, GELU,
  LayerNorm, decoder tied to the word embedding or not, plus a bias).

The transformer blocks are their own classes (``LlamaBlock``, ``BertBlock``; ``model.block_class``)
so a ZeRO-3 wrap policy can make one gather/release unit per block.

Initialisation is a function of the seed alone: every weight is drawn from a generator seeded
with ``seed`` (normal, std ``init_std``; residual output projections scaled by 1/sqrt(2·layers)),
and building a model leaves the global torch RNG untouched. Models are built on the CPU in
fp32; move them with ``.to(device)``.

Sizes: ``tiny`` (~0.1M parameters, tests), ``small`` (~2M, the CPU demo), and the models of
the paper's experiments as documented configs (``0.5b``/``1.1b`` Llama, ``1.1b`` BERT, plus
``base``/``large`` BERT), for profiling and planning at real scale; ``count_params(config)``
gives their size without building them. The small sizes use the byte vocabulary of
``poplar.workloads.text`` (260 tokens); the paper sizes use 32000 (Llama) and 30522 (BERT).

Losses: ``llama_loss_fn(model, tokens)`` and ``bert_loss_fn(model, batch)`` return the mean
over the micro-batch's *samples* of each sample's mean token loss — what the engine's scaling
by samples needs (docs/design.md §2). For the decoder every sample has the same number of target
tokens, so this is the plain mean over all tokens. For the masked LM the number of masked
tokens differs per sample, so each sample's masked-token mean is taken first.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from poplar.workloads.configs import (BERT_SIZES, LLAMA_SIZES, BertConfig, LlamaConfig,  # noqa: F401
                                      count_params)
from poplar.workloads.text import IGNORE_INDEX

__all__ = ["LlamaConfig", "LlamaModel", "LlamaBlock", "BertConfig", "BertModel", "BertBlock", "RMSNorm",
           "LLAMA_SIZES", "BERT_SIZES", "llama_loss_fn", "bert_loss_fn", "count_params", "create_model",
           "loss_fn_for", "MODEL_NAMES"]


# ====================================================================== Llama
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos/sin: (T, head_dim)."""
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = c.n_heads, c.kv_heads, c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        if self.kv_heads != self.n_heads:
            rep = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """One decoder layer: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.attn = LlamaAttention(c)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = SwiGLU(c.dim, c.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class LlamaModel(nn.Module):
    """tokens (B, T) int64 → logits (B, T, vocab_size)."""

    block_class = LlamaBlock

    def __init__(self, config: LlamaConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        c = self.config = config or LlamaConfig()
        with torch.random.fork_rng(devices=[]):  # the default inits below must not move the global RNG
            self.embed = nn.Embedding(c.vocab_size, c.dim)
            self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layers))
            self.norm = RMSNorm(c.dim, c.norm_eps)
            self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = _rotary_tables(c.head_dim, c.max_seq_len, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # derived, not in state_dict
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        c = self.config
        g = torch.Generator().manual_seed(seed)
        residual_std = c.init_std / math.sqrt(2 * c.n_layers)
        for name, p in self.named_parameters():  # model order; tied weights once
            if p.dim() == 1:
                p.fill_(1.0)  # norm weights
            else:
                std = residual_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else c.init_std
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def _rotary_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # the rotate-half layout
    return angles.cos().float(), angles.sin().float()


def llama_loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a (B, T+1) batch: inputs ``[:, :-1]``, targets ``[:, 1:]``.
    Every sample has T targets, so the token mean is the per-sample mean."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


# ====================================================================== BERT
class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout = c.n_heads, c.head_dim, c.dropout
        self.q = nn.Linear(c.dim, c.dim)
        self.k = nn.Linear(c.dim, c.dim)
        self.v = nn.Linear(c.dim, c.dim)
        self.out = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (lin(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class BertBlock(nn.Module):
    """One encoder layer (post-LayerNorm): h = norm(x + attn(x)); norm(h + mlp(h))."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attn = BertAttention(c)
        self.attn_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.up = nn.Linear(c.dim, c.hidden_dim)
        self.down = nn.Linear(c.hidden_dim, c.dim)
        self.mlp_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.attn_norm(x + self.drop(self.attn(x, mask)))
        return self.mlp_norm(h + self.drop(self.down(F.gelu(self.up(h)))))


class BertModel(nn.Module):
    """input_ids (B, T) int64 [, attention_mask (B, T), nonzero = real token] → MLM logits (B, T, vocab)."""

    block_class = BertBlock

    def __init__(self, config: BertConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        c = self.config = config or BertConfig()
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(c.vocab_size, c.dim)
            self.pos_embed = nn.Embedding(c.max_seq_len, c.dim)
            self.embed_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.layers = nn.ModuleList(BertBlock(c) for _ in range(c.n_layers))
            self.mlm_dense = nn.Linear(c.dim, c.dim)
            self.mlm_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
            self.mlm_decoder = nn.Linear(c.dim, c.vocab_size, bias=False)
            self.mlm_bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.drop = nn.Dropout(c.dropout)
        if c.tie_embeddings:
            self.mlm_decoder.weight = self.embed.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        c = self.config
        g = torch.Generator().manual_seed(seed)
        norm_weights = {id(m.weight) for m in self.modules() if isinstance(m, nn.LayerNorm)}
        for p in self.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * c.init_std)
            elif id(p) in norm_weights:
                p.fill_(1.0)
            else:
                p.zero_()  # biases

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.drop(self.embed_norm(self.embed(input_ids) + self.pos_embed(pos)))
        mask = None
        if attention_mask is not None:  # keys that are padding are not attended to
            mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        h = self.mlm_norm(F.gelu(self.mlm_dense(x)))
        return self.mlm_decoder(h) + self.mlm_bias


def bert_loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masked-LM loss of a batch ``{"input_ids", "labels"[, "attention_mask"]}`` (labels -100 =
    no loss): the mean over samples of each sample's mean loss over its labelled tokens (a sample
    with none counts 0)."""
    logits = model(batch["input_ids"], batch.get("attention_mask"))
    labels = batch["labels"]
    per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX,
                                reduction="none")  # (B, T), 0 where ignored
    counts = (labels != IGNORE_INDEX).sum(dim=1).clamp_min(1)
    return (per_token.sum(dim=1) / counts).mean()


# ====================================================================== by name
MODEL_NAMES = [f"llama-{s}" for s in LLAMA_SIZES] + [f"bert-{s}" for s in BERT_SIZES]


def create_model(name: str, *, seed: int = 0, **overrides: Any) -> nn.Module:
    """A model by name: ``llama-tiny``, ``llama-small``, ``bert-tiny``, ... (see ``MODEL_NAMES``);
    keyword arguments override config fields (e.g. ``max_seq_len=64``)."""
    family, _, size = name.partition("-")
    if family == "llama":
        return LlamaModel(LlamaConfig.named(size, **overrides), seed=seed)
    if family == "bert":
        return BertModel(BertConfig.named(size, **overrides), seed=seed)
    raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")


def loss_fn_for(model: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The loss function matching a model built here."""
    if isinstance(model, LlamaModel):
        return llama_loss_fn
    if isinstance(model, BertModel):
        return bert_loss_fn
    raise TypeError(f"no default loss for {type(model).__name__}")
