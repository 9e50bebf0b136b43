"""Choosing a configuration: ZeRO stage x activation checkpointing, by predicted iteration time
(docs/design.md §7.1). Pure computation on profiles (no torch).

A ``CandidateRow`` is one configuration: whether it fits every rank, its mbs per device type,
its predicted iteration time (from its own timed profile, or an estimate), and why it was
rejected. ``choose`` picks the fastest that fits (``rule="fastest"``) or the paper's first fit
(the lowest stage that fits without checkpointing, then with it). ``estimate_profile`` turns a
timed profile of another configuration into an optimistic one for a candidate (its own mbs;
beyond the measured batches the smallest measured cost per added sample, ``optimistic_time``;
no recomputation cost), so that its
prediction is a lower bound: a candidate whose bound is not below the best predicted time
cannot win and is not timed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any

from poplar.planner.planning import plan as make_plan
from poplar.types.configuration import CandidateRow
from poplar.types.plans import Offload, Plan, PlanError
from poplar.types.profiles import Profile, ProfileError, ProfilePoint

RULES = ("fastest", "first_fit")


def mbs_by_type(device_types: list[str], mbs: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t, m in zip(device_types, mbs):
        out[t] = min(out.get(t, m), m)
    return out


def predict(profile: Profile, gbs: int, stage: int, **limits: Any) -> tuple[Plan | None, str]:
    """The plan of ``profile`` at ``stage`` and "" , or None and why it cannot be planned; at the
    shard weights and optimizer placements the profile was measured at (even and on every
    device unless the model fitted no other way)."""
    shards = profile.shard_weights if profile.shard_weights is not None else "even"
    offload = [Offload(o) for o in profile.offloads] if profile.offloads is not None else "none"
    try:
        return make_plan(profile, gbs, stage, "poplar", shards=shards, offload=offload, **limits), ""
    except (PlanError, ProfileError, ValueError) as e:
        return None, f"cannot plan: {e}"


def estimate_profile(base: Profile, stage: int, mbs: list[int]) -> Profile:
    """An optimistic profile of a configuration with per-rank ``mbs``, from ``base`` (timed at
    another configuration): the measured times up to each rank's mbs, beyond them the fastest
    measured speed; communication priced by ring formulas at ``stage`` unless ``base`` was
    measured there."""
    est = copy.deepcopy(base)
    est.zero_stage = stage
    for r, m in zip(est.ranks, mbs):
        pts = [p for p in r.points if p.batch <= m]
        top = max((p.batch for p in pts), default=0)
        extra = sorted({b for b in (2 ** k for k in range(int(math.log2(max(m, 1))) + 1)) if top < b <= m} | {m})
        pts += [ProfilePoint(b, optimistic_time(r.points, b)) for b in extra if b > top]
        r.points, r.mbs = pts, m
    est.shard_weights = None  # the caller's configuration's own, if not even
    est.offloads = None  # likewise its optimizer placements
    return est


def optimistic_time(points: list[ProfilePoint], batch: int) -> float:
    """An optimistic micro-step time at ``batch``, beyond the measured points: from the largest
    measured batch on, the smallest cost per added sample seen between measured batches (a GPU's
    speed keeps growing with the batch while a fixed per-step cost is spread thinner, so keeping
    the fastest measured *speed* would overestimate a larger batch's time), and never slower than
    the fastest measured speed."""
    pts = sorted(points, key=lambda p: p.batch)
    last = pts[-1]
    at_best_speed = batch * min(p.compute_s / p.batch for p in pts)
    steps = [(b.compute_s - a.compute_s) / (b.batch - a.batch) for a, b in zip(pts, pts[1:])]
    marginal = min((x for x in steps if x > 0), default=None)
    if marginal is None or batch <= last.batch:
        return at_best_speed
    return min(at_best_speed, last.compute_s + (batch - last.batch) * marginal)


def with_probe(plain: Profile, probe: Profile) -> Profile:
    """``plain``'s points below each rank's probed batch, then the probe's (a checkpointed
    configuration timed at its own mbs): an optimistic base for a checkpointed candidate, since
    recomputation only adds time to the plain points, and measured where its plan runs most."""
    out = copy.deepcopy(plain)
    for r, q in zip(out.ranks, probe.ranks):
        top = min(p.batch for p in q.points)
        r.points = sorted([p for p in r.points if p.batch < top] + list(q.points), key=lambda p: p.batch)
    return out


def marked(rows: list[CandidateRow], rule: str = "fastest") -> list[CandidateRow]:
    """``rows`` with the rule's choice marked (``rule``: "fastest" or "first_fit") and, on the
    others that fit, why they were not chosen."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")
    fitting = [r for r in rows if r.fits and r.predicted_s is not None]
    if not fitting:
        raise PlanError("no configuration fits every rank: " + "; ".join(f"{r.name}: {r.reason}" for r in rows))
    if rule == "first_fit":
        best = min(fitting, key=lambda r: (r.checkpointing, r.stage))
    else:
        best = min(fitting, key=lambda r: (r.predicted_s, r.stage, r.checkpointing))
    out = []
    for r in rows:
        reason = r.reason
        if r is best:
            reason = ""
        elif r.fits and r.predicted_s is not None and not r.reason:
            reason = (f"slower: {r.predicted_s / best.predicted_s:.2f}x the choice" if rule == "fastest"
                      else "not the first fit")
        out.append(replace(r, chosen=r is best, reason=reason))
    return out


