"""Where each rank's model state lives, as the JSON config says it: its share of the sharded
state (``poplar.shards``) and whether its optimizer is offloaded to the host.

``poplar.shards`` is "even", "auto" (chosen with the batches) or one weight >= 0 per rank.
DeepSpeed's ``zero_optimization.offload_optimizer`` is all or nothing: ``{"device": "cpu"}``
(``pin_memory`` accepted: Poplar pins host state whenever the device is a GPU) means every rank
offloads, ``{"device": "none"}`` none. Poplar decides per rank: ``poplar.offload`` is ``"none"``,
``"all"``, a list of rank indices (``[1, 2]``: ranks 1 and 2 offload, the others keep their
optimizer on the device), or ``"auto"``: auto mode's planner offloads a rank only where that lets
the model fit or is predicted faster (``poplar.planner.offload_pricing``); it needs auto mode (no
plan file). Giving both keys is an error: they could disagree.

DeepSpeed's ``zero_optimization.offload_param`` (parameters in host memory, ZeRO-3) has no
equal in Poplar: a rank keeps the parameters it computes with on its GPU (at ZeRO-3 its shard and
the block being computed). What Poplar offloads is a rank's optimizer state and fp32 master
weights, most of its model state at ZeRO-3, so ``{"device": "cpu"}`` maps to that, every rank,
as ``offload_optimizer`` ``{"device": "cpu"}`` does; the run says so once (``PARAM_OFFLOAD``).
``{"device": "none"}`` moves nothing. ``offload_param`` to the host with ``offload_optimizer``
``{"device": "none"}`` asks for something Poplar does not do: an error naming both.
"""

from __future__ import annotations

from typing import Any

from poplar.types.plans import Offload, shard_weights_problem

# an offload setting: "none", "all", "auto" or the indices of the offloading ranks (None: the config says nothing,
# a plan file's rows keep theirs)
OffloadSetting = str | tuple[int, ...]

# DeepSpeed's offload_optimizer keys beyond "device" and "pin_memory": NVMe tuning, no meaning on the CPU
NVME_KEYS = {"nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init"}
# DeepSpeed's offload_param keys beyond "device" and "pin_memory": NVMe and buffer tuning
PARAM_KEYS = {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu"}
# what offload_param {"device": "cpu"} becomes (module doc), said once by the run
PARAM_OFFLOAD = ('{"device": "cpu"} became every rank\'s optimizer state and fp32 master weights in host memory '
                 '(as "offload_optimizer": {"device": "cpu"}): Poplar has no parameter offload, a rank keeps the '
                 "parameters it computes with on its GPU (at ZeRO-3 its shard and the block being computed)")


def read_shards(shards: Any, error: type[Exception]) -> str | tuple[float, ...]:
    """The ``poplar.shards`` value: "even", "auto" or one shard weight per rank."""
    if isinstance(shards, list) and shard_weights_problem(shards) is None:
        return tuple(float(w) for w in shards)
    if shards not in ("even", "auto"):
        raise error(f'"poplar.shards" must be "even", "auto" or a list of one weight >= 0 per rank (not all '
                    f'0), got {shards!r}')
    return shards


def read_offload(zero: dict, poplar: dict, error: type[Exception]) -> OffloadSetting | None:
    """The offload setting of a config's ``zero_optimization`` and ``poplar`` sections; ``error``
    (the config's error type) names a bad key and its fix."""
    deepspeed = _deepspeed_setting(zero, error)
    if "offload" not in poplar:
        return deepspeed
    for key in ("offload_optimizer", "offload_param"):
        if key in zero and (key == "offload_optimizer" or moves_parameters(zero)):
            raise error(f'"zero_optimization.{key}" and "poplar.offload" are both given; keep one '
                        '("poplar.offload" chooses per rank)')
    value = poplar["offload"]
    if value in ("none", "all", "auto"):
        return value
    if isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value) \
            and len(set(value)) == len(value):
        return tuple(sorted(value))
    raise error(f'"poplar.offload" must be "none", "all", "auto" or a list of distinct rank indices (e.g. [1, 2]: ranks 1 '
                f'and 2 keep their optimizer state in host memory), got {value!r}')


def moves_parameters(zero: dict) -> bool:
    """Whether a ``zero_optimization`` section's ``offload_param`` asks for host memory."""
    section = zero.get("offload_param")
    return isinstance(section, dict) and section.get("device", "none") != "none"


def _deepspeed_setting(zero: dict, error: type[Exception]) -> OffloadSetting | None:
    """The offload DeepSpeed's two keys ask for (module doc); None where neither says."""
    optimizer = _read_deepspeed(zero.get("offload_optimizer"), "offload_optimizer", error)
    if _read_deepspeed(zero.get("offload_param"), "offload_param", error) != "all":
        return optimizer
    if optimizer == "none":
        raise error('"zero_optimization.offload_param" asks for parameters in host memory but "offload_optimizer" '
                    'says "device": "none": Poplar has no parameter offload, it offloads the optimizer state and '
                    'fp32 master weights instead; set "offload_optimizer": {"device": "cpu"} (the nearest to '
                    'parameter offload), or "offload_param": {"device": "none"}')
    return "all"


def _read_deepspeed(section: Any, key: str, error: type[Exception]) -> OffloadSetting | None:
    where = f'"zero_optimization.{key}"'
    if section is None:
        return None
    if not isinstance(section, dict):
        raise error(f'{where} must be a dict such as {{"device": "cpu", "pin_memory": true}}, got {section!r}')
    tuning = NVME_KEYS | {"ratio"} if key == "offload_optimizer" else PARAM_KEYS
    unknown = sorted(set(section) - {"device", "pin_memory"} - tuning)
    if unknown:
        raise error(f"{where} has keys Poplar does not know: {unknown}; it reads \"device\" and \"pin_memory\"")
    device = section.get("device", "none")
    if device == "nvme":
        raise error(f'{where}: Poplar offloads to the CPU, not to NVMe; set "device": "cpu"')
    if device not in ("cpu", "none"):
        raise error(f'{where}: "device" must be "cpu" or "none", got {device!r}')
    if not isinstance(section.get("pin_memory", True), bool):
        raise error(f'{where}: "pin_memory" must be true or false, got {section["pin_memory"]!r}')
    if section.get("ratio", 1.0) != 1.0:
        raise error(f'{where}: "ratio" below 1 (a part of the state offloaded) is not supported; Poplar offloads a '
                    'whole rank: list the ranks in "poplar.offload" instead')
    return "all" if device == "cpu" else "none"


def offload_rows(setting: OffloadSetting, world_size: int, error: type[Exception]) -> tuple[Offload, ...]:
    """Every rank's placement under ``setting`` (not "auto": the planner chooses those)."""
    if setting == "auto":
        raise error('"poplar.offload": "auto" lets auto mode\'s planner choose; it cannot apply to a plan file: give '
                    '"none", "all" or rank indices with "poplar.plan", or leave the plan to auto mode')
    if setting == "none":
        return (Offload.NONE,) * world_size
    if setting == "all":
        return (Offload.OPTIMIZER,) * world_size
    beyond = [r for r in setting if r >= world_size]
    if beyond:
        raise error(f'"poplar.offload" names ranks {beyond} but the world has {world_size} ranks (0..{world_size - 1})')
    return tuple(Offload.OPTIMIZER if r in setting else Offload.NONE for r in range(world_size))

