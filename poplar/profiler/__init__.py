"""The profiler: each rank's largest micro-batch and compute time per batch size, measured where
it runs (docs/design.md §4).

Public names: ``profile`` (the API), ``ProfileOptions``, ``ProfileJob`` and ``ProfileRun`` (the
profiling sequence: ``ProfileRun(job, device).measure()``), ``Device`` / ``CudaDevice`` (devices), ``ProfilePhase`` /
``ProfileObserver`` (what hears of a run's phases), ``search_mbs`` / ``trial_budget`` (the
capacity search), ``timing_batches``.
"""

from poplar.profiler.api import profile
from poplar.profiler.capacity import CapacityResult, search_mbs, trial_budget
from poplar.profiler.cuda_device import CudaDevice
from poplar.profiler.devices import Device
from poplar.profiler.phases import PhaseRecord, ProfileObserver, ProfilePhase
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, ProfileRun, profile_rank
from poplar.profiler.timing import timing_batches

__all__ = ["profile", "CapacityResult", "search_mbs", "trial_budget", "CudaDevice", "Device", "PhaseRecord",
           "ProfileObserver", "ProfilePhase", "ProfileJob", "ProfileOptions", "ProfileRun", "profile_rank",
           "timing_batches"]
