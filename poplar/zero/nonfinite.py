"""Non-finite losses and gradients: one agreed verdict per iteration, for fp32, bf16 and fp16.

Each rank checks what it holds before the optimizer step: its loss sum, and the gradients it
holds then (stages 0/1: its local flat gradients, before they are reduced; stages 2/3: its
reduced gradient shards, which every rank's inf or NaN reaches through the reduce-scatter; stage
3 also its late gradients, not reduced yet). The check is one ``sum`` per flat buffer, added into
one float64 number: inf and NaN survive a sum (inf - inf is NaN), and it reads each buffer once
without allocating anything of its size (``isfinite(g).all()`` would allocate a mask as large as
the gradient). A finite buffer whose fp32 sum exceeds fp32's range (3.4e38) also counts as
non-finite: no step could use such a gradient. With a reduce dtype narrower than fp32's range
(fp16), stages 0/1 check instead that no local gradient exceeds that range divided by the number
of ranks (one max-abs per buffer), so neither the cast nor the sum over ranks can overflow
unseen; at stages 2/3 the cast and the sum come before the check, which sees their inf. The
rank's flag (0 or 1) rides in the
iteration's existing status all-reduce (docs/design.md §3.4), so the sum over ranks is the number
of ranks that saw a non-finite value, the same on every rank, and no collective is added.

If any rank flagged, every rank skips the step (``NonFinitePolicy.SKIP``: gradients dropped,
parameters and optimizer state untouched) or raises (``RAISE``). Under fp16 dynamic loss
scaling an overflow is the scaler's signal to back off, always a skip; only an overflow at the
minimum scale (or under a static scale) is treated as a real non-finite step. More than
``max_consecutive_skips`` such skips in a row raise on every rank.
"""

from __future__ import annotations

from enum import Enum

import torch


class NonFinitePolicy(str, Enum):
    """What every rank does when some rank's loss or gradients are not finite."""

    SKIP = "skip"  # drop the step's gradients, take no step, go on (raise after too many in a row)
    RAISE = "raise"  # raise a DistributedError on every rank

    def __str__(self) -> str:
        return self.value


class SkipReport(Enum):
    """What a skipped step leaves behind besides its count (``ZeroRuntime.skipped_steps``)."""

    LOG = "log"  # a warning on rank 0 (training: a skipped optimizer step is news)
    COUNT = "count"  # the count alone (profiling's trial steps: an fp16 overflow there trains nothing)


class Verdict(Enum):
    """The guard's decision on one non-finite iteration."""

    SKIP = "skip"
    RAISE = "raise"  # the policy is RAISE
    TOO_MANY = "too_many"  # more than max_consecutive_skips in a row


def nonfinite_flag(grads: list[torch.Tensor], loss_sum: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """1.0 (float64, on the loss's device) if ``loss_sum`` or any element of ``grads`` is not
    finite (or, with ``limit``, larger in magnitude), else 0.0; computed on the device, without
    waiting for it."""
    total = loss_sum.detach().to(torch.float64).clone()
    for g in grads:
        if limit is None:
            total += g.sum()
        else:  # NaN fails "<=" too
            total += torch.where(torch.linalg.vector_norm(g, float("inf")) <= limit, 0.0, float("inf"))
    return (~torch.isfinite(total)).to(torch.float64)


def grad_summary(grad: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """One value of ``grad`` that ``nonfinite_flag`` reads as it reads ``grad`` (its sum, or
    with ``limit`` its largest magnitude): a stage that reduces a gradient in place takes it
    before the reduction, for the check of this rank's own gradient."""
    return grad.sum() if limit is None else torch.linalg.vector_norm(grad, float("inf"))


class NonFiniteGuard:
    """Counts skipped steps and decides, identically on every rank, whether to raise."""

    def __init__(self, policy: NonFinitePolicy, max_consecutive_skips: int) -> None:
        self.policy, self.max_consecutive_skips = policy, max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive = 0  # skips in a row that count against max_consecutive_skips

    def on_nonfinite(self, counted: bool) -> Verdict:
        """A skipped step. ``counted`` is False for an fp16 overflow the loss scaler answers by
        backing off (normal, never raises)."""
        self.skipped_steps += 1
        if not counted:
            return Verdict.SKIP
        if self.policy is NonFinitePolicy.RAISE:
            return Verdict.RAISE
        self.consecutive += 1
        return Verdict.TOO_MANY if self.consecutive > self.max_consecutive_skips else Verdict.SKIP

    def on_step(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_steps, self.consecutive = int(state["skipped_steps"]), int(state["consecutive"])

    def warning(self, iteration: int, where: str, scales: tuple[float, float] | None) -> str:
        """Rank 0's log line for a skipped step; ``where``: ``where_nonfinite``'s words;
        ``scales``: the loss scale before and after."""
        scale = "" if scales is None else f"; loss scale {scales[0]:g} -> {scales[1]:g}"
        return (f"iteration {iteration}: {where}; the optimizer step was skipped on every rank "
                f"({self.skipped_steps} skipped so far{scale})")

    def message(self, verdict: Verdict, iteration: int, details: list[str | None]) -> str:
        """The error every rank raises; ``details[r]`` says what rank r saw (None: nothing)."""
        lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(details) if d is not None)
        if verdict is Verdict.RAISE:
            return (f"iteration {iteration}: non-finite loss or gradients (nonfinite='raise'); no optimizer step "
                    f"was taken:\n{lines}")
        return (f"iteration {iteration}: {self.consecutive} consecutive steps had non-finite loss or gradients "
                f"(max_consecutive_skips={self.max_consecutive_skips}); no optimizer step was taken in them. Check "
                "the learning rate, the data (inf or NaN inputs) and the loss function; under fp16 the minimum loss "
                f"scale, or train in bf16. Last step:\n{lines}")


def where_nonfinite(loss_ranks: tuple[int, ...], flagged: int, world_size: int, reduced: bool) -> str:
    """Where an iteration's inf or NaN was, in words that are true: the ranks whose own loss was
    not finite (a loss is local), else how many ranks held non-finite gradients. ``reduced``: the
    gradients checked are shards after a reduce-scatter (stages 2/3), which carries one rank's inf
    or NaN into every rank's shard, so their count does not say on how many ranks it arose."""
    if loss_ranks:
        names = f"rank {loss_ranks[0]}" if len(loss_ranks) == 1 else "ranks " + ", ".join(map(str, loss_ranks))
        return f"non-finite loss on {names} ({len(loss_ranks)} of {world_size} ranks)"
    if reduced:
        return (f"non-finite gradients in the reduced gradient shards of {flagged} of {world_size} ranks (one rank's "
                "inf or NaN reaches every shard it is summed into)")
    return f"non-finite gradients on {flagged} of {world_size} ranks"


def local_detail(grads: list[torch.Tensor], loss_sum: torch.Tensor, limit: float | None = None) -> str | None:
    """What this rank saw, for an error message (None if everything it holds is finite)."""
    loss = float(loss_sum)
    bad_grads = bool(nonfinite_flag(grads, torch.zeros((), dtype=torch.float64, device=loss_sum.device), limit))
    what = [f"loss sum {loss}"] if not torch.isfinite(torch.tensor(loss)) else []
    what += ["non-finite gradients"] if bad_grads else []
    return ", ".join(what) or None
