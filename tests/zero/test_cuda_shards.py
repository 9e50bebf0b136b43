"""Shard weights on NCCL: the uneven collectives, and ZeRO-1/2/3 with weighted shards against
single-process full-batch training on the same GPU.

Three ranks (``POPLAR_CUDA_RANKS=N`` asks for N), placed on the visible GPUs in turn, sharing them
where there are fewer (``poplar.emulation.gpu_ranks``). Skipped without a GPU (CI has none); written to
run as is on one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from poplar.checkpoint import load_checkpoint, save_checkpoint
from poplar.comm import Communicator, uneven
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.plans import Offload, Plan, RankPlan
from poplar.zero.config import ZeroConfig
from poplar.emulation.gpu_ranks import rank_gpu
from tests.toy import global_batch, loss_fn, make_model, make_optimizer, max_rel_err, rank_slice, train_reference

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.multiprocess]

ITERATIONS = 3
ROWS = [(3, 2, 1), (2, 1, 0), (2, 2, 1)]  # rank r's (micro-batch, accumulation steps, last batch): 7, 2, 5 samples
WEIGHTS = [5.0, 1.0, 2.0]
# (optimizer, clipping, offload): plain SGD-momentum catches a wrong gradient scale
CONFIGS = [("sgd", None, Offload.NONE), ("sgd", 0.5, Offload.NONE), ("adamw", 0.5, Offload.NONE),
           ("sgd", 0.5, Offload.OPTIMIZER)]


def world_size() -> int:
    return int(os.environ.get("POPLAR_CUDA_RANKS", "3"))


def plan_for(world: int, weights: bool = True, offload: Offload = Offload.NONE) -> Plan:
    return Plan([RankPlan(*ROWS[r % 3], shard_weight=WEIGHTS[r % 3] if weights else 1.0, offload=offload)
                 for r in range(world)])


def _config(stage: int) -> ZeroConfig:
    if stage == 3:
        return ZeroConfig(3, wrap_policy={nn.Linear, nn.LayerNorm})
    return ZeroConfig(stage, bucket_size_mb=0.001)  # small buckets: parameters cut across ranks


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def reference(kind: str, gbs: int, max_norm: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch, on the GPU."""
    model = make_model(seed=0).cuda()
    losses, state = train_reference(model, make_optimizer(model, kind),
                                    lambda it: loss_fn(model, global_batch(it, gbs).cuda()), ITERATIONS, max_norm)
    return losses, _cpu(state)


# ---------------------------------------------------------------- the collectives
def _sizes(world: int) -> list[tuple[int, ...]]:
    lengths = tuple((10, 2, 4, 7, 3, 5, 1, 6)[r % 8] for r in range(world))
    return [lengths] if world == 1 else [lengths, (0,) + lengths[1:]]  # and a rank with an empty part


def _part(rank: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32, device=device) + 100 * (rank + 1)


def collectives_worker(rank: int, world: int) -> dict:
    device = rank_gpu(rank, world)
    comm = Communicator(device=device)
    out = {"backend": comm.backend}
    for sizes in _sizes(world):
        total = sum(sizes)
        for method in (uneven.UnevenMethod.LISTED, uneven.UnevenMethod.PADDED):
            flat = torch.zeros(total, device=device)
            call = uneven.all_gather(flat, _part(rank, sizes[rank], device), sizes, rank, None, method)
            call.run(False)
            if call.finish is not None:
                call.finish()
            out[("all_gather", sizes, method.value)] = (flat.cpu(), call.wire_bytes)
            mine = torch.zeros(sizes[rank], device=device)
            call = uneven.reduce_scatter(mine, torch.arange(total, dtype=torch.float32, device=device) * (rank + 1),
                                         sizes, rank, None, method)
            call.run(False)
            if call.finish is not None:
                call.finish()
            out[("reduce_scatter", sizes, method.value)] = (mine.cpu(), call.wire_bytes)
        if world == 1:  # a world of one issues no collective through the communicator
            continue
        flat, mine = torch.zeros(total, device=device), torch.zeros(sizes[rank], device=device)
        comm.all_gather(flat, _part(rank, sizes[rank], device), tag="ag", async_op=True, sizes=sizes).wait()
        comm.reduce_scatter(mine, torch.arange(total, dtype=torch.float32, device=device) * (rank + 1), tag="rs",
                            async_op=True, sizes=sizes).wait()
        out[("comm", sizes)] = (flat.cpu(), mine.cpu(), {r.tag: r.bytes for r in comm.ledger.records})
        comm.ledger.records.clear()
    return out


