"""Checkpoints at ZeRO-3 scale: sharded saves and loads against the earlier full-gather save, in
one run on the same ranks (4 gloo ranks, ZeRO-3, shard weights 5:1:2:2, AdamW, a Llama of about
200 M parameters).

Per rank, side by side:
1. the earlier save: every rank gathers the whole model (``engine.full_state_dict()``), rank 0
   writes it, every rank writes its optimizer state cut by name and range (and each file's
   sha256), as Poplar's checkpoints were written before they were sharded;
2. the sharded save (``save_checkpoint``): every rank writes its own shards with DCP;
3. the save written in the background (``kept.start_save_kept``): the loop's wait is the
   snapshot to host plus the per-iteration polls (and a final wait if the write outlasts
   ``--overlap`` iterations); the iterations that overlap the write are timed against those
   before it;
4. the sharded load into a fresh engine: every rank reads only its ranges;
5. the FSDP2 round trip: FSDP2 ``fully_shard`` on 2 ranks loads the sharded checkpoint with DCP
   and ``set_state_dict`` and saves it again with DCP; Poplar on the 4 ranks loads both, and the
   largest difference of any parameter or AdamW state element is reported.

Memory is the growth of each process's peak resident set during a call over its resident set
when the call starts (``/proc/self/clear_refs``, VmHWM), with glibc giving every allocation over
64 KB back when freed (``MALLOC_MMAP_THRESHOLD_``): ``save_peak_over_shard`` = (shards + growth)
/ shards, the maximum over ranks, where the shards are the rank's fp32 parameter shard and
AdamW state; ``load_peak_over_shard`` = (parameter shard + growth) / shards after the load (a
fresh engine holds no optimizer state before it). The last line is ``RESULT {json}``.

    .venv/bin/python bench/checkpoint.py            # ~200 M parameters
    .venv/bin/python bench/checkpoint.py --small    # ~20 M, a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before any rank starts: read by glibc at start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from poplar.checkpoint import load_checkpoint, load_torch_checkpoint, save_checkpoint  # noqa: E402
from poplar.checkpoint.background import checkpoint_comm  # noqa: E402
from poplar.checkpoint.kept import start_save_kept  # noqa: E402
from poplar.checkpoint.storage import sha256  # noqa: E402
from poplar.process.launch import spawn  # noqa: E402
from poplar.engine import PoplarEngine  # noqa: E402
from poplar.types.plans import Plan, RankPlan  # noqa: E402
from poplar.workloads.models import create_model, llama_loss_fn  # noqa: E402
from poplar.zero.config import ZeroConfig  # noqa: E402

SEQ = 16
WEIGHTS = (5.0, 1.0, 2.0, 2.0)
SIZES = {  # ~210 M and ~21 M parameters, untied
    "full": {"vocab_size": 8192, "dim": 1024, "n_layers": 16, "n_heads": 16, "hidden_dim": 2816},
    "small": {"vocab_size": 4096, "dim": 384, "n_layers": 8, "n_heads": 6, "hidden_dim": 1024},
}


def model_config(size: str) -> dict:
    return {**SIZES[size], "max_seq_len": SEQ, "tie_embeddings": False}


def make_engine(size: str, seed: int) -> PoplarEngine:
    model = create_model("llama-tiny", seed=seed, **model_config(size))
    plan = Plan([RankPlan(1, 1, 0, shard_weight=w) for w in WEIGHTS])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return PoplarEngine(model, opt, zero_stage=ZeroConfig(3, wrap_policy=lambda m: type(m).__name__ == "LlamaBlock"),
                        plan=plan)


def step(engine: PoplarEngine, rank: int, it: int) -> float:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return engine.train_step(torch.randint(0, 4096, (1, SEQ + 1), generator=g), llama_loss_fn)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measured(fn) -> tuple[float, int]:
    """(seconds, bytes the peak resident set rose over the resident set at the start) of ``fn()``."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    base, start = _status("VmRSS"), time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, _status("VmHWM") - base


