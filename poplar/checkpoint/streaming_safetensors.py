"""A safetensors file written one tensor at a time, in bounded memory.

The format is an 8-byte little-endian header length, a JSON header (per tensor its ``dtype``,
``shape`` and ``data_offsets`` into the data section, plus ``__metadata__``, string to string),
padded with spaces to a multiple of 8 bytes, then the tensors' raw little-endian bytes, back to
back with no gaps. The library writes a whole ``{name: tensor}`` dict at once; a model that
does not fit one device cannot give it one.

[Note: header first] Every name, shape and dtype is known before any value is (the engine
knows its parameters' shapes without gathering them; a DCP checkpoint's metadata lists them),
so the header and every tensor's offset are fixed when the file is opened, the file is sized to
its final length, and each tensor's bytes go to their offset whenever its value arrives, in any
order. The writer keeps no tensor: ``write`` copies one tensor to the host, writes it and lets it
go. ``close`` refuses a file with a tensor never written, so a file is whole or an error.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, NamedTuple

import torch

# safetensors' names for torch's dtypes (the Rust crate's ``Dtype``)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


class TensorSpec(NamedTuple):
    """What the header says of one tensor before its value exists."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> "TensorSpec":
        return TensorSpec(name, tuple(tensor.shape), tensor.dtype)


def header_bytes(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None
                 ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The length prefix and padded JSON header for ``specs`` laid out in their order, and each
    name's (start, end) in the data section."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, at = {}, 0
    for s in specs:
        if s.dtype not in DTYPE_NAMES:
            raise ValueError(f"{s.name}: dtype {s.dtype} has no safetensors name")
        if s.name in offsets or s.name == "__metadata__":
            raise ValueError(f"tensor name {s.name!r} given twice (or reserved)")
        offsets[s.name] = (at, at + s.nbytes)
        header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [at, at + s.nbytes]}
        at += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, offsets


def write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Write a tensor's raw bytes to ``f`` (any dtype; safetensors is little-endian, as torch on
    every platform it runs on): from the tensor's own memory when it is a contiguous host tensor,
    else from one host copy of it. The bytes are read through ``ctypes``, not numpy: a numpy view
    would mark the storage not resizable, and a ZeRO-3 block frees its gathered storage by
    resizing it."""
    flat = tensor.detach().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes:
        f.write(memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())))


class StreamingSafetensorsWriter:
    """One safetensors file at ``path``: the header at once, each tensor by ``write``, then ``close``.

        writer = StreamingSafetensorsWriter(path, specs, metadata={"format": "pt"})
        for name, value in ...:  # any order, each name once
            writer.write(name, value)
        writer.close()
    """

    def __init__(self, path: str | os.PathLike, specs: list[TensorSpec], metadata: dict[str, str] | None = None
                 ) -> None:
        self.path = Path(path)
        self.specs = {s.name: s for s in specs}
        head, self.offsets = header_bytes(specs, metadata)
        self.data_start = len(head)
        self.size = self.data_start + sum(s.nbytes for s in specs)
        self.written: set[str] = set()
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        try:
            self._file.write(head)
            self._file.truncate(self.size)
        except BaseException:
            self._file.close()
            raise

    def write(self, name: str, value: torch.Tensor) -> None:
        """Write ``value`` as tensor ``name`` (its shape and dtype must be the header's)."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{self.path.name} has no tensor {name!r} in its header")
        if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
            raise ValueError(f"{name}: {tuple(value.shape)} {value.dtype} given, the header says {spec.shape} "
                             f"{spec.dtype}")
        if name in self.written:
            raise ValueError(f"{name} written twice into {self.path.name}")
        self._file.seek(self.data_start + self.offsets[name][0])
        write_tensor(self._file, value)
        self.written.add(name)

    def close(self) -> None:
        """Flush and close; ValueError if a tensor of the header was never written."""
        missing = [n for n in self.specs if n not in self.written]
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise ValueError(f"{self.path.name}: {len(missing)} tensors never written, e.g. {missing[:3]}")

    def abort(self) -> None:
        """Close without checking (a failed export; the caller removes the file)."""
        if not self._file.closed:
            self._file.close()
