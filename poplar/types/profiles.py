"""Profiles: what the profiler measured on each rank, as the planner reads it (JSON on disk).

One ``RankProfile`` per rank: its device type, memory capacity, largest micro-batch ``mbs``
and timed points (batch, compute seconds with communication subtracted, communication
seconds). ``CommProfile`` holds the fitted link (``Links``) used to predict the communication
time of a plan and the measured ``Exposure``. Ranks with the same ``device_type`` share one
speed curve. ``Provenance`` says where the profile comes from (schema, torch and Poplar
versions, the emulator's scales), ``Measurement`` how it was measured. On disk every profile
carries ``schema_version`` (``PROFILE_SCHEMA``); one of another schema is refused with a
``ProfileError`` that names it and says to profile again.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, Sequence

import numpy as np

from poplar.types import profile_json
from poplar.types.configuration import CandidateRow
from poplar.types.errors import ProfileError
from poplar.types.plans import read_json, write_text_atomic
from poplar.types.profile_json import PROFILE_SCHEMA, mapping as _mapping, record as _record, require as _require
from poplar.types.profile_json import READABLE_SCHEMAS  # noqa: F401  (importable from here, as before)
from poplar.types.route import Collectives, read_collectives
from poplar.types.topology import Topology, TopologyError


@dataclass
class ProfilePoint:
    batch: int
    compute_s: float  # compute time of one micro-step, communication subtracted
    comm_s: float = 0.0  # seconds spent inside collectives during that micro-step


@dataclass
class OffloadCost:
    """What keeping this rank's optimizer in host memory costs, as the profiler measured it: the
    copies' bandwidth both ways, the host optimizer step per parameter element (the user's
    optimizer class and settings on a CPU fp32 tensor), and the device bytes per parameter element
    that leave the device (its optimizer state, and its fp32 master under mixed precision)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_step_s_per_element: float
    state_bytes_per_element: float
    master_bytes_per_element: float = 0.0


@dataclass
class RankProfile:
    rank: int
    device_type: str
    mbs: int  # largest micro-batch that fits at this stage
    points: list[ProfilePoint]
    device_name: str = ""
    capacity_bytes: int | None = None
    base_bytes: int | None = None  # memory in use before a forward (model states etc.)
    bytes_per_sample: float | None = None
    shard_bytes: int | None = None  # its share of the sharded state at even shards (moves with a shard weight)
    nominal_tflops: float | None = None  # spec-sheet rating, used only by the `flops` baseline
    trial_steps: int = 0  # real steps the capacity search ran
    offload_cost: OffloadCost | None = None  # None: not measured (profiles from before offload)
    # timed above mbs, at shard weights that gave this rank the room (``profiler.shard_room``):
    # what its curve is there when a plan's weights let it run those batches
    points_past_mbs: list[ProfilePoint] = field(default_factory=list)
    device_identity: str = ""  # its name and total capacity (``Device.identity``): what the profile store checks

    def __post_init__(self) -> None:
        self.points = [p if isinstance(p, ProfilePoint) else ProfilePoint(**p) for p in self.points]
        self.points_past_mbs = [p if isinstance(p, ProfilePoint) else ProfilePoint(**p) for p in self.points_past_mbs]
        if isinstance(self.offload_cost, dict):
            try:
                self.offload_cost = OffloadCost(**self.offload_cost)
            except TypeError as e:
                raise ProfileError(f"rank {self.rank}: malformed offload_cost: {e}; re-run the profiler") from None

    def at_mbs(self, mbs: int) -> "RankProfile":
        """This rank with its largest micro-batch ``mbs`` (a shard or a subset moved its room):
        the points past it move to ``points_past_mbs``, those timed past it that fit now join the
        points. A point that no longer fits is still this device's compute at that batch, which
        its curve interpolates toward (Note: an mbs between measured batches, planner/curves.py)."""
        points = self.points + self.points_past_mbs
        return replace(self, mbs=mbs, points=[p for p in points if p.batch <= mbs],
                       points_past_mbs=sorted([p for p in points if p.batch > mbs], key=lambda p: p.batch))



