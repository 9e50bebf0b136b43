"""Poplar's engine against PyTorch's own data parallelism, same model, same per-rank batches.

- ``zero3_vs_fsdp2``: Poplar ZeRO-3 ÷ FSDP2 ``fully_shard(reshard_after_forward=True)``, both
  wrapping each transformer block (plus the root), AdamW.
- ``zero3_compiled_vs_eager`` / ``zero3_compiled_vs_fsdp2_compiled``: Poplar ZeRO-3 with each
  block compiled (``block.compile()``, inductor, docs/design.md §3.10) ÷ the same eager, and ÷
  FSDP2 with each block compiled the same way (``--no-compile`` leaves these rows out). Compiling
  happens in the warm-up iterations; timed blocks run the compiled code.
- ``zero0_vs_ddp``: Poplar ZeRO-0 ÷ ``DistributedDataParallel``.
- ``zero1_vs_ddp_zero``: Poplar ZeRO-1 ÷ DDP with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1).
- ``zero2_bf16_vs_fsdp2_bf16`` / ``zero3_bf16_vs_fsdp2_bf16``: Poplar ZeRO-2/3 with
  ``mixed_precision="bf16"`` ÷ FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)`` (``--no-bf16`` leaves these rows out).
- ``zero2_offload_over_peer``: Poplar ZeRO-2 with every rank's plan row ``Offload.OPTIMIZER``
  (fp32 master shard and AdamW state on the host, the step there) ÷ FSDP2 with
  ``CPUOffloadPolicy`` (parameters, gradients and optimizer state on the host, the step there),
  per block and root, ``reshard_after_forward=False`` (one parameter gather per iteration, as at
  ZeRO-2) (``--no-offload`` leaves these rows out). On CPU the "host" is the device: both sides
  pay the same host AdamW step, and their device-host copies are plain CPU memcpys (FSDP2
  skips its own when the device is the CPU); pinned memory needs a GPU, so it is off on CPU.
- ``zero1_vs_ddp_zero_by_shape`` (``--zero1-shapes``, default ``4x256,8x256,8x384``; two ranks or more): after the
  main pass, in the same run, one pass per shape (blocks x width) of only ZeRO-1 and DDP +
  ``ZeroRedundancyOptimizer``; ``zero1_vs_ddp_zero_max`` is the largest of them. Beside them each
  pass times ``compute_floor``: the same forward and backward and an AdamW step on about 1/world
  of the parameters, with no communication, the least any ZeRO-1 can take on these cores;
  ``zero1_floor_vs_ddp_zero_by_shape`` is it ÷ the peer, how far below the peer a ratio can go.
- ``zero0_vs_ddp_by_shape`` (``--zero0-shapes``, same default): the same for ZeRO-0 and DDP,
  both with their default 25 MB buckets; its ``compute_floor`` steps all the parameters.

By default gloo ranks on CPU (``poplar.process.launch.spawn``), one thread each, a small transformer
(~3.3M parameters, 4 blocks). ``--device cuda`` runs NCCL ranks on this machine's GPUs and a
larger model (the ``GPU`` sizes below; ``--dim/--layers/--heads/--seq/--batch/--vocab`` override
either preset), timing with ``torch.cuda.synchronize()`` around each block: by default a world of
one (the engine's own step, no collective); with ``--world N`` one process a rank, ranks sharing
a GPU where there are fewer (``poplar.emulation.gpu_ranks``: NCCL's socket transport joins them,
so the collectives overlap the compute as they would between machines, only slower). Every system
trains the same model copy on the same batches; timed blocks of iterations are interleaved
(A, B, A, B, ...) after a warm-up, each block's time is the slowest rank's, and ratios are of
medians (ours ÷ torch: < 1 means Poplar is faster). Prints a table and, last, ``RESULT {json}``.
``--trace DIR`` then profiles one more block of each system (``trace_block``): where a ratio
comes from, e.g. how often each system's host waits for its GPU.

    python bench/engine_vs_torch.py [--world 2] [--iters 4] [--repeats 5] [--zero1-shapes 4x256,8x256,8x384]
    python bench/engine_vs_torch.py --zero1-only --repeats 9
    python bench/engine_vs_torch.py --zero0-only --zero0-shapes 4x256,8x384 --repeats 9
    python bench/engine_vs_torch.py --device cuda --world 2 --zero0-only --zero0-shapes 12x768,24x1024
    python bench/engine_vs_torch.py --device cuda [--layers 12]
    python bench/engine_vs_torch.py --device cuda --world 2 --zero0-only --zero0-shapes 4x256 --trace $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from poplar.engine import PoplarEngine
from poplar.process.launch import free_port, spawn
from poplar.emulation.gpu_ranks import rank_gpu
from poplar.types.plans import Offload, Plan
from poplar.zero.config import ZeroConfig


@dataclass(frozen=True)
class Shape:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int  # samples per rank per iteration


CPU = Shape(vocab=512, dim=256, heads=4, layers=4, seq=64, batch=8)
GPU = Shape(vocab=32000, dim=1024, heads=16, layers=12, seq=1024, batch=8)


class Block(nn.Module):
    def __init__(self, c: Shape) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv, self.proj = nn.Linear(c.dim, 3 * c.dim), nn.Linear(c.dim, c.dim)
        self.up, self.down = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.proj(a)
        return h + self.down(F.gelu(self.up(self.ln2(h))))


class LM(nn.Module):
    def __init__(self, c: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Parameter(torch.zeros(c.seq, c.dim))
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def fresh_model(c: Shape, device: torch.device) -> LM:
    torch.manual_seed(0)
    return LM(c).to(device)


def batch(c: Shape, rank: int, it: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randint(0, c.vocab, (c.batch, c.seq + 1), generator=g).to(device)


@dataclass(frozen=True)
class Rows:
    """Which systems a pass builds: every row (with or without the bf16, offload and compiled
    rows), or only one stage's pair (``pair``: 1 for ``poplar_zero1`` and ``torch_ddp_zero``, 0
    for ``poplar_zero0`` and ``torch_ddp``, each with its ``compute_floor``) for the
    ``--zero1-shapes`` and ``--zero0-shapes`` passes."""

    bf16: bool = True
    offload: bool = True
    pair: int | None = None
    compiled: bool = True


def make_zero1_pair(c: Shape, world: int, device: torch.device) -> dict[str, Callable[[torch.Tensor], float]]:
    """Poplar ZeRO-1 and DDP + ZeroRedundancyOptimizer, AdamW, even shards."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = fresh_model(c, device)
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(1),
                          plan=Plan.even(world, world * c.batch, c.batch))
    model = DistributedDataParallel(fresh_model(c, device), device_ids=[device.index or 0] if device.type == "cuda" else None)
    local = fresh_model(c, device)
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-3)
    shard = [p for i, p in enumerate(local.parameters()) if i % world == 0]  # about 1/world of the state
    return {"poplar_zero1": lambda x, e=engine: e.train_step(x, loss_fn),
            "torch_ddp_zero": _torch_step(model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)),
            "compute_floor": _local_step(local, local_opt, shard)}


