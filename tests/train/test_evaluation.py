"""Evaluation over uneven shards equals one process evaluating the whole set (to 1e-6): token
(sum, count) losses on right-padded variable-length samples and per-sample mean losses, at
ZeRO-0 and ZeRO-3 (where ranks with fewer batches must still join every forward), on 3 ranks
with a plan that gives them 7, 2 and 1 samples, and a rank with none."""

from __future__ import annotations

import pytest

import math

import torch
import torch.nn.functional as F
from torch import nn

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.train.evaluation import eval_shards, evaluate
from tests.toy import SEQ, VOCAB, make_model, plan_of
from poplar.zero.config import ZeroConfig

PLANS = [plan_of((3, 2, 1), (2, 1, 0), (1, 1, 0)), plan_of((3, 3, 1), (0, 0, 0), (2, 2, 0))]


class Padded(torch.utils.data.Dataset):
    """Right-padded samples of lengths 2..SEQ+1, labels -100 after the end."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.items = []
        for i in range(n):
            length = 2 + i % SEQ
            ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            labels = ids.clone()
            labels[length:] = -100
            ids[length:] = 0
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def token_loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"][:, :-1])
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def mean_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    total, count = token_loss(model, batch)
    return total / count.clamp_min(1)  # a per-micro-batch mean: weighted by samples, not tokens


def reference(n: int) -> tuple[float, float]:
    """(token loss, sample-weighted loss) of one process over the whole set."""
    model = make_model(1)
    data = Padded(n)
    with torch.no_grad():
        total, count = token_loss(model, torch.utils.data.default_collate([data[i] for i in range(n)]))
        per_sample = [float(mean_loss(model, torch.utils.data.default_collate([data[i]]))) for i in range(n)]
    return float(total / count), sum(per_sample) / n


def worker(rank: int, world: int, n: int) -> list:
    torch.set_num_threads(1)
    out = []
    for plan in PLANS:
        for stage in (0, 3):
            model = make_model(1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            policy = {nn.Linear, nn.LayerNorm} if stage == 3 else None
            engine = PoplarEngine(model, opt, zero_stage=ZeroConfig(stage, wrap_policy=policy), plan=plan)
            data = Padded(n)
            tokens = evaluate(engine, data, loss_fn=token_loss)
            # mean losses over batches of one sample each weigh every sample equally, like the reference
            samples = evaluate(engine, [data[i] for i in range(n)], loss_fn=mean_loss, max_samples=n)
            out.append((stage, tokens.loss, tokens.perplexity, tokens.samples, samples.loss, samples.count))
    return out


@pytest.mark.multiprocess
def test_eval_loss_over_uneven_shards_equals_one_process() -> None:
    n = 23
    ref_tokens, _ = reference(n)
    results = spawn(worker, 3, (n,), timeout_s=120)
    for per_rank in results:
        assert per_rank == results[0]  # the same floats on every rank
        for stage, loss, ppl, samples, _, count in per_rank:
            assert abs(loss - ref_tokens) <= 1e-6 * abs(ref_tokens), (stage, loss, ref_tokens)
            assert math.isclose(ppl, math.exp(loss)) and samples == n and count == n


def test_mean_losses_weigh_each_micro_batch_by_its_samples() -> None:
    """A loss_fn returning a mean counts m samples per micro-batch; evaluating one sample per
    micro-batch then equals the per-sample reference exactly."""
    n = 7
    _, ref_samples = reference(n)
    plan = plan_of((1, 1, 0))
    model = make_model(1)
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
    result = evaluate(engine, Padded(n), loss_fn=mean_loss)
    assert abs(result.loss - ref_samples) <= 1e-6 * ref_samples and result.count == n


def test_shards_follow_the_plan_and_cover_the_set() -> None:
    shards = eval_shards(23, PLANS[0])
    assert [len(s) for s in shards] == [16, 5, 2]
    assert [i for s in shards for i in s] == list(range(23))
    assert [len(s) for s in eval_shards(5, PLANS[1])] == [4, 0, 1]
