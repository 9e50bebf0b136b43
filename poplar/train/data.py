"""Data for a plan: every iteration's global batch, cut into each rank's slice.

Iteration k's global batch is a fixed list of ``gbs`` sample indices taken from a seeded
permutation of the dataset. It depends only on (dataset length, gbs, seed, shuffle,
drop_last) and k — never on the plan or the world size — so a run resumed with a different
plan or on a different number of ranks continues the same sample stream (docs/design.md §2).
Rank i takes the contiguous slice of length n_i starting at Σ_{j<i} n_j.

Epochs. Epoch e's order is ``torch.randperm(N)`` drawn from a generator seeded with
``seed + e`` (the convention of ``torch.utils.data.DistributedSampler``); ``shuffle=False``
uses 0..N-1 every epoch. What happens to the N mod gbs samples left at the end of an epoch:

- ``drop_last=True`` (default): they are skipped; epoch e is iterations
  [e·⌊N/gbs⌋, (e+1)·⌊N/gbs⌋). Every global batch holds gbs distinct samples. Needs N ≥ gbs.
- ``drop_last=False``: the permutations are concatenated into one endless stream and global
  batch k is stream[k·gbs : (k+1)·gbs]. No sample is ever skipped; a global batch that
  crosses an epoch boundary takes its tail from the next epoch's permutation (and may then
  hold a sample twice, as it does when gbs > N).

A partial global batch is never produced: the plan fixes Σ n_i = gbs for every iteration.

Resuming: ``PlanLoader.state_dict()`` holds the next iteration and the seed; load it into a
loader built on the same dataset and gbs (any plan, any world size) and it continues the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, default_collate

from poplar.zero.batches import move_to_device, slice_batch
from poplar.types.plans import Plan, PlanError

__all__ = ["GlobalBatchSampler", "LoaderOptions", "PlanLoader", "move_to_device"]


class GlobalBatchSampler:
    """The global batch of every iteration, as a list of sample indices.

    Args:
        num_samples: the dataset's length N.
        global_batch_size: gbs, samples per iteration.
        seed: epoch e is shuffled by a generator seeded with ``seed + e``.
        shuffle: False = the identity order in every epoch.
        drop_last: see the module docstring (True skips an epoch's last N mod gbs samples,
            False continues the global batch into the next epoch).
    """

    _CACHE = 4  # permutations kept (a global batch spans at most a few epochs)

    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"the dataset must hold at least one sample, got length {num_samples!r}")
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
        if drop_last and global_batch_size > num_samples:
            raise ValueError(
                f"global_batch_size {global_batch_size} is larger than the dataset ({num_samples} samples): with "
                "drop_last=True no full global batch exists; use drop_last=False (batches then span epochs) "
                "or a larger dataset")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def iterations_per_epoch(self) -> float:
        """⌊N/gbs⌋ with drop_last, else N/gbs (a float: batches then straddle epochs)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return self.num_samples / self.global_batch_size

    def epoch_of(self, iteration: int) -> int:
        """The epoch iteration ``iteration``'s global batch starts in."""
        if self.drop_last:
            return iteration // (self.num_samples // self.global_batch_size)
        return iteration * self.global_batch_size // self.num_samples

    def reseed(self, seed: int) -> None:
        """Draw permutations from ``seed`` from now on (cached ones are dropped)."""
        self.seed = seed
        self._perms.clear()

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch`` (int64)."""
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                perm = torch.randperm(self.num_samples, generator=g)
            else:
                perm = torch.arange(self.num_samples)
            if len(self._perms) >= self._CACHE:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def indices(self, iteration: int, start: int = 0, length: int | None = None) -> list[int]:
        """Sample indices of iteration ``iteration``'s global batch (positions ``start`` to
        ``start + length`` of it; the whole batch by default)."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        gbs = self.global_batch_size
        length = gbs - start if length is None else length
        if start < 0 or length < 0 or start + length > gbs:
            raise ValueError(f"slice [{start}, {start + length}) is outside a global batch of {gbs}")
        n = self.num_samples
        if self.drop_last:
            per_epoch = n // gbs
            epoch, k = divmod(iteration, per_epoch)
            pos = k * gbs + start
            return self.permutation(epoch)[pos:pos + length].tolist()
        pos = iteration * gbs + start  # position in the endless stream of permutations
        out: list[int] = []
        while len(out) < length:
            epoch, off = divmod(pos, n)
            take = min(length - len(out), n - off)
            out.extend(self.permutation(epoch)[off:off + take].tolist())
            pos += take
        return out


