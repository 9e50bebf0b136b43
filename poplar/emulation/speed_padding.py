"""Speed padding of a virtual device: sleeping so a micro-step's compute lasts as long as on the
GPU it emulates (docs/design.md §4.4-4.5).

The forward is padded to ``forward_fraction * time_s(b)`` when the root module returns. The
backward is padded *before* autograd runs, so that the gradients -- and the reduce-scatters and
gathers the stages issue from their hooks -- come when a GPU's would and at stages 2/3 faster
ranks really wait inside every micro-step's collectives. The pad leaves room for the real
backward: the larger of ``BACKWARD_MARGIN`` times the real backward learned at that batch (an
average of earlier ones) and ``backward_room * time_s(b)``. The second is what keeps a device
on time when other ranks compute at the same moment: the learned backward is mostly measured
while the other ranks sleep, and one backward that meets a busy core takes several times as
long. Calibration sets ``backward_room`` to its margin (the share of the curve the real
compute takes at most with every rank computing at once). A last top-up when the backward
returns makes the micro-step's compute exactly ``time_s(b)``.

"Compute" is wall time minus the seconds the runtime's comm ledger recorded inside collectives
meanwhile, the quantity the profiler measures. A micro-step whose real compute overshoots its
curve (beyond ``LATE_TOLERANCE``) is *late*: it ran slower than the emulated GPU. Every padded
micro-step counts in ``padded_steps``, the late ones also in ``late_steps``; their ratio is
the ``late_step_fraction`` benchmarks report (a run above ``LATE_BUDGET`` is not valid).

Per-block padding (ZeRO-3, ``block_pacing``): the ranks meet at every block's all-gather, so a
pass padded once at its end would make them wait on each other's real CPU compute. At each
block boundary -- before a block's forward, when a block's backward begins -- the device sleeps
until its compute reaches the boundary's share of the pass's emulated time (the share of real
compute learned there, ``Fractions``), so every rank arrives at the block's collective when a
GPU of its curve would. The backward is then paced block by block instead of padded up front;
the first micro-step of a size, with nothing learned yet, is padded as above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from poplar.emulation.block_pacing import BlockHooks, Fractions
from poplar.profiler.devices import OpenStep

# a micro-step is late when its real compute overshoots the curve by more than this (the sleep's
# own jitter and the learned real backward's error are a fraction of a millisecond)
LATE_TOLERANCE, LATE_TOLERANCE_S = 0.01, 5e-4
BACKWARD_MARGIN = 1.3  # room left after the backward pad, in units of the learned real backward
LATE_BUDGET = 0.01  # a run with more late micro-steps than this fraction does not count
# a block boundary is paced to (its share - BLOCK_LEAD) of the pass: the slack left for a core
# that stalls in a later segment, proportional to each rank's own time so ranks keep the curves' skew
BLOCK_LEAD = 0.1


def _boundary(share: float, emulated_s: float, real_s: float | None) -> float:
    """Seconds into a pass of ``emulated_s`` to pace a boundary at ``share`` of its real compute
    to: ``BLOCK_LEAD`` early, and early enough that the rest of the pass's real compute (the
    learned ``real_s``, with ``BACKWARD_MARGIN`` room) still ends on the curve."""
    target = (share - BLOCK_LEAD) * emulated_s
    if real_s is not None:
        target = min(target, emulated_s - BACKWARD_MARGIN * (1 - share) * real_s)
    return target


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter() >= deadline``: a coarse sleep, then a short spin for the
    last ~0.2 ms (a bare ``time.sleep`` overshoots by ~0.1 ms, 2-3 % of a 5 ms step)."""
    remaining = deadline - time.perf_counter()
    if remaining > 3e-4:
        time.sleep(remaining - 2e-4)
    while time.perf_counter() < deadline:
        pass


