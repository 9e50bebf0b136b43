"""A real CUDA device: the allocator's own probes and its own out-of-memory error.

- memory in use: ``torch.cuda.memory_allocated``; peak: ``torch.cuda.max_memory_allocated``
  (reset at the start of each micro-step);
- capacity: ``mem_get_info``'s total, or a cap: ``memory_cap_bytes`` makes a big card act as a
  smaller one through ``torch.cuda.set_per_process_memory_fraction``, so the allocator raises
  ``torch.cuda.OutOfMemoryError`` at the cap exactly as the small card would;
- recovery: after an OOM the failed step's tensors are released (``gc.collect``) and the
  allocator's cache is emptied (``torch.cuda.empty_cache``), so the next trial starts clean;
- timing: ``synchronize`` before reading the clock (kernels are asynchronous);
- precision: bf16 only where the GPU computes in it natively
  (``torch.cuda.is_bf16_supported(including_emulation=False)``: compute capability 8.0+), and
  within ``precisions`` when given (a big card acting as a smaller one that lacks bf16).

The CUDA tests (``tests/profiler/test_profiler_cuda.py``) run it where a GPU is lent; the
project's CI has none.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from poplar.profiler.devices import Device
from poplar.types.precision import Precision, precision_of


class CudaDevice(Device):
    """This process's GPU (``index``: default the current CUDA device). ``memory_cap_bytes`` caps
    it; ``device_type`` names its type (default its CUDA name); ``nominal_tflops`` rates it for
    the ``flops`` baseline; ``precisions`` limits what it computes in (None: what it supports)."""

    def __init__(self, index: int | torch.device | None = None, *, memory_cap_bytes: int | None = None,
                 device_type: str | None = None, nominal_tflops: float | None = None,
                 precisions: frozenset[Precision] | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs CUDA; on a CPU-only machine emulate GPUs with poplar.emulation "
                               "(poplar profile --cluster ... emulates one per rank)")
        if index is None or (isinstance(index, torch.device) and index.index is None):
            idx = torch.cuda.current_device()
        else:
            idx = index.index if isinstance(index, torch.device) else int(index)
        dev = torch.device("cuda", idx)
        name = torch.cuda.get_device_name(dev)
        super().__init__(name, device_type or name, dev, nominal_tflops)
        self.precisions = precisions
        free, total = torch.cuda.mem_get_info(dev)
        self.total_bytes = int(total)
        self.memory_cap_bytes = memory_cap_bytes
        if memory_cap_bytes is not None:
            if not 0 < memory_cap_bytes <= total:
                raise ValueError(f"memory_cap_bytes must be in (0, {total}], got {memory_cap_bytes}")
            torch.cuda.set_per_process_memory_fraction(memory_cap_bytes / total, dev)
            self._capacity = int(memory_cap_bytes)
        else:
            # what this process can use: free memory now plus what its allocator already holds
            self._capacity = int(free + torch.cuda.memory_reserved(dev))

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def identity(self) -> str:
        """The GPU's name and total memory (and the cap, if any): its free memory varies from run to run."""
        cap = "" if self.memory_cap_bytes is None else f", capped at {self.memory_cap_bytes} bytes"
        return f"{self.name}, {self.total_bytes} bytes{cap}"

    def memory_in_use(self) -> int:
        return int(torch.cuda.memory_allocated(self.torch_device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.torch_device))

    def supports(self, precision: Any) -> bool:
        p = precision_of(precision)
        if self.precisions is not None and p not in self.precisions:
            return False
        if p is not Precision.BF16:
            return True
        with torch.cuda.device(self.torch_device):
            try:
                return bool(torch.cuda.is_bf16_supported(including_emulation=False))
            except TypeError:  # torch < 2.4: no emulation to leave out
                return bool(torch.cuda.is_bf16_supported())

    def static_bytes(self) -> int | None:
        return None  # the allocator sees one total; model states are not counted apart

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def release(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update({"total_bytes": self.total_bytes, "memory_cap_bytes": self.memory_cap_bytes})
        return d
