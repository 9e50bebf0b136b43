"""A profile's JSON reading: which schemas this Poplar reads and the schema-1 migration, the
checks a profile passes (every field of its JSON type, values in range), and the helpers that
name the field at fault. ``poplar.types.profiles`` holds the records; a ``ProfileError`` names the
field, what it must be, and says to profile again.
"""

from __future__ import annotations

from typing import Any

from poplar.types.errors import ProfileError
from poplar.types.plans import shard_weights_problem

# The profile format's version, written in every profile and store entry. Bumped when the format
# or the profiler's measurement changes, so that a stored profile measured by another profiler is
# measured again rather than reused. 1: the format before typed records (no ``schema_version``
# on disk: flat ``exposed_*`` fields and a ``meta`` dict), which ``from_schema_1`` converts.
# 2: one flat link (``Links`` without tiers), read as it is: a job on one node. 3: links per tier
# where the job spans nodes (``Links.topology``, ``intra``, ``cross``).
PROFILE_SCHEMA = 3
READABLE_SCHEMAS = (1, 2, PROFILE_SCHEMA)
AGAIN = "profile the cluster again (`poplar profile`, or auto mode)"
_OFFLOAD_COST = ("d2h_bytes_per_s", "h2d_bytes_per_s", "host_step_s_per_element", "state_bytes_per_element",
                 "master_bytes_per_element")


def readable(d: Any, source: str) -> tuple[int, dict[str, Any]]:
    """The schema of a profile's JSON object and its fields as the records read them (schema 1
    migrated); a ``ProfileError`` for another schema: measure it again."""
    if not isinstance(d, dict):
        raise ProfileError(f"{source} must be a JSON object, got {type(d).__name__}")
    version = d.get("schema_version", 1)
    if version not in READABLE_SCHEMAS:
        raise ProfileError(f"{source} has profile schema {version}, this Poplar reads schemas "
                           f"{', '.join(map(str, READABLE_SCHEMAS))}; {AGAIN}")
    if version == 1:
        d = from_schema_1(d)
    return version, {k: v for k, v in d.items() if k != "schema_version"}


def require(ok: bool, where: str, value: Any, what: str) -> None:
    """A ``ProfileError`` naming the field ``where`` unless ``ok``: it must be ``what``."""
    if not ok:
        raise ProfileError(f"profile field {where} must be {what}, got {value!r} ({type(value).__name__})")


def record(value: Any, kind: type, where: str) -> Any:
    """``value`` as a ``kind`` record: itself, or built from its JSON object (None stays None)."""
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(**mapping(value, where))
    except TypeError as e:
        raise ProfileError(f"profile field {where} is malformed: {e}; re-run the profiler") from None


def mapping(value: Any, where: str) -> dict[str, Any]:
    """``value``, a JSON object (else a ``ProfileError`` naming ``where``)."""
    require(isinstance(value, dict), where, value, "an object")
    return value


def check(value: Any, where: str, kind: type, optional: bool = False) -> None:
    """``value`` is a ``kind`` (an int for float fields too; never a bool), or None if optional."""
    if value is None and optional:
        return
    kinds = (int, float) if kind is float else (kind,)
    what = {int: "an integer", float: "a number", str: "a string"}[kind] + (" or null" if optional else "")
    require(isinstance(value, kinds) and not isinstance(value, bool), where, value, what)


