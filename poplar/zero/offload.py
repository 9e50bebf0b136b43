"""Per-rank CPU offload of the optimizer: where a rank's optimizer steps its shard.

A rank whose plan row says ``Offload.OPTIMIZER`` (ZeRO-1/2/3) keeps, per optimizer parameter
(one unit's shard), three tensors in host memory (pinned when the device is a GPU, so the copies
are DMA transfers that need not block the CPU): an fp32 copy of the shard (the master the
optimizer steps), a buffer for its reduced gradient, and the optimizer's state (momentum, Adam's
moments). The user's optimizer is re-pointed at the host copies, so torch's own optimizer steps
on the CPU with the group settings it was built with.

A step (``step``): every reduced, clipped gradient shard is copied to its host buffer (all
copies queued at once, then one wait), the optimizer steps on the host, and every updated shard
is copied back into the stage's device shard (queued, not waited for: the stage's next use of
it, the all-gather of ZeRO-1/2 or ZeRO-3's next gather, runs on the same stream after it). The
device keeps what the stage computes and communicates with: the shard of the parameters (ZeRO-3),
or the full parameters (ZeRO-1/2), and under mixed precision the stage's fp32 master shard.

The host copy is the one stepped, so it must hold the device shard's values: ``refresh``
copies them over after the stage's state was loaded, and ``on_device`` gives the optimizer back
its device parameters (state included) while a stage re-cuts its shards. Off a GPU the host
and device copies are both CPU tensors, still separate, so the same code runs in tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from poplar.types.plans import Offload, Plan
from poplar.zero.optim import optimizer_state_bytes

HOST_KEYS = ("host_master_params", "host_grads", "host_optimizer")  # memory_report keys of host bytes


def offload_problem(plan: Plan, zero_stage: int) -> str | None:
    """Why ``plan``'s offload rows cannot run at ``zero_stage``, or None."""
    ranks = [r for r, o in enumerate(plan.offloads) if o is not Offload.NONE]
    if ranks and zero_stage == 0:
        return (f"plan rows {ranks} offload the optimizer, but ZeRO-0 replicates the optimizer state on every "
                "rank and has no shard to offload; use zero_stage=1, 2 or 3, or offload=Offload.NONE")
    return None


@dataclass
class HostShard:
    """One optimizer parameter on an offloading rank: its device shard and the host tensors."""

    device: nn.Parameter  # the stage's shard (a view into its buffers), what forward reads
    host: nn.Parameter  # the fp32 master the optimizer steps
    grad: torch.Tensor  # the reduced gradient, copied over before each step


class OptimizerOffload:
    """Where ``optimizer`` steps: on the stage's device shards (``Offload.NONE``) or on host
    copies of them (``Offload.OPTIMIZER``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.placement = Offload.NONE
        self.shards: list[HostShard] = []
        self._host_of: dict[int, nn.Parameter] = {}
        self._capturable: list[bool | None] = []  # each group's setting while it steps on the host

    @property
    def active(self) -> bool:
        return self.placement is Offload.OPTIMIZER

    def place(self, placement: Offload) -> None:
        """Move the optimizer's parameters and state to ``placement`` (between iterations)."""
        if placement is self.placement:
            return
        if placement is Offload.OPTIMIZER:
            self._to_host()
        else:
            self._to_device()
        self.placement = placement

    def _host_tensor(self, value: torch.Tensor) -> torch.Tensor:
        out = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self.pin)
        out.copy_(value.detach())
        return out

    def _to_host(self) -> None:
        """Re-point every group at host copies of its (device shard) parameters; state moves too.
        ``capturable`` (CUDA graphs: state on the device) is off while the group steps on the host."""
        self.shards, self._host_of, self._capturable = [], {}, []
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            self._capturable.append(group.get("capturable"))
            if group.get("capturable"):
                group["capturable"] = False
            hosts = []
            for d in group["params"]:
                h = nn.Parameter(self._host_tensor(d), requires_grad=True)
                grad = torch.zeros(d.shape, dtype=d.dtype, device="cpu", pin_memory=self.pin)
                self.shards.append(HostShard(d, h, grad))
                self._host_of[id(d)] = h
                if d in state:
                    state[h] = {k: self._host_tensor(v) if torch.is_tensor(v) else v for k, v in state.pop(d).items()}
                hosts.append(h)
            group["params"] = hosts

    def _to_device(self) -> None:
        """Re-point every group back at the device shards; per-element state moves to the device,
        other state (Adam's ``step`` counter) stays where torch keeps it for device parameters."""
        device_of = {id(s.host): s for s in self.shards}
        state = self.optimizer.state
        for group, capturable in zip(self.optimizer.param_groups, self._capturable):
            if capturable:
                group["capturable"] = capturable
            devices = []
            for h in group["params"]:
                s = device_of[id(h)]
                with torch.no_grad():
                    s.device.copy_(h)
                if h in state:
                    state[s.device] = {k: v.to(s.device.device) if torch.is_tensor(v) and v.shape == h.shape
                                       and v.dim() > 0 else v for k, v in state.pop(h).items()}
                devices.append(s.device)
            group["params"] = devices
        self.shards, self._host_of = [], {}

    def stepped(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer steps for the stage's shard ``param`` (its host copy, or itself)."""
        return self._host_of.get(id(param), param)

    def step(self) -> None:
        """One optimizer step on the shards' gradients (``.grad`` of the device shards)."""
        if not self.active:
            self.optimizer.step()
            return
        for s in self.shards:  # device to host: every copy queued, then one wait
            if s.device.grad is None:
                s.host.grad = None
                continue
            s.grad.copy_(s.device.grad, non_blocking=self.pin)
            s.host.grad = s.grad
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()
        self.optimizer.step()
        with torch.no_grad():
            for s in self.shards:  # host to device: ordered before the stage's next use on the stream
                s.device.copy_(s.host, non_blocking=self.pin)
                s.host.grad = None

    def refresh(self) -> None:
        """The host copies take the device shards' values (after the stage's state was loaded)."""
        with torch.no_grad():
            for s in self.shards:
                s.host.copy_(s.device)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The optimizer on the device shards inside (a stage re-cutting its shards), and on host
        copies of the new shards after."""
        placement = self.placement
        self.place(Offload.NONE)
        try:
            yield
        finally:
            self.place(placement)

    def memory_report(self) -> dict[str, int]:
        """Host bytes of an offloading rank (none otherwise): the fp32 master copies, the
        gradient buffers and the optimizer state."""
        if not self.active:
            return {}
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        return {"host_master_params": sum(nbytes(s.host) for s in self.shards),
                "host_grads": sum(nbytes(s.grad) for s in self.shards),
                "host_optimizer": optimizer_state_bytes(self.optimizer)}
