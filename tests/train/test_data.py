"""The sample stream: every rank gets its contiguous slice of the same global batch under any
plan; epochs, resume, empty ranks, workers; the text datasets and the shipped corpus."""

from __future__ import annotations

import random

import pytest
import torch

from poplar.train.data import GlobalBatchSampler, LoaderOptions, PlanLoader
from poplar.engine import PoplarEngine
from poplar.types.plans import Plan, PlanError, RankPlan
from poplar.workloads.text import (IGNORE_INDEX, MASK, VOCAB_SIZE, ByteTokenizer, MaskedTextBlocks, TextBlocks,
                              default_corpus_path, load_text)


class Indices(torch.utils.data.Dataset):
    """Sample i is (i, 2i): the batch says which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.tensor([i, 2 * i])


def random_plan(rng: random.Random, gbs: int, world: int) -> Plan:
    """A random plan with exactly gbs samples, some ranks possibly empty."""
    cuts = sorted(rng.randint(0, gbs) for _ in range(world - 1))
    shares = [b - a for a, b in zip([0] + cuts, cuts + [gbs])]
    rows = []
    for n in shares:
        if n == 0:
            rows.append(RankPlan(rng.choice([0, 3]), 0, 0))
            continue
        b = rng.randint(1, n)
        rows.append(RankPlan(b, n // b, n % b))
    return Plan(rows)


def rank_batches(dataset, plan: Plan, iteration: int, **kw) -> list[list[int]]:
    out = []
    for r in range(plan.world_size):
        loader = PlanLoader(dataset, plan, r, LoaderOptions(**kw), start_iteration=iteration)
        ids, pairs = next(loader)
        assert ids.shape == (plan.ranks[r].num_samples,) and pairs.shape == (plan.ranks[r].num_samples, 2)
        assert torch.equal(pairs[:, 1], 2 * ids)
        out.append(ids.tolist())
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_under_random_plans(drop_last: bool) -> None:
    rng = random.Random(0)
    ds = Indices(53)
    empty_ranks = 0
    for trial in range(40):
        gbs = rng.randint(1, 40)
        world = rng.randint(1, 6)
        plan = random_plan(rng, gbs, world)
        empty_ranks += sum(r.num_samples == 0 for r in plan.ranks)
        iteration = rng.randint(0, 12)
        sampler = GlobalBatchSampler(len(ds), gbs, seed=7, drop_last=drop_last)
        parts = rank_batches(ds, plan, iteration, seed=7, drop_last=drop_last)
        # contiguous slices, in rank order, of one global batch that no plan changes
        assert sum(parts, []) == sampler.indices(iteration), (trial, plan.table())
        for r, part in enumerate(parts):
            start = plan.sample_offsets()[r]
            assert part == sampler.indices(iteration)[start:start + plan.ranks[r].num_samples]
        if drop_last:
            assert len(set(sum(parts, []))) == gbs  # distinct samples
        other = random_plan(rng, gbs, rng.randint(1, 6))
        assert sum(rank_batches(ds, other, iteration, seed=7, drop_last=drop_last), []) == sum(parts, [])
    assert empty_ranks >= 5  # the plans did include ranks with no samples


def test_epochs_drop_last() -> None:
    s = GlobalBatchSampler(10, 3, seed=5)
    assert s.iterations_per_epoch == 3
    epoch0 = sum((s.indices(k) for k in range(3)), [])
    epoch1 = sum((s.indices(k) for k in range(3, 6)), [])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # one sample skipped per epoch
    assert epoch0 == s.permutation(0)[:9].tolist() and epoch1 == s.permutation(1)[:9].tolist()
    assert s.permutation(0).tolist() != s.permutation(1).tolist()  # a new order every epoch
    assert torch.equal(s.permutation(1), torch.randperm(10, generator=torch.Generator().manual_seed(6)))
    assert [s.epoch_of(k) for k in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert GlobalBatchSampler(10, 3, seed=5).indices(4) == s.indices(4)  # a function of the arguments
    assert GlobalBatchSampler(10, 3, seed=6).indices(0) != s.indices(0)


def test_epochs_continue_without_drop_last() -> None:
    s = GlobalBatchSampler(10, 4, seed=1, drop_last=False)
    stream = sum((s.indices(k) for k in range(5)), [])  # 20 samples = exactly two epochs
    assert stream[:10] == s.permutation(0).tolist() and stream[10:] == s.permutation(1).tolist()
    assert s.indices(2) == s.permutation(0)[8:].tolist() + s.permutation(1)[:2].tolist()
    big = GlobalBatchSampler(3, 7, shuffle=False, drop_last=False)  # gbs > dataset
    assert big.indices(0) == [0, 1, 2, 0, 1, 2, 0] and big.indices(1) == [1, 2, 0, 1, 2, 0, 1]


def test_sampler_refuses_impossible_batches() -> None:
    with pytest.raises(ValueError, match="drop_last=False"):
        GlobalBatchSampler(5, 6)
    with pytest.raises(ValueError, match="at least one sample"):
        GlobalBatchSampler(0, 1)
    with pytest.raises(ValueError, match="global_batch_size"):
        GlobalBatchSampler(5, 0)


def test_resume_with_another_plan_continues_the_stream() -> None:
    ds = Indices(40)
    plan_a = Plan([RankPlan(2, 2, 1), RankPlan(3, 1, 0)])  # 5 + 3
    plan_b = Plan([RankPlan(1, 1, 0), RankPlan(2, 3, 0), RankPlan(0, 0, 0), RankPlan(1, 1, 0)])  # 1 + 6 + 0 + 1
    straight = [sum((next(PlanLoader(ds, plan_a, r, LoaderOptions(seed=3), start_iteration=k))[0].tolist()
                     for r in range(2)), []) for k in range(9)]
    loaders = [PlanLoader(ds, plan_a, r, LoaderOptions(seed=3)) for r in range(2)]
    for _ in range(4):
        for loader in loaders:
            next(loader)
    state = loaders[0].state_dict()
    assert state["iteration"] == 4 and state["seed"] == 3
    resumed = [PlanLoader(ds, plan_b, r, LoaderOptions(seed=999)) for r in range(4)]  # the seed comes from the state
    for loader in resumed:
        loader.load_state_dict(state)
    for k in range(4, 9):  # crosses into epoch 1 at iteration 5
        assert sum((next(loader)[0].tolist() for loader in resumed), []) == straight[k]
    with pytest.raises(ValueError, match="global_batch_size"):
        PlanLoader(ds, Plan([RankPlan(3, 1, 0)]), 0).load_state_dict(state)


def test_empty_rank_and_set_plan() -> None:
    ds = Indices(20)
    plan = Plan([RankPlan(2, 2, 0), RankPlan(0, 0, 0)])
    ids, pairs = next(PlanLoader(ds, plan, 1))
    assert ids.shape == (0,) and pairs.shape == (0, 2) and pairs.dtype == torch.int64
    loader = PlanLoader(ds, plan, 0, LoaderOptions(seed=2))
    first = next(loader)[0].tolist()
    loader.set_plan(Plan([RankPlan(1, 1, 0), RankPlan(1, 3, 0)]), rank=1)
    assert next(loader)[0].tolist() == loader.sampler.indices(1)[1:]
    assert first == loader.sampler.indices(0)
    with pytest.raises(PlanError, match="global batch"):
        loader.set_plan(Plan([RankPlan(5, 1, 0)]), rank=0)


def test_collate_fn_device_and_batch_lookup() -> None:
    ds = Indices(12)
    plan = Plan([RankPlan(3, 1, 1)])
    loader = PlanLoader(ds, plan, 0, LoaderOptions(collate_fn=lambda samples: [i for i, _ in samples]), device="cpu")
    assert loader.batch(2) == loader.rank_indices(2) == loader.global_indices(2)
    assert loader.iteration == 0 and next(loader) == loader.global_indices(0) and loader.iteration == 1


@pytest.mark.multiprocess
def test_workers_give_the_same_batches() -> None:
    ds = Indices(30)
    plan = Plan([RankPlan(2, 1, 1), RankPlan(4, 1, 0)])
    plain = PlanLoader(ds, plan, 1, LoaderOptions(seed=4))
    workers = PlanLoader(ds, plan, 1, LoaderOptions(seed=4, num_workers=1))
    for _ in range(3):
        assert torch.equal(next(plain)[1], next(workers)[1])
    state = workers.state_dict()  # the position is that of the batches yielded, not prefetched
    assert state["iteration"] == 3
    again = PlanLoader(ds, plan, 1, LoaderOptions(seed=4, num_workers=1))
    again.load_state_dict(state)
    assert torch.equal(next(again)[1], next(plain)[1])


def test_loader_feeds_the_engine() -> None:
    """World of one: the loader's batch is exactly what train_step expects."""
    ds = TextBlocks(seq_len=8)
    plan = Plan([RankPlan(3, 2, 1)])
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB_SIZE, 8), torch.nn.Linear(8, VOCAB_SIZE))
    engine = PoplarEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=1, plan=plan)
    loader = PlanLoader.for_engine(ds, engine)
    assert loader.device == torch.device("cpu") and loader.iteration == 0

    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))

    losses = [engine.train_step(batch, loss_fn) for _, batch in zip(range(3), loader)]
    assert loader.iteration == 3 and all(5.0 < x < 6.0 for x in losses)


