"""Poplar's module hooks under ``torch.compile``: they run eagerly, never traced.

[Note: Poplar's hooks run eagerly under torch.compile]
``module.compile()`` compiles the module's ``__call__``, hooks included, so dynamo traces into
every forward hook registered on a compiled module: the engine's hooks on the model and ZeRO-3's
gather/release hooks on the root and on each block. What they do is bookkeeping and collectives,
not tensor math: counting micro-steps, telling observers, walking the schedule of all-gathers,
resizing a released block's storage, reading clocks. Traced, dynamo breaks the graph on each of
them (``UntypedStorage.resize_``, ``time.perf_counter``, the collectives) or, worse, bakes a
Python decision of one call into the compiled code. So each is registered wrapped in
``torch.compiler.disable``: it runs as Python, once per call, as in eager mode. A disabled hook
at the edge of a compiled ``__call__`` costs no graph break (dynamo runs it before, or after,
the graph of the module's forward): per-block compile at every stage and whole-model compile at
stages 0-2 trace one graph per compiled module. Inside a compiled forward — ZeRO-3's block hooks
under whole-model compile — each is a break, where the block's parameters are gathered
(docs/design.md §3.11).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

Hook = TypeVar("Hook", bound=Callable)


def eager_hook(hook: Hook) -> Hook:
    """``hook``, to register on a module, run eagerly when the module is compiled."""
    return torch.compiler.disable(hook)