def check_types(profile: Any) -> None:
    """Every field of a ``Profile`` has its JSON type; a ``ProfileError`` names the first one that does not."""
    for name in ("zero_stage", "world_size", "param_count", "param_bytes"):
        check(getattr(profile, name), name, int)
    for i, r in enumerate(profile.ranks):
        where = f"ranks[{i}]"
        for name in ("rank", "mbs", "trial_steps"):
            check(getattr(r, name), f"{where}.{name}", int)
        check(r.device_type, f"{where}.device_type", str)
        check(r.capacity_bytes, f"{where}.capacity_bytes", int, optional=True)
        for name in ("base_bytes", "bytes_per_sample", "shard_bytes", "nominal_tflops"):
            check(getattr(r, name), f"{where}.{name}", float, optional=True)
        cost = r.offload_cost
        if cost is not None:
            require(all(hasattr(cost, name) for name in _OFFLOAD_COST), f"{where}.offload_cost", cost,
                     "an object or null")
            for name in _OFFLOAD_COST:
                check(getattr(cost, name), f"{where}.offload_cost.{name}", float)
            require(cost.d2h_bytes_per_s > 0 and cost.h2d_bytes_per_s > 0 and cost.host_step_s_per_element >= 0
                     and cost.state_bytes_per_element >= 0 and cost.master_bytes_per_element >= 0,
                     f"{where}.offload_cost", cost, "bandwidths > 0 and the rest >= 0")
        for name in ("points", "points_past_mbs"):
            for j, pt in enumerate(getattr(r, name)):
                check(pt.batch, f"{where}.{name}[{j}].batch", int)
                check(pt.compute_s, f"{where}.{name}[{j}].compute_s", float)
                check(pt.comm_s, f"{where}.{name}[{j}].comm_s", float)
    links, exposure = profile.comm.links, profile.comm.exposure
    check(links.bandwidth_bytes_per_s, "comm.links.bandwidth_bytes_per_s", float)
    check(links.latency_s, "comm.links.latency_s", float)
    for name in ("micro_step_s", "iteration_s", "switch_s", "overhead_s", "error"):
        check(getattr(exposure, name), f"comm.exposure.{name}", float, optional=True)
    for i, led in enumerate(exposure.leaders):
        check(led.device_type, f"comm.exposure.leaders[{i}].device_type", str)
        for name in ("micro_step_s", "iteration_s", "small_lead", "micro_step_small_lead_s",
                     "iteration_small_lead_s"):
            check(getattr(led, name), f"comm.exposure.leaders[{i}].{name}", float, optional=True)
    at = exposure.step_compute_s
    for name in ("step_s", "end_s"):  # each level's exposure, beside its compute (end_s may be absent)
        level = getattr(exposure, name)
        if level is not None or (name == "step_s" and at is not None):
            require(isinstance(at, tuple) and isinstance(level, tuple) and len(at) == len(level),
                     f"comm.exposure.step_compute_s / {name}", (at, level), "two lists of equal length")
            for j, (x, y) in enumerate(zip(at, level)):
                check(x, f"comm.exposure.step_compute_s[{j}]", float)
                check(y, f"comm.exposure.{name}[{j}]", float)


