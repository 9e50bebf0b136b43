"""The whole model state of a ZeRO-3 stage, read from and written to the ranks' shards.

``full_state_dict`` is a collective (every block is gathered in turn, between iterations);
under mixed precision it gathers the fp32 master shards, not the compute copy, so the state is
what the optimizer steps (a rank that offloads its optimizer sends its host master). ``load_full_state_dict``
needs no collective: every rank is given the whole state and copies its own part into its master
shards, wherever they live. ``reshard`` moves the shards to other shard weights (a collective,
between iterations).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from poplar.comm import Communicator, Phase
from poplar.zero.blocks import ShardedBlock
from poplar.zero.flat import FlatUnit
from poplar.zero.offload import OptimizerOffload
from poplar.zero.precision import StagePrecision
from poplar.zero.reshard import cut_state, gather_state
from poplar.zero.shard_layout import Shards


class ShardedState(Protocol):
    """What these functions need of a ZeRO-3 stage (``poplar.zero.sharded.Stage3``)."""

    model: nn.Module
    blocks: list[ShardedBlock]
    comm: Communicator
    precision: StagePrecision
    optimizer: torch.optim.Optimizer
    units: list[FlatUnit]
    shard_params: list[nn.Parameter]
    offload: OptimizerOffload

    @property
    def in_pass(self) -> bool: ...
    def gather_now(self, b: ShardedBlock) -> None: ...
    def free_gather(self, b: ShardedBlock) -> None: ...
    def unsharded_value(self, v: torch.Tensor) -> torch.Tensor: ...
    def load_unsharded(self, v: torch.Tensor, value: torch.Tensor) -> None: ...
    def check_state_fits(self, state: dict[str, torch.Tensor], shape: dict[str, Any]) -> None: ...
    def point_optimizer(self) -> None: ...


def reshard(stage: ShardedState, shards: Shards) -> None:
    """Cut every block by new ``shards``: each block's full fp32 values and the optimizer
    state are gathered over the old cut and cut again (``poplar.zero.reshard``)."""
    if stage.in_pass:
        raise RuntimeError("ZeRO-3: re-sharding inside a micro-step; change the plan between iterations")
    states = gather_state(stage.comm, stage.optimizer, stage.units, stage.shard_params)
    old = stage.shard_params
    with torch.no_grad():
        for b in stage.blocks:
            b.reshard(shards, b.gather_master(stage.comm))
    stage.point_optimizer()
    cut_state(stage.optimizer, stage.units, old, stage.shard_params, states)


def full_state_dict(stage: ShardedState) -> dict[str, torch.Tensor]:
    """Every block gathered in turn (a collective: all ranks call it, between iterations)."""
    if stage.in_pass:
        raise RuntimeError("ZeRO-3: full_state_dict() inside a micro-step; call it between iterations")
    sd = stage.model.state_dict(keep_vars=True)
    owner = {id(p): b.index for b in stage.blocks for p in b.params}
    out = {k: stage.unsharded_value(v) for k, v in sd.items() if id(v) not in owner}
    with stage.comm.ledger.scope(Phase.STATE):
        for b in stage.blocks:
            if stage.precision.separate_master:
                flats = b.gather_master(stage.comm, master_shard(stage, b))
                value = {id(p): u.slot(flats[k], i).clone()
                         for k, u in enumerate(b.units) for i, p in enumerate(u.params)}
                out.update({k: value[id(v)] for k, v in sd.items() if owner.get(id(v)) == b.index})
                continue
            stage.gather_now(b)
            out.update({k: v.detach().clone() for k, v in sd.items() if owner.get(id(v)) == b.index})
            stage.free_gather(b)
    return {k: out[k] for k in sd}


def load_full_state_dict(stage: ShardedState, state: dict[str, torch.Tensor]) -> None:
    """Set each rank's shards (and the unsharded tensors: buffers, frozen parameters) from a
    complete state, without a collective; ValueError before any change if it does not fit."""
    sd = stage.model.state_dict(keep_vars=True)
    where = {id(p): (b, k, i) for b in stage.blocks for k, u in enumerate(b.units) for i, p in enumerate(u.params)}
    shape = {key: v.shape for key, v in sd.items()}  # a sharded parameter's own shape is empty
    shape.update({key: where[id(v)][0].units[where[id(v)][1]].shapes[where[id(v)][2]]
                  for key, v in sd.items() if id(v) in where})
    stage.check_state_fits(state, shape)
    with torch.no_grad():
        for key, v in sd.items():
            if id(v) in where:  # a tied parameter is loaded once per key, with equal values
                b, k, i = where[id(v)]
                b.load_param(k, i, state[key], stage.offload.master(b.shard_params[k]))
            else:
                stage.load_unsharded(v, state[key])
    stage.offload.refresh()  # the host copies, or the compute copies of an offloaded master


def master_shard(stage: ShardedState, b: ShardedBlock) -> torch.Tensor | None:
    """A device copy of block ``b``'s fp32 master shard where it lives on the host (offloaded
    under mixed precision), else None (``b.shard`` is the master)."""
    if not stage.offload.master_on_host:
        return None
    return torch.cat([stage.offload.master(sp).detach() for sp in b.shard_params]).to(b.device)


def compute_copies(stage: ShardedState) -> dict[int, torch.Tensor] | None:
    """Mixed precision: each block keeps its shard in the compute dtype while its master is
    offloaded; by ``id`` of each optimizer parameter, its unit's slice of that shard."""
    if not stage.precision.separate_master:
        return None
    return {id(sp): view for b in stage.blocks for sp, view in zip(b.shard_params, b.hold_compute_shard())}


def drop_compute_copies(stage: ShardedState) -> None:
    """The master is back on the device: the compute-dtype shards go."""
    for b in stage.blocks:
        b.compute_shard = None


def kept_bytes(stage: ShardedState) -> tuple[int, int]:
    """(parameter, fp32 master) bytes of this rank's shards on the device: the shard is the
    parameters' or, under mixed precision, the master's; an offloaded master leaves the
    compute-dtype shard, counted as parameters."""
    if stage.offload.master_on_host:
        return sum(b.compute_shard.numel() * b.compute_shard.element_size()
                   for b in stage.blocks if b.compute_shard is not None), 0
    shards = sum(b.shard.numel() * b.element_size for b in stage.blocks)
    return (0, shards) if stage.precision.separate_master else (shards, 0)
