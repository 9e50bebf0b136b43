"""The whole model from a sharded ``torch.distributed.checkpoint`` (DCP) checkpoint, offline, in
one CPU process: ``poplar export CHECKPOINT_DIR OUT_DIR [--hf]``.

The checkpoint's state dict follows FSDP2's convention: ``"model"`` maps each parameter's fully
qualified name to its tensor (the full logical shape, stored as any number of shards of any
size, as the ranks that wrote it held them); ``"optim"`` is left alone. The metadata
(``FileSystemReader.read_metadata``) names every tensor with its shape and dtype, so the output's
headers are written first (``checkpoint.model_files``); then each tensor is loaded alone into a
tensor of its shape (DCP's own load without a process group, which reads only that tensor's
shards), written at its place, and let go. The process holds one tensor of the model at a time.

With ``hf`` the output is a Hugging Face folder: the checkpoint's ``config.json`` (which
``from_pretrained`` builds the model from), its ``generation_config.json`` and tokenizer files
where it carries them, are copied beside the weights.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from poplar.checkpoint.hf_layout import shard_bytes
from poplar.checkpoint.layout import HF_CONFIG_FILES
from poplar.checkpoint.model_files import ModelFiles
from poplar.checkpoint.streaming_safetensors import TensorSpec

MODEL_KEY = "model"  # the top-level key of the model's parameters (FSDP2's convention)
DCP_METADATA_FILE = ".metadata"
# what AutoTokenizer.from_pretrained reads, where a checkpoint carries it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")


class DcpExport(NamedTuple):
    """What ``export_dcp`` wrote: the weight files' entry (``file``/``bytes``/``sha256`` or
    ``shards``), the tensors, their bytes, the most bytes of model values held at once, and the
    config and tokenizer files copied."""

    entry: dict[str, Any]
    tensors: int
    total_bytes: int
    peak_tensor_bytes: int
    copied: tuple[str, ...]


def model_specs(metadata: Metadata) -> list[TensorSpec]:
    """The ``"model"`` tensors a DCP checkpoint's metadata lists, in the order it lists them;
    ValueError if it has none."""
    specs = []
    for key, meta in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key)
        if path is None:  # saved without flattening: the key is the path joined by "."
            path = tuple(key.split(".", 1))
        if len(path) != 2 or path[0] != MODEL_KEY or not isinstance(meta, TensorStorageMetadata):
            continue
        specs.append(TensorSpec(str(path[1]), tuple(meta.size), meta.properties.dtype))
    if not specs:
        raise ValueError(f"the checkpoint's state has no {MODEL_KEY!r} tensors (top-level keys: "
                         f"{sorted({k.split('.', 1)[0] for k in metadata.state_dict_metadata})}); export reads the "
                         f"model from {{'{MODEL_KEY}': {{name: tensor}}}}")
    return specs


def read_metadata(checkpoint: Path) -> tuple[dcp.FileSystemReader, Metadata]:
    """The reader and metadata of the DCP checkpoint in ``checkpoint``; FileNotFoundError naming
    the fix if there is none."""
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"checkpoint directory {checkpoint} does not exist")
    if not (checkpoint / DCP_METADATA_FILE).is_file():
        inside = sorted(p.name for p in checkpoint.iterdir() if (p / DCP_METADATA_FILE).is_file())
        fix = f"give one of the checkpoints in it ({', '.join(inside[-3:])}), e.g. {checkpoint / inside[-1]}" \
            if inside else "give the directory a sharded save wrote"
        raise FileNotFoundError(f"{checkpoint} holds no torch.distributed.checkpoint checkpoint (no "
                                f"{DCP_METADATA_FILE} file); {fix}")
    reader = dcp.FileSystemReader(str(checkpoint))
    return reader, reader.read_metadata()


def export_dcp(checkpoint: str | Path, out: str | Path, *, hf: bool = False,
               max_shard_bytes: int | str | None = None) -> DcpExport:
    """Write the ``"model"`` of the DCP checkpoint in ``checkpoint`` into ``out`` as
    ``model.safetensors`` (or Hugging Face shards above ``max_shard_bytes``), one tensor at a
    time, in this process alone; with ``hf`` also the config and tokenizer files (the checkpoint
    must carry ``config.json``). Files of the same names in ``out`` are replaced."""
    checkpoint, out = Path(checkpoint), Path(out)
    reader, metadata = read_metadata(checkpoint)
    specs = model_specs(metadata)
    carried = [n for n in (*HF_CONFIG_FILES, *TOKENIZER_FILES) if (checkpoint / n).is_file()] if hf else []
    if hf and "config.json" not in carried:
        raise FileNotFoundError(f"{checkpoint} carries no config.json, which from_pretrained needs; export without "
                                "--hf for model.safetensors alone, or put the model's config.json beside the checkpoint")
    limit = shard_bytes(max_shard_bytes)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; give a directory (made if missing)")
    out.mkdir(parents=True, exist_ok=True)
    files = ModelFiles(out, specs, limit)
    peak = 0
    try:
        for spec in specs:
            value = torch.empty(spec.shape, dtype=spec.dtype)
            _load_one(reader, checkpoint, spec.name, value)
            files.write(spec.name, value)
            peak = max(peak, spec.nbytes)
            del value
        entry = files.close()
    except BaseException:
        files.abort()
        raise
    for name in carried:
        shutil.copyfile(checkpoint / name, out / name)
    return DcpExport(entry, len(specs), files.total_bytes, peak, tuple(carried))


def _load_one(reader: dcp.FileSystemReader, checkpoint: Path, name: str, value: torch.Tensor) -> None:
    """Load ``"model"``'s tensor ``name`` into ``value``; a checkpoint that cannot give it (a
    missing or damaged shard file) is a ValueError naming the tensor."""
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load({MODEL_KEY: {name: value}}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException; one line for the CLI
        failures = list(getattr(e, "failures", {}).values())  # DCP's: per rank, the exception it wraps
        cause = failures[0] if failures else e
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its stack)
        reason = (str(cause).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{checkpoint}: reading {name!r} failed ({type(cause).__name__}: {reason}); the checkpoint's "
                         "shard files are missing or damaged") from e
