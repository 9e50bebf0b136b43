"""One iteration's loss bookkeeping and its status reduction (docs/design.md §2, §3.4).

A micro-step's loss comes in one of two kinds, and a rank's ``LossAccumulator`` records which:

- ``LossKind.MEAN``: a one-element tensor, the mean loss of the micro-batch's m samples. Its
  gradient is weighted by m / gbs at backward, so every sample of the global batch weighs 1/gbs.
- ``LossKind.SUM``: a pair ``(loss_sum, count)``, e.g. the summed token cross-entropy and the
  number of tokens it covers. The reduced gradients are divided once, at step time, by the global
  count (Σ of every rank's counts), so every counted item of the global batch weighs 1/Σ count,
  with no collective added per micro-step. So that a sum's gradients stay near a mean's size (an
  fp16 loss scale would overflow on a sum of thousands of tokens), sums are backpropagated times a
  power of two w near 1 / (the previous iteration's global count; gbs at first) and the divisor is
  count x w: multiplying by a power of two is exact, so the result is bitwise the same for any w.

The iteration ends with the status reduction: one all-reduce of 7 + 3 x world float64 numbers
(loss sum, samples, failed flag, non-finite flag, count, and whether it used mean or sum
losses, then three slots per rank that only that rank fills: its compute seconds, its samples
and whether its own loss was non-finite (so a message can name the ranks),
so the sum hands every rank every rank's measured compute with no collective of its own, which
drift detection reads), so every rank reaches the same verdict: a failure, a sample total other than gbs, loss
kinds mixed across ranks or an invalid count is an error on every rank; otherwise the step's
gradient divisor and its global mean loss follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch

from poplar.comm import Communicator
from poplar.zero.batches import batch_size_of
from poplar.logs import log
from poplar.types.plans import RankPlan
from poplar.zero.nonfinite import NonFiniteGuard, Verdict


class LossKind(str, Enum):
    """How a micro-step's loss is weighted (docs/design.md §2)."""

    MEAN = "mean"  # mean over the micro-batch's samples, weighted m / gbs
    SUM = "sum"  # (loss_sum, count): divided by the global count once, at step time

    def __str__(self) -> str:
        return self.value


def split_loss(loss: Any) -> tuple[torch.Tensor, Any | None]:
    """``loss`` as (tensor, count): count None for a mean loss. Raises ``TypeError`` naming the
    accepted forms for anything else."""
    if isinstance(loss, (tuple, list)):
        if len(loss) != 2:
            raise TypeError(f"a loss pair must be (loss_sum, count), got {len(loss)} values")
        total, count = loss
        if not (torch.is_tensor(total) and total.numel() == 1):
            raise TypeError(f"the first value of a (loss_sum, count) pair must be a one-element tensor, got {total!r}")
        if torch.is_tensor(count):
            if count.numel() != 1 or count.is_complex():
                raise TypeError(f"the count of a (loss_sum, count) pair must be one number, got {count!r}")
        elif isinstance(count, bool) or not isinstance(count, (int, float)):
            raise TypeError(f"the count of a (loss_sum, count) pair must be a number or a one-element tensor, "
                            f"got {count!r}")
        return total, count
    if torch.is_tensor(loss) and loss.numel() == 1:
        return loss, None
    raise TypeError("loss_fn must return a one-element tensor (the mean loss of the micro-batch) or a pair "
                    f"(loss_sum, count) (e.g. summed token losses and the number of tokens), got {loss!r}")


