"""``poplar simulate --nodes``: a cluster as nodes with their links, and whether its last node is
worth adding.

    poplar simulate --cluster C8.json --gbs 256 --stage 3 --nodes 4,4 --intra-gbps 16 --inter-gbps 100gbit

The cluster's ranks (in its file's order) are grouped into nodes of the sizes given; each node
has its own link (``--intra-gbps``: one value for every node, or one per node) and the nodes share
the cross-node link (``--inter-gbps``). Bandwidths are in GB/s, as the cluster files'
``bandwidth_gbps``; a value ending in ``gbit`` is in Gbit/s (100 Gbit/s InfiniBand: ``100gbit``,
12.5 GB/s). The planner prices each collective on the links it crosses (``planner.link_pricing``)
and the table compares, for the whole cluster and for it without its last node, the predicted
iteration and throughput with flat collectives, hierarchical ones and, at ZeRO-3, hierarchical
ones with node-local secondary shards, and the way the planner chooses (which may leave a node or
a device type out of the step where that is predicted faster: ``planner.participation``).
``--allow-lossy`` adds, per row, what quantized collectives (lossy) would be predicted to take:
each option's iteration (int8 weights at ZeRO-3, int8 gradients at ZeRO-2/3, both) beside exact,
and the one the planner would keep with ``allow_lossy`` (``planner.compression_choice``); the
verdict on the last node then weighs the lossy plans too. Ranks a plan leaves out are named with
the reason: the compute they would take off the others against the time they would add on the
links.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from poplar.emulation.cluster import ClusterSpec
from poplar.emulation.synthetic import ModelSpec, synthetic_profile
from poplar.planner.collective_choice import ORDER
from poplar.types.route import Collectives
from poplar.planner.planning import CollectivesRequest, plan
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Links, LinkSpeed, Profile
from poplar.types.topology import Topology

GBIT = "gbit"


def add_node_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("nodes and links (with --cluster and a stage 0-3): is the last node worth adding?")
    g.add_argument("--nodes", default=None, metavar="L0,L1,...",
                   help="ranks per node, in the cluster's rank order (e.g. 4,4); the last node is the one asked about")
    g.add_argument("--intra-gbps", default=None, metavar="BW[,BW...]",
                   help="each node's link, GB/s (or e.g. 600gbit): one for every node or one per node "
                        "(default: the cluster's bandwidth_gbps)")
    g.add_argument("--inter-gbps", default=None, metavar="BW",
                   help="the link between nodes, GB/s, or Gbit/s with a gbit suffix (100gbit = 12.5 GB/s); "
                        "required with --nodes of more than one node")
    g.add_argument("--intra-latency-us", type=float, default=None, metavar="US",
                   help="each node's link latency (default: the cluster's latency_us)")
    g.add_argument("--inter-latency-us", type=float, default=None, metavar="US",
                   help="the cross-node latency (default: the cluster's latency_us)")
    g.add_argument("--allow-lossy", action="store_true",
                   help="also price quantized collectives across nodes (int8 weights / gradients: lossy) and say "
                        "which the planner would choose with allow_lossy")


def bandwidth(text: str, flag: str) -> float:
    """Bytes per second of a ``--*-gbps`` value: GB/s, or Gbit/s with the ``gbit`` suffix."""
    value = text.strip().lower()
    scale = 1e9 / 8 if value.endswith(GBIT) else 1e9
    try:
        out = float(value[:-len(GBIT)] if value.endswith(GBIT) else value) * scale
    except ValueError:
        out = -1.0
    if not out > 0:
        raise ValueError(f"{flag} {text!r}: give a bandwidth > 0 in GB/s (12.5) or Gbit/s (100gbit)")
    return out


@dataclass(frozen=True)
class NodeLinks:
    """The nodes and links a user declared for a cluster."""

    topology: Topology
    intra: tuple[LinkSpeed, ...]
    cross: LinkSpeed | None

    @classmethod
    def from_args(cls, args: argparse.Namespace, spec: ClusterSpec) -> "NodeLinks":
        try:
            sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1 or sum(sizes) != spec.world_size:
            raise ValueError(f"--nodes {args.nodes!r}: give the ranks of each node, e.g. 4,4, adding up to the "
                             f"cluster's {spec.world_size} ranks ({spec.describe()})")
        intra_latency = (spec.latency_us if args.intra_latency_us is None else args.intra_latency_us) * 1e-6
        inter_latency = (spec.latency_us if args.inter_latency_us is None else args.inter_latency_us) * 1e-6
        given = [bandwidth(x, "--intra-gbps") for x in (args.intra_gbps or str(spec.bandwidth_gbps)).split(",")]
        if len(given) not in (1, len(sizes)):
            raise ValueError(f"--intra-gbps {args.intra_gbps!r}: give one bandwidth for every node or one per node "
                             f"({len(sizes)})")
        intra = tuple(LinkSpeed(bw, intra_latency) for bw in (given * len(sizes) if len(given) == 1 else given))
        if len(sizes) > 1 and args.inter_gbps is None:
            raise ValueError("--nodes of more than one node needs the link between them: --inter-gbps, e.g. 12.5 "
                             "(GB/s) or 100gbit")
        cross = None if len(sizes) == 1 else LinkSpeed(bandwidth(args.inter_gbps, "--inter-gbps"), inter_latency)
        return cls(Topology.of_sizes(sizes), intra, cross)

    def without_last(self) -> "NodeLinks":
        sizes = self.topology.sizes[:-1]
        return NodeLinks(Topology.of_sizes(sizes), self.intra[:-1], self.cross if len(sizes) > 1 else None)

    def links(self) -> Links:
        return Links.tiered(self.topology, self.intra, self.cross, "simulated")


def first_ranks(spec: ClusterSpec, count: int) -> ClusterSpec:
    """The cluster of its first ``count`` ranks. Its nodes and network are left out: the nodes
    simulated are those of ``--nodes`` (``NodeLinks``), and a cluster that declares its own
    (A-4+4) would otherwise declare more ranks than the cut keeps."""
    devices: list[dict[str, Any]] = []
    for dtype in spec.rank_types()[:count]:
        if devices and devices[-1]["type"] == dtype:
            devices[-1]["count"] += 1
        else:
            devices.append({"type": dtype, "count": 1})
    # its own nodes and network are not these ranks': ``NodeLinks`` gives their links
    return ClusterSpec.from_dict({**spec.to_dict(), "name": f"{spec.name}[:{count}]", "devices": devices,
                                  "nodes": None, "network": None})


def on_nodes(spec: ClusterSpec, nodes: NodeLinks, stage: int, model: ModelSpec) -> Profile:
    """The synthetic profile of ``spec``'s first ranks on these nodes and links."""
    prof = synthetic_profile(first_ranks(spec, nodes.topology.world_size), stage, model)
    return replace(prof, comm=replace(prof.comm, links=nodes.links()))