@dataclass
class PaddedStep(OpenStep):
    """A virtual device's open micro-step: the base record, the clocks its compute is measured by
    (wall seconds and the runtime's seconds in collectives when it opened), and the padding
    window: what was slept, and where the passes' real compute and block boundaries fell."""

    t0: float = 0.0  # wall clock when the micro-step opened
    c0: float = 0.0  # the runtime's comm-ledger seconds then
    paced: float = 0.0  # seconds of padding slept so far
    real_forward: float | None = None  # the forward's real compute (before its pad)
    forward_compute: float | None = None  # compute when the forward's pad ended
    b0: float | None = None  # compute when the backward began (after its up-front pad, if any)
    b0_paced: float = 0.0  # ``paced`` at that moment
    after_pad: float | None = None  # compute after the up-front backward pad
    forward_marks: list[float] = field(default_factory=list)  # real compute at each block boundary
    backward_marks: list[float] = field(default_factory=list)
    backward_expected: int = 0  # block backwards the forward announced
    backward_shares: list[float] | None = None  # learned shares the backward is paced to
    backward_s: float | None = None  # the backward's emulated seconds
    backward_real_s: float | None = None  # the backward's learned real seconds
    compute_over: bool = False  # autograd has returned: the stage is completing the collectives


def late_fraction(late: int, padded: int) -> float:
    """Late micro-steps over padded ones (0 when nothing was padded)."""
    return late / padded if padded else 0.0


