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
or the full parameters (ZeRO-1/2), and its gradient buffers.

Under mixed precision the stage's device shard is an fp32 master kept apart from the copy the
model computes with; while offloaded the host copy is the only master. The stage names, per
shard, a device tensor in the compute dtype (``compute``: its slice of the low-precision
parameters at ZeRO-1/2, a compute-dtype shard at ZeRO-3) and the stepped values are cast into it;
the device master's storage is freed (resized to 0 bytes) and comes back, with the host values,
when the optimizer returns to the device (``Offload.NONE``, and while a stage re-cuts its shards).

The host copy is the one stepped, so it must hold the stage's values: ``refresh`` makes the two
copies agree after the stage's state was loaded (from the device shard, or from the host master
where the stage loaded that). Off a GPU the host and device copies are both CPU tensors, still
separate, so the same code runs in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from poplar.types.plans import Offload, Plan
from poplar.zero.observers import CopyDirection
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
    compute: torch.Tensor | None = None  # the device copy in the compute dtype the stepped values go to
    # (mixed precision: the device shard, the fp32 master, is freed meanwhile); None: the device shard


class OptimizerOffload:
    """Where ``optimizer`` steps: on the stage's device shards (``Offload.NONE``) or on host
    copies of them (``Offload.OPTIMIZER``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 on_copy: Callable[[CopyDirection, int], None] | None = None) -> None:
        self.optimizer = optimizer
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.placement = Offload.NONE
        self.shards: list[HostShard] = []
        self._host_of: dict[int, nn.Parameter] = {}
        self._capturable: list[bool | None] = []  # each group's setting while it steps on the host
        self._freed: list[tuple[torch.UntypedStorage, int]] = []  # device masters' storage and its bytes
        # told the bytes of each direction's copies in a step (the runtime's observers' ``host_copy``)
        self._on_copy = on_copy or (lambda direction, nbytes: None)

    @property
    def master_on_host(self) -> bool:
        """The fp32 master lives only in host memory (offloaded under mixed precision)."""
        return any(s.compute is not None for s in self.shards)

    @property
    def active(self) -> bool:
        return self.placement is Offload.OPTIMIZER

    def place(self, placement: Offload, compute: Mapping[int, torch.Tensor] | None = None) -> None:
        """Move the optimizer's parameters and state to ``placement`` (between iterations).
        ``compute``: by ``id`` of a device shard, the device tensor in the compute dtype that
        takes its stepped values while offloaded, its shard then freed (mixed precision)."""
        if placement is self.placement:
            return
        if placement is Offload.OPTIMIZER:
            self._to_host(compute or {})
        else:
            self._to_device()
        self.placement = placement

    def _host_tensor(self, value: torch.Tensor) -> torch.Tensor:
        out = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self.pin)
        out.copy_(value.detach())
        return out

    def _to_host(self, compute: Mapping[int, torch.Tensor]) -> None:
        """Re-point every group at host copies of its (device shard) parameters; state moves too.
        ``capturable`` (CUDA graphs: state on the device) is off while the group steps on the host.
        A shard with a compute copy gives it its values; its device storage is freed after."""
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
                self.shards.append(HostShard(d, h, grad, compute.get(id(d))))
                self._host_of[id(d)] = h
                if d in state:
                    state[h] = {k: self._host_tensor(v) if torch.is_tensor(v) else v for k, v in state.pop(d).items()}
                hosts.append(h)
            group["params"] = hosts
        self._free_device_masters()

    def _free_device_masters(self) -> None:
        """Every shard with a compute copy: the copy takes the shard's values (cast), and the
        shard's storage (shared by a ZeRO-3 block's units) is resized to 0 bytes."""
        storages: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for s in self.shards:
                if s.compute is not None:
                    s.compute.copy_(s.device)
                    storage = s.device.untyped_storage()
                    if storage.nbytes():
                        storages[storage.data_ptr()] = storage
        self._freed = [(storage, storage.nbytes()) for storage in storages.values()]
        for storage, _ in self._freed:
            storage.resize_(0)

    def _to_device(self) -> None:
        """Re-point every group back at the device shards; per-element state moves to the device,
        other state (Adam's ``step`` counter) stays where torch keeps it for device parameters."""
        device_of = {id(s.host): s for s in self.shards}
        for storage, nbytes in self._freed:  # the device masters again, to be filled from the host
            storage.resize_(nbytes)
        self._freed = []
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

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """Where the master values of the stage's shard ``param`` live: its host copy where the
        device's is freed (``master_on_host``), else ``param`` itself (a loaded value goes there)."""
        return self._host_of[id(param)] if self.master_on_host else param

    def step(self) -> None:
        """One optimizer step on the shards' gradients (``.grad`` of the device shards)."""
        if not self.active:
            self.optimizer.step()
            return
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        copied = 0
        for s in self.shards:  # device to host: every copy queued, then one wait
            if s.device.grad is None:
                s.host.grad = None
                continue
            s.grad.copy_(s.device.grad, non_blocking=self.pin)
            s.host.grad = s.grad
            copied += nbytes(s.grad)
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()
        self._on_copy(CopyDirection.TO_HOST, copied)
        self.optimizer.step()
        with torch.no_grad():
            for s in self.shards:  # host to device: ordered before the stage's next use on the stream
                (s.device if s.compute is None else s.compute).copy_(s.host, non_blocking=self.pin)
                s.host.grad = None
        self._on_copy(CopyDirection.TO_DEVICE, sum(nbytes(s.host) for s in self.shards))

    def refresh(self) -> None:
        """After the stage's state was loaded: the host copy takes the device shard's values, or
        (master on the host, where the stage loaded it) the compute copy takes the host's."""
        with torch.no_grad():
            for s in self.shards:
                if s.compute is None:
                    s.host.copy_(s.device)
                else:
                    s.compute.copy_(s.host)

    def memory_report(self) -> dict[str, int]:
        """Host bytes of an offloading rank (none otherwise): the fp32 master copies, the
        gradient buffers and the optimizer state."""
        if not self.active:
            return {}
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        return {"host_master_params": sum(nbytes(s.host) for s in self.shards),
                "host_grads": sum(nbytes(s.grad) for s in self.shards),
                "host_optimizer": optimizer_state_bytes(self.optimizer)}
