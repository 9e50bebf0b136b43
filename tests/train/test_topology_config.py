"""The doors of a topology: ``poplar.topology`` in the JSON config, DeepSpeed's
``zero_hpz_partition_size`` (secondary shards: a node's size, or 1 for off; anything else a clear
error), and the launcher's nodes when none is declared (torchrun's variables)."""

from __future__ import annotations

import pytest

from poplar.train.config import ConfigError, TrainConfig, secondary_shards_of
from poplar.types.topology import Topology


def test_the_config_declares_nodes_and_hpz_maps_to_secondary_shards() -> None:
    cfg = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2},
                                 "poplar": {"topology": [[0, 1], [2, 3]]}})
    assert cfg.topology == Topology.of_sizes([2, 2]) and cfg.hpz_partition_size == 2
    assert secondary_shards_of(cfg.hpz_partition_size, cfg.topology, 3)
    assert not secondary_shards_of(1, cfg.topology, 3)  # DeepSpeed's default: off
    assert TrainConfig.from_dict({"poplar": {"topology": {"nodes": [[0, 1, 2], [3]]}}}).topology.sizes == (3, 1)
    assert TrainConfig.from_dict({}).topology is None


@pytest.mark.parametrize("topology, message", [
    ([[0, 2], [1, 3]], "consecutive runs of ranks"),
    ("two nodes", "a list of nodes, each a list of ranks"),
    ([[0, 1], []], "at least one rank"),
])
def test_a_bad_topology_names_the_fix(topology: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"poplar": {"topology": topology}})


@pytest.mark.parametrize("size, nodes, stage, message", [
    (3, (2, 2), 3, "give the size of every node"),
    (2, (3, 1), 3, "give the size of every node"),
    (2, (2,), 3, "give the size of every node"),
    (2, (2, 2), 2, 'set "stage": 3'),
])
def test_hpz_sizes_poplar_cannot_honour_are_errors(size: int, nodes: tuple[int, ...], stage: int,
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        secondary_shards_of(size, Topology.of_sizes(nodes), stage)


def test_the_launcher_gives_the_nodes() -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "3", "LOCAL_RANK": "1"}
    assert Topology.from_launcher(env, 4) == Topology.of_sizes([2, 2])
    assert Topology.from_launcher({}, 4) == Topology.single(4)  # no launcher: one node
    assert Topology.from_launcher({**env, "RANK": "2"}, 4) == Topology.single(4)  # not torchrun's numbering
    assert Topology.from_launcher({**env, "LOCAL_WORLD_SIZE": "3"}, 4) == Topology.single(4)  # unequal: declare them
