"""The profiler: each rank's largest micro-batch and compute time per batch size, measured where
it runs (docs/design.md §4), and device emulation for CPU-only clusters.

Public names: ``profile`` (the API), ``VirtualDevice`` / ``CudaDevice`` (devices), ``is_oom``,
``search_mbs`` / ``trial_budget`` (the capacity search), ``timing_batches``.
"""

from poplar.profiler.api import profile
from poplar.profiler.capacity import CapacityResult, search_mbs, trial_budget
from poplar.profiler.cuda_device import CudaDevice
from poplar.profiler.devices import Device, is_oom
from poplar.profiler.timing import timing_batches
from poplar.profiler.virtual_device import PresetCurve, SaturatingCurve, VirtualDevice

__all__ = ["profile", "CapacityResult", "search_mbs", "trial_budget", "CudaDevice", "Device", "is_oom",
           "timing_batches", "PresetCurve", "SaturatingCurve", "VirtualDevice"]