def shard_bytes(engine: PoplarEngine) -> tuple[int, int]:
    params = state = 0
    for p, _ in engine.stage.optimizer_segments():
        params += p.numel() * p.element_size()
        state += sum(v.numel() * v.element_size() for v in engine.optimizer.state.get(p, {}).values()
                     if torch.is_tensor(v) and v.dim() > 0)
    return params, state


def earlier_save(engine: PoplarEngine, directory: Path) -> None:
    """The save as Poplar wrote it before sharded checkpoints: the whole model gathered on every
    rank, written by rank 0; every rank's optimizer state by name and range; each file's sha256."""
    from safetensors.torch import save_file
    from poplar.checkpoint.save import unshared_cpu
    rank = engine.comm.rank
    full = engine.full_state_dict()  # every rank: every block gathered and cloned
    pieces = {}
    for p, segments in engine.stage.optimizer_segments():
        for key, value in engine.optimizer.state.get(p, {}).items():
            if value.dim() > 0:
                for name, offset, length, at in segments:
                    pieces[f"{key}/{name}/{offset}"] = value.reshape(-1)[at:at + length].clone()
    directory.mkdir(parents=True, exist_ok=True)
    rank_file = directory / f"optim-rank{rank}-of{engine.comm.world_size}.safetensors"
    save_file(pieces, str(rank_file))
    sha256(rank_file)
    if rank == 0:
        save_file(unshared_cpu(full), str(directory / "model.safetensors"))
        sha256(directory / "model.safetensors")
    del full, pieces
    dist.barrier()


def overlapped(engine: PoplarEngine, rank: int, root: Path, it: int, limit: int) -> dict:
    """A save written in the background while iterations run: the loop's wait, and the
    iterations' seconds during the write."""
    comm = checkpoint_comm(engine.comm)
    dist.barrier()
    start = time.perf_counter()
    pending = start_save_kept(engine, root / "kept", comm, keep=2)
    wait = time.perf_counter() - start
    during, done = [], False
    for _ in range(limit):
        t = time.perf_counter()
        step(engine, rank, it)
        it += 1
        during.append(time.perf_counter() - t)
        t = time.perf_counter()
        done = pending.poll(engine.comm)
        wait += time.perf_counter() - t
        if done:
            break
    if not done:
        t = time.perf_counter()
        pending.wait(engine.comm)
        wait += time.perf_counter() - t
    return {"wait_s": wait, "during_s": during, "written_within": len(during) if done else None, "it": it}


def poplar_worker(rank: int, world: int, root: str, size: str, overlap: int) -> dict:
    torch.set_num_threads(1)
    root_dir = Path(root)
    engine = make_engine(size, seed=0)
    before = [0.0, 0.0]
    for it in range(3):  # the first builds the optimizer state; two timed
        t = time.perf_counter()
        step(engine, rank, it)
        before[it % 2] = time.perf_counter() - t
    params, state = shard_bytes(engine)
    earlier_s, earlier_growth = measured(lambda: earlier_save(engine, root_dir / "earlier"))
    shutil.rmtree(root_dir / "earlier", ignore_errors=True)
    save_s, save_growth = measured(lambda: save_checkpoint(engine, root_dir / "sharded"))
    background = overlapped(engine, rank, root_dir, 3, overlap)
    model_numel = sum(u.numel for u in engine.stage.units)
    del engine
    gc.collect()
    fresh = make_engine(size, seed=1)
    load_s, load_growth = measured(lambda: load_checkpoint(fresh, root_dir / "sharded"))
    return {"params": params, "state": state, "numel": model_numel, "before_s": before,
            "earlier_s": earlier_s, "earlier_growth": earlier_growth, "save_s": save_s, "save_growth": save_growth,
            "load_s": load_s, "load_growth": load_growth, **background}


