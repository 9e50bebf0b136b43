"""The model's whole state streamed one part at a time: the values ``full_state_dict`` returns,
without ever holding all of them.

``state_specs()`` gives every name's shape and dtype with nothing gathered (a ZeRO-3 parameter's
own tensor is empty; its shape is its unit's record). ``state_parts()`` is a generator and a
collective: every rank runs it to its end, together, between iterations; each step yields one
``{name: value}`` dict, the same names on every rank in the same order.

[Note: what one part is] ZeRO-3: one block, gathered exactly (its fp32 master under mixed
precision), released when the generator resumes. Stages 1/2 under mixed precision: one unit's
fp32 master (a gradient bucket), gathered from the shards. Otherwise every rank holds the
parameters whole: a part is one parameter, a view of what the stage keeps, nothing allocated.
Buffers and frozen parameters (which no stage shards) come one at a time, as copies in the
model's own dtype. A part's values are valid only until the generator resumes (a ZeRO-3 block's
storage is released then): the consumer writes or copies them first. A consumer that fails part
way must still run the generator to its end, or the other ranks wait in a gather.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Protocol

import torch
from torch import nn

from poplar.comm import Phase
from poplar.zero.sharded_state import ShardedState, master_shard

StatePart = dict[str, torch.Tensor]


class UnshardedState(Protocol):
    """What the buffers' and frozen parameters' parts need of a stage (``ZeroStage``)."""

    model: nn.Module

    def unsharded_value(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def unsharded_dtype(self, tensor: torch.Tensor) -> torch.dtype: ...


class StateSpec(NamedTuple):
    """One state tensor's shape and dtype, known before its value is gathered."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def unsharded_specs(stage: UnshardedState, owned: set[int]) -> dict[str, StateSpec]:
    """The specs of the state tensors whose id is not in ``owned``: buffers and frozen
    parameters, in the model's own dtype."""
    return {k: StateSpec(tuple(v.shape), stage.unsharded_dtype(v))
            for k, v in stage.model.state_dict(keep_vars=True).items() if id(v) not in owned}


def unsharded_parts(stage: UnshardedState, owned: set[int]) -> Iterator[StatePart]:
    """The state tensors whose id is not in ``owned``, one copy at a time."""
    for k, v in stage.model.state_dict(keep_vars=True).items():
        if id(v) not in owned:
            yield {k: stage.unsharded_value(v)}


def sharded_specs(stage: ShardedState) -> dict[str, StateSpec]:
    """ZeRO-3: each block parameter's shape from its unit, its dtype the master's under mixed
    precision, else the gathered one's."""
    sd = stage.model.state_dict(keep_vars=True)
    specs: dict[int, StateSpec] = {}
    for b in stage.blocks:
        dtype = b.dtype if stage.precision.separate_master else b.compute_dtype
        for u in b.units:
            specs.update((id(p), StateSpec(tuple(shape), dtype)) for p, shape in zip(u.params, u.shapes))
    rest = unsharded_specs(stage, set(specs))
    return {k: specs[id(v)] if id(v) in specs else rest[k] for k, v in sd.items()}


def sharded_parts(stage: ShardedState) -> Iterator[StatePart]:
    """ZeRO-3: buffers and frozen parameters one at a time, then one gathered block per part."""
    if stage.in_pass:
        raise RuntimeError("ZeRO-3: the state streamed inside a micro-step; stream it between iterations")
    sd = stage.model.state_dict(keep_vars=True)
    owner = {id(p): b.index for b in stage.blocks for p in b.params}
    yield from unsharded_parts(stage, set(owner))
    for b in stage.blocks:
        keys = [k for k, v in sd.items() if owner.get(id(v)) == b.index]
        if stage.precision.separate_master:
            with stage.comm.ledger.scope(Phase.STATE):
                flats = b.gather_master(stage.comm, master_shard(stage, b))
            value = {id(p): u.slot(flats[k], i) for k, u in enumerate(b.units) for i, p in enumerate(u.params)}
            yield {key: value[id(sd[key])] for key in keys}
            del flats, value
            continue
        with stage.comm.ledger.scope(Phase.STATE):
            stage.gather_now(b)
        try:
            yield {key: sd[key].detach() for key in keys}
        finally:
            stage.free_gather(b)
