"""``PoplarTrainer``: a Hugging Face ``transformers.Trainer`` that trains with Poplar's per-rank plan.

    trainer = PoplarTrainer(model=model, args=TrainingArguments(...), train_dataset=data,
                            plan=plan, zero_stage=3)
    trainer.train()                      # launched with torchrun
    trainer.save_model("out")            # the full model; from_pretrained("out") loads it

How the Trainer's pieces map onto Poplar's:

- Data. Global batch i is the batch i that ``Trainer`` in one process takes with
  ``per_device_train_batch_size`` = the global batch and the same ``args`` (seed, sampler,
  collator, padding): every rank builds that one-process loader and trains on its plan row's
  slice of each batch, so a padded batch is padded as in one process. A last partial global
  batch is dropped (``dataloader_drop_last``: a step is always the whole global batch).
- A step. ``training_step`` runs this rank's micro-batches through ``compute_loss`` (so a
  ``compute_loss`` override, ``compute_loss_func`` and the model's own loss work) and
  ``PoplarEngine.train_step`` reduces, clips (``max_grad_norm``, the global norm) and steps.
  With ``num_items_in_batch`` (the Trainer's token count of the global batch, counted on every
  rank from the whole batch) each micro-batch's loss is its token sum over the global count,
  and the step's gradient is their sum: the token-weighted loss of one process exactly.
- The rest of ``TrainingArguments`` hold as in ``Trainer``: ``optim``, learning rate, scheduler
  and warmup (they act on the engine's optimizer), ``max_steps`` / epochs, logging (``grad_norm``
  is the engine's global norm before clipping), evaluation (every rank evaluates the whole set),
  ``bf16`` / ``fp16`` (Accelerate's autocast around the forward; fp16 also gets Poplar's
  dynamic loss scaling). ``gradient_accumulation_steps`` must stay 1: the plan accumulates.
- A DeepSpeed config (``deepspeed=``, a dict or a JSON path): its ZeRO section is read
  (stage, bucket size, ``zero_hpz_partition_size``, ``zero_quantized_weights`` /
  ``zero_quantized_gradients``, ``poplar.allow_lossy``, the offload keys:
  ``poplar.integrations.deepspeed_config``);
  the batches, optimizer, scheduler and precision stay the ``TrainingArguments``'.
- Saving. ``save_model(dir)`` streams the weights one block at a time (every rank; rank 0
  writes) into the HF layout ``save_pretrained`` writes. A checkpoint (``save_steps``) also
  holds ``poplar/``, a Poplar checkpoint (sharded optimizer state, iteration, RNG);
  ``train(resume_from_checkpoint=...)`` loads it, so the run continues exactly, on any world
  size, stage or plan.

A rank that dies or hangs ends the job as ``poplar train`` ends it: the others' collectives fail
(a hung rank's after the collective timeout: ``collective_timeout_s``, else a ``ddp_timeout`` the
user set, else 300 s as on the command line), the first of them prints one line naming the rank,
and every survivor exits with status 1 (``poplar.integrations.rank_failure``).

Why an ``Accelerator`` subclass. The Trainer hands placement, DDP wrapping, data sharding and
gradient clipping to Accelerate, so that is the seam: ``PoplarAccelerator`` prepares the model
without DDP, the data as one process would, the optimizer by building the ``PoplarEngine``, and
reports the engine's norm from ``clip_grad_norm_``. It serves the Trainer; a custom Accelerate
loop has no per-rank micro-batch plan to run, and should use ``PoplarEngine`` directly.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import GradientAccumulationPlugin
from transformers import Trainer, TrainerCallback

import poplar.checkpoint as checkpoint
from poplar.auto import AutoOptions
from poplar.process.group_exit import end_process_group_at_exit
from poplar.process.timeouts import COLLECTIVE_TIMEOUT_S, set_collective_timeout
from poplar.engine import PoplarEngine
from poplar.integrations.deepspeed_config import DeepSpeedZero
from poplar.integrations.rank_failure import run_as_one_job
from poplar.zero.batches import batch_size_of, slice_batch
from poplar.logs import log
from poplar.types.plans import Plan
from poplar.zero.config import ZeroConfig

POPLAR_DIR = "poplar"


@dataclass
class PoplarOptions:
    """What the engine is built with (``PoplarTrainer``'s Poplar arguments)."""

    plan: Plan | None = None
    zero_stage: int | ZeroConfig = 0
    global_batch_size: int | None = None
    auto: AutoOptions | None = None
    activation_checkpointing: Any = None
    max_grad_norm: float | None = None
    loss_fn: Any = None  # what auto mode profiles with: loss_fn(module, batch) -> mean loss


class StepTakenOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer sees: the engine's own optimizer's groups and state (so the LR
    scheduler sets the engine's learning rate), with ``step`` and ``zero_grad`` doing nothing: the
    engine stepped and zeroed in ``training_step``. Its ``state_dict`` is this rank's part; the
    Poplar checkpoint holds the whole state and restores it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: D107 - no super().__init__: a view
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None  # the Poplar checkpoint restores the optimizer (PoplarTrainer.train)


class PoplarAccelerator(Accelerator):
    """An ``Accelerator`` that prepares for Poplar (see the module doc). ``engine`` is built when the
    optimizer is prepared, after the model."""

    def __init__(self, options: PoplarOptions, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.poplar = options
        self.engine: PoplarEngine | None = None
        self.poplar_model: torch.nn.Module | None = None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        model = super().prepare_model(model, device_placement, evaluation_mode=True)  # placement, autocast; no DDP
        if not evaluation_mode:
            self.poplar_model = model
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if self.poplar_model is None:
            raise RuntimeError("PoplarAccelerator prepares the optimizer with the model; prepare(model, optimizer)")
        o = self.poplar
        precision = "fp16" if self.mixed_precision == "fp16" else None  # bf16: autocast alone, as in Trainer
        self.engine = PoplarEngine(self.poplar_model, optimizer, zero_stage=o.zero_stage, plan=o.plan,
                                   global_batch_size=o.global_batch_size if o.plan is None else None,
                                   max_grad_norm=o.max_grad_norm, mixed_precision=precision, loss_fn=o.loss_fn,
                                   activation_checkpointing=o.activation_checkpointing, auto=o.auto)
        end_process_group_at_exit()  # the group Accelerate started now holds the engine's work
        if self.engine.rank == 0:
            log.info(f"PoplarTrainer: ZeRO-{self.engine.zero_stage}, {self.engine.world_size} ranks, plan:\n"
                     f"{self.engine.plan.table()}")
        return StepTakenOptimizer(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return scheduler  # it steps the engine's optimizer's learning rate, once per step

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """The loader one process would get: every rank reads every batch (and takes its slice)."""
        return prepare_data_loader(data_loader, self.device, num_processes=1, process_index=0,
                                   split_batches=self.split_batches,
                                   put_on_device=self.device_placement if device_placement is None else device_placement,
                                   rng_types=self.rng_types.copy(), dispatch_batches=False,
                                   even_batches=self.even_batches, use_seedable_sampler=self.use_seedable_sampler,
                                   data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """The global gradient norm the engine measured (and clipped to ``max_grad_norm``) in its step."""
        norm = self.engine.last_grad_norm if self.engine is not None else None
        return torch.tensor(norm) if norm is not None else None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        raise RuntimeError("PoplarAccelerator: the engine runs backward (PoplarTrainer.training_step); "
                           "a custom loop should use PoplarEngine directly")


class PoplarCheckpoints(TrainerCallback):
    """Writes the Poplar checkpoint into each Trainer checkpoint (``checkpoint-N/poplar``)."""

    def __init__(self, trainer: "PoplarTrainer") -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        engine = self.trainer.engine
        if engine is not None:
            directory = Path(args.output_dir) / f"checkpoint-{state.global_step}" / POPLAR_DIR
            checkpoint.save_checkpoint(engine, directory)


class PoplarTrainer(Trainer):
    """``transformers.Trainer`` on Poplar (see the module doc). The Trainer's arguments, plus:

    Args:
        plan: a ``poplar.Plan``, one row per rank; None: auto mode (needs ``auto``).
        zero_stage: 0-3 or a ``poplar.ZeroConfig`` (None: the DeepSpeed config's, else 0).
        global_batch_size: samples per step in auto mode (default: ``per_device_train_batch_size``
            x world size x ``gradient_accumulation_steps``, the Trainer's total batch).
        auto: ``poplar.AutoOptions`` (profile data; the device: a GPU, or one emulated on CPU).
        activation_checkpointing: as ``PoplarEngine``'s.
        deepspeed: a DeepSpeed config (a dict or a JSON path; not ``args.deepspeed``, which starts
            DeepSpeed's own engine): its ZeRO
            stage and bucket size, ``zero_hpz_partition_size`` (secondary shards),
            ``zero_quantized_weights`` / ``zero_quantized_gradients`` (quantized collectives),
            ``poplar.allow_lossy`` and the offload keys (``poplar.integrations.deepspeed_config``).
        collective_timeout_s: how long a rank waits for a hung peer before the job ends; None: the
            ``TrainingArguments``' ``ddp_timeout`` where it was changed from its default, else
            ``poplar train``'s default (300 s).
    """

    def __init__(self, *args: Any, plan: Plan | None = None, zero_stage: int | ZeroConfig | None = None,
                 global_batch_size: int | None = None, auto: AutoOptions | None = None,
                 activation_checkpointing: Any = None, collective_timeout_s: float | None = None,
                 deepspeed: str | os.PathLike | dict | None = None, **kwargs: Any) -> None:
        targs = kwargs.get("args")
        if targs is None:
            raise ValueError("PoplarTrainer needs args=TrainingArguments(...)")
        if getattr(targs, "deepspeed", None) is not None:
            raise ValueError("TrainingArguments(deepspeed=...) sets up DeepSpeed's own engine in Accelerate; Poplar "
                             "runs ZeRO itself: give the config to PoplarTrainer(deepspeed=...) instead (its ZeRO "
                             "section is read there) and leave TrainingArguments' deepspeed unset")
        plan, zero_stage, auto = _with_deepspeed(deepspeed, plan, zero_stage, auto, targs.world_size,
                                                 say=getattr(targs, "process_index", 0) == 0)
        self.collective_timeout_s = collective_timeout_s if collective_timeout_s is not None else \
            collective_timeout_of(targs)
        gbs = plan.global_batch_size if plan is not None else global_batch_size
        if gbs is None:
            gbs = targs.per_device_train_batch_size * targs.world_size * targs.gradient_accumulation_steps
        if targs.gradient_accumulation_steps != 1 and plan is not None:
            raise ValueError("gradient_accumulation_steps must be 1 with PoplarTrainer: the plan sets each rank's "
                             "accumulation and the global batch")
        targs = copy.deepcopy(targs)
        # the Trainer in one process on the whole global batch: one batch of gbs per step, its
        # token count taken from that whole batch (no cross-rank sum: every rank sees all of it)
        targs.per_device_train_batch_size, targs.gradient_accumulation_steps = gbs, 1
        targs.dataloader_drop_last, targs.average_tokens_across_devices = True, False
        kwargs["args"] = targs
        self.poplar = PoplarOptions(plan, zero_stage, gbs, auto, activation_checkpointing,
                                    targs.max_grad_norm if targs.max_grad_norm and targs.max_grad_norm > 0 else None)
        super().__init__(*args, **kwargs)
        if plan is None:  # auto mode profiles on the training data, with the Trainer's collator and loss
            self.poplar.loss_fn = self._profiling_loss
            auto = AutoOptions() if auto is None else auto
            if auto.profile_data is None and auto.profile is None:
                auto = dataclasses.replace(auto, profile_data=self.train_dataset,
                                           collate_fn=auto.collate_fn or self.data_collator)
            self.poplar.auto = auto
        self.add_callback(PoplarCheckpoints(self))
        self._resume_from: str | None = None

    @property
    def engine(self) -> PoplarEngine | None:
        return self.accelerator.engine if isinstance(self.accelerator, PoplarAccelerator) else None

    def get_total_train_batch_size(self, args: Any) -> int:
        """The global batch (the Trainer would count every rank's batch: here each reads all of it)."""
        return self.poplar.global_batch_size

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        made = self.accelerator  # the Trainer's configuration, rebuilt as a PoplarAccelerator
        self.accelerator = PoplarAccelerator(self.poplar, mixed_precision=made.mixed_precision,
                                             dataloader_config=made.dataloader_config,
                                             gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
        self.gather_function = self.accelerator.gather_for_metrics
        self.gather_function = functools.partial(self.gather_function,
                                                 use_gather_object=self.args.eval_use_gather_object)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self._resume_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint
            self._resume_from = get_last_checkpoint(self.args.output_dir)
        set_collective_timeout(self.collective_timeout_s)  # the group TrainingArguments started
        return run_as_one_job("PoplarTrainer", super().train, resume_from_checkpoint, *args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        engine = self.engine
        if engine is None:
            raise RuntimeError("PoplarTrainer: no engine; train through trainer.train()")
        if self._resume_from is not None:  # the Trainer has loaded its own state; now the engine's
            self._load_poplar_checkpoint(self._resume_from)
            self._resume_from = None
        model.train()
        plan = engine.plan
        gbs = plan.global_batch_size
        if batch_size_of(inputs) != gbs:
            raise ValueError(f"PoplarTrainer got a batch of {batch_size_of(inputs)} samples but the global batch is "
                             f"{gbs}; the training loader must yield whole global batches")
        row = slice_batch(inputs, plan.sample_offsets()[engine.rank], plan.ranks[engine.rank].num_samples)

        def loss_fn(module: torch.nn.Module, micro: dict[str, Any]) -> Any:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(module, micro, num_items_in_batch=num_items_in_batch)
            if num_items_in_batch is None:
                return loss  # the micro-batch's mean: the engine weighs it by its samples
            # already over the global token count: the step's gradient is the plain sum, so each
            # micro-batch counts its share of the samples (the counts sum to 1)
            return loss, batch_size_of(micro) / gbs
        return torch.tensor(engine.train_step(row, loss_fn), device=self.args.device)

    def _profiling_loss(self, module: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        with self.compute_loss_context_manager():
            return self.compute_loss(module, batch)

    def _load_poplar_checkpoint(self, path: str) -> None:
        directory = Path(path) / POPLAR_DIR
        loaded = checkpoint.load_checkpoint(self.engine, directory)
        if self.engine.rank == 0:
            log.info(f"PoplarTrainer: resumed from {directory} at iteration {loaded.iteration}")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank: the weights are streamed one block at a time (``checkpoint.export``) and rank 0
        writes them with ``config.json``, the layout ``save_pretrained`` writes; the main process
        adds the tokenizer and the arguments."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        checkpoint.export_model(engine, output_dir)  # every rank, one block at a time; rank 0 writes weights and config
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _with_deepspeed(source: Any, plan: Plan | None, zero_stage: int | ZeroConfig | None, auto: AutoOptions | None,
                    world_size: int, say: bool) -> tuple[Plan | None, int | str | ZeroConfig, AutoOptions | None]:
    """(the plan, the stage, auto mode's options) of a job of ``world_size`` ranks under a
    DeepSpeed config (``deepspeed_config``: its ZeRO section), or as given (stage 0 where none
    is) without one; ``say``: log which of its keys the Trainer's arguments decide and what the
    keys Poplar has no equal of became (rank 0)."""
    if source is None:
        return plan, 0 if zero_stage is None else zero_stage, auto
    ds = DeepSpeedZero.read(source)
    stage = ds.zero_stage(zero_stage, plan)
    for note in ds.notes() if say else ():
        log.info(note)
    if plan is not None:
        return ds.on_plan(plan, stage.stage if isinstance(stage, ZeroConfig) else stage), stage, auto
    return None, stage, ds.on_auto(AutoOptions() if auto is None else auto, world_size)


def collective_timeout_of(args: Any) -> float:
    """The ``ddp_timeout`` of ``args`` where the user changed it from the ``TrainingArguments``
    default, else ``poplar train``'s collective timeout."""
    default = next((f.default for f in dataclasses.fields(args) if f.name == "ddp_timeout"), None)
    timeout = getattr(args, "ddp_timeout", default)
    return float(timeout) if timeout is not None and timeout != default else COLLECTIVE_TIMEOUT_S