def make_zero0_pair(c: Shape, world: int, device: torch.device) -> dict[str, Callable[[torch.Tensor], float]]:
    """Poplar ZeRO-0 and DDP, AdamW, both with their default buckets (25 MB)."""
    from torch.nn.parallel import DistributedDataParallel

    model = fresh_model(c, device)
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(0),
                          plan=Plan.even(world, world * c.batch, c.batch))
    model = DistributedDataParallel(fresh_model(c, device), device_ids=[device.index or 0] if device.type == "cuda" else None)
    local = fresh_model(c, device)
    return {"poplar_zero0": lambda x, e=engine: e.train_step(x, loss_fn),
            "torch_ddp": _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3)),
            "compute_floor": _local_step(local, torch.optim.AdamW(local.parameters(), lr=1e-3), list(local.parameters()))}


def _local_step(model: nn.Module, opt: torch.optim.Optimizer, shard: list[nn.Parameter]) -> Callable[[torch.Tensor], float]:
    """The floor under any data-parallel ZeRO on these cores: forward, backward and an AdamW step
    on ``shard`` (ZeRO-1: about 1/world of the parameters; ZeRO-0: all), with no communication."""
    mine = {id(p) for p in shard}

    def step(x: torch.Tensor) -> float:
        loss = loss_fn(model, x)
        loss.backward()
        for p in model.parameters():
            if id(p) not in mine:
                p.grad = None  # the step below updates this rank's share only
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def make_systems(c: Shape, world: int, rows: Rows, device: torch.device) -> dict[str, Callable[[torch.Tensor], float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if rows.pair is not None:
        return {0: make_zero0_pair, 1: make_zero1_pair}[rows.pair](c, world, device)
    plan = Plan.even(world, world * c.batch, c.batch)  # one micro-step of c.batch samples per rank
    systems: dict[str, Callable[[torch.Tensor], float]] = {}
    for stage in (3, 1, 0):
        model = fresh_model(c, device)
        engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(stage, wrap_policy={Block} if stage == 3 else None), plan=plan)
        systems[f"poplar_zero{stage}"] = lambda x, e=engine: e.train_step(x, loss_fn)

    model = fresh_model(c, device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    ids = [device.index or 0] if device.type == "cuda" else None
    systems["torch_fsdp2"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    model = DistributedDataParallel(fresh_model(c, device), device_ids=ids)
    systems["torch_ddp"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model = DistributedDataParallel(fresh_model(c, device), device_ids=ids)
    systems["torch_ddp_zero"] = _torch_step(model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                                           lr=1e-3))
    if rows.compiled:
        systems.update(compiled_pair(c, plan, mesh, device))
    if rows.offload:
        model = fresh_model(c, device)
        engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(2),
                              plan=plan.with_offloads((Offload.OPTIMIZER,) * world))
        systems["poplar_zero2_offload"] = lambda x, e=engine: e.train_step(x, loss_fn)
        model = fresh_model(c, device)
        cpu_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs an accelerator
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False, offload_policy=cpu_policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=cpu_policy)
        systems["torch_fsdp2_offload"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    if not rows.bf16:
        return systems
    for stage in (3, 2):
        model = fresh_model(c, device)
        engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(stage, wrap_policy={Block} if stage == 3 else None), plan=plan, mixed_precision="bf16")
        systems[f"poplar_zero{stage}_bf16"] = lambda x, e=engine: e.train_step(x, loss_fn)
    model = fresh_model(c, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    systems["torch_fsdp2_bf16"] = _torch_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return systems


def compiled_pair(c: Shape, plan: Plan, mesh: Any, device: torch.device) -> dict[str, Callable[[torch.Tensor], float]]:
    """Poplar ZeRO-3 and FSDP2, each block compiled in place before the model is wrapped, as
    torchtitan does; the hooks of both run eagerly at the edges of each block's graph."""
    from torch.distributed.fsdp import fully_shard

    model = fresh_model(c, device)
    for layer in model.layers:
        layer.compile()
    engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          zero_stage=ZeroConfig(3, wrap_policy={Block}), plan=plan)
    peer = fresh_model(c, device)
    for layer in peer.layers:
        layer.compile()
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(peer, mesh=mesh, reshard_after_forward=True)
    return {"poplar_zero3_compiled": lambda x, e=engine: e.train_step(x, loss_fn),
            "torch_fsdp2_compiled": _torch_step(peer, torch.optim.AdamW(peer.parameters(), lr=1e-3))}


def _torch_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], float]:
    def step(x: torch.Tensor) -> float:
        loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the CUDA runtime calls in which a host waits for its GPU, counted in a trace (``--trace``); a