# ---------------------------------------------------------------------------- text
def test_corpus_is_shipped() -> None:
    path = default_corpus_path()
    text = load_text()
    assert path.name == "corpus.txt" and path.parent.name == "data"
    assert 20_000 <= len(text.encode()) <= 100_000
    assert text.isascii() and text.count("\n\n") > 50


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids.dtype == torch.int64
    assert tok.decode(ids) == "héllo" and tok.vocab_size == VOCAB_SIZE == 260
    assert tok.encode("").numel() == 0


def test_text_blocks() -> None:
    ds = TextBlocks(seq_len=32)
    tokens = ByteTokenizer().encode(load_text())
    assert len(ds) == (len(tokens) - 1) // 32
    assert torch.equal(ds[1], tokens[32:65]) and ds[1][0] == ds[0][-1]  # blocks overlap by one token
    train, val = TextBlocks(seq_len=32, split="train"), TextBlocks(seq_len=32, split="val")
    assert len(train) + len(val) == len(ds) and torch.equal(val[0], ds[len(train)])
    with pytest.raises(ValueError, match="fewer than one block"):
        TextBlocks(text="abc", seq_len=8)


def test_masked_blocks() -> None:
    ds = MaskedTextBlocks(seq_len=64, seed=1)
    again = MaskedTextBlocks(seq_len=64, seed=1)
    masked = 0
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(item["input_ids"], again[i]["input_ids"])  # fixed by (seed, index)
        labelled = item["labels"] != IGNORE_INDEX
        assert labelled.any()
        original = ds.tokens[i * 64:(i + 1) * 64]
        assert torch.equal(item["labels"][labelled], original[labelled])
        assert torch.equal(item["input_ids"][~labelled], original[~labelled])
        masked += int(labelled.sum())
    rate = masked / (64 * len(ds))
    assert 0.12 < rate < 0.18
    assert (ds[0]["input_ids"] == MASK).any() or (ds[1]["input_ids"] == MASK).any()
    assert not torch.equal(MaskedTextBlocks(seq_len=64, seed=2)[0]["labels"], ds[0]["labels"])