def validate(profile: Any) -> None:
    """A ``Profile`` a plan can use: its field types, then its values (ranks, stage, points, shard
    weights, placements, links, exposure); a ``ProfileError`` names the first at fault and the fix."""
    check_types(profile)
    if not profile.ranks:
        raise ProfileError("profile has no ranks; run `poplar profile` on the cluster first")
    if profile.world_size != len(profile.ranks):
        raise ProfileError(f"profile says world_size={profile.world_size} but lists {len(profile.ranks)} ranks")
    if profile.zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"profile zero_stage must be 0-3, got {profile.zero_stage}")
    for r in profile.ranks:
        if r.mbs < 1:
            raise ProfileError(
                f"rank {r.rank} ({r.device_type}) fits no batch (mbs={r.mbs}) at stage {profile.zero_stage}; "
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
    if profile.shard_weights is not None:
        problem = shard_weights_problem(profile.shard_weights)
        if problem is not None or len(profile.shard_weights) != profile.world_size:
            raise ProfileError(f"profile shard_weights must be one weight per rank ({profile.world_size}): "
                               f"{problem or profile.shard_weights}; re-run the profiler")
    offloads = profile.offloads
    if offloads is not None and (not isinstance(offloads, list) or len(offloads) != profile.world_size
                                 or any(o not in ("none", "optimizer") for o in offloads)):
        raise ProfileError(f"profile offloads must be one of \"none\" / \"optimizer\" per rank ({profile.world_size}), "
                           f"got {profile.offloads!r}; re-run the profiler")
    if not profile.comm.links.bandwidth_bytes_per_s > 0:
        raise ProfileError(f"comm bandwidth must be > 0, got {profile.comm.links.bandwidth_bytes_per_s}")
    _validate_tiers(profile)
    error = profile.comm.exposure.error
    if error is not None and not 0 <= error < 1:
        raise ProfileError(f"comm.exposure.error must be a fraction in [0, 1), got {error}; re-run the profiler")
    for led in profile.comm.exposure.leaders:
        if led.small_lead is not None and not 0 <= led.small_lead < 1:
            raise ProfileError(f"comm.exposure small_lead of {led.device_type!r} must be a fraction in [0, 1), "
                               f"got {led.small_lead}; re-run the profiler")


def _validate_tiers(profile: Any) -> None:
    links = profile.comm.links
    if links.topology is None:
        if links.intra or links.cross is not None:
            raise ProfileError("comm.links has intra-node or cross-node links but no topology; re-run the profiler")
        return
    problem = links.topology.problem(profile.world_size)
    if problem is not None:
        raise ProfileError(f"comm.links.topology: {problem}; re-run the profiler")
    if len(links.intra) != links.topology.node_count or (links.topology.spans_nodes and links.cross is None):
        raise ProfileError(f"comm.links needs one intra-node link per node of {links.topology.describe()} "
                           "and a cross-node link; re-run the profiler")
    for where, x in [(f"intra[{k}]", x) for k, x in enumerate(links.intra)] + [("cross", links.cross)]:
        if x is not None and not (x.bandwidth_bytes_per_s > 0 and x.latency_s >= 0):
            raise ProfileError(f"comm.links.{where} must have bandwidth > 0 and latency >= 0, got {x}; "
                               "re-run the profiler")


# the exposure fields of a schema-1 CommProfile, by their ``Exposure`` / ``LedExposure`` names
_SCHEMA_1_EXPOSURE = {"exposed_micro_step_s": "micro_step_s", "exposed_iteration_s": "iteration_s",
                      "exposed_step_compute_s": "step_compute_s", "exposed_step_s": "step_s",
                      "exposed_switch_s": "switch_s", "iteration_overhead_s": "overhead_s", "exposed_error": "error"}
_SCHEMA_1_LED = {"exposed_micro_step_lead_s": "micro_step_s", "exposed_iteration_lead_s": "iteration_s",
                 "exposed_small_lead": "small_lead", "exposed_micro_step_small_lead_s": "micro_step_small_lead_s",
                 "exposed_iteration_small_lead_s": "iteration_small_lead_s"}


def from_schema_1(d: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 profile (before typed records: flat ``exposed_*`` fields and a ``meta`` dict) as
    the JSON object of a schema-2 one. Every measured number has one place in the new records; ``meta``'s prose and
    diagnostics that have none are left out."""
    d = dict(d)
    comm = dict(mapping(d.get("comm"), "comm"))
    links = {k: comm.pop(k) for k in ("bandwidth_bytes_per_s", "latency_s", "backend") if k in comm}
    exposure: dict[str, Any] = {new: comm.pop(old) for old, new in _SCHEMA_1_EXPOSURE.items() if old in comm}
    leaders: dict[str, dict[str, Any]] = {}
    for old, new in _SCHEMA_1_LED.items():
        for dtype, x in (comm.pop(old, None) or {}).items():
            leaders.setdefault(dtype, {"device_type": dtype})[new] = x
    exposure["leaders"] = list(leaders.values())
    d["comm"] = {**comm, "links": links, "exposure": exposure}
    legacy = dict(mapping(d.pop("meta", None) or {}, "meta"))
    d["precision"] = legacy.get("precision", "fp32")
    d["mixed_precision"] = legacy.get("mixed_precision")
    d["activation_checkpointing"] = bool(legacy.get("activation_checkpointing"))
    emulated = None
    if legacy.get("emulated") or legacy.get("synthetic"):
        cluster = legacy.get("cluster")
        emulated = {"memory_scale": legacy["memory_scale"], "time_scale": legacy.get("time_scale"),
                    "cluster": cluster.get("name", "") if isinstance(cluster, dict) else "",
                    "synthetic": bool(legacy.get("synthetic")), "calibration": legacy.get("calibration")}
    d["provenance"] = {"schema_version": 1, "emulated": emulated}
    notes = legacy.get("ranks") or {}
    past = legacy.get("points_past_mbs")
    d["measurement"] = {
        "requested_stage": legacy.get("requested_stage"),
        "escalations": [{"from_stage": e["from"], "to_stage": e["to"], "ranks": e["ranks"],
                         "reasons": e.get("reasons", {}), "offload": e.get("offload")}
                        for e in legacy.get("escalations", [])],
        "seconds": legacy.get("seconds", 0.0), "timing_rounds": legacy.get("timing_rounds", 0),
        "repeats": legacy.get("repeats", 0), "overflowing_trials": legacy.get("overflowing_trials", 0),
        "ranks": [notes[k] for k in sorted(notes, key=int)],
        "past_mbs": {"shard_weights": past["shard_weights"], "batches": past["batches"],
                     "seconds": past.get("seconds", 0.0)} if past else None}
    choice = legacy.get("auto_choice")
    if choice:
        d["auto_choice"] = {"rule": choice["rule"], "candidates": choice["candidates"],
                            "profiling_s": choice.get("profiling_s", {}), "timed": choice.get("timed", 0),
                            "probed": choice.get("probed", 0), "timing_rounds": choice.get("timing_rounds", 0),
                            "offload_escalations": choice.get("offload_escalations", [])}
    return d
