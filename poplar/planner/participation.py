"""Which GPUs take part: every one, or a node or a device type left out, by predicted iteration
time (docs/design.md §5.3).

On a job that spans nodes a GPU across a slow link can cost the step more in communication than
it brings in compute (the paper measured V4A4 slower than V4A3 at ZeRO-3). So beside the plan on
every rank, the planner plans each subset that leaves out one whole node, or every GPU of one
device type, on the profile of the ranks that stay (``on_ranks``: their curves and memory, and
their links, ``LinkPricing.with_nodes``'s tiers), and keeps the fastest. The ranks left out get
rows ``RankPlan(0, 0, 0, shard_weight=0)``: the runtime leaves them out of the step (§3.12).

Rules:
- A job on one node keeps every GPU: its plans are those of a planner without this choice.
- The plan on every rank comes first within the plan's tie (``Plan.choice.plan_tie``): leaving
  GPUs idle must be predicted faster by more than the cost model's resolution.
- A subset's collectives are chosen as the whole job's are (flat, hierarchical over the nodes
  of the ranks that stay, secondary shards; ``collective_choice``); on one node they are flat.
- Subsets are planned only where they are plans the runtime can run and the request can take:
  ZeRO-1/2/3, not fp16 (its loss scale moves with steps a rank left out would not see),
  ``require_all_ranks=False``, shards, placements and collectives chosen or even (not given).

[Note: a subset's memory]
A rank's mbs was measured holding its share of the sharded state with every rank sharding it;
without the ranks left out, the ranks that stay hold all of it (in the measured proportions among
themselves), so each one's mbs shrinks by its extra state over the bytes a sample takes
(``shard_memory.mbs_at`` at weights 0 for the ranks left out). A subset where some rank then fits
no batch is not planned. The measured points past a rank's new mbs stay its curve there
(``points_past_mbs``), for shard weights that give it the room back.

[Note: a subset's exposure]
A profile's exposure (what compute did not hide of the collectives) was measured with every rank
in the step. A subset runs the same schedule, the same collectives in the same order beside the
same compute per step, on fewer ranks and on the links of its own nodes. It is priced as another
way of running that schedule is (``CommModel.priced_as``; Note: an exposure carried, in
``types/profiles.py``): the measured exposure carried from the serial seconds its collectives took
on every rank's links to those they take on the subset's (the cost model's formulas on each:
``CommModel.serial_micro_step_s`` and ``serial_iteration_s``). The formulas alone add every
collective to the compute and price a subset over what it runs, the more so the more compute
hides (ZeRO-3's prefetched gathers). On the emulated C-4+4 and A-4+4 (4-rank subsets, ZeRO-3 at
global batch 32 and 480, ZeRO-2 at 480; 40 rows in eight runs, docs/experiments.md, 2026-11-29
and 2026-11-30) the carried exposure, with each subset's compute from its own curve (Note: an mbs
between measured batches, ``planner/curves.py``), priced every subset -0.6 to +0.4 % of what it
ran, the formulas alone up to 7.5 % over. It is still an estimate the measurement did not see, so the tie favours every GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple, Sequence

from poplar.planner.cost_model import CommModel
from poplar.planner.fastest import Candidate
from poplar.planner.fastest import fastest as choose
from poplar.planner.shard_memory import knows_shard_memory, mbs_at, measured_shares, sharded_bytes
from poplar.types.plan_choice import SubsetRow
from poplar.types.plans import Plan, PlanError, RankPlan, shares_of
from poplar.types.profiles import Carry, CommProfile, Exposure, Links, Profile, RankProfile
from poplar.types.topology import Topology


class Subset(NamedTuple):
    """A set of ranks that take part, by name (``"all"``, ``"without node 1"``, ``"without A100"``)."""

    name: str
    keep: tuple[int, ...]


def subsets(profile: Profile) -> list[Subset]:
    """The sets of ranks worth planning: every rank first, then each node left out and each
    device type left out (each set once); every rank alone on one node, or under fp16."""
    everyone = Subset("all", tuple(range(profile.world_size)))
    topology = profile.comm.links.topology
    if topology is None or not topology.spans_nodes or profile.precision == "fp16":
        return [everyone]
    out, seen = [everyone], {everyone.keep}
    for k, node in enumerate(topology.nodes):
        keep = tuple(r for r in everyone.keep if r not in node)
        if keep not in seen:
            out.append(Subset(f"without node {k}", keep))
            seen.add(keep)
    types = sorted({r.device_type for r in profile.ranks})
    for dtype in types if len(types) > 1 else ():
        keep = tuple(r.rank for r in sorted(profile.ranks, key=lambda r: r.rank) if r.device_type != dtype)
        if keep not in seen:
            out.append(Subset(f"without {dtype}", keep))
            seen.add(keep)
    return out


def _holding_everything(profile: Profile, keep: list[int]) -> dict[int, RankProfile]:
    """The ranks ``keep`` (old numbers) as they are when they hold the whole sharded state among
    them (Note: a subset's memory): each one's mbs at its larger shard, the points past it moved
    to ``points_past_mbs``, its shard's bytes. A rank with no batch left is a ``PlanError``."""
    by_rank = {r.rank: r for r in profile.ranks}
    if profile.zero_stage < 1 or not knows_shard_memory(profile):
        return {r: by_rank[r] for r in keep}
    measured = measured_shares(profile)
    weights = [measured[r] if r in keep else 0.0 for r in range(profile.world_size)]
    limits, shares, total = mbs_at(profile, weights), shares_of(tuple(weights)), sharded_bytes(profile)
    out = {}
    for r in keep:
        row, mbs = by_rank[r], limits[r]
        if mbs < 1:
            raise PlanError(f"rank {r} ({row.device_type}) holds {100 * shares[r]:.0f}% of the sharded state without "
                            "the ranks left out, and then batch 1 does not fit it")
        out[r] = replace(row.at_mbs(mbs), shard_bytes=int(round(shares[r] * total)))
    return out


def on_ranks(profile: Profile, keep: Sequence[int]) -> Profile:
    """The profile of the ranks ``keep`` alone, renumbered 0..k-1 in order: their curves and
    memory as they are holding the whole sharded state (Note: a subset's memory), the links of
    the nodes they are on (each node's link, the cross-node link if they span nodes), and the
    measured exposure carried to those links (Note: a subset's exposure)."""
    keep = sorted(keep)
    held = _holding_everything(profile, keep)
    ranks = [replace(held[old], rank=new) for new, old in enumerate(keep)]
    links = profile.comm.links
    topology = links.topology
    if topology is None or not topology.spans_nodes:
        sub_links = Links(links.bandwidth_bytes_per_s, links.latency_s, links.backend)
    else:
        nodes = [k for k, node in enumerate(topology.nodes) if any(r in keep for r in node)]
        sizes = [sum(1 for r in topology.nodes[k] if r in keep) for k in nodes]
        sub_links = Links.tiered(Topology.of_sizes(sizes), [links.intra[k] for k in nodes],
                                 links.cross if len(nodes) > 1 else None, links.backend)
    comm = CommProfile(sub_links, profile.comm.collectives_stage, [list(x) for x in profile.comm.micro_step],
                       [list(x) for x in profile.comm.iteration], Exposure(), profile.comm.collectives)
    pick = (lambda values: None if values is None else [values[r] for r in keep])
    sub = replace(profile, world_size=len(keep), ranks=ranks, comm=comm, shard_weights=pick(profile.shard_weights),
                  offloads=pick(profile.offloads))
    return replace(sub, comm=replace(comm, exposure=_carried_exposure(profile, sub)))


def _carried_exposure(profile: Profile, sub: Profile) -> Exposure:
    """``profile``'s measured exposure carried to ``sub``'s links (Note: a subset's exposure), with
    the leaders of ``sub``'s device types; none where nothing was measured."""
    stage, x, way = profile.comm.collectives_stage, profile.comm.exposure, profile.comm.collectives
    if stage is None or (x.micro_step_s is None and x.iteration_s is None):
        return Exposure()
    whole = CommModel.from_profile(replace(profile, comm=replace(profile.comm, exposure=Exposure())), way)
    part = CommModel.from_profile(sub, way)
    carried = x.carried(Carry.between(part.serial_micro_step_s(stage), whole.serial_micro_step_s(stage)),
                        Carry.between(part.serial_iteration_s(stage), whole.serial_iteration_s(stage)))
    return carried.only_leaders(sorted({r.device_type for r in sub.ranks}))


def widened(found: Plan, keep: Sequence[int], profile: Profile) -> Plan:
    """A plan of the ranks ``keep`` as a plan of every rank: the others left out of the step."""
    rows: list[RankPlan] = []
    mine = dict(zip(sorted(keep), found.ranks))
    types = {r.rank: r.device_type for r in profile.ranks}
    for rank in range(profile.world_size):
        rows.append(mine[rank] if rank in mine else RankPlan(0, 0, 0, device_type=types[rank], shard_weight=0))
    return replace(found, ranks=rows, meta=dict(found.meta))


def fastest(profile: Profile, everyone: Plan, planned: Callable[[Profile], Plan]) -> Plan:
    """``everyone`` (the plan on every rank) or the plan of a subset (``planned`` on its
    profile), whichever is predicted fastest, every rank first within the tie (its own: leaving
    GPUs idle must win by more than the cost model's resolution; Note: a subset's exposure); the
    plan records each subset planned (name, ranks left out, predicted seconds, chosen)."""
    subsets_ = subsets(profile)
    if len(subsets_) == 1:
        return everyone
    found = [Candidate(SubsetRow("all", (), everyone.predicted_iteration_s), everyone, preference=0)]
    for subset in subsets_[1:]:
        left_out = tuple(r for r in range(profile.world_size) if r not in subset.keep)
        try:
            plan = widened(planned(on_ranks(profile, subset.keep)), subset.keep, profile)
        except PlanError as e:
            found.append(Candidate(SubsetRow(subset.name, left_out, reason=str(e))))
            continue
        found.append(Candidate(SubsetRow(subset.name, left_out, plan.predicted_iteration_s), plan, preference=1))
    kept = choose(found, everyone.choice.plan_tie or 0.0)
    assert kept.plan is not None
    rows = tuple(replace(c.row, chosen=c.row.subset == kept.row.subset) for c in found)
    return replace(kept.plan, choice=replace(kept.plan.choice, participation_candidates=rows))
