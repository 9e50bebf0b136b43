"""Loading a checkpoint: every rank reads and checks the index, the model and the optimizer
pieces it needs before anything is changed, all ranks agree, then the state is applied."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from poplar.checkpoint.errors import CheckpointError, Damaged, DamagedCheckpoint, Invalid
from poplar.checkpoint.kept import resolve
from poplar.checkpoint.cut import param_shapes
from poplar.checkpoint.layout import DCP_METADATA_FILE, INDEX_FILE, check_files, is_dcp_index, parse_index, ties
from poplar.comm.pending import guarded
from poplar.checkpoint.reshard import CheckpointFiles, assemble_optimizer
from poplar.checkpoint.save import quiet_dcp
from poplar.checkpoint.sharded_load import Targets, check_against, check_hashes, read_metadata
from poplar.types.plans import Plan


@dataclass(frozen=True, eq=False)
class LoadedCheckpoint(Mapping):
    """What ``load_checkpoint`` loaded: the saving run's ``iteration``, ``world_size``,
    ``zero_stage`` and ``plan`` (None where it cannot be read), the caller's ``extra`` (an empty
    dict where none was saved), whether this rank's RNG came from the checkpoint, when it was
    created and the directory loaded. Also a read-only mapping of those names (``loaded["extra"]``),
    as the dict it was before."""

    iteration: int
    world_size: int
    zero_stage: int
    plan: Plan | None
    extra: dict[str, Any]
    rng_restored: bool
    created: Any
    path: str

    def __getitem__(self, name: str) -> Any:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def load_checkpoint(engine: Any, directory: str | os.PathLike, *, verify_hashes: bool = True) -> LoadedCheckpoint:
    """Load a checkpoint into ``engine``: model, optimizer state and hyper-parameters, iteration,
    and (for ranks that existed when it was saved) RNG states. The engine may have another
    world size, stage or plan than the run that saved it.

    Call on every rank between iterations. ``directory`` is a checkpoint, or a directory of kept
    checkpoints (``save_kept``, ``fit``), whose latest complete one is loaded. Returns the
    checkpoint's record (``LoadedCheckpoint``): ``iteration``, ``world_size``, ``zero_stage`` and
    ``plan`` (a ``Plan``) of the saving run, ``extra``, ``rng_restored`` (this rank's RNG came from
    the checkpoint), ``created`` and ``path`` (the checkpoint directory loaded). Raises
    ``CheckpointError`` on every rank, having changed nothing, if the checkpoint is missing,
    incomplete, corrupt or does not fit the engine (everything is checked before anything is
    read); ``DamagedCheckpoint`` (a ``CheckpointError``) when a data file does not match its
    sha256. ``verify_hashes=False`` checks file sizes only. A sharded checkpoint is read at
    ZeRO-3 straight into the shards: a read that fails after the checks (a file removed or
    unreadable meanwhile) leaves them partly loaded, and the error says so.
    """
    what = f"load checkpoint {Path(directory)}"
    directory, index = _agree_on_index(engine, Path(directory), what)
    if is_dcp_index(index):
        rng = load_sharded(engine, directory, index, verify_hashes, what)
        _finish(engine, index, rng, what)
        return _meta(index, _LoadedState({}, {}, rng), directory)
    loaded = _read_state(engine, directory, index, verify_hashes, what)
    _apply(engine, index, loaded, what)
    return _meta(index, loaded, directory)


@dataclass
class _LoadedState:
    """What a rank read of a checkpoint, checked, before changing anything."""

    model: dict[str, torch.Tensor]  # the full model state
    optimizer: dict[str, Any]  # the optimizer state for this rank's shard of the engine's layout
    rng: dict[str, torch.Tensor]  # "cpu" / "cuda" generator states; empty for a rank the saver lacked


def _agree_on_index(engine: Any, directory: Path, what: str) -> tuple[Path, dict]:
    """Step 1: the checkpoint directory (a kept one resolved to its latest complete checkpoint)
    and its index, read on every rank; every rank must be between iterations and read the same
    index."""
    error, index, digest = None, None, None
    try:
        if engine.in_iteration:
            raise Invalid("the engine is in the middle of an iteration; load a checkpoint between iterations")
        directory = resolve(directory)
        index = parse_index(directory)
        digest = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
    except Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = f"{type(e).__name__}: {e}"
    if len(set(engine.comm.agree(error, what, digest, error_type=CheckpointError))) > 1:
        raise CheckpointError(f"{what}: ranks read different index files; every rank must load the same "
                              "checkpoint directory")
    assert index is not None
    return directory, index


def _read_state(engine: Any, directory: Path, index: dict, verify_hashes: bool, what: str) -> _LoadedState:
    """Step 2: check everything and read what this rank needs, changing nothing yet. A damaged
    file on any rank is a ``DamagedCheckpoint`` on every rank (a caller may go back to an older
    checkpoint), any other problem a ``CheckpointError``."""
    comm = engine.comm
    expected = _expected_params(engine)
    error, damaged, loaded = None, None, None
    try:
        loaded = _check_and_read(engine, directory, index, expected, verify_hashes)
    except Damaged as e:  # told apart from the other problems
        damaged = str(e)
    except Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file or a malformed index, on every rank
        error = f"{type(e).__name__}: {e} (reading {directory})"
    damage = [f"  rank {r}: {d}" for r, d in enumerate(comm.agree(error, what, damaged, error_type=CheckpointError))
              if d is not None]
    if damage:
        raise DamagedCheckpoint(f"{what} failed on {len(damage)} of {comm.world_size} ranks:\n" + "\n".join(damage))
    assert loaded is not None
    return loaded


def _check_and_read(engine: Any, directory: Path, index: dict, expected: dict, verify_hashes: bool) -> _LoadedState:
    """This rank's checks of the checkpoint against the engine, then its reads; raises."""
    _check_params(index, expected)
    if "tied" in index["model"] and index["model"]["tied"] != ties(engine.module):
        raise Invalid(f"tied weights differ: the checkpoint ties {index['model']['tied']} and the model ties "
                      f"{ties(engine.module)}")
    check_files(directory, index)
    with ExitStack() as stack:
        files = CheckpointFiles(directory, index, verify_hashes, stack)
        model = files.model_state()
        optimizer = assemble_optimizer(engine, index, files)
        return _LoadedState(model, optimizer, _read_rng(engine, index, files))


