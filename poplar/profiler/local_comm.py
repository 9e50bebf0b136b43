"""A ZeRO runtime that believes it is rank r of N but never talks to another process.

The capacity search must not run collectives (docs/design.md §4, the deadlock trap: an OOM on one
rank in the middle of a ZeRO-2/3 step would leave the others waiting in a collective). It still
needs the memory of the real runtime at world size N: shards of size 1/N, stage-2 buckets,
stage-3 gathered blocks of full size. ``LocalCommunicator`` gives the runtime exactly that: the
same buffers, and collectives that are local copies (its route, ``poplar.comm.routes.PretendWorld``):

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

from typing import Any

import torch
from torch import nn

from poplar.types.plans import Offload, Plan, RankPlan
from poplar.types.precision import MixedPrecision
from poplar.comm import CommLedger, Communicator
from poplar.comm.routes import PretendWorld
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import ZeroRuntime


class LocalCommunicator(Communicator):
    """Rank ``rank`` of a pretend world of ``world_size``: right-sized buffers, no peers. Its
    route is a ``PretendWorld`` whatever the plan's: a plan that leaves ranks out makes no process
    group (``dist.new_group`` here would be a collective over the real world that only this rank
    joins, and would wait for ever), and changes only the parts' sizes, which its shard weights give."""

    def __init__(self, world_size: int, rank: int, device: torch.device | None = None,
                 ledger: CommLedger | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        super().__init__(device=device, ledger=ledger, world=PretendWorld(world_size, rank))


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
