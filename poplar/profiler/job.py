"""What a profiling run trains and how it measures: ``ProfileJob`` (the model, its loss, its
batches, its optimizer) and ``ProfileOptions`` (the runtime settings, the measurement policy).

``ProfilingPolicy`` holds the knobs of the measurement itself (how many repeats, how precise
the exposure, how far the capacity search goes, whether a stage where batch 1 does not fit
escalates, a progress bar). ``ProfileOptions`` and auto mode's ``AutoOptions`` are both a
``ProfilingPolicy``: auto mode hands its own to the profiler whole (``ProfilingPolicy.policy``),
so a knob added here reaches both without being copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch
from torch import nn

from poplar.profiler.capacity import DEFAULT_MAX_BATCH
from poplar.profiler.escalation import OffloadEscalation
from poplar.profiler.exposure import EXPOSURE_PRECISION
from poplar.types.configuration import Configuration
from poplar.types.plans import Offload
from poplar.types.profiles import Emulated
from poplar.types.precision import MixedPrecision, resolve_precision
from poplar.types.topology import Topology
from poplar.zero.config import ZeroConfig
from poplar.zero.nonfinite import SkipReport


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """fp32 AdamW: 8 bytes of state per parameter, the K of docs/design.md §3."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def model_size(model: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of one copy of the parameters), tied weights once."""
    params = list(model.parameters())  # unique objects
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


@dataclass(kw_only=True)
class ProfilingPolicy:
    """How a profile is measured (the same knobs for ``poplar.profile`` and auto mode)."""

    repeats: int = 3  # measurements per timed batch size (the smallest is kept)
    # steady timing rounds go on until the exposed communication is known to this fraction of a
    # round (poplar.profiler.exposure; 0: the fewest rounds, a quicker and rougher profile)
    exposure_precision: float = EXPOSURE_PRECISION
    max_batch: int = DEFAULT_MAX_BATCH  # the capacity search stops here even if more would fit
    # move to the next ZeRO stage when batch 1 does not fit on some rank (auto mode: with
    # zero_stage="auto" and choose="first_fit"; a given stage never moves: it is binding)
    escalate: bool = True
    progress: bool = True  # progress lines and bars of the profiling (rank 0, on a terminal)

    def policy(self) -> ProfilingPolicy:
        """These knobs alone (of a ``ProfileOptions`` or an ``AutoOptions``)."""
        return ProfilingPolicy(**{f.name: getattr(self, f.name) for f in fields(ProfilingPolicy)})


@dataclass
class ProfileOptions(ProfilingPolicy):
    zero_stage: int = 0
    max_extra_passes: int = 3  # re-measure points whose minimum no second measurement confirms
    tolerance: float = 0.02  # ... within this relative difference
    bucket_size_mb: float = 25.0
    wrap_policy: Any = None
    measure_comm: bool = True
    model_name: str = ""
    emulated: Emulated | None = None  # the emulator's scales and calibration (``Provenance.emulated``)
    # the precision policy training will run (None: fp32); "bf16" / "fp16" are resolved to one
    mixed_precision: MixedPrecision | str | None = None
    # the runtime's activation_checkpointing (None / False off, True, or a module policy)
    activation_checkpointing: Any = None
    # each rank's shard weight in the capacity searches and timing rounds (None: even shards)
    shard_weights: tuple[float, ...] | None = None
    # where each rank's optimizer lives in the capacity searches and timing rounds (None: on every device)
    offloads: tuple[Offload, ...] | None = None
    # whether ranks that fit batch 1 at no stage may search ZeRO-3 again with their optimizer offloaded
    offload_escalation: OffloadEscalation = OffloadEscalation.NEVER
    # time each rank past its mbs at shard weights that give it the room (``shard_room``), for
    # planning shard weights; off: the curve past mbs is extended at constant speed
    time_past_mbs: bool = True
    # the job's nodes (None: one node): on a topology that spans nodes the links are measured per
    # node and across nodes as well (``poplar.profiler.links``)
    topology: Topology | None = None
    # the buffer bytes the link probes time (None: ``poplar.profiler.links.probe_sizes``, 16 KB
    # to 4 MB, none past the model's bytes)
    comm_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.mixed_precision = resolve_precision(self.mixed_precision)
        try:
            self.offload_escalation = OffloadEscalation(self.offload_escalation)
            self.offloads = None if self.offloads is None else tuple(Offload(o) for o in self.offloads)
        except (TypeError, ValueError):
            raise ValueError(f"offloads must be one Offload per rank (\"none\" / \"optimizer\") and offload_escalation "
                             f"one of {[e.value for e in OffloadEscalation]}, got {self.offloads!r} and "
                             f"{self.offload_escalation!r}") from None
        if not self.exposure_precision >= 0:
            raise ValueError(f"exposure_precision must be >= 0 (a fraction of a round's time; 0: the fewest "
                             f"steady rounds), got {self.exposure_precision}")

    def zero_config(self, stage: int, process_group: Any = None) -> ZeroConfig:
        """The runtime settings the profiled runtimes use at ``stage``: a trial step skipped for an
        fp16 overflow is counted (``overflowing_trials`` in the profile's notes), not logged as a
        skipped optimizer step (the loss scaler backs off as in training)."""
        return ZeroConfig(stage, self.bucket_size_mb, self.wrap_policy, process_group, skip_report=SkipReport.COUNT)


@dataclass
class ProfileJob:
    """What a profiling run trains: the model (``model_fn()`` builds a fresh copy, the same on
    every call), its loss, batches of any size (``sample_fn(b)``), an optimizer for a model
    (``optimizer_fn(model)``: its state is part of memory), and the options.

    ``heaviest``: the heaviest configuration the run may time beyond the options' own (auto
    mode's candidates), for an observer whose set-up must cover it (an emulated device's scales)."""

    model_fn: Callable[[], nn.Module]
    loss_fn: Callable
    sample_fn: Callable[[int], Any]
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] = field(default=None)  # type: ignore[assignment]
    options: ProfileOptions = field(default_factory=ProfileOptions)
    heaviest: Configuration | None = None

    def __post_init__(self) -> None:
        if self.optimizer_fn is None:
            self.optimizer_fn = default_optimizer

    def at(self, configuration: Configuration) -> "ProfileJob":
        """The same job profiled at ``configuration``."""
        return replace(self, options=replace(self.options, zero_stage=configuration.stage,
                                             activation_checkpointing=configuration.checkpointing))

    def placed(self, shard_weights: tuple[float, ...] | None, offloads: tuple[Offload, ...] | None) -> "ProfileJob":
        """The same job with its searches and rounds at these shard weights and optimizer placements."""
        return replace(self, options=replace(self.options, shard_weights=shard_weights, offloads=offloads))
