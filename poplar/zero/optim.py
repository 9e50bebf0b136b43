"""Binding the user's optimizer to the model: which parameters it trains, in which group, and
re-pointing its groups at this rank's shards (stages 1-3) while keeping each group's settings;
and building a twin of it (same class and group settings) over other parameters."""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import nn


def named_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer
                       ) -> tuple[list[list[tuple[str, nn.Parameter]]], str | None]:
    """For each optimizer param group, its (name, parameter) pairs in model order.

    Returns (groups, error); error is a message naming the problem and the fix, or None.
    Parameters with ``requires_grad=False`` are frozen: not trained, not sharded.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # tied weights appear once
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    groups: list[list[tuple[str, nn.Parameter]]] = []
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        members = []
        for p in group["params"]:
            if id(p) not in names:
                return [], (f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that is not "
                            "a parameter of the model; build the optimizer on model.parameters() "
                            "(or groups of them) before creating the engine")
            if not p.requires_grad:
                continue
            members.append((names[id(p)], p))
            seen.add(id(p))
        members.sort(key=lambda np_: order[id(np_[1])])
        groups.append(members)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        return [], (f"model parameters {missing[:5]} require grad but are not in the optimizer; add them to "
                    "the optimizer or set requires_grad=False to freeze them")
    if not any(groups):
        return [], "the optimizer holds no trainable parameter of the model"
    if optimizer.state:
        return [], ("the optimizer already has state (it has stepped); create the engine before the first "
                    "optimizer step, or load optimizer state through the engine's checkpoint")
    return groups, None


def repoint_optimizer(optimizer: torch.optim.Optimizer, shards_per_group: list[list[nn.Parameter]]) -> None:
    """Replace each group's parameters by this rank's shard parameters; hyper-parameters stay."""
    for group, shards in zip(optimizer.param_groups, shards_per_group):
        group["params"] = list(shards)


ACCELERATOR_SETTINGS = ("fused", "capturable")  # settings whose kernels need an accelerator


def optimizer_like(optimizer: torch.optim.Optimizer, params_per_group: Sequence[Sequence[torch.Tensor]], *,
                   for_cpu: bool = False) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``params_per_group`` (one list per param group,
    in order), each group with its settings and the constructor's defaults as ``optimizer``'s.

    ``for_cpu`` drops ``fused`` and ``capturable``, so the twin steps on CPU tensors; its state
    is the same."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ValueError(f"{len(params_per_group)} parameter lists for an optimizer with "
                         f"{len(optimizer.param_groups)} param groups")
    dropped = {"params", *(ACCELERATOR_SETTINGS if for_cpu else ())}
    groups = [{**{k: v for k, v in group.items() if k not in dropped}, "params": list(params)}
              for group, params in zip(optimizer.param_groups, params_per_group)]
    accepted = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in dropped}
    return type(optimizer)(groups, **defaults)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total
