"""The profile store: a cache of measured profiles kept per device type, keyed by what they
depend on, so a start profiles only the device types it has no profile for.

A profile's rank parts depend on the model and on the device, and on nothing else of the job
but the communication costs. The key (``StoreKey``) covers what changes compute and memory,
also where it leaves every shape alone:

- the model: its class, parameter and buffer names, shapes, dtypes and trainability, the
  class of every module in order (its structure), and its configuration where it has one (a
  Hugging Face config with its attention implementation and dtype); the optimizer's class;
- the configuration asked for (ZeRO stage, the stages auto mode may choose among, activation
  checkpointing, the choice rule), the precision, the shape of one sample, the runtime's
  bucket size;
- the torch version;

and each entry is checked against two more parts of it: the device (its name and capacity,
``Device.identity``) and the profile schema (``PROFILE_SCHEMA``, bumped when the profile format
or the profiler changes). An entry measured on another device of the same type name, or by a
profiler of another schema, is measured again. Every type a start measures again is named in its
store line with why (``ProfileStore.misses``): nothing of that type stored; stored for other
jobs only, with what differs between the nearest stored key and the job's (``key_changes``: the
model's fingerprint, each setting with both values); another schema; another device; too old.
The communication costs are measured on one mix of devices and world size and kept with each
entry (``Entry.cluster``).

On disk (JSON): ``<dir>/<key digest>/<device type>.json``, one ``Entry`` per device type: the key
(checked on read, so a digest collision or a hand-copied file cannot be taken for another key),
the device, the schema, the configuration the run chose, one rank's ``RankProfile`` of that
type, and the cluster-wide parts of the profile it came from (communication, model size,
precision, provenance, auto mode's choice). Written atomically by one process (rank 0), read by
any. Every field is checked where it is read (``check_entry``; a schema version must be a
number, not text). The store is a cache: a file that cannot be read or has a bad field is
skipped, and a directory that cannot be read or written is passed over, each with a warning
naming the path, the field and the reason (``ProfileStore.warnings``); the job goes on and
profiles what it needs.

``assemble`` makes a whole ``Profile`` for a job from one entry per device type of its ranks:
the communication profile is the entry's whose mix is the job's, else the most recent entry's,
keeping the link's fit and its exposures (measured on another mix: an approximation the
re-planner corrects from measured iterations).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from poplar.types.plans import write_text_atomic
from poplar.types.profiles import (PROFILE_SCHEMA, AutoChoice, CommProfile, Links, Profile, ProfileError,
                                   Provenance, RankProfile, StoreRecord)

ENV_VAR = "POPLAR_PROFILE_STORE"  # a directory, or "off"


def default_store_dir() -> Path | None:
    """``$POPLAR_PROFILE_STORE`` ("off": no store), else ``$XDG_CACHE_HOME/poplar/profiles``
    (``~/.cache/poplar/profiles``)."""
    given = os.environ.get(ENV_VAR)
    if given is not None:
        return None if given.strip().lower() in ("", "off", "none", "0") else Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "poplar" / "profiles"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


def module_structure(model: Any) -> str:
    """Digest of every module's name and class, in order: a model whose modules compute
    differently (another attention class, say) differs here where its parameters may not."""
    return _digest([[name, type(m).__qualname__] for name, m in model.named_modules()])


# keys of a Hugging Face config that say where it came from, not what the model computes
_CONFIG_ORIGIN = ("_name_or_path", "transformers_version", "_commit_hash")


def model_config(model: Any) -> str:
    """Digest of the model's configuration ("" without one): the first module's ``config`` (a
    Hugging Face ``PretrainedConfig``, a dataclass or a dict), with its attention implementation
    and dtype. Heads, attention kernels and dtypes change compute and memory but need not change
    a parameter's shape."""
    config = next((m.config for m in model.modules() if getattr(m, "config", None) is not None), None)
    if config is None:
        return ""
    if hasattr(config, "to_dict"):
        d = dict(config.to_dict())
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        d = dataclasses.asdict(config)
    elif isinstance(config, dict):
        d = dict(config)
    else:
        d = {"repr": repr(config)}
    d = {k: v for k, v in d.items() if k not in _CONFIG_ORIGIN}
    d["attn_implementation"] = getattr(config, "_attn_implementation", None)
    d["dtype"] = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    return _digest(d)


