"""The profile store: measured profiles kept per device type, keyed by what they depend on, so a
start profiles only the device types it has no profile for.

A profile's rank parts depend on the model (its parameter names, shapes and dtypes, and its
optimizer's class), the configuration asked for (ZeRO stage, the stages auto mode may choose
among, activation checkpointing, the choice rule), the precision, the shape of one sample, the
runtime's bucket size and Poplar's version: together the ``StoreKey``. They do not depend on
which other devices share the job, except for the communication costs, which are measured on
one mix of devices and world size and kept with each entry (``Entry.cluster``).

On disk (JSON): ``<dir>/<key digest>/<device type>.json``, one ``Entry`` per device type: the key
(checked on read, so a digest collision or a hand-copied file cannot be taken for another key),
the configuration the run chose, one rank's ``RankProfile`` of that type, and the cluster-wide
parts of the profile it came from (communication, model size, meta). Written atomically by one
process (rank 0), read by any; a file that does not parse is ignored with a warning.

``assemble`` makes a whole ``Profile`` for a job from one entry per device type of its ranks:
the communication profile is the entry's whose mix is the job's, else the most recent entry's,
keeping the link's fit and its exposures (measured on another mix: an approximation the
re-planner corrects from measured iterations).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from poplar.types.plans import write_text_atomic
from poplar.types.profiles import CommProfile, Profile, ProfileError, RankProfile

FORMAT = 1
ENV_VAR = "POPLAR_PROFILE_STORE"  # a directory, or "off"


def default_store_dir() -> Path | None:
    """``$POPLAR_PROFILE_STORE`` ("off": no store), else ``$XDG_CACHE_HOME/poplar/profiles``
    (``~/.cache/poplar/profiles``)."""
    given = os.environ.get(ENV_VAR)
    if given is not None:
        return None if given.strip().lower() in ("", "off", "none", "0") else Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "poplar" / "profiles"


@dataclass(frozen=True)
class StoreKey:
    """What a device type's profile depends on (JSON-safe values only)."""

    model: str  # fingerprint: class, parameter names/shapes/dtypes, optimizer class
    zero_stage: int  # the stage asked for
    stages: tuple[int, ...]  # the stages auto mode may choose among
    checkpointing: str  # "auto" (auto mode tries off and on), "off", "on" or the policy's repr
    rule: str  # auto mode's choice rule ("fastest", "first_fit", or "single" for one configuration)
    precision: str
    sample: str  # the shape of one sample's tensors
    bucket_size_mb: float
    poplar_version: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = list(self.stages)
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Entry:
    """One device type's stored profile."""

    key: dict[str, Any]
    device_type: str
    zero_stage: int  # the configuration the run chose
    activation_checkpointing: bool
    rank: RankProfile  # one rank of this type (its curve is its type's)
    cluster: list[str]  # the device type of every rank of the run that measured it
    comm: dict[str, Any]  # that run's CommProfile
    param_count: int
    param_bytes: int
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # that run's Profile.meta
    saved_at: float = 0.0  # time.time() when it was written
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rank"] = asdict(self.rank)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Entry":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ProfileError(f"not a profile store entry of format {FORMAT}")
        try:
            d = dict(d)
            d["rank"] = RankProfile(**d["rank"])
            return cls(**d)
        except (TypeError, KeyError) as e:
            raise ProfileError(f"malformed profile store entry: {e}") from None

    @property
    def configuration(self) -> tuple[int, bool]:
        return self.zero_stage, self.activation_checkpointing


def entries_of(profile: Profile, key: StoreKey, checkpointed: bool) -> list[Entry]:
    """One entry per device type of ``profile`` (its first rank of that type)."""
    cluster = [r.device_type for r in profile.ranks]
    meta = {k: v for k, v in profile.meta.items() if k not in ("ranks", "store")}
    now = time.time()
    out = []
    for dtype in profile.device_types():
        rank = next(r for r in profile.ranks if r.device_type == dtype)
        out.append(Entry(key.to_dict(), dtype, profile.zero_stage, checkpointed, rank, cluster, asdict(profile.comm),
                         profile.param_count, profile.param_bytes, profile.model_name, meta, now))
    return out


