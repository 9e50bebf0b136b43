"""ZeRO-0/1 allocator: ranks synchronise once per iteration, so each runs its own micro-steps.

Rank i with n_i samples runs gas_i micro-steps of b_i plus a last one of lbs_i <= mbs_i (usually
the remainder, < b_i; larger when one bigger last micro-step beats a tiny extra one); the
iteration lasts max_i C_i + c_s (see ``cost_model``). Two allocators run and the cheaper plan
under the cost model wins, the paper's on a tie (``AllocatorSearch`` records both):

1. ``paper`` -- Algorithm 2, first branch. Every type runs at its peak-speed batch p_g;
   time_opt = gbs / sum_i speed_i; rank i gets floor(time_opt * speed_i) samples, split into
   gas x p_g + lbs; the samples left over go one at a time to the rank whose predicted finish
   after taking it stays lowest (a heap over device types; ranks of a type move in bulk).
2. ``threshold`` -- exact for this plan shape. With f_g(n) = the fastest split of n samples
   into gas x b + lbs on type g (b, lbs <= mbs; ``best_split``), f_g is non-decreasing in n, so
   the best iteration is the smallest T with sum_i n_g(T) >= gbs, n_g(T) = max{n : f_g(n) <= T}.
   T is found by bisection to ~1e-13 relative (``most_samples_within`` gives n_g(T)); then the
   samples over gbs are taken back, in bulk per type, from the ranks that finish last.
The paper's allocator alone can lose a whole micro-step when floor(time_opt * speed) lands just
above a multiple of p_g (a rank pays t(p_g) + t(1) where another rank had room); the threshold
allocator removes that loss. ``max_micro_steps`` (if set) bounds gas + [lbs > 0] per rank.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import numpy as np

from poplar.types.plan_choice import AllocatorSearch
from poplar.types.plans import PlanError
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup, TypeShares, shift_samples

Split = tuple[int, int, int, float]  # (b, gas, lbs, seconds)
SPLIT_TIE = 1e-3  # one rank's splits this close (relative) are the same to a profile


def canonical(b: int, gas: int, lbs: int) -> tuple[int, int, int]:
    """A single partial micro-step is written as one full micro-step; nothing as all zeros."""
    if gas == 0:
        return (lbs, 1, 0) if lbs else (0, 0, 0)
    return b, gas, lbs


@lru_cache(maxsize=64)
def _pairs(mbs: int) -> tuple[np.ndarray, np.ndarray]:
    """All (b, k) with 1 <= b <= mbs, 0 <= k <= mbs // b: the last batch is n mod b + k b."""
    b = np.concatenate([np.full(mbs // x + 1, x) for x in range(1, mbs + 1)])
    k = np.concatenate([np.arange(mbs // x + 1) for x in range(1, mbs + 1)])
    return b, k


def best_split(curve: SpeedCurve, n: int, max_micro_steps: int | None = None) -> Split:
    """The fastest (b, gas, lbs) with gas * b + lbs = n and b, lbs <= mbs. The last batch may
    exceed b (e.g. 3 = 2 + 1 merged: 2 + 2 + 3 beats 2 + 2 + 2 + 1 when a 1-sample micro-step is
    slow). Splits within ``SPLIT_TIE`` of the fastest tie (a measured curve cannot tell them
    apart: 2 + 7 and 8 + 1 differed by 0.005 % on a V100S's) and go to fewer micro-steps, then
    to the longest last micro-step (1 + 8 before 8 + 1), then to the larger b: at stages 0/1 the
    closing collectives are sent while the last micro-step's backward runs (``cost_model``), so
    of two splits that compute alike the one ending in the longer micro-step hides more of them.
    O(mbs log mbs) pairs."""
    if n == 0:
        return 0, 0, 0, 0.0
    b, k = _pairs(curve.mbs)
    lbs = n % b + k * b
    ok = lbs <= min(n, curve.mbs)
    b, lbs = b[ok], lbs[ok]
    gas = (n - lbs) // b
    steps = gas + (lbs > 0)
    secs = gas * curve.times[b - 1] + curve.times_of(lbs)
    if max_micro_steps is not None:
        secs = np.where(steps <= max_micro_steps, secs, np.inf)
    fastest = float(secs.min())
    if not math.isfinite(fastest):
        return 0, 0, 0, math.inf
    last = np.where(lbs > 0, lbs, b)
    i = int(np.lexsort((-b, -last, steps, secs > fastest * (1 + SPLIT_TIE)))[0])
    return (*canonical(int(b[i]), int(gas[i]), int(lbs[i])), float(secs[i]))


def peak_split(curve: SpeedCurve, n: int, max_micro_steps: int | None = None) -> Split:
    """The paper's split: micro-steps of the peak-speed batch, the remainder as the last batch."""
    p = curve.peak_batch
    gas, lbs = divmod(n, p)
    if max_micro_steps is not None and gas + (lbs > 0) > max_micro_steps:
        return 0, 0, 0, math.inf
    return (*canonical(p, gas, lbs), gas * curve.time(p) + curve.time(lbs))


def _most_samples_short_last(curve: SpeedCurve, seconds: float, max_micro_steps: int | None) -> int:
    """max{n : some split with lbs < b finishes within seconds}, closed form per b: as many full
    micro-steps as fit, then the largest remainder that fits."""
    t = curve.times
    b = np.arange(1, curve.mbs + 1)
    q = np.floor(seconds / t)
    if max_micro_steps is not None:
        q = np.minimum(q, max_micro_steps)
    rem = curve.max_batch_within(np.maximum(seconds - q * t, 0.0))
    r = np.minimum(b - 1, rem)
    if max_micro_steps is not None:
        r = np.where(q >= max_micro_steps, 0, r)
    return int((q * b + r).max())


def most_samples_within(curve: SpeedCurve, seconds: float, max_micro_steps: int | None = None) -> int:
    """n_g(T): the most samples one rank of this type can finish in ``seconds`` (any split).

    Splits with lbs < b give a lower bound in closed form; no split beats the peak speed, so
    n <= seconds * peak_speed; f(n) (``best_split``) is non-decreasing in n, so a binary
    search between the two bounds finds the exact value in a few evaluations."""
    lo = _most_samples_short_last(curve, seconds, max_micro_steps)
    hi = math.floor(seconds * curve.peak_speed * (1 + 1e-12)) + 1
    if max_micro_steps is not None:
        hi = min(hi, max_micro_steps * curve.mbs)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if best_split(curve, mid, max_micro_steps)[3] <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _rows(groups: list[DeviceGroup], shares: list[TypeShares], split: Callable[[int, int], Split],
          step: int) -> tuple[list[list[tuple[int, int, int]]], float]:
    rows, worst = [], 0.0
    for gi, s in enumerate(shares):
        per = []
        for n in s.per_rank(step):
            b, gas, lbs, secs = split(gi, n)
            worst = max(worst, secs)
            per.append((b, gas, lbs))
        rows.append(per)
    return rows, worst


def paper_allocation(groups: list[DeviceGroup], gbs: int, require_all_ranks: bool = False,
                     max_micro_steps: int | None = None):
    """Algorithm 2, first branch. Returns (rows, worst compute seconds) or None if infeasible."""
    speed = [g.curve.peak_speed for g in groups]
    time_opt = gbs / sum(g.count * s for g, s in zip(groups, speed))
    floor = 1 if require_all_ranks else 0
    shares = [TypeShares(g.count, max(floor, math.floor(time_opt * s))) for g, s in zip(groups, speed)]
    left = gbs - sum(s.count * s.level for s in shares)
    if left < 0:
        return None

    @lru_cache(maxsize=None)
    def split(gi: int, n: int) -> Split:
        return peak_split(groups[gi].curve, n, max_micro_steps)

    shift_samples(shares, left, +1, key=lambda gi, n: split(gi, n)[3])
    rows, worst = _rows(groups, shares, split, +1)
    return (rows, worst) if math.isfinite(worst) else None


def threshold_allocation(groups: list[DeviceGroup], gbs: int, require_all_ranks: bool = False,
                         max_micro_steps: int | None = None):
    """The exact min-max allocation over splits (b, gas, lbs). Returns (rows, worst seconds)."""
    floor = 1 if require_all_ranks else 0

    def totals(seconds: float) -> list[int] | None:
        n = [most_samples_within(g.curve, seconds, max_micro_steps) for g in groups]
        if min(n) < floor or sum(g.count * x for g, x in zip(groups, n)) < gbs:
            return None
        return n

    one_round = sum(g.count * g.mbs for g in groups)
    k = -(-gbs // one_round)  # this many micro-steps of mbs on every rank certainly suffice
    hi = max(g.curve.time(g.mbs) for g in groups) * k * (1 + 1e-9)
    lo = 0.0
    best = totals(hi)
    if best is None:
        raise PlanError(f"no allocation of {gbs} samples fits; this is a planner bug")
    for _ in range(200):
        if hi - lo <= 1e-13 * hi:
            break
        mid = 0.5 * (lo + hi)
        got = totals(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got

    @lru_cache(maxsize=None)
    def split(gi: int, n: int) -> Split:
        return best_split(groups[gi].curve, n, max_micro_steps)

    shares = [TypeShares(g.count, n) for g, n in zip(groups, best)]
    excess = sum(g.count * n for g, n in zip(groups, best)) - gbs
    shift_samples(shares, excess, -1, key=lambda gi, n: split(gi, n)[3], floor=floor)
    return _rows(groups, shares, split, -1)


def allocate_zero01(groups: list[DeviceGroup], gbs: int, require_all_ranks: bool = False,
                    max_micro_steps: int | None = None,
                    evaluate: Callable[[list], float] | None = None) -> tuple[list, AllocatorSearch]:
    """Rows per rank of each group for stages 0/1: the cheaper of the two allocators."""
    found = {"paper": paper_allocation(groups, gbs, require_all_ranks, max_micro_steps),
             "threshold": threshold_allocation(groups, gbs, require_all_ranks, max_micro_steps)}
    scores = {name: (evaluate(res[0]) if evaluate else res[1]) for name, res in found.items() if res}
    winner = min(scores, key=lambda name: (scores[name], name != "paper"))
    return found[winner][0], AllocatorSearch(winner, scores.get("paper"), scores.get("threshold"))
