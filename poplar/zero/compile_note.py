"""What ``torch.compile`` costs a run on a CPU, said once.

[Note: compiling on a CPU]
A compiled module pays its compile at its first call and again for each new input shape: one
graph per micro-batch size a rank runs (dynamo specialises a batch of 1). On a GPU the faster
kernels repay that over a run; on a CPU they gain little, and the compile time dominates a short
run (ten steps of a small model: minutes compiled against seconds eager). Whether to compile is
the user's choice, so nothing changes: a run on a CPU whose model has compiled modules says so
in one line (rank 0), once, where the engine is built or at its first step (a model compiled
after the engine is built, as whole-model compile may be, is seen there).

torch has no public query for a compiled module: ``Module.compile()`` keeps the compiled call in
``Module._compiled_call_impl`` and ``torch.compile(module)`` returns ``torch._dynamo``'s
``OptimizedModule`` wrapper. Both are read here, for this note only; where torch's dynamo was
never imported nothing can be compiled, and nothing is read.
"""

from __future__ import annotations

import sys

from torch import nn

from poplar.logs import log
from poplar.zero.observers import StepObserver


def compiled_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules whose call is compiled ("" for the model itself)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # torch.compile imports it: nothing is compiled
        return []
    wrapper = getattr(eval_frame, "OptimizedModule", ())
    return [name for name, m in model.named_modules()
            if isinstance(m, wrapper) or getattr(m, "_compiled_call_impl", None) is not None]


def compile_line(names: list[str]) -> str:
    """The note (module doc) for the compiled modules ``names``."""
    shown = ", ".join(n or "the model" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"torch.compile on CPU: {len(names)} compiled module{'s' if len(names) != 1 else ''} ({shown}); each "
            "compiles at its first call and again for each new micro-batch size, which on a CPU dominates a short "
            "run (minutes, where eager steps take seconds): train eagerly on CPU, or compile where the run is on GPUs")


class CompileNote(StepObserver):
    """The note of a run on a CPU whose model has compiled modules (module doc): ``check()``
    where the engine is built, and again at the first step; said once, on rank 0."""

    def __init__(self, model: nn.Module, on_cpu: bool, rank: int) -> None:
        self.model, self.active = model, on_cpu and rank == 0
        self.said = False

    def check(self) -> None:
        if not self.active or self.said:
            return
        names = compiled_modules(self.model)
        if names:
            log.info(compile_line(names))
            self.said = True

    def iteration_start(self, iteration: int) -> None:
        self.check()
        self.active = False  # the first step of this engine is the last look