# tensor's ``.item()`` on the GPU is one of the first (``aten::_local_scalar_dense`` is not counted:
# on a CPU tensor, such as an optimizer's step count, it waits for nothing)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def trace_block(name: str, step: Callable[[torch.Tensor], float], xs: list[torch.Tensor], device: torch.device,
                prefix: str) -> None:
    """One more block of ``step`` under ``torch.profiler``, after the timed ones (the profiler's
    cost is in no timing); rank 0 adds where the time went to ``prefix + ".txt"`` (one file a
    pass): the block's time an iteration, the calls that make the host wait for the GPU, and the
    ops by self time (device, then host)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for x in xs:
            step(x)
        _sync(device)
    per_iter = (time.perf_counter() - t0) / len(xs)
    if dist.get_rank() != 0:
        return
    events = prof.key_averages()
    waits = {e.key: e.count for e in events if e.key in HOST_WAITS}
    with open(f"{prefix}.txt", "a") as f:
        f.write(f"=== {name}: {len(xs)} iterations under the profiler, {per_iter:.4f} s each; host waits: {waits}\n\n")
        for sort in (("self_device_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",)):
            try:
                f.write(events.table(sort_by=sort, row_limit=30) + "\n\n")
            except Exception as e:  # a torch without this sort key: the other tables still come
                f.write(f"(no table by {sort}: {type(e).__name__}: {e})\n\n")


def worker(rank: int, world: int, c: Shape, iters: int, repeats: int, rows: Rows,
           device_type: str = "cpu", trace: str | None = None) -> dict[str, Any]:
    """Every system's warm-up and interleaved timed blocks on this rank; ``trace``: a path prefix
    for one profiled block of each system after them (``trace_block``)."""
    device = rank_gpu(rank, world) if device_type == "cuda" else torch.device("cpu")
    systems = make_systems(c, world, rows, device)
    losses = {name: [step(batch(c, rank, it, device)) for it in range(2)] for name, step in systems.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in systems}
    for rep in range(repeats):
        for name, step in systems.items():
            xs = [batch(c, rank, 2 + rep * iters + it, device) for it in range(iters)]
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for x in xs:
                step(x)
            _sync(device)
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name].append(float(slowest) / iters)
    if trace is not None:
        for name, step in systems.items():
            trace_block(name, step, [batch(c, rank, 10_000 + it, device) for it in range(iters)], device, trace)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"times": times, "losses": losses, "peak_bytes": peak}


def run_cuda(c: Shape, iters: int, repeats: int, rows: Rows, trace: str | None = None) -> dict[str, Any]:
    """A world of one on this process's GPU, over NCCL."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=300), device_id=device)
    try:
        return worker(0, 1, c, iters, repeats, rows, "cuda", trace)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, c: Shape, rows: Rows, label: str = "main") -> dict[str, Any]:
    """``worker`` on every rank, rank 0's result: gloo ranks on CPU; on GPUs over NCCL, a world of
    one in this process, or one process a rank (sharing GPUs where there are fewer:
    ``poplar.emulation.gpu_ranks``). ``label`` names the pass's trace files."""
    trace = None
    if args.trace is not None:
        os.makedirs(args.trace, exist_ok=True)
        trace = os.path.join(args.trace, f"trace-{label}")
        if os.path.exists(trace + ".txt"):
            os.remove(trace + ".txt")  # this run's systems only
    if args.device == "cuda" and args.world == 1:
        return run_cuda(c, args.iters, args.repeats, rows, trace)
    return spawn(worker, args.world, (c, args.iters, args.repeats, rows, args.device, trace),
                 backend="nccl" if args.device == "cuda" else "gloo", timeout_s=900, collective_timeout_s=300)[0]


