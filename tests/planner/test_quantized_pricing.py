"""Quantized collectives in the planner: their cross-node bytes are ``Quantization.wire_bytes``
of their elements, plus the conversion work; a policy given is used as given; with none given
every plan is exact unless ``allow_lossy``, and then a quantized plan is kept only where it is
predicted faster than the fastest exact plan by more than the tie, never on one node, never at
ZeRO-0/1."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poplar.planner import CollectivesRequest, plan
from poplar.planner.cost_model import CommModel
from poplar.planner.link_pricing import LinkPricing
from poplar.types.route import Collectives
from poplar.planner.quantized_pricing import CONVERSION_BYTES_PER_S, Compression, QuantizedWire
from poplar.types.compression import EXACT, CommPolicy, Quantization, QuantScope
from poplar.types.plans import Plan, PlanError
from poplar.types.profiles import Exposure, LinkSpeed, Links
from poplar.types.topology import Topology
from tests.planner.test_link_pricing import FAST, GB, SLOW, profile, two_nodes

INT8 = Quantization()
LOSSY = CollectivesRequest(allow_lossy=True)


def test_the_cross_step_sends_the_wire_bytes_of_its_elements_and_pays_the_conversion() -> None:
    nbytes, numel = 8e9, 2 * 10**9  # fp32
    wire = QuantizedWire(INT8, 4)
    sent = INT8.wire_bytes(numel)
    assert sent == numel + 4 * (numel // 256) and wire.bytes(nbytes) == sent
    convert = numel * 2 * (4 + 1) / CONVERSION_BYTES_PER_S
    assert wire.conversion_s(nbytes) == pytest.approx(convert)
    even = LinkPricing.of(two_nodes(), 8)
    # hierarchical: the node step exact, the cross step quantized
    assert even.call_s("reduce_scatter", nbytes, Collectives.HIERARCHICAL, wire=wire) == pytest.approx(
        even.intra_s("reduce_scatter", nbytes) + even.cross_s(sent) + convert)
    # flat on a topology that spans nodes: the whole ring quantized
    assert even.call_s("all_gather", nbytes, Collectives.FLAT, wire=wire) == pytest.approx(
        even.flat_s("all_gather", sent) + convert)
    # secondary shards: the backward re-gather stays in the node, exact
    assert even.call_s("all_gather", nbytes, Collectives.SECONDARY_SHARDS, backward_gather=True, wire=wire) == \
        even.intra_s("all_gather", nbytes)
    # every step: the node step quantized too
    every = QuantizedWire(Quantization(scope=QuantScope.EVERY_STEP), 4)
    assert even.call_s("all_gather", nbytes, Collectives.HIERARCHICAL, wire=every) == pytest.approx(
        even.intra_s("all_gather", sent) + even.cross_s(sent) + convert)
    # one node: nothing crosses, so a cross-node policy changes nothing
    one = LinkPricing.of(Links.tiered(Topology.single(4), (FAST,), None), 4)
    assert one.call_s("all_gather", nbytes, Collectives.FLAT, wire=wire) == one.flat_s("all_gather", nbytes)


def test_weights_quantize_zero3_gathers_and_gradients_the_reduce_scatters_never_the_rest() -> None:
    prof = profile(two_nodes(), stage=3)
    exact = CommModel.from_profile(prof, Collectives.HIERARCHICAL)
    weights = CommModel.from_profile(prof, Collectives.HIERARCHICAL, Compression.of(prof, CommPolicy(weights="int8")))
    grads = CommModel.from_profile(prof, Collectives.HIERARCHICAL, Compression.of(prof, CommPolicy(gradients="int8")))
    v = prof.param_bytes
    assert weights.per_micro_step_s(3) == pytest.approx(2 * weights.call_s("all_gather", v, table=True)
                                                        + exact.call_s("reduce_scatter", v))
    assert grads.per_micro_step_s(3) == pytest.approx(2 * exact.call_s("all_gather", v)
                                                      + grads.call_s("reduce_scatter", v, table=True))
    assert weights.call_s("all_gather", v, table=True) < exact.call_s("all_gather", v)
    # ZeRO-2: the reduce-scatter per micro-step quantized, the all-gather of updated parameters exact
    two = profile(two_nodes(), stage=2)
    exact2 = CommModel.from_profile(two, Collectives.HIERARCHICAL)
    grads2 = CommModel.from_profile(two, Collectives.HIERARCHICAL, Compression.of(two, CommPolicy(gradients="int8")))
    assert grads2.per_micro_step_s(2) < exact2.per_micro_step_s(2)
    assert grads2.per_iteration_s(2) == exact2.per_iteration_s(2)
    # under bf16 a gathered parameter is 2 bytes: the recorded gathers have half as many elements per byte
    bf16 = replace(prof, precision="bf16")
    assert Compression.of(bf16, CommPolicy(weights="int8")).wire("all_gather").itemsize == 2
    assert Compression.of(bf16, CommPolicy(weights="int8")).wire("all_gather", table=True).itemsize == 4


def test_a_measured_exposure_is_scaled_by_the_quantized_collectives_over_the_exact_ones() -> None:
    # quantized: the fraction alone, never the seconds (Note: an exposure carried)
    prof = profile(two_nodes(), stage=3, exposure=Exposure(micro_step_s=0.05, iteration_s=0.01),
                   collectives_stage=3, micro_step=[["all_gather", 4e7], ["all_gather", 4e7], ["reduce_scatter", 4e7]])
    exact = CommModel.from_profile(prof)
    both = CommModel.from_profile(prof, compression=Compression.of(prof, CommPolicy(weights="int8", gradients="int8")))
    assert exact.per_micro_step_s(3) == 0.05
    assert both.per_micro_step_s(3) == pytest.approx(0.05 * both.serial_micro_step_s(3) / exact.serial_micro_step_s(3))
    assert both.per_micro_step_s(3) < 0.3 * 0.05  # a flat ring over the slow link: about a quarter of the bytes


def cases() -> list[tuple[Links, int, int]]:
    """Links from a slow cross link to one faster than the nodes', node shapes, stages, batches."""
    out = []
    for cross in (LinkSpeed(0.1 * GB, 1e-4), SLOW, LinkSpeed(200 * GB, 5e-6)):
        for sizes, gbs in (((4, 4), 1000), ((2, 6), 64), ((2, 2, 4), 256)):
            for stage in (0, 1, 2, 3):
                out.append((Links.tiered(Topology.of_sizes(sizes), [FAST] * len(sizes), cross), stage, gbs))
    return out