def ways_row(label: str, prof: Profile, gbs: int, stage: int, limits: dict[str, Any],
             allow_lossy: bool = False) -> dict[str, Any]:
    """Each way's predicted plan on ``prof`` (None where it does not apply or fits no plan), the
    choice, and with ``allow_lossy`` the choice among quantized collectives too (``lossy``)."""
    row: dict[str, Any] = {"cluster": label, "ranks": prof.world_size,
                           "nodes": prof.comm.links.topology.describe() if prof.comm.links.topology else "1 node"}
    for way in ORDER:
        applies = way.applies(stage) and (way is Collectives.FLAT or prof.comm.links.spans_nodes)
        try:
            row[way.value] = plan(prof, gbs, stage, collectives=way, **limits) if applies else None
        except PlanError as e:
            row[way.value] = str(e)
    chosen: Plan = plan(prof, gbs, stage, **limits)
    row["chosen"] = chosen
    row["lossy"] = plan(prof, gbs, stage, collectives=CollectivesRequest(allow_lossy=True), **limits) \
        if allow_lossy else None
    return row


def lossy_lines(rows: list[dict[str, Any]]) -> str:
    """Per row planned with ``allow_lossy``: each option's predicted iteration and the choice."""
    out = []
    for r in rows:
        found: Plan | None = r.get("lossy")
        record = found.choice.compression_choice if found is not None else None
        if record is None:
            out.append(f"{r['cluster']}, allow_lossy: nothing to quantize (one node, or ZeRO-0/1): exact")
            continue
        priced = ", ".join(f"{c.policy.describe().removeprefix('quantized ').split(' (')[0]} "
                           + (f"{c.predicted_s:.4f} s" if c.predicted_s is not None else "no plan")
                           for c in record.candidates)
        out.append(f"{r['cluster']}, allow_lossy: {priced}; {record.describe()}"
                   + (f"; ranks {','.join(map(str, found.left_out))} out" if found.left_out else ""))
    return "\n".join(out)