class LossAccumulator:
    """This rank's losses of one iteration: their sum, its samples and, for sum losses, the count."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sum_weight: float | None = None  # w, a power of two, the same on every rank
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.count = torch.zeros((), dtype=torch.float64, device=self.device)
        self.samples = 0
        self.kind: LossKind | None = None
        self.error: str | None = None  # kinds mixed on this rank: reported at the status reduction

    def objective(self, loss: Any, num_samples: int, global_batch_size: int) -> torch.Tensor:
        """Record one micro-step's loss; returns the fp32 scalar whose gradient is the micro-step's
        share of the step's gradient (before the fp16 loss scale and the global count)."""
        total, count = split_loss(loss)
        kind = LossKind.MEAN if count is None else LossKind.SUM
        if self.kind is None:
            self.kind = kind
        elif kind is not self.kind and self.error is None:
            self.error = (f"loss_fn returned a {kind} loss after a {self.kind} loss in the same iteration; return "
                          "either the mean loss or a (loss_sum, count) pair in every micro-step")
        value = total.detach().double().reshape(())
        self.samples += num_samples
        if count is None:
            self.loss_sum += value * num_samples
            return total.float() * (num_samples / global_batch_size)
        self.loss_sum += value
        if self.sum_weight is None:
            self.sum_weight = _power_of_two_near(1.0 / global_batch_size)
        if torch.is_tensor(count):  # kept on the device: no synchronisation per micro-step
            self.count += count.detach().to(device=self.device, dtype=torch.float64).reshape(())
        else:
            self.count += float(count)
        return total.float() * self.sum_weight

    def divisor(self, status: IterationStatus) -> float:
        """What the reduced gradients are divided by (besides the fp16 loss scale): count x w
        for sum losses, 1 for mean losses."""
        if status.kind is LossKind.MEAN or status.count <= 0:
            return 1.0
        return status.count * self.weight_for(status)

    def weight_for(self, status: IterationStatus) -> float:
        return self.sum_weight if self.sum_weight is not None else _power_of_two_near(1.0 / status.samples)

    def end_iteration(self, status: IterationStatus) -> None:
        """Choose the next iteration's w from this one's agreed global count (every rank alike)."""
        if status.kind is LossKind.SUM and status.count > 0:
            self.sum_weight = _power_of_two_near(1.0 / status.count)


def _power_of_two_near(x: float) -> float:
    return 2.0 ** round(math.log2(x))


@dataclass(frozen=True)
class IterationStatus:
    """What every rank agreed on at the status reduction."""

    loss_sum: float
    samples: int
    failed_ranks: int
    nonfinite_ranks: int
    count: float
    mean_ranks: int  # ranks whose micro-steps returned mean losses
    sum_ranks: int  # ranks whose micro-steps returned (loss_sum, count) pairs
    rank_compute_s: tuple[float, ...] = ()  # each rank's forward+backward seconds, collectives taken out
    rank_samples: tuple[int, ...] = ()  # each rank's samples this iteration
    # the ranks whose own loss sum was not finite: exact, a loss is local (a gradient shard after a
    # reduce-scatter carries any rank's inf or NaN, so nonfinite_ranks cannot say where it arose)
    loss_nonfinite_ranks: tuple[int, ...] = ()

    @property
    def kind(self) -> LossKind:
        return LossKind.SUM if self.sum_ranks else LossKind.MEAN

    @property
    def empty(self) -> bool:
        """Sum losses whose global count is 0: the mean loss 0/0 is undefined."""
        return self.kind is LossKind.SUM and self.count == 0

    def mean_loss(self, global_batch_size: int) -> float:
        """The global mean: per sample (mean losses) or per counted item (sum losses)."""
        if self.kind is LossKind.SUM:
            return self.loss_sum / self.count if self.count > 0 else math.nan
        return self.loss_sum / global_batch_size


def reduce_status(comm: Communicator, losses: LossAccumulator, failed: bool, nonfinite: torch.Tensor,
                  compute_s: float = 0.0) -> IterationStatus:
    """The one all-reduce of the iteration's status (``nonfinite``: this rank's 0/1 flag, float64;
    ``compute_s``: this rank's measured compute seconds, shared in its own slot)."""
    dev, world, rank = comm.device, comm.world_size, comm.rank
    kind = losses.kind
    head = torch.tensor([float(losses.samples), 1.0 if failed else 0.0], dtype=torch.float64, device=dev)
    tail = torch.tensor([1.0 if kind is LossKind.MEAN else 0.0, 1.0 if kind is LossKind.SUM else 0.0],
                        dtype=torch.float64, device=dev)
    slots = torch.zeros(3 * world, dtype=torch.float64, device=dev)
    slots[3 * rank] = compute_s
    slots[3 * rank + 1] = float(losses.samples)
    slots[3 * rank + 2] = (~torch.isfinite(losses.loss_sum.detach())).to(torch.float64).reshape(())
    status = torch.cat([losses.loss_sum.reshape(1), head, nonfinite.reshape(1).to(torch.float64),
                        losses.count.reshape(1), tail, slots])
    comm.all_reduce(status, tag="status")
    values = status.tolist()
    loss_sum, samples, failed_ranks, nonfinite_ranks, count, mean_ranks, sum_ranks = values[:7]
    per_rank = values[7:]
    return IterationStatus(loss_sum, round(samples), round(failed_ranks), round(nonfinite_ranks), count,
                           round(mean_ranks), round(sum_ranks), tuple(per_rank[0::3]),
                           tuple(round(x) for x in per_rank[1::3]),
                           tuple(r for r, x in enumerate(per_rank[2::3]) if x > 0))


