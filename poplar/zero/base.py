"""What every ZeRO stage provides to the engine.

The engine drives an iteration as: for each micro-step ``begin_micro_step`` → forward →
backward → ``end_micro_step`` (or ``empty_micro_step`` when this rank has no samples left but
the stage communicates inside micro-steps), then ``reduce_gradients`` → clipping on
``grad_tensors`` → ``optimizer_step`` → ``zero_grad``. A stage decides what each rank holds
and which collectives run where.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from poplar.zero.comm import Communicator
from poplar.zero.flat import FlatUnit
from poplar.zero.optim import optimizer_state_bytes


class ZeroStage(ABC):
    stage: int = -1
    communicates_in_micro_steps: bool = False  # True for 2 and 3: every rank must join each micro-step
    grads_sharded: bool = True  # False when every rank holds the full reduced gradient (stage 0)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator,
                 units: list[FlatUnit]) -> None:
        self.model, self.optimizer, self.comm, self.units = model, optimizer, comm, units
        self.peak_transient_bytes = 0  # largest communication buffers held at once, measured
        self._transient = 0

    # -- bookkeeping of temporary communication buffers (reported by memory_report) --
    def _hold(self, nbytes: int) -> None:
        self._transient += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._transient)

    def _release(self, nbytes: int) -> None:
        self._transient -= nbytes

    # -- the iteration, as the engine drives it --
    def begin_micro_step(self) -> None:
        pass

    def end_micro_step(self) -> None:
        pass

    def empty_micro_step(self) -> None:
        """Take part in a micro-step's collectives with a zero contribution."""

    @abstractmethod
    def reduce_gradients(self) -> None:
        ...

    @abstractmethod
    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds after ``reduce_gradients`` (full or shard)."""
        ...

    @abstractmethod
    def optimizer_step(self) -> None:
        ...

    @abstractmethod
    def zero_grad(self) -> None:
        ...

    # -- state --
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @abstractmethod
    def param_bytes(self) -> int:
        ...

    @abstractmethod
    def grad_bytes(self) -> int:
        ...

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: model states, module buffers, and the peak of the engine's
        temporary communication buffers (``comm_buffers``)."""
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        frozen = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.requires_grad)
        return {
            "params": self.param_bytes() + frozen,
            "grads": self.grad_bytes(),
            "optimizer": optimizer_state_bytes(self.optimizer),
            "buffers": buffers,
            "comm_buffers": self.peak_transient_bytes,
        }
