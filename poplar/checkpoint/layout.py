"""The checkpoint format: file names, the index (reading and checking it, its own checksum, the
files it lists), and how dtypes, scalar optimizer state, param-group hyper-parameters and tied
weights are written in it."""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from poplar.checkpoint.errors import Invalid

FORMAT = "poplar-checkpoint"
# version 2: the model's weights may be Hugging Face shards (the index's model entry lists
# "shards"); a checkpoint with one model file is still written as version 1
# version 3: every rank's shards in torch.distributed.checkpoint's format (the "layout": "dcp"
# index; ``checkpoint.cut``), no whole-model file; versions 1 and 2 still load
FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
DCP_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DCP_METADATA_FILE = ".metadata"
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp")
INDEX_FILE = "index.json"
MODEL_FILE = "model.safetensors"
# the Hugging Face layout (checkpoint.hf_layout): sharded weights, their index, the model's config
HF_INDEX_FILE = "model.safetensors.index.json"
HF_CONFIG_FILES = ("config.json", "generation_config.json")
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# a kept-checkpoints directory's index.json points at its latest step directory (checkpoint.kept)
POINTER_FORMAT = "poplar-latest-checkpoint"
POINTER_VERSION = 1
# an index carries the sha256 of its own canonical JSON under this key (indexes written before it
# existed have none and are read as they are)
CHECKSUM_KEY = "index_sha256"
# param-group entries that choose an implementation rather than the math; they are not restored
IMPLEMENTATION_KEYS = {"params", "param_names", "foreach", "fused", "capturable", "differentiable"}


def optim_file_name(rank: int, world_size: int) -> str:
    return f"optim-rank{rank}-of{world_size}.safetensors"


def rng_file_name(rank: int, world_size: int) -> str:
    return f"rng-rank{rank}-of{world_size}.safetensors"


def dcp_file_names(directory: Path, rank: int) -> list[str]:
    """The data files DCP wrote for ``rank`` in ``directory``."""
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))


def is_dcp_file(name: str) -> bool:
    return name == DCP_METADATA_FILE or _DCP_FILE.fullmatch(name) is not None


def is_dcp_index(index: dict[str, Any]) -> bool:
    return index.get("layout") == "dcp"