@dataclass(frozen=True)
class LoaderOptions:
    """How a ``PlanLoader`` draws and loads its batches: the rarely changed knobs, one object.

    Args:
        seed, shuffle, drop_last: the global sample stream (see ``GlobalBatchSampler``); a
            checkpoint keeps them, and a resume must use the same ``shuffle`` and ``drop_last``.
        collate_fn: turns a list of samples into a batch (``default_collate`` by default); the
            training loop's evaluation collates with it too.
        num_workers: > 0 loads through a ``torch.utils.data.DataLoader`` with that many
            worker processes (prefetching ahead; the position kept is that of the batches
            yielded, so ``state_dict`` is exact anyway).
        pin_memory, prefetch_factor: passed to the ``DataLoader`` when ``num_workers`` > 0.
    """

    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    collate_fn: Callable[[list], Any] | None = None
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise TypeError(f"LoaderOptions.collate_fn must be a function of a list of samples or None "
                            f"(default_collate), got {type(self.collate_fn).__name__}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"LoaderOptions.num_workers must be an int >= 0 (0: load in this process), got "
                             f"{self.num_workers!r}")
        if self.prefetch_factor is not None and (isinstance(self.prefetch_factor, bool)
                                                 or not isinstance(self.prefetch_factor, int)
                                                 or self.prefetch_factor < 1):
            raise ValueError(f"LoaderOptions.prefetch_factor must be an int >= 1 or None (the DataLoader's "
                             f"default), got {self.prefetch_factor!r}")