def _file_name(device_type: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", device_type) + ".json"


class ProfileStore:
    """The entries under ``directory`` (see the module doc). ``max_age_s``: older entries are
    stale (None: entries stay fresh until the key changes)."""

    def __init__(self, directory: str | os.PathLike, max_age_s: float | None = None) -> None:
        self.directory, self.max_age_s = Path(directory), max_age_s
        self.warnings: list[str] = []  # files that could not be read, since the store was made

    def path(self, key: StoreKey, device_type: str) -> Path:
        return self.directory / key.digest() / _file_name(device_type)

    def get(self, key: StoreKey, device_type: str) -> Entry | None:
        """The fresh entry of ``device_type`` under ``key``, or None."""
        path = self.path(key, device_type)
        if not path.is_file():
            return None
        try:
            entry = Entry.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            self.warnings.append(f"ignoring the stored profile {path}: {e}")
            return None
        if entry.key != key.to_dict() or entry.device_type != device_type:
            return None
        if self.max_age_s is not None and time.time() - entry.saved_at > self.max_age_s:
            return None
        return entry

    def lookup(self, key: StoreKey, device_types: list[str]) -> dict[str, Entry]:
        """The fresh entries among ``device_types`` (each once)."""
        found = {}
        for dtype in dict.fromkeys(device_types):
            entry = self.get(key, dtype)
            if entry is not None:
                found[dtype] = entry
        return found

    def put(self, entry: Entry) -> Path:
        key = entry.key
        path = self.directory / StoreKey(**{**key, "stages": tuple(key["stages"])}).digest() / \
            _file_name(entry.device_type)
        write_text_atomic(path, json.dumps(entry.to_dict(), indent=1) + "\n")
        return path

    def save(self, profile: Profile, key: StoreKey, checkpointed: bool, only: set[str] | None = None) -> list[Path]:
        """Keep ``profile``'s device types (``only``: these of them). Only a profile measured at
        even shards can be kept: at uneven weights a rank's mbs is its weight's, not its type's."""
        if profile.shard_weights is not None and len(set(profile.shard_weights)) > 1:
            raise ProfileError("a profile measured at uneven shard weights cannot be kept per device type")
        return [self.put(e) for e in entries_of(profile, key, checkpointed) if only is None or e.device_type in only]


def agreed_configuration(entries: dict[str, Entry]) -> tuple[int, bool] | None:
    """The configuration every entry was chosen at, or None when they differ (or there are none)."""
    configs = {e.configuration for e in entries.values()}
    return next(iter(configs)) if len(configs) == 1 else None


def assemble(entries: dict[str, Entry], cluster: list[str]) -> Profile:
    """The profile of a job whose rank r has device type ``cluster[r]``, from one entry per type
    (which must agree on the configuration; ``agreed_configuration``)."""
    config = agreed_configuration(entries)
    missing = [t for t in dict.fromkeys(cluster) if t not in entries]
    if config is None or missing:
        raise ProfileError(f"cannot assemble a profile: missing {missing} or the entries' configurations differ")
    same_mix = [e for e in entries.values() if e.cluster == cluster]
    base = max(same_mix or entries.values(), key=lambda e: e.saved_at)
    comm = CommProfile(**base.comm)
    if base.cluster != cluster:  # exposures led by a device type the job lacks do not apply
        for name in ("exposed_micro_step_lead_s", "exposed_iteration_lead_s", "exposed_small_lead",
                     "exposed_micro_step_small_lead_s", "exposed_iteration_small_lead_s"):
            led = getattr(comm, name)
            if led is not None:
                setattr(comm, name, {t: v for t, v in led.items() if t in cluster} or None)
    ranks = []
    for r, dtype in enumerate(cluster):
        part = asdict(entries[dtype].rank)
        part["rank"] = r
        ranks.append(RankProfile(**part))
    meta = dict(base.meta)
    if base.cluster != cluster:
        meta.pop("cluster", None)  # the cluster it names is the storing run's, not this job's
    meta["store"] = {"reused": sorted(entries), "comm_from": base.cluster,
                     "saved_at": {t: e.saved_at for t, e in entries.items()}}
    return Profile(zero_stage=config[0], world_size=len(cluster), param_count=base.param_count,
                   param_bytes=base.param_bytes, ranks=ranks, comm=comm, model_name=base.model_name, meta=meta)
