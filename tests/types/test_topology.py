"""Topology: nodes as consecutive rank runs, and its errors."""

import json

import pytest

from poplar.types.topology import Link, Topology, TopologyError, Wire


def test_nodes_of_unequal_size_know_each_rank_s_node_and_local_rank():
    t = Topology.of_sizes([4, 3])
    assert t.nodes == ((0, 1, 2, 3), (4, 5, 6))
    assert (t.world_size, t.node_count, t.sizes, t.spans_nodes) == (7, 2, (4, 3), True)
    assert [t.node_of(r) for r in range(7)] == [0, 0, 0, 0, 1, 1, 1]
    assert [t.local_rank(r) for r in range(7)] == [0, 1, 2, 3, 0, 1, 2]
    assert t.describe() == "2 nodes: [0-3] [4-6]"


def test_declared_lists_become_tuples_and_round_trip_through_json():
    t = Topology(nodes=[[0, 1], [2, 3]])
    assert t == Topology.of_sizes([2, 2])
    assert Topology.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_a_single_node_does_not_span_nodes():
    t = Topology.single(3)
    assert not t.spans_nodes and t.describe() == "1 node: [0-2]"


@pytest.mark.parametrize("nodes", [[[0, 2], [1, 3]], [[0, 1], [1, 2]], [[1, 2]], [[0], []]])
def test_nodes_that_are_not_consecutive_runs_are_refused_naming_the_fix(nodes):
    with pytest.raises(TopologyError, match="node"):
        Topology(nodes=nodes)


def test_a_topology_for_another_world_size_names_the_problem():
    assert Topology.of_sizes([2, 2]).problem(4) is None
    assert "has 4 ranks but the world has 3" in Topology.of_sizes([2, 2]).problem(3)


def test_the_world_wire_is_flat_over_every_rank():
    assert Wire.world(3) == Wire(Link.FLAT, (0, 1, 2))
    assert str(Link.CROSS) == "cross-node" and Link.INTRA == "intra-node"