@dataclass(frozen=True)
class LinkSpeed:
    """One fitted link: seconds ~= ``latency_s`` + bus bytes / ``bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


def slowest_tier(intra: Sequence[LinkSpeed], sizes: Sequence[int], cross: LinkSpeed) -> LinkSpeed:
    """The link a flat ring over nodes of ``sizes`` ranks (node k on ``intra[k]``, the nodes joined
    by ``cross``) runs at where it was not measured: the slowest bandwidth and the largest latency
    of the tiers it crosses (a node's link where it has more than one rank, and the cross-node
    link), since a ring runs at the pace of its slowest hop."""
    used = [x for x, n in zip(intra, sizes) if n > 1] + [cross]
    return LinkSpeed(min(x.bandwidth_bytes_per_s for x in used), max(x.latency_s for x in used))


@dataclass(frozen=True)
class Links:
    """The fitted collective links, on ``backend``.

    ``bandwidth_bytes_per_s`` and ``latency_s`` are the flat link: a collective over every rank
    of the job as one ring (``bus_bytes``). A job on one node has that link alone (``topology``
    None, no tiers). A job whose ``topology`` spans nodes has tiers as well: ``intra``, one link
    per node (its ranks' collectives, in node order; a node of one rank has a link that is never
    used), and ``cross``, the link between nodes (collectives among one rank per node). There the
    flat link is the ring over every rank as measured, or, where it was not measured, the slowest
    of the tiers (``Links.tiered``): a flat ring runs at the pace of the slowest hop it crosses."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    backend: str = ""
    topology: Topology | None = None  # None: one node
    intra: tuple[LinkSpeed, ...] = ()  # one per node of ``topology``
    cross: LinkSpeed | None = None

    @property
    def spans_nodes(self) -> bool:
        return self.topology is not None and self.topology.spans_nodes

    @property
    def flat(self) -> LinkSpeed:
        return LinkSpeed(self.bandwidth_bytes_per_s, self.latency_s)

    def describe(self) -> list[str]:
        """One line per link: the flat ring, and on a job that spans nodes each node's and the cross-node one."""
        def line(name: str, x: LinkSpeed) -> str:
            return f"{name}: bus bandwidth {x.bandwidth_bytes_per_s / 1e9:.3f} GB/s, latency {x.latency_s * 1e6:.0f} us"

        lines = [line(f"collectives ({self.backend})", self.flat)]
        if self.topology is not None and self.spans_nodes:
            lines += [line(f"  node {k} (ranks {node[0]}-{node[-1]})", x) if len(node) > 1 else
                      f"  node {k} (rank {node[0]}): no link inside"
                      for k, (node, x) in enumerate(zip(self.topology.nodes, self.intra))]
            lines.append(line("  between nodes", self.cross))  # type: ignore[arg-type]
        return lines

    @classmethod
    def tiered(cls, topology: Topology, intra: Sequence[LinkSpeed], cross: LinkSpeed | None, backend: str = "",
               flat: LinkSpeed | None = None) -> "Links":
        """The links of a job on ``topology``; ``flat``: the ring over every rank, as measured (None:
        the slowest tier's bandwidth with the largest tier latency). One node: that node's link."""
        intra = tuple(intra)
        if len(intra) != topology.node_count:
            raise ProfileError(f"links: {len(intra)} intra-node links for {topology.describe()}; give one per node")
        if not topology.spans_nodes:
            return cls(intra[0].bandwidth_bytes_per_s, intra[0].latency_s, backend)
        if cross is None:
            raise ProfileError(f"links: {topology.describe()} spans nodes and needs a cross-node link")
        if flat is None:
            flat = slowest_tier(intra, topology.sizes, cross)
        return cls(flat.bandwidth_bytes_per_s, flat.latency_s, backend, topology, intra, cross)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Links":
        """The links of a JSON object (``asdict``'s); a flat link alone (schemas 1 and 2) is one node."""
        d = dict(_mapping(d, "comm.links"))
        topology = d.pop("topology", None)
        intra = d.pop("intra", [])
        cross = d.pop("cross", None)
        _require(isinstance(intra, (list, tuple)), "comm.links.intra", intra, "a list of links")
        try:
            nodes = None if topology is None else Topology.from_json(_mapping(topology, "comm.links.topology"))
            return cls(**d, topology=nodes,
                       intra=tuple(LinkSpeed(**_mapping(x, f"comm.links.intra[{i}]")) for i, x in enumerate(intra)),
                       cross=None if cross is None else LinkSpeed(**_mapping(cross, "comm.links.cross")))
        except TopologyError as e:
            raise ProfileError(f"profile field comm.links.topology: {e}") from None


