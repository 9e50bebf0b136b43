"""The profiler under a mixed-precision policy (``poplar.types.precision``).

Profiling must measure what training will run: the runtimes the profiler builds (capacity search,
timing rounds, calibration) get the run's policy, so saved activations, low-precision parameter
copies and the fp32 master weights are counted for real, and a virtual device pads compute to
its preset's curve at that precision. Helpers:

- ``runtime_precision``: the precision a runtime computes in (its ``mixed_precision`` policy);
- ``agree_precision_support``: every rank says whether its device computes in the policy's
  precision; any that cannot (bf16 on a V100 or T4) is one clear error on every rank, naming the
  devices and suggesting fp16.
"""

from __future__ import annotations

from typing import Any

from poplar.comm import Communicator
from poplar.profiler.devices import Device
from poplar.types.precision import MixedPrecision, Precision, resolve_precision
from poplar.types.precision import precision_unsupported_message
from poplar.types.profiles import Profile, ProfileError
from poplar.zero.runtime import ZeroRuntime


def runtime_precision(runtime: ZeroRuntime) -> Precision:
    """The precision ``runtime`` computes in: its policy's ``param_dtype`` (fp32 without one)."""
    policy = runtime.mixed_precision
    return policy.precision if policy is not None else Precision.FP32


def precision_meta(policy: MixedPrecision | None) -> dict[str, Any]:
    """What a profile records about the precision it was measured at (``Profile.precision`` and
    ``Profile.mixed_precision``)."""
    return {"precision": str(Precision.FP32 if policy is None else policy.precision),
            "mixed_precision": None if policy is None else policy.to_dict()}


def profile_precision(profile: Profile) -> Precision:
    """The precision a profile was measured at."""
    return Precision(profile.precision)


def agree_precision_support(comm: Communicator, device: Device | None, policy: Any, what: str,
                            error_type: type[Exception] = ProfileError) -> MixedPrecision | None:
    """Every rank's device must compute in ``policy``'s precision and every rank must ask for the
    same policy; otherwise ``error_type`` on every rank (naming the devices that lack it, with
    their ranks). Returns the resolved policy."""
    error, resolved = None, None
    try:
        resolved = resolve_precision(policy)
    except ValueError as e:
        error = str(e)
    precision = Precision.FP32 if resolved is None else resolved.precision
    supported = error is not None or device is None or device.supports(precision)
    name = device.device_type if device is not None else "no device"
    values = comm.agree(error, what, value=(str(precision), name, supported), error_type=error_type)
    if len({v[0] for v in values}) > 1:
        raise error_type(f"{what}: ranks ask for different precisions "
                         f"({', '.join(f'rank {r}: {v[0]}' for r, v in enumerate(values))}); give every rank the "
                         "same mixed_precision")
    missing: dict[str, list[int]] = {}
    for rank, (_, dev, ok) in enumerate(values):
        if not ok:
            missing.setdefault(dev, []).append(rank)
    if missing:
        raise error_type(f"{what}: {precision_unsupported_message(precision, missing)}")
    return resolved
