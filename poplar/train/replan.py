"""Re-planning while training: when a rank's speed or memory drifts, correct its curve from live
measurements, plan again and switch plans between iterations (docs/design.md §10).

``fit(..., replan=...)`` drives a ``Replanner`` instead of calling ``engine.train_step`` itself:

- **Speed.** Every iteration's status reduction already hands every rank each rank's compute
  seconds (communication taken out) and samples (``IterationStats.rank_compute_s``), so every
  rank holds the same numbers and takes the same decisions with no collective of its own. A rank whose measured / expected compute stays
  beyond ``threshold`` for ``patience`` iterations in a row has drifted; its points in the live
  profile are multiplied by the median of those ratios (a speed factor: a cubic spline is linear
  in its data, so the whole curve scales) and the ranks it belongs to become a device type of
  its own. The planner prices the current plan and a new one on the corrected profile; the new
  one is taken only if it is predicted faster by more than ``margin`` (hysteresis), and after a
  decision ``cooldown`` iterations pass before drift is looked for again. Either way the
  expected compute follows the corrected profile, so a drift is acted on once.
- **Memory.** An out-of-memory error on some ranks at their planned micro-batch is an
  ``IterationFailed`` on every rank, with no step taken. Each failing rank re-bounds its largest
  micro-batch without any collective from its profiled capacity search (memory grows by
  ``bytes_per_sample`` per sample): mbs' = mbs - ceil((C - C') / bytes_per_sample) for a capacity
  that fell from C to C', and below the batch that failed; ranks agree on the values, plan again
  and retry the same iteration, with the loader moved back one iteration onto the new plan's
  slices of the same global batch: no sample is lost or used twice. A retry that fails again
  lowers the bound further, ``max_retries`` times at most.

Plans differ only in speed (§2): switching never changes the math. Every switch goes through
``engine.set_plan`` (agreed by digest) and ``loader.set_plan``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any


from poplar.planner import CollectivesRequest, make_problem, plan as make_plan
from poplar.planner.cost_model import evaluate_rows
from poplar.train.data import PlanLoader
from poplar.logs import log
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Profile, ProfilePoint, RankProfile
from poplar.zero.failures import IterationFailed


@dataclass
class ReplanOptions:
    """Knobs of re-planning (``fit(..., replan=ReplanOptions(...))``)."""

    threshold: float = 0.10  # |measured / expected compute - 1| beyond this is drift
    patience: int = 3  # ... for this many iterations in a row (K)
    margin: float = 0.05  # a new plan must be predicted this much faster than the current one
    cooldown: int = 3  # iterations after a decision before drift is looked for again
    max_retries: int = 4  # out-of-memory retries of one iteration
    profile: Profile | None = None  # default: the engine's (auto mode)
    strategy: str | None = None  # default: the current plan's
    require_all_ranks: bool = False
    max_micro_steps: int | None = None
    enabled: bool = True  # False: re-planning off (also with a profile)

    def check(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"ReplanOptions.enabled must be True or False, got {self.enabled!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"replan threshold must be > 0 (0.1 = 10 %), got {self.threshold}")
        for name in ("patience", "cooldown", "max_retries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "patience" else 0):
                raise ValueError(f"replan {name} must be an int >= {1 if name == 'patience' else 0}, got {v!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"replan margin must be >= 0 (0.05 = 5 %), got {self.margin}")


@dataclass
class ReplanEvent:
    """One decision: the first iteration of the new plan, why, and the predicted iteration
    seconds of the current plan and of the new one, both on the corrected profile."""

    iteration: int
    kind: str  # "speed" or "memory"
    ranks: list[int]
    correction: dict[int, float]  # speed: time factor per rank; memory: the new mbs per rank
    predicted_before_s: float | None  # None: the current plan no longer fits in memory
    predicted_after_s: float
    applied: bool
    at: float = 0.0  # time.perf_counter() of the decision (the trace's clock)
    plan: list[list[int]] = field(default_factory=list)  # the new plan's rows (b, gas, lbs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_replanner(engine: Any, replan: ReplanOptions | None) -> "Replanner | None":
    """The re-planner ``fit`` uses, or None when re-planning is off (``ReplanOptions(enabled=False)``,
    or None and no profile). Options given without a profile are an error naming the fix."""
    if replan is not None and not isinstance(replan, ReplanOptions):
        raise TypeError(f"replan must be None or a ReplanOptions, got {type(replan).__name__}")
    if replan is not None and not replan.enabled:
        return None
    options = replan if replan is not None else ReplanOptions()
    options.check()
    profile = options.profile if options.profile is not None else engine.profile
    if profile is None:
        if replan is None:
            return None
        raise ValueError("re-planning needs a profile: build the engine in auto mode (global_batch_size=..., "
                         "auto=AutoOptions(...)) or pass replan=ReplanOptions(profile=...)")
    if profile.world_size != engine.world_size:
        raise ValueError(f"the re-planning profile has {profile.world_size} ranks but the job has "
                         f"{engine.world_size}; give the profile of this cluster")
    return Replanner(engine, options, profile)


class Replanner:
    """Runs ``fit``'s iterations with drift detection and out-of-memory recovery (module doc).
    Every rank holds one and calls ``step`` at the same iterations."""

    def __init__(self, engine: Any, options: ReplanOptions, profile: Profile) -> None:
        self.engine, self.options = engine, options
        self.profile = Profile.from_dict(profile.to_dict())  # the live profile, corrected as drift is found
        world = engine.world_size
        self.expected = self._expected(engine.plan)
        self.ratios: list[list[float]] = [[] for _ in range(world)]  # the current streak's ratios per rank
        self.quiet = 0  # cool-down iterations left
        self.events: list[ReplanEvent] = []

    # ------------------------------------------------------------------ one iteration
    def step(self, loader: PlanLoader, batch: Any, loss_fn: Any) -> tuple[float, Any]:
        """``engine.train_step`` on ``batch`` (``loader``'s last), retried on a new plan after an
        out-of-memory error; then the stats exchange and, on drift, a new plan. Returns the loss
        and the batch the step was taken on (the retry's, after a recovery)."""
        for attempt in range(self.options.max_retries + 1):
            try:
                loss = self.engine.train_step(batch, loss_fn)
                break
            except IterationFailed as e:
                if not e.only_out_of_memory or attempt == self.options.max_retries:
                    raise
                failed = e.out_of_memory_ranks
            batch = None  # the failed attempt's tensors go before the retry
            self._recover_memory(failed, loader)
            batch = next(loader)
        self._observe(loader)
        return loss, batch

    # ------------------------------------------------------------------ speed
    def _observe(self, loader: PlanLoader) -> None:
        stats = self.engine.last_stats
        if stats is None or not stats.rank_compute_s:
            return
        for r, (compute, samples) in enumerate(zip(stats.rank_compute_s, stats.rank_samples)):
            expected = self.expected[r]
            ratio = compute / expected if samples > 0 and expected > 0 and compute > 0 else 1.0
            if abs(ratio - 1.0) > self.options.threshold:
                self.ratios[r].append(ratio)
            else:
                self.ratios[r].clear()
        if self.quiet > 0:
            self.quiet -= 1
            return
        drifted = {r: statistics.median(rs[-self.options.patience:]) for r, rs in enumerate(self.ratios)
                   if len(rs) >= self.options.patience}
        if drifted:
            self._decide("speed", drifted, _scaled(self.profile, drifted), loader)

    # ------------------------------------------------------------------ memory
    def _recover_memory(self, failed: list[int], loader: PlanLoader) -> None:
        engine = self.engine
        device = engine.device
        if device is not None:  # forget the failed micro-step and collect what it held
            device.abort_step()
            device.release()
        error, bound = None, None
        if engine.rank in failed:
            bound, error = self._memory_bound(device)
        bounds = engine.comm.agree(error, "re-plan after an out-of-memory error", bound)
        new_mbs = {r: b for r, b in enumerate(bounds) if b is not None}
        loader.iteration -= 1  # the same global batch again, cut by the new plan
        self._decide("memory", {r: float(b[0]) for r, b in new_mbs.items()}, _with_mbs(self.profile, new_mbs),
                     loader, force=True)

    def _memory_bound(self, device: Any) -> tuple[tuple[int, int | None] | None, str | None]:
        """(new mbs, capacity now) for this rank, or an error when batch 1 no longer fits."""
        row, planned = self.profile.ranks[self.engine.rank], self.engine.rank_plan
        failed_at = max(planned.micro_batch_size, planned.last_batch_size)
        capacity = device.capacity_bytes if device is not None else None
        mbs = min(row.mbs, failed_at - 1)
        if capacity is not None and row.capacity_bytes and row.bytes_per_sample:
            lost = max(row.capacity_bytes - capacity, 0)
            mbs = min(mbs, row.mbs - math.ceil(lost / row.bytes_per_sample))
        if mbs < 1:
            return None, (f"out of memory at a micro-batch of {failed_at}, and batch 1 no longer fits "
                          f"(capacity now {capacity} bytes): free memory on this device or use a higher ZeRO stage")
        return (mbs, capacity), None

    # ------------------------------------------------------------------ deciding and switching
    def _decide(self, kind: str, correction: dict[int, float], corrected: Profile, loader: PlanLoader,
                force: bool = False) -> None:
        engine, opts = self.engine, self.options
        current = engine.plan
        try:
            # the running shard weights stay: a re-plan moves batches, and its mbs are those weights'
            new = make_plan(corrected, current.global_batch_size, current.zero_stage,
                            opts.strategy or current.strategy or "poplar", require_all_ranks=opts.require_all_ranks,
                            max_micro_steps=opts.max_micro_steps,
                            shards="even" if current.even_shards else current.shard_weights,
                            # a running policy of quantized collectives stays: a re-plan moves batches
                            collectives=CollectivesRequest(compression=current.compression))
            new = new.with_offloads(current.offloads)  # and so do the ranks whose optimizer is offloaded
        except PlanError as e:
            raise PlanError(f"re-planning at iteration {engine.iteration} failed: {e}") from None
        before = _price(corrected, current)
        after = new.predicted_iteration_s or 0.0
        apply = force or before is None or (before - after) > opts.margin * before
        event = ReplanEvent(engine.iteration, kind, sorted(correction), correction, before, after, apply,
                            time.perf_counter(), [[r.micro_batch_size, r.accum_steps, r.last_batch_size]
                                                  for r in new.ranks])
        self.events.append(event)
        self.profile = corrected
        if apply:
            engine.set_plan(new)
            loader.set_plan(new, engine.rank)
        self.expected = self._expected(engine.plan)
        self.ratios = [[] for _ in self.ratios]
        self.quiet = opts.cooldown
        if engine.rank == 0:
            log.info(_describe(event, new if apply else None))

    def _expected(self, plan: Plan) -> list[float]:
        """Each rank's compute seconds for its row of ``plan``, priced on the live profile."""
        problem = make_problem(self.profile, plan.global_batch_size, plan.zero_stage)
        ev = evaluate_rows(_rows(self.profile, plan), problem.curves, plan.zero_stage, problem.comm)
        return list(ev.compute_s)

    def records(self, since: int = 0) -> list[dict[str, Any]]:
        """The decisions from the ``since``-th on, JSON-safe (``metrics.json``'s ``replans``)."""
        return [e.to_dict() for e in self.events[since:]]


def _rows(profile: Profile, plan: Plan) -> list[tuple[str, int, int, int]]:
    return [(profile.ranks[r].device_type, row.micro_batch_size, row.accum_steps, row.last_batch_size)
            for r, row in enumerate(plan.ranks)]


def _price(profile: Profile, plan: Plan) -> float | None:
    """``plan``'s predicted iteration seconds on ``profile``; None if a row exceeds a rank's mbs."""
    problem = make_problem(profile, plan.global_batch_size, plan.zero_stage, compression=plan.compression)
    try:
        return evaluate_rows(_rows(profile, plan), problem.curves, plan.zero_stage, problem.comm).iteration_s
    except ValueError:
        return None


def _own_type(row: RankProfile) -> str:
    """A corrected rank leaves its device type: its curve is no longer its peers'."""
    mark = f"@rank{row.rank}"
    return row.device_type if row.device_type.endswith(mark) else row.device_type + mark


def _scaled(profile: Profile, factors: dict[int, float]) -> Profile:
    """``profile`` with each named rank's compute times multiplied by its factor."""
    ranks = [replace(r, device_type=_own_type(r), points=[ProfilePoint(p.batch, p.compute_s * factors[r.rank],
                                                                      p.comm_s) for p in r.points])
             if r.rank in factors else r for r in profile.ranks]
    return replace(profile, ranks=ranks)


def _with_mbs(profile: Profile, mbs: dict[int, tuple[int, int | None]]) -> Profile:
    """``profile`` with each named rank's mbs (and capacity) re-bounded; its points beyond the new
    mbs are dropped (the curve is tabulated up to mbs)."""
    ranks = []
    for r in profile.ranks:
        if r.rank not in mbs:
            ranks.append(r)
            continue
        new_mbs, capacity = mbs[r.rank]
        points = [p for p in r.points if p.batch <= new_mbs] or [_at(r.points, new_mbs)]
        ranks.append(replace(r, device_type=_own_type(r), mbs=new_mbs, points=points,
                             capacity_bytes=capacity if capacity is not None else r.capacity_bytes))
    return replace(profile, ranks=ranks)


def _at(points: list[ProfilePoint], batch: int) -> ProfilePoint:
    """A point at ``batch`` from the smallest measured one (time scaled by the batch ratio), for a
    rank left with no measured point at or below its new mbs."""
    low = min(points, key=lambda p: p.batch)
    return ProfilePoint(batch, low.compute_s * batch / low.batch, low.comm_s)


def _describe(event: ReplanEvent, new: Plan | None) -> str:
    what = ", ".join(f"rank {r} {'x' if event.kind == 'speed' else 'mbs '}{v:.3g}"
                     for r, v in event.correction.items())
    before = "does not fit" if event.predicted_before_s is None else f"{event.predicted_before_s:.4f} s"
    head = (f"{'re-plan' if new is not None else 'drift noted, plan kept'} at iteration {event.iteration} "
            f"({event.kind}: {what}): predicted iteration on the current plan {before}, on a new plan "
            f"{event.predicted_after_s:.4f} s")
    return head + (f"\n{new.table()}" if new is not None else "")