@dataclass(frozen=True)
class StoreKey:
    """What a device type's profile depends on, besides the device and the schema (JSON-safe values only)."""

    model: str  # fingerprint: class, parameter names/shapes/dtypes, optimizer class
    structure: str  # digest of the class of every module, in order
    config: str  # digest of the model's configuration (a Hugging Face config, attention, dtype); "" without one
    zero_stage: int  # the stage asked for
    stages: tuple[int, ...]  # the stages auto mode may choose among
    checkpointing: str  # "auto" (auto mode tries off and on), "off", "on" or the policy's repr
    rule: str  # auto mode's choice rule ("fastest", "first_fit", or "single" for one configuration)
    precision: str
    sample: str  # the shape of one sample's tensors
    bucket_size_mb: float
    torch_version: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = list(self.stages)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreKey":
        return cls(**{**d, "stages": tuple(d["stages"])})

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Entry:
    """One device type's stored profile."""

    key: StoreKey
    device_type: str
    device: str  # the device's identity: its name and capacity (``RankProfile.device_identity``)
    zero_stage: int  # the configuration the run chose
    activation_checkpointing: bool
    rank: RankProfile  # one rank of this type (its curve is its type's)
    cluster: list[str]  # the device type of every rank of the run that measured it
    comm: CommProfile  # that run's
    param_count: int
    param_bytes: int
    model_name: str = ""
    precision: str = "fp32"
    mixed_precision: dict[str, Any] | None = None
    provenance: Provenance = field(default_factory=Provenance)
    auto_choice: AutoChoice | None = None
    saved_at: float = 0.0  # time.time() when it was written

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["key"] = self.key.to_dict()
        return {"schema_version": PROFILE_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: Any, path: Path) -> "Entry":
        """The entry of the JSON object read from ``path``; a ``StaleEntry`` if another schema
        wrote it, a ``ProfileError`` naming ``path`` and the field if a field is bad. Every field
        is checked here, where it is read (``check_entry``)."""
        if not isinstance(d, dict):
            raise ProfileError(f"stored profile {path} is not a JSON object")
        try:
            version = check_schema(d)
        except ProfileError as e:
            raise ProfileError(f"stored profile {path} has a bad field: {e}") from None
        if version != PROFILE_SCHEMA:
            raise StaleEntry(f"its entry {path} was written by profile schema {version}, this Poplar's is "
                             f"{PROFILE_SCHEMA}")
        try:
            check_entry(d)
            d = {k: v for k, v in d.items() if k != "schema_version"}
            # the stored rank, checked as every rank of the run that stored it (every field its JSON
            # type; the communication profile's links are that run's, its nodes included)
            ranks = [{**d["rank"], "rank": r, "device_type": t} for r, t in enumerate(d["cluster"])]
            check = Profile(d["zero_stage"], len(ranks), d["param_count"], d["param_bytes"], ranks, d["comm"],
                            provenance=d.get("provenance") or Provenance(), auto_choice=d.get("auto_choice"))
            return cls(**{**d, "key": StoreKey.from_dict(d["key"]), "rank": RankProfile(**d["rank"]),
                          "comm": check.comm, "provenance": check.provenance, "auto_choice": check.auto_choice})
        except (TypeError, KeyError, ProfileError) as e:
            raise ProfileError(f"stored profile {path} has a bad field: {e}") from None

    @property
    def configuration(self) -> tuple[int, bool]:
        return self.zero_stage, self.activation_checkpointing


class StaleEntry(ProfileError):
    """A stored entry written by a profiler of another profile schema."""


