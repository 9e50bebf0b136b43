"""ZeRO-3 blocks: which modules are gathered and released as one (the wrap policy), and which
trainable parameters each block owns.

A wrap policy is one of:
- ``None`` (default): for a model that names its unsplittable modules (a Hugging Face model's
  ``_no_split_modules``, e.g. ``{"LlamaDecoderLayer"}``), every module of those classes; otherwise
  (transformer-style models) every module held directly in an ``nn.ModuleList`` or
  ``nn.Sequential`` (the layer stack), outermost containers only; a model with no such container
  gets every direct child of the root that holds parameters.
- a module class, or a set/list/tuple of classes or class names (``{Block}``, ``{"Block"}``):
  every module that is an instance of one (FSDP's module-class policy);
- a callable ``policy(name, module) -> bool`` (or ``policy(module) -> bool``).
The root module is never a block: what no block owns forms the root unit.

Ownership: a parameter belongs to the innermost block containing the module that holds it.
A parameter held by modules of two different blocks (tied weights: one ``Parameter`` in two
modules) belongs to the root unit, which stays gathered from the model's forward until all its
gradients have arrived in backward, so every user sees the gathered value and the weights stay tied. Blocks may nest
(an outer block owns what its inner blocks do not). A parameter must only be used inside the
forward of the block that owns it (as with FSDP); use outside (e.g. ``F.linear(x, self.layers[0].w)``
in the root's forward) finds it released and fails with a shape error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

Policy = Callable[[str, nn.Module], bool]


@dataclass
class BlockSpec:
    """One block before sharding: its module and, per optimizer group, its (name, param) pairs."""
    name: str  # "" for the root unit
    module: nn.Module
    members: list[tuple[int, list[tuple[str, nn.Parameter]]]]  # (group index, params in model order)


def resolve_policy(policy: Any) -> tuple[Policy | None, str | None]:
    """The policy as ``f(name, module) -> bool`` (None = the default), or an error message."""
    if policy is None:
        return None, None
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(c for c in policy if isinstance(c, type))
        names = {c for c in policy if isinstance(c, str)}
        bad = [c for c in policy if not isinstance(c, (type, str))]
        if bad or not policy:
            return None, (f"wrap_policy must be module classes (or class names), a callable (name, module) -> bool, "
                          f"or None; got {policy!r}")
        return (lambda _n, m: isinstance(m, classes) or type(m).__name__ in names), None
    if callable(policy):
        try:
            two = len(inspect.signature(policy).parameters) >= 2
        except (TypeError, ValueError):
            two = False
        return (policy if two else (lambda _n, m: policy(m))), None
    return None, f"wrap_policy must be module classes, a callable or None; got {type(policy).__name__}"


def no_split_classes(model: nn.Module) -> set[str]:
    """The class names a model says must not be split across devices (Hugging Face's
    ``_no_split_modules``; empty for a model that names none)."""
    names = getattr(model, "_no_split_modules", None)  # a foreign model's convention, not ours
    if not isinstance(names, (set, frozenset, list, tuple)):
        return set()
    return {n for n in names if isinstance(n, str)}


def default_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of the model's no-split classes, if any own parameters; else members of the
    outermost ModuleList / Sequential containers; else the root's children."""
    names = no_split_classes(model)
    if names:
        found = [(n, m) for n, m in model.named_modules()
                 if n and type(m).__name__ in names and any(True for _ in m.parameters())]
        if found:
            return found
    found = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                found.extend((f"{path}.{n}", c) for n, c in child.named_children())
            else:
                visit(path + ".", child)

    if isinstance(model, (nn.ModuleList, nn.Sequential)):
        found.extend(model.named_children())
    else:
        visit("", model)
    if not found:
        found = [(n, c) for n, c in model.named_children() if any(True for _ in c.parameters())]
    return found


def plan_blocks(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], policy: Any
                ) -> tuple[list[BlockSpec], str | None]:
    """The root unit (first) and the blocks in module registration order, or an error message."""
    fn, error = resolve_policy(policy)
    if error:
        return [], error
    if fn is None:
        matched = default_blocks(model)
    else:
        matched = [(n, m) for n, m in model.named_modules() if n and fn(n, m)]
        if not matched:
            kinds = sorted({type(m).__name__ for _, m in model.named_modules()})
            return [], (f"wrap_policy {policy!r} matches no module of the model (module classes present: "
                        f"{kinds}); pass classes that occur in the model, or None for the default")
    seen: set[int] = set()
    block_names: dict[str, int] = {}
    for name, module in matched:  # a module object shared at two paths is one block, under its first name
        if id(module) not in seen:
            seen.add(id(module))
            block_names[name] = len(block_names) + 1

    def innermost(path: str) -> int:
        while path:
            if path in block_names:
                return block_names[path]
            path = path.rpartition(".")[0]
        return 0

    owners: dict[int, set[int]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        owner = innermost(path)
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), set()).add(owner)
    owner_of = {pid: (next(iter(o)) if len(o) == 1 else 0) for pid, o in owners.items()}

    named = dict(matched)
    specs = [BlockSpec("", model, [])] + [BlockSpec(n, named[n], []) for n in block_names]
    for gi, members in enumerate(groups):
        per_block: dict[int, list[tuple[str, nn.Parameter]]] = {}
        for name, p in members:
            per_block.setdefault(owner_of.get(id(p), 0), []).append((name, p))
        for bi, ps in per_block.items():
            specs[bi].members.append((gi, ps))
    blocks = [s for s in specs[1:] if s.members]
    if fn is not None and not blocks:
        return [], (f"wrap_policy {policy!r} matches {len(block_names)} module(s) but none owns a trainable "
                    "parameter of its own (tied parameters belong to the root unit); wrap modules that hold weights")
    for s in [specs[0]] + blocks:
        dtypes = {p.dtype for _, ps in s.members for _, p in ps}
        if len(dtypes) > 1:
            return [], (f"block '{s.name or '<root>'}' mixes parameter dtypes {sorted(map(str, dtypes))}; "
                        "ZeRO-3 gathers a block in one dtype, so cast the model to one dtype")
    return [specs[0]] + blocks, None


def block_orders(blocks: list[Any], layers: list[Any], pre: list[int], post: list[int]) -> tuple[list, list]:
    """The forward and backward orders of ``blocks`` from a forward's recorded pre- and
    post-order (block indices); blocks of ``layers`` it did not run follow in model order."""
    by = {b.index: b for b in blocks}
    canon_f = [b.index for b in layers]
    canon_g = list(reversed(post_order(layers)))
    return ([by[i] for i in pre] + [by[i] for i in canon_f if i not in pre],
            [by[i] for i in reversed(post)] + [by[i] for i in canon_g if i not in post])


def post_order(blocks: list[Any]) -> list[int]:
    """Indices of ``blocks`` (in pre-order, with ``.name`` and ``.index``) in the order their
    forwards end, if blocks nest as their names say."""
    out: list[int] = []
    stack: list[Any] = []
    for b in blocks:
        while stack and not b.name.startswith(stack[-1].name + "."):
            out.append(stack.pop().index)
        stack.append(b)
    out.extend(b.index for b in reversed(stack))
    return out
