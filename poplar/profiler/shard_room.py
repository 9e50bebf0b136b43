"""Timing each rank past its mbs, at shard weights that give it the room (docs/design.md §4.3).

A capacity search at even shards finds how far each rank's micro-batch goes while it holds a
full 1/N of the state; a short card beside big ones may fit one sample. The planner can move
state off it (``planner.shards``), and then it runs larger micro-batches, whose times the timing
rounds never measured: a curve known at batch 1 only is extended at constant speed, several
times too slow on a GPU whose speed rises with the batch, so the planner would give that card
too little of the batch, and the shards too little weight, to be worth it.

So, after the timing rounds, every rank whose largest micro-batch grows under the weights at
which the rank with the least room holds no state (the farthest shard candidate, which gives
every card with less room than average its most) is timed again at the batches between its mbs
and that one, in lock-step rounds at those weights; the others run batch 1 beside it. A
micro-step's compute (communication subtracted) does not depend on the shard, so the points
are its curve there (``RankProfile.points_past_mbs``). Before the rounds, every rank runs one
local step of its largest batch at those weights, the real trial of the memory model; where
one does not fit, or a round overflows, the profile stays as it was and says why.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.profiles import PastMbs, Profile, ProfileError
from poplar.planner.shard_memory import blended, emptied_blend, knows_shard_memory, mbs_at, proportional_weights


def sizes_past_mbs(profile: Profile, max_batch: int) -> tuple[tuple[float, ...], list[list[int]]] | None:
    """The weights that give the ranks with less room their most, and per rank the batches to
    time past its mbs there (powers of two and the largest, at most ``max_batch``); None when
    the profile does not say what a shard costs, or no rank would grow."""
    if profile.world_size < 2 or not knows_shard_memory(profile):
        return None
    proportional = proportional_weights(profile)
    blend = emptied_blend(proportional)
    if blend is None:
        return None
    weights = blended(proportional, blend)
    grown = [min(m, max_batch) for m in mbs_at(profile, weights)]
    if min(grown) < 1:
        return None
    ranks = sorted(profile.ranks, key=lambda r: r.rank)
    sizes = [[b for b in timing_batches(g, TimingGrid.SPARSE) if b > r.mbs] for r, g in zip(ranks, grown)]
    return (weights, sizes) if any(sizes) else None


def time_past_mbs(run: Any, fit: Any, profile: Profile) -> Profile:
    """``profile`` with every rank's ``points_past_mbs`` (module doc), timed by ``run`` (the
    profiling run: its comm, job, ``trial_fits`` and ``time``) at ``fit``'s stage. Every rank
    calls it with the same profile; the same profile comes back on every rank."""
    found = sizes_past_mbs(profile, run.job.options.max_batch)
    if found is None:
        return profile
    weights, sizes = found
    per_rank = [s or [1] for s in sizes]  # a rank with nothing to time runs its cheapest beside the others
    started = time.perf_counter()
    fits = run.trial_fits(fit.stage, max(per_rank[run.comm.rank]), weights, fit.offloads)
    if not all(fits):
        run.lead(f"timing past mbs skipped: at shard weights {list(weights)} rank(s) "
                 f"{[r for r, ok in enumerate(fits) if not ok]} did not fit their largest batch")
        return profile
    base = run.job
    run.job = replace(base, options=replace(base.options, shard_weights=weights))
    try:
        # no warm-up round: this process has run these computations (its timing rounds, its
        # capacity searches), and a first round slow enough to matter breaks the curve's shape
        # and is measured again (CURVE)
        timing = run.time(fit, per_rank, warmup=False, confirm=Confirmation.CURVE, exposure=ExposureRounds.GRID)
    except ProfileError as e:  # a round overflowed on some rank: every rank raised it
        run.lead(f"timing past mbs skipped: {e}")
        return profile
    finally:
        run.job = base
    # not assembled into a profile: these points lie past the ranks' mbs, which a profile's
    # points may not; they are gathered as they are
    mine = set(sizes[run.comm.rank])
    points = run.comm.all_gather_object([p for p in timing.points if p.batch in mine], tag="profile:past mbs")
    for r in profile.ranks:
        r.points_past_mbs = sorted(points[r.rank], key=lambda p: p.batch)
    profile = replace(profile, measurement=replace(profile.measurement, past_mbs=PastMbs(
        [float(w) for w in weights], [list(b) for b in sizes], round(time.perf_counter() - started, 3))))
    run.lead(f"timed past mbs at shard weights {[round(w, 2) for w in weights]}: batches {sizes}")
    return profile