@dataclass(frozen=True)
class LedExposure:
    """What one leading device type changes in the exposure: measured in its led rounds (it at
    the balanced compute, the others at half of it: ``LED_ROUNDS_LEAD``) and in its small led
    rounds (the others at 85 %: ``SMALL_LEAD``, at the lead they actually ran, ``small_lead``).
    A value is None where those rounds did not run."""

    device_type: str
    micro_step_s: float | None = None  # a micro-step's exposed communication, led by this type
    iteration_s: float | None = None  # the iteration's closing collectives, led by this type
    small_lead: float | None = None  # the measured median lead of its small led rounds
    micro_step_small_lead_s: float | None = None
    iteration_small_lead_s: float | None = None


class Carry(NamedTuple):
    """How a measured exposure carries to the same steps' collectives run another way (Note: an
    exposure carried): the new serial seconds over the measured ones (``ratio``), and the measured
    less the new (``saved_s``)."""

    ratio: float = 1.0
    saved_s: float = 0.0

    @classmethod
    def between(cls, new_s: float, measured_s: float, keep_seconds: bool = True) -> "Carry":
        """From the serial seconds of the collectives run the new way and as measured; without
        ``keep_seconds``, the fraction alone (scaled, never moved)."""
        if not measured_s > 0:
            return cls()
        return cls(new_s / measured_s, measured_s - new_s if keep_seconds else -math.inf)

    def of(self, exposed: Any) -> Any:
        """An exposed time (a number, or a numpy array of them) carried: the smaller of it scaled
        by ``ratio`` and moved by ``saved_s``, none below zero."""
        if self.ratio == 1.0 and self.saved_s == 0.0:  # as measured (the cost model's hot path)
            return exposed
        scaled, moved = exposed * self.ratio, exposed - self.saved_s
        if isinstance(exposed, np.ndarray):
            return np.maximum(np.minimum(scaled, moved), 0.0)
        return max(min(scaled, moved), 0.0)


# [Note: an exposure carried]
# A profile's exposure is what compute did not hide of the collectives as they ran when it was
# measured. The same steps with their collectives run another way (another route or a quantized
# one, ``CommModel.priced_as``; a subset's ranks on its own links, ``participation.on_ranks``) are
# priced from it, not from the formulas alone, which add every collective to the compute. Where
# the new collectives take fewer serial seconds, the same compute hides at least the seconds it
# hid (as much of them as there is) and at least the fraction it hid, so the exposure is at most
# the measured one moved by the seconds saved and at most it scaled by the serial ratio: each
# exposed value is carried as the smaller (``Carry.of``), none below zero. The two bounds bind
# in different places: the prefetched gathers of ZeRO-3, where much is hidden, keep the seconds;
# ZeRO-2's closing reduce-scatter, exposed more than its serial seconds, the fraction. Where the
# new collectives take more, the smaller is the scaled value wherever the measured exposure is
# within its serial seconds. Quantized collectives keep the fraction alone: their conversion runs
# on the device beside the compute that hid the exact ones, so the seconds that compute hid are
# not known to stay free for them, and no run has measured it. On the emulated C-4+4 and A-4+4
# (docs/experiments.md, 2026-11-29) the carried exposure priced crossing once per iteration -0.6
# to +2.3 % of what it ran in eleven rows (scaled alone up to +4.7 %), and 4-rank subsets -0.6
# to +0.4 % in 40 (scaled alone up to +3.1 % at ZeRO-3, moved alone up to +5.1 % at ZeRO-2;
# 2026-11-29 and 2026-11-30).


