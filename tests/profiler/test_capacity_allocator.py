"""The capacity search on a real allocator's terms, where memory is free only once nothing holds
it: a card that runs out while the model is placed and sharded fits no batch (an answer, not an
error), and a runtime rebuilt after an out-of-memory error is built with the broken one gone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from poplar.emulation import VirtualDevice
from poplar.profiler.capacity import CapacitySearch
from poplar.profiler.configurations import raised_at
from poplar.profiler.local_comm import local_engine
from poplar.profiler.profile_run import ProfileJob, ProfileOptions, search_capacity
from poplar.zero.runtime import ZeroRuntime
from poplar.zero.config import ZeroConfig
from tests.toy import SEQ, VOCAB, loss_fn, make_model


def _tokens(b: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ + 1))


def test_no_room_to_build_is_no_batch_not_an_error() -> None:
    def out_of_memory() -> torch.nn.Module:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    device = VirtualDevice("dev", 10**9)
    device.pad = False
    job = ProfileJob(out_of_memory, loss_fn, _tokens, options=ProfileOptions(zero_stage=3))
    result = search_capacity(job, device, world_size=2, rank=1, stage=3)
    assert result.mbs == 0 and result.trial_steps == 0
    assert "placed and sharded" in result.reason and "Tried to allocate 20.00 MiB" in result.reason

    def broken() -> torch.nn.Module:
        raise ValueError("a bad model_fn")

    with pytest.raises(ValueError, match="bad model_fn"):  # anything but an OOM is still an error
        search_capacity(ProfileJob(broken, loss_fn, _tokens, options=job.options), device, world_size=2, rank=1,
                        stage=3)


class LeakyLooking(VirtualDevice):
    """Reports more memory in use at every read, as an allocator does when a failed step kept
    some: every recovery rebuilds the runtime."""

    reads = 0

    def memory_in_use(self) -> int:
        self.reads += 1
        return super().memory_in_use() + self.reads


def test_a_rebuild_finds_the_broken_runtime_gone() -> None:
    device = LeakyLooking("dev", 10**9)
    device.pad = False

    def new_runtime() -> ZeroRuntime:
        model = make_model()
        return local_engine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), world_size=2, rank=0,
                            zero_stage=ZeroConfig(3), device=torch.device("cpu"))

    def too_big(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if len(tokens) > 2:
            raise torch.OutOfMemoryError("out of memory at this batch")
        return loss_fn(model, tokens)

    built: list[weakref.ref] = []

    def rebuild() -> ZeroRuntime:
        gc.collect()
        assert built[-1]() is None, "the broken runtime is still held while its replacement is built"
        runtime = new_runtime()
        built.append(weakref.ref(runtime))
        return runtime

    first = new_runtime()
    built.append(weakref.ref(first))
    search = CapacitySearch(first, device, _tokens, too_big, 3, max_batch=8, rebuild=rebuild)
    del first
    result = search.run()
    assert result.mbs == 2 and len(built) >= 2 and all(e.rebuilt for e in result.oom_events)


def test_no_room_to_build_again_after_a_failed_trial_is_no_batch() -> None:
    """A failed trial can leave memory taken for good (cuBLAS's workspaces, on a GPU); where the
    runtime then cannot be built again, no batch fits at those weights, whatever fitted before."""
    builds = []

    def model_fn() -> torch.nn.Module:
        builds.append(1)
        if len(builds) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return make_model()

    def too_big(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if len(tokens) > 2:
            raise torch.OutOfMemoryError("out of memory at this batch")
        return loss_fn(model, tokens)

    device = LeakyLooking("dev", 10**9)
    device.pad = False
    job = ProfileJob(model_fn, too_big, _tokens, options=ProfileOptions(zero_stage=3, max_batch=8))
    result = search_capacity(job, device, world_size=2, rank=0, stage=3)
    assert len(builds) == 2 and result.mbs == 0 and "placed and sharded" in result.reason
    assert (1, True) in result.trials and result.trials[-1][1] is False  # what was tried stays on record


def test_a_rank_error_names_where_in_poplar_it_was_raised() -> None:
    """The agreement carries a rank's error as text: it names the innermost Poplar frames."""
    device = VirtualDevice("dev", 10**9)
    try:
        search_capacity(ProfileJob(make_model, loss_fn, lambda b: 1 / 0, options=ProfileOptions(zero_stage=3)),
                        device, world_size=2, rank=0, stage=3)
    except ZeroDivisionError as e:
        where = raised_at(e)
    assert where.startswith("capacity.py:") and " trial < " in where, where  # not the test's own frames
