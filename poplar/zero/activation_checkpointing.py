"""Activation checkpointing: chosen modules keep only their inputs in forward and run their
forward again in backward, when their gradients are needed (docs/design.md §3.8).

``ZeroRuntime(..., activation_checkpointing=...)``:

- ``None`` / ``False``: off;
- ``True``: the wrap policy's blocks (``poplar.zero.wrap``; the default policy's layer stack, at
  every stage), those that contain no other block;
- a module class, a set of classes or class names, or a callable ``policy(name, module) -> bool``
  (the forms of ``wrap_policy``): the outermost modules it matches.

How. Torch's non-reentrant checkpoint, applied through forward hooks (the composable
``torch.distributed._composable.checkpoint``): the module objects, their names and the
``state_dict`` keys stay exactly as they were, so checkpoints, wrap policies and user code that
reaches ``model.layers[3]`` see the same model. The recomputation replays the saved RNG state,
so dropout draws the same masks: the math is that of the run without checkpointing.

ZeRO-3. A checkpointed module must not strictly contain a ZeRO-3 block: its recomputation runs
during the backward of the block that holds it, when the backward schedule has gathered that
block (its output's gradient hook asked for it before any node of it runs), and it issues no
collective, so the fixed list of collectives (``poplar.zero.prefetch``) is the same on every rank
with or without checkpointing. Hooks of the stage recognise a recomputation (``recomputing()``)
and neither gather nor release anything.

Key/value caches. A model with a Hugging Face style ``config.use_cache`` keeps each attention
layer's keys and values in a cache during forward; the recomputation would append the same keys
a second time (twice the sequence length, and a shape error in eager attention). Training never
reads the cache, so where modules are checkpointed every ``config.use_cache`` found on the
model's modules is set to False (as Hugging Face's own gradient checkpointing does).

Observing recomputation. ``add_recompute_context(factory)`` enters ``factory()`` around every
recomputation (the profiler's virtual devices count the recomputed activations with it).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, ContextManager, Iterator

from torch import nn

from poplar.comm import Communicator
from poplar.zero.wrap import default_blocks, resolve_policy

_recomputing = [0]  # recomputations running now in this process (nested ones count twice)


def recomputing() -> bool:
    """True while a checkpointed module's forward runs again, inside backward."""
    return _recomputing[0] > 0


@contextlib.contextmanager
def _recompute_scope(factories: list[Callable[[], ContextManager[Any]]]) -> Iterator[None]:
    _recomputing[0] += 1
    try:
        with contextlib.ExitStack() as stack:
            for f in list(factories):
                stack.enter_context(f())
            yield
    finally:
        _recomputing[0] -= 1


class RecomputeHandle:
    """Detaches a recompute context factory (``remove()``)."""

    def __init__(self, owner: list, factory: Callable[[], ContextManager[Any]]) -> None:
        self._owner, self._factory = owner, factory

    def remove(self) -> None:
        if self._factory in self._owner:
            self._owner.remove(self._factory)


def _outermost(matched: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in matched]
    return [(n, m) for n, m in matched if not any(n.startswith(o + ".") for o in names if o != n)]


def _innermost(matched: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in matched]
    return [(n, m) for n, m in matched if not any(o.startswith(n + ".") for o in names if o != n)]


