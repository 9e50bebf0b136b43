"""What one save writes, taken between iterations: this rank's shards in torch's state-dict
convention (views of the shards, or host copies for a save written in the background), every
rank's pieces (the cut), the run's record for the index and this rank's RNG states."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from poplar.checkpoint.cut import Piece, dcp_value, param_shapes, pieces_of
from poplar.checkpoint.errors import CheckpointError
from poplar.checkpoint.layout import DCP_FORMAT_VERSION, FORMAT, dtype_name, group_hyperparams, ties


@dataclass
class Snapshot:
    """One rank's part of a save."""

    state: dict[str, Any]  # {"model": ..., "optim": ...}: what DCP writes
    everyone: dict[str, list[Piece]]  # every rank's pieces, by parameter name
    record: dict[str, Any]  # the index's fields that describe the run
    rng: dict[str, torch.Tensor]  # "cpu" (and "cuda") generator states
    on_host: bool  # every tensor of ``state`` is in host memory


def take_snapshot(engine: Any, what: str, group: Any, copy: bool) -> Snapshot:
    """Collective (the pieces are gathered, metadata only). ``copy``: the shards are copied to
    host memory (a save written while training goes on), else ``state`` holds views of them.
    ``group``: the process group the save's ``ShardedTensor`` metadata names."""
    held = held_pieces(engine)
    everyone = gather_pieces(engine.comm, [pc for _, ps in held for pc in ps], what)
    if copy:
        held = [(p.detach().to("cpu", copy=True) if ps else p, ps) for p, ps in held]
    state = shard_state(engine, held, everyone, group, copy)
    rng = {"cpu": torch.get_rng_state()}
    if engine.comm.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(engine.comm.device).cpu()
    on_host = copy or engine.comm.device.type == "cpu"
    return Snapshot(state, everyone, run_record(engine, everyone), rng, on_host)


def held_pieces(engine: Any) -> list[tuple[torch.Tensor, list[Piece]]]:
    """This rank's optimizer parameters and their pieces; ZeRO-0 replicates them, and rank 0's
    copy is the checkpoint's."""
    held = pieces_of(engine.stage, engine.comm.rank)
    if engine.zero_stage == 0 and engine.comm.rank != 0:
        return [(p, []) for p, _ in held]
    return held


def gather_pieces(comm: Any, mine: list[Piece], what: str) -> dict[str, list[Piece]]:
    """Every rank's pieces by parameter name (metadata only)."""
    by_name: dict[str, list[Piece]] = defaultdict(list)
    for pieces in comm.agree(None, what, mine, error_type=CheckpointError):
        for pc in pieces:
            by_name[pc.name].append(pc)
    return dict(by_name)


def shard_state(engine: Any, held: list[tuple[torch.Tensor, list[Piece]]], everyone: dict[str, list[Piece]],
                group: Any, copy: bool) -> dict[str, Any]:
    """This rank's part of the state in torch's convention (``get_state_dict`` of an FSDP2 model):
    ``{"model": {name: tensor}, "optim": {"state": {name: {key: tensor}}, "param_groups": [...]}}``.
    ``held``: the tensors the optimizer steps (or their host copies, ``copy``), in the optimizer's
    order; its state is read from the optimizer (and copied with them)."""
    live = [p for p, _ in engine.stage.optimizer_segments()]
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for (p, pieces), stepped in zip(held, live):
        values = engine.optimizer.state.get(stepped, {})
        per_element = {k: v.detach().reshape(-1) for k, v in values.items() if is_per_element(k, v, stepped)}
        if copy and pieces:
            per_element = {k: v.to("cpu", copy=True) for k, v in per_element.items()}
        flat = p.detach().reshape(-1)
        for pc in pieces:
            model[pc.name] = dcp_value(pc, flat, everyone[pc.name], group)
            entry = {k: dcp_value(pc, f, everyone[pc.name], group) for k, f in per_element.items()}
            entry.update({k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                          for k, v in values.items() if k not in per_element})
            if entry:
                state[pc.name] = entry
    if engine.comm.rank == 0:
        model.update(unsharded_tensors(engine))
    name_of = {id(p): n for u in engine.stage.units for p, n in zip(u.params, u.names)}
    model.update({k: model[name_of[id(v)]] for k, v in engine.module.state_dict(keep_vars=True).items()
                  if id(v) in name_of and name_of[id(v)] != k and name_of[id(v)] in model})  # tied: under each key
    return {"model": model, "optim": {"state": state, "param_groups": param_groups(engine)}}


def unsharded_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """The tensors of the model no optimizer parameter holds (buffers, frozen parameters), whole."""
    trained = {id(p) for u in engine.stage.units for p in u.params}
    return {k: engine.stage.unsharded_value(v) for k, v in engine.module.state_dict(keep_vars=True).items()
            if id(v) not in trained}


def param_groups(engine: Any) -> list[dict[str, Any]]:
    """The optimizer's groups as ``get_state_dict`` gives them: hyper-parameters, and ``params``
    the names of the model parameters in the group."""
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    names: dict[int, list[str]] = defaultdict(list)
    for u in engine.stage.units:
        names[u.group_index].extend(u.names)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": sorted(names[gi], key=order.__getitem__)}
            for gi, g in enumerate(engine.optimizer.param_groups)]


def is_per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    if not torch.is_tensor(value) or value.shape != param.shape:
        return False
    return value.dim() > 0 or key != "step"  # a 0-d parameter's 0-d "step" is a counter


def run_record(engine: Any, everyone: dict[str, list[Piece]]) -> dict[str, Any]:
    """The index's description of the run and the model, as it is at the save."""
    shapes = param_shapes(engine.stage, engine.module)
    dtypes = {k: v.dtype for k, v in engine.module.state_dict(keep_vars=True).items()}
    params = {k: {"shape": list(s), "dtype": dtype_name(torch.float32 if k in everyone else dtypes[k])}
              for k, s in shapes.items()}
    return {
        "format": FORMAT, "version": DCP_FORMAT_VERSION, "layout": "dcp",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch": torch.__version__,
        "iteration": engine.iteration,
        "world_size": engine.comm.world_size,
        "zero_stage": engine.zero_stage,
        "plan": engine.plan.to_dict() if engine.plan is not None else None,
        "model": {"params": params, "tied": ties(engine.module)},
        "optimizer": {"class": type(engine.optimizer).__name__,
                      "param_groups": [group_hyperparams(g) for g in engine.optimizer.param_groups]},
        "precision": precision_state(engine),
    }


def precision_state(engine: Any) -> dict[str, Any]:
    """The precision policy the run trained under, its loss scaler (fp16) and its skipped steps:
    a resumed run continues them; weights and optimizer state are fp32 under every policy, so
    a checkpoint loads under any other policy."""
    policy, scaler = engine.mixed_precision, engine.loss_scaler
    return {"policy": None if policy is None else policy.to_dict(),
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            "nonfinite": engine.nonfinite.state_dict()}