# an entry's own fields on disk (its rank, communication, provenance and choice are checked as a
# profile's): the JSON types each may have, in words, and whether it must be there
_INT, _NUMBER, _NULL = (int,), (int, float), (type(None),)
ENTRY_FIELDS: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "key": ((dict,), "an object (the store key)", True),
    "device_type": ((str,), "a string", True),
    "device": ((str,), "a string (the device's name and capacity)", True),
    "zero_stage": (_INT, "an integer, 0 to 3", True),
    "activation_checkpointing": ((bool,), "true or false", True),
    "rank": ((dict,), "an object (one rank's profile)", True),
    "cluster": ((list,), "a non-empty list of device type names", True),
    "comm": ((dict,), "an object (the communication profile)", True),
    "param_count": (_INT, "an integer", True),
    "param_bytes": (_INT, "an integer", True),
    "model_name": ((str,), "a string", False),
    "precision": ((str,), "a string", False),
    "mixed_precision": ((dict,) + _NULL, "an object or null", False),
    "provenance": ((dict,) + _NULL, "an object or null", False),
    "auto_choice": ((dict,) + _NULL, "an object or null", False),
    "saved_at": (_NUMBER, "a number (seconds since the epoch)", False),
}
# the store key's fields (``StoreKey``), likewise
KEY_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"), "structure": ((str,), "a string"), "config": ((str,), "a string"),
    "zero_stage": (_INT, "an integer"), "stages": ((list,), "a list of integers"),
    "checkpointing": ((str,), "a string"), "rule": ((str,), "a string"), "precision": ((str,), "a string"),
    "sample": ((str,), "a string"), "bucket_size_mb": (_NUMBER, "a number"), "torch_version": ((str,), "a string"),
}


