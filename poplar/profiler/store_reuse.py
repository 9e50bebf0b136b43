"""The profile store in a profiling run (``poplar.profiler.store``): what a start reuses, and the
profiling of the device types the store lacks (``ProfileRun``'s store step).

Every rank takes the same path, decided from rank 0's reading of the store (one gather):

- every device type of the job stored, at one configuration: no profiling; the profile is
  assembled from the entries (``StoreUse.REUSED``);
- some types stored: the new ones are profiled at the stored configuration (``NewTypes``):
  their capacity search, then lock-step timing rounds in which the stored ranks run their
  cheapest batch (a round needs every rank); the stored ranks keep their stored points and
  capacity (``StoreUse.PARTIAL``), and every rank is timed past its mbs (``shard_room``) where
  shard weights give it room in this mix;
- none stored, or the entries disagree on the configuration: the full profile, as without a
  store (``StoreUse.MEASURED``).

Whatever was measured is written back (rank 0), one entry per device type. Types named in
``StoreRequest.refresh`` (auto mode's: a plan from their entries failed its check step) are
looked up as if not stored, so they are measured again and their entries replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from poplar.comm import Communicator
from poplar.profiler.capacity import CapacityResult
from poplar.profiler.devices import Device
from poplar.profiler.escalation import StageCapacity
from poplar.profiler.exposure import ExposureRounds
from poplar.profiler.job import ProfileJob
from poplar.profiler.phases import observers_of
from poplar.profiler.rank_phases import RankPhases, Timed
from poplar.profiler.store import Entry, ProfileStore, StoreKey, agreed_configuration, assemble
from poplar.profiler.timing import Confirmation, TimingGrid, timing_batches
from poplar.types.configuration import Configuration
from poplar.types.profiles import Profile, ProfileError, StoreRecord


class StoreUse(Enum):
    """How a start used the store."""

    REUSED = "reused"  # every device type's profile came from the store
    PARTIAL = "partial"  # stored types reused, new types profiled
    MEASURED = "measured"  # everything profiled


@dataclass(frozen=True)
class StoreRequest:
    """The store a run reads and writes, the job's key in it, and the job's checkpointing policy
    (a stored configuration with checkpointing runs with it, when the job gave one)."""

    store: ProfileStore
    key: StoreKey
    checkpointing: Any = None
    # device types whose entries are set aside and measured again (a plan from them failed its
    # check step); what is measured replaces them
    refresh: frozenset[str] = frozenset()


@dataclass
class StoreLookup:
    """Rank 0's reading of the store, the same on every rank."""

    cluster: list[str]  # every rank's device type
    entries: dict[str, Entry]  # the fresh ones
    warnings: list[str]
    misses: dict[str, str] = field(default_factory=dict)  # device types looked up, not found -> why

    def why_measured(self, types: list[str]) -> str:
        """Why each of ``types`` is measured, in words: its miss, or set aside (``refresh``)."""
        return "; ".join(f"{t}: {self.misses.get(t, 'set aside to be measured again')}" for t in types)

    @property
    def configuration(self) -> tuple[int, bool] | None:
        return agreed_configuration(self.entries)

    @property
    def new_types(self) -> list[str]:
        return [t for t in dict.fromkeys(self.cluster) if t not in self.entries]

    def stored_configuration(self, checkpointing: Any) -> Configuration:
        """The stored configuration as the runtime's setting (the job's own policy when it gave one)."""
        config = self.configuration
        assert config is not None
        stage, checkpointed = config
        return Configuration(stage, (checkpointing if checkpointing not in (None, False) else True)
                             if checkpointed else None)

    def assembled(self, types: list[str] | None = None) -> Profile:
        """The profile of the stored entries, for every rank (or the ranks of ``types``)."""
        cluster = self.cluster if types is None else [t for t in self.cluster if t in types]
        return assemble(self.entries, cluster)


def look_up(comm: Communicator, store: ProfileStore, key: StoreKey, device: Device,
            refresh: frozenset[str] = frozenset()) -> StoreLookup:
    """Every rank: the job's device types and rank 0's fresh entries for them (not those of ``refresh``)."""
    devices = comm.all_gather_object((device.device_type, device.identity()), tag="auto:store types")
    cluster = [t for t, _ in devices]
    found: tuple[dict[str, Entry], list[str], dict[str, str]] = ({}, [], {})
    if comm.rank == 0:
        fresh = store.lookup(key, [t for t in cluster if t not in refresh], dict(reversed(devices)))
        found = (fresh, store.take_warnings(), store.take_misses())
    entries, warnings, misses = comm.all_gather_object(found, tag="auto:store entries")[0]
    return StoreLookup(cluster, entries, warnings, misses)


def _stored_capacity(entry: Entry, stage: int) -> CapacityResult:
    r = entry.rank
    return CapacityResult(stage=stage, capacity_bytes=int(r.capacity_bytes or 0), mbs=r.mbs, trial_steps=0,
                          base_bytes=r.base_bytes, bytes_per_sample=r.bytes_per_sample, shard_bytes=r.shard_bytes)


@dataclass
class NewTypes:
    """``ProfileRun``'s target when the store holds some device types: the new ones profiled at
    ``config``, the stored ones keeping their entries (the module doc)."""

    lookup: StoreLookup
    config: Configuration

    def job_for(self, job: ProfileJob) -> ProfileJob:
        return job.at(self.config)

    def prepare(self, run: Any, job: ProfileJob) -> None:
        """Emulate at the scales the stored types were measured at (``run``: the ``ProfileRun``)."""
        stored_part = self.lookup.assembled(list(self.lookup.entries))
        for observer in observers_of(run.device):
            observer.prepare_profiling(run.comm, job, stored_part)

    def capacity(self, phases: RankPhases) -> StageCapacity | None:
        """This rank's search (a stored rank: its entry's), agreed; None on every rank when a new
        type does not fit batch 1 (the run then profiles everything)."""
        mine = self.lookup.entries.get(phases.device.device_type)
        error, result = None, None
        try:
            result = _stored_capacity(mine, self.config.stage) if mine is not None else \
                phases.search_capacity(self.config.stage)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
            error = f"capacity search at {self.config.name} failed: {type(e).__name__}: {e}"
        mbs = phases.comm.agree(error, "profile new device types", result.mbs if result is not None else 0,
                                error_type=ProfileError)
        phases.end_phase("capacity_s")
        if any(m < 1 for m in mbs):
            phases.log(f"profile store: batch 1 does not fit {', '.join(self.lookup.new_types)} at "
                       f"{self.config.name}; profiling every device type")
            return None
        assert result is not None
        return StageCapacity(self.config.stage, result, list(mbs))

    def timing(self, phases: RankPhases, fit: StageCapacity) -> Timed:
        """The new types timed on the sparse grid beside the stored ranks' cheapest batch."""
        lookup, mine = self.lookup, self.lookup.entries.get(phases.device.device_type)
        per_rank = [[1] if t in lookup.entries else timing_batches(m, TimingGrid.SPARSE)
                    for t, m in zip(lookup.cluster, fit.mbs)]
        stored = None if mine is None else [p for p in mine.rank.points if p.batch <= mine.rank.mbs]
        profile = phases.timed_profile(fit, per_rank, warmup=False, confirm=Confirmation.CURVE,
                                       exposure=ExposureRounds.GRID,
                                       own_points=None if stored is None else lambda timed: stored)
        return Timed(phases.job, fit, profile)

    def finish(self, phases: RankPhases, profile: Profile, past_mbs_s: float) -> Profile:
        return replace(profile, store=StoreRecord(reused=sorted(self.lookup.entries), profiled=self.lookup.new_types))