def where(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return f"{args.world} gloo ranks on CPU"
    gpus = torch.cuda.device_count()
    shared = f", sharing {gpus} GPU(s) through NCCL's socket transport" if args.world > gpus else ""
    return f"{args.world} NCCL rank(s) on {torch.cuda.get_device_name(0)}{shared}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, 1 on CUDA)")
    ap.add_argument("--iters", type=int, default=4, help="iterations per timed block")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per system (interleaved)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="leave out the bf16 rows")
    ap.add_argument("--no-offload", dest="offload", action="store_false", help="leave out the offload rows")
    ap.add_argument("--no-compile", dest="compiled", action="store_false",
                    help="leave out the rows with compiled blocks")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo ranks; cuda: NCCL ranks on the GPUs (one by default)")
    ap.add_argument("--zero1-shapes", default="4x256,8x256,8x384",
                    help="after the main pass, one ZeRO-1 ÷ DDP+ZeroRedundancyOptimizer pass per "
                         "BLOCKSxDIM shape ('' for none; two ranks or more)")
    ap.add_argument("--zero1-only", action="store_true", help="only the --zero1-shapes passes")
    ap.add_argument("--zero0-shapes", default="4x256,8x256,8x384",
                    help="after the main pass, one ZeRO-0 ÷ DDP pass per BLOCKSxDIM shape ('' for none; two "
                         "ranks or more)")
    ap.add_argument("--zero0-only", action="store_true", help="only the --zero0-shapes passes")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="after each pass's timed blocks, profile one more block of each system and write "
                         "where its time went to DIR/trace-<pass>.txt (rank 0)")
    for field in ("vocab", "dim", "heads", "layers", "seq", "batch"):
        ap.add_argument(f"--{field}", type=int, help=f"override the preset's {field}")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU and a torch built with CUDA; this one sees none (run on CPU "
                 "without --device)")
    rows = Rows(args.bf16, args.offload, compiled=args.compiled)
    c = CPU if args.device == "cpu" else GPU
    c = replace(c, **{k: getattr(args, k) for k in asdict(c) if getattr(args, k) is not None})
    if args.world is None:
        args.world = 1 if args.device == "cuda" else 2
    result: dict[str, Any] = {"world": args.world}
    if not (args.zero1_only or args.zero0_only):
        out = run_ranks(args, c, rows)
        result = main_rows(args, c, out, where(args))
        if args.device == "cuda":
            result.update(device=torch.cuda.get_device_name(0), shape=asdict(c), peak_gib=out["peak_bytes"] / 2 ** 30)
    if args.world > 1:  # a world of one has no collective to compare
        if args.zero1_shapes and not args.zero0_only:
            result.update(pair_passes(args, c, 1))
        if args.zero0_shapes and not args.zero1_only:
            result.update(pair_passes(args, c, 0))
    print("RESULT " + json.dumps(result))


