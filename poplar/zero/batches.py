"""Batches as the engine takes them: a tensor, or a tuple/list/dict of tensors (nested is fine),
with samples on dim 0. Non-tensor leaves are passed through unchanged to every micro-step."""

from __future__ import annotations

from typing import Any

import torch


def batch_size_of(batch: Any) -> int:
    """Number of samples (dim 0), the same in every tensor, or a ValueError saying which differ."""
    sizes: dict[str, int] = {}

    def visit(x: Any, path: str) -> None:
        if torch.is_tensor(x):
            if x.dim() == 0:
                raise ValueError(f"batch{path} is a 0-d tensor; samples must be on dim 0")
            sizes[path or "<tensor>"] = x.shape[0]
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{path}[{i}]")

    visit(batch, "")
    if not sizes:
        raise ValueError(f"batch holds no tensor (got {type(batch).__name__}); pass a tensor, or a "
                         "tuple/list/dict of tensors with samples on dim 0")
    distinct = set(sizes.values())
    if len(distinct) > 1:
        raise ValueError(f"batch tensors disagree on the number of samples (dim 0): {sizes}")
    return distinct.pop()


def slice_batch(batch: Any, start: int, length: int) -> Any:
    """Samples ``start .. start+length`` of every tensor in the batch (views, no copy)."""
    if torch.is_tensor(batch):
        return batch.narrow(0, start, length)
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, start, length)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, start, length) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, length) for v in batch)
    return batch


def move_to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor of a (nested) batch on ``device``; other leaves unchanged."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, move_to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    return batch
