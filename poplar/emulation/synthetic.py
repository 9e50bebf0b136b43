"""Synthetic profiles: what the profiler would measure on a cluster of preset devices.

Assumptions (all explicit in ``ModelSpec``):
- Model states per rank, fp32 Adam (4 B parameters + 4 B gradients + 8 B optimizer per
  parameter, Psi parameters, N ranks), as in docs/design.md section 3:
      stage 0: 16 Psi   stage 1: 8 Psi + 8 Psi / N   stage 2: 4 Psi + 12 Psi / N
      stage 3: 16 Psi / N + 4 Psi * live_param_fraction (parameters gathered for live layers)
  plus ``reserve_bytes`` (CUDA context, allocator slack, communication buffers).
- Activations grow linearly: ``activation_bytes_per_sample`` per sample, so
  mbs = floor((capacity - states - reserve) / activation_bytes_per_sample).
- Compute time of a micro-step is the preset curve times ``work_scale`` (the model's cost
  relative to the reference workload the presets are calibrated on).
- Points are profiled at powers of two up to mbs, plus mbs itself (as the profiler does).
- Communication: the cluster's bus bandwidth and latency; ``param_bytes`` = 4 Psi.
Memory is scaled by ``memory_scale`` (1 = real GPUs and a real-size model; < 1 to match a
CPU-sized model on emulated devices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.presets import GIB, DevicePreset, get_preset
from poplar.types.profiles import (CommProfile, Emulated, Links, Profile, ProfileError, ProfilePoint, Provenance,
                                   RankProfile)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    param_count: int
    activation_bytes_per_sample: float
    work_scale: float = 1.0  # compute time relative to the presets' reference workload
    live_param_fraction: float = 0.1  # ZeRO-3: share of parameters gathered at once
    reserve_bytes: float = 1.0 * GIB

    @property
    def param_bytes(self) -> int:
        return 4 * self.param_count

    def state_bytes(self, stage: int, world_size: int) -> float:
        psi, n = self.param_count, world_size
        return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n,
                3: 16 * psi / n + 4 * psi * self.live_param_fraction}[stage]

    def shard_bytes(self, stage: int, world_size: int) -> float:
        """A rank's 1/N of the sharded state: what moves with a shard weight."""
        return {0: 0.0, 1: 8.0, 2: 12.0, 3: 16.0}[stage] * self.param_count / world_size


# The workload the presets' speeds describe: a GPT-2-small-sized transformer (125M parameters,
# 1 GiB of activations per sample). A V100-SXM2 trains it at 40 samples/s; 16 GB cards fit ~13.
REFERENCE_MODEL = ModelSpec("reference-125M", 125_000_000, 1.0 * GIB)


def profile_points(mbs: int) -> list[int]:
    return sorted({2 ** k for k in range(mbs.bit_length()) if 2 ** k <= mbs} | {mbs})


def synthetic_profile(cluster: ClusterSpec | str, zero_stage: int, model: ModelSpec = REFERENCE_MODEL,
                      memory_scale: float = 1.0, speed_scale: float = 1.0) -> Profile:
    """The profile a cluster of preset devices would produce for ``model`` at ``zero_stage``."""
    spec = ClusterSpec.resolve(cluster)
    prof = profile_from_presets([get_preset(t) for t in spec.rank_types()], zero_stage, model,
                                spec.bandwidth_gbps, spec.latency_us, memory_scale, speed_scale)
    emulated = replace(prof.provenance.emulated, cluster=spec.name)
    return replace(prof, provenance=replace(prof.provenance, emulated=emulated))


def profile_from_presets(presets: Sequence[DevicePreset], zero_stage: int, model: ModelSpec = REFERENCE_MODEL,
                         bandwidth_gbps: float = 10.0, latency_us: float = 30.0, memory_scale: float = 1.0,
                         speed_scale: float = 1.0) -> Profile:
    """A synthetic profile with one rank per preset, in order (presets may be any DevicePreset)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"zero_stage must be 0-3, got {zero_stage!r}")
    world = len(presets)
    base = model.state_bytes(zero_stage, world) + model.reserve_bytes * memory_scale
    ranks, cache = [], {}
    for rank, preset in enumerate(presets):
        if preset.name not in cache:
            capacity = preset.capacity_bytes(memory_scale)
            mbs = math.floor((capacity - base) / model.activation_bytes_per_sample)
            if mbs < 1:
                raise ProfileError(
                    f"{model.name} does not fit on {preset.name} at ZeRO-{zero_stage} ({capacity / GIB:.2f} GiB, "
                    f"model states {base / GIB:.2f} GiB); use a higher ZeRO stage or a smaller model")
            points = [(b, preset.time_s(b, speed_scale) * model.work_scale) for b in profile_points(mbs)]
            cache[preset.name] = (capacity, mbs, points)
        capacity, mbs, points = cache[preset.name]
        ranks.append(RankProfile(rank, preset.name, mbs, [ProfilePoint(b, t) for b, t in points],
                                 device_name=f"preset:{preset.name}", capacity_bytes=capacity,
                                 base_bytes=int(base), bytes_per_sample=model.activation_bytes_per_sample,
                                 shard_bytes=int(model.shard_bytes(zero_stage, world)) or None,
                                 nominal_tflops=preset.nominal_tflops))
    return Profile(zero_stage, world, model.param_count, model.param_bytes, ranks,
                   CommProfile(Links(bandwidth_gbps * 1e9, latency_us * 1e-6, "simulated")), model_name=model.name,
                   provenance=Provenance(emulated=Emulated(memory_scale=memory_scale, synthetic=True)))
