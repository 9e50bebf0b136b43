"""Tiny Hugging Face models (GPT-2, Llama, BERT masked-LM), right-padded variable-length batches
with -100 labels, and the single-process token-weighted reference the engine must equal."""

from __future__ import annotations

import warnings

import torch

from poplar.workloads.hf import IGNORE_INDEX, causal_lm_loss_fn, masked_lm_loss_fn
from tests.toy import train_reference

VOCAB, SEQ, PAD, MASK = 100, 12, 0, 3
KINDS = ("gpt2", "llama", "bert")


def make_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, hidden-32 model without dropout, the same weights for the same seed."""
    import transformers as t

    t.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    torch.manual_seed(seed)
    if kind == "gpt2":  # tied embeddings; one c_attn bias holds the q, k and v biases
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
        return t.GPT2LMHeadModel(config)
    if kind == "llama":  # rotary embedding buffers, grouped-query attention, untied head
        config = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                               bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
        return t.LlamaForCausalLM(config)
    if kind == "bert":  # tied decoder, separate key biases (mathematically zero gradient)
        config = t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0, pad_token_id=PAD)
        return t.BertForMaskedLM(config)
    raise ValueError(kind)


def loss_fn_of(kind: str):
    return masked_lm_loss_fn if kind == "bert" else causal_lm_loss_fn


def global_batch(kind: str, iteration: int, gbs: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of random lengths 2..SEQ: ``input_ids``, ``attention_mask`` and
    ``labels`` (-100 at padding; for BERT -100 except at ~30% of real positions, masked)."""
    g = torch.Generator().manual_seed(7000 + iteration)
    lengths = torch.randint(2, SEQ + 1, (gbs,), generator=g)
    ids = torch.randint(4, VOCAB, (gbs, SEQ), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    if kind != "bert":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}
    chosen = (torch.rand(gbs, SEQ, generator=g) < 0.3) & (mask == 1)
    labels = ids.masked_fill(~chosen, IGNORE_INDEX)
    return {"input_ids": ids.masked_fill(chosen, MASK), "attention_mask": mask, "labels": labels}


def rank_part(batch: dict[str, torch.Tensor], plan, rank: int) -> dict[str, torch.Tensor]:
    start = plan.sample_offsets()[rank]
    n = plan.ranks[rank].num_samples
    return {k: v[start:start + n] for k, v in batch.items()}


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def reference(kind: str, gbs: int, iterations: int, max_norm: float | None
              ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch, loss = Σ token losses / Σ counted tokens."""
    model = make_model(kind)
    return train_reference(model, optimizer(model), lambda it: loss_fn_of(kind)(model, global_batch(kind, it, gbs)),
                           iterations, max_norm)


def is_key_bias(name: str) -> bool:
    """Attention key biases: softmax is invariant to them, so their gradient is mathematically 0."""
    return name.endswith(("key.bias", "k_proj.bias"))


def state_errors(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: relative error, or absolute error for attention key biases."""
    assert state.keys() == ref.keys()
    out = {}
    for k, b in ref.items():
        if not b.is_floating_point():
            assert torch.equal(state[k], b), k
            continue
        diff = float((state[k].float() - b.float()).norm())
        out[k] = diff if is_key_bias(k) else diff / max(float(b.float().norm()), 1e-12)
    return out
