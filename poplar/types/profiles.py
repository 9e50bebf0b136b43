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
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from poplar.types.plans import read_json, shard_weights_problem, write_text_atomic
from poplar.types.route import Collectives, read_collectives
from poplar.types.topology import Topology, TopologyError


class ProfileError(ValueError):
    """A profile that cannot be used, with the reason and the fix in its message."""


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


# The profile format's version, written in every profile and store entry. Bumped when the format
# or the profiler's measurement changes, so that a stored profile measured by another profiler is
# measured again rather than reused. 1: the format before typed records (no ``schema_version``
# on disk: flat ``exposed_*`` fields and a ``meta`` dict), which ``from_schema_1`` converts.
# 2: one flat link (``Links`` without tiers), read as it is: a job on one node. 3: links per tier
# where the job spans nodes (``Links.topology``, ``intra``, ``cross``).
PROFILE_SCHEMA = 3
READABLE_SCHEMAS = (1, 2, PROFILE_SCHEMA)


@dataclass(frozen=True)
class LinkSpeed:
    """One fitted link: seconds ~= ``latency_s`` + bus bytes / ``bandwidth_bytes_per_s``."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0


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
            used = [x for x, n in zip(intra, topology.sizes) if n > 1] + [cross]
            flat = LinkSpeed(min(x.bandwidth_bytes_per_s for x in used), max(x.latency_s for x in used))
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


@dataclass
class Measurement:
    """How the profile was measured: diagnostics for a reader; the planner reads none of it."""

    requested_stage: int | None = None  # the stage asked for (``Profile.zero_stage``: the one that fitted)
    escalations: list[Escalation] = field(default_factory=list)
    seconds: float = 0.0  # the run's wall time in the ranks, from their set-up
    timing_rounds: int = 0
    repeats: int = 0
    overflowing_trials: int = 0  # fp16 trial steps and rounds skipped for an overflow, all ranks
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: its capacity search's notes
    past_mbs: PastMbs | None = None

    def __post_init__(self) -> None:
        self.escalations = [e if isinstance(e, Escalation) else Escalation(**e) for e in self.escalations]
        if isinstance(self.past_mbs, dict):
            self.past_mbs = PastMbs(**self.past_mbs)


@dataclass(frozen=True)
class AutoChoice:
    """Auto mode's choice of configuration, made on this profile (``poplar.auto.choice``)."""

    rule: str  # "fastest" or "first_fit"
    candidates: list[dict[str, Any]]  # the candidate table (``Candidate.to_dict``), chosen row marked
    profiling_s: dict[str, float] = field(default_factory=dict)  # capacity_s, timing_s, comm_s
    timed: int = 0
    probed: int = 0
    timing_rounds: int = 0
    # the capacity searches run again with short ranks' optimizers offloaded: configuration, ranks, offload
    offload_escalations: list[dict[str, Any]] = field(default_factory=list)


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
        self.auto_choice = _record(self.auto_choice, AutoChoice, "auto_choice")
        self.validate()

    def check_types(self) -> None:
        """Every field has its JSON type; a ``ProfileError`` names the first one that does not."""
        for name in ("zero_stage", "world_size", "param_count", "param_bytes"):
            _check(getattr(self, name), name, int)
        for i, r in enumerate(self.ranks):
            where = f"ranks[{i}]"
            for name in ("rank", "mbs", "trial_steps"):
                _check(getattr(r, name), f"{where}.{name}", int)
            _check(r.device_type, f"{where}.device_type", str)
            _check(r.capacity_bytes, f"{where}.capacity_bytes", int, optional=True)
            for name in ("base_bytes", "bytes_per_sample", "shard_bytes", "nominal_tflops"):
                _check(getattr(r, name), f"{where}.{name}", float, optional=True)
            cost = r.offload_cost
            if cost is not None:
                _require(isinstance(cost, OffloadCost), f"{where}.offload_cost", cost, "an object or null")
                for name in ("d2h_bytes_per_s", "h2d_bytes_per_s", "host_step_s_per_element",
                             "state_bytes_per_element", "master_bytes_per_element"):
                    _check(getattr(cost, name), f"{where}.offload_cost.{name}", float)
                _require(cost.d2h_bytes_per_s > 0 and cost.h2d_bytes_per_s > 0 and cost.host_step_s_per_element >= 0
                         and cost.state_bytes_per_element >= 0 and cost.master_bytes_per_element >= 0,
                         f"{where}.offload_cost", cost, "bandwidths > 0 and the rest >= 0")
            for name in ("points", "points_past_mbs"):
                for j, pt in enumerate(getattr(r, name)):
                    _check(pt.batch, f"{where}.{name}[{j}].batch", int)
                    _check(pt.compute_s, f"{where}.{name}[{j}].compute_s", float)
                    _check(pt.comm_s, f"{where}.{name}[{j}].comm_s", float)
        links, exposure = self.comm.links, self.comm.exposure
        _check(links.bandwidth_bytes_per_s, "comm.links.bandwidth_bytes_per_s", float)
        _check(links.latency_s, "comm.links.latency_s", float)
        for name in ("micro_step_s", "iteration_s", "switch_s", "overhead_s", "error"):
            _check(getattr(exposure, name), f"comm.exposure.{name}", float, optional=True)
        for i, led in enumerate(exposure.leaders):
            _check(led.device_type, f"comm.exposure.leaders[{i}].device_type", str)
            for name in ("micro_step_s", "iteration_s", "small_lead", "micro_step_small_lead_s",
                         "iteration_small_lead_s"):
                _check(getattr(led, name), f"comm.exposure.leaders[{i}].{name}", float, optional=True)
        at = exposure.step_compute_s
        for name in ("step_s", "end_s"):  # each level's exposure, beside its compute (end_s may be absent)
            level = getattr(exposure, name)
            if level is not None or (name == "step_s" and at is not None):
                _require(isinstance(at, tuple) and isinstance(level, tuple) and len(at) == len(level),
                         f"comm.exposure.step_compute_s / {name}", (at, level), "two lists of equal length")
                for j, (x, y) in enumerate(zip(at, level)):
                    _check(x, f"comm.exposure.step_compute_s[{j}]", float)
                    _check(y, f"comm.exposure.{name}[{j}]", float)

    def validate(self) -> None:
        self.check_types()
        if not self.ranks:
            raise ProfileError("profile has no ranks; run `poplar profile` on the cluster first")
        if self.world_size != len(self.ranks):
            raise ProfileError(f"profile says world_size={self.world_size} but lists {len(self.ranks)} ranks")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ProfileError(f"profile zero_stage must be 0-3, got {self.zero_stage}")
        for r in self.ranks:
            if r.mbs < 1:
                raise ProfileError(
                    f"rank {r.rank} ({r.device_type}) fits no batch (mbs={r.mbs}) at stage {self.zero_stage}; "
                    "profile at a higher ZeRO stage or leave this rank out")
            if not r.points:
                raise ProfileError(f"rank {r.rank} ({r.device_type}) has no timed points; re-run the profiler")
            for p in r.points:
                if p.batch < 1 or p.batch > r.mbs or not p.compute_s > 0:
                    raise ProfileError(
                        f"rank {r.rank}: bad point batch={p.batch}, compute_s={p.compute_s} "
                        f"(need 1 <= batch <= mbs={r.mbs} and compute_s > 0)")
            for p in r.points_past_mbs:
                if p.batch <= r.mbs or not p.compute_s > 0:
                    raise ProfileError(
                        f"rank {r.rank}: bad point past mbs batch={p.batch}, compute_s={p.compute_s} "
                        f"(need batch > mbs={r.mbs} and compute_s > 0)")
        if self.shard_weights is not None:
            problem = shard_weights_problem(self.shard_weights)
            if problem is not None or len(self.shard_weights) != self.world_size:
                raise ProfileError(f"profile shard_weights must be one weight per rank ({self.world_size}): "
                                   f"{problem or self.shard_weights}; re-run the profiler")
        if self.offloads is not None and (not isinstance(self.offloads, list) or len(self.offloads) != self.world_size
                                          or any(o not in ("none", "optimizer") for o in self.offloads)):
            raise ProfileError(f"profile offloads must be one of \"none\" / \"optimizer\" per rank ({self.world_size}), "
                               f"got {self.offloads!r}; re-run the profiler")
        if not self.comm.links.bandwidth_bytes_per_s > 0:
            raise ProfileError(f"comm bandwidth must be > 0, got {self.comm.links.bandwidth_bytes_per_s}")
        self._validate_tiers()
        error = self.comm.exposure.error
        if error is not None and not 0 <= error < 1:
            raise ProfileError(f"comm.exposure.error must be a fraction in [0, 1), got {error}; re-run the profiler")
        for led in self.comm.exposure.leaders:
            if led.small_lead is not None and not 0 <= led.small_lead < 1:
                raise ProfileError(f"comm.exposure small_lead of {led.device_type!r} must be a fraction in [0, 1), "
                                   f"got {led.small_lead}; re-run the profiler")

    def _validate_tiers(self) -> None:
        links = self.comm.links
        if links.topology is None:
            if links.intra or links.cross is not None:
                raise ProfileError("comm.links has intra-node or cross-node links but no topology; re-run the profiler")
            return
        problem = links.topology.problem(self.world_size)
        if problem is not None:
            raise ProfileError(f"comm.links.topology: {problem}; re-run the profiler")
        if len(links.intra) != links.topology.node_count or (links.topology.spans_nodes and links.cross is None):
            raise ProfileError(f"comm.links needs one intra-node link per node of {links.topology.describe()} "
                               "and a cross-node link; re-run the profiler")
        for where, x in [(f"intra[{k}]", x) for k, x in enumerate(links.intra)] + [("cross", links.cross)]:
            if x is not None and not (x.bandwidth_bytes_per_s > 0 and x.latency_s >= 0):
                raise ProfileError(f"comm.links.{where} must have bandwidth > 0 and latency >= 0, got {x}; "
                                   "re-run the profiler")

    def device_types(self) -> list[str]:
        """Distinct device types, in order of first appearance."""
        return list(dict.fromkeys(r.device_type for r in self.ranks))

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": PROFILE_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "profile") -> "Profile":
        """The profile of a JSON object written by ``to_dict``. ``source`` names it in errors
        (a file path, say). A profile of another schema is refused: measure it again."""
        if not isinstance(d, dict):
            raise ProfileError(f"{source} must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version", 1)
        again = "profile the cluster again (`poplar profile`, or auto mode)"
        if version not in READABLE_SCHEMAS:
            raise ProfileError(f"{source} has profile schema {version}, this Poplar reads schemas "
                               f"{', '.join(map(str, READABLE_SCHEMAS))}; {again}")
        try:
            if version == 1:
                d = from_schema_1(d)
            d = {k: v for k, v in d.items() if k != "schema_version"}
            return cls(**d)
        except (TypeError, KeyError, AttributeError) as e:
            raise ProfileError(f"malformed {source} (schema {version}): {e}; {again}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Profile":
        d = read_json(path, "profile file", ProfileError, "; run `poplar profile` first")
        return cls.from_dict(d, source=f"profile file {path}")


def _require(ok: bool, where: str, value: Any, what: str) -> None:
    if not ok:
        raise ProfileError(f"profile field {where} must be {what}, got {value!r} ({type(value).__name__})")


# the exposure fields of a schema-1 CommProfile, by their ``Exposure`` / ``LedExposure`` names
_SCHEMA_1_EXPOSURE = {"exposed_micro_step_s": "micro_step_s", "exposed_iteration_s": "iteration_s",
                      "exposed_step_compute_s": "step_compute_s", "exposed_step_s": "step_s",
                      "exposed_switch_s": "switch_s", "iteration_overhead_s": "overhead_s", "exposed_error": "error"}
_SCHEMA_1_LED = {"exposed_micro_step_lead_s": "micro_step_s", "exposed_iteration_lead_s": "iteration_s",
                 "exposed_small_lead": "small_lead", "exposed_micro_step_small_lead_s": "micro_step_small_lead_s",
                 "exposed_iteration_small_lead_s": "iteration_small_lead_s"}


def from_schema_1(d: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 profile (before typed records: flat ``exposed_*`` fields and a ``meta`` dict) as
    a schema-2 one. Every measured number has one place in the new records; ``meta``'s prose and
    diagnostics that have none are left out."""
    d = dict(d)
    comm = dict(_mapping(d.get("comm"), "comm"))
    links = {k: comm.pop(k) for k in ("bandwidth_bytes_per_s", "latency_s", "backend") if k in comm}
    exposure: dict[str, Any] = {new: comm.pop(old) for old, new in _SCHEMA_1_EXPOSURE.items() if old in comm}
    leaders: dict[str, dict[str, Any]] = {}
    for old, new in _SCHEMA_1_LED.items():
        for dtype, x in (comm.pop(old, None) or {}).items():
            leaders.setdefault(dtype, {"device_type": dtype})[new] = x
    exposure["leaders"] = list(leaders.values())
    d["comm"] = {**comm, "links": links, "exposure": exposure}
    legacy = dict(_mapping(d.pop("meta", None) or {}, "meta"))
    d["precision"] = legacy.get("precision", "fp32")
    d["mixed_precision"] = legacy.get("mixed_precision")
    d["activation_checkpointing"] = bool(legacy.get("activation_checkpointing"))
    emulated = None
    if legacy.get("emulated") or legacy.get("synthetic"):
        cluster = legacy.get("cluster")
        emulated = Emulated(memory_scale=legacy["memory_scale"], time_scale=legacy.get("time_scale"),
                            cluster=cluster.get("name", "") if isinstance(cluster, dict) else "",
                            synthetic=bool(legacy.get("synthetic")), calibration=legacy.get("calibration"))
    d["provenance"] = Provenance(schema_version=1, emulated=emulated)
    notes = legacy.get("ranks") or {}
    past = legacy.get("points_past_mbs")
    d["measurement"] = Measurement(
        requested_stage=legacy.get("requested_stage"),
        escalations=[Escalation(e["from"], e["to"], e["ranks"], e.get("reasons", {}), e.get("offload"))
                     for e in legacy.get("escalations", [])],
        seconds=legacy.get("seconds", 0.0), timing_rounds=legacy.get("timing_rounds", 0),
        repeats=legacy.get("repeats", 0), overflowing_trials=legacy.get("overflowing_trials", 0),
        ranks=[notes[k] for k in sorted(notes, key=int)],
        past_mbs=PastMbs(past["shard_weights"], past["batches"], past.get("seconds", 0.0)) if past else None)
    choice = legacy.get("auto_choice")
    if choice:
        d["auto_choice"] = AutoChoice(choice["rule"], choice["candidates"], choice.get("profiling_s", {}),
                                      choice.get("timed", 0), choice.get("probed", 0), choice.get("timing_rounds", 0),
                                      choice.get("offload_escalations", []))
    return d


def _record(value: Any, kind: type, where: str) -> Any:
    """``value`` as a ``kind`` record: itself, or built from its JSON object (None stays None)."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(**_mapping(value, where))
    except TypeError as e:
        raise ProfileError(f"profile field {where} is malformed: {e}; re-run the profiler") from None


def _mapping(value: Any, where: str) -> dict[str, Any]:
    _require(isinstance(value, dict), where, value, "an object")
    return value


def _check(value: Any, where: str, kind: type, optional: bool = False) -> None:
    """``value`` is a ``kind`` (an int for float fields too; never a bool), or None if optional."""
    if value is None and optional:
        return
    kinds = (int, float) if kind is float else (kind,)
    what = {int: "an integer", float: "a number", str: "a string"}[kind] + (" or null" if optional else "")
    _require(isinstance(value, kinds) and not isinstance(value, bool), where, value, what)
