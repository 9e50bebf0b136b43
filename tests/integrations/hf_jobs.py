"""Hugging Face jobs of the integration tests: a tiny GPT-2, token data whose samples count
different numbers of labelled tokens, the one-process ``Trainer`` reference and the per-rank
``PoplarTrainer`` runs (importable by name for ``poplar.process.launch.spawn``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from poplar.integrations.hf import PoplarTrainer
from tests import toy

GBS, SEQ, VOCAB = 10, 12, 61
PLAN_ROWS = ((2, 1, 1), (3, 2, 0), (1, 1, 0))  # 3 + 6 + 1 = 10
CLIP = 0.05  # below the first steps' gradient norm (about 1): the clipping clips


class LabelledTokens(torch.utils.data.Dataset):
    """Sample i: random tokens; the first i mod 5 labels are -100, so the token weighting matters."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[:i % 5] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def arguments(out: str, steps: int, **kwargs: Any) -> TrainingArguments:
    settings = dict(output_dir=out, per_device_train_batch_size=GBS, max_steps=steps, optim="sgd",
                    optim_args="momentum=0.9", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=CLIP,
                    seed=11, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True,
                    dataloader_drop_last=True)
    return TrainingArguments(**{**settings, **kwargs})


def reference(out: str, steps: int, evaluate: bool = False) -> dict[str, Any]:
    """``Trainer`` in one process, the whole global batch per step: the trained state (and, with
    ``evaluate``, ``eval_loss`` on the held-out samples)."""
    torch.set_num_threads(1)
    model = tiny_gpt2()
    trainer = Trainer(model=model, args=arguments(out, steps), train_dataset=LabelledTokens(),
                      eval_dataset=LabelledTokens(12))
    trainer.train()
    grad_norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    assert max(grad_norms) > CLIP, grad_norms  # the clipping clipped
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "eval_loss": trainer.evaluate()["eval_loss"]} if evaluate else state


def train_rank(rank: int, world: int, port: int, zero_stage: int, out: str, steps: int,
               resume: str | None = None, save_steps: int | None = None) -> dict[str, Any] | None:
    """``PoplarTrainer`` on this rank; saves the model to ``out/final``; rank 0 returns what it loaded back."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    extra = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    args = arguments(out, steps, **extra)
    trainer = PoplarTrainer(model=tiny_gpt2(), args=args, train_dataset=LabelledTokens(),
                            eval_dataset=LabelledTokens(12), plan=toy.plan_of(*PLAN_ROWS), zero_stage=zero_stage)
    trainer.train(resume_from_checkpoint=resume)
    eval_loss = trainer.evaluate()["eval_loss"]  # every rank evaluates the whole set, on the sharded model
    trainer.save_model(os.path.join(out, "final"))
    torch.distributed.barrier()
    if rank != 0:
        return None
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "final"))
    return {"state": {k: v.detach().clone() for k, v in loaded.state_dict().items()}, "eval_loss": eval_loss,
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r]}


def auto_train_rank(rank: int, world: int, port: int, out: str, steps: int) -> dict[str, Any]:
    """Auto mode on emulated cluster B (2 V100 + 2 T4): profile, plan, train ``steps`` steps."""
    from poplar.auto import AutoOptions
    from poplar.emulation import cluster_device

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args = arguments(out, steps, per_device_train_batch_size=6)  # the Trainer's total batch: 6 x 4 ranks
    trainer = PoplarTrainer(model=tiny_gpt2(), args=args, train_dataset=LabelledTokens(96),
                            auto=AutoOptions(device=cluster_device("B", rank), repeats=1, exposure_precision=0, progress=False))
    trainer.train()
    engine = trainer.engine
    out = {"plan": engine.plan.to_dict(), "device": engine.device.describe()["device_type"],
           "steps": trainer.state.global_step, "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r]}
    engine.close()
    return out
