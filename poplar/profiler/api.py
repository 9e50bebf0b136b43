"""``poplar.profile``: measure every rank's largest micro-batch and speed curve, as a ``Profile``.

Two ways to run it:

- on a real cluster, inside an initialised ``torch.distributed`` job: every rank calls
  ``poplar.profile(model_fn, loss_fn, sample_fn, zero_stage=...)``; each rank profiles its own
  CUDA device (or the ``device`` given) and all ranks return the same ``Profile``;
- on one CPU machine, as an emulated cluster: pass ``cluster`` (a ``ClusterSpec``, a built-in
  name such as ``"B"``, or a cluster JSON file) or ``devices`` (one ``VirtualDevice`` per
  rank); one process per rank is spawned. The functions must then be importable by name
  (module-level), since they travel to the spawned processes.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from poplar.profiler.devices import Device
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.profiles import Profile, ProfileError


def profile(model_fn: Callable[[], nn.Module], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
            sample_fn: Callable[[int], Any], *, zero_stage: int = 0, cluster: Any = None,
            devices: list[Device] | None = None, device: Device | None = None,
            optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None, escalate: bool = True,
            max_batch: int = 4096, repeats: int = 3, bucket_size_mb: float = 25.0, wrap_policy: Any = None,
            memory_scale: float | str = "auto", time_scale: float | str = "auto", model_name: str = "",
            progress: bool = True, timeout_s: float = 1800.0, output: str | os.PathLike | None = None,
            mixed_precision: Any = None) -> Profile:
    """Profile ``model_fn()`` trained with ``loss_fn`` on batches from ``sample_fn``.

    Args:
        model_fn: builds the model (on CPU; the profiler moves it), the same on every call.
        loss_fn: ``loss_fn(model, batch)`` -> the mean loss of the batch.
        sample_fn: ``sample_fn(b)`` -> a batch of ``b`` samples (samples on dim 0).
        zero_stage: the ZeRO stage to profile; raised automatically (and recorded in
            ``profile.meta["escalations"]``) if batch 1 does not fit on some rank, unless
            ``escalate=False``.
        cluster / devices: emulate on CPU (see the module doc). ``memory_scale`` and
            ``time_scale`` scale the cluster's presets ("auto": measured from the model).
        device: the distributed case: this rank's device (default: the current CUDA device).
        optimizer_fn: ``optimizer_fn(model)``; default fp32 AdamW (its state is part of memory).
        max_batch: the capacity search stops here. repeats: measurements per timed size.
        output: also save the profile there (JSON).
        mixed_precision: the precision training will run (None / "fp32", "bf16", "fp16" or a
            ``MixedPrecision``): every runtime profiled runs under it, and emulated devices
            compute at their preset's speed for it; recorded in ``profile.meta["precision"]``.
            A device without it (bf16 on a V100 or T4) is a ``ProfileError`` naming it.
    Returns the ``Profile`` (JSON via ``profile.save(path)``); raises ``ProfileError`` with the
    reason (e.g. the model does not fit even at ZeRO-3) on bad input.
    """
    options = ProfileOptions(zero_stage=zero_stage, escalate=escalate, max_batch=max_batch, repeats=repeats,
                             bucket_size_mb=bucket_size_mb, wrap_policy=wrap_policy, model_name=model_name,
                             progress=progress, mixed_precision=mixed_precision)
    optimizer_fn = optimizer_fn or default_optimizer
    log = None if progress else (lambda m: None)
    if dist.is_available() and dist.is_initialized():
        if device is None:
            if not torch.cuda.is_available():
                raise ProfileError("no CUDA device on this rank: pass device=VirtualDevice(...) to emulate one")
            from poplar.profiler.cuda_device import CudaDevice
            device = CudaDevice()
        result = profile_rank(model_fn, loss_fn, sample_fn, device, optimizer_fn=optimizer_fn, options=options,
                              log=log)
    else:
        result = _emulate(model_fn, loss_fn, sample_fn, cluster, devices, optimizer_fn, options, memory_scale,
                          time_scale, progress, timeout_s)
    if output is not None:
        result.save(output)
    return result


def _emulate(model_fn: Callable, loss_fn: Callable, sample_fn: Callable, cluster: Any, devices: Any,
             optimizer_fn: Callable, options: ProfileOptions, memory_scale: Any, time_scale: Any, progress: bool,
             timeout_s: float) -> Profile:
    from poplar.comm.launch import spawn
    from poplar.profiler.emulate import CalibrationInputs, emulate_cluster, emulated_rank

    if (cluster is None) == (devices is None):
        raise ProfileError("without torch.distributed, give either cluster= (a ClusterSpec, a built-in name or a "
                           "cluster file) or devices= (one VirtualDevice per rank) to emulate a cluster on CPU")
    if options.zero_stage not in (0, 1, 2, 3):
        raise ProfileError(f"zero_stage must be 0, 1, 2 or 3, got {options.zero_stage!r}")
    if cluster is not None:
        inputs = CalibrationInputs(model_fn, loss_fn, sample_fn, optimizer_fn, options.zero_stage,
                                   options.bucket_size_mb, options.wrap_policy, options.max_batch,
                                   options.mixed_precision)
        emulated = emulate_cluster(cluster, inputs, memory_scale, time_scale)
        if progress and emulated.calibration is not None:
            print(f"[poplar profile] emulating {emulated.spec.describe()} on CPU: memory scale "
                  f"{emulated.memory_scale:.3g}, time scale {emulated.time_scale:.3g} (predicted mbs "
                  f"{emulated.calibration.predicted_mbs})", file=sys.stderr, flush=True)
        devices = emulated.devices()
        options.meta.update(emulated.meta())
    if not devices:
        raise ProfileError("devices is empty; give one VirtualDevice per rank")
    options.meta.setdefault("emulated", True)
    job = {"model_fn": model_fn, "loss_fn": loss_fn, "sample_fn": sample_fn, "optimizer_fn": optimizer_fn,
           "devices": list(devices), "options": options, "progress": progress}
    results = spawn(emulated_rank, len(devices), (job,), timeout_s=timeout_s, collective_timeout_s=timeout_s)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise ProfileError(errors[0])
    return Profile.from_dict(results[0]["profile"])
