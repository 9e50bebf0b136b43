"""Cluster descriptions: which device types, how many of each, and the link between them.

A cluster file is JSON::

    {"name": "B", "devices": [{"type": "V100-16G", "count": 2}, {"type": "T4-16G", "count": 2}],
     "bandwidth_gbps": 8.0, "latency_us": 30.0}

``type`` names a device preset (``poplar.emulation.presets``); ranks are numbered in the order
the devices are listed. ``bandwidth_gbps`` (GB/s, a collective's bus bandwidth, see
``poplar.planner.cost_model``) and ``latency_us`` are optional; the defaults are a PCIe-class
link. Built-in clusters are the paper's (types and links as in its Table 1, 2 ranks per type
to keep CPU emulation small; the paper ran A and C with 4 + 4), ``C-1:3`` from its quantity
study, and a 4-type cluster ``D``. ``check_precision`` refuses a precision some device lacks
(cluster B's V100 and T4 have no bf16: use fp16 there).

A cluster that spans machines declares its nodes, consecutive runs of ranks each with its own
intra-node link, and the network between them (a link preset of ``presets.LINKS`` by name, or
``{"bandwidth_gbps": ..., "latency_us": ...}``)::

    {"name": "A", "devices": [...], "nodes": [{"ranks": 2, "link": "nvlink-a100"},
     {"ranks": 2, "link": "pcie4"}], "network": "ib-100g"}

``topology()`` gives the job's ranks that ``Topology``; ``with_network`` picks another
inter-node link (``presets.FAST_NETWORK``, ``presets.SLOW_NETWORK``). The paper's A and C are
two nodes each: A has NVLink in its A100-80G node and PCIe 4.0 in its A100-40G node, C PCIe in
both (PCIe 3.0 for its V100S); ``A-4+4`` and ``C-4+4`` are the paper's sizes. A cluster without
nodes is one machine; its ``bandwidth_gbps`` / ``latency_us`` are the simulator's single link.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar.types.plans import read_json, write_text_atomic
from poplar.emulation.presets import FAST_NETWORK, LINKS, PRESETS, LinkPreset, PresetError, get_link, get_preset
from poplar.types.topology import Topology
from poplar.types.precision import precision_unsupported_message

DEFAULT_BANDWIDTH_GBPS = 10.0
DEFAULT_LATENCY_US = 30.0


class ClusterError(ValueError):
    """A cluster description that cannot be used, with the reason and the fix in its message."""


@dataclass
class DeviceCount:
    type: str
    count: int


@dataclass(frozen=True)
class NodeSpec:
    """One machine of a cluster: its next ``ranks`` ranks, joined by ``link``."""

    ranks: int
    link: LinkPreset


@dataclass
class ClusterSpec:
    name: str
    devices: list[DeviceCount]
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    latency_us: float = DEFAULT_LATENCY_US
    meta: dict[str, Any] = field(default_factory=dict)
    nodes: list[NodeSpec] | None = None  # None: one machine
    network: LinkPreset | None = None  # the link between nodes (default ``FAST_NETWORK`` when there are several)

    def __post_init__(self) -> None:
        self.devices = [d if isinstance(d, DeviceCount) else _device(d, i) for i, d in enumerate(self.devices)]
        where = f"cluster {self.name!r}"
        if self.nodes is not None:
            if not isinstance(self.nodes, list) or not self.nodes:
                raise ClusterError(f"{where}: \"nodes\" must be a non-empty list of {{\"ranks\", \"link\"}}")
            self.nodes = [n if isinstance(n, NodeSpec) else _node(n, f"{where}: node {i}")
                          for i, n in enumerate(self.nodes)]
        if self.network is not None or (self.nodes is not None and len(self.nodes) > 1):
            self.network = _link(self.network if self.network is not None else FAST_NETWORK, f"{where}: network")
        self.validate()

    def validate(self) -> None:
        where = f"cluster {self.name!r}"
        if not isinstance(self.name, str):
            raise ClusterError(f"{where}: name must be a string")
        if not self.devices:
            raise ClusterError(f"{where} lists no devices; add e.g. {{\"type\": \"T4-16G\", \"count\": 2}}")
        for i, d in enumerate(self.devices):
            if isinstance(d.count, bool) or not isinstance(d.count, int) or d.count < 1:
                raise ClusterError(f"{where}: device {i} ({d.type}) needs an int count >= 1, got {d.count!r}")
            try:
                get_preset(d.type)
            except PresetError as e:
                raise ClusterError(f"{where}: device {i}: {e}") from None
        for key in ("bandwidth_gbps", "latency_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    key == "bandwidth_gbps" and value == 0):
                raise ClusterError(f"{where}: {key} must be a positive number, got {value!r}")

        if self.nodes is not None and sum(n.ranks for n in self.nodes) != self.world_size:
            raise ClusterError(f"{where}: its nodes hold {sum(n.ranks for n in self.nodes)} ranks but it lists "
                               f"{self.world_size} devices; give every device's rank to exactly one node")

    @property
    def world_size(self) -> int:
        return sum(d.count for d in self.devices)

    def topology(self) -> Topology:
        """The job's ranks grouped into the cluster's machines (one node when it declares none)."""
        if self.nodes is None:
            return Topology.single(self.world_size)
        return Topology.of_sizes([n.ranks for n in self.nodes])

    def node_links(self) -> list[LinkPreset]:
        """Each node's intra-node link (a cluster without nodes: its single declared link)."""
        if self.nodes is None:
            return [LinkPreset("declared", self.bandwidth_gbps, self.latency_us)]
        return [n.link for n in self.nodes]

    def with_network(self, network: "str | LinkPreset | dict[str, Any]") -> "ClusterSpec":
        """The same cluster with another link between its nodes (a preset name, e.g.
        ``presets.SLOW_NETWORK``, a ``LinkPreset``, or {"bandwidth_gbps", "latency_us"})."""
        if self.nodes is None or len(self.nodes) < 2:
            raise ClusterError(f"cluster {self.name!r} is one machine: a network joins nodes; declare its "
                               "\"nodes\" first")
        return ClusterSpec(self.name, list(self.devices), self.bandwidth_gbps, self.latency_us, dict(self.meta),
                           list(self.nodes), _link(network, f"cluster {self.name!r}: network"))

    def rank_types(self) -> list[str]:
        """One device type per rank, in rank order."""
        return [d.type for d in self.devices for _ in range(d.count)]

    def describe(self) -> str:
        return f"{self.name}: " + " + ".join(f"{d.count}x {d.type}" for d in self.devices)

    def unsupported(self, precision: Any) -> dict[str, list[int]]:
        """Device types that cannot compute in ``precision`` (a name, ``Precision`` or policy),
        each with its ranks."""
        out: dict[str, list[int]] = {}
        for rank, t in enumerate(self.rank_types()):
            if not get_preset(t).supports(precision):
                out.setdefault(t, []).append(rank)
        return out

    def check_precision(self, precision: Any) -> None:
        """ClusterError naming the devices that lack ``precision`` (e.g. bf16 on V100 / T4)."""
        missing = self.unsupported(precision)
        if missing:
            raise ClusterError(f"cluster {self.name!r}: {precision_unsupported_message(precision, missing)}")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "devices": [{"type": x.type, "count": x.count} for x in self.devices],
                             "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}
        if self.meta:
            d["meta"] = self.meta
        if self.nodes is not None:
            d["nodes"] = [{"ranks": n.ranks, "link": _link_json(n.link)} for n in self.nodes]
        if self.network is not None:
            d["network"] = _link_json(self.network)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "cluster") -> "ClusterSpec":
        if not isinstance(d, dict):
            raise ClusterError(f"{where} must be a JSON object with \"name\" and \"devices\", got {type(d).__name__}")
        unknown = set(d) - {"name", "devices", "bandwidth_gbps", "latency_us", "meta", "nodes", "network"}
        if unknown:
            raise ClusterError(f"{where}: unknown keys {sorted(unknown)}; allowed: name, devices, "
                               "bandwidth_gbps, latency_us, meta, nodes, network")
        if "devices" not in d:
            raise ClusterError(f"{where}: missing key \"devices\" (a list of {{\"type\", \"count\"}})")
        if not isinstance(d["devices"], list):
            raise ClusterError(f"{where}: \"devices\" must be a list, got {type(d['devices']).__name__}")
        return cls(name=d.get("name", Path(str(where)).stem), devices=d["devices"],
                   bandwidth_gbps=d.get("bandwidth_gbps", DEFAULT_BANDWIDTH_GBPS),
                   latency_us=d.get("latency_us", DEFAULT_LATENCY_US), meta=d.get("meta", {}),
                   nodes=d.get("nodes"), network=d.get("network"))

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSpec":
        return cls.from_dict(read_json(path, "cluster file", ClusterError), where=str(path))

    @classmethod
    def builtin(cls, name: str) -> "ClusterSpec":
        if name not in BUILTIN_CLUSTERS:
            raise ClusterError(f"unknown built-in cluster {name!r}; built-in: {', '.join(BUILTIN_CLUSTERS)} "
                               "(or give a cluster JSON file)")
        return cls.from_dict(json.loads(json.dumps(BUILTIN_CLUSTERS[name])), where=f"built-in {name}")

    @classmethod
    def resolve(cls, name_or_path: "str | os.PathLike | ClusterSpec") -> "ClusterSpec":
        """A ClusterSpec, a built-in name, or a path to a cluster file."""
        if isinstance(name_or_path, ClusterSpec):
            return name_or_path
        if isinstance(name_or_path, str) and name_or_path in BUILTIN_CLUSTERS:
            return cls.builtin(name_or_path)
        if Path(name_or_path).exists():
            return cls.load(name_or_path)
        raise ClusterError(f"{str(name_or_path)!r} is neither a built-in cluster ({', '.join(BUILTIN_CLUSTERS)}) "
                           "nor an existing cluster file")