def data_files(index: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file an index lists (``file``, ``bytes``, ``sha256``): the model and rank files of
    versions 1-2; the DCP metadata, every rank's DCP files and RNG file of version 3."""
    if not is_dcp_index(index):
        return [*model_file_entries(index["model"]), *index["ranks"]]
    return [index["model"]["dcp_metadata"], *index["ranks"], *(s for r in index["ranks"] for s in r["shards"])]


def shard_file_name(i: int, count: int) -> str:
    """The Hugging Face name of weight shard ``i`` (from 0) of ``count``."""
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def is_model_file(name: str) -> bool:
    """Whether ``name`` is a file of the model's weights or Hugging Face config in a checkpoint."""
    return (name in (MODEL_FILE, HF_INDEX_FILE, HF_INDEX_FILE + ".part", *HF_CONFIG_FILES)
            or _SHARD_FILE.fullmatch(name) is not None)


def model_file_entries(model_entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The weight files an index's "model" entry lists, each with ``file``, ``bytes``, ``sha256``."""
    return list(model_entry["shards"]) if "shards" in model_entry else [model_entry]


def parse_index(directory: Path) -> dict[str, Any]:
    """``read_index`` raising ``Invalid``, for use before an agreement point."""
    path = directory / INDEX_FILE
    if not directory.is_dir():
        raise Invalid(f"checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise Invalid(f"{directory} has no {INDEX_FILE}: not a complete Poplar checkpoint (a save may have "
                      "been interrupted)")
    index = read_sealed_json(path)
    if index.get("format") != FORMAT:
        raise Invalid(f"{path} is not a Poplar checkpoint index")
    if index.get("version") not in READABLE_VERSIONS:
        raise Invalid(f"{path} has format version {index.get('version')}; this Poplar reads versions "
                      f"{', '.join(map(str, READABLE_VERSIONS))}")
    for key in ("iteration", "world_size", "zero_stage", "model", "optimizer", "ranks"):
        if key not in index:
            raise Invalid(f"{path} lacks '{key}': the checkpoint is corrupt")
    if len(index["ranks"]) != index["world_size"]:
        raise Invalid(f"{path} lists {len(index['ranks'])} rank files for a world of {index['world_size']}")
    return index


def check_files(directory: Path, index: dict[str, Any]) -> None:
    """Every file the index lists is there with its size (the cheap half of checking them)."""
    for entry in data_files(index):
        path = directory / entry["file"]
        if not path.is_file():
            raise Invalid(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise Invalid(f"checkpoint file {path} has {size} bytes but the index says {entry['bytes']}: it is "
                          "truncated or corrupt")


def sealed(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as it reads back from JSON, with the sha256 of its canonical form added."""
    plain = json.loads(json.dumps(obj, allow_nan=False))
    plain.pop(CHECKSUM_KEY, None)
    plain[CHECKSUM_KEY] = _canonical_sha256(plain)
    return plain


def read_sealed_json(path: Path) -> dict[str, Any]:
    """A JSON object written with ``sealed``, checked against its checksum (if it has one)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Invalid(f"{path} is not valid JSON ({e}): the checkpoint is corrupt") from None
    if not isinstance(obj, dict):
        raise Invalid(f"{path} is not a Poplar checkpoint index")
    if CHECKSUM_KEY in obj and obj[CHECKSUM_KEY] != _canonical_sha256(obj):
        raise Invalid(f"{path} does not match its own checksum ({CHECKSUM_KEY}): the file was changed or "
                      "damaged after it was written, so the checkpoint is corrupt")
    return obj


def _canonical_sha256(obj: dict[str, Any]) -> str:
    body = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise Invalid(f"unknown dtype {name!r} in the index")
    return dtype


def encode_scalar(key: str, value: Any, param: torch.Tensor) -> dict[str, Any]:
    """A non-per-element optimizer state value (Adam's ``step``, ...) as JSON."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise ValueError(f"optimizer state '{key}' of shape {tuple(value.shape)} is neither per-element (shape "
                             f"{tuple(param.shape)}) nor a scalar; Poplar checkpoints cannot re-shard it")
        return {"tensor": value.item(), "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"optimizer state '{key}' is a {type(value).__name__}; Poplar checkpoints store tensors "
                     "and numbers")


def decode_scalar(enc: dict[str, Any]) -> Any:
    if "tensor" in enc:
        return torch.tensor(enc["tensor"], dtype=dtype_of(enc["dtype"])).reshape(enc["shape"])
    return enc["value"]


def group_hyperparams(group: dict) -> dict[str, Any]:
    """A param group's hyper-parameters as JSON (those JSON cannot hold are left out)."""
    out = {}
    for k, v in group.items():
        if k in IMPLEMENTATION_KEYS:
            continue
        if torch.is_tensor(v) and v.numel() == 1:
            out[k] = {"tensor": v.item(), "dtype": dtype_name(v.dtype)}
        elif isinstance(v, tuple):
            out[k] = {"tuple": list(v)}
        else:
            try:
                json.dumps(v, allow_nan=False)
            except (TypeError, ValueError):
                continue  # not restorable from JSON: the new optimizer's value stays
            out[k] = v
    return out


def restore_hyperparams(group: dict, saved: dict) -> dict:
    """``group`` with the saved hyper-parameters put back."""
    new = dict(group)
    for k, v in saved.items():
        if isinstance(v, dict) and "tuple" in v:
            v = tuple(v["tuple"])
        elif isinstance(v, dict) and "tensor" in v:
            v = torch.tensor(v["tensor"], dtype=dtype_of(v["dtype"]),
                             device=group[k].device if torch.is_tensor(group.get(k)) else None)
        new[k] = v
    return new


def ties(module: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied weights)."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, p in module.named_parameters(remove_duplicate=False):
        groups[id(p)].append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)
