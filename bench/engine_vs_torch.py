"""Poplar's engine against PyTorch's own data parallelism, same model, same per-rank batches.

- ``zero3_vs_fsdp2``: Poplar ZeRO-3 ÷ FSDP2 ``fully_shard(reshard_after_forward=True)``, both
  wrapping each transformer block (plus the root), AdamW.
- ``zero0_vs_ddp``: Poplar ZeRO-0 ÷ ``DistributedDataParallel``.
- ``zero1_vs_ddp_zero``: Poplar ZeRO-1 ÷ DDP with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1).
- ``zero2_bf16_vs_fsdp2_bf16`` / ``zero3_bf16_vs_fsdp2_bf16``: Poplar ZeRO-2/3 with
  ``mixed_precision="bf16"`` ÷ FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`` (``--no-bf16`` leaves these rows out).

Gloo ranks on CPU (``poplar.comm.launch.spawn``), one thread each, a small transformer (~3.3M
parameters, 4 blocks). Every system trains the same model copy on the same batches; timed
blocks of iterations are interleaved (A, B, A, B, ...) after a warm-up, each block's time is the
slowest rank's, and ratios are of medians (ours ÷ torch: < 1 means Poplar is faster).
Prints a table and, last, ``RESULT {json}``.

    python bench/engine_vs_torch.py [--world 2] [--iters 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from poplar.engine import PoplarEngine
from poplar.comm.launch import spawn
from poplar.types.plans import Plan

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 512, 256, 4, 4, 64, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        h = h + self.proj(a)
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def fresh_model() -> LM:
    torch.manual_seed(0)
    return LM()


def batch(rank: int, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def make_systems(world: int, bf16: bool) -> dict[str, Callable[[torch.Tensor], float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    plan = Plan.even(world, world * BATCH, BATCH)  # one micro-step of BATCH samples per rank
    systems: dict[str, Callable[[torch.Tensor], float]] = {}
    for stage in (3, 1, 0):
        model = fresh_model()
        engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=stage, plan=plan,
                              wrap_policy={Block} if stage == 3 else None)
        systems[f"poplar_zero{stage}"] = lambda x, e=engine: e.train_step(x, loss_fn)

    model = fresh_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    systems["torch_fsdp2"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    model = DistributedDataParallel(fresh_model())
    systems["torch_ddp"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model = DistributedDataParallel(fresh_model())
    systems["torch_ddp_zero"] = _torch_step(model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                                           lr=1e-3))
    if not bf16:
        return systems
    for stage in (3, 2):
        model = fresh_model()
        engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=stage, plan=plan,
                              wrap_policy={Block} if stage == 3 else None, mixed_precision="bf16")
        systems[f"poplar_zero{stage}_bf16"] = lambda x, e=engine: e.train_step(x, loss_fn)
    model = fresh_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    systems["torch_fsdp2_bf16"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return systems


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], float]:
    def step(x: torch.Tensor) -> float:
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def worker(rank: int, world: int, iters: int, repeats: int, bf16: bool) -> dict[str, Any]:
    systems = make_systems(world, bf16)
    losses = {name: [step(batch(rank, it)) for it in range(2)] for name, step in systems.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(repeats):
        for name, step in systems.items():
            dist.barrier()
            t0 = time.perf_counter()
            for it in range(iters):
                step(batch(rank, 2 + rep * iters + it))
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name].append(float(slowest) / iters)
    return {"times": times, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4, help="iterations per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per system (interleaved)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="leave out the bf16 rows")
    args = ap.parse_args()
    out = spawn(worker, args.world, (args.iters, args.repeats, args.bf16), timeout_s=900,
                collective_timeout_s=300)[0]
    med = {name: statistics.median(ts) for name, ts in out["times"].items()}
    psi = sum(p.numel() for p in fresh_model().parameters())
    print(f"{args.world} gloo ranks on CPU, {psi / 1e6:.2f}M parameters, {LAYERS} blocks, {BATCH}x{SEQ} tokens "
          f"per rank, AdamW; median of {args.repeats} blocks of {args.iters} iterations")
    print(f"{'system':<18} {'s/iter':>8} {'min':>8} {'max':>8}   warm-up losses")
    for name, ts in out["times"].items():
        print(f"{name:<18} {med[name]:>8.4f} {min(ts):>8.4f} {max(ts):>8.4f}   "
              + " ".join(f"{v:.4f}" for v in out["losses"][name]))
    result = {"zero3_vs_fsdp2": med["poplar_zero3"] / med["torch_fsdp2"],
              "zero0_vs_ddp": med["poplar_zero0"] / med["torch_ddp"],
              "zero1_vs_ddp_zero": med["poplar_zero1"] / med["torch_ddp_zero"],
              "seconds_per_iter": med, "world": args.world, "params": psi}
    print(f"ZeRO-3 / FSDP2 = {result['zero3_vs_fsdp2']:.3f}   ZeRO-0 / DDP = {result['zero0_vs_ddp']:.3f}   "
          f"ZeRO-1 / DDP+ZeroRedundancyOptimizer = {result['zero1_vs_ddp_zero']:.3f}")
    if args.bf16:
        for stage in (2, 3):
            result[f"zero{stage}_bf16_vs_fsdp2_bf16"] = med[f"poplar_zero{stage}_bf16"] / med["torch_fsdp2_bf16"]
        print(f"bf16: ZeRO-2 / FSDP2 = {result['zero2_bf16_vs_fsdp2_bf16']:.3f}   "
              f"ZeRO-3 / FSDP2 = {result['zero3_bf16_vs_fsdp2_bf16']:.3f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