def _device(d: Any, i: int) -> DeviceCount:
    if not isinstance(d, dict) or set(d) != {"type", "count"}:
        raise ClusterError(f"device {i} must be an object with exactly \"type\" and \"count\", got {d!r}")
    if not isinstance(d["type"], str):
        raise ClusterError(f"device {i}: type must be a preset name, got {d['type']!r}; known: {', '.join(PRESETS)}")
    return DeviceCount(d["type"], d["count"])


def _link(value: Any, where: str) -> LinkPreset:
    """A link preset from its name, a ``LinkPreset``, or {"bandwidth_gbps", "latency_us"[, "name"]}."""
    if isinstance(value, LinkPreset):
        return value
    try:
        if isinstance(value, str):
            return get_link(value)
        if isinstance(value, dict) and {"bandwidth_gbps", "latency_us"} <= set(value) <= {
                "bandwidth_gbps", "latency_us", "name"}:
            return LinkPreset(str(value.get("name", "custom")), value["bandwidth_gbps"], value["latency_us"])
    except PresetError as e:
        raise ClusterError(f"{where}: {e}") from None
    raise ClusterError(f"{where}: a link is a name ({', '.join(LINKS)}) or {{\"bandwidth_gbps\": ..., "
                       f"\"latency_us\": ...}}, got {value!r}")


