"""The model's weight files in the Hugging Face layout (``checkpoint.hf_layout``), written one
tensor at a time: one ``model.safetensors``, or above ``max_shard_bytes`` the shards
``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``. Which tensor goes into
which file is decided from the names, shapes and dtypes alone (the same greedy cut in model
order as ``hf_layout``), so every file's header is written before any value exists
(``checkpoint.streaming_safetensors``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from poplar.checkpoint.layout import (FORMAT, HF_CONFIG_FILES, HF_INDEX_FILE, MODEL_FILE, is_model_file,
                                      shard_file_name)
from poplar.checkpoint.storage import file_facts, umask_mode, write_json
from poplar.checkpoint.streaming_safetensors import StreamingSafetensorsWriter, TensorSpec

# "pt": what transformers expects of a safetensors file; "poplar": who wrote it
METADATA = {"format": "pt", "poplar": FORMAT}


class ModelFiles:
    """The weight files of ``specs`` in ``directory``, open for ``write(name, value)`` in any order."""

    def __init__(self, directory: Path, specs: list[TensorSpec], max_shard_bytes: int) -> None:
        self.directory = Path(directory)
        self.total_bytes = sum(s.nbytes for s in specs)
        by_name = {s.name: s for s in specs}
        groups = split_by_bytes(specs, max_shard_bytes)
        remove_weights(self.directory)  # an older export's shards must not outlive it
        names = [MODEL_FILE] if len(groups) == 1 else [shard_file_name(i, len(groups)) for i in range(len(groups))]
        self.writers: list[StreamingSafetensorsWriter] = []
        self.file_of: dict[str, StreamingSafetensorsWriter] = {}
        try:
            for name, keys in zip(names, groups):
                writer = StreamingSafetensorsWriter(self.directory / name, [by_name[k] for k in keys], METADATA)
                self.writers.append(writer)
                self.file_of.update((k, writer) for k in keys)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, value: torch.Tensor) -> None:
        self.file_of[name].write(name, value)

    def close(self) -> dict[str, Any]:
        """Close every file (ValueError if a tensor was never written). Returns the index's "model"
        entry: one file's ``file``, ``bytes`` and ``sha256``, or ``shards``, a list of them."""
        for w in self.writers:
            w.close()
        entries = [{"file": w.path.name, **file_facts(w.path)} for w in self.writers]
        if len(self.writers) == 1:
            return entries[0]
        weight_map = {k: w.path.name for k, w in self.file_of.items()}
        write_json(self.directory / HF_INDEX_FILE, {"metadata": {"total_size": self.total_bytes},
                                                    "weight_map": weight_map})
        umask_mode(self.directory / HF_INDEX_FILE, 0o666)
        return {"shards": entries}

    def abort(self) -> None:
        """Close every file without checking and remove them (a failed export)."""
        for w in self.writers:
            w.abort()
            w.path.unlink(missing_ok=True)


def remove_weights(directory: Path) -> None:
    """Remove the weight files of the Hugging Face layout from ``directory`` (its config stays)."""
    for path in directory.iterdir():
        if is_model_file(path.name) and path.name not in HF_CONFIG_FILES and path.is_file():
            path.unlink()


def split_by_bytes(specs: list[TensorSpec], max_bytes: int) -> list[list[str]]:
    """Names in the given (model) order, cut greedily into files of at most ``max_bytes`` (a
    larger tensor gets a file of its own): ``hf_layout``'s cut, from the specs alone."""
    groups: list[list[str]] = [[]]
    size = 0
    for s in specs:
        if groups[-1] and size + s.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(s.name)
        size += s.nbytes
    return groups
