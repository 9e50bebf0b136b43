"""Building the ``ZeroStage`` a runtime asked for: stage 3 (blocks, ``zero.sharded``) or stages
0-2 (gradient buckets over replicated parameters, ``zero.replicated``), first parameter sync
included, its collectives recorded in the set-up phase of the ledger."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poplar.comm import Communicator, Phase
from poplar.zero.base import StageHooks, ZeroStage
from poplar.zero.flat import gradient_buckets
from poplar.zero.precision import StagePrecision


def build_stage(zero_stage: int, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                groups: list, bucket_size_mb: float, wrap_policy: Any, precision: StagePrecision,
                hooks: StageHooks, shard_weights: tuple[float, ...] | None = None) -> ZeroStage:
    """The stage for ``zero_stage`` (0-3) over ``groups`` (the optimizer's (name, param) groups);
    ``hooks`` are what the stage tells the runtime's observers as it happens; ``shard_weights``
    (one per rank, None = even) sets each rank's share of the sharded state."""
    with comm.ledger.scope(Phase.SETUP):
        if zero_stage == 3:
            from poplar.zero.sharded import Stage3
            return Stage3(model, optimizer, comm, groups, wrap_policy, hooks=hooks, precision=precision,
                          shard_weights=shard_weights)
        from poplar.zero.replicated import Stage0, Stage2
        from poplar.zero.stage1 import Stage1

        units = gradient_buckets(model, groups, comm.world_size, comm.rank, bucket_size_mb, shard_weights)
        stage_class = {0: Stage0, 1: Stage1, 2: Stage2}[zero_stage]
        stage = stage_class(model, optimizer, comm, units, precision=precision, hooks=hooks)
        stage.sync_params()
        return stage