def _link_json(link: LinkPreset) -> Any:
    if LINKS.get(link.name) == link:
        return link.name
    return {"name": link.name, "bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us}


def _node(d: Any, where: str) -> NodeSpec:
    if not isinstance(d, dict) or set(d) != {"ranks", "link"}:
        raise ClusterError(f"{where} must be an object with exactly \"ranks\" and \"link\", got {d!r}")
    if isinstance(d["ranks"], bool) or not isinstance(d["ranks"], int) or d["ranks"] < 1:
        raise ClusterError(f"{where}: ranks must be an int >= 1, got {d['ranks']!r}")
    return NodeSpec(d["ranks"], _link(d["link"], where))


# Links: A mixes NVLink (A100-80G) and PCIe 4.0 (A100-40G), and a ring runs at its slowest link;
# B and C are PCIe (the V100 generation is PCIe 3.0). GB/s are rough bus bandwidths for NCCL rings:
# the single link the simulator prices. A and C are two machines, one per GPU type, each node with
# its own link (``presets.LINKS``) and InfiniBand between them by default.
BUILTIN_CLUSTERS: dict[str, dict[str, Any]] = {
    "A": {"name": "A", "devices": [{"type": "A100-80G", "count": 2}, {"type": "A100-40G", "count": 2}],
          "bandwidth_gbps": 16.0, "latency_us": 20.0,
          "nodes": [{"ranks": 2, "link": "nvlink-a100"}, {"ranks": 2, "link": "pcie4"}], "network": FAST_NETWORK},
    "B": {"name": "B", "devices": [{"type": "V100-16G", "count": 2}, {"type": "T4-16G", "count": 2}],
          "bandwidth_gbps": 8.0, "latency_us": 30.0},
    "C": {"name": "C", "devices": [{"type": "A800-80G", "count": 2}, {"type": "V100S-32G", "count": 2}],
          "bandwidth_gbps": 10.0, "latency_us": 30.0,
          "nodes": [{"ranks": 2, "link": "pcie4"}, {"ranks": 2, "link": "pcie3"}], "network": FAST_NETWORK},
    "A-4+4": {"name": "A-4+4", "devices": [{"type": "A100-80G", "count": 4}, {"type": "A100-40G", "count": 4}],
              "bandwidth_gbps": 16.0, "latency_us": 20.0,
              "nodes": [{"ranks": 4, "link": "nvlink-a100"}, {"ranks": 4, "link": "pcie4"}], "network": FAST_NETWORK},
    "C-4+4": {"name": "C-4+4", "devices": [{"type": "A800-80G", "count": 4}, {"type": "V100S-32G", "count": 4}],
              "bandwidth_gbps": 10.0, "latency_us": 30.0,
              "nodes": [{"ranks": 4, "link": "pcie4"}, {"ranks": 4, "link": "pcie3"}], "network": FAST_NETWORK},
    "C-1:3": {"name": "C-1:3", "devices": [{"type": "A800-80G", "count": 1}, {"type": "V100S-32G", "count": 3}],
              "bandwidth_gbps": 10.0, "latency_us": 30.0},
    "D": {"name": "D", "devices": [{"type": "A100-80G", "count": 2}, {"type": "RTX4090-24G", "count": 2},
                                   {"type": "V100-16G", "count": 2}, {"type": "RTX3060-12G", "count": 2}],
          "bandwidth_gbps": 8.0, "latency_us": 30.0},
}
