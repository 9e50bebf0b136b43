"""The model's weights in the Hugging Face layout, so a checkpoint directory is also a model
directory that ``from_pretrained`` loads (docs/design.md §8).

Up to ``max_shard_bytes`` of tensors the weights are one ``model.safetensors``; above it they are
``model-00001-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` (``total_size``
and a ``weight_map`` from each key to its shard), as ``save_pretrained`` writes them. Poplar's
own loader reads the same files (the index lists them with sizes and sha256), so the weights are
stored once. Tied weights are stored under each of their keys, so a plain ``load_state_dict``
works as well. For a ``transformers.PreTrainedModel`` the directory also holds ``config.json``
(with ``architectures`` naming the model class) and, for a model that generates,
``generation_config.json``. ``transformers`` is never imported here: a model can only be one of
its classes if the user's program imported it.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from poplar.checkpoint.layout import FORMAT, HF_INDEX_FILE, MODEL_FILE, shard_file_name
from poplar.checkpoint.storage import file_facts, umask_mode, write_json

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default, "5GB"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def shard_bytes(value: int | str | None) -> int:
    """``max_shard_bytes`` as a number of bytes: an int, or a size such as "500MB" or "2GiB"
    (None: the default, 5 GB). Raises ``ValueError`` for anything else."""
    if value is None:
        return DEFAULT_MAX_SHARD_BYTES
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", value.upper())
        if match is None:
            raise ValueError(f"max_shard_bytes {value!r} is not a size; give bytes (an int) or e.g. '500MB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {value!r}")
    return value


def write_model(directory: Path, state: dict[str, torch.Tensor], module: torch.nn.Module,
                max_shard_bytes: int) -> dict[str, Any]:
    """Write ``state`` (contiguous CPU tensors sharing no storage) and, for a Hugging Face model,
    its config files into ``directory``. Returns the index's "model" entry for the weights: one
    file's ``file``, ``bytes`` and ``sha256``, or ``shards``, a list of them."""
    metadata = {"format": "pt", "poplar": FORMAT}  # "pt": what transformers expects of a safetensors file
    shards = _split(state, max_shard_bytes)
    _write_hf_config(directory, module)
    if len(shards) == 1:
        save_file(state, str(directory / MODEL_FILE), metadata=metadata)
        return {"file": MODEL_FILE, **file_facts(directory / MODEL_FILE)}
    entries, weight_map = [], {}
    for i, keys in enumerate(shards):
        name = shard_file_name(i, len(shards))
        save_file({k: state[k] for k in keys}, str(directory / name), metadata=metadata)
        entries.append({"file": name, **file_facts(directory / name)})
        weight_map.update((k, name) for k in keys)
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_json(directory / HF_INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    umask_mode(directory / HF_INDEX_FILE, 0o666)
    return {"shards": entries}


def _split(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys in model order, cut greedily into shards of at most ``max_bytes`` (a larger tensor
    gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _write_hf_config(directory: Path, module: torch.nn.Module) -> None:
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return
    config = copy.deepcopy(module.config)
    config.architectures = [type(module).__name__]
    config.save_pretrained(str(directory))
    umask_mode(directory / "config.json", 0o666)
    generation = module.generation_config if module.can_generate() else None
    if generation is not None:
        generation.save_pretrained(str(directory))
        umask_mode(directory / "generation_config.json", 0o666)
