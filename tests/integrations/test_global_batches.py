"""The per-rank cut of a user's DataLoader: global batch i is the next gbs samples of the user's
sampler, rank r takes its plan row's slice (PlanLoader's cut), an empty row gets a 0-sample batch,
and a resume skips the global batches already trained."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from poplar.integrations.global_batches import rank_dataloader
from tests import toy

ROWS = ((2, 1, 1), (3, 2, 0), (1, 0, 0), (1, 1, 0))  # 3 + 6 + 0 + 1 = 10; rank 2 has no samples


def _data(n: int = 33) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


def _batches(loader: DataLoader) -> list[list[int]]:
    return [b[0].tolist() for b in loader]


def test_each_rank_gets_its_slice_of_consecutive_global_batches() -> None:
    plan = toy.plan_of(*ROWS)
    cuts = [_batches(rank_dataloader(DataLoader(_data(), batch_size=7), plan, r)) for r in range(4)]
    assert all(len(c) == 3 for c in cuts)  # 33 // 10 global batches; the partial one is dropped
    for i in range(3):
        assert cuts[0][i] + cuts[1][i] + cuts[3][i] == list(range(10 * i, 10 * i + 10))
        assert cuts[2][i] == []  # an empty row: a batch of 0 samples with the structure of one
    loader = rank_dataloader(DataLoader(_data()), plan, 2)
    x, y = next(iter(loader))
    assert x.shape == (0,) and y.shape == (0,)


def test_a_random_sampler_gives_every_rank_the_same_permutation() -> None:
    plan = toy.plan_of(*ROWS)
    cuts = []
    for r in range(4):
        sampler = RandomSampler(_data(), generator=torch.Generator().manual_seed(4))
        cuts.append(_batches(rank_dataloader(DataLoader(_data(), sampler=sampler), plan, r)))
    order = torch.randperm(33, generator=torch.Generator().manual_seed(4)).tolist()
    assert [x for i in range(3) for r in (0, 1, 3) for x in cuts[r][i]] == order[:30]


def test_a_resume_skips_the_trained_global_batches_once() -> None:
    plan = toy.plan_of(*ROWS)
    loader = rank_dataloader(DataLoader(_data()), plan, 1)
    first = iter(loader)
    next(first)
    loader.batch_sampler.trained += 1  # the training loop counts a step
    state = loader.state_dict()
    again = rank_dataloader(DataLoader(_data()), plan, 1)
    again.load_state_dict(state)
    assert _batches(again) == [list(range(13, 19)), list(range(23, 29))]
    assert len(_batches(again)) == 3  # the next epoch starts from its beginning
    with pytest.raises(ValueError, match="global batch size"):
        rank_dataloader(DataLoader(_data()), toy.plan_of((2, 1, 0)), 0).load_state_dict(state)


def test_bad_loaders_are_refused_with_the_fix() -> None:
    plan = toy.plan_of(*ROWS)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        rank_dataloader(DataLoader(_data(7)), plan, 0)
    with pytest.raises(ValueError, match="batch_sampler of its own"):
        rank_dataloader(DataLoader(_data(), batch_sampler=[[0, 1]]), plan, 0)
    with pytest.raises(TypeError, match="DataLoader"):
        rank_dataloader(_data(), plan, 0)
