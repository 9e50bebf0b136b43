"""The cost model: predicted compute and iteration time of a plan. Written once, used by the
allocators, the baselines, the simulator and the tests.

Notation: rank i runs ``gas_i`` micro-steps of ``b_i`` samples, then one of ``lbs_i`` if
``lbs_i > 0``; ``t_i(b)`` is its device type's curve (seconds for a micro-step of b samples,
``t_i(0) = 0``); N ranks; V = ``param_bytes`` (one full copy of the parameters; gradients have
the same size); bandwidth B and latency a come from the profile's ``CommProfile``.

Compute of rank i:   C_i = gas_i * t_i(b_i) + t_i(lbs_i)

One collective (reduce-scatter or all-gather of V bytes, ring algorithm):
    coll = (N-1)/N * V / B + a          all-reduce = 2 (N-1)/N * V / B + a
B is therefore a *bus* bandwidth (the NCCL-tests "busbw" convention): the per-link rate at which
a ring moves data, not bytes-of-tensor / seconds. With N = 1 there is no communication.

    stage | per micro-step (c_m) | once per iteration (c_s)
    0     | 0                    | all-reduce of gradients
    1     | 0                    | reduce-scatter of gradients + all-gather of parameters = 2 coll
    2     | coll (reduce-scatter)| coll (all-gather of updated parameters)
    3     | 3 coll (all-gather before forward and before backward, reduce-scatter after)| 0
plus, per iteration, the latency of the engine's status all-reduce (one more at stage 3, for
late gradients). That table is the model without a measurement. A measured profile, planned at
the stage it was measured at, replaces it with what the profiler saw on each timing round's
slowest rank: c_m = the micro-step's collective time that compute did not hide (prefetch and
reduce-scatters in flight overlap it), c_s = the iteration's closing collectives plus its fixed
overhead outside micro-steps (optimizer step, zeroing). Without those, the collectives the
engine really issued (``CommProfile.micro_step`` / ``.iteration``: per bucket at stage 2, per
wrapped block at stage 3, the small all-reduces) are priced one by one as above, serially.

Stages 0/1 synchronise only at the end, so ranks run their micro-steps independently:
    T = max_i C_i + c_s
Stages 2/3 synchronise in every micro-step, so micro-step k lasts as long as its slowest rank.
With K = max_i (gas_i + [lbs_i > 0]) lock-step micro-steps and s_ik the size of rank i's k-th
micro-step (0 once it has run all of its own; such a rank joins the collective with zeros):
    T = sum_{k=1..K} (max_i t_i(s_ik) + c_m) + c_s
The predicted communication of a plan is c_s (stages 0/1) or K c_m + c_s (stages 2/3). Measured,
c_m is the exposure of a step in which every rank finishes together, the planner's steps; a step
whose slowest device type leads the next type by a fraction g of its compute (ranks of one type
tie, as in the profiler's rounds) costs c_m + ``lead_change``(g): the change c_lead - c_m measured
with the others at half its compute (g = ``LED_ROUNDS_LEAD``) in full from there on, piecewise
linear below it through 0 at g = 0 and the change the small led rounds measured at their lead
(``CommModel.lockstep_s``); c_s likewise, with the
lead of the last lock-step (stages 2/3) or of the ranks' compute C_i (stages 0/1). At stages 0/1
the closing collectives are sent while the last micro-step's backward runs, so the balanced c_s
is interpolated in the compute of the slowest rank's last micro-step, t_i(lbs_i) or t_i(b_i),
between the levels the profiler measured (``Exposure.end_s``): a short last micro-step hides less. At stages 2/3 a
micro-step whose batches differ from the one before it (the first follows the iteration's last)
adds the measured ``Exposure.switch_s``. ``evaluate_rows`` and the exact
``ideal`` price steps so; the ZeRO-2/3 allocator searches with every step at c_m, then prices
its shortlist, with led last steps, by ``evaluate_rows``. Idle time of rank i is T - C_i.

[Note: ZeRO-0's gradients from the table]
Across nodes once per iteration, ZeRO-0's gradient all-reduce runs hierarchically and every other
all-reduce (the status reduction) flat. The recorded collectives are ``[op, bytes]`` pairs, all
of the iteration's end at ZeRO-0, and do not say which all-reduce is the gradients'; the table
does: one all-reduce of the full gradients (``all_reduce_s``, the way's price) and the status
reduction's latency. So at ZeRO-0 another way scales the recorded end by the table's end run that
way over it run as measured (the ratio of ``priced_as``'s ``iteration_carry``), not by the recorded pairs.

[Note: nodes apart inside an iteration]
Across nodes once per iteration (every parameter held, exact), no micro-step's collective leaves
its node: each node's ranks meet only each other until the iteration's end, where the exchange
and the closing collectives join every rank. So micro-step k of a node costs its own slowest
compute plus its own collectives on its own link, and the micro-steps cost as long as the node
that takes longest over all of them, not the slowest compute plus the slowest link in every
step: a node that computes longer on a faster link does not wait on the other's slower link.
At ZeRO-3 each block's first gather crosses nodes in the first micro-step, so that micro-step is
priced in step over every rank (an upper bound: only its forward meets).
``CommModel.apart`` gives each node its model (a measured exposure carried to the node's serial
seconds), and ``evaluate_rows`` sums each node's lock-step micro-steps and takes the largest.
With part of the parameters held, their rest crosses nodes in every micro-step, and every rank
stays in step. On the emulated A-4+4 and C-4+4 at micro-batches of 13-15 it priced
crossing once per iteration -0.8 to +1.8 % of what it ran, where every rank in step put it 2.3-5.0 %
over (docs/experiments.md, 2026-11-30).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from poplar.planner.curves import SpeedCurve
from poplar.planner.lead import lead_change
from poplar.planner.link_pricing import LinkPricing
from poplar.planner.quantized_pricing import NO_COMPRESSION, Compression
from poplar.types.profiles import Carry
from poplar.types.route import Collectives


def bus_bytes(op: str, nbytes: float, world_size: int) -> float:
    """Bytes a ring moves for one collective of a ``nbytes`` buffer (the full, unsharded size):
    2 (N-1)/N of it for an all-reduce, (N-1)/N for a reduce-scatter or an all-gather."""
    n = world_size
    return (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n) * nbytes


Ops = tuple[tuple[str, float], ...]  # (op, bytes of the full buffer) per collective
Led = tuple[tuple[str, float], ...]  # (device type, seconds) per leading type

# Backward's share of a micro-step's compute: two matmuls per layer (the inputs' gradients and the
# weights') against forward's one. Crossing nodes once per iteration exchanges the gradients beside
# the last micro-step's backward, on the cross-node link (``CommModel.crossing_s``); with
# activation checkpointing backward also recomputes forward, so this is the smaller share.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class CommModel:
    world_size: int
    param_bytes: float
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    measured_stage: int | None = None  # the stage the measured values below belong to
    micro_step_ops: Ops = ()
    iteration_ops: Ops = ()
    exposed_micro_step_s: float | None = None
    exposed_iteration_s: float | None = None  # closing collectives + fixed overhead
    exposed_lead_s: Led | None = None  # a micro-step's per leading device type (``led_micro_step_s``)
    exposed_steps: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # (computes, exposures) balanced
    exposed_end_lead_s: Led | None = None  # exposed_iteration_s per leading device type
    exposed_switch_s: float = 0.0  # more for a micro-step whose batches differ from the step before
    small_lead: Led | None = None  # per leading device type, the lead of its small led rounds
    exposed_small_lead_s: Led | None = None  # a micro-step's exposure there
    exposed_end_small_lead_s: Led | None = None  # the iteration's end's (closing + fixed overhead)
    # Links per tier (None: the flat link above alone) and how this model prices the collectives;
    # the measured exposures above are of ``measured_collectives``, and another way of running
    # them carries what they expose to its serial seconds (``priced_as``)
    pricing: LinkPricing | None = None
    collectives: Collectives = Collectives.FLAT
    measured_collectives: Collectives = Collectives.FLAT
    overhead_s: float = 0.0  # of the measured iteration's end, the fixed overhead (no collective)
    # the plan's quantized collectives (``quantized_pricing``); the exposures above were measured exact
    compression: Compression = NO_COMPRESSION
    # the measured exposures carried to this model's collectives (``priced_as``; Note: an
    # exposure carried, in ``types/profiles.py``)
    micro_carry: Carry = Carry()
    iteration_carry: Carry = Carry()
    # (computes, ends) balanced: the iteration's end (closing + fixed overhead) after a last
    # micro-step of that compute; stages 0/1 price their end from it (``led_iteration_s``)
    exposed_end_steps: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # across nodes once per iteration: the share of the parameters that cross so, the rest per
    # micro-step as hierarchical collectives (``Route``'s Note: a share held)
    held_share: float = 1.0
    # per node, the model of its own micro-step collectives where no micro-step crosses nodes
    # (``apart``; Note: nodes apart inside an iteration); () otherwise
    nodes: tuple["CommModel", ...] = ()

    @classmethod
    def from_profile(cls, profile: Any, collectives: Collectives = Collectives.FLAT,
                     compression: Compression = NO_COMPRESSION, held_share: float = 1.0) -> "CommModel":
        """The model of a profile's links and exposures, pricing the collectives as ``collectives``
        with ``compression``'s quantized collectives (once per iteration: for ``held_share`` of
        the parameters)."""
        model = replace(cls._measured_model(profile), compression=compression.exact(),
                        overhead_s=float(profile.comm.exposure.overhead_s or 0.0))
        links = profile.comm.links
        if not links.spans_nodes:
            return model.priced_as(Collectives.FLAT, compression) if compression.lossy else model
        pricing = LinkPricing.of(links, profile.world_size, profile.shard_weights)
        measured = profile.comm.collectives
        return replace(model, pricing=pricing, collectives=measured,
                       measured_collectives=measured).priced_as(collectives, compression, held_share)

    def priced_as(self, collectives: Collectives, compression: Compression | None = None,
                  held_share: float = 1.0) -> "CommModel":
        """This model with the collectives run as ``collectives`` (once per iteration: for
        ``held_share`` of the parameters), quantized as ``compression`` (None: as this model's):
        the formulas price them on their links, and a measured exposure is carried from the serial
        seconds of one micro-step's (and of the iteration's closing) collectives as it measured them
        (exact, every parameter held) to those run so (Note: an exposure carried, in
        ``types/profiles.py``)."""
        compression = self.compression if compression is None else compression
        measured = replace(self, collectives=self.measured_collectives, micro_carry=Carry(), iteration_carry=Carry(),
                           compression=compression.exact(), held_share=1.0, nodes=())
        priced = replace(measured, collectives=collectives, compression=compression, held_share=held_share)

        stage = self.measured_stage
        if stage is None:
            return priced.apart(None)
        if collectives is self.measured_collectives and not compression.lossy and held_share >= 1:
            return priced.apart(measured)
        seconds = not compression.lossy  # (Note: an exposure carried: quantized, the fraction alone)
        return replace(priced,
                       micro_carry=Carry.between(priced.serial_micro_step_s(stage), measured.serial_micro_step_s(stage),
                                                 seconds),
                       iteration_carry=Carry.between(priced.serial_iteration_s(stage),
                                                     measured.serial_iteration_s(stage), seconds)).apart(measured)

    def apart(self, measured: "CommModel | None") -> "CommModel":
        """This model with ``nodes`` where no micro-step crosses nodes (Note: nodes apart inside an
        iteration): across nodes once per iteration, every parameter held, exact. Each node's
        model prices its micro-step collectives on its own link, a measured exposure carried from
        ``measured``'s serial seconds to that node's."""
        pricing = self.pricing
        if (pricing is None or not pricing.spans_nodes or self.collectives is not Collectives.ONCE_PER_ITERATION
                or self.held_share < 1 or self.compression.lossy or min(pricing.shares) <= 0):
            return self
        stage = self.measured_stage  # set wherever ``measured`` is given (``priced_as``)
        nodes = []
        for k in range(len(pricing.sizes)):
            node = replace(self, pricing=pricing.with_nodes([k]), nodes=())
            if measured is not None:
                node = replace(node, micro_carry=Carry.between(node.serial_micro_step_s(stage),
                                                               measured.serial_micro_step_s(stage)))
            nodes.append(node)
        return replace(self, nodes=tuple(nodes))

    def serial_micro_step_s(self, stage: int) -> float:
        """One micro-step's collectives one by one, serially: the recorded ones, else the table's."""
        if self.micro_step_ops:
            return self._ops_s(self.micro_step_ops, stage, in_micro_step=True)
        return self._table_micro_step_s(stage)

    def serial_iteration_s(self, stage: int) -> float:
        """The iteration's closing collectives one by one, serially: the recorded ones, but at
        ZeRO-0 the table's (Note: ZeRO-0's gradients from the table)."""
        if self.iteration_ops and stage != 0:
            return self._ops_s(self.iteration_ops, stage)
        return self._table_iteration_s(stage)

    @classmethod
    def _measured_model(cls, profile: Any) -> "CommModel":
        c, x = profile.comm, profile.comm.exposure
        end = None
        overhead = x.overhead_s or 0.0
        if x.iteration_s is not None:
            end = x.iteration_s + overhead

        def per_type(name: str, add: float = 0.0) -> Led | None:
            seconds = x.per_leader(name)
            return tuple((t, v + add) for t, v in sorted(seconds.items())) if seconds else None

        return cls(profile.world_size, float(profile.param_bytes), float(c.links.bandwidth_bytes_per_s),
                   float(c.links.latency_s or 0.0), c.collectives_stage,
                   tuple((str(op), float(n)) for op, n in c.micro_step),
                   tuple((str(op), float(n)) for op, n in c.iteration), x.micro_step_s, end,
                   per_type("micro_step_s"),
                   (tuple(x.step_compute_s), tuple(x.step_s)) if x.step_s else None,
                   per_type("iteration_s", overhead), float(x.switch_s or 0.0),
                   per_type("small_lead"), per_type("micro_step_small_lead_s"),
                   per_type("iteration_small_lead_s", overhead),
                   exposed_end_steps=(tuple(x.step_compute_s), tuple(e + overhead for e in x.end_s))
                   if x.end_s and x.step_compute_s else None)

    def call_s(self, op: str, nbytes: float, backward_gather: bool = False, table: bool = False,
               in_micro_step: bool = False) -> float:
        """One collective of a ``nbytes`` buffer (the full, unsharded size); ``backward_gather``:
        a ZeRO-3 all-gather before backward; ``table``: a buffer of the formulas (the model's
        full copy), not one the profile recorded (its element size differs under mixed precision);
        ``in_micro_step``: a call of every micro-step, not of the iteration's end
        (``LinkPricing.call_s``)."""
        wire = self.compression.wire(op, table)
        if self.pricing is not None and (self.collectives is not Collectives.FLAT or wire is not None):
            held = self.pricing.call_s(op, nbytes, self.collectives, backward_gather, wire, in_micro_step)
            if self.held_share >= 1:
                return held
            # the pieces outside the held share cross per micro-step, hierarchically (Note: a share held)
            per_step = self.pricing.call_s(op, nbytes, Collectives.HIERARCHICAL, backward_gather, wire, in_micro_step)
            return self.held_share * held + (1 - self.held_share) * per_step
        n = self.world_size
        if n <= 1:
            return 0.0
        if wire is not None and wire.every_step:  # one node: only a policy of every step quantizes
            return bus_bytes(op, wire.bytes(nbytes), n) / self.bandwidth_bytes_per_s + self.latency_s \
                + wire.conversion_s(nbytes)
        return bus_bytes(op, nbytes, n) / self.bandwidth_bytes_per_s + self.latency_s

    def _ops_s(self, ops: Ops, stage: int, in_micro_step: bool = False) -> float:
        """The recorded collectives one by one, serially (``in_micro_step``: a micro-step's). At
        ZeRO-3 every block is gathered before forward and again before backward, the same bytes:
        half the all-gathers are backward's."""
        if stage != 3 or not self.collectives.secondary_shards:
            return sum(self.call_s(op, n, in_micro_step=in_micro_step) for op, n in ops)
        return sum((self.call_s(op, n) + self.call_s(op, n, backward_gather=True)) / 2 if op == "all_gather"
                   else self.call_s(op, n) for op, n in ops)

    def crossing_s(self, stage: int, last_step_s: float | None = None) -> float:
        """What crossing nodes once per iteration adds to the iteration's end (0 for every other
        way): each micro-step collective's step across nodes, once (at ZeRO-3 each block's gather
        is recorded twice, before forward and before backward, and crosses once). The gradients'
        exchanges start as the last lock-step micro-step's in-node reduce-scatters complete
        (``zero.reduce_queue.NodeExchanges``) and run beside that micro-step's backward, on the
        cross-node link: with ``last_step_s`` (its slowest compute) up to ``BACKWARD_SHARE`` of it
        is hidden; without, none (an upper bound). Held for a share of the parameters, that share
        of them crosses so (the rest crossed in their micro-steps, ``call_s``)."""
        if self.pricing is None or stage not in (2, 3) or self.collectives is not Collectives.ONCE_PER_ITERATION:
            return 0.0
        pricing, collectives = self.pricing, self.collectives

        def once(op: str, n: float, table: bool) -> float:
            return pricing.crossing_s(op, n, collectives, self.compression.wire(op, table)) * (
                0.5 if stage == 3 and op == "all_gather" and not table else 1.0)
        if self._measured(stage) and self.micro_step_ops:
            ops, table = self.micro_step_ops, False
        else:
            ops, table = (("reduce_scatter", self.param_bytes),) + (
                (("all_gather", self.param_bytes),) if stage == 3 else ()), True
        gathers = sum(once(op, n, table) for op, n in ops if op == "all_gather")
        exchanges = sum(once(op, n, table) for op, n in ops if op == "reduce_scatter")
        hidden = BACKWARD_SHARE * last_step_s if last_step_s is not None else 0.0
        return self.held_share * gathers + max(0.0, self.held_share * exchanges - hidden)

    def _measured(self, stage: int) -> bool:
        return self.measured_stage == stage and bool(self.micro_step_ops or self.iteration_ops)

    def collective_s(self, backward_gather: bool = False, op: str = "all_gather") -> float:
        """One reduce-scatter or all-gather (``op``) of the full parameter size."""
        return self.call_s(op, self.param_bytes, backward_gather, table=True)

    def all_reduce_s(self) -> float:
        """ZeRO-0's gradient all-reduce of the full gradients: hierarchical where this model runs
        it across nodes once per iteration (``LinkPricing.gradient_all_reduce_s``), else one ring
        on the flat link."""
        if self.pricing is not None and self.collectives is Collectives.ONCE_PER_ITERATION:
            return self.pricing.gradient_all_reduce_s(self.param_bytes, self.collectives)
        n = self.world_size
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * self.param_bytes / self.bandwidth_bytes_per_s + self.latency_s

    def per_micro_step_s(self, stage: int) -> float:
        if self.measured_stage == stage and self.exposed_micro_step_s is not None:
            return self.micro_carry.of(self.exposed_micro_step_s) if stage in (2, 3) else 0.0
        if self._measured(stage):
            return self._ops_s(self.micro_step_ops, stage, in_micro_step=True)
        return self._table_micro_step_s(stage)

    def _table_micro_step_s(self, stage: int) -> float:
        def one(op: str, backward_gather: bool = False) -> float:
            return self.call_s(op, self.param_bytes, backward_gather, table=True, in_micro_step=True)
        scatter = one("reduce_scatter")
        if stage == 3:  # the gathers before forward and before backward, the gradients' reduce-scatter
            return one("all_gather") + one("all_gather", backward_gather=True) + scatter
        return {0: 0.0, 1: 0.0, 2: scatter}[stage]

    def led_micro_step_s(self, stage: int, lead: Any, compute: Any = None, leader: Any = None) -> Any:
        """c_m of a micro-step whose slowest device type ``leader`` leads the next by ``lead`` (a
        fraction of its compute) and computes ``compute`` seconds (numbers, or arrays of them and
        of type names): measured, the balanced exposure (interpolated in the compute between the
        measured levels, constant beyond them) plus the ``lead_change`` the leader's led rounds
        measured; otherwise ``per_micro_step_s``."""
        lead = np.asarray(lead, dtype=float)
        if self.measured_stage != stage or stage not in (2, 3) or self.exposed_micro_step_s is None:
            return self.per_micro_step_s(stage) + 0.0 * lead
        balanced = self.exposed_micro_step_s  # as measured; carried below when priced another way
        base = balanced + 0.0 * lead
        if compute is not None and self.exposed_steps is not None:
            base = np.interp(compute, *self.exposed_steps) + 0.0 * lead
        if self.exposed_lead_s is None or leader is None:
            return self.micro_carry.of(base)
        change = _per_leader(self.exposed_lead_s, leader, balanced) - balanced
        led = np.maximum(0.0, base + self._lead_change(lead, change, self.exposed_small_lead_s, leader, balanced))
        return self.micro_carry.of(led)

    def _lead_change(self, lead: Any, change: Any, small: Led | None, leader: Any, balanced: float) -> Any:
        """``lead_change`` with the leader's small led rounds (``small``: their exposure), if measured."""
        if self.small_lead is None or small is None:
            return lead_change(lead, change)
        return lead_change(lead, change, _per_leader(self.small_lead, leader, np.nan),
                           _per_leader(small, leader, np.nan) - balanced)

    def prices_by_shape(self, stage: int) -> bool:
        """Whether a step's exposure at ``stage`` depends on its shape (its compute, who leads,
        a change of batches), not only on its being a step: measured levels, leads or switches."""
        return self.measured_stage == stage and stage in (2, 3) and self.exposed_micro_step_s is not None and bool(
            self.exposed_lead_s or self.exposed_steps or self.exposed_end_lead_s or self.exposed_switch_s)

    def cheapest_micro_step_s(self, stage: int) -> float:
        """The least c_m any micro-step pays (a lower bound for searches)."""
        leaders = [t for t, _ in self.exposed_lead_s or ()] or [None]
        # the lead's change is monotone in the lead (``lead_change``): its ends bound it
        return float(min(self.led_micro_step_s(stage, g, t, who) for g in (0.0, 1.0) for t in (0.0, np.inf)
                         for who in leaders))

    def lockstep_s(self, stage: int, per_type: Any, types: Sequence[str]) -> Any:
        """Seconds of lock-step micro-steps from each device type's compute in them (axis 0: the
        ``types``, each its slowest rank's, 0 for a type with nothing to run; further axes:
        steps): the slowest compute plus c_m at its lead over the next type. With one type every
        rank ties with the slowest."""
        raw = np.asarray(per_type, dtype=float).reshape(len(per_type), -1)
        t = np.sort(raw, axis=0)[::-1]
        slowest = t[0]
        second = t[1] if t.shape[0] > 1 else slowest
        lead = np.where(slowest > 0, (slowest - second) / np.where(slowest > 0, slowest, 1.0), 0.0)
        leader = np.asarray(types)[np.argmax(raw, axis=0)]
        out = slowest + self.led_micro_step_s(stage, lead, slowest, leader)
        return out if np.ndim(per_type) > 1 else float(out[0])

    def led_iteration_s(self, stage: int, lead: float, leader: str | None, last_step_s: float | None = None) -> float:
        """c_s of an iteration whose slowest device type ``leader`` leads the next by ``lead`` at
        its end: measured, the balanced end plus the ``lead_change`` the leader's led rounds
        measured. At stages 0/1 the balanced end is interpolated in ``last_step_s``, the compute
        of the slowest rank's last micro-step, between the measured levels (constant beyond them):
        the closing collectives overlap that micro-step's backward, so a shorter one hides less.
        At stages 2/3 ``last_step_s`` is the compute of the last lock-step micro-step's slowest
        rank, beside whose backward crossing nodes once per iteration exchanges (``crossing_s``)."""
        return self._led_end_s(stage, lead, leader, last_step_s) + self.crossing_s(stage, last_step_s)

    def _led_end_s(self, stage: int, lead: float, leader: str | None, last_step_s: float | None) -> float:
        if self.measured_stage != stage or self.exposed_iteration_s is None:
            return self._end_s(stage)
        balanced = self.exposed_iteration_s  # as measured; carried below when priced another way
        base = balanced
        if stage in (0, 1) and last_step_s is not None and self.exposed_end_steps is not None:
            base = float(np.interp(last_step_s, *self.exposed_end_steps))
        if self.exposed_end_lead_s is None or leader is None:
            return self._carried_end(base)
        change = float(_per_leader(self.exposed_end_lead_s, leader, balanced)) - balanced
        return self._carried_end(base + float(self._lead_change(lead, change, self.exposed_end_small_lead_s,
                                                               leader, balanced)))

    def _carried_end(self, measured: float) -> float:
        """A measured iteration's end with its collectives priced as this model's: the fixed
        overhead as it is, the rest carried."""
        if self.iteration_carry == Carry():
            return measured
        return self.overhead_s + self.iteration_carry.of(measured - self.overhead_s)

    def per_iteration_s(self, stage: int) -> float:
        """c_s with no lead, what crossing nodes once per iteration adds included, none of it
        hidden (``crossing_s``: an upper bound for searches)."""
        return self._end_s(stage) + self.crossing_s(stage)

    def _end_s(self, stage: int) -> float:
        if self.measured_stage == stage and self.exposed_iteration_s is not None:
            return self._carried_end(self.exposed_iteration_s)
        if self._measured(stage):
            # at ZeRO-0 the recorded all-reduces are priced flat; ``priced_as`` scales the way's end
            # by the table's (Note: ZeRO-0's gradients from the table)
            return self._ops_s(self.iteration_ops, stage) * (self.iteration_carry.ratio if stage == 0 else 1.0)
        return self._table_iteration_s(stage)

    def _table_iteration_s(self, stage: int) -> float:
        small = (2 if stage == 3 else 1) * (self.latency_s if self.world_size > 1 else 0.0)
        ends = {0: self.all_reduce_s(), 1: self.collective_s(op="reduce_scatter") + self.collective_s(),
                2: self.collective_s(), 3: 0.0}
        return small + ends[stage]


Row = tuple[str, int, int, int]  # (device_type, b, gas, lbs)


def _per_leader(led: Led, leader: Any, otherwise: float) -> Any:
    """``led``'s seconds for each leading type in ``leader`` (a name or an array of names)."""
    table = dict(led)
    if isinstance(leader, str):
        return table.get(leader, otherwise)
    return np.array([table.get(str(t), otherwise) for t in np.ravel(leader)]).reshape(np.shape(leader))


@dataclass
class Evaluation:
    compute_s: list[float]  # C_i per rank
    iteration_s: float  # T
    comm_s: float
    micro_steps: int  # K: lock-step micro-steps (stages 2/3) / most micro-steps of any rank (0/1)
    end_s: float = 0.0  # of comm_s, what the iteration's end costs (c_s at its lead)
    switch_s: float = 0.0  # of comm_s, what the micro-steps that change batches add

    def idle_s(self) -> list[float]:
        return [self.iteration_s - c for c in self.compute_s]


def compute_s(curve: SpeedCurve, b: int, gas: int, lbs: int) -> float:
    """C_i for one rank."""
    return gas * curve.time(b) + curve.time(lbs)


def evaluate_rows(rows: Sequence[Row], curves: Mapping[str, SpeedCurve], stage: int,
                  comm: CommModel) -> Evaluation:
    """The cost model for one row per rank. Work is per distinct row, so 10,000 ranks of a few
    distinct rows cost about as much as a few ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {stage}")
    distinct: dict[Row, float] = {}
    for row in rows:
        if row not in distinct:
            dtype, b, gas, lbs = row
            if b > curves[dtype].mbs or lbs > curves[dtype].mbs:
                raise ValueError(f"{dtype}: micro-batch {max(b, lbs)} exceeds its mbs {curves[dtype].mbs}")
            distinct[row] = compute_s(curves[dtype], b, gas, lbs)
    per_rank = [distinct[row] for row in rows]
    steps = max((gas + (1 if lbs > 0 else 0) for (_, _, gas, lbs) in distinct), default=0)
    if stage in (0, 1):
        totals: dict[str, float] = {}
        for (dtype, _, _, _), c in distinct.items():
            totals[dtype] = max(totals.get(dtype, 0.0), c)
        comm_s = comm.led_iteration_s(stage, *_lead(totals), _last_step_s(distinct, curves))
        return Evaluation(per_rank, max(per_rank) + comm_s, comm_s, steps, comm_s)
    # Lock-step: micro-step k (0-based) of a row costs t(b) for k < gas, t(lbs) at k == gas.
    # Between consecutive breakpoints every row's cost is constant, so sum segment by segment.
    marks = {0, steps}
    for (_, _, gas, lbs) in distinct:
        marks.update((gas, gas + 1) if lbs > 0 else (gas,))
    cuts = sorted(m for m in marks if 0 <= m <= steps)
    apart = bool(comm.nodes) and len(rows) == sum(_node_size(node) for node in comm.nodes)
    compute_wall, exposed = (_apart_s(rows, curves, stage, comm, cuts) if apart
                             else _lockstep_s(distinct, curves, stage, comm, cuts))
    last = _step_per_type(distinct, curves, cuts[-2]) if len(cuts) > 1 else {}
    shapes = [tuple(b if start < gas else lbs if start == gas else 0 for (_, b, gas, lbs) in distinct)
              for start in cuts[:-1]]
    end_s = comm.led_iteration_s(stage, *_lead(last), max(last.values(), default=0.0))
    switch_s = 0.0
    if comm.measured_stage == stage:  # iterations repeat, so the first micro-step follows the last one
        switch_s = comm.exposed_switch_s * sum(a != b for a, b in zip(shapes, shapes[-1:] + shapes[:-1]))
    comm_s = exposed + end_s + switch_s
    return Evaluation(per_rank, compute_wall + comm_s, comm_s, steps, end_s, switch_s)


def _step_per_type(rows: Iterable[Row], curves: Mapping[str, SpeedCurve], start: int) -> dict[str, float]:
    """Each device type's slowest compute in lock-step micro-step ``start`` (0: done, its ranks
    wait in the collectives)."""
    per_type: dict[str, float] = {}
    for (dtype, b, gas, lbs) in rows:
        t = curves[dtype].time(b) if start < gas else curves[dtype].time(lbs) if start == gas and lbs > 0 else 0.0
        per_type[dtype] = max(per_type.get(dtype, 0.0), t)
    return per_type


def _lockstep_s(rows: Iterable[Row], curves: Mapping[str, SpeedCurve], stage: int, comm: CommModel,
                cuts: Sequence[int]) -> tuple[float, float]:
    """(compute, exposed) seconds of the lock-step micro-steps of ``rows``, between consecutive
    ``cuts`` every row's cost constant: each step its slowest compute plus c_m at its lead."""
    rows = list(dict.fromkeys(rows))  # distinct, in order (the leader of a tie is the first)
    compute = exposed = 0.0
    for start, end in zip(cuts, cuts[1:]):
        per_type = _step_per_type(rows, curves, start)
        slowest = max(per_type.values())
        compute += (end - start) * slowest
        exposed += (end - start) * (comm.lockstep_s(stage, list(per_type.values()), list(per_type)) - slowest)
    return compute, exposed


