"""Auto mode's key in the profile store (``poplar.profiler.store``): what a job's profiles depend
on. What a start reuses, and the profiling of the device types the store lacks, is the
profiling run's store step (``poplar.profiler.store_reuse``, ``ProfileRun.measure``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torch import nn

from poplar.profiler.store import StoreKey, model_config, module_structure
from poplar.profiler.store_reuse import StoreUse
from poplar.types.precision import MixedPrecision, precision_of

__all__ = ["StoreUse", "model_fingerprint", "store_key"]


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return [list(x.shape[1:]), str(x.dtype)]  # one sample: the batch dimension left out
    if isinstance(x, dict):
        return {str(k): _shapes(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_shapes(v) for v in x]
    return type(x).__name__


def model_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The model's class, parameter and buffer names, shapes, dtypes and trainability, and the
    optimizer's class (its state is part of memory); not the values."""
    parts: list[Any] = [type(model).__qualname__, type(optimizer).__qualname__]
    parts += [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]
    parts += [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def store_key(model: nn.Module, optimizer: torch.optim.Optimizer, sample_fn: Callable[[int], Any], *,
              zero_stage: int, stages: tuple[int, ...], checkpointing: Any, rule: str, bucket_size_mb: float,
              policy: MixedPrecision | None) -> StoreKey:
    """What this job's profiles depend on (every rank computes the same key).

    A gradient bucket holds at most the whole model: every bucket size from the model's bytes up
    runs the same job (one bucket), so the key records the bucket size no larger than that, and a
    small model's profile serves whatever larger bucket a config names."""
    params = list(model.parameters())  # as the runtime cuts buckets: every element at the first's size
    model_mb = sum(p.numel() for p in params) * (params[0].element_size() if params else 4) / 2 ** 20
    setting = "auto" if checkpointing is None and rule != "single" else \
        "off" if checkpointing in (None, False) else "on" if checkpointing is True else repr(checkpointing)
    return StoreKey(model=model_fingerprint(model, optimizer), structure=module_structure(model),
                    config=model_config(model), zero_stage=zero_stage,
                    stages=tuple(sorted(set(stages))), checkpointing=setting, rule=rule,
                    precision=str(precision_of(policy).value), sample=repr(_shapes(sample_fn(1))),
                    bucket_size_mb=float(min(bucket_size_mb, model_mb)), torch_version=torch.__version__)
