"""The exact ideal: the shortest iteration that *any* runnable plan reaches under given curves.

A runnable plan gives every rank one row (b, gas, lbs): ``gas`` micro-steps of ``b`` samples,
then one of ``lbs`` (``0 <= b, lbs <= mbs`` of the rank's type, ``lbs`` may exceed ``b``), with
sum_i (gas_i b_i + lbs_i) = gbs. Its iteration time is the cost model's (``cost_model``: the
same compute curves, the same communication pricing, lock-step micro-steps at stages 2/3).
``ideal()`` returns the minimum of that time over *all* such plans, with one plan reaching it;
the planner's allocators search narrower families (the paper's split, or a common number of
full micro-steps with a last one no larger), so the ideal is a bound on every strategy and is
what "fraction of the ideal" measures plans against.

Stages 0/1 (ranks independent until the end). Let f_t(n) be the fastest split of n samples on
one rank of type t (min over b and lbs of gas t(b) + t(lbs)); f_t is non-decreasing (drop one
sample from the last micro-step, or turn a last full one into b - 1). The optimum is the
smallest T in the finite set {f_t(n)} with sum_t count_t N_t(T) >= gbs, N_t(T) = max{n :
f_t(n) <= T}; then samples are taken back one at a time (never raising a rank's time) until
exactly gbs remain. Exact, no tolerance: T is searched over the candidate set itself. The
search prices the iteration's end at balance; where the profile measured how the end depends on
the slowest rank's last micro-step (``Exposure.end_s``), the plan it names is then priced with
that, as every other plan, and a plan ending in a longer last micro-step can come in under it by
at most the difference between the levels.

Stages 2/3 (lock-step). Two facts make an exact search small:
1. Given the step times tau_1..tau_K of an optimal plan, each rank could take the row with the
   most samples that fits under them, and ranks of one type have the same best row; taking
   samples back never raises a step's time. So some optimal plan gives all ranks of a type the
   same row: the search is over one row per *type*.
2. For fixed full-step sizes b_t (one per type, 0 = the type takes nothing) a plan is a sequence
   of lock-steps in which the set S of types still in their full phase only shrinks. A step is
   either a *full step* (every type in S runs b_t: time max_S t_t(b_t)) or a *leaving step*
   (types L of S run their last micro-step; with the step's time tau, each should run the most
   samples that fit, B_t(tau) = max{l : t_t(l) <= tau}, the others in S still run b_t); a type
   may also leave without a last micro-step, at no cost. A dynamic programme over (S, samples
   so far, capped at gbs) with these transitions gives the cheapest plan for those b_t; tau only
   needs the finitely many values t_t(l) (and the full step time). The first step is a full step
   of every type with b_t > 0 (a type leaving in step 1 is the plan with b_t = its last batch).
Enumerating the b_t makes the search exact. With a measured lead exposure (``cost_model``) fact 1
is no proof (filling a type up to a step's time changes the lead): tests compare with brute force.
The search prices the iteration's end at balance and no extra for micro-steps that change
batches; the plan it names is then priced with both, as every other plan. Vectors are visited in the order of a lower bound
(first full step + the cheapest cover of the remaining samples by steps of any time, ignoring
the b_t) and the search stops when the bound reaches the best plan found; each dynamic programme
costs O(4^types) vector operations of length ~gbs x sum_t mbs_t. Milliseconds for the
benchmark's clusters; the worst case is prod_t (mbs_t + 1) programmes, so this is a benchmark's
and a test's tool, not a planner for large clusters.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.planner.cost_model import CommModel, evaluate_rows
from poplar.planner.curves import SpeedCurve
from poplar.planner.groups import DeviceGroup
from poplar.planner.zero01 import canonical

Row = tuple[str, int, int, int]  # (device_type, b, gas, lbs)
StepPrice = Callable[[Any], Any]  # per-type compute of lock-steps (types x steps) -> their seconds


@dataclass
class Ideal:
    """The ideal iteration time and one plan (per-rank rows) that reaches it."""

    iteration_s: float
    rows: list[Row]
    zero_stage: int
    comm_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch_size(self) -> int:
        return sum(b * gas + lbs for _, b, gas, lbs in self.rows)

    def plan(self) -> Plan:
        """The rows as a runnable ``Plan`` (strategy ``ideal``)."""
        return Plan([RankPlan(b, gas, lbs, device_type=t) for t, b, gas, lbs in self.rows],
                    zero_stage=self.zero_stage, strategy="ideal", predicted_iteration_s=self.iteration_s,
                    predicted_comm_s=self.comm_s, meta=dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return {"iteration_s": self.iteration_s, "comm_s": self.comm_s, "zero_stage": self.zero_stage,
                "rows": [list(r) for r in self.rows], "meta": self.meta}


def ideal(groups: Sequence[DeviceGroup], global_batch_size: int, zero_stage: int, comm: CommModel) -> Ideal:
    """The exact minimum iteration time over all runnable plans of ``global_batch_size`` samples
    on ``groups`` (one curve per device type; a curve's length is the type's mbs), priced by
    the cost model with ``comm``; see the module doc."""
    gbs = global_batch_size
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1:
        raise PlanError(f"global_batch_size must be an int >= 1, got {gbs!r}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not groups:
        raise PlanError("ideal() needs at least one device group")
    world = sum(g.count for g in groups)
    ranks = sorted(r for g in groups for r in g.ranks)
    if ranks != list(range(world)):
        raise PlanError(f"device groups must cover ranks 0..{world - 1} once each, got {ranks}")
    if comm.world_size != world:
        raise PlanError(f"comm model is for {comm.world_size} ranks but the groups have {world}")
    if zero_stage in (0, 1):
        per_type = None
        rows = _independent(groups, gbs)
    else:
        types = [g.device_type for g in groups]
        per_type = _lockstep(groups, gbs, lambda times: comm.lockstep_s(zero_stage, times, types),
                             comm.cheapest_micro_step_s(zero_stage), comm.per_iteration_s(zero_stage))
        rows = _per_rank(groups, per_type, gbs)
    curves = {g.device_type: g.curve for g in groups}
    ev = evaluate_rows(rows, curves, zero_stage, comm)
    if sum(b * gas + lbs for _, b, gas, lbs in rows) != gbs:
        raise AssertionError("ideal: rows do not sum to the global batch; this is a bug")
    meta: dict[str, Any] = {"micro_steps": ev.micro_steps}
    if per_type is not None:
        meta["search_s"], meta["b_vectors_searched"] = per_type[1], per_type[2]
        # the rebuilt plan is priced independently; it must match the search's own figure
        # ... but for its end, which the search prices at balance (``CommModel.led_iteration_s``),
        # and the micro-steps that change batches, which it does not price
        searched = ev.iteration_s - ev.end_s - ev.switch_s + comm.per_iteration_s(zero_stage)
        if not math.isclose(searched, per_type[1], rel_tol=1e-9, abs_tol=1e-12):
            raise AssertionError(f"ideal: search found {per_type[1]!r} s but its plan costs {searched!r} s")
    return Ideal(ev.iteration_s, rows, zero_stage, ev.comm_s, meta)


# ---------------------------------------------------------------------- stages 0/1
def fastest_splits(curve: SpeedCurve, n_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f(n) for n = 0..n_max: the least compute of one rank for n samples over every split into
    gas micro-steps of b plus one of lbs (b, lbs <= mbs); and the b and lbs reaching it."""
    mbs = curve.mbs
    f = np.full(n_max + 1, np.inf)
    best_b = np.zeros(n_max + 1, dtype=np.int64)
    best_l = np.zeros(n_max + 1, dtype=np.int64)
    f[0] = 0.0
    for b in range(1, mbs + 1):
        tb = curve.time(b)
        for lbs in range(0, min(mbs, n_max) + 1):
            n = np.arange(lbs, n_max + 1, b)
            cost = (n - lbs) // b * tb + curve.time(lbs)
            better = cost < f[n]
            f[n[better]], best_b[n[better]], best_l[n[better]] = cost[better], b, lbs
    return f, best_b, best_l