def choose(rows: list[CandidateRow], rule: str = "fastest") -> CandidateRow:
    """The chosen row, marked (``marked``)."""
    return next(r for r in marked(rows, rule) if r.chosen)


def format_table(rows: list[CandidateRow], measured: dict[str, float] | None = None) -> str:
    """The candidate table: config, fits, mbs per device type, predicted seconds, why rejected."""
    types = sorted({t for r in rows for t in r.mbs})
    head = ["config", "fits"] + [f"mbs {t}" for t in types] + ["predicted s", "source"]
    if measured is not None:
        head.append("measured s")
    head.append("choice / why rejected")
    lines = []
    for r in rows:
        pred = "-" if r.predicted_s is None else f"{r.predicted_s:.4f}"
        src = r.source or ("timed" if r.timed else ("bound" if r.predicted_s is not None else "-"))
        cells = [r.name, "yes" if r.fits else "no"] + [str(r.mbs.get(t, "-")) for t in types] + [pred, src]
        if measured is not None:
            m = measured.get(r.name)
            cells.append("-" if m is None else f"{m:.4f}")
        cells.append("CHOSEN" if r.chosen else r.reason)
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(c) for c in lines])


def recorded_candidates(profile: Profile, gbs: int, **limits: Any) -> list[CandidateRow]:
    """The candidate table auto mode saved with ``profile`` (``Profile.auto_choice``), predicted
    again at ``gbs``. The profile is the chosen configuration's: it is planned from its timings
    and stays the choice; every other fitting configuration gets a lower bound from it
    (``estimate_profile``), and a bound below the choice says that profiling again at this
    global batch could choose differently."""
    saved = profile.auto_choice.candidates if profile.auto_choice is not None else None
    if not saved:
        raise ValueError(f"this profile holds one configuration (ZeRO-{profile.zero_stage}), not auto mode's "
                         "candidates: profile in auto mode with AutoOptions(profile_output=...), or ask "
                         "`poplar simulate --cluster ... --stage auto` for a preset-based table")
    own = next((r for r in saved if r.chosen), None)
    if own is None:
        raise ValueError("the profile's candidate table marks no choice; profile again in auto mode")
    types = [r.device_type for r in profile.ranks]
    rows = []
    for r in saved:
        r = replace(r, chosen=False, timed=r is own, source="")
        if r.fits:
            est = profile if r.timed else estimate_profile(profile, r.stage, [r.mbs.get(t, 0) for t in types])
            plan, reason = predict(est, gbs, r.stage, **limits)
            r = replace(r, reason=reason, predicted_s=plan.predicted_iteration_s if plan else None)
        rows.append(r)
    best = next(r for r in rows if r.timed)
    best = choose([best], "fastest")
    out = []
    for r in rows:
        if r.timed:
            r = best
        elif r.predicted_s is not None:
            bound = f"lower bound {r.predicted_s:.4f} s"
            r = replace(r, reason=f"{bound} >= the choice" if r.predicted_s >= best.predicted_s  # type: ignore[operator]
                        else f"{bound} < the choice: profile again at this global batch")
        out.append(r)
    return out