def load_sharded(engine: Any, directory: Path, index: dict | None, verify_hashes: bool,
                 what: str) -> dict[str, torch.Tensor]:
    """Load a DCP checkpoint's model and optimizer state into ``engine``, each rank reading only
    what its shards need (``checkpoint.sharded_load``); ``index``: Poplar's (None for one torch
    wrote). Returns this rank's saved RNG states (none without an index)."""
    comm = engine.comm
    error, damaged, rng, md = None, None, {}, None
    try:
        if engine.in_iteration:
            raise Invalid("the engine is in the middle of an iteration; load a checkpoint between iterations")
        if index is not None:
            if index["model"]["tied"] != ties(engine.module):
                raise Invalid(f"tied weights differ: the checkpoint ties {index['model']['tied']} and the model "
                              f"ties {ties(engine.module)}")
            if index["optimizer"]["class"] != type(engine.optimizer).__name__:
                raise Invalid(f"the checkpoint's optimizer is {index['optimizer']['class']} but the engine's is "
                              f"{type(engine.optimizer).__name__}")
            check_files(directory, index)
            if verify_hashes:
                check_hashes(directory, index, comm.rank, comm.world_size)
            with ExitStack() as stack:
                rng = _read_rng(engine, index, CheckpointFiles(directory, index, False, stack))
        md = read_metadata(directory)
        check_against(engine, md)
    except Damaged as e:
        damaged = str(e)
    except Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = f"{type(e).__name__}: {e} (reading {directory})"
    damage = [f"  rank {r}: {d}" for r, d in enumerate(comm.agree(error, what, damaged, error_type=CheckpointError))
              if d is not None]
    if damage:
        raise DamagedCheckpoint(f"{what} failed on {len(damage)} of {comm.world_size} ranks:\n" + "\n".join(damage))
    with quiet_dcp():
        targets = Targets(engine, md, what)
    error = None
    try:
        group, no_dist = (comm.group, False) if comm.distributed else (None, True)  # None: the default group
        with quiet_dcp():  # DCP's collectives marked blocked, as in the save (checkpoint.save.write_shards)
            guarded(comm.rank, "checkpoint read", what,
                    lambda: dcp.load(targets.state_dict(), storage_reader=dcp.FileSystemReader(str(directory)),
                                     process_group=group, no_dist=no_dist))
        targets.set_model()
        engine.optimizer.load_state_dict(targets.optimizer_state())
    except Exception as e:  # noqa: BLE001
        error = (f"{type(e).__name__}: {e}; the engine's state is now partly loaded: load a checkpoint again "
                 "or build the engine anew")
    comm.agree(error, what, error_type=CheckpointError)
    return rng