def test_without_allow_lossy_no_plan_is_quantized_and_with_it_some_are() -> None:
    chosen = []
    for links, stage, gbs in cases():
        prof = profile(links, stage=stage)
        exact = plan(prof, gbs, stage)
        assert exact.compression == EXACT and exact.choice.compression_choice is None
        assert not Plan.from_dict(exact.to_dict()).compression.lossy
        lossy = plan(prof, gbs, stage, collectives=LOSSY)
        assert lossy.compression.problem(stage) is None
        chosen.append(lossy.compression.lossy)
        if stage < 2:
            assert not lossy.compression.lossy and lossy.choice.compression_choice is None  # no option at ZeRO-0/1
    assert any(chosen) and not all(chosen)  # the same inputs, allowed: quantized somewhere, not everywhere


@pytest.mark.parametrize("stage", [2, 3])
def test_allow_lossy_quantizes_over_a_slow_cross_link_and_not_over_a_fast_one(stage: int) -> None:
    # one micro-step a rank: quantized crossings beat exact ones
    slow = plan(profile(two_nodes(cross=SLOW), stage=stage), 200, stage, collectives=LOSSY, participation="all")
    record = slow.choice.compression_choice
    assert slow.compression.lossy and record.chosen == slow.compression and slow.max_micro_steps == 1
    assert record.saving > record.tie and record.chosen_s == slow.predicted_iteration_s
    assert record.exact_s == plan(profile(two_nodes(cross=SLOW), stage=stage), 200, stage,
                                  participation="all").predicted_iteration_s
    # six: crossing once per iteration, exact, beats quantizing each micro-step's crossing
    # (quantized gradients cross per micro-step: ``LinkPricing.crossing_s``)
    many = plan(profile(two_nodes(cross=SLOW), stage=stage), 1000, stage, collectives=LOSSY, participation="all")
    assert not many.compression.lossy and many.collectives is Collectives.ONCE_PER_ITERATION
    assert many.max_micro_steps == 6 and min(c.predicted_s for c in many.choice.compression_choice.candidates
                                             if c.policy.lossy) > many.predicted_iteration_s
    assert {c.policy for c in record.candidates} == {EXACT, CommPolicy(gradients="int8")} | (
        {CommPolicy(weights="int8"), CommPolicy(weights="int8", gradients="int8")} if stage == 3 else set())
    assert "chosen (allow_lossy): predicted" in slow.table()
    fast = plan(profile(two_nodes(cross=LinkSpeed(200 * GB, 5e-6)), stage=stage), 256, stage, collectives=LOSSY)
    assert not fast.compression.lossy and fast.choice.compression_choice.saving == 0
    assert "exact collectives kept (allow_lossy)" in fast.table()
    # the record reads back from plan JSON
    assert Plan.from_dict(slow.to_dict()).choice.compression_choice == record


