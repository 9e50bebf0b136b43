"""A tiny model with tied weights and odd-sized parameters, its data, and the single-process
reference that every engine test compares against (docs/design.md §2)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poplar.types.plans import Plan, RankPlan

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 5


class TiedNet(nn.Module):
    """Embedding tied to the output head; parameter sizes (481, 377, 29, ...) divide by neither 2 nor 3."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(self.norm(h))


def make_model(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """Two param groups with different settings: matrices, and vectors (biases, norm)."""
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    if kind == "sgd":
        return torch.optim.SGD([{"params": mats, "lr": 0.5}, {"params": vecs, "lr": 0.2, "momentum": 0.5}],
                               lr=0.5, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "lr": 3e-3}],
                                 lr=1e-2, weight_decay=0.0)
    raise ValueError(kind)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over the micro-batch's samples (all of equal length)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def global_batch(iteration: int, gbs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + iteration)
    return torch.randint(0, VOCAB, (gbs, SEQ + 1), generator=g)


def rank_slice(batch: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    start = plan.sample_offsets()[rank]
    return batch[start:start + plan.ranks[rank].num_samples]


def reference_run(kind: str, gbs: int, iterations: int, max_grad_norm: float | None
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training on the whole global batch."""
    model = make_model()
    return train_reference(model, make_optimizer(model, kind), lambda it: loss_fn(model, global_batch(it, gbs)),
                           iterations, max_grad_norm)


def assert_runs_match_reference(results: list[dict], configs: list[tuple[str, float | None]], plans: int, gbs: int,
                                iterations: int) -> None:
    """Every rank's run of every (optimizer kind, max_norm) config and plan index, as
    ``results[rank][(kind, max_norm, plan index)] = (losses, full state)``, equals single-process
    training on the whole global batch to 1e-5."""
    for kind, max_norm in configs:
        ref_losses, ref_state = reference_run(kind, gbs, iterations, max_norm)
        for pi in range(plans):
            for rank, res in enumerate(results):
                losses, state = res[(kind, max_norm, pi)]
                assert max_rel_err(state, ref_state) <= 1e-5, (kind, max_norm, pi, rank)
                assert losses == pytest.approx(ref_losses, rel=1e-5), (kind, max_norm, pi, rank)


def train_reference(model: nn.Module, opt: torch.optim.Optimizer, loss_at: Callable[[int], Any], iterations: int,
                    max_grad_norm: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training, the reference of every parity test: ``loss_at(iteration)`` is the
    whole global batch's mean loss, or a pair (loss_sum, count) trained as sum / count."""
    losses = []
    for it in range(iterations):
        loss = loss_at(it)
        if isinstance(loss, tuple):
            total, count = loss
            loss = total / count
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plan_of(*rows: tuple[int, int, int]) -> Plan:
    return Plan([RankPlan(*r) for r in rows])


def with_shards(plan: Plan, weights: tuple[float, ...]) -> Plan:
    """``plan`` with these shard weights, one per rank (its batches unchanged)."""
    return Plan([RankPlan(r.micro_batch_size, r.accum_steps, r.last_batch_size, shard_weight=w)
                 for r, w in zip(plan.ranks, weights)])


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)
