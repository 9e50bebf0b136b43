"""``PoplarStrategy``: a PyTorch Lightning strategy that trains with Poplar's per-rank plan.

    trainer = L.Trainer(strategy=PoplarStrategy(zero_stage=2, plan=plan), accelerator="cpu", devices=3,
                        max_steps=100, gradient_clip_val=1.0)
    trainer.fit(module, DataLoader(dataset, shuffle=False))   # launched with torchrun

How Lightning's pieces map onto Poplar's:

- Data. The training ``DataLoader`` is replaced by one over the same dataset, sampler order and
  collate function that yields this rank's slice of every global batch
  (``poplar.integrations.global_batches``): global batch i is the next ``global_batch_size``
  samples of the user's sampler, whatever the world size or plan. The loader's ``batch_size`` is
  not used: the plan's rows (or ``global_batch_size`` in auto mode) say how many samples a step
  takes. Lightning's ``DistributedSampler`` is not injected (``is_distributed`` is False for
  that reason); evaluation loaders are left as they are (every rank evaluates all of them), and
  ``validation_step`` / ``test_step`` / ``predict_step`` run through the engine's module, so a
  ZeRO-3 model is gathered for them.
- A step. One Lightning batch is this rank's whole slice of a global batch. ``training_step``
  runs once per micro-batch of the rank's plan row (``batch_idx`` is the step's batch index)
  and returns the micro-batch's mean loss (a tensor, or a dict with ``"loss"``) or a pair
  ``(loss_sum, count)`` for a token-weighted loss; the engine runs the backward passes with
  Poplar's exact scaling, reduces, clips and steps (``PoplarEngine.train_step``). Lightning's
  own backward and optimizer step are not run: ``accumulate_grad_batches`` must stay 1 (the
  plan accumulates), manual optimization is not supported, and ``on_before_backward`` /
  ``on_after_backward`` / ``on_before_optimizer_step`` hooks are not called.
- ``gradient_clip_val`` clips the global gradient norm (the engine's ``max_grad_norm``; the
  "value" algorithm is refused). ``precision="bf16-mixed"`` / ``"16-mixed"``: each micro-batch's
  forward runs in Lightning's autocast; fp16 also gets Poplar's dynamic loss scaling.
- Checkpoints. ``trainer.save_checkpoint(path)`` writes a directory: ``poplar/`` (a Poplar
  checkpoint: model, sharded optimizer state, iteration, RNG) and ``lightning.pt`` (Lightning's
  loops, callbacks, schedulers and the data position). ``fit(ckpt_path=path)`` loads both, on
  any world size, stage or plan. ``lightning_module_state_dict()`` is the full model state
  (gathered from the shards, on every rank: every rank must call it).
- Logging: ``poplar/loss`` (the global mean loss), ``poplar/iteration_s`` and per rank
  ``poplar/compute_s/rank{r}`` and ``poplar/idle_s/rank{r}`` (its wait for the slowest rank:
  ``poplar.train.rank_times.idle_from_compute``); the plan is logged when training starts.

Processes: launch with ``torchrun`` (or SLURM), or initialize ``torch.distributed`` before ``fit``.
A rank that dies or hangs ends the job as ``poplar train`` ends it: the others' collectives fail
(a hung rank's after ``timeout_s``, 300 s by default, as the command line's), the first of them
prints one line naming the rank, and every survivor leaves with exit status 1
(``poplar.integrations.rank_failure``).
``register()`` adds the name ``"poplar"`` to Lightning's strategy registry (default arguments).
"""

from __future__ import annotations


import dataclasses
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

import poplar.checkpoint as checkpoint
from poplar.auto import AutoOptions
from poplar.process.group_exit import end_process_group_at_exit
from poplar.process.timeouts import COLLECTIVE_TIMEOUT_S, set_collective_timeout
from poplar.engine import PoplarEngine
from poplar.integrations.global_batches import RankDataLoader, rank_dataloader
from poplar.integrations.rank_failure import run_as_one_job
from poplar.logs import log
from poplar.train import rank_times
from poplar.types.plans import Plan
from poplar.zero.config import ZeroConfig
from poplar.zero.wrap import default_blocks

POPLAR_DIR, LIGHTNING_FILE = "poplar", "lightning.pt"