def _cell(found: Plan | str | None) -> str:
    if found is None:
        return "-"
    if isinstance(found, str):
        return "no plan"
    return f"{found.predicted_iteration_s:.4f} s {found.predicted_samples_per_s:8.2f}/s"


def _way(found: Plan) -> str:
    """The chosen way, and the ranks the plan leaves out of the step (``planner.participation``)."""
    way = found.collectives.value + (f" ({100 * found.held_share:.0f}% held)" if found.held_share < 1 else "")
    return way + (f", ranks {','.join(map(str, found.left_out))} out" if found.left_out else "")


def _every_gpu_plan(row: dict[str, Any]) -> Plan:
    """The row's fastest exact plan with every GPU at work (its choice may leave some out)."""
    return max((p for p in (row[w.value] for w in ORDER) if isinstance(p, Plan)),
               key=lambda p: p.predicted_samples_per_s)


def _every_gpu(row: dict[str, Any]) -> float:
    """The row's fastest throughput with every GPU at work (its choice may leave some out)."""
    return _every_gpu_plan(row).predicted_samples_per_s


def _lossy_every_gpu(row: dict[str, Any], gbs: int) -> float | None:
    """The throughput of the row's plan with ``allow_lossy`` with every GPU at work: the plan
    itself, or where it leaves ranks out, its policy's plan on every rank as the planner priced it
    (``participation_candidates``); None without ``--allow-lossy`` or such a plan."""
    found: Plan | None = row.get("lossy")
    if found is None:
        return None
    if not found.left_out:
        return found.predicted_samples_per_s
    every = [c.predicted_s for c in found.choice.participation_candidates or () if not c.left_out]
    return gbs / every[0] if every and every[0] else None


def _compute_s(found: Plan) -> float:
    """The slowest rank's predicted compute in the step."""
    return max(r.predicted_compute_s or 0.0 for r in found.ranks if not r.left_out)


