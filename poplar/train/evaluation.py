"""Evaluation on a held-out set, exact across ranks with uneven shards.

``evaluate(engine, dataset)`` (every rank together; ``fit(evaluation=EvalOptions(data, every))``
calls it) splits the dataset into contiguous shards, one per rank, sized in proportion to each
rank's share of the plan's global batch (a fast rank evaluates more; a rank with no samples,
none), and runs each shard in micro-batches of the rank's planned micro-batch size (a size known
to fit), under ``torch.no_grad()`` with the model in eval mode.

Exactness: every micro-batch contributes a pair (loss sum, count). A ``loss_fn`` returning
``(loss_sum, count)`` (token-weighted, e.g. summed token cross-entropy and the number of
non-ignored tokens) gives it directly; one returning a mean loss gives (mean·m, m) for its m
samples. The pairs are summed on each rank in float64 and then over ranks by one all-reduce, and
the eval loss is Σ sums / Σ counts: the loss of a single process evaluating the whole set at once,
never a mean of per-rank means (which weighs a small shard as much as a large one). Perplexity is
exp(loss), meaningful when the loss is a token cross-entropy.

At ZeRO-3 a no-grad forward gathers blocks and is collective, so every rank runs the same number
of forwards: a rank with fewer micro-batches repeats a one-sample forward whose result is
dropped. A failure on any rank (a bad batch, a loss_fn that raises) is one ``DistributedError``
on every rank, agreed after the forwards.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from poplar.comm import Phase
from poplar.zero.batches import batch_size_of, move_to_device
from poplar.types.plans import Plan


@dataclass
class EvalResult:
    """One evaluation: ``loss`` = Σ sums / Σ counts over every rank."""

    iteration: int
    loss: float
    perplexity: float
    count: float  # what the loss averages over: tokens for (sum, count) losses, else samples
    samples: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loss_sum_count(out: Any, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, count) of a ``loss_fn`` result: a ``(sum, count)`` pair as it is, a mean loss
    as (mean·samples, samples)."""
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise ValueError(f"loss_fn returned a sequence of {len(out)} items; return a mean loss or a pair "
                             "(loss_sum, count)")
        total, count = out
        total = total.detach().double() if torch.is_tensor(total) else torch.tensor(float(total), dtype=torch.float64)
        count = count.detach().double() if torch.is_tensor(count) else torch.tensor(float(count), dtype=torch.float64)
        return total.reshape(()), count.reshape(()).to(total.device)
    if not torch.is_tensor(out) or out.numel() != 1:
        raise ValueError(f"loss_fn returned {type(out).__name__}; return a scalar mean loss or a pair "
                         "(loss_sum, count)")
    mean = out.detach().double().reshape(())
    return mean * samples, torch.tensor(float(samples), dtype=torch.float64, device=mean.device)


def eval_shards(num_samples: int, plan: Plan) -> list[range]:
    """Contiguous shards of ``num_samples`` items, one per rank, in proportion to each rank's
    samples in ``plan`` (largest remainders get the leftovers, lowest rank first on ties)."""
    shares = [r.num_samples for r in plan.ranks]
    total = sum(shares)
    exact = [num_samples * s / total for s in shares]
    sizes = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in order[:num_samples - sum(sizes)]:
        sizes[r] += 1
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def _eval_batch_size(plan: Plan, rank: int) -> int:
    row = plan.ranks[rank]
    return max(1, row.micro_batch_size, row.last_batch_size)


def evaluate(engine: Any, dataset: Any, *, loss_fn: Callable | None = None,
             collate_fn: Callable[[list], Any] | None = None, max_samples: int | None = None) -> EvalResult:
    """The exact eval loss of ``dataset`` (or its first ``max_samples`` items) over every rank.
    Collective: every rank calls it at the same point, between iterations."""
    loss_fn = loss_fn or engine.loss_fn
    collate = collate_fn or default_collate
    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    if n < 1:
        raise ValueError("the evaluation set is empty; give eval_data with at least one sample")
    plan, rank, world = engine.plan, engine.rank, engine.world_size
    shards = eval_shards(n, plan)
    sizes = [_eval_batch_size(plan, r) for r in range(world)]
    mine, bs = shards[rank], sizes[rank]
    rounds = max(math.ceil(len(s) / b) for s, b in zip(shards, sizes))  # forwards every rank runs at ZeRO-3
    mine_rounds = math.ceil(len(mine) / bs) if rounds else 0
    pad_forwards = engine.zero_stage == 3
    device = engine.comm.device
    acc = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, count, samples
    error: str | None = None
    module = engine.module
    was_training = module.training
    t0 = time.perf_counter()
    module.train(False)
    try:
        with torch.no_grad(), engine.comm_ledger.scope(Phase.EVAL):
            for k in range(rounds if pad_forwards else mine_rounds):
                real = k < mine_rounds
                idx = list(mine[k * bs:(k + 1) * bs]) if real else [0]
                if error is not None and not pad_forwards:
                    break
                try:
                    batch = move_to_device(collate([dataset[i] for i in idx]), device)
                    out = loss_fn(module, batch)
                    if real and error is None:
                        total, count = loss_sum_count(out, batch_size_of(batch))
                        acc[0] += total.to(device)
                        acc[1] += count.to(device)
                        acc[2] += len(idx)
                except Exception as e:  # noqa: BLE001 - agreed below, on every rank
                    error = error or f"evaluation failed on a batch of samples {idx[:4]}...: {type(e).__name__}: {e}"
    finally:
        module.train(was_training)
    engine.comm.agree(error, "evaluation")
    engine.comm.all_reduce(acc, tag="eval:loss")
    total, count, samples = acc.tolist()
    if count <= 0:
        raise ValueError("the evaluation set holds nothing to score (every count is 0, e.g. all labels -100)")
    loss = total / count
    return EvalResult(engine.iteration, loss, math.exp(loss) if loss < 700 else math.inf, count, int(samples),
                      time.perf_counter() - t0)