def _unique(matched: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    out = []
    for n, m in matched:
        if id(m) not in seen:
            seen.add(id(m))
            out.append((n, m))
    return out


def select_modules(model: nn.Module, setting: Any, wrap_policy: Any) -> tuple[list[tuple[str, nn.Module]], str | None]:
    """The (name, module) pairs ``setting`` checkpoints, in registration order, or an error."""
    if setting is None or setting is False:
        return [], None
    if setting is True:
        fn, error = resolve_policy(wrap_policy)
        if error:
            return [], error
        matched = default_blocks(model) if fn is None else [(n, m) for n, m in model.named_modules() if n and fn(n, m)]
        chosen = _innermost(_unique(matched))
        if not chosen:
            return [], ("activation_checkpointing=True checkpoints the wrap policy's blocks, but the model has "
                        "none; pass module classes to checkpoint (activation_checkpointing={MyBlock})")
        return chosen, None
    fn, error = resolve_policy(setting)
    if error:
        return [], "activation_checkpointing: " + error.replace("wrap_policy", "the policy") + \
            " (or True / False / None)"
    assert fn is not None
    if fn("", model):
        return [], (f"activation_checkpointing={setting!r} matches the whole model; checkpointing it is not "
                    "supported, checkpoint its layers")
    matched = [(n, m) for n, m in model.named_modules() if n and fn(n, m)]
    if not matched:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules()})
        return [], (f"activation_checkpointing={setting!r} matches no module of the model (module classes present: "
                    f"{kinds}); pass classes that occur in the model below its root")
    return _outermost(_unique(matched)), None


def check_stage3(chosen: list[tuple[str, nn.Module]], block_names: list[str]) -> str | None:
    """A checkpointed module that strictly contains a ZeRO-3 block could not be recomputed
    without gathering that block out of the schedule's order: the error, or None."""
    for name, _ in chosen:
        inner = [b for b in block_names if b.startswith(name + ".")]
        if inner:
            return (f"activation checkpointing of '{name}' at ZeRO-3: it contains the ZeRO-3 block(s) {inner[:3]}; "
                    "checkpoint modules inside one block (activation_checkpointing=True checkpoints the blocks "
                    f"themselves) or wrap '{name}' as one block (wrap_policy)")
    return None


class ActivationCheckpointing:
    """Which modules of a model are checkpointed, and the hooks that do it.

    Build it with ``setup(...)`` (collective: ranks agree on the choice). ``names`` lists the
    checkpointed modules; ``enabled`` is False when there are none.
    """

    def __init__(self, chosen: list[tuple[str, nn.Module]]) -> None:
        self.names = [n for n, _ in chosen]
        self._factories: list[Callable[[], ContextManager[Any]]] = []
        if chosen:
            from torch.distributed._composable import checkpoint as composable_checkpoint

            for _, module in chosen:
                composable_checkpoint(module, context_fn=self._contexts)

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def _contexts(self) -> tuple[ContextManager[Any], ContextManager[Any]]:
        return contextlib.nullcontext(), _recompute_scope(self._factories)

    def add_recompute_context(self, factory: Callable[[], ContextManager[Any]]) -> RecomputeHandle:
        """Enter ``factory()`` around each recomputation from now on; ``handle.remove()`` stops it."""
        self._factories.append(factory)
        return RecomputeHandle(self._factories, factory)

    def describe(self) -> str:
        if not self.names:
            return "off"
        shown = ", ".join(self.names[:4]) + (f", ... ({len(self.names)} modules)" if len(self.names) > 4 else "")
        return f"on: {shown}"


def disable_kv_cache(model: nn.Module) -> int:
    """Set every ``config.use_cache`` found on ``model``'s modules to False (the module doc:
    a recomputed attention layer would add its keys to the cache again); how many were on."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    return len(configs)


def setup(comm: Communicator, model: nn.Module, setting: Any, wrap_policy: Any,
          stage3_blocks: list[str] | None) -> ActivationCheckpointing:
    """Choose the modules, check them against the ZeRO-3 blocks (``stage3_blocks``: their names,
    None below stage 3), agree with every rank, and install the hooks."""
    try:
        chosen, error = select_modules(model, setting, wrap_policy)
    except Exception as e:  # a user policy that raises must not leave the other ranks waiting
        chosen, error = [], f"activation_checkpointing policy raised {type(e).__name__}: {e}"
    if error is None and stage3_blocks is not None:
        error = check_stage3(chosen, stage3_blocks)
    signature = hashlib.sha256(repr([n for n, _ in chosen]).encode()).hexdigest()
    comm.agree(error, "activation checkpointing", signature,
               mismatch="ranks chose different modules to checkpoint; pass the same activation_checkpointing "
                        "to every rank")
    if chosen:
        disable_kv_cache(model)
    return ActivationCheckpointing(chosen)
