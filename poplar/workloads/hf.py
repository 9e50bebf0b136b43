"""Token-weighted losses for Hugging Face language models, as ``(loss_sum, count)`` pairs.

Padded or variable-length batches hold different numbers of real tokens per sample, so the
per-sample mean is the wrong weighting for a token loss. These helpers return the summed token
cross-entropy and the number of tokens it covers; ``PoplarEngine`` divides the reduced gradients
by the global count, so training equals one process on the whole global batch with loss =
Σ sums / Σ counts (docs/design.md §2). Labels of -100 (``ignore_index``) are not counted:
padding, prompt tokens, unmasked positions of masked-LM.

    engine = PoplarEngine(model, optimizer, ..., loss_fn=causal_lm_loss_fn)
    engine.train_step({"input_ids": ids, "attention_mask": mask, "labels": labels})

Batches are dicts of the model's keyword arguments plus ``labels``, samples on dim 0 (any model
whose output has ``.logits``, or is the logits tensor, works). ``causal_lm_*`` shift the labels
as Hugging Face's causal-LM heads do (position t predicts label t + 1); ``masked_lm_*`` do not.
Nothing here imports ``transformers`` (the optional extra ``poplar[hf]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, counted tokens) of next-token prediction: ``logits[:, t]`` predicts
    ``labels[:, t + 1]``; labels equal to ``ignore_index`` are skipped."""
    _check(logits, labels)
    return token_loss(logits[:, :-1], labels[:, 1:], ignore_index)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, counted tokens) where ``logits[:, t]`` predicts ``labels[:, t]``
    (masked-LM: every label but the masked positions' is ``ignore_index``)."""
    _check(logits, labels)
    return token_loss(logits, labels, ignore_index)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the positions whose label is not ``ignore_index`` (in fp32),
    and their number (an int64 tensor on the labels' device)."""
    labels = labels.to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    total = F.cross_entropy(flat, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return total, (labels != ignore_index).sum()


def causal_lm_loss_fn(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_fn`` for a causal LM (GPT-2, Llama, ...): ``model(**inputs)`` on the batch without
    its ``labels``, then ``causal_lm_loss``. Without ``labels`` the targets are ``input_ids``
    with padding (``attention_mask == 0``) ignored."""
    inputs, labels = _split(batch, shifted=True)
    return causal_lm_loss(_logits(model(**inputs)), labels)


def masked_lm_loss_fn(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_fn`` for a masked LM (BERT, ...): ``model(**inputs)`` on the batch without its
    ``labels`` (required: -100 everywhere but the masked positions), then ``masked_lm_loss``."""
    inputs, labels = _split(batch, shifted=False)
    return masked_lm_loss(_logits(model(**inputs)), labels)


def _split(batch: Any, shifted: bool) -> tuple[dict[str, Any], torch.Tensor]:
    if not isinstance(batch, dict):
        raise TypeError(f"a Hugging Face batch is a dict of the model's inputs and 'labels', got "
                        f"{type(batch).__name__}")
    inputs = {k: v for k, v in batch.items() if k != "labels"}  # the model would compute its own loss
    labels = batch.get("labels")
    if labels is None:
        if not shifted or "input_ids" not in batch:
            raise ValueError("the batch has no 'labels'" + ("" if shifted else " (masked-LM needs them: -100 "
                                                                            "except at the masked positions)"))
        labels = batch["input_ids"]
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return inputs, labels


def _logits(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    logits = getattr(output, "logits", None)  # a transformers ModelOutput
    if not torch.is_tensor(logits):
        raise TypeError(f"the model's output has no logits tensor (got {type(output).__name__}); use a model "
                        "with a language-model head (e.g. AutoModelForCausalLM)")
    return logits


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be (batch, sequence, vocab) and labels (batch, sequence); got logits "
                         f"{tuple(logits.shape)} and labels {tuple(labels.shape)}")