def status_error(status: IterationStatus, iteration: int, global_batch_size: int, world_size: int) -> str | None:
    """The error every rank raises for an agreed status that cannot make a step (None: it can)."""
    if status.samples != global_batch_size:
        return (f"iteration {iteration}: ranks processed {status.samples} samples in all but the plan's global "
                f"batch is {global_batch_size}; each rank must backward exactly its plan row's samples")
    if status.mean_ranks and status.sum_ranks:
        return (f"iteration {iteration}: {status.sum_ranks} of {world_size} ranks returned (loss_sum, count) pairs "
                f"and {status.mean_ranks} returned mean losses; every rank's loss_fn must return the same kind")
    if status.kind is LossKind.SUM and not (math.isfinite(status.count) and status.count >= 0):
        return (f"iteration {iteration}: the global count of the (loss_sum, count) losses is {status.count}; counts "
                "must be finite and non-negative (e.g. the number of tokens whose label is not -100)")
    return None


def check_batch(batch: Any, row: RankPlan, loss_fn: Callable | None) -> tuple[str | None, BaseException | None]:
    """This rank's input against its plan row: an error message (and its exception) or None."""
    try:
        n = batch_size_of(batch)
    except ValueError as e:
        return str(e), e
    if n != row.num_samples:
        return (f"batch has {n} samples but this rank's plan row (micro_batch_size={row.micro_batch_size}, "
                f"accum_steps={row.accum_steps}, last_batch_size={row.last_batch_size}) needs "
                f"{row.num_samples}; give each rank its slice of the global batch (poplar's sampler does "
                "this)"), None
    if loss_fn is None:
        return "no loss_fn: pass train_step(batch, loss_fn) or PoplarEngine(..., loss_fn=...)", None
    return None, None


def left_out_batch_error(batch: Any) -> str | None:
    """The error of a batch given to a rank the plan leaves out of the step (None: no batch, as
    ``step()`` has, or an empty one), reported at the status reduction as ``check_batch``'s are."""
    if batch is None:
        return None
    try:
        n = batch_size_of(batch)
    except ValueError as e:
        return str(e)
    if n == 0:
        return None
    return (f"the plan leaves this rank out of the step (its row has 0 samples) but it was given {n} samples; "
            "give it an empty batch (poplar's sampler does)")


def failure_message(iteration: int, messages: list[str | None]) -> str:
    """The error every rank raises when some failed; ``messages[r]``: rank r's error or None."""
    lines = [f"  rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    return (f"iteration {iteration} failed on {len(lines)} of {len(messages)} ranks; no optimizer step was "
            "taken:\n" + "\n".join(lines))


def skip_empty_step(guard: NonFiniteGuard, iteration: int, rank: int) -> str | None:
    """Sum losses counting 0 items over the global batch: the mean loss 0/0 is not finite, so the
    step counts as a skipped non-finite step. Rank 0 logs a warning; returns the error every rank
    raises instead when the policy says so (None: skip and go on)."""
    message = (f"iteration {iteration}: the (loss_sum, count) losses of the whole global batch count 0 items "
               "(every label ignored?), so the mean loss is 0/0")
    if guard.on_nonfinite(counted=True) is Verdict.SKIP:
        if rank == 0:
            log.warning(f"{message}; the optimizer step was skipped on every rank ({guard.skipped_steps} skipped "
                        "so far)")
        return None
    return (f"{message}; no optimizer step was taken ({guard.consecutive} such or non-finite steps in a row, "
            f"nonfinite='{guard.policy}', max_consecutive_skips={guard.max_consecutive_skips}). Check that "
            "the batches hold counted tokens")
