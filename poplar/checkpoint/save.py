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
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from poplar.checkpoint.cut import Piece, dcp_value, param_shapes, pieces_of
from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.layout import (DCP_FORMAT_VERSION, DCP_METADATA_FILE, FORMAT, INDEX_FILE, dcp_file_names,
                                      dtype_name, group_hyperparams, rng_file_name, sealed, ties)
from poplar.checkpoint.storage import (check_replaceable, file_facts, publish, remove_replaced,
                                       remove_stale_temporaries, temporary_prefix, write_json)


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
    comm = engine.comm
    directory = Path(directory)
    what = f"save checkpoint {directory}"
    problem = "the engine is in the middle of an iteration; save between iterations" if engine.in_iteration else None
    if max_shard_bytes is not None:
        problem = ("max_shard_bytes sizes the files of a whole-model export; a checkpoint is sharded by rank "
                   "(leave it unset)")
    comm.agree(problem, what, None, error_type=CheckpointError)
    tmp = _make_temporary(comm, directory, extra, what)
    try:
        tmp_dir = Path(tmp[0])
        everyone = write_shards(engine, tmp_dir, what)
        info, error = None, None
        try:
            info = _rank_files(engine, tmp_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"{type(e).__name__}: {e}"
        infos = comm.agree(error, what, info, error_type=CheckpointError)
        error = None
        if comm.rank == 0:
            try:
                index = checkpoint_index(engine, everyone, infos, file_facts(tmp_dir / DCP_METADATA_FILE), extra)
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


def write_shards(engine: Any, tmp_dir: Path, what: str) -> dict[str, list[Piece]]:
    """Every rank writes its shards into ``tmp_dir`` (a DCP save, collective); returns every
    rank's pieces by parameter name."""
    held = held_pieces(engine)
    everyone = gather_pieces(engine.comm, [pc for _, ps in held for pc in ps], what)
    error = None
    try:
        state = shard_state(engine, held, everyone)
        with quiet_dcp():
            dcp.save(state, storage_writer=writer_for(engine, tmp_dir),
                     process_group=engine.comm.group if engine.comm.distributed else None,
                     no_dist=not engine.comm.distributed)
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank; agreed again for one message
        error = f"{type(e).__name__}: {e}"
    engine.comm.agree(error, what, None, error_type=CheckpointError)
    return everyone


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns that ``ShardedTensor`` (how it takes local shards of any size, ``checkpoint.cut``)
    will give way to DTensor, and that a world of one saves without a process group; both are
    expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def writer_for(engine: Any, tmp_dir: Path) -> dcp.FileSystemWriter:
    """DCP's file writer: one file per rank from host memory; one file per tensor from a device,
    as DCP keeps the host copy of every tensor of a file until it is closed."""
    on_host = engine.comm.device.type == "cpu"
    return dcp.FileSystemWriter(str(tmp_dir), thread_count=1, single_file_per_rank=on_host)


def held_pieces(engine: Any) -> list[tuple[torch.Tensor, list[Piece]]]:
    """This rank's optimizer parameters and their pieces; ZeRO-0 replicates them, and rank 0's
    copy is the checkpoint's."""
    held = pieces_of(engine.stage, engine.comm.rank)
    if engine.zero_stage == 0 and engine.comm.rank != 0:
        return [(p, []) for p, _ in held]
    return held


def gather_pieces(comm: Any, mine: list[Piece], what: str) -> dict[str, list[Piece]]:
    """Every rank's pieces by parameter name (metadata only)."""
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for pieces in comm.agree(None, what, mine, error_type=CheckpointError):
        for pc in pieces:
            by_name[pc.name].append(pc)
    return dict(by_name)


def shard_state(engine: Any, held: list[tuple[torch.Tensor, list[Piece]]],
                everyone: dict[str, list[Piece]]) -> dict[str, Any]:
    """This rank's part of the state in torch's convention (``get_state_dict`` of an FSDP2 model):
    ``{"model": {name: tensor}, "optim": {"state": {name: {key: tensor}}, "param_groups": [...]}}``,
    every tensor a view of the shard (no copy)."""
    opt, group = engine.optimizer, engine.comm.group if engine.comm.distributed else None
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for p, pieces in held:
        values = opt.state.get(p, {})
        per_element = {k: v.detach().reshape(-1) for k, v in values.items() if is_per_element(k, v, p)}
        flat = p.detach().reshape(-1)
        for pc in pieces:
            model[pc.name] = dcp_value(pc, flat, everyone[pc.name], group)
            entry = {k: dcp_value(pc, f, everyone[pc.name], group) for k, f in per_element.items()}
            entry.update({k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                          for k, v in values.items() if k not in per_element})
            if entry:
                state[pc.name] = entry
    if engine.comm.rank == 0:
        model.update(unsharded_tensors(engine))
    name_of = {id(p): n for u in engine.stage.units for p, n in zip(u.params, u.names)}
    model.update({k: model[name_of[id(v)]] for k, v in engine.module.state_dict(keep_vars=True).items()
                  if id(v) in name_of and name_of[id(v)] != k and name_of[id(v)] in model})  # tied: under each key
    return {"model": model, "optim": {"state": state, "param_groups": param_groups(engine)}}


def unsharded_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """The tensors of the model no optimizer parameter holds (buffers, frozen parameters), whole."""
    trained = {id(p) for u in engine.stage.units for p in u.params}
    return {k: engine.stage.unsharded_value(v) for k, v in engine.module.state_dict(keep_vars=True).items()
            if id(v) not in trained}


def param_groups(engine: Any) -> list[dict[str, Any]]:
    """The optimizer's groups as ``get_state_dict`` gives them: hyper-parameters, and ``params``
    the names of the model parameters in the group."""
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    names: dict[int, list[str]] = defaultdict(list)
    for u in engine.stage.units:
        names[u.group_index].extend(u.names)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": sorted(names[gi], key=order.__getitem__)}
            for gi, g in enumerate(engine.optimizer.param_groups)]


