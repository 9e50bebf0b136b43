"""Checkpoints (safetensors) that resume exactly, and on another world size, ZeRO stage or plan.

A checkpoint is a directory::

    model.safetensors              the full model (engine.full_state_dict(), written by rank 0);
                                   plain ``model.load_state_dict(safetensors.torch.load_file(...))``
                                   works (tied weights are stored under each of their keys)
    optim-rank{r}-of{N}.safetensors  rank r's optimizer state, cut by model parameter name and
                                   element range, plus its RNG states ("rng/cpu", "rng/cuda")
    index.json                     format version, world size, stage, plan, iteration, the
                                   parameter table (name, shape, dtype), the optimizer class and
                                   param-group hyper-parameters, every file with its size and
                                   sha256, per rank the table of its state pieces (and scalar
                                   state such as Adam's ``step``), and the caller's ``extra``

Optimizer state by name: ``engine.stage.optimizer_segments()`` says, for each parameter the
optimizer holds (a model parameter at stage 0, a flat shard at stages 1-3), which element range
of which model parameter each part of it is. Every per-element state tensor (Adam ``exp_avg``,
SGD ``momentum_buffer``, ...) is saved as one piece per (name, range); scalar state is saved in
the index per piece. On load each rank rebuilds the state of each of its new optimizer
parameters from the saved pieces that overlap its segments, reading only those ranges
(``safe_open``) from whichever old ranks' files hold them. A new shard that is all padding gets
zeros and its group's scalars. The rebuilt state goes through ``optimizer.load_state_dict``, so
torch applies its own device/dtype rules, and the param groups' hyper-parameters (lr, betas,
weight decay, ...; not implementation switches such as ``foreach``/``fused``) are restored.

Safety: files are written into a temporary directory next to the target, index.json last, and
the directory is renamed into place, so a directory with a valid index is a complete checkpoint
(an existing checkpoint at the target is replaced; anything else there is refused). Loading
checks the format, the parameter table against the model, the optimizer class and groups, every
file's size (all ranks) and the sha256 of each file it reads; any problem on any rank raises
``CheckpointError`` on every rank before anything is changed. Every rank must call both
functions (the model is gathered collectively at stage 3). All ranks must see the same directory
(a shared filesystem when ranks span machines).

RNG: each rank's torch CPU RNG state (and its CUDA device's, on CUDA) is saved and restored on
the rank of the same number, so a resume on the same world size is bitwise on CPU. Ranks beyond
the saved world size keep their RNG. Data-loader position, LR schedulers and anything else of
the caller go in ``extra`` (JSON), e.g. ``extra={"data": loader.state_dict()}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from poplar.plans import Plan
from poplar.zero.comm import DistributedError

__all__ = ["save_checkpoint", "load_checkpoint", "read_index", "CheckpointError", "FORMAT_VERSION"]

FORMAT = "poplar-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
MODEL_FILE = "model.safetensors"
# param-group entries that choose an implementation rather than the math; they are not restored
_IMPLEMENTATION_KEYS = {"params", "param_names", "foreach", "fused", "capturable", "differentiable"}


class CheckpointError(DistributedError):
    """A checkpoint could not be saved or loaded; raised on every rank together."""


class _Invalid(Exception):
    """A problem found by one rank, reported at the next agreement point."""


def optim_file_name(rank: int, world_size: int) -> str:
    return f"optim-rank{rank}-of{world_size}.safetensors"


# ====================================================================== save
def save_checkpoint(engine: Any, directory: str | os.PathLike, *, extra: dict | None = None) -> Path:
    """Write a checkpoint of ``engine`` (model, optimizer state, iteration, RNG) to ``directory``.

    Call on every rank between iterations. ``extra`` (rank 0's is kept) must be JSON-serialisable.
    Returns the directory. Raises ``CheckpointError`` on every rank if any rank fails; then no
    checkpoint is left at ``directory`` (a previous one there stays).
    """
    comm = engine.comm
    rank, world = comm.rank, comm.world_size
    directory = Path(directory)
    mid = "the engine is in the middle of an iteration; save between iterations" \
        if getattr(engine, "_micro_steps", 0) else None
    _gather_or_raise(comm, mid, None, "save checkpoint")
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
                _check_replaceable(directory)
                directory.parent.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                error = f"{type(e).__name__}: {e}"
    tmp = _gather_or_raise(comm, error, tmp, "save checkpoint")[0]
    tmp_dir = Path(tmp)

    # 2. every rank writes its optimizer state
    info, error = None, None
    try:
        tensors, info = _optimizer_pieces(engine)
        name = optim_file_name(rank, world)
        save_file(tensors, str(tmp_dir / name), metadata={"format": FORMAT, "rank": str(rank)})
        info.update(file=name, **_file_facts(tmp_dir / name))
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    try:
        infos = _gather_or_raise(comm, error, info, "save checkpoint")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    # 3. rank 0 writes the model and the index (last), then moves the directory into place
    error = None
    if rank == 0:
        try:
            params = {k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in full.items()}
            save_file(_unshared_cpu(full), str(tmp_dir / MODEL_FILE), metadata={"format": FORMAT})
            index = {
                "format": FORMAT, "version": FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "torch": torch.__version__,
                "iteration": engine.iteration,
                "world_size": world,
                "zero_stage": engine.zero_stage,
                "plan": engine.plan.to_dict() if engine.plan is not None else None,
                "model": {"file": MODEL_FILE, **_file_facts(tmp_dir / MODEL_FILE), "params": params,
                          "tied": _ties(engine.module)},
                "optimizer": {"class": type(engine.optimizer).__name__,
                              "param_groups": [_group_hyperparams(g) for g in engine.optimizer.param_groups]},
                "ranks": infos,
                "extra": extra,
            }
            _write_json(tmp_dir / INDEX_FILE, index)
            _publish(tmp_dir, directory)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp_dir, ignore_errors=True)
    _gather_or_raise(comm, error, None, "save checkpoint")
    return directory


def _optimizer_pieces(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's optimizer state cut into (name, range) pieces, plus its RNG states."""
    opt = engine.optimizer
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    tensors: dict[str, torch.Tensor] = {}
    pieces = []
    for p, segments in engine.stage.optimizer_segments():
        state = opt.state.get(p, {})
        per_element, scalars = {}, {}
        for key, value in state.items():
            if _is_per_element(key, value, p):
                per_element[key] = value.detach().reshape(-1)
            else:
                scalars[key] = _encode_scalar(key, value, p)
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


def _encode_scalar(key: str, value: Any, param: torch.Tensor) -> dict[str, Any]:
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"optimizer state '{key}' of shape {tuple(value.shape)} is neither per-element (shape "
                             f"{tuple(param.shape)}) nor a scalar; Poplar checkpoints cannot re-shard it")
        return {"tensor": value.item(), "dtype": _dtype_name(value.dtype), "shape": list(value.shape)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"optimizer state '{key}' is a {type(value).__name__}; Poplar checkpoints store tensors "
                     "and numbers")


