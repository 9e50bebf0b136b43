"""What ZeRO-3 communicates, read from the comm ledger: per micro-step one all-gather per block in
forward, one in backward, one reduce-scatter per block — on every rank, including a rank with
no samples and a rank with fewer micro-steps; evaluation gathers each block once."""

from __future__ import annotations

import pytest

from collections import Counter

import torch

from poplar.engine import PoplarEngine
from tests.zero.test_stage3_common import part_results, tiny_lm
from tests.toy import global_batch, loss_fn, make_optimizer, plan_of, rank_slice

# micro-step counts 4, 0, 2
PLAN = plan_of((3, 3, 1), (0, 0, 0), (2, 2, 0))
ITERATIONS = 3


def worker(rank: int, world: int) -> tuple[list, dict, int]:
    model = tiny_lm()
    engine = PoplarEngine(model, make_optimizer(model, "adamw"), zero_stage=3, plan=PLAN, max_grad_norm=1.0)
    for it in range(ITERATIONS):
        engine.train_step(rank_slice(global_batch(it, PLAN.global_batch_size), PLAN, rank), loss_fn)
    with torch.no_grad():  # evaluation: every rank together, each on its own batch size
        engine.module(global_batch(50, 1 + rank)[:, :-1])
    records = [(r.op, r.phase, r.iteration, r.micro_step, r.tag, r.bytes) for r in engine.comm_ledger.records]
    blocks = {f"block{b.index}": b.gathered_nbytes for b in engine.stage.blocks}
    return records, blocks, engine.stage.root.index


@pytest.mark.multiprocess
def test_stage3_collectives_per_micro_step_on_every_rank() -> None:
    results = part_results(3, "ledger")
    for records, blocks, root in results:
        layers = {t for t in blocks if t != f"block{root}"}
        assert len(layers) == 3
        for it in range(ITERATIONS):
            for k in range(PLAN.max_micro_steps):
                got = Counter((r[0], r[1], r[4]) for r in records if r[2] == it and r[3] == k and r[1] != "eval")
                want = Counter({("all_gather", "forward", t): 1 for t in blocks})
                want.update({("all_gather", "backward", t): 1 for t in layers})  # the root stays gathered
                want.update({("reduce_scatter", "backward", t): 1 for t in blocks})
                assert got == want, (it, k, got)
        for r in records:
            if r[0] == "all_gather" and r[4] in blocks:
                assert r[5] == blocks[r[4]]  # the whole block in one collective (two param groups inside)
        evals = Counter((r[0], r[4]) for r in records if r[1] == "eval")
        assert evals == Counter({("all_gather", t): 1 for t in blocks})
    # the same collectives, with the same sizes, on every rank (a mismatch would hang or corrupt)
    counts = [Counter(records) for records, _, _ in results]
    assert counts[0] == counts[1] == counts[2]