@dataclass(frozen=True)
class Exposure:
    """What of the collectives compute did not hide, measured at ``CommProfile.collectives_stage``
    on the critical rank (``poplar.profiler.exposure.exposed_costs``). None: not measured."""

    micro_step_s: float | None = None  # balanced: every rank finishing its micro-step together
    iteration_s: float | None = None  # the iteration's closing collectives, balanced
    # balanced exposure of shorter (and longer) steps: at each compute (ascending), this much in the
    # micro-step, and at the iteration's end (``end_s``: at stages 0/1 it overlaps the last micro-step)
    step_compute_s: tuple[float, ...] | None = None
    step_s: tuple[float, ...] | None = None
    switch_s: float | None = None  # more per micro-step whose batches differ from the step before
    leaders: tuple[LedExposure, ...] = ()  # one per device type that led rounds
    overhead_s: float | None = None  # the optimizer step and the rest outside micro-steps
    # how well the steady rounds knew their exposure: the largest standard error of a
    # configuration's median, as a fraction of its round time (None: no steady rounds)
    error: float | None = None
    end_s: tuple[float, ...] | None = None  # the iteration's end at each ``step_compute_s`` (above)

    def per_leader(self, name: str) -> dict[str, float] | None:
        """``LedExposure.<name>`` of every leader that has it, by device type (None: none has)."""
        found = {x.device_type: getattr(x, name) for x in self.leaders if getattr(x, name) is not None}
        return found or None

    def only_leaders(self, device_types: list[str]) -> "Exposure":
        """This exposure with the leaders of these device types only."""
        return replace(self, leaders=tuple(x for x in self.leaders if x.device_type in device_types))

    def carried(self, micro_step: Carry, iteration: Carry) -> "Exposure":
        """This exposure carried to collectives run another way (Note: an exposure carried):
        every micro-step value by ``micro_step``, every value of the iteration's closing
        collectives by ``iteration``; the switch's extra (a difference of two exposures) scaled by
        the micro-step's ratio; the lead, the overhead and the error as they are."""
        def step(v: float | None) -> float | None:
            return None if v is None else micro_step.of(v)

        def end(v: float | None) -> float | None:
            return None if v is None else iteration.of(v)
        leaders = tuple(replace(x, micro_step_s=step(x.micro_step_s), iteration_s=end(x.iteration_s),
                                micro_step_small_lead_s=step(x.micro_step_small_lead_s),
                                iteration_small_lead_s=end(x.iteration_small_lead_s)) for x in self.leaders)
        return replace(self, micro_step_s=step(self.micro_step_s), iteration_s=end(self.iteration_s),
                       step_s=None if self.step_s is None else tuple(micro_step.of(v) for v in self.step_s),
                       end_s=None if self.end_s is None else tuple(iteration.of(v) for v in self.end_s),
                       switch_s=None if self.switch_s is None else self.switch_s * micro_step.ratio,
                       leaders=leaders)


@dataclass
class CommProfile:
    """Measured collective performance: the fitted link (``links``); which collectives the engine
    issued at ``collectives_stage`` while it was timed, as ``[op, bytes]`` pairs: those of one
    micro-step (``micro_step``) and those of the iteration's end (``iteration``); and what of them
    compute did not hide (``exposure``), with the iteration's fixed overhead, as the collectives
    ran then (``collectives``: flat, hierarchical, or with secondary shards). The cost model uses
    these when it plans at that stage."""

    links: Links
    collectives_stage: int | None = None
    micro_step: list[list] = field(default_factory=list)
    iteration: list[list] = field(default_factory=list)
    exposure: Exposure = field(default_factory=Exposure)
    collectives: Collectives = Collectives.FLAT  # the way they ran then; the planner prices others from it

    def __post_init__(self) -> None:
        self.collectives = Collectives.named(self.collectives, ProfileError)
        if isinstance(self.links, dict):
            self.links = Links.from_json(self.links)
        _require(isinstance(self.links, Links), "comm.links", self.links, "an object")
        if isinstance(self.exposure, dict):
            d = dict(self.exposure)
            d.update({n: tuple(d[n]) for n in ("step_compute_s", "step_s", "end_s") if isinstance(d.get(n), list)})
            leaders = d.get("leaders", [])
            _require(isinstance(leaders, (list, tuple)), "comm.exposure.leaders", leaders, "a list of objects")
            d["leaders"] = tuple(x if isinstance(x, LedExposure) else LedExposure(
                **_mapping(x, f"comm.exposure.leaders[{i}]")) for i, x in enumerate(leaders))
            self.exposure = Exposure(**d)
        _require(isinstance(self.exposure, Exposure), "comm.exposure", self.exposure, "an object")


@dataclass(frozen=True)
class Emulated:
    """The emulator's scales a profile was measured at (``poplar.emulation``): what a real
    cluster of those devices would measure is this profile with the scales undone."""

    memory_scale: float
    time_scale: float | None = None  # None: a synthetic profile, computed without timing
    cluster: str = ""  # the emulated cluster's name
    synthetic: bool = False  # computed from presets, not measured
    calibration: dict[str, Any] | None = None  # how the scales were calibrated (the emulator's record)


@dataclass(frozen=True)
class Provenance:
    """Where a profile comes from. Each rank's device name and capacity are in its
    ``RankProfile`` (``device_name``, ``capacity_bytes``)."""

    schema_version: int = PROFILE_SCHEMA
    torch_version: str = ""
    poplar_version: str = ""
    emulated: Emulated | None = None  # None: measured on real devices


