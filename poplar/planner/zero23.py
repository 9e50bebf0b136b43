"""ZeRO-2/3 allocator: every rank runs the same lock-step micro-steps; exact search.

Plan shape: G full micro-steps in which rank i runs b_i samples, then (if needed) one last
micro-step in which it runs l_i <= b_i samples. All ranks with samples share the same G (equal
accumulation steps); a rank with l_i = 0 joins the last collective with zeros, and a rank with
b_i = 0 takes no samples at all but still joins every collective (allowed: the engine lets a
rank contribute zeros). With the cost model (see ``cost_model``), such a plan costs
    G (tau1 + c_m) + [last step] (tau2 + c_m) + c_s,   tau1 = max_i t_i(b_i), tau2 = max_i t_i(l_i).

Search. Candidate step times are the finite set {t_g(b) : device type g, 1 <= b <= mbs_g}. For a
candidate tau, b_g(tau) = largest b with t_g(b) <= tau (curves are non-decreasing, so this is a
binary search) and M(tau) = sum_g count_g b_g(tau) is the most samples one micro-step of length
<= tau can hold. For every candidate tau1 as the full-step time:
    K = ceil(gbs / M(tau1)) micro-steps (K - 1 full ones),   R = gbs - (K - 1) M(tau1) in [1, M(tau1)],
    tau2 = the smallest candidate with M(tau2) >= R,
    cost = (K - 1)(tau1 + c_m) + tau2 + c_m + c_s,
and the cheapest candidate wins. This refines Algorithm 2's wall = gas (t + c_m): the last
micro-step is priced at its own, shorter time tau2 instead of a full tau1.

Exactness (over all plans of the shape above). Take any such plan with G full steps at time
tau1 and a last step at tau2 <= tau1 (l_i <= b_i); it holds G M(tau1) + M(tau2) >= gbs samples.
The search at the same tau1 picks the fewest steps K <= G + 1. If K = G + 1 its remainder R is
<= M(tau2), so its last step is no longer than tau2; if K <= G it is no dearer than K full
steps <= G full steps. Either way its cost is <= the plan's. Tests check this against brute force.
The limits keep the argument intact: ``require_all_ranks`` skips candidates below max_g t_g(1)
(and lifts a single micro-step to at least that), ``max_micro_steps`` skips candidates needing
more micro-steps; any plan obeying a limit is matched by a candidate that obeys it too.
Not searched: plans whose last micro-step is larger than the full ones (l_i > b_i); brute force
found one beating this shape in 1 of 272 tiny random instances.
Cost: O(C log C) for C = sum_g mbs_g candidates, independent of the number of ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from poplar.types.plans import PlanError
from poplar.planner.cost_model import CommModel
from poplar.planner.groups import DeviceGroup, TypeShares, shift_samples

Rows = list[list[tuple[int, int, int]]]  # per group, per rank of the group: (b, gas, lbs)


def allocate_zero23(groups: list[DeviceGroup], gbs: int, stage: int, comm: CommModel,
                    require_all_ranks: bool = False,
                    max_micro_steps: int | None = None) -> tuple[Rows, dict[str, Any]]:
    """Rows (b, gas, lbs) per rank of each group for stages 2/3, and what the search chose."""
    c_m, c_s = comm.per_micro_step_s(stage), comm.per_iteration_s(stage)
    cand = np.unique(np.concatenate([g.curve.times for g in groups]))
    counts = np.array([g.count for g in groups], dtype=np.int64)
    fits = np.stack([g.curve.max_batch_within(cand) for g in groups])  # b_g(tau), shape (G, C)
    capacity = counts @ fits  # M(tau), non-decreasing in tau
    valid = capacity > 0
    first_all = 0
    if require_all_ranks:
        everyone = np.all(fits >= 1, axis=0)
        valid &= everyone
        first_all = int(np.argmax(everyone))  # everyone is monotone, and true at the largest candidate
    steps = np.where(valid, -(-gbs // np.maximum(capacity, 1)), np.iinfo(np.int64).max)
    if max_micro_steps is not None:
        valid &= steps <= max_micro_steps
    if not valid.any():
        raise PlanError(
            f"no lock-step plan fits: {gbs} samples need more than max_micro_steps={max_micro_steps} "
            "micro-steps; raise max_micro_steps or lower the global batch")
    rest = np.where(valid, gbs - (steps - 1) * capacity, 1)
    last_idx = np.searchsorted(capacity, rest, side="left")
    if require_all_ranks:  # a single micro-step must still give every rank a sample
        last_idx = np.where(steps == 1, np.maximum(last_idx, first_all), last_idx)
    last_idx = np.minimum(last_idx, cand.size - 1)
    cost = np.where(valid, (steps - 1) * (cand + c_m) + cand[last_idx] + c_m + c_s, np.inf)
    best = int(np.lexsort((steps, cost))[0])  # cheapest; on a tie, fewer micro-steps
    k, r, j = int(steps[best]), int(rest[best]), int(last_idx[best])

    shares = [TypeShares(g.count, int(fits[gi, j])) for gi, g in enumerate(groups)]
    excess = int(capacity[j]) - r
    floor = 1 if (require_all_ranks and k == 1) else 0
    shift_samples(shares, excess, -1, key=lambda gi, n: groups[gi].curve.time(n), floor=floor)

    lasts = [s.per_rank(-1) for s in shares]
    if k == 1:
        rows = lockstep_rows([[0] * g.count for g in groups], lasts, 0)
    else:
        rows = lockstep_rows([[int(fits[gi, best])] * g.count for gi, g in enumerate(groups)], lasts, k - 1)
    meta = {
        "full_step_s": float(cand[best]) if k > 1 else None,
        "last_step_s": float(cand[j]),
        "micro_steps": k,
        "candidates": int(cand.size),
        "search_predicted_s": float(cost[best]),
    }
    return rows, meta


def lockstep_rows(full: list[list[int]], last: list[list[int]], n_full: int) -> Rows:
    """Rows (b, gas, lbs) for ``n_full`` micro-steps of ``full[g][r]`` samples then one of
    ``last[g][r]`` (<= full) samples, written canonically: with no full micro-steps the single
    one is written as gas=1; a last micro-step as large as the full ones becomes one more full
    micro-step when that holds for every rank with samples; a rank with nothing is all zeros."""
    if n_full == 0:
        return [[(n, 1, 0) if n else (0, 0, 0) for n in grp] for grp in last]
    pairs = [list(zip(fg, lg)) for fg, lg in zip(full, last)]
    if all(l_ == b for grp in pairs for b, l_ in grp):
        return [[(b, n_full + 1, 0) if b else (0, 0, 0) for b, _ in grp] for grp in pairs]
    return [[(b, n_full, l_) if b else (0, 0, 0) for b, l_ in grp] for grp in pairs]
