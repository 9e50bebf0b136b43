"""The doors of a topology: ``poplar.topology`` in the JSON config, DeepSpeed's
``zero_hpz_partition_size`` (secondary shards: a node's size, or 1 for off; anything else a clear
error), and the launcher's nodes when none is declared (torchrun's variables)."""

from __future__ import annotations

import pytest

from poplar.auto import AutoOptions
from poplar.planner import plan
from poplar.train.config import ConfigError, TrainConfig, secondary_shards_of
from poplar.train.from_config import auto_collectives
from poplar.types.topology import Topology
from tests.planner.test_link_pricing import profile, two_nodes


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
    (2, (2, 2), None, '"stage" is not given'),
])
def test_hpz_sizes_poplar_cannot_honour_are_errors(size: int, nodes: tuple[int, ...], stage: int,
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        secondary_shards_of(size, Topology.of_sizes(nodes), stage)


def test_hpz_in_auto_mode_is_a_setting_the_planner_keeps() -> None:
    """DeepSpeed treats zero_hpz_partition_size as a setting: auto mode's planner plans with
    secondary shards where it is given, also where it would choose another way by itself; at 1
    (DeepSpeed's default) the planner chooses."""
    nodes = {"topology": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    cfg = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}, "poplar": nodes})
    assert auto_collectives(cfg, 8) == "secondary_shards"
    off = TrainConfig.from_dict({"zero_optimization": {"stage": 3}, "poplar": nodes})
    assert auto_collectives(off, 8) == "auto"
    # 256 samples: every rank's one step of 32 fits only without secondary shards' memory, so the
    # planner alone keeps hierarchical collectives; with hpZ given it plans secondary shards
    prof = profile(two_nodes())
    chosen = plan(prof, 256, 3, collectives=AutoOptions(collectives=auto_collectives(off, 8)).collectives_request,
                  participation="all")  # every GPU: which take part is another choice (test_participation.py)
    assert chosen.hierarchical and not chosen.secondary_shards
    kept = plan(prof, 256, 3, collectives=AutoOptions(collectives=auto_collectives(cfg, 8)).collectives_request)
    assert kept.hierarchical and kept.secondary_shards
    with pytest.raises(ConfigError, match='"stage" is not given'):  # hpZ is ZeRO-3's: auto mode is not asked to guess
        auto_collectives(TrainConfig.from_dict({"zero_optimization": {"zero_hpz_partition_size": 4}, "poplar": nodes}),
                         8)


def test_the_launcher_gives_the_nodes() -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "RANK": "3", "LOCAL_RANK": "1"}
    assert Topology.from_launcher(env, 4) == Topology.of_sizes([2, 2])
    assert Topology.from_launcher({}, 4) == Topology.single(4)  # no launcher: one node
    assert Topology.from_launcher({**env, "RANK": "2"}, 4) == Topology.single(4)  # not torchrun's numbering
    assert Topology.from_launcher({**env, "LOCAL_WORLD_SIZE": "3"}, 4) == Topology.single(4)  # unequal: declare them
