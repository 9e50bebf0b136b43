"""What one rank's iteration time is made of: compute, comm, idle and other.

These are the per-rank times of the log table, ``metrics.json`` and TensorBoard, defined here
and nowhere else:

- **compute**: forward and backward, with the time blocked in collectives taken out;
- **idle**: the time the rank waited for the slowest rank, wherever it waited: the part of each
  collective's blocked time spent before the last rank arrived;
- **comm**: the collectives' own time: the rest of the blocked time;
- **other**: the rest of the step: the optimizer step, clipping, bookkeeping.

compute + comm + idle + other is the rank's wall time of the step.

[Note: the wait is read from durations, not from clocks]
Every rank blocks in a collective until the collective completes, and all of them leave it at
about the same time, so a rank's blocked seconds are its wait for the last rank plus the
collective's own time. The last rank to arrive waits for nobody: its blocked seconds are the
collective's own time, and it is the rank that blocked least. So, per collective, idle is this
rank's blocked seconds minus the fewest any rank blocked, and comm is that fewest. Comparing
entry times (the ledger's ``start``) would say the same on one machine, but clocks of different
machines disagree by milliseconds, while durations need no common clock.
Collectives are matched by their order in the step: every rank issues the step's collectives in
the same order. Only collectives on the flat link (all ranks taking part) are matched; a
node-local or cross-node step of a hierarchical collective counts wholly as comm, since the
ledger does not say which ranks took part. A step whose ranks issued different numbers of flat
collectives is not matched either (all of its blocked time is comm).

Where only every rank's compute is known (the Lightning door logs each step from the iteration's
status, before any rows are gathered), ``idle_from_compute`` gives the same wait from the
compute alone: the slowest rank's compute minus this rank's.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from poplar.types.topology import Link


class RankTimes(NamedTuple):
    """One rank's iteration, split (seconds)."""

    compute_s: float
    comm_s: float
    idle_s: float
    other_s: float


def flat_blocked_seconds(records: Sequence[Any]) -> tuple[float, ...]:
    """The blocked seconds of the flat-link collectives among ``records`` (ledger records of one
    step, in the order they were recorded): what ``split`` matches across ranks."""
    return tuple(float(r.seconds) for r in records if r.link == Link.FLAT)


def step_records(records: Sequence[Any], last_before: Any) -> list[Any]:
    """The ledger records appended after ``last_before`` (the last record before the step, or
    None), oldest first: the step's collectives. Walks back from the newest, so it costs the
    step's collectives, not the ledger's length."""
    out = []
    for r in reversed(records):
        if r is last_before:
            break
        out.append(r)
    out.reverse()
    return out


def collective_waits(flat_blocked: Sequence[Sequence[float]]) -> list[list[float]] | None:
    """Per rank, per flat collective of one iteration (in order), the seconds it waited for the
    last rank to arrive; None where the ranks' collectives cannot be matched (different counts)."""
    if not flat_blocked or len({len(b) for b in flat_blocked}) != 1:
        return None
    waits: list[list[float]] = [[] for _ in flat_blocked]
    for per_rank in zip(*flat_blocked):
        own = min(per_rank)  # the last rank to arrive waited for nobody
        for r, seconds in enumerate(per_rank):
            waits[r].append(seconds - own)
    return waits


def split(walls: Sequence[float], computes: Sequence[float], blocked_totals: Sequence[float],
          flat_blocked: Sequence[Sequence[float]]) -> list[RankTimes]:
    """Every rank's ``RankTimes`` of one iteration, from each rank's wall, compute and total
    blocked seconds of the step, and its flat collectives' blocked seconds in order."""
    per_collective = collective_waits(flat_blocked)
    waits = [sum(w) for w in per_collective] if per_collective is not None else [0.0] * len(walls)
    out = []
    for wall, compute, blocked, wait in zip(walls, computes, blocked_totals, waits):
        wait = min(wait, blocked)
        out.append(RankTimes(compute, blocked - wait, wait, max(0.0, wall - compute - blocked)))
    return out


def idle_from_compute(rank_compute_s: Sequence[float]) -> list[float]:
    """Each rank's wait for the slowest rank when only every rank's compute is known: the ranks
    meet in the same collectives, so a rank waits as long as the slowest computes beyond it."""
    slowest = max(rank_compute_s, default=0.0)
    return [slowest - c for c in rank_compute_s]