def _decode_scalar(enc: dict[str, Any]) -> Any:
    if "tensor" in enc:
        return torch.tensor(enc["tensor"], dtype=_dtype(enc["dtype"])).reshape(enc["shape"])
    return enc["value"]


def _group_hyperparams(group: dict) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k in _IMPLEMENTATION_KEYS:
            continue
        if torch.is_tensor(v) and v.numel() == 1:
            out[k] = {"tensor": v.item(), "dtype": _dtype_name(v.dtype)}
        elif isinstance(v, tuple):
            out[k] = {"tuple": list(v)}
        else:
            try:
                json.dumps(v, allow_nan=False)
            except (TypeError, ValueError):
                continue  # not restorable from JSON: the new optimizer's value stays
            out[k] = v
    return out


def _restore_hyperparams(group: dict, saved: dict) -> dict:
    new = dict(group)
    for k, v in saved.items():
        if isinstance(v, dict) and "tuple" in v:
            v = tuple(v["tuple"])
        elif isinstance(v, dict) and "tensor" in v:
            v = torch.tensor(v["tensor"], dtype=_dtype(v["dtype"]),
                             device=group[k].device if torch.is_tensor(group.get(k)) else None)
        new[k] = v
    return new


def _unshared_cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def _check_replaceable(directory: Path) -> None:
    if directory.exists():
        if not directory.is_dir():
            raise FileExistsError(f"{directory} exists and is not a directory")
        if any(directory.iterdir()) and not (directory / INDEX_FILE).exists():
            raise FileExistsError(f"{directory} exists, is not empty and is not a Poplar checkpoint; "
                                  "refusing to replace it (choose another directory)")