def test_uneven_collectives_on_nccl() -> None:
    world = world_size()
    results = spawn(collectives_worker, world, backend="nccl", timeout_s=120)
    weight_sum = world * (world + 1) // 2  # ranks contribute x1, x2, ...
    for sizes in _sizes(world):
        total, longest = sum(sizes), max(sizes)
        gathered = torch.cat([_part(r, s, torch.device("cpu")) for r, s in enumerate(sizes)])
        summed = torch.arange(total, dtype=torch.float32) * weight_sum
        starts = [sum(sizes[:r]) for r in range(world)]
        for rank, res in enumerate(results):
            assert res["backend"] == "nccl"
            mine = summed[starts[rank]:starts[rank] + sizes[rank]]
            for method, wire in (("listed", total), ("padded", world * longest)):
                flat, sent = res[("all_gather", sizes, method)]
                assert torch.equal(flat, gathered) and sent == 4 * wire, (sizes, method, rank)
                part, sent = res[("reduce_scatter", sizes, method)]
                assert torch.equal(part, mine) and sent == 4 * wire, (sizes, method, rank)
            if world == 1:
                continue
            flat, part, ledger = res[("comm", sizes)]
            assert torch.equal(flat, gathered) and torch.equal(part, mine)
            assert ledger == {"ag": 4 * total, "rs": 4 * total}  # NCCL's list collectives send no padding


# ---------------------------------------------------------------- training with weighted shards
def parity_worker(rank: int, world: int, stage: int) -> dict:
    device = rank_gpu(rank, world)
    plan = plan_for(world)
    gbs = plan.global_batch_size
    out: dict = {}
    for kind, max_norm, offload in CONFIGS:
        run_plan = plan_for(world, offload=offload)
        model = make_model(seed=0).to(device)
        engine = PoplarEngine(model, make_optimizer(model, kind), zero_stage=_config(stage), plan=run_plan,
                              max_grad_norm=max_norm)
        losses = [engine.train_step(rank_slice(global_batch(it, gbs), plan, rank).to(device), loss_fn)
                  for it in range(ITERATIONS)]
        out[(kind, max_norm, offload.value)] = (losses, _cpu(engine.full_state_dict()))
    model = make_model(seed=0).to(device)
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(stage), plan=plan,
                          max_grad_norm=0.5, mixed_precision="bf16")
    out["bf16"] = [engine.train_step(rank_slice(global_batch(it, gbs), plan, rank).to(device), loss_fn)
                   for it in range(ITERATIONS)]
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_weighted_shards_match_single_process_on_nccl(stage: int) -> None:
    world = world_size()
    plan = plan_for(world)
    results = spawn(parity_worker, world, (stage,), backend="nccl", timeout_s=180)
    for kind, max_norm, offload in CONFIGS:
        ref_losses, ref_state = reference(kind, plan.global_batch_size, max_norm)
        for rank, res in enumerate(results):
            losses, state = res[(kind, max_norm, offload.value)]
            assert max_rel_err(state, ref_state) <= 1e-5, (kind, max_norm, offload, rank)
            assert losses == pytest.approx(ref_losses, rel=1e-5), (kind, max_norm, offload, rank)
    ref_losses, _ = reference("sgd", plan.global_batch_size, 0.5)
    for res in results:  # bf16 compute with fp32 masters follows fp32 training
        assert res["bf16"] == pytest.approx(ref_losses, rel=0.02), (res["bf16"], ref_losses)


def checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    device = rank_gpu(rank, world)
    weighted_plan, even_plan = plan_for(world), plan_for(world, weights=False)
    gbs = weighted_plan.global_batch_size
    model = make_model(seed=0).to(device)
    engine = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(3), plan=weighted_plan)
    for it in range(2):
        engine.train_step(rank_slice(global_batch(it, gbs), weighted_plan, rank).to(device), loss_fn)
    save_checkpoint(engine, directory)
    model = make_model(seed=1).to(device)  # other initial weights: everything must come from the checkpoint
    resumed = PoplarEngine(model, make_optimizer(model, "sgd"), zero_stage=_config(3), plan=even_plan)
    load_checkpoint(resumed, directory)
    loss = resumed.train_step(rank_slice(global_batch(2, gbs), even_plan, rank).to(device), loss_fn)
    return {"loss": loss, "state": _cpu(resumed.full_state_dict())}


def test_weighted_checkpoint_resumes_with_even_shards_on_nccl(tmp_path: Path) -> None:
    world = world_size()
    results = spawn(checkpoint_worker, world, (str(tmp_path / "ckpt"),), backend="nccl", timeout_s=120)
    ref_losses, ref_state = reference("sgd", plan_for(world).global_batch_size, None)
    for res in results:
        assert max_rel_err(res["state"], ref_state) <= 1e-5
        assert res["loss"] == pytest.approx(ref_losses[2], rel=1e-5)
