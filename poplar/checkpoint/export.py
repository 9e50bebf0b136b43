"""The whole model for people, from a live engine: ``model.safetensors`` (or Hugging Face shards)
and, for a ``transformers`` model, ``config.json``, so ``from_pretrained(dir)`` loads it, written
while no rank ever holds more of the model than one part.

Every rank runs ``export_model`` together, between iterations: the engine streams its state one
part at a time (``engine.state_parts()``: at ZeRO-3 one gathered block; ``poplar.zero.state_parts``)
and rank 0 writes each part's tensors at their place in the files, whose headers it wrote first
from ``engine.state_specs()`` (``checkpoint.model_files``). A part is let go before the next is
gathered, so the export holds at most one block of the full model, on the device and on the
host, where ``engine.full_state_dict()`` holds all of them on every rank.

A failure on rank 0 (a full disk, an unwritable directory) does not leave the other ranks in a
gather: rank 0 keeps taking part in the stream, writes nothing more, removes what it wrote, and
every rank raises ``CheckpointError`` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.hf_layout import _write_hf_config, shard_bytes
from poplar.checkpoint.model_files import ModelFiles
from poplar.checkpoint.streaming_safetensors import TensorSpec


class ExportReport(NamedTuple):
    """What an export wrote and held. ``entry``: the weight files (as an index's "model" entry:
    ``file``, ``bytes``, ``sha256`` or ``shards``), on rank 0; None on the others.
    ``peak_part_bytes``: the most bytes of model values this rank held at once (the largest
    part); ``total_bytes``: the whole model's."""

    directory: Path
    entry: dict[str, Any] | None
    parts: int
    peak_part_bytes: int
    total_bytes: int


def export_model(engine: Any, directory: str | os.PathLike, *, max_shard_bytes: int | str | None = None,
                 config: bool = True) -> ExportReport:
    """Write ``engine``'s whole model into ``directory`` (made if missing; files of the same names
    are replaced), streaming one part at a time. Call on every rank between iterations.

    ``max_shard_bytes`` (bytes or e.g. "500MB"; default 5 GB): above it the weights are Hugging
    Face shards with ``model.safetensors.index.json``. ``config``: also write a ``transformers``
    model's ``config.json`` (and ``generation_config.json``). Raises ``CheckpointError`` on every
    rank if any rank fails.
    """
    comm = engine.comm
    directory = Path(directory)
    what = f"export model {directory}"
    specs = [TensorSpec(k, s.shape, s.dtype) for k, s in engine.state_specs().items()]
    files, error = None, None
    if engine.in_iteration:
        error = "the engine is in the middle of an iteration; export between iterations"
    elif comm.rank == 0:
        try:
            limit = shard_bytes(max_shard_bytes)
            directory.mkdir(parents=True, exist_ok=True)
            files = ModelFiles(directory, specs, limit)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"{type(e).__name__}: {e}"
    comm.agree(error, what, None, error_type=CheckpointError)
    parts, peak = 0, 0
    for part in engine.state_parts():  # every rank to the end: the parts are collectives
        parts += 1
        peak = max(peak, part_bytes(part))
        if files is not None and error is None:
            error = _write_part(files, part)
        del part  # let it go before the next is gathered
    entry = None
    if files is not None:
        entry, error = _finish(files, error, engine.module if config else None)
    comm.agree(error, what, None, error_type=CheckpointError)
    return ExportReport(directory, entry, parts, peak, sum(s.nbytes for s in specs))


def part_bytes(part: dict[str, torch.Tensor]) -> int:
    """The bytes of a part's values, a tensor stored under two names (tied) counted once."""
    seen: dict[tuple[int, int], int] = {}
    for v in part.values():
        seen[(v.data_ptr(), v.numel())] = v.numel() * v.element_size()
    return sum(seen.values())


def _write_part(files: ModelFiles, part: dict[str, torch.Tensor]) -> str | None:
    try:
        for name, value in part.items():
            files.write(name, value)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return f"{type(e).__name__}: {e}"
    return None


def _finish(files: ModelFiles, error: str | None, module: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Close the files (and write the model's config) or, after an error, remove them."""
    if error is None:
        try:
            entry = files.close()
            if module is not None:
                _write_hf_config(files.directory, module)
            return entry, None
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
    files.abort()
    return None, error
