"""Auto mode's choice among configurations (ZeRO stage x activation checkpointing) by predicted
iteration time (docs/design.md §7.1): every candidate's capacity, collective-free; the first fit
timed; then, while a candidate's lower bound could beat the best prediction so far, a probe at
its mbs (a few rounds where its plan runs most) or its timing. Timings after the first reuse
what an earlier one measured with the same compute, on the sparse grid, with a measurement
repeated only where it breaks the curve's shape: together about a single-stage profile's cost.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, replace
from typing import Any, Callable

from poplar.comm import Communicator
from poplar.planner.candidates import CandidateRow, choose, estimate_profile, format_table, mbs_by_type, predict, \
    with_probe
from poplar.planner.shards import weights_to_fit
from poplar.profiler.configurations import CandidateProfiler, ConfigCapacity, Reuse
from poplar.profiler.devices import Device
from poplar.profiler.escalation import OffloadEscalation, next_offloads
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.profile_run import ProfileJob
from poplar.profiler.timing import Confirmation, TimingGrid
from poplar.types.configuration import Configuration
from poplar.types.logs import progress_bar
from poplar.types.profiles import AutoChoice, Profile, ProfileError


@dataclass
class Choice:
    """What auto mode chooses among: the global batch, the rule, the stages (one when the user
    gave a stage: it is binding; every stage for "auto") and the checkpointing settings (the
    engine's ``activation_checkpointing``: None lets auto mode try off and on, a value is binding)."""

    gbs: int
    rule: str
    checkpointing: Any
    stages: tuple[int, ...]
    active: bool = True  # False: profile one configuration (escalating), as the paper does
    rows: list[CandidateRow] | None = None
    chosen: Configuration | None = None

    def configs(self, stages: tuple[int, ...] | None = None) -> list[Configuration]:
        """The configurations allowed (or those at ``stages``), checkpointing off first, stages up."""
        settings = [None, True] if self.checkpointing is None else [self.checkpointing]
        return [Configuration(s, c) for c in settings for s in sorted(set(self.stages if stages is None else stages))]


def fit_by_shards(prof: CandidateProfiler, caps: list[ConfigCapacity],
                  say: Callable[[str], None]) -> list[ConfigCapacity]:
    """Where no configuration fits batch 1 on every rank at even shards: each one that fits some
    rank is searched again at shard weights that share the state in proportion to every rank's
    room (``planner.shards.weights_to_fit``, from the agreed searches: the same on every rank)."""
    out = []
    for c in caps:
        memory = c.memory
        weights = weights_to_fit([m.capacity_bytes for m in memory], [m.fixed_bytes for m in memory],
                                 [m.shard_bytes for m in memory]) if c.config.stage >= 1 else None
        if weights is None:
            out.append(c)
            continue
        say(f"ZeRO-{c.config.stage}, checkpointing {'on' if c.config.checkpointed else 'off'}: batch 1 does not "
            f"fit every rank at even shards; searching again at shard weights {list(weights)} (by memory)")
        out.append(prof.capacities([c.config], weights)[0])
    return out


def fit_by_offload(prof: CandidateProfiler, caps: list[ConfigCapacity], say: Callable[[str], None],
                   record: list[dict[str, Any]]) -> list[ConfigCapacity]:
    """Where no configuration fits batch 1 on every rank, at even shards or by room: the
    configurations at the highest stage (ZeRO-1 or above) are searched again with the optimizer
    of the ranks batch 1 does not fit offloaded to host memory (``escalation.next_offloads``,
    from the agreed searches: the same on every rank), until they fit or those ranks already
    offload. Each search again is appended to ``record``."""
    top = max(c.config.stage for c in caps)
    out = []
    for c in caps:
        while c.config.stage == top >= 1 and not c.fits:
            short = [r for r, m in enumerate(c.mbs) if m < 1]
            more = next_offloads(c.offloads, short, len(c.mbs))
            if more is None:
                break
            say(f"{c.config.name}: batch 1 does not fit ranks {short}; searching again with their optimizer "
                "offloaded to host memory")
            record.append({"configuration": c.config.name, "ranks": short, "offload": [o.value for o in more]})
            c = prof.capacities([c.config], c.shard_weights, more)[0]
        out.append(c)
    return out


def choose_configuration(comm: Communicator, job: ProfileJob, device: Device, choice: Choice,
                         say: Callable[[str], None], **limits: Any) -> Profile:
    """Capacity of every configuration (no collective), timing of the first fit, then of each
    candidate whose lower bound could beat the best prediction so far; choose (docs/design.md §7.1).
    ``limits``: the planner's (``require_all_ranks``, ``max_micro_steps``). Returns the chosen
    configuration's profile (the same on every rank) and records the choice in ``choice``."""
    popts, started = job.options, _time.perf_counter()
    prof = CandidateProfiler(job, device, log=lambda m: say(m.removeprefix("[poplar profile] ")),
                             process_group=comm.group)
    types = comm.all_gather_object(device.device_type, tag="auto:types")
    caps = prof.capacities(choice.configs())
    if not any(c.fits for c in caps):
        caps = fit_by_shards(prof, caps, say)
    offloaded: list[dict[str, Any]] = []  # the searches again with short ranks' optimizers offloaded
    if not any(c.fits for c in caps) and popts.offload_escalation is OffloadEscalation.SHORT_RANKS:
        caps = fit_by_offload(prof, caps, say, offloaded)
    rows = [CandidateRow(c.config.stage, c.config.checkpointed, c.fits, mbs_by_type(types, c.mbs)) for c in caps]
    for row, c in zip(rows, caps):
        if not c.fits:
            bad = [r for r, m in enumerate(c.mbs) if m < 1]
            row.reason = f"batch 1 does not fit on rank {bad[0]} ({types[bad[0]]})" + \
                (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
    profiles: dict[int, Profile] = {}  # timed candidates
    probes: dict[int, Profile] = {}  # candidates timed at their mbs only
    noise = popts.tolerance  # a bound within this fraction of the best cannot win by more than the noise

    def same_compute(i: int, among: dict[int, Profile]) -> Profile | None:
        """A profile in ``among`` whose micro-steps compute as candidate i's do (stages 0-2, same setting)."""
        return next((among[j] for j in among if rows[j].checkpointing == rows[i].checkpointing
                     and (j == i or rows[j].stage < 3 and rows[i].stage < 3)), None)

    def time(i: int) -> None:
        # the sparse grid (powers of two and mbs), a measurement repeated only where it breaks
        # the curve's shape: fewer and cheaper rounds than a single-stage profile's
        reuse, how = same_compute(i, profiles) or same_compute(i, probes), Reuse.SAME_COMPUTE
        if i in probes:  # its own probe measured its mbs and its costs
            reuse, how = (with_probe(reuse, probes[i]) if reuse else probes[i]), Reuse.SAME_CONFIG
        say(f"timing {rows[i].name}{' (new batch sizes only)' if reuse else ''} ...")
        # the steady rounds would cost each candidate about a single-stage profile's grid again
        profiles[i] = prof.time(caps[i], reuse=reuse, how=how, grid=TimingGrid.SPARSE, confirm=Confirmation.CURVE,
                                exposure=ExposureRounds.GRID)
        plan, why = predict(profiles[i], choice.gbs, rows[i].stage, **limits)
        rows[i].predicted_s, rows[i].timed = (plan.predicted_iteration_s, True) if plan else (None, True)
        rows[i].reason = why

    def bound(i: int, best: float) -> None:
        timed = [j for j in profiles if rows[j].predicted_s is not None] or list(profiles)
        same = [j for j in timed if rows[j].checkpointing == rows[i].checkpointing]
        plain = next((j for j in timed if not rows[j].checkpointing), None)
        checkpointed = next((probes[j] for j in probes if rows[j].checkpointing), None)
        if same:
            base = profiles[same[0]]
        elif rows[i].checkpointing and checkpointed is not None and plain is not None:
            base = with_probe(profiles[plain], checkpointed)  # recomputation measured at a probe
        else:
            base = profiles[timed[0]]
        if i in probes:
            base = with_probe(base, probes[i])
        estimate = estimate_profile(base, rows[i].stage, caps[i].mbs)
        estimate.shard_weights = list(caps[i].shard_weights) if caps[i].shard_weights else None
        estimate.offloads = [o.value for o in caps[i].offloads] if caps[i].offloads else None
        plan, why = predict(estimate, choice.gbs, rows[i].stage, **limits)
        rows[i].predicted_s, rows[i].reason = (plan.predicted_iteration_s if plan else None), why
        if plan and plan.predicted_iteration_s >= best * (1 - noise):
            rows[i].reason = (f"not timed: lower bound {plan.predicted_iteration_s:.4f} s >= best {best:.4f} s"
                              + (f" - {noise:.0%} noise" if plan.predicted_iteration_s < best else ""))

    fitting = sorted((i for i, r in enumerate(rows) if r.fits), key=lambda i: (rows[i].checkpointing, rows[i].stage))
    if not fitting:
        raise _none_fits(prof, choice, rows, say, popts.offload_escalation)
    # one bar over the fitting candidates: each is timed, or decided by its bound (rank 0)
    bar = progress_bar(len(fitting), "profiling: candidates", popts.progress and comm.rank == 0)
    time(fitting[0])
    bar.update(1)
    while choice.rule == "fastest":
        best = min((rows[i].predicted_s for i in profiles if rows[i].predicted_s is not None), default=float("inf"))
        for i in fitting:
            if i not in profiles:
                bound(i, best)
        hopeful = [i for i in fitting if i not in profiles and rows[i].predicted_s is not None
                   and rows[i].predicted_s < best * (1 - noise)]
        if not hopeful:
            break
        nxt = min(hopeful, key=lambda i: rows[i].predicted_s)
        if same_compute(nxt, profiles) is None and same_compute(nxt, probes) is None:
            # a cheap probe first: one round at the candidate's own mbs, where its plan runs
            # most; its bound then holds its own speed there, and a full timing keeps it. One
            # measurement: a disturbed probe raises the bound by the disturbance at most, so it
            # can only make a candidate within that of the best go untimed
            say(f"probing {rows[nxt].name} at its mbs ...")
            probes[nxt] = prof.time(caps[nxt], sizes=[[m] for m in caps[nxt].mbs], confirm=Confirmation.CURVE,
                                    exposure=ExposureRounds.GRID)
            continue
        time(nxt)
        bar.update(1)
    bar.update(len(fitting) - len(profiles))  # the rest, decided by their bounds
    bar.close()
    pick = choose([r for i, r in enumerate(rows) if i in profiles] or rows, choice.rule)
    index = rows.index(pick)
    choice.rows, choice.chosen = rows, caps[index].config
    profile = profiles[index]
    if popts.time_past_mbs and caps[index].result is not None:
        profile = prof.time_past_mbs(caps[index], profile)
    profile = replace(profile, auto_choice=AutoChoice(choice.rule, [r.to_dict() for r in rows], {
        k: round(v, 3) for k, v in prof.seconds.items()}, len(profiles), len(probes), prof.rounds, offloaded))
    say(f"configurations ({choice.rule}; profiling {prof.total_seconds:.1f} s, {_time.perf_counter() - started:.1f} s "
        f"of wall time with set-up: capacity "
        f"{prof.seconds['capacity_s']:.1f} s, timing {prof.seconds['timing_s']:.1f} s ({prof.rounds} rounds), "
        f"collectives {prof.seconds['comm_s']:.1f} s; {len(profiles)} timed, {len(probes)} probed):\n"
        + format_table(rows))
    return Profile.from_dict(comm.all_gather_object(profile.to_dict() if comm.rank == 0 else None,
                                                    tag="auto:profile")[0])


def _none_fits(prof: CandidateProfiler, choice: Choice, rows: list[CandidateRow],
               say: Callable[[str], None], offload: OffloadEscalation) -> ProfileError:
    """The error when no allowed configuration fits batch 1 on every rank: each one's reason, and
    the lowest higher stage that would fit, at even shards or by room (its capacity searched now,
    every rank together)."""
    why = "; ".join(f"{r.name}: {r.reason}" for r in rows)
    higher = tuple(range(max(choice.stages) + 1, 4))
    caps = prof.capacities(choice.configs(higher)) if higher else []
    if caps and not any(c.fits for c in caps):
        caps = fit_by_shards(prof, caps, say)
    found = [c.config for c in caps if c.fits]
    would = min(found, key=lambda c: (c.stage, c.checkpointed), default=None)
    asked = "the stage given" if len(set(choice.stages)) == 1 else "the stages allowed"
    if would is None:
        tried = (" (offloading the short ranks' optimizer to host memory did not make it fit either)"
                 if offload is OffloadEscalation.SHORT_RANKS else
                 ", or let the short ranks offload their optimizer to host memory: AutoOptions(offload=\"auto\")")
        return ProfileError(f"batch 1 does not fit every rank at {asked} ({why}), nor at any higher stage: use "
                            "devices with more memory, a smaller model, activation checkpointing or fewer ranks "
                            f"on the small devices{tried}")
    return ProfileError(f"batch 1 does not fit every rank at {asked} ({why}); {would.name} would fit: give "
                        f'zero_stage={would.stage} ("stage": {would.stage} in a config), or "auto" to let auto mode '
                        "choose the stage")