class PlanLoader:
    """This rank's share of every global batch, collated, one iteration per ``next()``.

    Works for any map-style dataset (``__len__`` and ``__getitem__``). Iterating yields
    without end, iteration ``self.iteration`` first; bound the loop yourself, with the loader
    last in ``zip`` so no batch is drawn and thrown away::

        for step, batch in zip(range(steps), loader):
            engine.train_step(batch, loss_fn)

    A rank whose plan row has 0 samples gets an empty batch (dim 0 of size 0, the structure of
    one collated sample), which the engine accepts.

    With checkpoints: save ``loader.state_dict()`` in ``extra`` and, after ``load_checkpoint``,
    ``loader.load_state_dict(loaded.extra[...])`` (any plan, any world size).

    Args:
        dataset: map-style dataset.
        plan: the per-rank rows; its global batch size is the sampler's gbs.
        rank: this rank's row.
        options: ``LoaderOptions`` (seed, shuffle, drop_last, collate_fn, workers); the defaults
            when None.
        device: move each batch there (tensors only; non-blocking when ``pin_memory``).
        start_iteration: the first iteration to yield.
    """

    def __init__(self, dataset: Dataset, plan: Plan, rank: int, options: LoaderOptions | None = None, *,
                 device: torch.device | str | None = None, start_iteration: int = 0) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a poplar.Plan, got {type(plan).__name__}")
        options = LoaderOptions() if options is None else options
        if not isinstance(options, LoaderOptions):
            raise TypeError(f"options must be a LoaderOptions, got {type(options).__name__}")
        self.dataset = dataset
        self.sampler = GlobalBatchSampler(len(dataset), plan.global_batch_size, seed=options.seed,
                                          shuffle=options.shuffle, drop_last=options.drop_last)
        self.collate_fn = options.collate_fn or default_collate
        self.device = torch.device(device) if device is not None else None
        self.num_workers, self.pin_memory = options.num_workers, options.pin_memory
        self.prefetch_factor = options.prefetch_factor
        self.iteration = int(start_iteration)
        self._empty: Any = None
        self._workers: Iterator[Any] | None = None
        self.set_plan(plan, rank)

    @classmethod
    def for_engine(cls, dataset: Dataset, engine: Any, options: LoaderOptions | None = None) -> "PlanLoader":
        """A loader for ``engine``'s plan and rank, starting at its iteration, moving batches to its
        device (another device or start: the constructor)."""
        return cls(dataset, engine.plan, engine.rank, options, device=engine.comm.device,
                   start_iteration=engine.iteration)

    # ------------------------------------------------------------------ plan
    def set_plan(self, plan: Plan, rank: int | None = None) -> None:
        """Use a new plan (and rank) from the next iteration on. The global batch size must not
        change: it defines the sample stream."""
        if plan.global_batch_size != self.sampler.global_batch_size:
            raise PlanError(
                f"the new plan's global batch is {plan.global_batch_size} samples but this loader's sample stream "
                f"has global batches of {self.sampler.global_batch_size}; keep the global batch size "
                "(or build a new loader)")
        rank = getattr(self, "rank", 0) if rank is None else rank
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {plan.world_size} rows")
        self.plan, self.rank = plan, rank
        self.offset = plan.sample_offsets()[rank]
        self.num_rank_samples = plan.ranks[rank].num_samples
        self._workers = None

    # ------------------------------------------------------------------ what each iteration holds
    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the next iteration."""
        return self.sampler.epoch_of(self.iteration)

    def global_indices(self, iteration: int) -> list[int]:
        """The global batch of ``iteration`` (the same on every rank, under every plan)."""
        return self.sampler.indices(iteration)

    def rank_indices(self, iteration: int) -> list[int]:
        """This rank's slice of the global batch of ``iteration``."""
        return self.sampler.indices(iteration, self.offset, self.num_rank_samples)

    def batch(self, iteration: int) -> Any:
        """This rank's collated batch of ``iteration``, without moving the loader."""
        idx = self.rank_indices(iteration)
        if not idx:
            return self._finish(self._empty_batch())
        return self._finish(self.collate_fn([self.dataset[i] for i in idx]))

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> "PlanLoader":
        return self

    def __next__(self) -> Any:
        if self.num_workers > 0 and self.num_rank_samples > 0:
            if self._workers is None:
                self._workers = iter(self._worker_loader())
            batch = self._finish(next(self._workers))
        else:
            batch = self.batch(self.iteration)
        self.iteration += 1
        return batch

    def _worker_loader(self) -> Any:
        from torch.utils.data import DataLoader

        sampler = _RankBatches(self.sampler, self.iteration, self.offset, self.num_rank_samples)
        kwargs: dict[str, Any] = {}
        if self.prefetch_factor is not None:
            kwargs["prefetch_factor"] = self.prefetch_factor
        return DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                          num_workers=self.num_workers, pin_memory=self.pin_memory, **kwargs)

    def _empty_batch(self) -> Any:
        if self._empty is None:  # the structure of one sample, with 0 rows
            first = self.sampler.indices(self.iteration, 0, 1)[0]
            self._empty = slice_batch(self.collate_fn([self.dataset[first]]), 0, 0)
        return self._empty

    def _finish(self, batch: Any) -> Any:
        return batch if self.device is None else move_to_device(batch, self.device, non_blocking=self.pin_memory)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """The position (next iteration) and seed, plus what defines the sample stream; JSON-safe."""
        s = self.sampler
        return {"iteration": self.iteration, "seed": s.seed, "global_batch_size": s.global_batch_size,
                "num_samples": s.num_samples, "shuffle": s.shuffle, "drop_last": s.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. The dataset length, global batch size, shuffle and
        drop_last must match (they define the stream); plan and world size may differ."""
        s = self.sampler
        for key, mine in (("global_batch_size", s.global_batch_size), ("num_samples", s.num_samples),
                          ("shuffle", s.shuffle), ("drop_last", s.drop_last)):
            if key in state and state[key] != mine:
                raise ValueError(f"saved loader state has {key}={state[key]!r} but this loader has {mine!r}; the "
                                 "sample stream would differ, so build the loader with the saved setting")
        if "iteration" not in state:
            raise ValueError("saved loader state lacks 'iteration'")
        s.reseed(int(state.get("seed", s.seed)))
        self.iteration = int(state["iteration"])
        self._empty = None
        self._workers = None


class _RankBatches:
    """Endless batch sampler of one rank's slices, from a given iteration (for ``DataLoader``)."""

    def __init__(self, sampler: GlobalBatchSampler, start: int, offset: int, length: int) -> None:
        self.sampler, self.start, self.offset, self.length = sampler, start, offset, length

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            yield self.sampler.indices(k, self.offset, self.length)
            k += 1
