"""An engine that is no longer referenced is freed with its model, at every stage: gradient
hooks live on the parameters' C++ side, out of the cycle collector's sight, so a hook that held
the stage strongly kept every engine ever built (and each profiler trial builds one) alive."""

from __future__ import annotations

import pytest

import gc
import weakref

import torch

from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, plan_of, rank_slice

PLAN = plan_of((2, 1, 0), (1, 2, 0))


def build_train_drop(rank: int, world: int) -> dict[int, tuple[bool, bool]]:
    torch.set_num_threads(1)
    alive = {}
    for stage in range(4):
        model = make_model()
        engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=stage, plan=PLAN)
        for it in range(2):
            engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), loss_fn)
        engine.close()
        engine_ref, model_ref = weakref.ref(engine), weakref.ref(model)
        del engine, model
        gc.collect()
        alive[stage] = (engine_ref() is not None, model_ref() is not None)
    return alive


@pytest.mark.multiprocess
def test_a_dropped_engine_is_freed_with_its_model_at_every_stage():
    for alive in spawn(build_train_drop, 2, (), timeout_s=240, collective_timeout_s=60):
        assert alive == {stage: (False, False) for stage in range(4)}, alive