class PoplarStrategy(ParallelStrategy):
    """Poplar's ZeRO-0/1/2/3 with a per-rank plan, as a Lightning strategy (see the module doc).

    Args:
        zero_stage: 0-3 or a ``poplar.ZeroConfig``.
        plan: a ``poplar.Plan``, one row per rank; None: auto mode (profile every rank's device,
            plan), which needs ``global_batch_size`` and ``auto=AutoOptions(profile_data=...)``.
        global_batch_size: samples per optimizer step (auto mode; with a plan, its rows' sum).
        auto: ``poplar.AutoOptions`` for auto mode (profile data, the device: a GPU, or an
            emulated one on CPU).
        activation_checkpointing: as ``PoplarEngine``'s.
        timeout_s: the collective timeout: how long a rank waits for a hung peer before the job
            ends (the process group's, whether the strategy creates it or finds it).
    """

    strategy_name = "poplar"

    def __init__(self, zero_stage: int | ZeroConfig = 0, plan: Plan | None = None,
                 global_batch_size: int | None = None, *, auto: AutoOptions | None = None,
                 activation_checkpointing: Any = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        super().__init__()
        if plan is None and global_batch_size is None:
            raise ValueError("PoplarStrategy needs a plan, or global_batch_size (and auto=AutoOptions(profile_data=...)) "
                             "for auto mode")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be a poplar.Plan, got {type(plan).__name__}")
        self.zero_stage, self.plan, self.global_batch_size = zero_stage, plan, global_batch_size
        self.auto, self.activation_checkpointing, self.timeout_s = auto, activation_checkpointing, timeout_s
        self.engine: PoplarEngine | None = None
        self._train_loader: RankDataLoader | None = None

    # ------------------------------------------------------------------ processes and devices
    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else super().global_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else super().world_size

    @property
    def local_rank(self) -> int:
        if dist.is_initialized() and "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        return super().local_rank

    @property
    def is_distributed(self) -> bool:
        """False, so that Lightning injects no ``DistributedSampler``: the strategy cuts the data itself."""
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        super().setup_environment()
        if not dist.is_initialized():
            env = self.cluster_environment
            if env is None or not env.creates_processes_externally:
                raise RuntimeError("PoplarStrategy does not start processes: launch the script with torchrun "
                                   "(or SLURM), or call torch.distributed.init_process_group before trainer.fit")
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            # NCCL is told each rank's GPU (its local rank's): left to guess, torch takes the global
            # rank modulo the GPUs it sees, which on nodes of different GPU counts is another GPU
            cuda = self.root_device.type == "cuda"
            dist.init_process_group("nccl" if cuda else "gloo", rank=env.global_rank(), world_size=env.world_size(),
                                    timeout=timedelta(seconds=self.timeout_s),
                                    **({"device_id": self.root_device} if cuda else {}))
            end_process_group_at_exit()  # the group this strategy started ends with the script
        else:
            set_collective_timeout(self.timeout_s)
        pl.utilities.rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        self._launcher = OneJobLauncher()

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """All-reduce a tensor (Lightning's metric sync): "mean"/"avg", "sum", "max" or "min", or a ``ReduceOp``."""
        if not isinstance(tensor, torch.Tensor) or self.world_size == 1:
            return tensor
        name = (reduce_op.name if hasattr(reduce_op, "name") else str(reduce_op or "mean")).lower()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        out = tensor.clone()
        dist.all_reduce(out, op=ops.get(name, dist.ReduceOp.SUM), group=group)
        return out / self.world_size if name in ("mean", "avg") else out

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ the engine
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.engine = self._build_engine(trainer)
        self.setup_precision_plugin()

    def _build_engine(self, trainer: pl.Trainer) -> PoplarEngine:
        problems = []
        if len(self.optimizers) != 1:
            problems.append(f"configure_optimizers returned {len(self.optimizers)} optimizers; Poplar trains with one")
        if trainer.accumulate_grad_batches != 1:
            problems.append("accumulate_grad_batches must be 1: the plan sets each rank's accumulation")
        if not self.lightning_module.automatic_optimization:
            problems.append("manual optimization is not supported; use automatic optimization")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
            problems.append("gradient_clip_algorithm='value' is not supported; Poplar clips the global norm ('norm')")
        if problems:
            raise ValueError("PoplarStrategy: " + "; ".join(problems))
        clip = float(trainer.gradient_clip_val) if trainer.gradient_clip_val else None
        precision = None
        if isinstance(self.precision_plugin, LightningMixedPrecision) and self.precision_plugin.precision == "16-mixed":
            precision = "fp16"  # Poplar's dynamic loss scaling; autocast stays Lightning's
        zero = ZeroConfig.of(self.zero_stage)
        if zero.wrap_policy is None:  # the blocks the LightningModule itself would get as the root
            zero = dataclasses.replace(zero, wrap_policy=NamedBlocks(
                TrainingStep.PREFIX + name for name, _ in default_blocks(self.lightning_module)))
        engine = PoplarEngine(TrainingStep(self.lightning_module), self.optimizers[0], zero_stage=zero, plan=self.plan,
                              global_batch_size=self.global_batch_size if self.plan is None else None,
                              loss_fn=self._loss_fn(0), max_grad_norm=clip, mixed_precision=precision,
                              activation_checkpointing=self.activation_checkpointing, auto=self.auto)
        if engine.rank == 0:
            log.info(f"PoplarStrategy: ZeRO-{engine.zero_stage}, {engine.world_size} ranks, plan:\n{engine.plan.table()}")
        return engine

    def _loss_fn(self, batch_idx: int) -> Callable[[Any, Any], Any]:
        precision = self.precision_plugin

        def loss_fn(module: Any, micro_batch: Any) -> Any:  # the engine's TrainingStep, or auto mode's copy of it
            with precision.train_step_context():
                return loss_of(module(micro_batch, batch_idx))
        return loss_fn

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.engine is None or trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._train_loader = rank_dataloader(dataloader, self.engine.plan, self.engine.rank)
        return self._train_loader

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            raise RuntimeError("PoplarStrategy trains only inside trainer.fit")
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        engine = self.engine
        loss = engine.train_step(batch, self._loss_fn(batch_idx))
        if self._train_loader is not None:
            self._train_loader.batch_sampler.trained += 1
        self._log_step(loss)
        return torch.tensor(loss)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """Through the engine's module, so that ZeRO-3 gathers the parameters for the step."""
        if self.engine is None:
            return getattr(super(), hook)(*args, **kwargs)
        with context():
            return self.engine.module(*args, hook=hook, **kwargs)

    def _log_step(self, loss: float) -> None:
        stats, module = self.engine.last_stats, self.lightning_module
        module.log("poplar/loss", loss, prog_bar=True, rank_zero_only=True)
        module.log("poplar/iteration_s", stats.wall_s, rank_zero_only=True)
        idle = rank_times.idle_from_compute(stats.rank_compute_s)  # the wait for the slowest rank
        for r, compute in enumerate(stats.rank_compute_s):
            module.log(f"poplar/compute_s/rank{r}", compute, rank_zero_only=True)
            module.log(f"poplar/idle_s/rank{r}", idle[r], rank_zero_only=True)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # the engine ran every micro-step's backward in training_step

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the closure runs training_step, where the engine steps

    # ------------------------------------------------------------------ state and checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model state; with an engine, gathered from the shards (every rank must call it)."""
        if self.engine is None:
            return super().lightning_module_state_dict()
        prefix = TrainingStep.PREFIX
        return {k[len(prefix):]: v for k, v in self.engine.full_state_dict().items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {} if self.engine is not None else super().optimizer_state(optimizer)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (built in setup) loads the Poplar checkpoint

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank: the Poplar checkpoint in ``filepath/poplar``; rank 0: the rest in ``filepath/lightning.pt``."""
        if self.engine is None:
            return super().save_checkpoint(checkpoint_dict, filepath, storage_options)
        root = Path(filepath)
        if self.is_global_zero:
            if root.is_file():
                raise FileExistsError(f"{root} is a file; a Poplar checkpoint is a directory, choose another path")
            root.mkdir(parents=True, exist_ok=True)
        self.barrier()
        checkpoint.save_checkpoint(self.engine, root / POPLAR_DIR)
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint_dict.items() if k != "state_dict"}  # optimizer_states: [{}]
            tmp = root / f".{LIGHTNING_FILE}.tmp"
            torch.save(rest, tmp)
            os.replace(tmp, root / LIGHTNING_FILE)
        self.barrier()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        root = Path(checkpoint_path)
        if self.engine is None or not (root / LIGHTNING_FILE).exists():
            raise ValueError(f"{root} is not a checkpoint PoplarStrategy wrote (a directory with {POPLAR_DIR}/ and "
                             f"{LIGHTNING_FILE}); resume from one written by trainer.save_checkpoint under this strategy")
        loaded = checkpoint.load_checkpoint(self.engine, root / POPLAR_DIR)
        if self.is_global_zero:
            log.info(f"PoplarStrategy: resumed from {root} at iteration {loaded.iteration} "
                     f"(saved by {loaded.world_size} ranks at ZeRO-{loaded.zero_stage})")
        return torch.load(root / LIGHTNING_FILE, map_location="cpu", weights_only=False)

    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            super().load_model_state_dict(checkpoint_dict, strict)  # the engine loaded its own in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint_dict: Mapping[str, Any]) -> None:
        if self.engine is None:
            super().load_optimizer_state_dict(checkpoint_dict)

    def teardown(self) -> None:
        """Detach the engine's device. The model stays where it is (not moved to the CPU as other
        strategies do): its parameters are views of the engine's buffers, which
        ``lightning_module_state_dict()`` still gathers after ``fit``."""
        if self.engine is None:
            return super().teardown()
        self.engine.close()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


class OneJobLauncher(_Launcher):
    """Starts no processes (torchrun or SLURM did): runs the Trainer's entry point so that a
    failed collective ends this rank as ``poplar train`` ends it (``run_as_one_job``)."""

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return run_as_one_job("PoplarStrategy", function, *args, **kwargs)

    def kill(self, signum: Any) -> None:
        return None  # no processes of its own to stop


class NamedBlocks:
    """A ZeRO-3 wrap policy: the modules at these paths are the blocks (paths survive auto mode's copies)."""

    def __init__(self, names: Any) -> None:
        self.names = frozenset(names)

    def __call__(self, name: str, module: torch.nn.Module) -> bool:
        return name in self.names


class TrainingStep(torch.nn.Module):
    """The module the engine trains: its forward is the LightningModule's ``training_step`` (or,
    with ``hook=``, its ``validation_step`` / ``test_step`` / ``predict_step``), so the engine's
    forward points (observers, profiling devices, ZeRO-3 gathers) see every step, whether or not
    the step calls the LightningModule itself."""

    PREFIX = "module."  # its state dict is the LightningModule's under this prefix

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, hook: str = "training_step", **kwargs: Any) -> Any:
        return getattr(self.module, hook)(*args, **kwargs)


def loss_of(output: Any) -> Any:
    """``training_step``'s result as the engine takes it: a mean-loss tensor, a dict with ``"loss"``,
    or a pair ``(loss_sum, count)``."""
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError("training_step returned a dict without 'loss'; return the micro-batch's mean loss")
        return output["loss"]
    if isinstance(output, torch.Tensor) or (isinstance(output, tuple) and len(output) == 2):
        return output
    raise ValueError(f"training_step must return the micro-batch's mean loss (a tensor, or a dict with 'loss') or a "
                     f"pair (loss_sum, count) under PoplarStrategy, got {type(output).__name__}")


def register(registry: Any = StrategyRegistry) -> None:
    """Add ``strategy="poplar"`` to Lightning's registry: ``PoplarStrategy()`` needs a plan or a
    global batch size, so the name stands for ``PoplarStrategy`` built with ``POPLAR_PLAN`` (a plan
    file) read from the environment. Call it once before building the ``Trainer``."""
    if "poplar" not in registry:
        registry.register("poplar", _strategy_from_environment,
                          description="Poplar: ZeRO with a per-rank plan (plan file in $POPLAR_PLAN)")


def _strategy_from_environment(**kwargs: Any) -> PoplarStrategy:
    path = os.environ.get("POPLAR_PLAN")
    if not path:
        raise ValueError('strategy="poplar" reads its plan from $POPLAR_PLAN (a plan file); set it, or pass '
                         "PoplarStrategy(plan=..., zero_stage=...) to the Trainer")
    return PoplarStrategy(zero_stage=int(os.environ.get("POPLAR_ZERO_STAGE", "0")), plan=Plan.load(path), **kwargs)