def test_a_quantized_option_within_the_tie_keeps_exact() -> None:
    prof = profile(two_nodes(cross=SLOW), stage=3)
    best = plan(prof, 1000, 3, collectives=LOSSY, participation="all").choice.compression_choice
    gain = best.saving
    widened = replace(prof, comm=replace(prof.comm, exposure=Exposure(error=gain)))  # tie 2 sqrt 2 x the gain
    kept = plan(widened, 1000, 3, collectives=LOSSY, participation="all")
    assert not kept.compression.lossy and kept.choice.compression_choice.tie > gain


def test_one_node_and_zero1_are_never_quantized_and_a_given_policy_is_used_as_given() -> None:
    one = profile(Links.tiered(Topology.single(8), (SLOW,), None), stage=3)
    alone = plan(one, 1000, 3, collectives=LOSSY)
    assert not alone.compression.lossy and alone.choice.compression_choice is None
    for stage in (0, 1):
        got = plan(profile(two_nodes(cross=LinkSpeed(0.1 * GB, 1e-4)), stage=stage), 1000, stage, collectives=LOSSY)
        assert not got.compression.lossy
    with pytest.raises(PlanError, match="ZeRO-1"):
        plan(profile(two_nodes(), stage=1), 1000, 1, collectives=CollectivesRequest(compression=CommPolicy(
            gradients="int8")))
    # given: used even where exact is faster, and priced as quantized
    fast = profile(two_nodes(cross=LinkSpeed(200 * GB, 5e-6)), stage=3)
    given = CommPolicy(weights="int8", gradients="int8")
    got = plan(fast, 1000, 3, collectives=CollectivesRequest(compression=given, allow_lossy=True))
    assert got.compression == given and got.choice.compression_choice is None
    assert got.predicted_iteration_s != plan(fast, 1000, 3).predicted_iteration_s
    assert "quantized weights int8 and gradients int8" in got.table()
    with pytest.raises(PlanError, match="allow_lossy must be True or False"):
        CollectivesRequest(allow_lossy="yes")


@pytest.mark.parametrize("lossy_s, says", [(10.0, "to take as long as exact (a tie)"),
                                           (10.000001, "to take as long as exact (a tie)"),
                                           (9.9999, "to take as long as exact (a tie)"),
                                           (10.5, "5.0% slower"),
                                           (9.95, "0.5% faster, not more than the tie (2.0%)")])
def test_exact_kept_says_faster_or_slower_by_the_sign_and_a_tie_as_a_tie(lossy_s: float, says: str) -> None:
    """The line of a choice that kept exact: never a negative "slower" (a lossy option priced
    as exact once read "predicted -0.0% slower")."""
    from poplar.types.compression import QuantBits
    from poplar.types.plans import CompressionCandidate, CompressionChoice

    option = CommPolicy(weights=QuantBits.INT8)
    record = CompressionChoice(EXACT, 10.0, 10.0, 0.02, (CompressionCandidate(EXACT, 10.0),
                                                         CompressionCandidate(option, lossy_s)))
    line = record.describe()
    assert line.endswith(f"{option.describe()}, is predicted {says}") and "-" not in line.split("predicted")[-1], line