def load_torch_checkpoint(engine: Any, directory: str | os.PathLike) -> None:
    """Load the model and optimizer state of a ``torch.distributed.checkpoint`` directory that
    torch wrote (FSDP2, torchtitan: ``{"model": ..., "optim": ...}`` as ``get_state_dict``
    gives them) into ``engine``, on any world size, stage or plan; its iteration, RNG and plan
    stay. Call on every rank between iterations. Raises ``CheckpointError`` on every rank."""
    directory = Path(directory)
    what = f"load torch checkpoint {directory}"
    if not (directory / DCP_METADATA_FILE).is_file() or (directory / INDEX_FILE).is_file():
        problem = (f"{directory} is a Poplar checkpoint: load it with load_checkpoint" if (directory / INDEX_FILE)
                   .is_file() else f"{directory} has no {DCP_METADATA_FILE}: not a torch.distributed.checkpoint")
        engine.comm.agree(problem, what, error_type=CheckpointError)
    load_sharded(engine, directory, None, False, what)


def _finish(engine: Any, index: dict, rng: dict[str, torch.Tensor], what: str) -> None:
    """After a sharded load: the iteration, the precision state and the RNG."""
    error = None
    try:
        engine.restore_iteration(int(index["iteration"]))
        restore_precision_state(engine, index.get("precision"))
        _set_rng(engine, rng)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    engine.comm.agree(error, what, error_type=CheckpointError)


def _set_rng(engine: Any, rng: dict[str, torch.Tensor]) -> None:
    for kind, state in rng.items():
        if kind == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, engine.comm.device)


def _apply(engine: Any, index: dict, loaded: _LoadedState, what: str) -> None:
    """Step 3: set the engine's model, optimizer, iteration, precision state and RNG; every rank
    agrees that it succeeded."""
    error = None
    try:
        engine.stage.load_full_state_dict(loaded.model)
        engine.optimizer.load_state_dict(loaded.optimizer)
        engine.restore_iteration(int(index["iteration"]))
        restore_precision_state(engine, index.get("precision"))
        _set_rng(engine, loaded.rng)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    engine.comm.agree(error, what, error_type=CheckpointError)


def _meta(index: dict, loaded: _LoadedState, directory: Path) -> LoadedCheckpoint:
    """What ``load_checkpoint`` returns: the saving run's record and what this load did."""
    return LoadedCheckpoint(iteration=index["iteration"], world_size=index["world_size"],
                            zero_stage=index["zero_stage"], plan=_saved_plan(index), extra=index.get("extra") or {},
                            rng_restored=bool(loaded.rng), created=index.get("created"), path=str(directory))


def _saved_plan(index: dict[str, Any]) -> Plan | None:
    """The saving run's plan, or None where the index has none or it no longer reads (it is
    informational: the engine's own plan decides)."""
    try:
        return Plan.from_dict(index["plan"]) if index.get("plan") is not None else None
    except Exception:  # noqa: BLE001 - the plan is informational here
        return None


def _expected_params(engine: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of the full model state the engine holds."""
    dtypes = {k: v.dtype for k, v in engine.module.state_dict(keep_vars=True).items()}
    return {k: (shape, dtypes[k]) for k, shape in param_shapes(engine.stage, engine.module).items()}


def _check_params(index: dict, expected: dict) -> None:
    saved = {k: tuple(v["shape"]) for k, v in index["model"]["params"].items()}
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    shapes = [f"{k}: checkpoint {list(saved[k])} vs model {list(expected[k][0])}" for k in expected
              if k in saved and saved[k] != expected[k][0]]
    if missing or unexpected or shapes:
        lines = []
        if missing:
            lines.append(f"model parameters missing from the checkpoint: {missing[:6]}")
        if unexpected:
            lines.append(f"checkpoint parameters the model does not have: {unexpected[:6]}")
        if shapes:
            lines.append(f"shapes differ: {shapes[:6]}")
        raise Invalid("the checkpoint does not match the model (a different architecture or size?): "
                      + "; ".join(lines))


def restore_precision_state(engine: Any, state: dict[str, Any] | None) -> None:
    """Continue the saved run's skipped-step count and, when both runs scale the loss (fp16), its
    loss scale. A checkpoint of another policy (or of a version that saved none) leaves the
    new run's scaler at its initial scale."""
    if not state:
        return
    if state.get("nonfinite"):
        engine.nonfinite.load_state_dict(state["nonfinite"])
    if state.get("loss_scaler") and engine.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])


def _read_rng(engine: Any, index: dict, files: CheckpointFiles) -> dict[str, torch.Tensor]:
    r = engine.comm.rank
    if r >= index["world_size"]:
        return {}
    kinds = index["ranks"][r].get("rng", [])
    out = {}
    if "cpu" in kinds:
        out["cpu"] = files.read(r, "rng/cpu").to(torch.uint8)
    if "cuda" in kinds and engine.comm.device.type == "cuda":
        out["cuda"] = files.read(r, "rng/cuda").to(torch.uint8)
    return out