def left_out_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per row whose choice leaves ranks out: which, and why, as the cost model prices it (the
    iteration beyond the slowest rank's compute is the time the links add to the step)."""
    out = []
    for r in rows:
        chosen: Plan = r["chosen"]
        if not chosen.left_out:
            continue
        every = _every_gpu_plan(r)
        compute_in, compute_out = _compute_s(every), _compute_s(chosen)
        links_in = every.predicted_iteration_s - compute_in
        links_out = chosen.predicted_iteration_s - compute_out
        subset = next((c.subset for c in chosen.choice.participation_candidates or () if c.chosen), "")
        which = f"ranks {','.join(map(str, chosen.left_out))}" + \
            (f" ({subset.removeprefix('without ')})" if subset.startswith("without ") else "")
        taken = f"take {compute_out - compute_in:.2f} s of compute off the others" if compute_out > compute_in \
            else "take no compute off the others"
        out.append(f"{r['cluster']}: {which} left out: in the step they would {taken} (slowest rank "
                   f"{compute_out:.2f} s -> {compute_in:.2f} s) and add {links_in - links_out:.2f} s on the links "
                   f"({links_out:.2f} s -> {links_in:.2f} s with the fastest way, {_way(every)})")
    return out


def _worth(gain: float) -> str:
    """A gain as printed (two decimals): worth it above 1.00x, a tie at 1.00x."""
    shown = round(gain, 2)
    return "worth it" if shown > 1 else "not worth it" if shown < 1 else "a tie"


def verdict(rows: list[dict[str, Any]], gbs: int) -> str:
    """Whether adding the last node is worth it: the whole cluster with every GPU at work
    against the cluster without the node, each with its fastest collectives; with
    ``--allow-lossy``, also each with its fastest plan where lossy collectives are allowed."""
    alone = rows[1]["chosen"].predicted_samples_per_s
    exact = _every_gpu(rows[0]) / alone
    head = f"adding the last node: {exact:.2f}x the throughput, each cluster with its fastest collectives"
    lossy_all = _lossy_every_gpu(rows[0], gbs)
    if lossy_all is None:
        return f"{head} ({_worth(exact)} at this link and batch)"
    alone_lossy = rows[1]["lossy"].predicted_samples_per_s if rows[1].get("lossy") is not None else alone
    lossy = max(lossy_all, _every_gpu(rows[0])) / max(alone, alone_lossy)
    if _worth(exact) == _worth(lossy):
        tail = f"{_worth(exact)} at this link and batch, with exact or lossy collectives"
    elif _worth(lossy) == "worth it":
        tail = "worth it at this link and batch only with lossy collectives"
    else:
        tail = f"{_worth(exact)} with exact collectives, {_worth(lossy)} with lossy ones, at this link and batch"
    return f"{head}, {lossy:.2f}x with lossy ones allowed: {tail}"


def table(rows: list[dict[str, Any]], gbs: int | None = None) -> str:
    heads = ["", "ranks", "nodes"] + [f"{w.value} (s/iter, samples/s)" for w in ORDER] + ["chosen", "samples/s"]
    lines = [[r["cluster"], str(r["ranks"]), r["nodes"]] + [_cell(r[w.value]) for w in ORDER]
             + [_way(r["chosen"]), f"{r['chosen'].predicted_samples_per_s:.2f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(heads, *lines)]
    out = "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in [heads, *lines])
    out += "".join(f"\n{line}" for line in left_out_lines(rows))
    if len(rows) > 1:
        # every GPU of the grown cluster at work (its choice may leave the node out again)
        out += "\n" + verdict(rows, gbs if gbs is not None else rows[0]["chosen"].global_batch_size)
    return out


def simulate_nodes(args: argparse.Namespace, spec: ClusterSpec, model: ModelSpec,
                   limits: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The table of the whole cluster and of it without its last node, and its rows."""
    if not isinstance(args.stage, int):
        raise ValueError("--nodes compares ways of running the collectives at one stage: give --stage 0-3")
    nodes = NodeLinks.from_args(args, spec)
    cases = [("all nodes", nodes)]
    if nodes.topology.node_count > 1:
        cases.append(("without the last node", nodes.without_last()))
    lossy = bool(getattr(args, "allow_lossy", False))
    rows = [ways_row(label, on_nodes(spec, n, args.stage, model), args.gbs, args.stage, limits, lossy)
            for label, n in cases]
    links = nodes.links()
    head = (f"{spec.describe()} as {nodes.topology.describe()}; node links "
            + ", ".join(f"{x.bandwidth_bytes_per_s / 1e9:g}" for x in nodes.intra) + " GB/s"
            + (f", between nodes {links.cross.bandwidth_bytes_per_s / 1e9:g} GB/s" if links.cross else "")
            + f"; ZeRO-{args.stage}, global batch {args.gbs}")
    return head + "\n" + table(rows, args.gbs) + ("\n" + lossy_lines(rows) if lossy else ""), rows


def rows_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def one(found: Plan | str | None) -> Any:
        if found is None or isinstance(found, str):
            return {"error": found} if found else None
        return {"iteration_s": found.predicted_iteration_s, "samples_per_s": found.predicted_samples_per_s,
                "plan": found.to_dict()}
    return [{"cluster": r["cluster"], "ranks": r["ranks"], "nodes": r["nodes"],
             **{w.value: one(r[w.value]) for w in ORDER},
             "chosen": r["chosen"].collectives.value, "held_share": r["chosen"].held_share,
             "left_out": list(r["chosen"].left_out), "chosen_samples_per_s": r["chosen"].predicted_samples_per_s,
             "every_gpu_samples_per_s": _every_gpu(r),
             "allow_lossy": one(r["lossy"]) if r.get("lossy") is not None else None} for r in rows]
