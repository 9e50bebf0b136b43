"""A malformed profile names the field that is wrong (and what it must be)."""

from __future__ import annotations

import copy

import pytest

from poplar.types.profiles import Profile, ProfileError

GOOD = {
    "zero_stage": 2, "world_size": 2, "param_count": 1000, "param_bytes": 4000,
    "ranks": [{"rank": r, "device_type": "A100-80G", "mbs": 8, "points": [{"batch": 1, "compute_s": 0.01},
                                                                          {"batch": 8, "compute_s": 0.05}]}
              for r in range(2)],
    "comm": {"links": {"bandwidth_bytes_per_s": 1e9}},
    "schema_version": 2,
}


def _set(path: list, value) -> dict:
    d = copy.deepcopy(GOOD)
    target = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


def test_the_good_profile_loads() -> None:
    assert Profile.from_dict(copy.deepcopy(GOOD)).ranks[1].points[1].batch == 8


@pytest.mark.parametrize("path, value, needle", [
    (["ranks", 1, "mbs"], "8", "profile field ranks[1].mbs must be an integer, got '8' (str)"),
    (["ranks", 0, "points", 1, "batch"], 2.5, "ranks[0].points[1].batch must be an integer, got 2.5"),
    (["ranks", 0, "points", 0, "compute_s"], "fast", "ranks[0].points[0].compute_s must be a number"),
    (["ranks", 1, "device_type"], 7, "ranks[1].device_type must be a string"),
    (["ranks", 1, "capacity_bytes"], "80G", "ranks[1].capacity_bytes must be an integer or null"),
    (["ranks", 1, "points"], {"batch": 1}, "ranks[1].points must be a list of points"),
    (["ranks", 0, "points", 0], 3, "ranks[0].points[0] must be an object"),
    (["ranks", 1], "A100", "ranks[1] must be an object"),
    (["ranks"], {}, "profile field ranks must be a list"),
    (["comm", "links", "bandwidth_bytes_per_s"], None, "comm.links.bandwidth_bytes_per_s must be a number, got None"),
    (["comm", "exposure"], {"leaders": [{"device_type": "A100-80G", "micro_step_s": "x"}]},
     "comm.exposure.leaders[0].micro_step_s must be a number or null"),
    (["comm", "exposure"], {"leaders": [3]}, "comm.exposure.leaders[0] must be an object"),
    (["world_size"], True, "world_size must be an integer, got True (bool)"),
    (["zero_stage"], "2", "zero_stage must be an integer"),
])
def test_a_malformed_field_is_named(path: list, value, needle: str) -> None:
    with pytest.raises(ProfileError) as info:
        Profile.from_dict(_set(path, value))
    assert needle in str(info.value)
