"""Loading a sharded (DCP) checkpoint on any world size, stage, plan or shard weights: each rank
asks DCP for the rectangles of its own new pieces (``checkpoint.cut``) and DCP's load planner
reads only the saved chunks that overlap them, straight into the stage's fp32 master shards and
into the optimizer state being built. Nothing is gathered; a rank holds its shards plus what
DCP reads of one saved chunk at a time.

ZeRO-3 loads in place: every check (index, parameter table, optimizer, every file's size and,
spread over the ranks, sha256, the DCP metadata) comes before the read, but a read that fails
midway (a file that vanished or cannot be read) leaves the engine's shards partly loaded; the
``CheckpointError`` says so. Stages 0-2 hold the whole model on every rank anyway: they read it
whole into new tensors and set it once everything is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from poplar.checkpoint.cut import Piece, dcp_value, param_shapes, pieces_of
from poplar.checkpoint.errors import Damaged, Invalid
from poplar.checkpoint.layout import DCP_METADATA_FILE, IMPLEMENTATION_KEYS
from poplar.checkpoint.snapshot import gather_pieces
from poplar.checkpoint.storage import sha256

MODEL, STATE, GROUPS = "model.", "optim.state.", "optim.param_groups."


def check_hashes(directory: Path, index: dict[str, Any], rank: int, world: int) -> None:
    """Every data file's sha256, the files spread over the ranks (rank r checks old rank j's
    DCP files where j % world == r), so no rank reads the whole checkpoint to check it."""
    entries = [index["model"]["dcp_metadata"]]
    if rank < len(index["ranks"]):
        entries.append(index["ranks"][rank])
    entries += [s for j, r in enumerate(index["ranks"]) if j % world == rank for s in r["shards"]]
    for entry in entries:
        path = directory / entry["file"]
        if sha256(path) != entry["sha256"]:
            raise Damaged(f"checkpoint file {path} does not match its sha256 in the index: it is corrupt")


def read_metadata(directory: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"{directory / DCP_METADATA_FILE} cannot be read ({type(e).__name__}: {e}): not a complete "
                      "torch.distributed.checkpoint directory") from None


def unsharded(engine: Any) -> dict[str, torch.Tensor]:
    """The model's tensors no optimizer parameter holds (buffers, frozen parameters)."""
    trained = {id(p) for u in engine.stage.units for p in u.params}
    return {k: v for k, v in engine.module.state_dict(keep_vars=True).items() if id(v) not in trained}


def aliases(engine: Any) -> dict[str, str]:
    """Tied weights: each state-dict name of a trained parameter other than its unit's name ->
    that name."""
    name_of = {id(p): n for u in engine.stage.units for p, n in zip(u.params, u.names)}
    return {k: name_of[id(v)] for k, v in engine.module.state_dict(keep_vars=True).items()
            if id(v) in name_of and name_of[id(v)] != k}


