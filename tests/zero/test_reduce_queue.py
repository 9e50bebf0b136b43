"""``poplar.zero.reduce_queue``: the bounded queue of reduce-scatters in flight shared by ZeRO-2
and ZeRO-3, with fake collectives (no process group), and the handles the stages push to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar.comm import Communicator
from poplar.zero.blocks import BlockState, GatherHandle, GradState, ShardedBlock
from poplar.zero.flat import FlatUnit
from poplar.zero.reduce_queue import ReduceHandle, ReduceQueue
from poplar.zero.shard_layout import Shards


class FakeWork:
    """A collective in flight: ``wait()`` logs its id."""

    def __init__(self, log: list[int], ident: int) -> None:
        self.log, self.ident = log, ident

    def wait(self) -> None:
        assert self.ident not in self.log, f"reduce {self.ident} waited twice"
        self.log.append(self.ident)


class Accounting:
    """The stage's ``_hold``/``_release`` bookkeeping."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.released: list[int] = []

    def hold(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def release(self, nbytes: int) -> None:
        self.now -= nbytes
        self.released.append(nbytes)


def handle(log: list[int], i: int, grad: torch.Tensor, held: int = 0) -> ReduceHandle:
    out = torch.full_like(grad, float(10 ** i))
    return ReduceHandle(FakeWork(log, i), out, torch.empty(0), grad, held or 8 * (i + 1))


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_push_keeps_at_most_the_bound_in_flight_and_completes_oldest_first(bound: int) -> None:
    log: list[int] = []
    acc = Accounting()
    q = ReduceQueue(bound, acc.release)
    grad = torch.zeros(2, dtype=torch.float64)
    for i in range(6):
        q.push(handle(log, i, grad))
        assert len(q) == min(i + 1, bound)
        assert log == list(range(max(0, i + 1 - bound)))  # exactly the oldest ones, in issue order
    q.drain()
    assert len(q) == 0 and log == list(range(6))
    assert grad.tolist() == [111111.0] * 2  # every output added once into the gradient
    assert acc.released == [8 * (i + 1) for i in range(6)]  # each handle's bytes, in completion order
    q.drain()  # nothing left: no second wait, no second release
    assert log == list(range(6)) and len(acc.released) == 6


def test_completion_adds_output_only_after_the_wait() -> None:
    log: list[int] = []
    grad = torch.zeros(3)
    q = ReduceQueue(1, lambda n: None)
    q.push(handle(log, 0, grad))
    assert log == [] and grad.tolist() == [0.0, 0.0, 0.0]  # still in flight
    q.push(handle(log, 1, grad))
    assert log == [0] and grad.tolist() == [1.0, 1.0, 1.0]


def test_byte_accounting_peak_follows_the_bound() -> None:
    """As the stages do: hold a reduce's bytes before pushing it; the queue releases them."""
    for bound, peak in [(0, 100), (1, 200), (2, 300)]:
        acc = Accounting()
        q = ReduceQueue(bound, acc.release)
        for i in range(5):
            acc.hold(100)
            q.push(handle([], i, torch.zeros(1), held=100))
            assert acc.now == 100 * min(i + 1, bound)
        q.drain()
        assert acc.now == 0 and acc.peak == peak, bound


def test_world_of_one_handle_has_no_work() -> None:
    grad = torch.ones(2)
    released: list[int] = []
    q = ReduceQueue(1, released.append)
    q.push(ReduceHandle(None, torch.full((2,), 2.0), torch.empty(0), grad, 16))
    q.drain()
    assert grad.tolist() == [3.0, 3.0] and released == [16]


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        ReduceQueue(-1, lambda n: None)


# ------------------------------------------------------------------ the ZeRO-3 block's typed handles
def block(group_sizes: list[list[int]]) -> tuple[ShardedBlock, list[torch.Tensor]]:
    """A block of one unit per group, in a world of one (collectives are local copies), and its
    parameters' values."""
    torch.manual_seed(0)
    units = [FlatUnit([nn.Parameter(torch.randn(n)) for n in sizes], [f"g{gi}p{i}" for i in range(len(sizes))],
                      gi, Shards.even(1), 0, gi) for gi, sizes in enumerate(group_sizes)]
    values = [p.detach().clone() for u in units for p in u.params]
    return ShardedBlock(1, "blk", nn.Identity(), units), values


@pytest.mark.parametrize("groups", [[[3, 2]], [[3], [4]]])
def test_block_reduce_handle_holds_its_bytes_and_lands_in_the_shard_gradient(groups: list[list[int]]) -> None:
    b, _ = block(groups)
    comm = Communicator()
    flats = [torch.arange(u.padded_numel, dtype=torch.float32) + 1 for u in b.units]
    h = b.start_reduce(comm, flats, None)
    assert isinstance(h, ReduceHandle) and h.grad is b.shard_grad
    assert h.held_bytes == b.shard_numel * b.element_size + b.grad_nbytes
    released: list[int] = []
    q = ReduceQueue(0, released.append)
    q.push(h)
    assert released == [h.held_bytes]
    assert torch.equal(b.shard_grad, torch.cat(flats))  # one rank: the shard is the whole gradient
    zeros = torch.zeros(b.full_numel)
    h = b.start_reduce(comm, None, zeros)  # no gradient: zeros, nothing but the output held
    assert h.held_bytes == b.shard_numel * b.element_size
    q.push(h)
    assert torch.equal(b.shard_grad, torch.cat(flats))


@pytest.mark.parametrize("groups", [[[3, 2]], [[3], [4]]])
def test_block_gather_handle_and_states(groups: list[list[int]]) -> None:
    b, values = block(groups)
    assert b.state is BlockState.RELEASED and all(p.numel() == 0 for p in b.params)
    h = b.start_gather(Communicator(), async_op=True)
    assert isinstance(h, GatherHandle) and b.state is BlockState.GATHERED
    assert (h.staged is None) == (len(groups) == 1)  # several units gather through a staging buffer
    assert h.staged_nbytes == (0 if h.staged is None else b.shard_numel * b.element_size)
    with pytest.raises(AssertionError, match="gathered twice"):
        b.start_gather(Communicator(), async_op=True)
    b.finish_gather(h)
    assert all(torch.equal(p, v) for p, v in zip(b.params, values))
    b.free()
    assert b.state is BlockState.RELEASED and all(p.numel() == 0 for p in b.params)
    assert b.grad_state is GradState.ACCUMULATING
