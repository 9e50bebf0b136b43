"""Re-sharding optimizer state on load: each new optimizer parameter's state is rebuilt from the
saved (name, element range) pieces that overlap its segments, reading only those ranges from
whichever old ranks' files hold them."""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from poplar.checkpoint.errors import Damaged, Invalid
from poplar.checkpoint.layout import decode_scalar, model_file_entries, restore_hyperparams
from poplar.checkpoint.storage import sha256


class CheckpointFiles:
    """Opens checkpoint files on first use, after checking their sha256."""

    def __init__(self, directory: Path, index: dict, verify: bool, stack: ExitStack) -> None:
        self.directory, self.index, self.verify, self.stack = directory, index, verify, stack
        self.open: dict[int, Any] = {}

    def _checked(self, entry: dict) -> Path:
        path = self.directory / entry["file"]
        if self.verify and sha256(path) != entry["sha256"]:
            raise Damaged(f"checkpoint file {path} does not match its sha256 in the index: it is corrupt")
        return path

    def model_state(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for entry in model_file_entries(self.index["model"]):  # one file, or Hugging Face shards
            state.update(load_file(str(self._checked(entry)), device="cpu"))
        table = self.index["model"]["params"]
        if set(state) != set(table):
            raise Invalid(f"the model files of {self.directory} hold other tensors than the index lists: the "
                          "checkpoint is corrupt")
        return state

    def rank_file(self, r: int) -> Any:
        if r not in self.open:
            path = self._checked(self.index["ranks"][r])
            self.open[r] = self.stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self.open[r]

    def read(self, r: int, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of a 1-d tensor of old rank r's file (the whole tensor by default)."""
        f = self.rank_file(r)
        try:
            if start is None:
                return f.get_tensor(key)
            return f.get_slice(key)[start:stop]
        except Exception as e:  # noqa: BLE001
            raise Invalid(f"{self.index['ranks'][r]['file']} lacks tensor '{key}' ({e}): the checkpoint is "
                          "corrupt") from None


def assemble_optimizer(engine: Any, index: dict, files: CheckpointFiles) -> dict[str, Any]:
    """The optimizer state dict (torch format) of this rank's new optimizer parameters."""
    opt = engine.optimizer
    saved_opt = index["optimizer"]
    if saved_opt["class"] != type(opt).__name__:
        raise Invalid(f"the checkpoint's optimizer is {saved_opt['class']} but the engine's is "
                      f"{type(opt).__name__}")
    if len(saved_opt["param_groups"]) != len(opt.param_groups):
        raise Invalid(f"the checkpoint's optimizer has {len(saved_opt['param_groups'])} param groups but the "
                      f"engine's has {len(opt.param_groups)}")

    catalog: dict[str, list[tuple[int, dict]]] = defaultdict(list)  # name -> (old rank, piece)
    group_keys: dict[int, set] = defaultdict(set)
    group_scalars: dict[int, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for r, rank_info in enumerate(index["ranks"]):
        for piece in rank_info["pieces"]:
            catalog[piece["name"]].append((r, piece))
            group_keys[piece["group"]].update(piece["keys"])
            for k, enc in piece["scalars"].items():
                group_scalars[piece["group"]][k].add(json.dumps(enc, sort_keys=True))

    segments_of = {id(p): segs for p, segs in engine.stage.optimizer_segments()}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    i = 0
    for gi, group in enumerate(opt.param_groups):
        ids = []
        for p in group["params"]:
            if id(p) not in segments_of:
                raise Invalid(f"optimizer group {gi} holds a parameter the ZeRO stage does not describe")
            s = _param_state(p, gi, segments_of[id(p)], catalog, group_keys, group_scalars, files)
            if s:
                state[i] = s
            ids.append(i)
            i += 1
        restored = restore_hyperparams(group, saved_opt["param_groups"][gi])
        restored["params"] = ids
        groups.append(restored)
    return {"state": state, "param_groups": groups}


def _param_state(p: torch.Tensor, gi: int, segments: list, catalog: dict, group_keys: dict, group_scalars: dict,
                 files: CheckpointFiles) -> dict[str, Any]:
    """One new optimizer parameter's state, from the saved pieces overlapping its segments."""
    if not segments:  # all padding: zeros and the group's scalars
        out: dict[str, Any] = {}
        for k, values in group_scalars[gi].items():
            if len(values) != 1:
                raise Invalid(f"optimizer state '{k}' differs between parameters of group {gi}; cannot give a "
                              "padding shard one value")
            out[k] = decode_scalar(json.loads(next(iter(values))))
        for k in group_keys[gi]:
            out[k] = torch.zeros_like(p, device="cpu")
        return out

    keys: set | None = None
    scalars: dict[str, set] = defaultdict(set)
    parts = []  # (old rank, piece, a, b, at): elements [a, b) of the name go to index `at` of p
    for name, offset, length, at in segments:
        if name not in catalog:
            raise Invalid(f"the checkpoint has no optimizer state for '{name}' (was it frozen, or tied to "
                          "another parameter, when saved?)")
        covered = 0
        for r, piece in catalog.get(name, []):
            a, b = max(offset, piece["offset"]), min(offset + length, piece["offset"] + piece["length"])
            if a >= b:
                continue
            if piece["group"] != gi:
                raise Invalid(f"parameter '{name}' was in optimizer param group {piece['group']} when saved and is "
                              f"in group {gi} now; build the optimizer with the same groups")
            piece_keys = set(piece["keys"])
            if keys is None:
                keys = piece_keys
            elif keys != piece_keys:
                raise Invalid(f"optimizer state of '{name}' has keys {sorted(piece_keys)} in one part and "
                              f"{sorted(keys)} in another; the checkpoint cannot be re-sharded")
            for k, enc in piece["scalars"].items():
                scalars[k].add(json.dumps(enc, sort_keys=True))
            parts.append((r, piece, a, b, at + (a - offset)))
            covered += b - a
        if covered != length:
            raise Invalid(f"the checkpoint holds optimizer state for {covered} of elements {offset}..{offset + length}"
                          f" of '{name}': it is incomplete or corrupt")
    out = {}
    for k, values in scalars.items():
        if len(values) != 1:
            raise Invalid(f"optimizer state '{k}' differs between the parameters that now share one shard "
                          f"({sorted(values)}); cannot merge them")
        out[k] = decode_scalar(json.loads(next(iter(values))))
    for k in sorted(keys or ()):
        flat = None
        for r, piece, a, b, to in parts:
            data = files.read(r, piece["keys"][k], a - piece["offset"], b - piece["offset"])
            if flat is None:
                flat = torch.zeros(p.numel(), dtype=data.dtype)
            flat[to:to + (b - a)] = data
        out[k] = flat.view(p.shape)
    return out
