"""Lightning jobs of the integration tests: a LightningModule around the toy model, its data, and
the per-rank functions ``poplar.process.launch.spawn`` runs (importable by name)."""

from __future__ import annotations

import os
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from poplar.integrations.lightning import PoplarStrategy
from poplar.types.plans import Plan
from tests import toy

GBS = 10
PLAN_ROWS = ((2, 1, 1), (3, 2, 0), (1, 1, 0))  # 3 + 6 + 1 = 10 samples: uneven rows and micro-batches


class TokenData(Dataset):
    """``n`` sequences of toy tokens; sample i is a fixed tensor."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, toy.VOCAB, (n, toy.SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


class ToyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = toy.make_model()
        self.forward_dtypes: set[torch.dtype] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch[:, :-1])
        self.forward_dtypes.add(logits.dtype)  # what autocast made of the head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return toy.make_optimizer(self, "sgd")


def reference(steps: int, max_grad_norm: float | None = None, bf16: bool = False) -> dict[str, torch.Tensor]:
    """One process, plain torch: global batch i is the i-th run of GBS samples of the dataset, in
    order, epoch after epoch (an epoch is len(data) // GBS global batches)."""
    module, data = ToyModule(), TokenData()
    opt = module.configure_optimizers()
    per_epoch = len(data) // GBS

    def loss_at(i: int) -> torch.Tensor:
        start = (i % per_epoch) * GBS
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return module.training_step(data.tokens[start:start + GBS], i)
    _, state = toy.train_reference(module, opt, loss_at, steps, max_grad_norm)
    return state


def trainer_for(strategy: PoplarStrategy, max_steps: int, devices: int = 1, **kwargs: Any) -> pl.Trainer:
    """``devices``: 1 in a process group made by the test harness; the world size under torchrun."""
    settings = dict(accelerator="cpu", devices=devices, max_steps=max_steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def fit_rank(rank: int, world: int, zero_stage: int, steps: int, clip: float | None, ckpt: str | None,
             resume: str | None, precision: str = "32-true") -> dict[str, torch.Tensor] | None:
    """Fit ``steps`` steps (from ``resume`` if given); with ``ckpt`` (a directory) Lightning's
    ``ModelCheckpoint`` saves there every 2 steps while training. Rank 0 returns the full state."""
    torch.set_num_threads(1)
    plan = toy.plan_of(*PLAN_ROWS)
    strategy = PoplarStrategy(zero_stage=zero_stage, plan=plan)
    module = ToyModule()
    kwargs: dict[str, Any] = {}
    if ckpt is not None:
        every = pl.callbacks.ModelCheckpoint(dirpath=ckpt, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        kwargs = {"callbacks": [every], "enable_checkpointing": True}
    trainer = trainer_for(strategy, steps, gradient_clip_val=clip, precision=precision, **kwargs)
    trainer.fit(module, DataLoader(TokenData(), batch_size=4, shuffle=False), ckpt_path=resume)
    state = trainer.strategy.lightning_module_state_dict()
    assert trainer.global_step == steps, trainer.global_step
    if rank == 0:
        return {"state": {k: v.clone() for k, v in state.items()}, "dtypes": sorted(map(str, module.forward_dtypes))}
    return None


def auto_fit_rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Auto mode on emulated cluster B (2 V100 + 2 T4): profile, plan, train ``steps`` steps."""
    from poplar.auto import AutoOptions
    from poplar.emulation import cluster_device

    torch.set_num_threads(1)
    data = TokenData(96)
    device = cluster_device("B", rank)
    strategy = PoplarStrategy(zero_stage=0, global_batch_size=24,
                              auto=AutoOptions(profile_data=data, device=device, repeats=1, exposure_precision=0, progress=False))
    trainer = trainer_for(strategy, steps)
    trainer.fit(ToyModule(), DataLoader(data, shuffle=False))
    engine = trainer.strategy.engine
    out = {"plan": engine.plan.to_dict(), "device": engine.device.describe()["device_type"],
           "steps": trainer.global_step, "loss": float(trainer.callback_metrics["poplar/loss"])}
    engine.close()
    return out


class ValidatedModule(ToyModule):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = toy.loss_fn(self.net, batch)  # the submodule directly: ZeRO-3 still gathers it
        self.log("val_loss", loss)
        return loss


def validate_rank(rank: int, world: int, zero_stage: int) -> float:
    """Fit 2 steps, validating (2 batches of 5) after step 2; the logged epoch-mean val_loss."""
    torch.set_num_threads(1)
    strategy = PoplarStrategy(zero_stage=zero_stage, plan=toy.plan_of(*PLAN_ROWS))
    trainer = trainer_for(strategy, 2, limit_val_batches=2, val_check_interval=2)
    trainer.fit(ValidatedModule(), DataLoader(TokenData(), shuffle=False), DataLoader(TokenData(), batch_size=5))
    return float(trainer.callback_metrics["val_loss"])


def in_one_group(rank: int, world: int, calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Several of the jobs above, one after another in one process group (each its own trainer,
    strategy and engine): a rank that imports Lightning takes seconds of CPU to start, so the
    tests that need no fresh process share one start."""
    return [fn(rank, world, *args) for fn, args in calls]
