"""Model-state memory of an engine, with the optimizer state it will hold after its first step.

Optimizers create their state lazily at the first ``step()``, so before it ``memory_report()``
says 0 bytes of optimizer state while the capacity search must already count it (the first
trial step would otherwise fit a batch that the second step, with Adam's moments allocated,
does not). ``predicted_optimizer_bytes`` builds a throw-away twin of the optimizer
(``poplar.zero.optim.optimizer_like``: same class, same group settings) over zero tensors shaped
like the parameters it holds now (this rank's shards at stages 1-3), steps it once on CPU and
counts its state.
"""

from __future__ import annotations

from typing import Any

import torch

from poplar.zero.base import ZeroStage
from poplar.zero.offload import HOST_KEYS
from poplar.zero.optim import optimizer_like, optimizer_state_bytes

# memory_report keys that are not model states: peaks of temporaries (communication buffers,
# stage-3 gathered parameters), counted as they come and go by transient_bytes / gathered_bytes
TRANSIENT_KEYS = frozenset({"comm_buffers", "gathered_params"})


def predicted_optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state after one step (on the parameters' own dtypes)."""
    actual = optimizer_state_bytes(optimizer)
    try:
        params = [[torch.zeros(p.shape, dtype=p.dtype, requires_grad=True) for p in g["params"]]
                  for g in optimizer.param_groups]
        for group in params:
            for p in group:
                p.grad = torch.zeros_like(p)
        twin = optimizer_like(optimizer, params, for_cpu=True)  # the state is the same without fused kernels
        twin.step()
        predicted = optimizer_state_bytes(twin)
    except Exception:  # noqa: BLE001 - an optimizer we cannot twin: fall back to a rule of thumb
        predicted = _rule_of_thumb(optimizer)
    return max(actual, predicted)


def _rule_of_thumb(optimizer: torch.optim.Optimizer) -> int:
    numel_bytes = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return 2 * numel_bytes
    if any(g.get("momentum", 0) for g in optimizer.param_groups):
        return numel_bytes
    return 0


def model_state_bytes(engine: Any, optimizer_bytes: int | None = None) -> dict[str, int]:
    """Bytes this rank's device holds between steps, by ``memory_report`` key: params, grads,
    optimizer (as after the first step), buffers, and whatever else the runtime reports it keeps
    (under mixed precision the fp32 master weights). Communication buffers are not included (they
    come and go: ``transient_bytes``), nor is what an offloading rank keeps in host memory
    (``host_state_bytes``)."""
    report = engine.memory_report()
    states = {k: int(v) for k, v in report.items() if k not in TRANSIENT_KEYS and k not in HOST_KEYS}
    states.setdefault("buffers", 0)
    if optimizer_bytes is not None and "host_optimizer" not in report:
        states["optimizer"] = max(states.get("optimizer", 0), int(optimizer_bytes))
    return states


def host_state_bytes(engine: Any, optimizer_bytes: int | None = None) -> dict[str, int]:
    """Bytes an offloading rank keeps in host memory (empty for one that does not), by
    ``memory_report`` key, the optimizer state as after the first step."""
    report = engine.memory_report()
    host = {k: int(report[k]) for k in HOST_KEYS if k in report}
    if host and optimizer_bytes is not None:
        host["host_optimizer"] = max(host["host_optimizer"], int(optimizer_bytes))
    return host


def transient_bytes(stage: ZeroStage) -> int:
    """Communication buffers the stage holds right now (stage 2 buckets, stage 1 temporaries)."""
    return stage.transient_bytes


def gathered_bytes(stage: ZeroStage) -> int:
    """Stage 3: bytes of parameters gathered and alive right now (0 at other stages)."""
    return stage.gathered_bytes