def _apart_s(rows: Sequence[Row], curves: Mapping[str, SpeedCurve], stage: int, comm: CommModel,
             cuts: Sequence[int]) -> tuple[float, float]:
    """(compute, exposed) seconds of the micro-steps with each node in lock-step with itself alone
    (Note: nodes apart inside an iteration): the node that takes longest; at ZeRO-3 the first
    micro-step, whose gathers cross nodes, in lock-step over every rank. ``rows`` in rank order,
    nodes consecutive runs of ranks."""
    together = (0.0, 0.0)
    if stage == 3 and cuts[-1] >= 1:
        together = _lockstep_s(rows, curves, stage, comm, (0, 1))
        cuts = sorted({1, *cuts} - {0})  # one cut (no micro-step left): no node adds any
    worst, first = (0.0, 0.0), 0
    for node in comm.nodes:
        size = _node_size(node)
        mine = _lockstep_s(rows[first:first + size], curves, stage, node, cuts)
        first += size
        if sum(mine) > sum(worst):
            worst = mine
    return together[0] + worst[0], together[1] + worst[1]


def _node_size(node: CommModel) -> int:
    """The ranks of one of ``CommModel.nodes`` (each has its node's pricing)."""
    assert node.pricing is not None
    return node.pricing.world_size


def _last_step_s(computes: Mapping[Row, float], curves: Mapping[str, SpeedCurve]) -> float:
    """The compute of the last micro-step of the slowest row (of ``computes``: C_i per row)."""
    dtype, b, gas, lbs = max(computes, key=lambda row: computes[row])
    return curves[dtype].time(lbs if lbs > 0 else b)


def _lead(per_type: Mapping[str, float]) -> tuple[float, str | None]:
    """How far the slowest device type leads the next, as a fraction of its time (0 with one
    type), and which type that is."""
    ordered = sorted(per_type.items(), key=lambda kv: -kv[1])
    if len(ordered) < 2 or ordered[0][1] <= 0:
        return 0.0, ordered[0][0] if ordered else None
    return (ordered[0][1] - ordered[1][1]) / ordered[0][1], ordered[0][0]
