"""Post-accumulate-grad hooks that hold their owner weakly.

A hook registered with ``Tensor.register_post_accumulate_grad_hook`` is kept by the parameter's
C++ side, where Python's cycle collector cannot see it. A hook that refers to the ZeRO stage,
which refers to the module and so back to the parameter, therefore forms a cycle the collector
can never free: every engine ever built (each profiler trial builds one) would stay alive with
its model. These hooks reach their owner through a weak reference and carry only plain values.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle


def on_grad_accumulated(param: torch.Tensor, method: Callable[..., Any], *args: int) -> RemovableHandle:
    """Call ``method(*args, param)`` after ``param``'s gradient is accumulated, for as long as
    ``method``'s object lives. ``method`` must be a bound method; ``args`` plain indices (never
    the module or anything that refers to it)."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, p)

    return param.register_post_accumulate_grad_hook(hook)
