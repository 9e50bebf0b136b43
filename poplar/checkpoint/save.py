"""Saving a checkpoint: every rank writes its own shards (fp32 master parameters and optimizer
state, cut by parameter name and element range) with ``torch.distributed.checkpoint``, with no
gather; rank 0 writes the index last and the directory is moved into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.layout import DCP_METADATA_FILE, FORMAT, INDEX_FILE, dcp_file_names, rng_file_name, sealed
from poplar.checkpoint.snapshot import Snapshot, take_snapshot
from poplar.checkpoint.storage import (check_replaceable, file_facts, publish, remove_replaced,
                                       remove_stale_temporaries, temporary_prefix, write_json)
from poplar.comm.pending import guarded


def save_checkpoint(engine: Any, directory: str | os.PathLike, *, extra: dict | None = None,
                    max_shard_bytes: int | str | None = None) -> Path:
    """Write a checkpoint of ``engine`` (model, optimizer state, iteration, RNG) to ``directory``.

    Call on every rank between iterations. Every rank writes its own shards (a DCP checkpoint:
    ``docs/checkpoint-format.md``); nothing is gathered. ``extra`` (rank 0's is kept) must be
    JSON-serialisable. Returns the directory. Raises ``CheckpointError`` on every rank if any rank
    fails, and on every surviving rank if one dies. ``directory`` never holds a partial
    checkpoint: after a failure it holds the previous one (if any), or the new one if rank 0 had
    already moved it into place when another rank died. To keep several checkpoints of a run, see
    ``save_kept``. ``max_shard_bytes`` belongs to the whole-model export, not to a checkpoint.
    """
    what = f"save checkpoint {directory}"
    check_can_save(engine, what, max_shard_bytes)
    group = engine.comm.group if engine.comm.distributed else None
    return write_checkpoint(engine.comm, take_snapshot(engine, what, group, copy=False), Path(directory), extra)


def check_can_save(engine: Any, what: str, max_shard_bytes: int | str | None = None) -> None:
    """Every rank: the engine is between iterations (and no whole-model option was given)."""
    problem = "the engine is in the middle of an iteration; save between iterations" if engine.in_iteration else None
    if max_shard_bytes is not None:
        problem = ("max_shard_bytes sizes the files of a whole-model export; a checkpoint is sharded by rank "
                   "(leave it unset)")
    engine.comm.agree(problem, what, None, error_type=CheckpointError)


def write_checkpoint(comm: Any, snap: Snapshot, directory: Path, extra: dict | None) -> Path:
    """Write ``snap`` (every rank's) into ``directory`` over ``comm``: a temporary directory,
    every rank's shards and RNG file, rank 0's index last, then the rename. Collective."""
    what = f"save checkpoint {directory}"
    tmp = _make_temporary(comm, directory, extra, what)
    try:
        tmp_dir = Path(tmp[0])
        write_shards(comm, snap, tmp_dir, what)
        info, error = None, None
        try:
            info = _rank_files(comm, snap, tmp_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"{type(e).__name__}: {e}"
        infos = comm.agree(error, what, info, error_type=CheckpointError)
        error = None
        if comm.rank == 0:
            try:
                index = _index(snap, infos, file_facts(tmp_dir / DCP_METADATA_FILE), extra)
                write_json(tmp_dir / INDEX_FILE, sealed(index))
                publish(tmp_dir, directory)
                remove_replaced(directory)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        comm.agree(error, what, None, error_type=CheckpointError)
    except BaseException:
        # a failed save leaves nothing behind: rank 0 made the temporary directory and removes it
        # (after a successful publish it no longer exists); if rank 0 itself died, a later save
        # removes it once it is stale
        if comm.rank == 0 and tmp[1]:
            shutil.rmtree(tmp[0], ignore_errors=True)
        raise
    return directory


def _make_temporary(comm: Any, directory: Path, extra: dict | None, what: str) -> tuple[str, bool]:
    """Rank 0 makes the temporary directory next to ``directory`` and tells the others its name;
    (name, whether this rank made it)."""
    error, tmp = None, None
    if comm.rank == 0:
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            error = f"extra must be JSON-serialisable (numbers, strings, lists, dicts): {e}"
        if error is None:
            try:
                check_replaceable(directory)
                directory.parent.mkdir(parents=True, exist_ok=True)
                remove_stale_temporaries(directory)
                tmp = tempfile.mkdtemp(prefix=temporary_prefix(directory), dir=directory.parent)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                error = f"{type(e).__name__}: {e}"
    return comm.agree(error, what, tmp, error_type=CheckpointError)[0], comm.rank == 0 and tmp is not None


def write_shards(comm: Any, snap: Snapshot, tmp_dir: Path, what: str) -> None:
    """Every rank writes its shards into ``tmp_dir`` (a DCP save over ``comm``'s group)."""
    error = None
    try:
        writer = dcp.FileSystemWriter(str(tmp_dir), thread_count=1, single_file_per_rank=snap.on_host)
        group, no_dist = (comm.group, False) if comm.distributed else (None, True)  # None: the default group
        with quiet_dcp():  # DCP's collectives are marked blocked, as the communicator's are: a rank
            # waiting in one for a peer that died still answers torchrun's SIGTERM (process.sigterm_watch)
            guarded(comm.rank, "checkpoint write", what,
                    lambda: dcp.save(snap.state, storage_writer=writer, process_group=group, no_dist=no_dist))
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank; agreed again for one message
        error = f"{type(e).__name__}: {e}"
    comm.agree(error, what, None, error_type=CheckpointError)


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that ``ShardedTensor`` (how it takes local shards of any size, ``checkpoint.cut``)
    will give way to DTensor, and that a world of one saves without a process group; both are
    expected here. (From a device, DCP keeps the host copy of every tensor of a file until the
    file is closed, so such a save writes one file per tensor: ``single_file_per_rank``.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank_files(comm: Any, snap: Snapshot, tmp_dir: Path) -> dict[str, Any]:
    """This rank's RNG file, and the size and sha256 of every file it wrote."""
    name = rng_file_name(comm.rank, comm.world_size)
    save_file({f"rng/{k}": v for k, v in snap.rng.items()}, str(tmp_dir / name),
              metadata={"format": FORMAT, "rank": str(comm.rank)})
    shards = [{"file": f, **file_facts(tmp_dir / f)} for f in dcp_file_names(tmp_dir, comm.rank)]
    return {"file": name, **file_facts(tmp_dir / name), "rng": sorted(snap.rng), "shards": shards}


def _index(snap: Snapshot, infos: list[dict], metadata: dict[str, Any], extra: dict | None) -> dict[str, Any]:
    """The index: the run's record, the cut (every rank's pieces, in model order) and every file
    with its size and sha256."""
    order = list(snap.record["model"]["params"])
    ranks = []
    for r, info in enumerate(infos):
        pieces = [pc.to_dict() for name in sorted(snap.everyone, key=order.index) for pc in snap.everyone[name]
                  if pc.rank == r]
        ranks.append({**info, "pieces": pieces})
    model = {**snap.record["model"], "dcp_metadata": {"file": DCP_METADATA_FILE, **metadata}}
    return {**snap.record, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model, "ranks": ranks,
            "extra": extra}


def unshared_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (tied weights, views of a flat buffer)."""
    out, seen = {}, set()
    for k, v in state.items():
        t = v.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out