class SpeedPadding:
    """The padding half of ``VirtualDevice`` (a mixin over ``Device``): needs ``time_s``,
    ``slowdown``, ``forward_fraction``, ``pads`` and the base class's open micro-step."""

    time_s: Callable[[int], float]
    slowdown: float | None
    forward_fraction: float
    _open: PaddedStep | None
    late_steps: int
    runtime: Any

    def _init_padding(self, backward_room: float) -> None:
        if not 0 <= backward_room < 1:
            raise ValueError(f"backward_room must be in [0, 1), got {backward_room}")
        self.backward_room = backward_room
        self.padded_steps = 0  # micro-steps padded to the curve (late ones included)
        self._real_backward: dict[int, float] = {}  # batch -> real backward compute (average), for padding
        self._blocks: BlockHooks | None = None  # ZeRO-3 block boundaries while attached
        self._forward_shares, self._backward_shares = Fractions(), Fractions()

    def _compute_s(self, step: PaddedStep, now: float | None = None) -> float:
        """Seconds of the open micro-step so far, less the seconds spent in collectives."""
        now = time.perf_counter() if now is None else now
        return now - step.t0 - (self.runtime.comm_ledger.total_seconds - step.c0)

    # ------------------------------------------------------------------ per-block pacing
    def _pace_to(self, step: PaddedStep, now: float, seconds: float) -> None:
        """Sleep ``seconds`` (if > 0) of padding, counted in ``step.paced``."""
        if seconds > 0:
            sleep_until(now + seconds)
            step.paced += time.perf_counter() - now

    def _pacing(self) -> PaddedStep | None:
        step = self._open
        if step is None or self._blocks is None or not self.pads or self.slowdown is not None:
            return None
        return step

    def block_forward(self) -> None:
        """Before a block's forward: pad to the boundary's share of the forward's time."""
        step = self._pacing()
        if step is None or step.forward_done:
            return  # not a training forward, or a recomputation inside backward
        now = time.perf_counter()
        compute = self._compute_s(step, now)
        marks = step.forward_marks
        marks.append(compute - step.paced)
        batch, count = step.batch, self._blocks.count
        shares = self._forward_shares.get(batch, count)
        if shares is not None and len(marks) <= len(shares):
            target = _boundary(shares[len(marks) - 1], self.forward_fraction * self.time_s(batch),
                               self._forward_shares.real_s(batch, count))
            self._pace_to(step, now, target - compute)

    def block_forward_end(self) -> bool:
        step = self._pacing()
        if step is None or step.forward_done:
            return False
        step.backward_expected += 1
        return True

    def block_backward(self) -> None:
        """When a block's backward begins: pad to the boundary's share of the backward's time."""
        step = self._pacing()
        if step is None or step.b0 is None:
            return
        now = time.perf_counter()
        compute = self._compute_s(step, now)
        marks = step.backward_marks
        marks.append(compute - step.b0 - (step.paced - step.b0_paced))
        shares = step.backward_shares
        if shares is not None and len(marks) <= len(shares):
            lead = _boundary(shares[len(marks) - 1], step.backward_s, step.backward_real_s)
            self._pace_to(step, now, step.b0 + lead - compute)

    def _learn_forward(self, step: PaddedStep, compute: float) -> None:
        marks = step.forward_marks
        if self._blocks is not None and marks and len(marks) == self._blocks.count:
            self._forward_shares.learn(step.batch, marks, compute - step.paced)

    def _learn_backward(self, step: PaddedStep, compute: float) -> None:
        marks = step.backward_marks
        if marks and step.b0 is not None and len(marks) == step.backward_expected:
            real = compute - step.b0 - (step.paced - step.b0_paced)
            self._backward_shares.learn(step.batch, marks, real)

    def _start_backward_pacing(self, step: PaddedStep, compute: float) -> bool:
        """At backward start: True if the backward will be paced block by block (shares known)."""
        if self._blocks is None:
            return False
        step.b0, step.b0_paced = compute, step.paced
        shares = self._backward_shares.get(step.batch, step.backward_expected)
        if shares is None:
            return False
        step.backward_shares, step.backward_s = shares, self.time_s(step.batch) - compute
        step.backward_real_s = self._backward_shares.real_s(step.batch, len(shares))
        return True

    @property
    def late_step_fraction(self) -> float:
        return late_fraction(self.late_steps, self.padded_steps)

    def _pad_forward(self, step: PaddedStep) -> None:
        now = time.perf_counter()
        compute = self._compute_s(step, now)
        step.real_forward = compute
        self._learn_forward(step, compute)
        if self.slowdown is not None:
            sleep_until(now + (self.slowdown - 1) * compute)
        else:
            sleep_until(now + self.forward_fraction * self.time_s(step.batch) - compute)
        step.forward_compute = self._compute_s(step)

    def _pad_backward_start(self, step: PaddedStep, loss: torch.Tensor) -> None:
        if self.slowdown is not None:
            def queue(grad: torch.Tensor) -> None:
                torch.autograd.Variable._execution_engine.queue_callback(self._pad_backward)
            loss.register_hook(queue)
            return
        batch = step.batch
        now = time.perf_counter()
        if self._start_backward_pacing(step, self._compute_s(step, now)):
            return
        target = self.time_s(batch)
        real = self._real_backward.get(batch, 2.0 * (step.real_forward or 0.0))
        room = max(BACKWARD_MARGIN * real, self.backward_room * target)
        self._pace_to(step, now, target - room - self._compute_s(step, now))
        step.after_pad = step.b0 = self._compute_s(step)
        step.b0_paced = step.paced

    def _pad_backward(self) -> None:
        """Slowdown mode: when autograd has finished, stretch the backward's real compute."""
        step = self._open
        if step is None:
            return
        now = time.perf_counter()
        compute = self._compute_s(step, now)
        real_backward = compute - (compute if step.forward_compute is None else step.forward_compute)
        sleep_until(now + (self.slowdown - 1) * max(real_backward, 0.0))

    def _top_up(self, step: PaddedStep) -> None:
        """At the backward's end: count the step, learn its real backward, sleep to the curve."""
        now = time.perf_counter()
        compute = self._compute_s(step, now)
        self._learn_backward(step, compute)
        if step.after_pad is not None:  # learn the real compute that follows the backward pad
            real = max(compute - step.after_pad, 0.0)
            seen = self._real_backward.get(step.batch)
            self._real_backward[step.batch] = real if seen is None else 0.7 * seen + 0.3 * real
        target = self.time_s(step.batch)
        self.padded_steps += 1
        if compute > target + max(LATE_TOLERANCE_S, LATE_TOLERANCE * target):
            self.late_steps += 1
        sleep_until(now + target - compute)