def is_per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    if not torch.is_tensor(value) or value.shape != param.shape:
        return False
    return value.dim() > 0 or key != "step"  # a 0-d parameter's 0-d "step" is a counter


def _rank_files(engine: Any, tmp_dir: Path) -> dict[str, Any]:
    """This rank's RNG file, and the size and sha256 of every file it wrote."""
    rank, world = engine.comm.rank, engine.comm.world_size
    tensors, rng = {"rng/cpu": torch.get_rng_state()}, ["cpu"]
    device = engine.comm.device
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device).cpu()
        rng.append("cuda")
    name = rng_file_name(rank, world)
    save_file(tensors, str(tmp_dir / name), metadata={"format": FORMAT, "rank": str(rank)})
    shards = [{"file": f, **file_facts(tmp_dir / f)} for f in dcp_file_names(tmp_dir, rank)]
    return {"file": name, **file_facts(tmp_dir / name), "rng": rng, "shards": shards}


def checkpoint_index(engine: Any, everyone: dict[str, list[Piece]], infos: list[dict], metadata: dict[str, Any],
                     extra: dict | None) -> dict[str, Any]:
    """The index: the run's record, the parameter table, the cut (every rank's pieces) and every
    file with its size and sha256."""
    shapes = param_shapes(engine.stage, engine.module)
    dtypes = {k: v.dtype for k, v in engine.module.state_dict(keep_vars=True).items()}
    params = {k: {"shape": list(s), "dtype": dtype_name(torch.float32 if k in everyone else dtypes[k])}
              for k, s in shapes.items()}
    ranks = []
    for r, info in enumerate(infos):
        pieces = [pc.to_dict() for name in sorted(everyone, key=list(shapes).index) for pc in everyone[name]
                  if pc.rank == r]
        ranks.append({**info, "pieces": pieces})
    return {
        "format": FORMAT, "version": DCP_FORMAT_VERSION, "layout": "dcp",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "iteration": engine.iteration,
        "world_size": engine.comm.world_size,
        "zero_stage": engine.zero_stage,
        "plan": engine.plan.to_dict() if engine.plan is not None else None,
        "model": {"params": params, "tied": ties(engine.module), "dcp_metadata": {"file": DCP_METADATA_FILE,
                                                                                  **metadata}},
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "param_groups": [group_hyperparams(g) for g in engine.optimizer.param_groups]},
        "ranks": ranks,
        "precision": precision_state(engine),
        "extra": extra,
    }


def precision_state(engine: Any) -> dict[str, Any]:
    """The precision policy the run trained under, its loss scaler (fp16) and its skipped steps:
    a resumed run continues them; weights and optimizer state are fp32 under every policy, so
    a checkpoint loads under any other policy."""
    policy, scaler = engine.mixed_precision, engine.loss_scaler
    return {"policy": None if policy is None else policy.to_dict(),
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "nonfinite": engine.nonfinite.state_dict()}


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