def fsdp2_worker(rank: int, world: int, source: str, target: str, size: str) -> None:
    """FSDP2 on 2 ranks: load Poplar's checkpoint with DCP and set_state_dict, save it again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    model = create_model("llama-tiny", seed=2, **model_config(size))
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    llama_loss_fn(model, torch.zeros(1, 3, dtype=torch.long)).backward()  # optimizer state to load into
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=source)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=target)


def compare_worker(rank: int, world: int, first: str, second: str, size: str) -> float:
    """Poplar loads both checkpoints; the largest difference of any shard element."""
    torch.set_num_threads(1)
    engine = make_engine(size, seed=3)
    load_checkpoint(engine, first)
    held = [(p.detach().clone(), {k: v.clone() for k, v in engine.optimizer.state[p].items()})
            for p, _ in engine.stage.optimizer_segments()]
    load_torch_checkpoint(engine, second)
    diff = 0.0
    for (p, _), (value, st) in zip(engine.stage.optimizer_segments(), held):
        diff = max(diff, float((p.detach() - value).abs().max()) if p.numel() else 0.0)
        for k, v in st.items():
            if v.dim() > 0 and v.numel():
                diff = max(diff, float((engine.optimizer.state[p][k] - v).abs().max()))
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="~20 M parameters instead of ~200 M")
    parser.add_argument("--overlap", type=int, default=4, help="iterations to run while the background save writes")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    size = "small" if args.small else "full"
    root = Path(args.dir or tempfile.mkdtemp(prefix="poplar-bench-checkpoint-"))
    try:
        ranks = spawn(poplar_worker, 4, (str(root), size, args.overlap), timeout_s=1800, collective_timeout_s=600)
        spawn(fsdp2_worker, 2, (str(root / "sharded"), str(root / "fsdp2"), size), timeout_s=900,
              collective_timeout_s=600)
        diffs = spawn(compare_worker, 4, (str(root / "sharded"), str(root / "fsdp2"), size), timeout_s=900,
                      collective_timeout_s=600)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report(ranks, max(diffs))


def report(ranks: list[dict], fsdp2_diff: float) -> None:
    mb = 1e6
    print(f"model: {ranks[0]['numel'] / 1e6:.0f} M parameters; 4 ranks, ZeRO-3, shard weights "
          f"{':'.join(str(int(w)) for w in WEIGHTS)}, AdamW")
    print(f"{'rank':>4} {'shards MB':>10} {'earlier save s':>15} {'+MB':>8} {'sharded save s':>15} {'+MB':>8} "
          f"{'load s':>7} {'+MB':>8} {'bg wait s':>10} {'iter s':>7} {'iter s during':>14}")
    for r, x in enumerate(ranks):
        shards = x["params"] + x["state"]
        during = sum(x["during_s"]) / max(1, len(x["during_s"]))
        print(f"{r:>4} {shards / mb:>10.1f} {x['earlier_s']:>15.2f} {x['earlier_growth'] / mb:>8.1f} "
              f"{x['save_s']:>15.2f} {x['save_growth'] / mb:>8.1f} {x['load_s']:>7.2f} {x['load_growth'] / mb:>8.1f} "
              f"{x['wait_s']:>10.2f} {min(x['before_s']):>7.2f} {during:>14.2f}")
    save_s = max(x["save_s"] for x in ranks)
    earlier_s = max(x["earlier_s"] for x in ranks)
    result = {
        "params_m": round(ranks[0]["numel"] / 1e6, 1),
        "stall_vs_sync_save": round(max(x["wait_s"] for x in ranks) / save_s, 3),
        "save_peak_over_shard": round(max((x["params"] + x["state"] + x["save_growth"]) / (x["params"] + x["state"])
                                          for x in ranks), 3),
        "load_peak_over_shard": round(max((x["params"] + x["load_growth"]) / (x["params"] + x["state"])
                                          for x in ranks), 3),
        "earlier_save_peak_over_shard": round(max((x["params"] + x["state"] + x["earlier_growth"])
                                                  / (x["params"] + x["state"]) for x in ranks), 3),
        "fsdp2_roundtrip_max_abs_diff": fsdp2_diff,
        "sharded_save_s": round(save_s, 2),
        "earlier_save_s": round(earlier_s, 2),
        "save_speedup_vs_earlier": round(earlier_s / save_s, 2),
        "load_s": round(max(x["load_s"] for x in ranks), 2),
        "background_write_within_iterations": max((x["written_within"] or -1) for x in ranks),
        "iteration_slowdown_during_write": round(max(
            (sum(x["during_s"]) / max(1, len(x["during_s"]))) / min(x["before_s"]) for x in ranks), 2),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
