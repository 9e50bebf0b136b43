"""The CUDA path of the profiler: real allocator probes, a memory cap, real OOM recovery.

Skipped without a GPU (CI has none); written to run as is on one.
"""

from __future__ import annotations

import pytest
import torch

from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.local_comm import local_engine, search_plan
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, default_optimizer, search_capacity
from poplar.workloads import get_workload
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import PlanCheck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GIB = 2 ** 30
W = get_workload("llama-tiny")


@pytest.fixture
def capped_device():
    from poplar.profiler.cuda_device import CudaDevice

    torch.cuda.empty_cache()
    device = CudaDevice(0, memory_cap_bytes=int(0.5 * GIB))  # act as a 0.5 GiB card
    yield device
    torch.cuda.set_per_process_memory_fraction(1.0, device.torch_device)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_cuda_capacity_search_and_recovery(stage: int, capped_device) -> None:
    device = capped_device
    result = search_capacity(ProfileJob(W.model_fn, W.loss_fn, W.sample_fn, default_optimizer, ProfileOptions(bucket_size_mb=4.0)), device,
                             world_size=2, rank=0, stage=stage,
                             log=lambda m: None)
    assert result.mbs >= 1 and result.oom_events
    for event in result.oom_events:  # a real torch.cuda.OutOfMemoryError, caught and released
        assert "OutOfMemoryError" in event.message
    # the found mbs trains; one more does not
    model = W.model_fn().to(device.torch_device)
    engine = local_engine(model, default_optimizer(model), world_size=2, rank=0, zero_stage=ZeroConfig(stage, bucket_size_mb=4.0),
                          device=device.torch_device)
    with device.attach(engine):
        search = CapacitySearch(engine, device, W.sample_fn, W.loss_fn, stage)
        assert search.trial(result.mbs)
        assert not search.trial(result.mbs + max(1, result.mbs // 8))
        engine.set_plan(search_plan(2, 0, result.mbs), PlanCheck.LOCAL)
        engine.train_step(W.sample_fn(result.mbs).cuda(), W.loss_fn)


def test_capacity_search_leaves_no_garbage_on_the_gpu(capped_device) -> None:
    """The search's last runtime is collected before it returns, not left as reference cycles
    holding GPU memory until some later collection (which a later search would misread)."""
    import gc

    def search() -> None:
        search_capacity(ProfileJob(W.model_fn, W.loss_fn, W.sample_fn, default_optimizer, ProfileOptions(bucket_size_mb=4.0)), capped_device, world_size=2, rank=0,
                        stage=2, log=lambda m: None)

    search()  # the first also allocates the libraries' workspaces, which stay
    gc.collect()
    before = torch.cuda.memory_allocated(capped_device.torch_device)
    search()
    assert torch.cuda.memory_allocated(capped_device.torch_device) == before
