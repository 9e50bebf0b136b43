"""The CPU emulator of GPU clusters: it makes CPU processes act as GPUs and a cluster, so that
Poplar's tests, benches and demo run on any machine. It sits beside the product: it uses the
product (a virtual device is a profiler ``Device`` and a ``ProfileObserver``; a virtual link is
a ``CollectiveObserver`` of the communicator), and the product never imports it.

- GPU presets and clusters: ``presets`` (the paper's GPUs as data), ``cluster`` (``ClusterSpec``,
  built-in clusters A, B, C, C-1:3, D, A-4+4, C-4+4, or a cluster file; nodes and their links).
- Devices: ``VirtualDevice`` (memory capacity counted in software, compute padded to a speed
  curve: ``speed_padding``, ``block_pacing``, ``saved_tensors``, ``speed_curves``), and
  ``cluster_device`` / ``ClusterDevice`` (rank r's GPU of a cluster, calibrated for the workload).
- Links: ``virtual_link`` (collectives of known duration), ``virtual_network`` (a link per node
  and one between nodes), ``cluster_network`` (a cluster's declared links at the emulation's
  scales), ``link_calibration``.
- Calibration: ``calibration`` (memory and time scales for a CPU-sized model), ``emulate``
  (``EmulatedCluster``, one device per rank), ``profile_cluster`` (profile a whole emulated
  cluster from one process), ``runs`` (a bench's run repeated until it held its speed).
- Faults: ``faults`` (injected drift). What-if and ground truth: ``synthetic`` (profiles from
  presets), ``what_if`` (``simulate`` on a cluster), ``ideal`` (the exact best plan).
"""

from poplar.emulation.calibration import Calibration, Scales, calibrate, calibrate_stages
from poplar.emulation.cluster import BUILTIN_CLUSTERS, ClusterError, ClusterSpec
from poplar.emulation.cluster_device import ClusterDevice, cluster_device
from poplar.emulation.cluster_network import NetworkScales, emulated_network, machine_floor
from poplar.emulation.emulate import EmulatedCluster, cluster_devices, emulate_cluster
from poplar.emulation.faults import FaultSchedule
from poplar.emulation.presets import PRESETS, DevicePreset, PresetError, get_preset
from poplar.emulation.profile_cluster import profile_cluster
from poplar.emulation.runs import until_on_time
from poplar.emulation.speed_curves import PresetCurve, SaturatingCurve
from poplar.emulation.virtual_device import VirtualDevice
from poplar.emulation.virtual_network import NetworkSpec, VirtualNetwork
from poplar.emulation.what_if import simulate

__all__ = ["Calibration", "Scales", "calibrate", "calibrate_stages", "BUILTIN_CLUSTERS", "ClusterError",
           "ClusterSpec", "ClusterDevice", "cluster_device", "EmulatedCluster", "cluster_devices", "emulate_cluster",
           "FaultSchedule", "PRESETS", "DevicePreset", "PresetError", "get_preset", "profile_cluster",
           "until_on_time", "PresetCurve", "SaturatingCurve", "VirtualDevice", "simulate", "NetworkScales",
           "emulated_network", "machine_floor", "NetworkSpec", "VirtualNetwork"]
