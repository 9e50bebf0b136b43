"""`poplar train --config run.json`: one rank of a training job, launched by ``torchrun``
(``torchrun --nproc_per_node N -m poplar train --config run.json``; without torchrun it runs as a
world of one). CUDA + NCCL when the machine has GPUs, gloo on CPU. The config
(``poplar.train.config``) names the model, data, optimizer, ZeRO stage and global batch; the plan
comes from auto mode (profiling each rank's GPU, or the emulated cluster's device on CPU), a plan
file, or an even split. The config's ``bf16`` / ``fp16`` section sets the engine's mixed
precision (profiling runs under it too). Training logs measured vs predicted times, writes checkpoints and resumes
from them.

A failure on any rank (a dead peer, a bad batch, a corrupt checkpoint) ends every rank with exit
status 1 and one error on stderr, printed once by the first rank that failed, naming the ranks
that died where that can be known (``poplar.process.failure``); the last complete checkpoint stays as
it was. SIGTERM or SIGINT (preemption; torchrun forwards them) stops every rank after the same
iteration, which is checkpointed and reported; rank 0 prints one line and every rank exits with
128 + the signal's number (``poplar.train.preemption``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch

from poplar.process.failure import FailureReporting
from poplar.logs import log
from poplar.types.precision import MixedPrecision
from poplar.train.config import ConfigError, TrainConfig
from poplar.train.preemption import Preempted


def init_distributed(timeout_s: float) -> torch.device:
    """Join the job torchrun started (env:// rendezvous); returns this rank's device."""
    import torch.distributed as dist

    if "RANK" not in os.environ or dist.is_initialized():
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if torch.cuda.is_available():
        local, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= visible:  # else set_device dies with CUDA's "invalid device ordinal"
            raise ConfigError(f"local rank {local} has no GPU: {visible} visible on this machine, so start at most "
                              f"{visible} ranks per node (torchrun --nproc_per_node), or train on CPU with gloo "
                              f"by hiding the GPUs (CUDA_VISIBLE_DEVICES=)")
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):  # one machine: stay on loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs["device_id"] = device
    from poplar.comm import DistributedError
    from poplar.process.attempts import attempt_store
    try:
        store = attempt_store(timeout_s)  # None outside torchrun: env:// as usual
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(**kwargs)
    except (RuntimeError, dist.DistBackendError) as e:
        raise DistributedError(f"rank {os.environ.get('RANK')}: joining the job's process group failed within "
                               f"{timeout_s:g} s (poplar.collective_timeout_s): another rank died while starting, or "
                               f"the ranks cannot reach each other ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:300] if str(e) else ''})") from e
    return device


def describe_precision(policy: MixedPrecision) -> str:
    """One line about a precision policy, for the log."""
    text = f"{policy.precision} compute, fp32 master weights and optimizer state"
    scale = policy.loss_scale
    if scale is None:
        return text
    if scale.dynamic:
        return (f"{text}, dynamic loss scale from {scale.initial_scale:g} (x{scale.growth_factor:g} after "
                f"{scale.growth_interval} clean steps, x{scale.backoff:g} after {scale.hysteresis} overflows, "
                f"min {scale.min_scale:g})")
    return f"{text}, static loss scale {scale.static_scale:g}"