@dataclass(frozen=True)
class Escalation:
    """A configuration the capacity search left because batch 1 did not fit ``ranks`` there:
    a higher stage (``to_stage`` > ``from_stage``) or the same stage with ``offload``."""

    from_stage: int
    to_stage: int
    ranks: list[int]
    reasons: dict[str, str] = field(default_factory=dict)  # rank -> why batch 1 did not fit
    offload: list[str] | None = None  # every rank's placement searched next (same stage)


@dataclass(frozen=True)
class PastMbs:
    """Where the timing past mbs ran (``profiler.shard_room``): the shard weights and each rank's batches."""

    shard_weights: list[float]
    batches: list[list[int]]
    seconds: float = 0.0


@dataclass(frozen=True)
class OomRecord:
    """An out-of-memory trial step of the capacity search and what the release left: the memory in
    use before the step and after it was released, and at ZeRO-3 the gathered parameter bytes."""

    batch: int
    message: str
    memory_before: int
    memory_after: int
    gathered_before: int
    gathered_after: int
    at: dict[str, Any] | None = None  # a virtual device's view at the failure: where, saved, gathered bytes
    rebuilt: bool = False  # the runtime did not clean up after the OOM and was rebuilt


@dataclass(frozen=True)
class CapacityNotes:
    """One rank's capacity search and timing as they ran: diagnostics for a reader."""

    estimate: int | None = None  # Algorithm 1's bound from batch 1
    trials: tuple[tuple[int, bool], ...] = ()  # (batch, fitted) in order
    trial_budget: int | None = None
    trial_steps_per_stage: dict[str, int] = field(default_factory=dict)
    state_bytes: int | None = None
    capped: bool = False  # every batch up to the search's largest fitted
    oom_events: tuple[OomRecord, ...] = ()
    device: str = ""
    timing_comm_s: float = 0.0
    overflowing_trials: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, value: Any, where: str) -> "CapacityNotes":
        """The notes of a JSON object (fields another profiler wrote and this one does not: left out)."""
        if isinstance(value, cls):
            return value
        d = {k: v for k, v in _mapping(value, where).items() if k in _NOTES}
        d["trials"] = tuple(tuple(t) for t in d.get("trials", ()))
        d["oom_events"] = tuple(_record(e, OomRecord, f"{where}.oom_events[{i}]")
                                for i, e in enumerate(d.get("oom_events", ())))
        return cls(**d)


_NOTES = frozenset(CapacityNotes.__dataclass_fields__)


@dataclass
class Measurement:
    """How the profile was measured: diagnostics for a reader; the planner reads none of it."""

    requested_stage: int | None = None  # the stage asked for (``Profile.zero_stage``: the one that fitted)
    escalations: list[Escalation] = field(default_factory=list)
    seconds: float = 0.0  # the run's wall time in the ranks, from their set-up
    timing_rounds: int = 0
    repeats: int = 0
    overflowing_trials: int = 0  # fp16 trial steps and rounds skipped for an overflow, all ranks
    ranks: list[CapacityNotes] = field(default_factory=list)  # per rank: its capacity search's notes
    past_mbs: PastMbs | None = None

    def __post_init__(self) -> None:
        self.escalations = [e if isinstance(e, Escalation) else Escalation(**e) for e in self.escalations]
        self.ranks = [CapacityNotes.read(x, f"measurement.ranks[{i}]") for i, x in enumerate(self.ranks)]
        if isinstance(self.past_mbs, dict):
            self.past_mbs = PastMbs(**self.past_mbs)


@dataclass(frozen=True)
class OffloadSearch:
    """A configuration's capacity searched again with the optimizer of ``ranks`` offloaded to host
    memory (``offload``: every rank's placement, the values of ``Offload``), by auto mode."""

    configuration: str
    ranks: list[int]
    offload: list[str]


@dataclass(frozen=True)
class AutoChoice:
    """Auto mode's choice of configuration, made on this profile (``poplar.auto.choice``)."""

    rule: str  # "fastest" or "first_fit"
    candidates: tuple[CandidateRow, ...]  # the candidate table, the chosen row marked
    profiling_s: dict[str, float] = field(default_factory=dict)  # capacity_s, timing_s, comm_s
    timed: int = 0
    probed: int = 0
    timing_rounds: int = 0
    # the capacity searches run again with short ranks' optimizers offloaded
    offload_escalations: tuple[OffloadSearch, ...] = ()

    @classmethod
    def read(cls, value: Any) -> "AutoChoice | None":
        """The choice of a JSON object (itself, or None, as it is)."""
        if value is None or isinstance(value, cls):
            return value
        d = dict(_mapping(value, "auto_choice"))
        candidates = d.get("candidates", ())
        _require(isinstance(candidates, (list, tuple)), "auto_choice.candidates", candidates, "a list of rows")
        d["candidates"] = tuple(_record(c, CandidateRow, f"auto_choice.candidates[{i}]")
                                for i, c in enumerate(candidates))
        d["offload_escalations"] = tuple(_record(x, OffloadSearch, f"auto_choice.offload_escalations[{i}]")
                                         for i, x in enumerate(d.get("offload_escalations", ())))
        return _record(d, cls, "auto_choice")


