"""After an out-of-memory error in a micro-step, the failed iteration's activations are freed by
reference counting alone: with the garbage collector off and no ``gc.collect()``, memory is back
to its level before the failure and the next iteration on a batch that fits succeeds. The error
still tells where it happened (its traceback, as a note)."""

from __future__ import annotations

import gc

import pytest

from poplar.comm import DistributedError
from poplar.emulation import VirtualDevice
from poplar.zero.failures import is_oom
from tests.emulation.test_virtual_device import MB, engine_at, step


@pytest.mark.parametrize("stage", [0, 3])
def test_the_next_iteration_fits_without_a_gc_collect(stage: int) -> None:
    engine = engine_at(stage)
    device = VirtualDevice("d", 1 * MB)
    gc.collect()
    gc.disable()
    try:
        with device.attach(engine):
            step(engine, 2)
            before = device.memory_in_use()
            error = None
            try:
                step(engine, 64)
            except DistributedError as e:
                error = e
            assert error is not None and is_oom(error)
            kept_traceback, notes = error.__cause__.__traceback__ is not None, getattr(error.__cause__, "__notes__", [])
            error = None
            assert device.memory_in_use() == before and device.saved_bytes == 0
            assert not kept_traceback and "in forward" in "".join(notes)
            step(engine, 2)  # fits again, without device.release() or gc.collect()
            step(engine, 2)
    finally:
        gc.enable()
