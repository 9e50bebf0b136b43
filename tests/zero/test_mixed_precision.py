"""Mixed precision at every ZeRO stage: bf16 training tracks fp32 single-process training,
ZeRO-3 gathers half the bytes, memory_report matches the design table, and the state is the
fp32 master (docs/design.md §3.7)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from poplar.comm import Phase
from poplar.process.launch import spawn
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan
from poplar.types.precision import MixedPrecision
from poplar.workloads.models import create_model, llama_loss_fn
from tests.toy import max_rel_err, plan_of
from tests.zero.test_stage3_common import tiny_lm
from poplar.zero.config import ZeroConfig
from poplar.zero.runtime import ZeroRuntime

ITERATIONS, SEQ, GBS = 12, 16, 10
PLANS = {2: plan_of((2, 2, 1), (3, 1, 2)),  # n_i = 5, 5 with micro-step counts 3, 2
         3: plan_of((3, 2, 0), (0, 0, 0), (1, 3, 1))}  # 6, 0, 4: a rank without samples
STAGES = (0, 1, 2, 3)


def token_batch(iteration: int) -> torch.Tensor:
    """Arithmetic progressions mod the vocabulary: learnable, so the loss moves in 12 steps."""
    g = torch.Generator().manual_seed(500 + iteration)
    start = torch.randint(0, 260, (GBS, 1), generator=g)
    step = torch.randint(1, 4, (GBS, 1), generator=g)
    return (start + step * torch.arange(SEQ + 1)) % 260


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    mats = [p for p in model.parameters() if p.dim() > 1]
    vecs = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}], lr=3e-3)


@functools.lru_cache(maxsize=None)
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """fp32 single-process training on the whole global batch."""
    model = create_model("llama-tiny")
    opt = adamw(model)
    losses = []
    for it in range(ITERATIONS):
        loss = llama_loss_fn(model, token_batch(it))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def bf16_runs(rank: int, world: int) -> dict:
    plan = PLANS[world]
    start = plan.sample_offsets()[rank]
    out = {}
    for stage in STAGES:
        model = create_model("llama-tiny")
        engine = PoplarEngine(model, adamw(model), zero_stage=ZeroConfig(stage, bucket_size_mb=0.05), plan=plan, mixed_precision="bf16")
        compute_dtype = model.layers[0].attn.wq.weight.dtype if stage < 3 else engine.stage.blocks[1].full.dtype
        losses = [engine.train_step(token_batch(it)[start:start + plan.ranks[rank].num_samples], llama_loss_fn)
                  for it in range(ITERATIONS)]
        out[stage] = (losses, engine.full_state_dict(), compute_dtype)
    return out


def gather_bytes(rank: int, world: int) -> dict:
    """ZeRO-3 all-gather bytes of one iteration of the tied TinyLM, under fp32 and bf16."""
    plan = Plan.even(world, 2 * world, 1)
    out = {}
    for precision in (None, "bf16"):
        model = tiny_lm()
        engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), zero_stage=3,
                              plan=plan, mixed_precision=precision)
        engine.train_step(torch.randint(0, 37, (2, 6)), lambda m, b: m(b[:, :-1]).float().logsumexp(-1).mean())
        out[precision] = {phase: sum(r.bytes for r in engine.comm_ledger.records
                                     if r.op == "all_gather" and r.phase == phase)
                          for phase in (Phase.FORWARD, Phase.BACKWARD)}
    return out


def memory_runs(rank: int, world: int) -> dict:
    """memory_report after one AdamW step of a 4 x Linear(256, 256) model (Ψ = 263,168)."""
    out = {}
    for precision in (None, "bf16"):
        for stage in STAGES:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
            engine = PoplarEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_stage=ZeroConfig(stage, bucket_size_mb=0.3),
                                  plan=Plan.even(world, 2 * world, 1), mixed_precision=precision)
            engine.train_step(torch.randn(2, 256), lambda m, b: m(b).float().pow(2).mean())
            out[(precision, stage)] = engine.memory_report()
    return out


def state_round_trip(rank: int, world: int) -> dict:
    """load_full_state_dict under bf16 sets the fp32 master exactly and the compute copy cast."""
    out = {}
    for stage in STAGES:
        model = create_model("llama-tiny")
        engine = PoplarEngine(model, adamw(model), zero_stage=stage, plan=Plan.even(world, world, 1),
                              mixed_precision="bf16")
        target = {k: v + 1e-3 * torch.arange(v.numel()).reshape(v.shape).sin() for k, v in engine.full_state_dict().items()}
        engine.stage.load_full_state_dict(target)
        copy = model.norm.weight.detach().clone() if stage < 3 else None
        out[stage] = (max_rel_err(engine.full_state_dict(), target), copy, target["norm.weight"])
    return out


def everything(rank: int, world: int) -> dict:
    out = {"bf16": bf16_runs(rank, world)}
    if world == 2:
        out.update(gather=gather_bytes(rank, world), memory=memory_runs(rank, world),
                   round_trip=state_round_trip(rank, world))
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    return spawn(everything, world, (), timeout_s=300)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.multiprocess
def test_bf16_tracks_fp32_at_every_stage(world: int) -> None:
    ref_losses, ref_state = reference()
    for stage in STAGES:
        first_losses, first_state, _ = results(world)[0]["bf16"][stage]
        for rank, res in enumerate(results(world)):
            losses, state, compute_dtype = res["bf16"][stage]
            assert compute_dtype == torch.bfloat16
            deviation = max(abs(a / b - 1) for a, b in zip(losses, ref_losses))
            print(f"world {world} stage {stage} rank {rank}: max loss deviation from fp32 {deviation:.4%}")
            assert deviation <= 0.01, (stage, rank, losses, ref_losses)
            assert losses == first_losses  # the same float on every rank
            assert state.keys() == ref_state.keys() and all(v.dtype == torch.float32 for v in state.values())
            assert all(torch.equal(state[k], first_state[k]) for k in state)  # one master, whatever the rank
            assert max_rel_err(state, ref_state) <= 0.05, stage
        assert losses != pytest.approx(ref_losses, rel=1e-6)  # it really ran in bf16
        assert ref_losses[-1] < ref_losses[0] - 0.5  # and the loss moved


@pytest.mark.multiprocess
def test_stage3_bf16_gathers_half_the_bytes() -> None:
    for res in results(2):
        fp32, bf16 = res["gather"][None], res["gather"]["bf16"]
        assert fp32[Phase.FORWARD] > 0 and fp32[Phase.BACKWARD] > 0
        assert bf16[Phase.FORWARD] * 2 == fp32[Phase.FORWARD]
        assert bf16[Phase.BACKWARD] * 2 == fp32[Phase.BACKWARD]


def design_bytes(stage: int, precision: str | None, psi: int, n: int) -> dict[str, float]:
    """The per-rank table of docs/design.md §3.7 (AdamW: 8 bytes of state per parameter)."""
    low = precision is not None
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1, "master_params": stage >= 1}
    per = {"params": 0 if low and stage == 3 else (2 if low else 4), "master_params": 4 if low else 0,
           "grads": 4, "optimizer": 8}
    return {k: per[k] * psi / (n if sharded[k] else 1) for k in per}


@pytest.mark.multiprocess
def test_memory_report_matches_the_design_table() -> None:
    psi, n = 4 * (256 * 256 + 256), 2
    for rank, res in enumerate(results(n)):
        for (precision, stage), report in res["memory"].items():
            for key, want in design_bytes(stage, precision, psi, n).items():
                assert abs(report[key] - want) <= 0.02 * want, (precision, stage, rank, key, report[key], want)
            if stage == 3:  # the largest gathered block, in the compute dtype
                assert report["gathered_params"] <= 2 * (256 * 256 + 256) * (2 if precision else 4)


@pytest.mark.multiprocess
def test_load_full_state_dict_sets_the_fp32_master() -> None:
    for res in results(2):
        for stage, (err, copy, target) in res["round_trip"].items():
            assert err == 0.0, stage
            if copy is not None:
                assert copy.dtype == torch.bfloat16 and torch.equal(copy, target.to(torch.bfloat16))


def test_policy_resolution() -> None:
    assert MixedPrecision().loss_scale is None and MixedPrecision(param_dtype=torch.float16).loss_scale is not None
    assert MixedPrecision().buffer_dtype == torch.bfloat16
    model = create_model("llama-tiny")
    engine = PoplarEngine(model, adamw(model), zero_stage=0, plan=Plan.even(1, 2, 1), mixed_precision="fp32")
    assert engine.mixed_precision is None and engine.loss_scaler is None and engine.loss_scale == 1.0
    assert model.embed.weight.dtype == torch.float32


def test_a_bad_precision_name_is_refused_at_the_door() -> None:
    """The engine turns a precision's name into a policy once; a name it does not know is
    refused there, before any collective, and the runtime takes a policy only."""
    model = create_model("llama-tiny")
    with pytest.raises(ValueError, match="mixed_precision='fp8': use None, 'fp32', 'bf16', 'fp16'"):
        PoplarEngine(model, adamw(model), zero_stage=1, plan=Plan.even(1, 2, 1), mixed_precision="fp8")
    with pytest.raises(TypeError, match="ZeroRuntime takes mixed_precision=poplar.MixedPrecision"):
        ZeroRuntime(model, adamw(model), zero_stage=ZeroConfig(1), plan=Plan.even(1, 2, 1), mixed_precision="bf16")
    with pytest.raises(TypeError, match=r"write ZeroConfig\(1\)"):
        ZeroRuntime(model, adamw(model), zero_stage=1, plan=Plan.even(1, 2, 1))


@pytest.mark.parametrize("kwargs, needle", [
    ({"zero_stage": ZeroConfig(1, nonfinite="ignore")}, "nonfinite must be 'skip' or 'raise'"),
    ({"zero_stage": ZeroConfig(1, max_consecutive_skips=-1)}, "max_consecutive_skips must be an int >= 0"),
])
def test_bad_policies_are_setup_errors(kwargs: dict, needle: str) -> None:
    from poplar.comm import DistributedError
    model = create_model("llama-tiny")
    with pytest.raises(DistributedError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        PoplarEngine(model, adamw(model), plan=Plan.even(1, 2, 1), **{"zero_stage": 1, **kwargs})


def test_mixed_precision_needs_an_fp32_model() -> None:
    from poplar.comm import DistributedError
    model = create_model("llama-tiny").to(torch.bfloat16)
    with pytest.raises(DistributedError, match="needs an fp32 model"):
        PoplarEngine(model, adamw(model), zero_stage=1, plan=Plan.even(1, 2, 1), mixed_precision="bf16")