def _table(out: dict[str, Any], med: dict[str, float]) -> None:
    print(f"{'system':<22} {'s/iter':>8} {'min':>8} {'max':>8}   warm-up losses")
    for name, ts in out["times"].items():
        print(f"{name:<22} {med[name]:>8.4f} {min(ts):>8.4f} {max(ts):>8.4f}   "
              + " ".join(f"{v:.4f}" for v in out["losses"][name]))


def main_rows(args: argparse.Namespace, c: Shape, out: dict[str, Any], where: str) -> dict[str, Any]:
    """The main pass's table and ratios."""
    med = {name: statistics.median(ts) for name, ts in out["times"].items()}
    psi = sum(p.numel() for p in LM(c).parameters())
    print(f"{where}, {psi / 1e6:.2f}M parameters, {c.layers} blocks, {c.batch}x{c.seq} tokens "
          f"per rank, AdamW; median of {args.repeats} blocks of {args.iters} iterations")
    _table(out, med)
    result = {"zero3_vs_fsdp2": med["poplar_zero3"] / med["torch_fsdp2"],
              "zero0_vs_ddp": med["poplar_zero0"] / med["torch_ddp"],
              "zero1_vs_ddp_zero": med["poplar_zero1"] / med["torch_ddp_zero"],
              "seconds_per_iter": med, "world": args.world, "params": psi}
    print(f"ZeRO-3 / FSDP2 = {result['zero3_vs_fsdp2']:.3f}   ZeRO-0 / DDP = {result['zero0_vs_ddp']:.3f}   "
          f"ZeRO-1 / DDP+ZeroRedundancyOptimizer = {result['zero1_vs_ddp_zero']:.3f}")
    if args.compiled:
        result["zero3_compiled_vs_eager"] = med["poplar_zero3_compiled"] / med["poplar_zero3"]
        result["zero3_compiled_vs_fsdp2_compiled"] = med["poplar_zero3_compiled"] / med["torch_fsdp2_compiled"]
        print(f"compiled blocks: ZeRO-3 compiled / ZeRO-3 eager = {result['zero3_compiled_vs_eager']:.3f}   "
              f"ZeRO-3 compiled / FSDP2 compiled = {result['zero3_compiled_vs_fsdp2_compiled']:.3f}")
    if args.offload:
        result["zero2_offload_over_peer"] = med["poplar_zero2_offload"] / med["torch_fsdp2_offload"]
        print(f"offload: ZeRO-2, every rank's optimizer on the host / FSDP2 with CPUOffloadPolicy = "
              f"{result['zero2_offload_over_peer']:.3f}"
              + (" (on CPU the host is the device: both step AdamW there, the copies are memcpys)"
                 if args.device == "cpu" else ""))
    if args.bf16:
        for stage in (2, 3):
            result[f"zero{stage}_bf16_vs_fsdp2_bf16"] = med[f"poplar_zero{stage}_bf16"] / med["torch_fsdp2_bf16"]
        print(f"bf16: ZeRO-2 / FSDP2 = {result['zero2_bf16_vs_fsdp2_bf16']:.3f}   "
              f"ZeRO-3 / FSDP2 = {result['zero3_bf16_vs_fsdp2_bf16']:.3f}")
    return result


