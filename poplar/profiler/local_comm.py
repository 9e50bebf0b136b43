"""A ZeRO runtime that believes it is rank r of N but never talks to another process.

The capacity search must not run collectives (docs/design.md §4, the deadlock trap: an OOM on one
rank in the middle of a ZeRO-2/3 step would leave the others waiting in a collective). It still
needs the memory of the real runtime at world size N: shards of size 1/N, stage-2 buckets,
stage-3 gathered blocks of full size. ``LocalCommunicator`` gives the runtime exactly that: the
same buffers, and collectives that are local copies:

- all-gather: every slice of the output receives this rank's input (the other ranks' shards are
  unknown; tiling keeps the gathered weights finite and of the right magnitude);
- reduce-scatter: the output receives this rank's slice of its own input;
- all-reduce: unchanged (this rank's contribution is the sum: the search's plan gives every other
  rank zero samples, so the runtime's sample count agrees);
- all-gather of objects: N copies of this rank's object.

A ``quantization`` is ignored: nothing is sent, so nothing is quantized (the buffers a quantized
collective stages are counted by ``staging_bytes``, as on a real communicator).

``local_engine`` builds a ``ZeroRuntime`` on it; the search switches its plan every trial
(``set_plan(plan, PlanCheck.LOCAL)``: no agreement, there are no peers).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from poplar.types.plans import Offload, Plan, RankPlan
from poplar.types.precision import MixedPrecision
from poplar.comm import CommLedger, Communicator, PendingCollective
from poplar.types.compression import Quantization
from poplar.types.topology import Wire
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import ZeroRuntime


class LocalCommunicator(Communicator):
    """Rank ``rank`` of a pretend world of ``world_size``: right-sized buffers, no peers."""

    def __init__(self, world_size: int, rank: int, device: torch.device | None = None,
                 ledger: CommLedger | None = None) -> None:  # noqa: D107 - no super().__init__: no process group
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.distributed = False
        self.group = None
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self.ledger = ledger or CommLedger()
        self.backend = "local"
        self.wire = Wire.world(world_size)

    def set_step_ranks(self, ranks: Sequence[int]) -> None:
        """Nothing to make: a pretend world has no process groups (``dist.new_group`` here would be
        a collective over the real world that only this rank joins, and would wait for ever), and
        every collective is already this rank's own copy. A plan that leaves ranks out changes only
        the parts' sizes, which its shard weights give."""

    def _local(self, op: str, nbytes: int, fn: Any, async_op: bool, tag: str) -> PendingCollective | None:
        timer = self.start_timer()
        fn()
        blocked = timer.stop()
        if async_op:  # the runtime's own handle, already complete (no work to wait for)
            return PendingCollective(self, None, op, nbytes, blocked, tag)
        self.ledger.add(op, nbytes, blocked, tag)
        return None

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = False) -> PendingCollective | None:
        return self._local("all_reduce", tensor.numel() * tensor.element_size(), lambda: None, async_op, tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                       async_op: bool = False, sizes: Sequence[int] | None = None,
                       quantization: Quantization | None = None) -> PendingCollective | None:
        def run() -> None:
            if sizes is None:
                output.copy_(input.view(self.world_size, -1)[self.rank].view_as(output))
            else:
                output.copy_(input.split(list(sizes))[self.rank])
        return self._local("reduce_scatter", input.numel() * input.element_size(), run, async_op, tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str = "",
                   async_op: bool = False, sizes: Sequence[int] | None = None,
                   quantization: Quantization | None = None) -> PendingCollective | None:
        def run() -> None:
            if sizes is None:
                output.view(self.world_size, -1).copy_(input.reshape(1, -1).expand(self.world_size, -1))
                return
            for part in output.split(list(sizes)):  # each part: this rank's values, repeated to fit
                n = part.numel()
                if n and input.numel():
                    part.copy_(input.reshape(-1).repeat(-(-n // input.numel()))[:n])
                else:
                    part.zero_()
        return self._local("all_gather", output.numel() * output.element_size(), run, async_op, tag)

    def all_gather_object(self, obj: Any, tag: str = "") -> list[Any]:
        return [obj] * self.world_size

    def barrier(self) -> None:
        pass


def search_plan(world_size: int, rank: int, batch: int, shard_weights: tuple[float, ...] | None = None,
                offloads: tuple[Offload, ...] | None = None) -> Plan:
    """The plan of one capacity-search trial: this rank runs one micro-step of ``batch``, the
    (pretend) others none, so the global batch is ``batch``; ``shard_weights``: each rank's share
    of the sharded state (None: even); ``offloads``: where each rank's optimizer lives (None: on
    the device)."""
    weights = shard_weights or (1.0,) * world_size
    places = offloads or (Offload.NONE,) * world_size
    rows = [RankPlan(0, 0, 0, shard_weight=w, offload=o) for w, o in zip(weights, places)]
    rows[rank] = RankPlan(batch, 1, 0, shard_weight=weights[rank], offload=places[rank])
    return Plan(rows)


def round_plan(batches: list[int], shard_weights: tuple[float, ...] | None = None,
               offloads: tuple[Offload, ...] | None = None) -> Plan:
    """One lock-step timing round: rank i runs one micro-step of ``batches[i]`` samples, at
    these shard weights (None: even) and optimizer placements (None: on every device)."""
    weights = shard_weights or (1.0,) * len(batches)
    places = offloads or (Offload.NONE,) * len(batches)
    return Plan([RankPlan(b, 1, 0, shard_weight=w, offload=o) for b, w, o in zip(batches, weights, places)])


def local_engine(model: nn.Module, optimizer: torch.optim.Optimizer, *, world_size: int, rank: int,
                 zero_stage: ZeroConfig, device: torch.device, mixed_precision: MixedPrecision | None = None,
                 activation_checkpointing: Any = None, shard_weights: tuple[float, ...] | None = None,
                 offloads: tuple[Offload, ...] | None = None) -> ZeroRuntime:
    """A ZeRO runtime for rank ``rank`` of ``world_size`` on a ``LocalCommunicator`` (its plan's
    shard weights and optimizer placements: ``search_plan``'s)."""
    comm = LocalCommunicator(world_size, rank, device)
    return ZeroRuntime(model, optimizer, zero_stage=zero_stage, plan=search_plan(world_size, rank, 1, shard_weights, offloads),
                       communicator=comm, mixed_precision=mixed_precision,
                       activation_checkpointing=activation_checkpointing)
