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

Measured exposure. A profile's exposure depends on which device type leads a step and by how
much (``cost_model``: a led step pays its leader's measured led change as far as its lead
reaches, ``lead_change``; a balanced one the balanced figure), which the constant c_m above does not see:
a step led by a fast type can cost less than the balanced step the search finds, even where it
computes longer (the emulated runs: docs/experiments.md).
So with ``evaluate`` (the full cost model), where the exposure depends on a step's shape
(``CommModel.prices_by_shape``), the ``SHORTLIST`` cheapest distinct full steps of the
search are priced again with their last step in every led form too: each device type in turn
at each of its batches that leaves the step room (no more than its full-step batch), the other
types filled up under its time and the excess taken from them first. The cheapest plan by
``evaluate`` wins; with no exposure measured, ``evaluate`` is the constant model and the search's
own plan wins, exactly as above.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from poplar.types.plan_choice import AllocatorSearch
from poplar.types.plans import PlanError
from poplar.planner.cost_model import CommModel
from poplar.planner.groups import DeviceGroup, TypeShares, shift_samples

Rows = list[list[tuple[int, int, int]]]  # per group, per rank of the group: (b, gas, lbs)
# distinct full steps of the search priced again with led last steps: a bound on the planning
# cost, chosen on the CPU emulator's clusters, not measured
SHORTLIST = 4


class Priced(NamedTuple):
    """Rows priced by the full cost model during the shortlist's second look."""

    seconds: float  # by ``evaluate``
    order: int  # when it was priced: the first priced wins a tie
    rows: Rows
    candidate: int  # the search candidate (index into its step times) whose micro-steps it keeps


def allocate_zero23(groups: list[DeviceGroup], gbs: int, stage: int, comm: CommModel,
                    require_all_ranks: bool = False, max_micro_steps: int | None = None,
                    evaluate: Callable[[Rows], float] | None = None) -> tuple[Rows, AllocatorSearch]:
    """Rows (b, gas, lbs) per rank of each group for stages 2/3, and what the search chose;
    ``evaluate`` (seconds of rows by the full cost model): led last steps priced too."""
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
    order = [int(i) for i in np.lexsort((steps, cost)) if valid[i]]  # cheapest; on a tie, fewer micro-steps
    best = order[0]

    def build(i: int, last: list[int], leader: int | None) -> Rows:
        """Rows of candidate ``i`` (its micro-steps and full step) with a last step of ``last``
        samples per rank of each group before its excess is taken back, from groups other than
        ``leader`` first."""
        k, shares = int(steps[i]), [TypeShares(g.count, n) for g, n in zip(groups, last)]
        floor = 1 if (require_all_ranks and k == 1) else 0
        shift_samples(shares, sum(g.count * n for g, n in zip(groups, last)) - int(rest[i]), -1, floor=floor,
                      key=lambda gi, n: groups[gi].curve.time(n) - (1e9 if gi == leader else 0.0))
        lasts = [s.per_rank(-1) for s in shares]
        if k == 1:
            return lockstep_rows([[0] * g.count for g in groups], lasts, 0)
        return lockstep_rows([[int(fits[gi, i])] * g.count for gi, g in enumerate(groups)], lasts, k - 1)

    rows = build(best, [int(fits[gi, last_idx[best]]) for gi in range(len(groups))], None)
    chosen, search_s = best, float(cost[best])
    if evaluate is not None and comm.prices_by_shape(stage):
        priced = {_key(rows): Priced(evaluate(rows), 0, rows, best)}
        first: dict[tuple, int] = {}  # per distinct full step (micro-steps, batches), its cheapest candidate
        for i in order:
            first.setdefault((int(steps[i]), tuple(fits[:, i].tolist()) if steps[i] > 1 else ()), i)
        for i in list(first.values())[:SHORTLIST]:
            for last, leader in _led_lasts(groups, fits[:, i] if steps[i] > 1 else None, int(rest[i])):
                if require_all_ranks and steps[i] == 1 and min(last) == 0:
                    continue
                candidate = build(i, last, leader)
                key = _key(candidate)
                if key not in priced:
                    priced[key] = Priced(evaluate(candidate), len(priced), candidate, i)
        cheapest = min(priced.values(), key=lambda v: (v.seconds, v.order))
        search_s, rows, chosen = cheapest.seconds, cheapest.rows, cheapest.candidate
    k = int(steps[chosen])
    in_last = [(g, lbs if lbs else b if gas == k else 0) for g, grp in zip(groups, rows) for b, gas, lbs in grp]
    return rows, AllocatorSearch(micro_steps=k, full_step_s=float(cand[chosen]) if k > 1 else None,
                                 last_step_s=max(g.curve.time(n) for g, n in in_last), candidates=int(cand.size),
                                 search_predicted_s=search_s)


def _key(rows: Rows) -> tuple:
    return tuple(tuple(grp) for grp in rows)


def _led_lasts(groups: list[DeviceGroup], full: np.ndarray | None, rest: int) -> list[tuple[list[int], int]]:
    """Last steps led by each group in turn, as (samples per rank of each group before the
    excess is taken back, the leader): the leader at each of its batches up to ``full`` (its
    full-step batch; its mbs for a single step), the others at the most they fit in the same
    time (no more than their full-step batch), when that holds the ``rest`` samples."""
    out = []
    for gi, g in enumerate(groups):
        top = g.curve.mbs if full is None else int(full[gi])
        for b in range(1, top + 1):
            tau = np.array([g.curve.time(b)])
            last = [b if hi == gi else int(h.curve.max_batch_within(tau)[0]) for hi, h in enumerate(groups)]
            if full is not None:
                last = [min(n, int(f)) for n, f in zip(last, full)]
            if sum(h.count * n for h, n in zip(groups, last)) >= rest:
                out.append((last, gi))
    return out


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
