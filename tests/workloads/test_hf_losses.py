"""The Hugging Face (loss_sum, count) helpers and the ZeRO-3 default wrap policy from
``_no_split_modules`` (fast, single process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poplar.workloads.hf import causal_lm_loss, causal_lm_loss_fn, masked_lm_loss, masked_lm_loss_fn
from poplar.zero.wrap import default_blocks


def test_causal_lm_loss_shifts_and_counts() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 0, 1]])
    total, count = causal_lm_loss(logits, labels)
    expected = sum(F.cross_entropy(logits[b, t], labels[b, t + 1], reduction="sum")
                   for b in range(2) for t in range(4) if labels[b, t + 1] != -100)
    assert count.item() == 2 + 4 and torch.allclose(total, expected)


def test_masked_lm_loss_does_not_shift() -> None:
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[-100, 3, -100, 5]])
    total, count = masked_lm_loss(logits, labels)
    expected = F.cross_entropy(logits[0, [1, 3]], torch.tensor([3, 5]), reduction="sum")
    assert count.item() == 2 and torch.allclose(total, expected)
    zero, none = masked_lm_loss(logits, torch.full((1, 4), -100))
    assert zero.item() == 0.0 and none.item() == 0  # a sum, not 0/0


class Echo(nn.Module):
    """Returns fixed logits and records the keyword arguments it was called with."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.seen = logits, {}

    def forward(self, **kwargs):
        self.seen = kwargs
        return self.logits


def test_loss_fns_strip_labels_and_default_to_unpadded_inputs() -> None:
    logits = torch.randn(1, 4, 9)
    model = Echo(logits)
    ids, mask = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    total, count = causal_lm_loss_fn(model, {"input_ids": ids, "attention_mask": mask})
    assert set(model.seen) == {"input_ids", "attention_mask"} and count.item() == 2
    same = causal_lm_loss_fn(model, {"input_ids": ids, "attention_mask": mask,
                                     "labels": torch.tensor([[5, 6, 7, -100]])})
    assert "labels" not in model.seen and torch.equal(same[0], total)
    with pytest.raises(ValueError, match="masked-LM needs them"):
        masked_lm_loss_fn(model, {"input_ids": ids})
    with pytest.raises(TypeError, match="dict"):
        causal_lm_loss_fn(model, ids)
    with pytest.raises(ValueError, match="logits must be"):
        causal_lm_loss(logits, torch.zeros(1, 3, dtype=torch.long))


def test_default_wrap_policy_follows_no_split_modules() -> None:
    pytest.importorskip("transformers")
    from tests.workloads.hf_tiny import make_model

    assert [n for n, _ in default_blocks(make_model("llama"))] == ["model.layers.0", "model.layers.1"]
    assert [n for n, _ in default_blocks(make_model("gpt2"))] == ["transformer.h.0", "transformer.h.1"]
    assert [n for n, _ in default_blocks(make_model("bert"))] == ["bert.embeddings", "bert.encoder.layer.0",
                                                                  "bert.encoder.layer.1"]

    class Named(nn.Module):
        _no_split_modules = ["NoSuchBlock"]  # names nothing present: the layer-stack default

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    assert [n for n, _ in default_blocks(Named())] == ["layers.0", "layers.1"]
