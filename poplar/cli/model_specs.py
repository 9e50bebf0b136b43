"""Planning models for ``poplar simulate --model``: a built-in model name or a Hugging Face
``config.json`` turned into the simulator's ``ModelSpec``, with and without activation
checkpointing.

The simulator needs, per model, its parameter count, activation bytes per sample and compute
cost relative to the presets' reference workload. From a transformer's shape (layers L, hidden
h, FFN f, heads a, vocabulary V, sequence s) these are estimates, good to tens of percent:

- activations, fp32, eager attention, per sample:
  ``4 s (L (10 h + g f + 2 a s) + 2 V)`` bytes (per layer: norm inputs, q/k/v, attention output
  and projection, residuals ~10 h; the MLP's g = 3 (gated, SiLU) or 2 tensors of f; attention
  scores and probabilities; then the logits and their softmax);
- with checkpointing (every block): the block inputs ``L h``, one block's activations live
  while it is recomputed, and the logits; one extra forward: compute x 4/3;
- compute: ``6 P s + 12 L h s^2`` FLOPs per sample, relative to the reference (a 125M GPT-2-small
  shape at s = 512, ``REFERENCE_SHAPE``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from poplar.emulation.synthetic import REFERENCE_MODEL, ModelSpec

MAX_DEFAULT_SEQ = 2048  # a config's context can be far longer than its training sequences
RECOMPUTE_FACTOR = 4.0 / 3.0  # forward ~ 1/3 of forward + backward; checkpointing runs it twice


@dataclass(frozen=True)
class TransformerShape:
    """What the estimates need of a transformer (see the module docstring)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq: int
    gated: bool = False  # SwiGLU MLP (three FFN-sized tensors) instead of a plain one (two)

    def activation_bytes(self, checkpointing: bool = False) -> float:
        block = 10 * self.hidden + (3 if self.gated else 2) * self.ffn + 2 * self.heads * self.seq
        kept = self.layers * self.hidden + block if checkpointing else self.layers * block
        return 4.0 * self.seq * (kept + 2 * self.vocab)

    def flops_per_sample(self, params: int) -> float:
        return 6.0 * params * self.seq + 12.0 * self.layers * self.hidden * self.seq ** 2


REFERENCE_SHAPE = TransformerShape(12, 768, 3072, 12, 50257, 512)


@dataclass(frozen=True)
class PlanningModel:
    """A model as the simulator sees it: without and with activation checkpointing."""

    plain: ModelSpec
    checkpointed: ModelSpec
    description: str

    def spec(self, checkpointing: bool) -> ModelSpec:
        return self.checkpointed if checkpointing else self.plain


def from_shape(name: str, shape: TransformerShape, params: int, description: str) -> PlanningModel:
    work = shape.flops_per_sample(params) / REFERENCE_SHAPE.flops_per_sample(REFERENCE_MODEL.param_count)
    plain = ModelSpec(name, params, shape.activation_bytes(False), work_scale=work)
    ckpt = replace(plain, activation_bytes_per_sample=shape.activation_bytes(True), work_scale=work * RECOMPUTE_FACTOR)
    return PlanningModel(plain, ckpt, description)


def reference_model() -> PlanningModel:
    """The presets' reference workload; its checkpointed activations scaled as its shape's."""
    ratio = REFERENCE_SHAPE.activation_bytes(True) / REFERENCE_SHAPE.activation_bytes(False)
    ckpt = replace(REFERENCE_MODEL, activation_bytes_per_sample=REFERENCE_MODEL.activation_bytes_per_sample * ratio,
                   work_scale=REFERENCE_MODEL.work_scale * RECOMPUTE_FACTOR)
    return PlanningModel(REFERENCE_MODEL, ckpt, f"{REFERENCE_MODEL.name} (the presets' reference workload)")


def resolve_model(name_or_path: str | None, seq: int | None = None) -> PlanningModel:
    """``None`` or "reference": the reference workload; a built-in model name (``llama-1.1b``,
    ``bert-large``, ...); or a Hugging Face ``config.json``. ``seq`` overrides the sequence
    length (default: the model's maximum, at most ``MAX_DEFAULT_SEQ`` for a config.json)."""
    if seq is not None and seq < 1:
        raise ValueError(f"--seq must be >= 1, got {seq}")
    if name_or_path in (None, "reference"):
        return reference_model()
    from poplar.workloads.configs import BERT_SIZES, LLAMA_SIZES, LlamaConfig, count_params

    builtin = {f"llama-{k}": v for k, v in LLAMA_SIZES.items()} | {f"bert-{k}": v for k, v in BERT_SIZES.items()}
    if name_or_path in builtin:
        c = builtin[name_or_path]
        gated = isinstance(c, LlamaConfig)
        shape = TransformerShape(c.n_layers, c.dim, c.hidden_dim, c.n_heads, c.vocab_size, seq or c.max_seq_len, gated)
        return from_shape(name_or_path, shape, count_params(c), f"{name_or_path}, seq {shape.seq}")
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--model {name_or_path!r} is neither a built-in model ({', '.join(['reference', *builtin])}) "
                         "nor a Hugging Face config.json file")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config {path}: {e}") from None
    return from_hf_config(cfg, str(path), seq)


def _key(cfg: dict[str, Any], where: str, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise ValueError(f"{where}: none of {', '.join(names)} is set; is it a transformer's config.json?")
    return default


def from_hf_config(cfg: dict[str, Any], where: str = "config.json", seq: int | None = None) -> PlanningModel:
    """A Hugging Face transformer config (GPT-2, Llama, BERT, ... key names) as a planning model."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: a config.json must hold a JSON object")
    h = int(_key(cfg, where, "hidden_size", "n_embd", "d_model"))
    layers = int(_key(cfg, where, "num_hidden_layers", "n_layer", "num_layers"))
    heads = int(_key(cfg, where, "num_attention_heads", "n_head"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    ffn = int(_key(cfg, where, "intermediate_size", "n_inner", "ffn_dim", default=4 * h))
    vocab = int(_key(cfg, where, "vocab_size"))
    positions = int(_key(cfg, where, "max_position_embeddings", "n_positions", "n_ctx", default=2048))
    gated = str(cfg.get("hidden_act", cfg.get("activation_function", ""))) == "silu"
    learned_positions = "n_positions" in cfg or cfg.get("model_type") in ("bert", "roberta", "opt", "gpt_neo")
    attention = 2 * h * h + 2 * h * (h // heads) * kv
    block = attention + (3 if gated else 2) * h * ffn + 4 * h
    params = (vocab * h + layers * block + (positions * h if learned_positions else 0)
              + (0 if cfg.get("tie_word_embeddings", True) else vocab * h))
    shape = TransformerShape(layers, h, ffn, heads, vocab, seq or min(positions, MAX_DEFAULT_SEQ), gated)
    name = str(cfg.get("_name_or_path") or cfg.get("model_type") or Path(where).parent.name or "hf-model")
    return from_shape(name, shape, params, f"{name} from {where} ({params / 1e6:.0f}M parameters), seq {shape.seq}")
