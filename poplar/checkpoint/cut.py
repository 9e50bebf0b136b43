"""The cut of a sharded checkpoint: which element range of which parameter each rank holds, and
how such a range is put to ``torch.distributed.checkpoint`` (DCP).

[Note: flat ranges as rectangles]
A rank's shard is an element range of a flattened parameter, of any length (shard weights cut
unevenly). DCP describes a rank's part of a tensor as rectangular chunks (offsets and sizes in
every dimension). A flat range of a row-major tensor is not one rectangle in general, but it is
a union of at most ``2 * ndim - 1`` rectangles, each contiguous in memory: the tail of its first
row (recursively in the row's own dimensions), the whole rows between, and the head of its last
row. So each piece is saved as those rectangles of the parameter in its true shape, as the local
shards of a ``ShardedTensor`` whose global metadata lists every rank's rectangles. A loader that
asks for other rectangles (FSDP2's row blocks, another Poplar cut) reads the overlaps through
DCP's own planner: no conversion, no gather, and the rectangles are views of the shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the tensor's own dimensions


@dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + length) of parameter ``name`` (shape ``shape``), held by rank
    ``rank`` at element ``at`` of one of its optimizer parameters, in optimizer group ``group``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    length: int
    group: int
    rank: int
    at: int

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.length == math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "offset": self.offset, "length": self.length, "group": self.group}


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Rectangles, in memory order, covering elements [start, stop) of a row-major tensor of
    ``shape`` (see the note above)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    rest = tuple(shape[1:])
    if first == last:
        return [((first, *o), (1, *s)) for o, s in boxes(rest, start - first * inner, stop - first * inner)]
    out: list[Box] = []
    full_from = first if start % inner == 0 else first + 1
    full_to = last + 1 if stop % inner == 0 else last
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in boxes(rest, start - first * inner, inner)]
    if full_to > full_from:
        out.append(((full_from, *(0,) * len(rest)), (full_to - full_from, *rest)))
    if stop % inner:
        out += [((last, *o), (1, *s)) for o, s in boxes(rest, 0, stop - last * inner)]
    return out


def flat_offset(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """The row-major element index of ``offsets`` in a tensor of ``shape``."""
    index = 0
    for size, o in zip(shape, offsets):
        index = index * size + o
    return index


def own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` as a tensor over the same host memory whose storage is exactly its bytes.

    DCP's file writer copies a tensor whose storage is larger than it (a view of a shard) and
    keeps every copy until the rank's file is closed: a whole extra shard. Over its own storage
    it is written from where it is. A device tensor, or a dtype numpy lacks, stays a view (DCP
    stages it to the host, one file per tensor: ``save.writer_for``)."""
    if view.device.type != "cpu" or view.untyped_storage().nbytes() == view.nbytes:
        return view
    try:
        return torch.from_numpy(view.detach().numpy())
    except TypeError:
        return view


def local_views(piece: Piece, flat: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """The piece's rectangles as views of ``flat`` (the 1-d tensor that holds the piece at ``at``)."""
    out = []
    for box in boxes(piece.shape, piece.offset, piece.offset + piece.length):
        begin = piece.at + flat_offset(piece.shape, box[0]) - piece.offset
        out.append((box, own_storage(flat[begin:begin + math.prod(box[1])].view(box[1]))))
    return out


def dcp_value(piece: Piece, flat: torch.Tensor, everyone: Sequence[Piece], group: Any) -> torch.Tensor:
    """What DCP saves or loads for this rank's piece of a parameter's tensor (its value, or one
    per-element optimizer state), ``flat`` holding it: a view of the whole parameter where the
    piece is all of it, else a ``ShardedTensor`` of the piece's rectangles whose global metadata
    has every rank's (``everyone``: all ranks' pieces of this parameter)."""
    if piece.whole:
        return own_storage(flat[piece.at:piece.at + piece.length].view(piece.shape))
    device = flat.device
    local = [Shard(view, _shard_md(box, piece.rank, device)) for box, view in local_views(piece, flat)]
    shards = [_shard_md(box, p.rank, device if p.rank == piece.rank else torch.device("cpu"))
              for p in everyone for box in boxes(p.shape, p.offset, p.offset + p.length)]
    props = TensorProperties(dtype=flat.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    md = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size(piece.shape), tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=group)


def _shard_md(box: Box, rank: int, device: torch.device) -> ShardMetadata:
    return ShardMetadata(shard_offsets=list(box[0]), shard_sizes=list(box[1]), placement=f"rank:{rank}/{device}")


def pieces_of(stage: Any, rank: int) -> list[tuple[torch.Tensor, list[Piece]]]:
    """This rank's optimizer parameters (the fp32 masters the optimizer steps), each with the
    pieces of model parameters it holds (``stage.optimizer_segments()``)."""
    opt = stage.optimizer
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    shapes = {name: tuple(shape) for u in stage.units for name, shape in zip(u.names, u.shapes)}
    return [(p, [Piece(name, shapes[name], offset, length, group_of[id(p)], rank, at)
                 for name, offset, length, at in segments])
            for p, segments in stage.optimizer_segments()]


def param_shapes(stage: Any, module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the model's state dict, without gathering anything (a
    parameter a ZeRO-3 stage shards has an empty tensor of its own; its unit knows its shape)."""
    shape_of = {id(p): tuple(shape) for u in stage.units for p, shape in zip(u.params, u.shapes)}
    return {k: shape_of.get(id(v), tuple(v.shape)) for k, v in module.state_dict(keep_vars=True).items()}
