"""Auto mode's choice among configurations (ZeRO stage x activation checkpointing) by predicted
iteration time (docs/design.md §7.1): every candidate's capacity, collective-free; the first fit
timed; then, while a candidate's lower bound could beat the best prediction so far, a probe at
its mbs (a few rounds where its plan runs most) or its timing. Timings after the first reuse
what an earlier one measured with the same compute, on the sparse grid, with a measurement
repeated only where it breaks the curve's shape: together about a single-stage profile's cost.

``ConfigurationSearch`` decides; the profiler's run (``ProfileRun.measure`` with a
``candidate_run.Candidates`` target) measures what it asks for, on every rank together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from poplar.planner.candidates import CandidateRow, estimate_profile, format_table, marked, mbs_by_type, predict, \
    with_probe
from poplar.planner.shards import weights_to_fit
from poplar.profiler.candidate_run import ChoiceRecord, TimingRequest
from poplar.profiler.configurations import ConfigCapacity, Reuse, ShardMemory
from poplar.profiler.escalation import OffloadEscalation
from poplar.types.configuration import Configuration
from poplar.logs import progress_bar
from poplar.types.profiles import AutoChoice, Profile, ProfileError


@dataclass(frozen=True)
class Choice:
    """What auto mode chooses among: the global batch, the rule, the stages (one when the user
    gave a stage: it is binding; every stage for "auto") and the checkpointing settings (the
    engine's ``activation_checkpointing``: None lets auto mode try off and on, a value is binding)."""

    gbs: int
    rule: str
    checkpointing: Any
    stages: tuple[int, ...]
    active: bool = True  # False: profile one configuration (escalating), as the paper does

    def configs(self, stages: tuple[int, ...] | None = None) -> list[Configuration]:
        """The configurations allowed (or those at ``stages``), checkpointing off first, stages up."""
        settings = [None, True] if self.checkpointing is None else [self.checkpointing]
        return [Configuration(s, c) for c in settings for s in sorted(set(self.stages if stages is None else stages))]


@dataclass(frozen=True)
class PlanLimits:
    """The planner's limits a candidate's prediction is made under."""

    require_all_ranks: bool = False
    max_micro_steps: int | None = None

    def predict(self, profile: Profile, gbs: int, stage: int) -> tuple[Any, str]:
        return predict(profile, gbs, stage, require_all_ranks=self.require_all_ranks,
                       max_micro_steps=self.max_micro_steps)


@dataclass
class Candidate:
    """One configuration of the search: its agreed capacity, its row of the table, and what was
    measured of it (its timing; its probe, one round at its mbs)."""

    index: int
    capacity: ConfigCapacity
    row: CandidateRow
    profile: Profile | None = None
    probe: Profile | None = None

    def computes_as(self, other: "Candidate") -> bool:
        """Whether ``other``'s micro-steps compute as this one's (stages 0-2, the same setting)."""
        return other.row.checkpointing == self.row.checkpointing and \
            (other is self or other.row.stage < 3 and self.row.stage < 3)


class Bound(NamedTuple):
    """A candidate not timed: its predicted iteration from an estimate (a lower bound), and why."""

    predicted_s: float | None
    reason: str


class ConfigurationSearch:
    """The branch and bound over the candidates (module doc); a ``candidate_run.CandidateChoice``.
    ``noise``: a bound within this fraction of the best cannot win by more than the noise."""

    def __init__(self, choice: Choice, say: Callable[[str], None], limits: PlanLimits, *, noise: float,
                 progress: bool) -> None:
        self.choice, self.say, self.limits, self.noise, self.progress = choice, say, limits, noise, progress
        self.candidates: list[Candidate] = []
        self.fitting: list[Candidate] = []  # the candidates that fit every rank, checkpointing off first, stages up
        self.timed: list[Candidate] = []  # in the order they were timed
        self.probed: list[Candidate] = []  # in the order they were probed
        self.chosen_config: Configuration | None = None
        self.bar: Any = None

    @property
    def rows(self) -> list[CandidateRow]:
        """The candidate table: every candidate's row, in order."""
        return [c.row for c in self.candidates]

    # ---- capacity ----
    def configurations(self, higher: bool = False) -> list[Configuration]:
        stages = tuple(range(max(self.choice.stages) + 1, 4)) if higher else None
        return self.choice.configs(stages) if stages != () else []

    def weights_to_fit(self, memory: list[ShardMemory]) -> tuple[float, ...] | None:
        return weights_to_fit([m.capacity_bytes for m in memory], [m.fixed_bytes for m in memory],
                              [m.shard_bytes for m in memory])

    def start(self, capacities: list[ConfigCapacity], device_types: list[str]) -> None:
        """Every candidate's row (why it does not fit, where it does not)."""
        for i, cap in enumerate(capacities):
            row = CandidateRow(cap.config.stage, cap.config.checkpointed, cap.fits, mbs_by_type(device_types, cap.mbs))
            bad = [r for r, m in enumerate(cap.mbs) if m < 1]
            if bad:
                row = replace(row, reason=f"batch 1 does not fit on rank {bad[0]} ({device_types[bad[0]]})"
                              + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
            self.candidates.append(Candidate(i, cap, row))
        self.fitting = sorted((c for c in self.candidates if c.row.fits),
                              key=lambda c: (c.row.checkpointing, c.row.stage))
        if self.fitting:  # one bar over the fitting candidates: each is timed, or decided by its bound (rank 0)
            self.bar = progress_bar(len(self.fitting), "profiling: candidates", self.progress)

    def none_fit(self, higher: list[ConfigCapacity], offload: OffloadEscalation) -> ProfileError:
        """Each candidate's reason, and the lowest higher stage that would fit (at even shards or
        by room), or what else to try."""
        why = "; ".join(f"{c.row.name}: {c.row.reason}" for c in self.candidates)
        would = min((c.config for c in higher if c.fits), key=lambda c: (c.stage, c.checkpointed), default=None)
        asked = "the stage given" if len(set(self.choice.stages)) == 1 else "the stages allowed"
        if would is not None:
            return ProfileError(f"batch 1 does not fit every rank at {asked} ({why}); {would.name} would fit: give "
                                f'zero_stage={would.stage} ("stage": {would.stage} in a config), or "auto" to let '
                                "auto mode choose the stage")
        tried = (" (offloading the short ranks' optimizer to host memory did not make it fit either)"
                 if offload is OffloadEscalation.SHORT_RANKS else
                 ", or let the short ranks offload their optimizer to host memory: AutoOptions(offload=\"auto\")")
        return ProfileError(f"batch 1 does not fit every rank at {asked} ({why}), nor at any higher stage: use "
                            "devices with more memory, a smaller model, activation checkpointing or fewer ranks "
                            f"on the small devices{tried}")

    # ---- timing ----
    def next_timing(self) -> TimingRequest | None:
        """The first fit's timing; then, while a candidate's bound could beat the best so far, the
        most hopeful one's probe (where nothing with its compute was measured) or timing."""
        if not self.timed:
            return self._timing_of(self.fitting[0])
        if self.choice.rule != "fastest":
            return None
        best = min((c.row.predicted_s for c in self.timed if c.row.predicted_s is not None), default=float("inf"))
        for c in self.fitting:
            if c.profile is None:
                bound = self._bound(c, best)
                c.row = replace(c.row, predicted_s=bound.predicted_s, reason=bound.reason)
        hopeful = [c for c in self.fitting if c.profile is None and c.row.predicted_s is not None
                   and c.row.predicted_s < best * (1 - self.noise)]
        if not hopeful:
            return None
        nxt = min(hopeful, key=lambda c: c.row.predicted_s)
        if self._measured_like(nxt, self.timed, False) is None and self._measured_like(nxt, self.probed, True) is None:
            # a cheap probe first: one round at the candidate's own mbs, where its plan runs
            # most; its bound then holds its own speed there, and a full timing keeps it. One
            # measurement: a disturbed probe raises the bound by the disturbance at most, so it
            # can only make a candidate within that of the best go untimed
            self.say(f"probing {nxt.row.name} at its mbs ...")
            return TimingRequest(nxt.index, probe=True)
        return self._timing_of(nxt)

    def record(self, request: TimingRequest, profile: Profile) -> None:
        c = self.candidates[request.index]
        if request.probe:
            c.probe = profile
            self.probed.append(c)
            return
        c.profile = profile
        self.timed.append(c)
        plan, why = self.limits.predict(profile, self.choice.gbs, c.row.stage)
        c.row = replace(c.row, predicted_s=plan.predicted_iteration_s if plan else None, timed=True, reason=why)
        self.bar.update(1)

    def chosen(self) -> tuple[int, Profile]:
        """The rule's pick among the timed candidates."""
        self.bar.update(len(self.fitting) - len(self.timed))  # the rest, decided by their bounds
        self.bar.close()
        among = [c for c in self.candidates if c.profile is not None] or self.candidates
        for c, row in zip(among, marked([c.row for c in among], self.choice.rule)):
            c.row = row
        chosen = next(c for c in among if c.row.chosen)
        self.chosen_config = chosen.capacity.config
        assert chosen.profile is not None
        return chosen.index, chosen.profile

    def finish(self, profile: Profile, record: ChoiceRecord) -> Profile:
        """The chosen profile with the choice recorded (``Profile.auto_choice``), and its table (rank 0)."""
        rows, seconds = [c.row for c in self.candidates], record.seconds
        chosen = replace(profile, auto_choice=AutoChoice(
            self.choice.rule, tuple(rows), {k: round(v, 3) for k, v in seconds.items()},
            len(self.timed), len(self.probed), record.rounds, tuple(record.offload_escalations)))
        self.say(f"configurations ({self.choice.rule}; profiling {sum(seconds.values()):.1f} s, {record.wall_s:.1f} s "
                 f"of wall time with set-up: capacity {seconds['capacity_s']:.1f} s, timing "
                 f"{seconds['timing_s']:.1f} s ({record.rounds} rounds), collectives {seconds['comm_s']:.1f} s; "
                 f"{len(self.timed)} timed, "
                 f"{len(self.probed)} probed):\n" + format_table(rows))
        return chosen

    # ---- the bound ----
    def _timing_of(self, c: Candidate) -> TimingRequest:
        """``c``'s timing, reusing what was measured with its compute (its own probe first)."""
        reuse = self._measured_like(c, self.timed, False) or self._measured_like(c, self.probed, True)
        how = Reuse.SAME_COMPUTE
        if c.probe is not None:  # its own probe measured its mbs and its costs
            reuse, how = (with_probe(reuse, c.probe) if reuse else c.probe), Reuse.SAME_CONFIG
        self.say(f"timing {c.row.name}{' (new batch sizes only)' if reuse else ''} ...")
        return TimingRequest(c.index, reuse=reuse, how=how)

    @staticmethod
    def _measured_like(c: Candidate, among: list[Candidate], probe: bool) -> Profile | None:
        """The first profile (``probe``: probe) in ``among`` whose micro-steps compute as ``c``'s."""
        found = next((o for o in among if c.computes_as(o)), None)
        return None if found is None else found.probe if probe else found.profile

    def _bound(self, c: Candidate, best: float) -> Bound:
        """``c``'s predicted iteration from an estimate of its profile (a lower bound)."""
        cap = c.capacity
        estimate = estimate_profile(self._bound_base(c), c.row.stage, cap.mbs)
        estimate.shard_weights = list(cap.shard_weights) if cap.shard_weights else None
        estimate.offloads = [o.value for o in cap.offloads] if cap.offloads else None
        plan, why = self.limits.predict(estimate, self.choice.gbs, c.row.stage)
        if plan and plan.predicted_iteration_s >= best * (1 - self.noise):
            why = (f"not timed: lower bound {plan.predicted_iteration_s:.4f} s >= best {best:.4f} s"
                   + (f" - {self.noise:.0%} noise" if plan.predicted_iteration_s < best else ""))
        return Bound(plan.predicted_iteration_s if plan else None, why)

    def _bound_base(self, c: Candidate) -> Profile:
        """The timed profile ``c``'s estimate starts from: one with its checkpointing setting, or
        the plain one with recomputation measured at a probe, or the first timed; with ``c``'s
        own probe where it has one."""
        timed = [o for o in self.timed if o.row.predicted_s is not None] or list(self.timed)
        same = [o for o in timed if o.row.checkpointing == c.row.checkpointing]
        plain = next((o for o in timed if not o.row.checkpointing), None)
        checkpointed = next((o.probe for o in self.probed if o.row.checkpointing), None)
        if same:
            base = same[0].profile
        elif c.row.checkpointing and checkpointed is not None and plain is not None:
            base = with_probe(plain.profile, checkpointed)  # recomputation measured at a probe
        else:
            base = timed[0].profile
        assert base is not None
        return with_probe(base, c.probe) if c.probe is not None else base
