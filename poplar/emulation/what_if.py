"""What-if questions on clusters described by GPU presets rather than measured: "does adding four
T4s help?", "which ZeRO stage would run fastest?". A cluster (built-in name, cluster file or
``ClusterSpec``) becomes a synthetic profile of its presets' curves (``synthetic``), which the
planner's simulator and candidate table price like a measured one. Planning inputs good to tens
of percent; a measured profile replaces them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.presets import get_preset
from poplar.emulation.synthetic import REFERENCE_MODEL, ModelSpec, synthetic_profile
from poplar.planner.candidates import CandidateRow, predict
from poplar.planner.planning import STRATEGIES
from poplar.planner.simulator import Simulation
from poplar.planner.simulator import simulate as simulate_profile
from poplar.types.plans import PlanError
from poplar.types.profiles import Profile


def simulate(cluster_or_profile: ClusterSpec | Profile | str | os.PathLike | Mapping[str, Any],
             global_batch_size: int, zero_stage: int | None = None, strategies: Iterable[str] = STRATEGIES,
             model: ModelSpec = REFERENCE_MODEL, memory_scale: float = 1.0, require_all_ranks: bool = False,
             max_micro_steps: int | None = None) -> Simulation:
    """Plan every strategy on a cluster (preset curves) or a measured profile and compare them.

    A string is a built-in cluster name, or a path to a cluster file or a profile file (a JSON
    object with ``devices`` is a cluster, one with ``ranks`` a profile). ``zero_stage`` is
    required for a cluster and defaults to the profile's stage for a profile.
    """
    source, profile = _resolve(cluster_or_profile, zero_stage, model, memory_scale)
    return simulate_profile(profile, global_batch_size, zero_stage, strategies, require_all_ranks, max_micro_steps,
                            source=source)


def _resolve(obj: Any, zero_stage: int | None, model: ModelSpec, memory_scale: float) -> tuple[str, Profile]:
    if isinstance(obj, Profile):
        return f"profile ({obj.model_name or 'model'}, {obj.world_size} ranks)", obj
    if isinstance(obj, Mapping) and "ranks" in obj:
        return _resolve(Profile.from_dict(dict(obj)), zero_stage, model, memory_scale)
    if isinstance(obj, Mapping):
        obj = ClusterSpec.from_dict(dict(obj))
    if isinstance(obj, (str, os.PathLike)) and not isinstance(obj, ClusterSpec):
        path = Path(obj)
        if path.suffix == ".json" and path.exists():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                data = None  # ClusterSpec.load below reports it
            if isinstance(data, dict) and "ranks" in data:
                return _resolve(Profile.load(path), zero_stage, model, memory_scale)
        obj = ClusterSpec.resolve(obj)
    if zero_stage is None:
        raise PlanError("simulating a cluster needs a ZeRO stage (0-3)")
    spec: ClusterSpec = obj
    return (f"cluster {spec.describe()} [{model.name}]",
            synthetic_profile(spec, zero_stage, model, memory_scale))


def preset_candidates(cluster: ClusterSpec | str, gbs: int, plain: ModelSpec, checkpointed: ModelSpec | None,
                      stages: tuple[int, ...] = (0, 1, 2, 3), **limits: Any) -> list[CandidateRow]:
    """Every configuration on a cluster of preset devices (the simulator's synthetic profiles):
    ``plain`` is the model without checkpointing, ``checkpointed`` with it (None: not a candidate).
    Nothing is chosen yet (``choose``)."""
    spec = ClusterSpec.resolve(cluster)
    types = spec.rank_types()
    rows = []
    for ckpt, model in ((False, plain), (True, checkpointed)):
        if model is None:
            continue
        for stage in stages:
            states = model.state_bytes(stage, spec.world_size) + model.reserve_bytes
            mbs = {t: max(0, math.floor((get_preset(t).capacity_bytes() - states) / model.activation_bytes_per_sample))
                   for t in dict.fromkeys(types)}
            row = CandidateRow(stage, ckpt, all(m >= 1 for m in mbs.values()), mbs, source="presets")
            if not row.fits:
                bad = [t for t, m in mbs.items() if m < 1]
                rows.append(replace(row, reason=f"batch 1 does not fit on {', '.join(bad)} "
                                                f"({states / 2 ** 30:.1f} GiB of model states and reserve)"))
                continue
            plan, reason = predict(synthetic_profile(spec, stage, model), gbs, stage, **limits)
            rows.append(replace(row, reason=reason, predicted_s=plan.predicted_iteration_s if plan else None))
    return rows