def _publish(tmp: Path, directory: Path) -> None:
    """Move the finished temporary directory to ``directory``, replacing an older checkpoint."""
    _umask_mode(tmp, 0o777)
    _fsync_dir(tmp)
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
        try:
            os.replace(tmp, directory)
        except BaseException:
            os.replace(old, directory)  # put the previous checkpoint back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
    _fsync_dir(directory.parent)


def _write_json(path: Path, obj: Any) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_facts(path: Path) -> dict[str, Any]:
    _umask_mode(path, 0o666)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _umask_mode(path: Path, mode: int) -> None:
    """Temporary files and directories are private (0600/0700); give the result the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise _Invalid(f"unknown dtype {name!r} in the index")
    return dtype


# ====================================================================== load
def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed index.json of a checkpoint directory (checked for format and version)."""
    try:
        return _read_index(Path(directory))
    except _Invalid as e:
        raise CheckpointError(str(e)) from None


def load_checkpoint(engine: Any, directory: str | os.PathLike, *, verify_hashes: bool = True) -> dict[str, Any]:
    """Load a checkpoint into ``engine``: model, optimizer state and hyper-parameters, iteration,
    and (for ranks that existed when it was saved) RNG states. The engine may have another
    world size, stage or plan than the run that saved it.

    Call on every rank between iterations. Returns the checkpoint's meta: ``iteration``,
    ``world_size``, ``zero_stage`` and ``plan`` (a ``Plan``) of the saving run, ``extra``,
    ``rng_restored`` (this rank's RNG came from the checkpoint) and ``created``. Raises
    ``CheckpointError`` on every rank, having changed nothing, if the checkpoint is missing,
    incomplete, corrupt or does not fit the engine (everything is checked and read before
    anything is set). ``verify_hashes=False`` checks file sizes only.
    """
    comm = engine.comm
    directory = Path(directory)
    what = f"load checkpoint {directory}"
    # 1. the index, on every rank; every rank must be between iterations and read the same index
    error, index, digest = None, None, None
    try:
        if getattr(engine, "_micro_steps", 0):
            raise _Invalid("the engine is in the middle of an iteration; load a checkpoint between iterations")
        index = _read_index(directory)
        digest = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
    except _Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        error = f"{type(e).__name__}: {e}"
    if len(set(_gather_or_raise(comm, error, digest, what))) > 1:
        raise CheckpointError(f"{what}: ranks read different index files; every rank must load the same "
                              "checkpoint directory")
    assert index is not None

    # 2. check everything and read what this rank needs, changing nothing yet
    expected = _expected_params(engine)  # every rank: a collective at stage 3
    error = None
    loaded: dict[str, Any] = {}
    try:
        _check_params(index, expected)
        if "tied" in index["model"] and index["model"]["tied"] != _ties(engine.module):
            raise _Invalid(f"tied weights differ: the checkpoint ties {index['model']['tied']} and the model ties "
                           f"{_ties(engine.module)}")
        _check_sizes(directory, index)
        with ExitStack() as stack:
            files = _Files(directory, index, verify_hashes, stack)
            loaded["model"] = files.model_state()
            loaded["optimizer"] = _assemble_optimizer(engine, index, files)
            loaded["rng"] = _read_rng(engine, index, files)
    except _Invalid as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file or a malformed index, on every rank
        error = f"{type(e).__name__}: {e} (reading {directory})"
    _gather_or_raise(comm, error, None, what)

    # 3. apply
    error = None
    try:
        engine.stage.load_full_state_dict(loaded["model"])
        engine.optimizer.load_state_dict(loaded["optimizer"])
        engine.iteration = int(index["iteration"])
        engine.comm_ledger.iteration = engine.iteration
        for kind, state in loaded["rng"].items():
            if kind == "cpu":
                torch.set_rng_state(state)
            else:
                torch.cuda.set_rng_state(state, comm.device)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    try:
        comm.agree(error, what)
    except DistributedError as e:
        raise CheckpointError(str(e)) from None
    plan = index.get("plan")
    try:
        plan = Plan.from_dict(plan) if plan is not None else None
    except Exception:  # noqa: BLE001 - the plan is informational here
        pass
    return {"iteration": index["iteration"], "world_size": index["world_size"], "zero_stage": index["zero_stage"],
            "plan": plan, "extra": index.get("extra"), "rng_restored": bool(loaded["rng"]),
            "created": index.get("created")}


