"""Saving a checkpoint: every rank writes its optimizer state cut by parameter name and element
range, rank 0 writes the full model and the index last, and the directory is moved into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.hf_layout import shard_bytes, write_model
from poplar.checkpoint.layout import (FORMAT, FORMAT_VERSION, INDEX_FILE, SHARDED_FORMAT_VERSION, dtype_name,
                                      encode_scalar, group_hyperparams, optim_file_name, sealed, ties)
from poplar.checkpoint.storage import (check_replaceable, file_facts, publish, remove_replaced,
                                       remove_stale_temporaries, temporary_prefix, write_json)


def save_checkpoint(engine: Any, directory: str | os.PathLike, *, extra: dict | None = None,
                    max_shard_bytes: int | str | None = None) -> Path:
    """Write a checkpoint of ``engine`` (model, optimizer state, iteration, RNG) to ``directory``.

    Call on every rank between iterations. ``extra`` (rank 0's is kept) must be JSON-serialisable.
    The model's weights are in the Hugging Face layout (``checkpoint.hf_layout``): one
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` (bytes or e.g. "500MB";
    default 5 GB) with ``model.safetensors.index.json``; a ``transformers.PreTrainedModel`` also
    gets its ``config.json``, so ``from_pretrained(directory)`` loads the trained weights.
    Returns the directory. Raises ``CheckpointError`` on every rank if any rank fails, and on
    every surviving rank if one dies. ``directory`` never holds a partial checkpoint: after a
    failure it holds the previous one (if any), or the new one if rank 0 had already moved it
    into place when another rank died. To keep several checkpoints of a run, see ``save_kept``.
    """
    comm = engine.comm
    rank, world = comm.rank, comm.world_size
    directory = Path(directory)
    what = f"save checkpoint {directory}"
    try:
        shard_limit, bad_size = shard_bytes(max_shard_bytes), None
    except ValueError as e:
        shard_limit, bad_size = 0, str(e)
    mid = "the engine is in the middle of an iteration; save between iterations" \
        if engine.in_iteration else None
    comm.agree(mid or bad_size, what, None, error_type=CheckpointError)
    full = engine.full_state_dict()  # every rank: a collective at stage 3

    # 1. rank 0 makes the temporary directory and tells the others its name
    error, tmp = None, None
    if rank == 0:
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
    try:
        tmp_dir = Path(comm.agree(error, what, tmp, error_type=CheckpointError)[0])

        # 2. every rank writes its optimizer state
        info, error = None, None
        try:
            tensors, info = _optimizer_pieces(engine)
            name = optim_file_name(rank, world)
            save_file(tensors, str(tmp_dir / name), metadata={"format": FORMAT, "rank": str(rank)})
            info.update(file=name, **file_facts(tmp_dir / name))
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        infos = comm.agree(error, what, info, error_type=CheckpointError)

        # 3. rank 0 writes the model and the index (last), then moves the directory into place
        error = None
        if rank == 0:
            try:
                model_entry = write_model(tmp_dir, unshared_cpu(full), engine.module, shard_limit)
                index = _index(engine, full, model_entry, infos, extra)
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
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _index(engine: Any, full: dict[str, torch.Tensor], model_entry: dict[str, Any], infos: list[dict],
           extra: dict | None) -> dict[str, Any]:
    params = {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v in full.items()}
    return {
        "format": FORMAT, "version": SHARDED_FORMAT_VERSION if "shards" in model_entry else FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "iteration": engine.iteration,
        "world_size": engine.comm.world_size,
        "zero_stage": engine.zero_stage,
        "plan": engine.plan.to_dict() if engine.plan is not None else None,
        "model": {**model_entry, "params": params, "tied": ties(engine.module)},
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "param_groups": [group_hyperparams(g) for g in engine.optimizer.param_groups]},
        "ranks": infos,
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


def _optimizer_pieces(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's optimizer state cut into (name, range) pieces, plus its RNG states."""
    opt = engine.optimizer
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    tensors: dict[str, torch.Tensor] = {}
    pieces = []
    # ZeRO-0 replicates the optimizer state on every rank: rank 0's copy is the checkpoint's
    replicated_copy = engine.zero_stage == 0 and engine.comm.rank != 0
    for p, segments in [] if replicated_copy else engine.stage.optimizer_segments():
        state = opt.state.get(p, {})
        per_element, scalars = {}, {}
        for key, value in state.items():
            if _is_per_element(key, value, p):
                per_element[key] = value.detach().reshape(-1)
            else:
                scalars[key] = encode_scalar(key, value, p)
        for name, offset, length, at in segments:
            keys = {}
            for key, flat in per_element.items():
                tkey = f"{key}/{name}/{offset}"
                tensors[tkey] = flat[at:at + length].to("cpu", copy=True).contiguous()
                keys[key] = tkey
            pieces.append({"name": name, "offset": offset, "length": length, "group": group_of[id(p)],
                           "keys": keys, "scalars": scalars})
    rng = ["cpu"]
    tensors["rng/cpu"] = torch.get_rng_state()
    device = engine.comm.device
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device).cpu()
        rng.append("cuda")
    return tensors, {"pieces": pieces, "rng": rng}


def _is_per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    if not torch.is_tensor(value) or value.shape != param.shape:
        return False
    return value.dim() > 0 or key != "step"  # a 0-d parameter's 0-d "step" is a counter


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
