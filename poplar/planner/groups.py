"""Device groups: the ranks of one device type, which share one speed curve.

Planning works per group, never per rank, so its cost grows with the number of device types.
A group's ``mbs`` is the smallest mbs any of its ranks reported (so no rank of the type can run
out of memory), and its curve merges the points of all its ranks (median per batch).

``TypeShares`` keeps "count ranks of one type, ``count - moved`` at ``level`` and ``moved`` one
step away" so the allocators can hand out or take back one sample per rank in bulk.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from poplar.planner.curves import SpeedCurve
from poplar.types.profiles import Profile, ProfileError


@dataclass
class DeviceGroup:
    device_type: str
    ranks: list[int]  # global rank ids, ascending
    curve: SpeedCurve
    nominal_tflops: float | None = None

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def mbs(self) -> int:
        return self.curve.mbs


def group_profile(profile: Profile) -> list[DeviceGroup]:
    """One group per device type, in order of first appearance; ranks ordered by ``rank``."""
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ProfileError(
            f"profile ranks must be 0..{len(ranks) - 1} once each, got {[r.rank for r in profile.ranks]}")
    by_type: dict[str, list] = {}
    for r in ranks:
        if not isinstance(r.device_type, str) or not r.device_type:
            raise ProfileError(f"rank {r.rank}: device_type must be a non-empty string")
        by_type.setdefault(r.device_type, []).append(r)
    groups = []
    for dtype, members in by_type.items():
        mbs = min(r.mbs for r in members)
        points = [(p.batch, p.compute_s) for r in members for p in r.points]
        past = [(p.batch, p.compute_s) for r in members for p in r.points + r.points_past_mbs if p.batch > mbs]
        tflops = next((r.nominal_tflops for r in members if r.nominal_tflops), None)
        groups.append(DeviceGroup(dtype, [r.rank for r in members],
                                  SpeedCurve.from_points(dtype, mbs, points, above=past), tflops))
    return groups


@dataclass
class TypeShares:
    """Samples per rank for one group: ``count - moved`` ranks at ``level``, ``moved`` at ``level + step``."""

    count: int
    level: int
    moved: int = 0

    def per_rank(self, step: int) -> list[int]:
        """Per-rank sample counts, the un-moved ranks first."""
        return [self.level] * (self.count - self.moved) + [self.level + step] * self.moved


def shift_samples(shares: list[TypeShares], amount: int, step: int,
                  key: Callable[[int, int], float], floor: int = 0) -> None:
    """Move ``amount`` samples one per rank, in bulk per group (step +1 adds, -1 removes).

    Adding (step=+1) always serves the group whose ``key(g, level + 1)`` (the finish time after
    one more sample) is lowest; removing (step=-1) serves the group whose ``key(g, level)`` is
    highest and never goes below ``floor``. All ranks of a group at the same level have the
    same key, so moving a whole level at once is the same as moving one sample at a time.
    Leaves every group with ``moved == 0`` or its ranks at two adjacent levels.
    """
    heap: list[tuple[float, int]] = []

    def push(g: int) -> None:
        s = shares[g]
        if step > 0:
            heapq.heappush(heap, (key(g, s.level + 1), g))
        elif s.level > floor:
            heapq.heappush(heap, (-key(g, s.level), g))

    for g in range(len(shares)):
        push(g)
    while amount > 0:
        if not heap:
            raise ProfileError("no rank can take or give a sample; this is a planner bug")
        _, g = heapq.heappop(heap)
        s = shares[g]
        k = min(amount, s.count - s.moved)
        s.moved += k
        amount -= k
        if s.moved == s.count:
            s.level += step
            s.moved = 0
            push(g)
        # else amount is 0 now: the loop ends with this group part-way through a level