PAIRS = {1: ("poplar_zero1", "torch_ddp_zero", "DDP+ZeroRedundancyOptimizer", "zero1_vs_ddp_zero", "zero1_floor_vs_ddp_zero"),
         0: ("poplar_zero0", "torch_ddp", "DDP", "zero0_vs_ddp", "zero0_floor_vs_ddp")}


def pair_passes(args: argparse.Namespace, c: Shape, stage: int) -> dict[str, Any]:
    """One pass per ``--zero1-shapes`` (or ``--zero0-shapes``) entry (BLOCKSxDIM, the rest of the
    shape as the main pass's): only the stage's pair and its compute floor, interleaved, in this
    same run."""
    ours, peer, peer_name, key, floor_key = PAIRS[stage]
    ratios: dict[str, float] = {}
    floors: dict[str, float] = {}
    for spec in (args.zero1_shapes if stage == 1 else args.zero0_shapes).split(","):
        layers, dim = (int(v) for v in spec.lower().split("x"))
        shape = replace(c, layers=layers, dim=dim)
        out = run_ranks(args, shape, Rows(pair=stage), f"zero{stage}-{spec}")
        med = {name: statistics.median(ts) for name, ts in out["times"].items()}
        psi = sum(p.numel() for p in LM(shape).parameters())
        print(f"ZeRO-{stage} pair, {spec}: {psi / 1e6:.2f}M parameters, {layers} blocks, d={dim}, {c.batch}x{c.seq} "
              f"tokens per rank, AdamW; median of {args.repeats} blocks of {args.iters} iterations")
        _table(out, med)
        ratios[spec] = med[ours] / med[peer]
        floors[spec] = med["compute_floor"] / med[peer]
        print(f"ZeRO-{stage} / {peer_name} ({spec}) = {ratios[spec]:.3f}   "
              f"no-communication floor / {peer_name} = {floors[spec]:.3f}")
    return {f"{key}_by_shape": ratios, f"{key}_max": max(ratios.values()), f"{floor_key}_by_shape": floors}


if __name__ == "__main__":
    main()
