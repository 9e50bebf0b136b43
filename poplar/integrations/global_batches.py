"""The global batches of a loop of the user's own, cut per rank as ``PlanLoader`` cuts them.

Rule. Global batch i is the next ``global_batch_size`` samples in the order of the user's own
sampler (a ``SequentialSampler``: dataset order; a ``RandomSampler``: its permutation, drawn
when an epoch starts); a last partial global batch of an epoch is dropped (a step is always the
whole global batch). The order does not depend on the plan or the world size. Rank r trains on
the contiguous slice of length n_r starting at the sum of the rows before it (``Plan.sample_offsets``).

Every rank iterates its own copy of the sampler, so the sampler must give the same order on every
rank: a ``SequentialSampler``, or a ``RandomSampler`` drawn after the same seed on every rank
(Lightning's ``seed_everything``, or a ``generator`` with a fixed seed).

Resuming. ``RankBatchSampler.state_dict()`` holds the global batches this epoch has trained
(``trained``, counted by the caller after each step, not by what a prefetching loader has drawn);
after ``load_state_dict`` the next epoch started skips that many global batches once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler, default_collate

from poplar.zero.batches import slice_batch
from poplar.types.plans import Plan


class RankBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices of each global batch drawn from ``sampler``'s order.
    A rank whose row is empty gets the first index of the global batch, which ``EmptyRowCollate``
    turns into a batch of 0 samples (the structure of one sample)."""

    def __init__(self, sampler: Iterable[int], plan: Plan, rank: int) -> None:
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {plan.world_size} rows")
        self.sampler, self.global_batch_size = sampler, plan.global_batch_size
        self.offset = plan.sample_offsets()[rank]
        self.length = plan.ranks[rank].num_samples
        self.trained = 0  # global batches of the current epoch trained so far (the caller counts them)
        self._skip = 0  # global batches to skip once, at the start of the next epoch (a resume)

    def __len__(self) -> int:
        return len(self.sampler) // self.global_batch_size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0
        self.trained = skip
        batch: list[int] = []
        drawn = 0
        for index in self.sampler:
            batch.append(int(index))
            if len(batch) < self.global_batch_size:
                continue
            drawn += 1
            if drawn > skip:
                part = batch[self.offset:self.offset + self.length]
                yield part if part else batch[:1]
            batch = []

    def state_dict(self) -> dict[str, Any]:
        return {"trained": self.trained, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch_size") != self.global_batch_size:
            raise ValueError(f"the checkpoint's data position is in global batches of {state.get('global_batch_size')} "
                             f"samples but this run's are {self.global_batch_size}; keep the global batch size")
        trained = int(state["trained"])
        self._skip = trained if trained < len(self) else 0  # a finished epoch: the next starts afresh


class EmptyRowCollate:
    """The user's collate function; for a rank with no samples in the plan, the batch is cut to 0 rows."""

    def __init__(self, collate_fn: Callable[[list], Any] | None, empty: bool) -> None:
        self.collate_fn, self.empty = collate_fn or default_collate, empty

    def __call__(self, samples: list) -> Any:
        batch = self.collate_fn(samples)
        return slice_batch(batch, 0, 0) if self.empty else batch


class RankDataLoader(DataLoader):
    """A ``DataLoader`` over the user's dataset that yields this rank's slice of every global batch.
    It is stateful (``state_dict`` / ``load_state_dict``): a loop that saves loader states resumes
    mid-epoch at the next global batch."""

    batch_sampler: RankBatchSampler

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)


def rank_dataloader(loader: DataLoader, plan: Plan, rank: int) -> RankDataLoader:
    """``loader``'s dataset, sampler order, collate function and workers, cut into this rank's slices
    of ``plan``'s global batches. ``loader`` must be map-style and draw single samples (a ``sampler``,
    not a ``batch_sampler`` of its own)."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"the training data must be a torch DataLoader, got {type(loader).__name__}")
    if loader.batch_size is None and loader.batch_sampler is not None:
        raise ValueError("the training DataLoader has a batch_sampler of its own; give it a sampler (or shuffle=) "
                         "instead: Poplar cuts the global batches from the sampler's order")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise ValueError("the training DataLoader reads an IterableDataset; Poplar needs a map-style dataset "
                         "(__len__ and __getitem__) to cut global batches per rank")
    if len(loader.sampler) < plan.global_batch_size:  # type: ignore[arg-type]
        raise ValueError(f"the training data holds {len(loader.sampler)} samples, fewer than one global batch "  # type: ignore[arg-type]
                         f"of {plan.global_batch_size}; use a smaller global batch or more data")
    sampler = RankBatchSampler(loader.sampler, plan, rank)
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    return RankDataLoader(loader.dataset, batch_sampler=sampler,
                          collate_fn=EmptyRowCollate(loader.collate_fn, sampler.length == 0),
                          num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                          worker_init_fn=loader.worker_init_fn, **kwargs)
