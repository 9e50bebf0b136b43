"""Baseline strategies, planned through the same rows and cost model as Poplar.

``even`` -- what DeepSpeed users run today: one micro-batch for all ranks, the smallest mbs in
the cluster, and equal shares (the first gbs mod N ranks take one sample more).
  stages 0/1: rank i runs its share in micro-steps of that size plus a last batch;
  stages 2/3: lock-step: K = ceil(gbs / (N b)) micro-steps, K - 1 full ones of b on every rank,
  the remainder split evenly over the last micro-step.
``flops`` -- Whale-like: shares proportional to each rank's nominal (spec-sheet) TFLOPS,
capped by memory.
  stages 0/1: n_i ~ TFLOPS_i, run in micro-steps of the rank's own mbs (Whale uses the largest
  batch that fits); with ``max_micro_steps`` a share is capped at max_micro_steps * mbs_i and the
  rest re-split over the others;
  stages 2/3: the smallest common micro-step count K for which the per-micro-step batch
  ceil(gbs / K), split ~ TFLOPS, fits every rank's mbs; G = floor(gbs / that batch) full
  micro-steps, the remainder split ~ TFLOPS (at most b_i each) over one last micro-step.
"""

from __future__ import annotations

import math
from typing import Sequence

from poplar.types.plans import PlanError
from poplar.planner.groups import DeviceGroup
from poplar.planner.zero01 import canonical
from poplar.planner.zero23 import lockstep_rows

Rows = list[list[tuple[int, int, int]]]


def split_by_weight(total: int, counts: Sequence[int], weights: Sequence[float], floor: int = 0,
                    caps: Sequence[int] | None = None) -> list[list[int]]:
    """Split ``total`` over ranks (``counts[g]`` ranks of weight ``weights[g]``) ~ weight, each rank
    getting >= ``floor`` and <= ``caps[g]``; largest remainders round. Per group, per rank."""
    n_groups = len(counts)
    caps = list(caps) if caps is not None else [math.inf] * n_groups
    if total < floor * sum(counts):
        raise PlanError(f"cannot give {sum(counts)} ranks {floor} sample(s) each out of {total}")
    if total > sum(c * cap for c, cap in zip(counts, caps)):
        raise PlanError(f"cannot split {total} samples within the per-rank caps {caps}")
    base = [floor] * n_groups
    rest = total - floor * sum(counts)
    room = [cap - floor for cap in caps]
    active = set(range(n_groups))
    ideal = [0.0] * n_groups
    while active:  # water-fill: types whose ideal share exceeds their cap are pinned at the cap
        weight = sum(counts[g] * weights[g] for g in active)
        for g in active:
            ideal[g] = rest * weights[g] / weight
        over = [g for g in active if ideal[g] > room[g]]
        if not over:
            break
        for g in over:
            ideal[g] = room[g]
            rest -= counts[g] * room[g]
            active.discard(g)
    whole = [min(int(math.floor(ideal[g] + 1e-9)), room[g]) for g in range(n_groups)]
    left = total - floor * sum(counts) - sum(c * w for c, w in zip(counts, whole))
    plus = [0] * n_groups
    order = sorted(range(n_groups), key=lambda g: (-(ideal[g] - whole[g]), g))
    while left > 0:
        moved = False
        for g in order:
            if left and whole[g] + 1 <= room[g] and plus[g] < counts[g]:
                k = min(left, counts[g] - plus[g])
                plus[g] += k
                left -= k
                moved = True
        if not moved:
            raise PlanError("cannot split the samples within the per-rank caps")
    return [[base[g] + whole[g] + 1] * plus[g] + [base[g] + whole[g]] * (counts[g] - plus[g])
            for g in range(n_groups)]


def _check_steps(name: str, steps: int, max_micro_steps: int | None) -> None:
    if max_micro_steps is not None and steps > max_micro_steps:
        raise PlanError(
            f"strategy {name!r} needs {steps} micro-steps on some rank, more than "
            f"max_micro_steps={max_micro_steps}; raise max_micro_steps or lower the global batch")


def even_rows(groups: list[DeviceGroup], gbs: int, stage: int, max_micro_steps: int | None = None) -> Rows:
    world = sum(g.count for g in groups)
    b = min(g.mbs for g in groups)
    if stage in (0, 1):
        largest_share = -(-gbs // world)
        _check_steps("even", -(-largest_share // b), max_micro_steps)
        return [[canonical(b, *divmod(gbs // world + int(r < gbs % world), b)) for r in g.ranks]
                for g in groups]
    steps = -(-gbs // (world * b))
    _check_steps("even", steps, max_micro_steps)
    rest = gbs - (steps - 1) * world * b
    last = [[rest // world + int(r < rest % world) for r in g.ranks] for g in groups]
    return lockstep_rows([[b] * g.count for g in groups], last, steps - 1)


def _tflops(groups: list[DeviceGroup]) -> list[float]:
    missing = [g.device_type for g in groups if not (g.nominal_tflops and g.nominal_tflops > 0)]
    if missing:
        raise PlanError(
            f"strategy 'flops' needs nominal_tflops for device types {missing}; add it to the "
            "profile's ranks (or build the profile from device presets)")
    return [float(g.nominal_tflops) for g in groups]


def flops_rows(groups: list[DeviceGroup], gbs: int, stage: int, require_all_ranks: bool = False,
               max_micro_steps: int | None = None) -> Rows:
    weights = _tflops(groups)
    counts = [g.count for g in groups]
    floor = 1 if require_all_ranks else 0
    if stage in (0, 1):
        caps = None if max_micro_steps is None else [max_micro_steps * g.mbs for g in groups]
        shares = split_by_weight(gbs, counts, weights, floor, caps)
        return [[canonical(g.mbs, *divmod(n, g.mbs)) for n in grp] for g, grp in zip(groups, shares)]
    # from 1, not from `ideal`: with every rank required, fewer micro-steps may be the only way
    # to give each rank a sample per micro-step (e.g. gbs = N ranks of mbs 1 with skewed FLOPs)
    for steps in range(1, gbs + 1):
        if -(-gbs // steps) < floor * sum(counts):
            raise PlanError("flops: cannot give every rank a sample in every micro-step within memory")
        # one b per type (the largest of its ranks' split), so the last micro-step can stay <= b
        per_rank = [max(grp) for grp in split_by_weight(-(-gbs // steps), counts, weights, floor)]
        if all(b <= g.mbs for g, b in zip(groups, per_rank)):
            break
    n_full, rest = divmod(gbs, sum(c * b for c, b in zip(counts, per_rank)))
    _check_steps("flops", n_full + (rest > 0), max_micro_steps)
    last = split_by_weight(rest, counts, weights, floor if n_full == 0 else 0, per_rank)
    return lockstep_rows([[b] * c for b, c in zip(per_rank, counts)], last, n_full)