def check_against(engine: Any, md: Metadata) -> None:
    """The checkpoint's model tensors are the engine's (names and shapes), and its optimizer has
    as many param groups, with the same parameters in each; raises ``Invalid`` naming the
    difference."""
    saved = {k[len(MODEL):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
             if k.startswith(MODEL) and isinstance(v, TensorStorageMetadata)}
    expected = param_shapes(engine.stage, engine.module)
    tied = aliases(engine)
    missing = [k for k in expected if k not in saved and k not in tied]
    unexpected = sorted(k for k in saved if k not in expected)
    shapes = [f"{k}: checkpoint {list(saved[k])} vs model {list(expected[k])}" for k in saved
              if k in expected and saved[k] != expected[k]]
    lines = [f"model parameters missing from the checkpoint: {missing[:6]}"] if missing else []
    lines += [f"checkpoint parameters the model does not have: {unexpected[:6]}"] if unexpected else []
    lines += [f"shapes differ: {shapes[:6]}"] if shapes else []
    if lines:
        raise Invalid("the checkpoint does not match the model (a different architecture or size?): "
                      + "; ".join(lines))
    groups = {k[len(GROUPS):].split(".")[0] for k in md.state_dict_metadata if k.startswith(GROUPS)}
    if len(groups) != len(engine.optimizer.param_groups):
        raise Invalid(f"the checkpoint's optimizer has {len(groups)} param groups but the engine's has "
                      f"{len(engine.optimizer.param_groups)}; build the optimizer with the same groups")


def _keys(md: Metadata, name: str) -> tuple[dict[str, torch.dtype], dict[str, Any]]:
    """The optimizer state saved for parameter ``name``: per-element keys (a tensor of the
    parameter's shape) with their dtypes, and the others (``step``, ...) with their metadata."""
    prefix = f"{STATE}{name}."
    model = md.state_dict_metadata[MODEL + name]
    per_element, scalars = {}, {}
    for k, v in md.state_dict_metadata.items():
        if not k.startswith(prefix):
            continue
        key = k[len(prefix):]
        if isinstance(v, TensorStorageMetadata) and len(v.size) > 0 and tuple(v.size) == tuple(model.size):
            per_element[key] = v.properties.dtype
        else:
            scalars[key] = v
    return per_element, scalars


def _scalar_targets(scalars: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in scalars.items()}


class Targets:
    """What this rank reads: a DCP state dict of views into its new shards (ZeRO-3: the stage's
    masters; the optimizer state: new flat tensors), and how the engine takes it afterwards."""

    def __init__(self, engine: Any, md: Metadata, what: str) -> None:
        self.engine, self.md = engine, md
        opt = engine.optimizer
        group = engine.comm.group if engine.comm.distributed else None
        self.in_place = engine.zero_stage == 3
        self.held = pieces_of(engine.stage, engine.comm.rank)
        everyone = gather_pieces(engine.comm, [pc for _, ps in self.held for pc in ps if not pc.whole], what)
        self.group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        self.first = [next((n for u in engine.stage.units if u.group_index == gi for n in u.names), None)
                      for gi in range(len(opt.param_groups))]
        self.model: dict[str, Any] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.flats: list[dict[str, torch.Tensor]] = []
        for i, (p, pieces) in enumerate(self.held):
            self._add(i, p, pieces, everyone, group)
        for name in self.first:  # a shard that is all padding takes its group's scalars from there
            if name is not None and name not in self.state:
                self.state[name] = _scalar_targets(_keys(md, name)[1])
        self.full: dict[str, torch.Tensor] = {}  # stages 0-2: the whole model, read, then set
        if not self.in_place:
            shapes = param_shapes(engine.stage, engine.module)
            self.full = {n: torch.empty(shapes[n], dtype=torch.float32) for u in engine.stage.units for n in u.names}
            self.model.update(self.full)
        self.buffers = {k: torch.empty_like(v, device="cpu") for k, v in unsharded(engine).items()}
        self.model.update(self.buffers)
        self.model.update({alias: self.model[name] for alias, name in aliases(engine).items()
                           if name in self.model and MODEL + alias in md.state_dict_metadata})
        self.groups = [{k[len(f"{GROUPS}{gi}."):]: None for k in md.state_dict_metadata
                        if k.startswith(f"{GROUPS}{gi}.")} for gi in range(len(opt.param_groups))]

    def _add(self, i: int, p: torch.Tensor, pieces: list[Piece], everyone: dict[str, list[Piece]], group: Any) -> None:
        name = pieces[0].name if pieces else self.first[self.group_of[id(p)]]
        per_element = _keys(self.md, name)[0] if name is not None else {}
        flats = {k: torch.zeros(p.numel(), dtype=dtype, device=p.device) for k, dtype in per_element.items()}
        self.flats.append(flats)
        master = None
        if self.in_place:
            master = self.engine.stage.offload.master(self.engine.stage.shard_params[i]).detach().reshape(-1)
        for pc in pieces:
            if master is not None:
                self.model[pc.name] = dcp_value(pc, master, everyone.get(pc.name, []), group)
            entry = {k: dcp_value(pc, f, everyone.get(pc.name, []), group) for k, f in flats.items()}
            entry.update(_scalar_targets(_keys(self.md, pc.name)[1]))
            if entry:
                self.state[pc.name] = entry

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model, "optim": {"state": self.state, "param_groups": self.groups}}

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state dict (torch's, by position) from what was read."""
        opt = self.engine.optimizer
        index_of = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for (p, pieces), flats in zip(self.held, self.flats):
            names = [pc.name for pc in pieces] or [self.first[self.group_of[id(p)]]]
            scalars = _agreed_scalars(self.state, flats, names)
            entry = {**{k: f.view(p.shape) for k, f in flats.items()}, **scalars}
            if entry:
                state[index_of[id(p)]] = entry
        groups = []
        for gi, g in enumerate(opt.param_groups):
            saved = {k: v for k, v in self.groups[gi].items() if k not in IMPLEMENTATION_KEYS}
            groups.append({**g, **saved, "params": [index_of[id(p)] for p in g["params"]]})
        return {"state": state, "param_groups": groups}

    def set_model(self) -> None:
        """Hand what was read to the stage: ZeRO-3 read its masters in place (their host or
        compute copies follow); stages 0-2 take the whole model."""
        stage = self.engine.stage
        if self.in_place:
            with torch.no_grad():
                for k, v in unsharded(self.engine).items():
                    stage.load_unsharded(v, self.buffers[k])
            stage.offload.refresh()
            return
        full = {**self.full, **self.buffers}
        full.update({alias: full[name] for alias, name in aliases(self.engine).items()})
        stage.load_full_state_dict(full)


def _agreed_scalars(state: dict[str, dict[str, Any]], flats: dict[str, torch.Tensor],
                    names: list[str | None]) -> dict[str, Any]:
    """The non-per-element state (``step``, ...) the parameters that now share one shard had:
    one value, or ``Invalid``."""
    out: dict[str, Any] = {}
    for name in names:
        for k, v in (state.get(name, {}) if name is not None else {}).items():
            if k in flats:
                continue
            value = v.clone() if torch.is_tensor(v) else v
            if k in out and not _same(out[k], value):
                raise Invalid(f"optimizer state '{k}' differs between the parameters that now share one shard "
                              f"({out[k]} and {value}); cannot merge them")
            out[k] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b
