"""``ZeroConfig``: the ZeRO runtime's settings beyond the model, the plan and the precision.

The stage, and the rarer knobs a stage reads: the gradient bucket size of stages 0-2 (each
bucket is one collective), which modules form a gather/release block at stage 3, the process
group, and what every rank does when a loss or gradient on some rank is not finite. Where a
runtime or engine takes ``zero_stage``, a plain int means ``ZeroConfig(stage=that)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from poplar.comm import Communicator

from poplar.types.topology import Topology
from poplar.zero.nonfinite import NonFinitePolicy, SkipReport


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO settings (see the module doc).

    Args:
        stage: 0, 1, 2 or 3; or "auto" in the engine's auto mode (auto mode chooses the stage).
        bucket_size_mb: gradient bucket size of stages 0-2.
        wrap_policy: stage 3 only: which modules form a gather/release block (module classes,
            or a callable taking a module and returning whether it is a block).
        process_group: defaults to the world group; without ``torch.distributed`` initialised
            the runtime runs as a world of one.
        nonfinite: ``NonFinitePolicy`` (or "skip" / "raise"): what every rank does when a loss or
            gradient on some rank is inf or NaN.
        max_consecutive_skips: with "skip", more non-finite steps in a row than this raise (under
            fp16 dynamic loss scaling only those at the minimum scale count).
        skip_report: ``SkipReport.LOG`` warns of each skipped step on rank 0; ``COUNT`` only
            counts it (profiling's trial steps).
        topology: the job's nodes (``poplar.Topology``); None: from the launcher (torchrun's
            ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``), else one node. On a topology that spans
            nodes the plan's ``hierarchical`` and ``secondary_shards`` choose the collectives.
    Values are checked when a runtime is built on them (every rank agrees on the verdict).
    """

    stage: int | str = 0
    bucket_size_mb: float = 25.0
    wrap_policy: Any = None
    process_group: Any = None
    nonfinite: NonFinitePolicy | str = NonFinitePolicy.SKIP
    max_consecutive_skips: int = 5
    skip_report: SkipReport = SkipReport.LOG
    topology: Topology | None = None

    @classmethod
    def of(cls, zero_stage: "int | ZeroConfig") -> "ZeroConfig":
        """``zero_stage`` as a config: a config stays as it is, anything else is its stage (checked
        with the other arguments when the runtime is built)."""
        return zero_stage if isinstance(zero_stage, ZeroConfig) else cls(stage=zero_stage)


def communicator_for(config: ZeroConfig, device: torch.device) -> Communicator:
    """The communicator of a runtime on ``config``: its process group, and its topology, or the
    launcher's (``Topology.from_launcher``) when none is declared and the group is the world's.
    A topology that spans nodes creates its node groups here, once (every rank together)."""
    topology = config.topology
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"ZeroConfig(topology=...) takes a poplar.Topology, e.g. Topology(nodes=[[0, 1], [2, 3]]), "
                        f"got {topology!r}")
    if topology is None and config.process_group is None and dist.is_available() and dist.is_initialized():
        topology = job_topology(None, dist.get_world_size())
    return Communicator(config.process_group, device, topology=topology)


def job_topology(declared: Topology | None, world: int) -> Topology:
    """The nodes of a job of ``world`` ranks: the ``declared`` topology, else the launcher's
    (``Topology.from_launcher``: torchrun's node rank and local world size). The one place a job
    asks the launcher, so the runtime and the config door never see two answers."""
    return declared if declared is not None else Topology.from_launcher(os.environ, world)
