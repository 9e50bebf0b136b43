"""``poplar.profile``: measure every rank's largest micro-batch and speed curve, as a ``Profile``.

Inside a job (``torch.distributed`` initialised, one process per GPU) every rank calls
``poplar.profile(model_fn, loss_fn, sample_fn, options=ProfileOptions(zero_stage=...))``; each rank
profiles its own device (the current CUDA device, or the ``device`` given) and all ranks return
the same ``Profile``. Without a process group it profiles this one device as a world of one.
To profile an emulated cluster on one CPU machine, see ``poplar.emulation.profile_cluster``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from poplar.profiler.cuda_device import CudaDevice
from poplar.profiler.devices import Device
from poplar.profiler.profile_run import ProfileOptions, default_optimizer, profile_rank
from poplar.types.profiles import Profile, ProfileError


def profile(model_fn: Callable[[], nn.Module], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
            sample_fn: Callable[[int], Any], *, options: ProfileOptions | None = None, device: Device | None = None,
            optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
            output: str | os.PathLike | None = None) -> Profile:
    """Profile ``model_fn()`` trained with ``loss_fn`` on batches from ``sample_fn``, on every rank.

    Args:
        model_fn: builds the model (on CPU; the profiler moves it), the same on every call.
        loss_fn: ``loss_fn(model, batch)`` -> the mean loss of the batch.
        sample_fn: ``sample_fn(b)`` -> a batch of ``b`` samples (samples on dim 0).
        options: ``ProfileOptions``: the ZeRO stage (raised automatically, and recorded in
            ``profile.measurement.escalations``, if batch 1 does not fit on some rank, unless
            ``escalate=False``), the precision training will run (``mixed_precision``: every
            runtime profiled runs under it; a device without it, bf16 on a V100 or T4, is a
            ``ProfileError`` naming it), the search bound, the repeats, stage-3 wrapping.
        device: this rank's device (default: the current CUDA device).
        optimizer_fn: ``optimizer_fn(model)``; default fp32 AdamW (its state is part of memory).
        output: also save the profile there (JSON; rank 0 writes it).
    Returns the ``Profile`` (JSON via ``profile.save(path)``); raises ``ProfileError`` with the
    reason (e.g. the model does not fit even at ZeRO-3) on bad input.
    """
    options = options or ProfileOptions()
    if device is None:
        if not torch.cuda.is_available():
            raise ProfileError("no CUDA device on this rank: pass device= (a poplar Device), or profile an emulated "
                               "cluster on CPU with poplar.emulation.profile_cluster")
        device = CudaDevice()
    result = profile_rank(model_fn, loss_fn, sample_fn, device, optimizer_fn=optimizer_fn or default_optimizer,
                          options=options, log=None if options.progress else (lambda m: None))
    if output is not None and (not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0):
        result.save(output)
    return result