def _independent(groups: Sequence[DeviceGroup], gbs: int) -> list[Row]:
    tables = [fastest_splits(g.curve, gbs) for g in groups]
    envelope = [np.maximum.accumulate(f) for f, _, _ in tables]  # f is non-decreasing up to rounding
    candidates = np.unique(np.concatenate(envelope))

    def most(t: float) -> list[int]:
        return [int(np.searchsorted(e, t, side="right")) - 1 for e in envelope]

    lo, hi = 0, candidates.size - 1  # the largest candidate is f(gbs) on some type: always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(g.count * n for g, n in zip(groups, most(candidates[mid]))) >= gbs:
            hi = mid
        else:
            lo = mid + 1
    shares = {r: n for g, n in zip(groups, most(candidates[lo])) for r in g.ranks}
    kind = {r: gi for gi, g in enumerate(groups) for r in g.ranks}
    excess = sum(shares.values()) - gbs
    while excess > 0:  # take back from the rank that finishes last (never raises a time)
        r = max(shares, key=lambda r: (envelope[kind[r]][shares[r]] if shares[r] else -1.0, r))
        shares[r] -= 1
        excess -= 1
    rows: list[Row] = []
    for r in range(len(shares)):
        gi, n = kind[r], shares[r]
        _, bb, bl = tables[gi]
        b, lbs = int(bb[n]), int(bl[n])
        rows.append((groups[gi].device_type, *canonical(b, (n - lbs) // b if b else 0, lbs)))
    return rows


# ---------------------------------------------------------------------- stages 2/3
@dataclass
class _Step:
    kind: str  # "full", "leave" (a step in which types `left` run their last micro-step) or "free"
    left: tuple[int, ...] = ()
    tau: float = 0.0


def _subsets(s: int) -> list[int]:
    """Non-empty subsets of the bit set ``s``."""
    out, sub = [], s
    while sub:
        out.append(sub)
        sub = (sub - 1) & s
    return out


def _bits(s: int) -> list[int]:
    return [i for i in range(s.bit_length()) if s >> i & 1]


class _Programme:
    """The dynamic programme for one choice of full-step sizes ``b`` (per type).

    ``cost[S][n]``: the cheapest way to have run n samples (n = gbs: at least gbs) with the
    types of bit set S still in their full phase. Every entry keeps a back-pointer (source set,
    source samples, step) so the cheapest path can be replayed into rows."""

    def __init__(self, groups: Sequence[DeviceGroup], b: Sequence[int], gbs: int, price: StepPrice,
                 c_s: float) -> None:
        self.groups, self.b, self.gbs, self.price = groups, b, gbs, price
        self.full_t = [g.curve.time(x) for g, x in zip(groups, b)]
        self.start = sum(1 << t for t, x in enumerate(b) if x > 0)
        sets = [s for s in range(self.start + 1) if (s & ~self.start) == 0]
        self.cost = {s: np.full(gbs + 1, np.inf) for s in sets}
        self.parent = {s: (np.full(gbs + 1, -1), np.full(gbs + 1, -1), np.full(gbs + 1, -1)) for s in sets}
        # The first step is a full step of every type: a type that would leave in step 1 is the
        # same plan as one with b = its last batch and one full step (another b vector).
        self.steps: list[_Step] = [_Step("full")]
        self.first = min(self._samples(self.start), gbs)
        self.cost[self.start][self.first] = c_s + float(price(self._full_step(self.start)))
        self.parent[self.start][2][self.first] = 0

    def _samples(self, s: int) -> int:
        return sum(self.groups[t].count * self.b[t] for t in _bits(s))

    def _step_time(self, s: int) -> float:
        return max((self.full_t[t] for t in _bits(s)), default=0.0)

    def _full_step(self, s: int) -> list[float]:
        """Per type, its compute in a full step of the types in ``s`` (0: nothing to run)."""
        return [self.full_t[t] if s >> t & 1 else 0.0 for t in range(len(self.groups))]

    def _set(self, dst: int, where: np.ndarray, vals: np.ndarray, src: int, src_n: np.ndarray,
             step: np.ndarray | int) -> None:
        out = self.cost[dst]
        better = vals < out[where]
        if better.any():
            w = where[better]
            out[w] = vals[better]
            ps, pn, pk = self.parent[dst]
            ps[w], pn[w] = src, src_n[better]
            pk[w] = step[better] if isinstance(step, np.ndarray) else step

    def _relax(self, src: int, dst: int, gains: np.ndarray, seconds: np.ndarray, steps: np.ndarray) -> None:
        """dst[min(n + gain_j, gbs)] <- src[n] + seconds_j, for every n and every j."""
        a, g = self.cost[src], self.gbs
        m = np.arange(g)
        idx = m[None, :] - gains[:, None]  # source n of target m < gbs, per transition j
        vals = np.where(idx >= 0, a[np.maximum(idx, 0)] + seconds[:, None], np.inf)
        j = np.argmin(vals, axis=0)
        self._set(dst, m, vals[j, m], src, m - gains[j], steps[j])
        suffix = np.minimum.accumulate(a[::-1])[::-1]  # min of a[k:]
        lo = np.maximum(g - gains, 0)
        capped = suffix[lo] + seconds
        jj = int(np.argmin(capped))
        n = lo[jj] + int(np.argmin(a[lo[jj]:]))
        self._set(dst, np.array([g]), capped[jj:jj + 1], src, np.array([n]), int(steps[jj]))

    def _close(self, s: int) -> None:
        """Any number of full steps of the types in ``s``: along each chain n, n + M, n + 2M, ...
        the best entry is min over i <= j of a_i + (j - i) seconds."""
        m, seconds, g = self._samples(s), float(self.price(self._full_step(s))), self.gbs
        a = self.cost[s]
        rows = -(-g // m)
        grid = np.full(rows * m, np.inf)
        grid[:g] = a[:g]
        grid = grid.reshape(rows, m)  # grid[j, r] = a[r + j m]
        j = np.arange(rows)[:, None]
        x = grid - j * seconds
        best = np.minimum.accumulate(x, axis=0)
        source = np.maximum.accumulate(np.where(x <= best, j, -1), axis=0)  # the i reaching the minimum
        ok = source >= 0
        src = np.where(ok, source, 0)
        closed = np.where(ok, np.take_along_axis(grid, src, axis=0) + (j - src) * seconds, np.inf)
        step = len(self.steps)
        self.steps.append(_Step("full"))
        improved = (closed < grid).ravel()[:g]
        where = np.flatnonzero(improved)
        self._set(s, where, closed.ravel()[where], s, where - m, step)
        lo = max(g - m, 0)
        n = lo + int(np.argmin(a[lo:g]))
        self._set(s, np.array([g]), np.array([a[n] + seconds]), s, np.array([n]), step)

    def run(self) -> float:
        for s in sorted(self.cost, key=lambda s: -bin(s).count("1")):
            if not s or not np.isfinite(self.cost[s]).any():
                continue
            self._close(s)
            for leave in _subsets(s):
                rest = s & ~leave
                self.steps.append(_Step("free", tuple(_bits(leave))))
                self._relax(s, rest, np.array([0]), np.array([0.0]), np.array([len(self.steps) - 1]))
                self._leaving_steps(s, leave, rest)
        return float(self.cost[0][self.gbs])

    def _leaving_steps(self, s: int, leave: int, rest: int) -> None:
        """Steps in which the types of ``leave`` run their last micro-step, as large as the step's
        time tau allows, and those of ``rest`` a full one; tau ranges over the curves' times."""
        floor = self._step_time(rest)
        leaving = _bits(leave)
        taus = [np.array([floor])] if rest else []
        taus += [t[t >= floor] for t in (self.groups[i].curve.times for i in leaving)]
        tau = np.unique(np.concatenate(taus))
        lasts = np.stack([self.groups[i].curve.max_batch_within(tau) for i in leaving])
        keep = lasts.sum(axis=0) > 0  # else nobody leaving runs anything: a full step of `rest`
        if not keep.any():
            return
        tau, lasts = tau[keep], lasts[:, keep]
        took = np.stack([self.groups[i].curve.times_of(n) for i, n in zip(leaving, lasts)])
        per_type = np.repeat(np.array(self._full_step(rest))[:, None], tau.size, axis=1)
        per_type[leaving] = took
        seconds = self.price(per_type)
        counts = np.array([self.groups[i].count for i in leaving])
        gains = self._samples(rest) + counts @ lasts
        order = np.lexsort((seconds, gains))  # per gain, the cheapest first
        first = np.concatenate(([True], np.diff(gains[order]) > 0))
        pick = order[first]
        base = len(self.steps)
        self.steps.extend(_Step("leave", tuple(leaving), float(t)) for t in tau[pick])
        self._relax(s, rest, gains[pick], seconds[pick], base + np.arange(pick.size))

    def rows(self) -> list[tuple[int, int, int]]:
        """Per type (b, gas, lbs) of the cheapest path to ``gbs`` samples."""
        path: list[_Step] = []
        s, n = 0, self.gbs
        while not (s == self.start and n == self.first):
            ps, pn, pk = self.parent[s]
            if ps[n] < 0:
                raise AssertionError("ideal: broken back-pointer; this is a bug")
            path.append(self.steps[pk[n]])
            s, n = int(ps[n]), int(pn[n])
        gas = [1 if x else 0 for x in self.b]  # the first full step
        last = [0] * len(self.groups)
        active = set(_bits(self.start))
        for step in reversed(path):
            if step.kind == "full":
                for t in active:
                    gas[t] += 1
            elif step.kind == "free":
                active -= set(step.left)
            else:
                for t in active - set(step.left):
                    gas[t] += 1
                for t in step.left:
                    last[t] = self.groups[t].curve.max_batch_within(step.tau)
                active -= set(step.left)
        return [(self.b[t], gas[t], last[t]) if self.b[t] else (0, 0, 0) for t in range(len(self.groups))]


def _lockstep(groups: Sequence[DeviceGroup], gbs: int, price: StepPrice, c_m: float, c_s: float,
              prune: bool = True) -> tuple[list, float, int]:
    """Cheapest per-type rows over every vector of full-step sizes b. Vectors are tried in the
    order of a lower bound and the search stops once the bound reaches the best found: after the
    first full step (M(b) samples in ``price`` of its per-type compute), every further step of
    time tau holds at most cap(tau) = sum_t count_t B_t(tau) samples, so the rest costs at least
    L(gbs - M(b)), L(r) = min_tau (tau + c_m + L(r - cap(tau))), L(r <= 0) = 0, with c_m the least
    any step's communication costs. ``price``: per-type compute of lock-steps -> their seconds."""
    tau = np.unique(np.concatenate([g.curve.times for g in groups]))
    cap = sum(g.count * g.curve.max_batch_within(tau) for g in groups)
    rest = np.zeros(gbs + 1)
    for r in range(1, gbs + 1):
        rest[r] = float(np.min(tau + c_m + rest[np.maximum(r - cap, 0)]))
    vectors = []
    for b in itertools.product(*[range(g.mbs + 1) for g in groups]):
        if any(b):
            first = float(price([g.curve.time(x) for g, x in zip(groups, b)]))
            held = sum(g.count * x for g, x in zip(groups, b))
            vectors.append((c_s + first + rest[max(gbs - held, 0)], b))
    vectors.sort()
    best, best_prog, tried = math.inf, None, 0
    for bound, b in vectors:
        if prune and bound >= best:
            break
        prog = _Programme(groups, b, gbs, price, c_s)
        value = prog.run()
        tried += 1
        if value < best:
            best, best_prog = value, prog
    assert best_prog is not None
    return best_prog.rows(), best, tried


def _per_rank(groups: Sequence[DeviceGroup], per_type: tuple[list, float, int], gbs: int) -> list[Row]:
    """One row per rank from the per-type rows, with the samples over gbs taken back: from a
    rank's last micro-step, or by turning its last full micro-step into one of b - 1 (neither
    makes any lock-step longer)."""
    rows: dict[int, list[Any]] = {}
    for g, (b, gas, lbs) in zip(groups, per_type[0]):
        for r in g.ranks:
            rows[r] = [g.device_type, b, gas, lbs]
    excess = sum(b * gas + lbs for _, b, gas, lbs in rows.values()) - gbs
    for r in sorted(rows, reverse=True):
        row = rows[r]
        while excess > 0 and (row[2] or row[3]):
            if row[3]:
                row[3] -= 1
            else:
                row[2], row[3] = row[2] - 1, row[1] - 1
            excess -= 1
    return [(t, *canonical(b, gas, lbs)) for t, b, gas, lbs in (rows[r] for r in sorted(rows))]