@dataclass(frozen=True)
class StoreRecord:
    """What of the profile came from the profile store (``poplar.profiler.store``)."""

    reused: list[str]  # device types whose parts came from the store
    profiled: list[str] = field(default_factory=list)  # device types measured by this run
    comm_from: list[str] | None = None  # the cluster of the run whose communication profile was taken


@dataclass
class Profile:
    zero_stage: int
    world_size: int
    param_count: int  # Ψ, parameters of the model
    param_bytes: int  # bytes of one full copy of the parameters
    ranks: list[RankProfile]
    comm: CommProfile
    model_name: str = ""
    # the shard weights every rank was measured at (its mbs and shard_bytes are theirs); None: even
    shard_weights: list[float] | None = None
    # where every rank's optimizer was while its mbs was measured ("none" / "optimizer", the values
    # of ``Offload``); None: on the device everywhere
    offloads: list[str] | None = None
    precision: str = "fp32"  # the precision the ranks computed in (``Precision``'s value)
    mixed_precision: dict[str, Any] | None = None  # the policy measured at (``MixedPrecision.to_dict``)
    activation_checkpointing: bool = False  # measured with activation checkpointing
    provenance: Provenance = field(default_factory=Provenance)
    measurement: Measurement = field(default_factory=Measurement)
    auto_choice: AutoChoice | None = None  # auto mode chose the configuration on this profile
    store: StoreRecord | None = None  # parts of it came from, or went to, the profile store

    def __post_init__(self) -> None:
        _require(isinstance(self.ranks, list), "ranks", self.ranks, "a list of rank profiles")
        for i, r in enumerate(self.ranks):
            if not isinstance(r, RankProfile):
                for name in ("points", "points_past_mbs"):
                    points = _mapping(r, f"ranks[{i}]").get(name, [])
                    _require(isinstance(points, list), f"ranks[{i}].{name}", points, "a list of points")
                    for j, point in enumerate(points):
                        _mapping(point, f"ranks[{i}].{name}[{j}]")
        self.ranks = [r if isinstance(r, RankProfile) else RankProfile(**r) for r in self.ranks]
        if isinstance(self.comm, dict):
            self.comm = CommProfile(**read_collectives(_mapping(self.comm, "comm"), ProfileError))  # older: two bools
        _require(isinstance(self.comm, CommProfile), "comm", self.comm, "an object")
        self.provenance = _record(self.provenance, Provenance, "provenance")
        if isinstance(self.provenance.emulated, dict):
            self.provenance = replace(self.provenance, emulated=Emulated(**self.provenance.emulated))
        self.measurement = _record(self.measurement, Measurement, "measurement")
        self.store = _record(self.store, StoreRecord, "store")
        self.auto_choice = AutoChoice.read(self.auto_choice)
        self.validate()

    def check_types(self) -> None:
        """Every field has its JSON type; a ``ProfileError`` names the first one that does not."""
        profile_json.check_types(self)

    def validate(self) -> None:
        """The field types and values a plan needs; a ``ProfileError`` names the first one at fault."""
        profile_json.validate(self)

    def device_types(self) -> list[str]:
        """Distinct device types, in order of first appearance."""
        return list(dict.fromkeys(r.device_type for r in self.ranks))

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": PROFILE_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "profile") -> "Profile":
        """The profile of a JSON object written by ``to_dict``. ``source`` names it in errors
        (a file path, say). A profile of another schema is refused: measure it again."""
        version = d.get("schema_version", 1) if isinstance(d, dict) else None
        try:
            version, fields_ = profile_json.readable(d, source)
            return cls(**fields_)
        except (TypeError, KeyError, AttributeError) as e:
            raise ProfileError(f"malformed {source} (schema {version}): {e}; {profile_json.AGAIN}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        d = read_json(path, "profile file", ProfileError, "; run `poplar profile` first")
        return cls.from_dict(d, source=f"profile file {path}")