def _read_index(directory: Path) -> dict[str, Any]:
    path = directory / INDEX_FILE
    if not directory.is_dir():
        raise _Invalid(f"checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise _Invalid(f"{directory} has no {INDEX_FILE}: not a complete Poplar checkpoint (a save may have "
                       "been interrupted)")
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Invalid(f"{path} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise _Invalid(f"{path} is not a Poplar checkpoint index")
    if index.get("version") != FORMAT_VERSION:
        raise _Invalid(f"{path} has format version {index.get('version')}; this Poplar reads version "
                       f"{FORMAT_VERSION}")
    for key in ("iteration", "world_size", "zero_stage", "model", "optimizer", "ranks"):
        if key not in index:
            raise _Invalid(f"{path} lacks '{key}': the checkpoint is corrupt")
    if len(index["ranks"]) != index["world_size"]:
        raise _Invalid(f"{path} lists {len(index['ranks'])} rank files for a world of {index['world_size']}")
    return index


def _ties(module: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied weights)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, p in module.named_parameters(remove_duplicate=False):
        groups[id(p)].append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _expected_params(engine: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of the full model state the engine holds."""
    if engine.zero_stage == 3:  # parameters are shards; the full state is gathered
        state = engine.full_state_dict()
    else:
        state = engine.module.state_dict()
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


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
        raise _Invalid("the checkpoint does not match the model (a different architecture or size?): "
                       + "; ".join(lines))


def _check_sizes(directory: Path, index: dict) -> None:
    entries = [index["model"]] + list(index["ranks"])
    for e in entries:
        path = directory / e["file"]
        if not path.is_file():
            raise _Invalid(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != e["bytes"]:
            raise _Invalid(f"checkpoint file {path} has {size} bytes but the index says {e['bytes']}: it is "
                           "truncated or corrupt")


class _Files:
    """Opens checkpoint files on first use, after checking their sha256."""

    def __init__(self, directory: Path, index: dict, verify: bool, stack: ExitStack) -> None:
        self.directory, self.index, self.verify, self.stack = directory, index, verify, stack
        self.open: dict[int, Any] = {}

    def _checked(self, entry: dict) -> Path:
        path = self.directory / entry["file"]
        if self.verify and _sha256(path) != entry["sha256"]:
            raise _Invalid(f"checkpoint file {path} does not match its sha256 in the index: it is corrupt")
        return path

    def model_state(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self._checked(self.index["model"])
        state = load_file(str(path), device="cpu")
        table = self.index["model"]["params"]
        if set(state) != set(table):
            raise _Invalid(f"{path} holds other tensors than the index lists: the checkpoint is corrupt")
        return state

    def rank_file(self, r: int) -> Any:
        if r not in self.open:
            path = self._checked(self.index["ranks"][r])
            self.open[r] = self.stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self.open[r]

    def read(self, r: int, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of a 1-d tensor of old rank r's file (the whole tensor by default)."""
        f = self.rank_file(r)
        try:
            if start is None:
                return f.get_tensor(key)
            return f.get_slice(key)[start:stop]
        except Exception as e:  # noqa: BLE001
            raise _Invalid(f"{self.index['ranks'][r]['file']} lacks tensor '{key}' ({e}): the checkpoint is "
                           "corrupt") from None


def _assemble_optimizer(engine: Any, index: dict, files: _Files) -> dict[str, Any]:
    """The optimizer state dict (torch format) of this rank's new optimizer parameters."""
    opt = engine.optimizer
    saved_opt = index["optimizer"]
    if saved_opt["class"] != type(opt).__name__:
        raise _Invalid(f"the checkpoint's optimizer is {saved_opt['class']} but the engine's is "
                       f"{type(opt).__name__}")
    if len(saved_opt["param_groups"]) != len(opt.param_groups):
        raise _Invalid(f"the checkpoint's optimizer has {len(saved_opt['param_groups'])} param groups but the "
                       f"engine's has {len(opt.param_groups)}")

    catalog: dict[str, list[tuple[int, dict]]] = defaultdict(list)  # name -> (old rank, piece)
    group_keys: dict[int, set] = defaultdict(set)
    group_scalars: dict[int, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for r, rank_info in enumerate(index["ranks"]):
        for piece in rank_info["pieces"]:
            catalog[piece["name"]].append((r, piece))
            group_keys[piece["group"]].update(piece["keys"])
            for k, enc in piece["scalars"].items():
                group_scalars[piece["group"]][k].add(json.dumps(enc, sort_keys=True))

    segments_of = {id(p): segs for p, segs in engine.stage.optimizer_segments()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    i = 0
    for gi, group in enumerate(opt.param_groups):
        ids = []
        for p in group["params"]:
            if id(p) not in segments_of:
                raise _Invalid(f"optimizer group {gi} holds a parameter the ZeRO stage does not describe")
            s = _param_state(p, gi, segments_of[id(p)], catalog, group_keys, group_scalars, files)
            if s:
                state[i] = s
            ids.append(i)
            i += 1
        restored = _restore_hyperparams(group, saved_opt["param_groups"][gi])
        restored["params"] = ids
        groups.append(restored)
    return {"state": state, "param_groups": groups}


def _param_state(p: torch.Tensor, gi: int, segments: list, catalog: dict, group_keys: dict, group_scalars: dict,
                 files: _Files) -> dict[str, Any]:
    """One new optimizer parameter's state, from the saved pieces overlapping its segments."""
    if not segments:  # all padding: zeros and the group's scalars
        out: dict[str, Any] = {}
        for k, values in group_scalars[gi].items():
            if len(values) != 1:
                raise _Invalid(f"optimizer state '{k}' differs between parameters of group {gi}; cannot give a "
                               "padding shard one value")
            out[k] = _decode_scalar(json.loads(next(iter(values))))
        for k in group_keys[gi]:
            out[k] = torch.zeros_like(p, device="cpu")
        return out

    keys: set | None = None
    scalars: dict[str, set] = defaultdict(set)
    parts = []  # (old rank, piece, a, b, at): elements [a, b) of the name go to index `at` of p
    for name, offset, length, at in segments:
        if name not in catalog:
            raise _Invalid(f"the checkpoint has no optimizer state for '{name}' (was it frozen, or tied to "
                           "another parameter, when saved?)")
        covered = 0
        for r, piece in catalog.get(name, []):
            a, b = max(offset, piece["offset"]), min(offset + length, piece["offset"] + piece["length"])
            if a >= b:
                continue
            if piece["group"] != gi:
                raise _Invalid(f"parameter '{name}' was in optimizer param group {piece['group']} when saved and is "
                               f"in group {gi} now; build the optimizer with the same groups")
            piece_keys = set(piece["keys"])
            if keys is None:
                keys = piece_keys
            elif keys != piece_keys:
                raise _Invalid(f"optimizer state of '{name}' has keys {sorted(piece_keys)} in one part and "
                               f"{sorted(keys)} in another; the checkpoint cannot be re-sharded")
            for k, enc in piece["scalars"].items():
                scalars[k].add(json.dumps(enc, sort_keys=True))
            parts.append((r, piece, a, b, at + (a - offset)))
            covered += b - a
        if covered != length:
            raise _Invalid(f"the checkpoint holds optimizer state for {covered} of elements {offset}..{offset + length}"
                           f" of '{name}': it is incomplete or corrupt")
    out = {}
    for k, values in scalars.items():
        if len(values) != 1:
            raise _Invalid(f"optimizer state '{k}' differs between the parameters that now share one shard "
                           f"({sorted(values)}); cannot merge them")
        out[k] = _decode_scalar(json.loads(next(iter(values))))
    for k in sorted(keys or ()):
        flat = None
        for r, piece, a, b, to in parts:
            data = files.read(r, piece["keys"][k], a - piece["offset"], b - piece["offset"])
            if flat is None:
                flat = torch.zeros(p.numel(), dtype=data.dtype)
            flat[to:to + (b - a)] = data
        out[k] = flat.view(p.shape)
    return out


def _read_rng(engine: Any, index: dict, files: _Files) -> dict[str, torch.Tensor]:
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


# ====================================================================== agreement
def _gather_or_raise(comm: Any, error: str | None, payload: Any, what: str) -> list[Any]:
    """Every rank's payload, or ``CheckpointError`` on every rank naming each failing rank."""
    verdicts = comm.all_gather_object((error, payload), tag=what)
    lines = [f"  rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e is not None]
    if lines:
        raise CheckpointError(f"{what} failed on {len(lines)} of {comm.world_size} ranks:\n" + "\n".join(lines))
    return [p for _, p in verdicts]