def finished_at(cfg: TrainConfig) -> int | None:
    """The iteration of the checkpoint a resumed run would start from, when it has already reached
    ``cfg.iterations`` (the job has nothing to do); None otherwise. Rank 0 reads, every rank gets
    its answer."""
    import torch.distributed as dist
    from poplar.checkpoint.kept import find_latest

    answer: list[Any] = [None]
    if (not dist.is_initialized() or dist.get_rank() == 0) and cfg.checkpoint_dir and cfg.resume:
        try:
            latest = find_latest(cfg.checkpoint_dir) if os.path.isdir(cfg.checkpoint_dir) else None
        except Exception:  # noqa: BLE001 - resuming reports an unreadable checkpoint itself
            latest = None
        if latest is not None and latest.iteration >= cfg.iterations:
            answer[0] = latest.iteration
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def run(cfg: TrainConfig, failures: "FailureReporting | None" = None, plan_only: bool = False) -> int:
    """Join the job, claim the checkpoint directory, build and train (every rank); ``plan_only``:
    stop once the plan is made (``poplar profile --config``: the profile store is then filled)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker whose launcher is gone stops by itself
        from poplar.process.launcher_watch import LauncherWatch
        from poplar.process.sigterm_watch import SigtermWatch
        LauncherWatch(cfg.collective_timeout_s).start()
        SigtermWatch("poplar train").start()  # blocked in a collective, it still answers SIGTERM
    init_distributed(cfg.collective_timeout_s)
    if failures is not None:
        failures.join()
    done = None if plan_only else finished_at(cfg)
    if done is not None:  # before claiming, building or profiling anything
        if int(os.environ.get("RANK", "0")) == 0:
            log.info(f"nothing to do: the checkpoint in {cfg.checkpoint_dir} is at iteration {done} and iterations="
                     f"{cfg.iterations} is reached (raise iterations to train further)")
        return 0
    from poplar.comm import Communicator
    from poplar.train.checkpointing import claim, let_go

    if cfg.checkpoint_dir is not None:  # before anything else: a second job on the directory stops at once
        claim(Communicator(), cfg.checkpoint_dir)
    try:
        return _train(cfg, plan_only)
    finally:
        if cfg.checkpoint_dir is not None:
            let_go(Communicator(), cfg.checkpoint_dir)


def emulated_device(cfg: TrainConfig) -> Any:
    """The door to the emulator: where the config names an emulated cluster (``poplar.cluster``)
    and auto mode will profile, this rank's device of that cluster (its r-th GPU), checked for
    the config's precision (bf16 on an emulated V100 / T4 is an error now); else None, and the
    emulator is not imported."""
    if not cfg.cluster or cfg.plan:
        return None
    from poplar.emulation import cluster_device
    from poplar.emulation.cluster import ClusterSpec

    import torch.distributed as dist

    if cfg.mixed_precision is not None:
        ClusterSpec.resolve(cfg.cluster).check_precision(cfg.mixed_precision)
    # a world of one (no torchrun) stands as the cluster's first GPU; auto mode then names the ranks missing
    return cluster_device(cfg.cluster, dist.get_rank() if dist.is_initialized() else 0)


def with_cluster_nodes(cfg: TrainConfig) -> TrainConfig:
    """The config of a job on an emulated cluster (``poplar.cluster``, auto mode profiling it)
    with the cluster's nodes as its topology, so the engine, the profiler and the planner see the
    machines the emulated network joins (``ClusterDevice``); a ``poplar.topology`` that differs
    from them is an error naming both. Any other config is returned as it is."""
    if not cfg.cluster or cfg.plan:
        return cfg
    from dataclasses import replace

    from poplar.emulation.cluster import ClusterSpec

    spec = ClusterSpec.resolve(cfg.cluster)
    nodes = spec.topology()
    if cfg.topology is None:
        return replace(cfg, topology=nodes) if nodes.spans_nodes else cfg
    if cfg.topology != nodes:
        raise ConfigError(f'"poplar.topology" {[list(n) for n in cfg.topology.nodes]} is not the nodes of the emulated '
                          f'cluster {spec.name!r} ({nodes.describe()}): the cluster declares its machines and the '
                          'network between them; remove "poplar.topology" (the cluster\'s nodes are used), or '
                          'declare those nodes in a cluster file')
    return cfg


def _train(cfg: TrainConfig, plan_only: bool = False) -> int:
    from poplar.train import Trainer
    from poplar.train.hf_output import output_dir, run_tokenizer

    if plan_only:  # the plan is made (and the profile store filled) by building the engine
        from poplar.train.from_config import build_engine
        from poplar.train.run_parts import build_parts

        torch.manual_seed(cfg.seed)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        build_engine(cfg, build_parts(cfg, device), emulated_device(cfg)).close()
        return 0
    trainer = Trainer.from_config(cfg, emulated_device(cfg))
    try:
        if trainer.engine.rank == 0 and cfg.mixed_precision is not None:
            log.info(f"mixed precision: {describe_precision(cfg.mixed_precision)}")
        # fit handles SIGTERM while it trains and then gives back the handler it found: SIG_IGN, so a
        # SIGTERM torchrun sends once it sees a peer die cannot end this rank between fit's failure
        # and the failure line (a second SIGTERM during fit then no longer kills at once)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        trainer.fit(cfg.iterations)
        out = output_dir(cfg)
        if out is not None:
            trainer.save_pretrained(out, run_tokenizer(cfg))
    finally:
        trainer.close()
    return 0


def _main(args: argparse.Namespace) -> int:
    from poplar.comm import DistributedError
    from poplar.checkpoint import NoCompleteCheckpoint

    code = 1
    failures = FailureReporting()
    failure: tuple[str, bool] | None = None  # (the failure's text, whether a peer's failure caused it)
    try:
        cfg = with_cluster_nodes(TrainConfig.load(args.config))
        if args.iterations is not None:
            cfg.iterations = args.iterations
        code = run(cfg, failures, plan_only=getattr(args, "plan_only", False))
        failures.finished()
    except Preempted as e:
        code = e.exit_code
        failures.finished()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"poplar train: {e}", file=sys.stderr, flush=True)
    except (DistributedError, ValueError, FileNotFoundError, MemoryError) as e:
        # bad input (a config, a plan, a path) fails every rank alike; a dead peer fails the survivors
        if isinstance(e, NoCompleteCheckpoint):  # the fix in this interface's terms
            e = NoCompleteCheckpoint(e.problem, 'set "poplar.checkpoint.resume": false in the config')
        # only the text is kept: the exception's frames hold the engine and, through it, the
        # process group, whose connections must close for peers blocked on this rank to go on
        failure = (str(e), isinstance(e, DistributedError)) if isinstance(e, DistributedError) \
            else (f"error: {e}", False)
    try:
        if failure is not None:
            code = 1
            failures.end(*failure)
    finally:
        _tear_down()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun, a finished rank sometimes aborted at interpreter shutdown ("terminate
        # called without an active exception": a gloo thread destroyed late), turning a success
        # into exit status 1. Everything is torn down and flushed by now, so leave at once.
        os._exit(code)
    return code


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may be gone
            pass


def _tear_down() -> None:
    """The process group last, after every rank is done with it; then flush what was printed."""
    import logging

    _destroy_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()


def register(sub: argparse._SubParsersAction) -> None:
    # the module docstring's first paragraph, as plain text: --help shows no RST backticks
    description = __doc__.split("\n\n")[0].replace("`", "") if __doc__ else None
    p = sub.add_parser("train", help="train from a JSON config (launch with torchrun for several ranks)",
                       description=description)
    p.add_argument("--config", required=True, help="the run's JSON config (DeepSpeed-style keys + a poplar section)")
    p.add_argument("--iterations", type=int, default=None, help="override poplar.iterations")
    p.set_defaults(func=_main)