def _field(value: Any, types: tuple[type, ...], name: str, what: str) -> None:
    """A ``ProfileError`` naming field ``name`` where ``value`` is none of ``types`` (a bool is no number)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ProfileError(f'field "{name}" must be {what}, got {value!r} ({type(value).__name__})')


def check_schema(d: dict) -> int:
    """The entry's profile schema (1 where none is written: entries before schema versions); a
    ``ProfileError`` naming the field where it is not an integer (text such as "3" included)."""
    version = d.get("schema_version", 1)
    _field(version, _INT, "schema_version", "an integer (the profile schema that wrote it)")
    return version


def check_entry(d: dict) -> None:
    """Every field of an entry's JSON object its type (``ENTRY_FIELDS``, ``KEY_FIELDS``); a
    ``ProfileError`` naming the first field that is missing, unknown or bad."""
    unknown = sorted(set(d) - set(ENTRY_FIELDS) - {"schema_version"})
    if unknown:
        raise ProfileError(f'unknown field "{unknown[0]}"')
    for name, (types, what, required) in ENTRY_FIELDS.items():
        if name not in d:
            if required:
                raise ProfileError(f'field "{name}" is missing')
            continue
        _field(d[name], types, name, what)
    if not 0 <= d["zero_stage"] <= 3:
        raise ProfileError(f'field "zero_stage" must be an integer, 0 to 3, got {d["zero_stage"]!r}')
    if not d["cluster"] or d["device_type"] not in d["cluster"]:
        raise ProfileError(f'field "cluster" must list the device type of every rank of the run that stored the '
                           f'entry, {d["device_type"]!r} among them, got {d["cluster"]!r}')
    for i, dtype in enumerate(d["cluster"]):
        _field(dtype, (str,), f"cluster[{i}]", "a device type name (a string)")
    if not math.isfinite(d.get("saved_at", 0.0)):
        raise ProfileError(f'field "saved_at" must be a finite number, got {d["saved_at"]!r}')
    key = d["key"]
    if set(key) != set(KEY_FIELDS):
        odd = sorted(set(key) ^ set(KEY_FIELDS))
        raise ProfileError(f'field "key.{odd[0]}" is {"unknown" if odd[0] in key else "missing"}')
    for name, (types, what) in KEY_FIELDS.items():
        _field(key[name], types, f"key.{name}", what)
    for i, stage in enumerate(key["stages"]):
        _field(stage, _INT, f"key.stages[{i}]", "an integer")


# what each part of a store key is, in a line that says what changed
_MODEL_PARTS = {"model": "model fingerprint (parameters, buffers, optimizer class)", "structure": "module classes",
                "config": "model configuration"}
_SETTINGS = {"zero_stage": "ZeRO stage", "stages": "stages to choose among", "checkpointing": "activation checkpointing",
             "rule": "choice rule", "precision": "precision", "sample": "sample shape", "bucket_size_mb": "bucket MB",
             "torch_version": "torch version"}


def key_changes(stored: StoreKey, wanted: StoreKey) -> list[str]:
    """What differs between a stored key and the job's, in words: the model's parts (its
    fingerprint), then each setting with both values; [] where they are equal."""
    model = [words for name, words in _MODEL_PARTS.items() if getattr(stored, name) != getattr(wanted, name)]
    out = [", ".join(model)] if model else []
    for name, words in _SETTINGS.items():
        was, now = getattr(stored, name), getattr(wanted, name)
        if was != now:
            out.append(f"{words} {_said(was)} (this job's {_said(now)})")
    return out


def _said(value: Any) -> str:
    return f"{list(value)}" if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else str(value)


def entries_of(profile: Profile, key: StoreKey, checkpointed: bool) -> list[Entry]:
    """One entry per device type of ``profile`` (its first rank of that type)."""
    cluster = [r.device_type for r in profile.ranks]
    now = time.time()
    out = []
    for dtype in profile.device_types():
        rank = next(r for r in profile.ranks if r.device_type == dtype)
        out.append(Entry(key, dtype, rank.device_identity, profile.zero_stage, checkpointed, rank, cluster,
                         profile.comm, profile.param_count, profile.param_bytes, profile.model_name,
                         profile.precision, profile.mixed_precision, profile.provenance, profile.auto_choice, now))
    return out


def _file_name(device_type: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", device_type) + ".json"


class ProfileStore:
    """The entries under ``directory`` (see the module doc). ``max_age_s``: older entries are
    stale (None: entries stay fresh until the key changes)."""

    def __init__(self, directory: str | os.PathLike, max_age_s: float | None = None) -> None:
        self.directory, self.max_age_s = Path(directory), max_age_s
        self.warnings: list[str] = []  # entries skipped and paths that could not be read or written
        self.misses: dict[str, str] = {}  # device types looked up and not found -> why (``why_missing``)

    def take_warnings(self) -> list[str]:
        """The warnings since the last call (each reported once)."""
        out, self.warnings = self.warnings, []
        return out

    def take_misses(self) -> dict[str, str]:
        """Why each device type looked up since the last call had no entry to reuse."""
        out, self.misses = self.misses, {}
        return out

    def path(self, key: StoreKey, device_type: str) -> Path:
        return self.directory / key.digest() / _file_name(device_type)

    def get(self, key: StoreKey, device_type: str, device: str | None = None) -> Entry | None:
        """The fresh entry of ``device_type`` under ``key``, measured on ``device`` (an identity,
        ``Device.identity``; None: any), or None, with why in ``misses``."""
        entry, why = self._read(key, device_type)
        if entry is not None and device is not None and entry.device != device:
            entry, why = None, f"its entry was measured on {entry.device or 'another device'}, this job's is {device}"
        if entry is not None and self.max_age_s is not None and time.time() - entry.saved_at > self.max_age_s:
            entry, why = None, f"its entry is older than the store's {self.max_age_s:g} s"
        if entry is None:
            self.misses[device_type] = why
        return entry

    def _read(self, key: StoreKey, device_type: str) -> tuple[Entry | None, str]:
        """The entry at ``key``'s path for ``device_type``, or None and why."""
        path = self.path(key, device_type)
        try:
            if not path.is_file():
                return None, self.why_missing(key, device_type)
            entry = Entry.from_dict(json.loads(path.read_text()), path)
        except StaleEntry as e:
            return None, str(e)
        except OSError as e:
            self.warnings.append(f"profile store: cannot read {path} ({e.strerror or e}); profiling "
                                 f"{device_type} instead")
            return None, "its entry cannot be read"
        except ValueError as e:  # not JSON, or a bad field: the message names the file (and the field)
            what = str(e) if isinstance(e, ProfileError) else f"stored profile {path} is not JSON ({e})"
            self.warnings.append(f"profile store: skipping an entry: {what}")
            return None, "its entry was skipped (a bad field)"
        if entry.key != key or entry.device_type != device_type:  # a hand-copied file
            changed = key_changes(entry.key, key) or [f"device type {entry.device_type}"]
            return None, f"its file {path} holds another job's entry ({'; '.join(changed)})"
        return entry, ""

    def why_missing(self, key: StoreKey, device_type: str) -> str:
        """Why ``key`` has no entry of ``device_type``: the nearest stored key of that type (the
        fewest fields apart, then the newest) and what differs (``key_changes``), or that none
        of that type is stored. Files that cannot be read are passed over here."""
        best: tuple[tuple[int, float], list[str]] | None = None
        try:
            paths = sorted(self.directory.glob(f"*/{_file_name(device_type)}"))
        except OSError:
            paths = []
        for path in paths:
            try:
                d = json.loads(path.read_text())
                check_entry({k: v for k, v in d.items() if k != "schema_version"})
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            changes = key_changes(StoreKey.from_dict(d["key"]), key)
            order = (len(changes), -float(d.get("saved_at", 0.0)))
            if changes and (best is None or order < best[0]):
                best = (order, changes)
        if best is None:
            return "nothing stored for this device type"
        return f"stored for other jobs only, the nearest differs in {'; '.join(best[1])}"

    def lookup(self, key: StoreKey, device_types: list[str], devices: dict[str, str] | None = None) -> dict[str, Entry]:
        """The fresh entries among ``device_types`` (each once); ``devices``: each type's device identity."""
        found = {}
        for dtype in dict.fromkeys(device_types):
            entry = self.get(key, dtype, None if devices is None else devices.get(dtype))
            if entry is not None:
                found[dtype] = entry
        return found

    def put(self, entry: Entry) -> Path | None:
        """Write ``entry``; None, with a warning naming the path and the reason, where it cannot be written."""
        path = self.path(entry.key, entry.device_type)
        try:
            write_text_atomic(path, json.dumps(entry.to_dict(), indent=1) + "\n")
        except OSError as e:
            self.warnings.append(f"profile store: cannot write {path} ({e.strerror or e}); the {entry.device_type} "
                                 "profile is not kept, the job goes on")
            return None
        return path

    def save(self, profile: Profile, key: StoreKey, checkpointed: bool, only: set[str] | None = None) -> list[Path]:
        """Keep ``profile``'s device types (``only``: these of them); the paths written. Only a
        profile measured at even shards can be kept: at uneven weights a rank's mbs is its weight's, not its type's."""
        if profile.shard_weights is not None and len(set(profile.shard_weights)) > 1:
            raise ProfileError("a profile measured at uneven shard weights cannot be kept per device type")
        written = [self.put(e) for e in entries_of(profile, key, checkpointed)
                   if only is None or e.device_type in only]
        return [p for p in written if p is not None]


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
    comm, provenance = base.comm, base.provenance
    if base.cluster != cluster:
        # exposures led by a device type the job lacks do not apply; the cluster named is the storing run's
        comm = replace(comm, exposure=comm.exposure.only_leaders(cluster))
        links = comm.links
        if links.topology is not None and links.topology.world_size != len(cluster):
            # the storing run's nodes are not this job's ranks: its flat ring stands for the job's
            # collectives (the slowest tier's pace), as on one node; the re-planner corrects it
            comm = replace(comm, links=Links(links.bandwidth_bytes_per_s, links.latency_s, links.backend))
        if provenance.emulated is not None:
            provenance = replace(provenance, emulated=replace(provenance.emulated, cluster=""))
    ranks = [replace(entries[dtype].rank, rank=r) for r, dtype in enumerate(cluster)]
    return Profile(zero_stage=config[0], world_size=len(cluster), param_count=base.param_count,
                   param_bytes=base.param_bytes, ranks=ranks, comm=comm, model_name=base.model_name,
                   precision=base.precision, mixed_precision=base.mixed_precision,
                   activation_checkpointing=config[1], provenance=provenance, auto_choice=base.auto_choice,
                   store=StoreRecord(reused=sorted(entries), comm_from=base.cluster))
