"""Storage over several independent drives: colibrì's split directories and mirrors, and where each
of an expert's reads lands.

A :class:`StorageRecord` (JSON, strict ``from_json`` / ``to_json``) describes the drives (each a
name, a device profile: a shipped name or a calibrated file, possibly a RAID-0 array, a speed
factor and a capacity in bytes), the split directories (``COLI_MODEL_DIRS``: each a drive and the
shard names found there; the first is the primary directory, the model's ``SNAP``), the mirrors
(``COLI_MODEL_MIRROR``: each a drive and the shards it holds, complete or partial), the replica
weights (``COLI_DISK_WEIGHTS``, one per replica, primary first; ``null`` for what the engine's
startup probe measures), ``direct`` (O_DIRECT weight reads) and ``stripe`` (``COLI_MIR_STRIPE``).
One drive holding every shard, no mirror, is the single-array model relayout had before.

:class:`Storage` binds a record to a layout's files and maps one expert's reads onto drives
(:meth:`Storage.expert_reads`) by the engine's rules (docs/MULTI_DRIVE.md): replica routing by a
hash of (layer, expert id) cut by the weights (:func:`route_hash`, :func:`replica_cuts`), the
primary when the routed replica lacks the shard of the expert's gate weight, the primary for any
file the replica lacks, and O_DIRECT reads of 4 MiB or more striped in equal 4 KiB-aligned chunks
over the replicas holding the shard (:func:`stripe_chunks`). Bytes, bytes/s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import parse_json
from containers.layout import SCALE_SLOTS, WEIGHT_SLOTS, Layout
from containers.records import from_json, to_json

from replay.model.device import ArrayProfile, load_device

HASH_SLOTS = 256
"""The routing hash's values: replica ``r`` owns ``[cut[r-1], cut[r])`` of them."""
MAX_MIRRORS = 4
"""Mirror directories the engine registers at most (five replicas with the primary)."""
STRIPE_MIN_BYTES = 4 << 20
"""The smallest widened O_DIRECT read the engine stripes over replicas (bytes)."""
DIRECT_ALIGNMENT = 4096
"""O_DIRECT reads are widened to and striped in multiples of this (bytes)."""
PROBE_READ_BYTES = 19 << 20
"""The size of the engine's startup probe reads (bytes); eight run at once."""
PROBE_DEPTH = 8


@dataclass(frozen=True)
class DriveSpec:
    """One drive: ``profile`` a shipped device name or a profile JSON path (relative to the
    storage file), ``speed`` a factor on its rates (:meth:`ArrayProfile.scaled`),
    ``capacity_bytes`` what it can hold (0: unknown, not checked)."""

    name: str
    profile: str
    speed: float = 1.0
    capacity_bytes: int = 0


@dataclass(frozen=True)
class DirectorySpec:
    """A directory on ``drive`` holding the shards ``shards`` (file names)."""

    drive: str
    shards: list[str]


@dataclass(frozen=True)
class StorageRecord:
    """Drives, split directories (primary first), mirrors, replica weights, O_DIRECT and striping."""

    drives: list[DriveSpec]
    dirs: list[DirectorySpec]
    mirrors: list[DirectorySpec] = field(default_factory=list)
    weights: list[float] | None = None
    direct: bool = True
    stripe: bool = True

    def to_json(self) -> dict:
        return to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "StorageRecord":
        rec = from_json(cls, obj, where, "storage description")
        rec.check(where)
        return rec

    def check(self, where: str | None) -> None:
        """Names unique, every directory on a known drive, a shard in one split directory only,
        at most :data:`MAX_MIRRORS` mirrors, weights one positive number per replica."""
        names = [d.name for d in self.drives]
        if not names:
            raise InputError(where, "a storage description needs at least one drive")
        if len(set(names)) != len(names):
            raise InputError(where, "drive names must be unique")
        for d in self.drives:
            if not d.speed > 0:
                raise InputError(where, f"drive {d.name!r}: speed must be positive")
            if d.capacity_bytes < 0:
                raise InputError(where, f"drive {d.name!r}: capacity_bytes must be >= 0")
        if not self.dirs:
            raise InputError(where, "a storage description needs a primary directory")
        seen: dict[str, int] = {}
        for i, d in enumerate(self.dirs + self.mirrors):
            if d.drive not in names:
                raise InputError(where, f"directory {i} is on unknown drive {d.drive!r}")
            if len(set(d.shards)) != len(d.shards):
                raise InputError(where, f"directory {i} lists a shard twice")
            for s in d.shards:
                if not s or "/" in s or s in (".", "..") or not s.endswith(".safetensors"):
                    raise InputError(where, f"{s!r} is not a shard file name")
        for i, d in enumerate(self.dirs):
            for s in d.shards:
                if s in seen:
                    raise InputError(where, f"shard {s} is in split directories {seen[s]} and {i}; each shard lives in one")
                seen[s] = i
        if len(self.mirrors) > MAX_MIRRORS:
            raise InputError(where, f"{len(self.mirrors)} mirrors; the engine registers at most {MAX_MIRRORS}")
        for i, m in enumerate(self.mirrors):
            if not m.shards:
                raise InputError(where, f"mirror {i} holds no shard (the engine would skip it)")
            unknown = [s for s in m.shards if s not in seen]
            if unknown:
                raise InputError(where, f"mirror {i} holds {unknown[0]}, which no split directory holds")
        if self.weights is not None:
            if len(self.weights) != 1 + len(self.mirrors) or not all(w > 0 for w in self.weights):
                raise InputError(where, f"weights must be {1 + len(self.mirrors)} positive numbers (primary, then each mirror)")


def load_storage(path: str | os.PathLike) -> tuple[StorageRecord, dict[str, ArrayProfile]]:
    """A storage description and its drives' profiles (scaled by their speed), by drive name."""
    p = Path(path)
    try:
        obj = parse_json(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(p, f"cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise InputError(p, f"not a valid storage description ({exc})") from None
    rec = StorageRecord.from_json(obj, str(p))
    profiles = {}
    for d in rec.drives:
        ref = d.profile
        if ref.endswith(".json") and not os.path.isabs(ref):
            ref = str(p.parent / ref)
        prof = load_device(ref)
        profiles[d.name] = prof.scaled(d.speed) if d.speed != 1.0 else prof
    return rec, profiles


def single_drive(layout: Layout, profile: str, name: str = "array") -> StorageRecord:
    """Every shard of ``layout`` on one drive (or array), no mirror: the single-array model."""
    return StorageRecord([DriveSpec(name, profile)], [DirectorySpec(name, list(layout.files))])


# ------------------------------------------------------------------------------ the engine's rules

def route_hash(layer: int, expert: int) -> int:
    """The engine's routing hash of (absolute layer, expert id), 0-255 (docs/MULTI_DRIVE.md)."""
    m = 0xFFFFFFFF
    h = ((layer * 2654435761) & m) ^ ((expert * 0x9E3779B9) & m)
    h ^= h >> 16
    h = (h * 0x45D9F3B) & m
    h ^= h >> 16
    return h & 255


def replica_cuts(weights: list[float]) -> list[int]:
    """Cumulative cuts of the 256 hash values, one per replica: ``round(256 cumulative / total)``
    half up, at least one above the previous, at most 256; the last is 256."""
    total = float(sum(weights))
    cuts, acc, cum = [], 0, 0.0
    for w in weights:
        cum += w
        c = int(HASH_SLOTS * cum / total + 0.5)
        c = min(max(c, acc + 1), HASH_SLOTS)
        cuts.append(c)
        acc = c
    cuts[-1] = HASH_SLOTS
    return cuts


def route_replica(layer: int, expert: int, cuts: list[int]) -> int:
    """The replica an expert routes to: the first whose cut exceeds its hash (0 without mirrors)."""
    if len(cuts) < 2:
        return 0
    h = route_hash(layer, expert)
    r = 0
    while h >= cuts[r]:
        r += 1
    return r


def widen_direct(offset: int, length: int) -> tuple[int, int]:
    """An O_DIRECT read widened to :data:`DIRECT_ALIGNMENT`: ``(start, length)``, bytes."""
    base = offset - offset % DIRECT_ALIGNMENT
    need = offset - base + length
    return base, -(-need // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


def stripe_chunks(length: int, holders: list[int], routed: int) -> list[tuple[int, int, int]]:
    """How the engine stripes one widened O_DIRECT read of ``length`` bytes: ``(replica, offset,
    bytes)`` per chunk, or ``[]`` when it does not stripe (fewer than two ``holders``, the
    replicas holding the shard in replica order, or a read under :data:`STRIPE_MIN_BYTES`).
    Chunk ``i`` goes to ``holders[(routed + i) % n]`` (``routed`` the replica *number*)."""
    n = len(holders)
    if n < 2 or length < STRIPE_MIN_BYTES:
        return []
    chunk = (-(-length // n) + DIRECT_ALIGNMENT - 1) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
    out = []
    for i in range(n):
        o = i * chunk
        if o >= length:
            break
        out.append((holders[(routed + i) % n], o, min(chunk, length - o)))
    return out


class Storage:
    """A :class:`StorageRecord` bound to a layout's files: which drive holds each replica of each file.

    ``drives`` (names, in record order) index every array here; ``profiles`` [D] their profiles;
    ``file_drive[r][f]`` the drive holding replica ``r`` of file ``f`` (-1: that replica lacks it;
    replica 0, the primary, holds every file); ``cuts`` the routing cuts (:func:`replica_cuts`).
    """

    def __init__(self, record: StorageRecord, profiles: dict[str, ArrayProfile], layout: Layout, where: str | None = None):
        self.record = record
        self.drives = [d.name for d in record.drives]
        self.profiles = [profiles[n] for n in self.drives]
        index = {n: i for i, n in enumerate(layout.files)}
        primary = np.full(len(layout.files), -1, dtype=np.int64)
        for d in record.dirs:
            for s in d.shards:
                if s not in index:
                    raise InputError(where, f"shard {s} is not a file of the layout")
                primary[index[s]] = self.drives.index(d.drive)
        missing = [layout.files[f] for f in np.flatnonzero(primary < 0)]
        if missing:
            raise InputError(where, f"{len(missing)} file(s) of the layout are in no split directory (first: {missing[0]})")
        reps = [primary]
        for m in record.mirrors:
            row = np.full(len(layout.files), -1, dtype=np.int64)
            for s in m.shards:
                row[index[s]] = self.drives.index(m.drive)
            reps.append(row)
        self.file_drive = reps
        self.file_sizes = list(layout.file_sizes)
        self.weights = list(record.weights) if record.weights is not None else self.probe_weights()
        self.cuts = replica_cuts(self.weights) if len(reps) > 1 else [HASH_SLOTS]
        for i, d in enumerate(record.drives):
            held = sum(self.file_sizes[f] for rep in reps for f in np.flatnonzero(rep == i))
            if d.capacity_bytes and held > d.capacity_bytes:
                raise InputError(where, f"drive {d.name!r} holds {held} bytes, more than its capacity {d.capacity_bytes}")

    @property
    def n_replicas(self) -> int:
        return len(self.file_drive)

    def probe_weights(self) -> list[float]:
        """What the engine's probe finds without ``COLI_DISK_WEIGHTS``: per replica, the rate of
        eight concurrent 19 MiB reads on the drive holding that replica's largest file, GB/s."""
        out = []
        for rep in self.file_drive:
            held = np.flatnonzero(rep >= 0)
            big = held[int(np.argmax([self.file_sizes[f] for f in held]))]
            out.append(self.profiles[int(rep[big])].steady_rate(PROBE_READ_BYTES, PROBE_DEPTH) / 1e9)
        return out

    def holders(self, f: int) -> list[int]:
        """The replicas holding file ``f``, in replica order."""
        return [r for r, rep in enumerate(self.file_drive) if rep[f] >= 0]

    def expert_reads(self, layer: int, expert: int, loc: np.ndarray) -> list[tuple[int, int]]:
        """The drive reads one expert load causes: ``(drive, bytes)`` per read, the weight read(s)
        first, then the three scale reads. ``loc`` [6, 3]: the expert's ``(file, offset, bytes)``
        per slot (:class:`containers.layout.Layout`'s ``expert_loc[li, e]``)."""
        return [(d, n) for _, _, n, d in self.expert_extents(layer, expert, loc)]

    def expert_extents(self, layer: int, expert: int, loc: np.ndarray) -> list[tuple[int, int, int, int]]:
        """:meth:`expert_reads` with where each read is: ``(file, offset, bytes, drive)``
        (O_DIRECT weight reads widened, striped ones per chunk)."""
        route = route_replica(layer, expert, self.cuts)
        gate_file = int(loc[WEIGHT_SLOTS[0], 0])
        if route and self.file_drive[route][gate_file] < 0:
            route = 0
        reads = []
        w = loc[list(WEIGHT_SLOTS)]
        srt = w[np.argsort(w[:, 1], kind="stable")]
        contiguous = len(set(w[:, 0].tolist())) == 1 and all(srt[i, 1] + srt[i, 2] == srt[i + 1, 1] for i in range(2))
        if contiguous:
            f, off, n = int(srt[0, 0]), int(srt[0, 1]), int(srt[:, 2].sum())
            if self.record.direct:
                off, n = widen_direct(off, n)
                chunks = stripe_chunks(n, self.holders(f), route) if self.record.stripe else []
                if chunks:
                    reads += [(f, off + o, size, int(self.file_drive[r][f])) for r, o, size in chunks]
                else:
                    reads.append((f, off, n, self._drive(route, f)))
            else:
                reads.append((f, off, n, self._drive(route, f)))
        else:
            reads += [(int(f), int(o), int(n), self._drive(route, int(f))) for f, o, n in w]
        reads += [(int(loc[s, 0]), int(loc[s, 1]), int(loc[s, 2]), self._drive(route, int(loc[s, 0]))) for s in SCALE_SLOTS]
        return reads

    def _drive(self, replica: int, f: int) -> int:
        """The drive serving a whole read of file ``f`` asked of ``replica``: the primary's when it lacks ``f``."""
        d = self.file_drive[replica][f]
        return int(d) if d >= 0 else int(self.file_drive[0][f])

    def engine_variables(self, paths: dict[str, str]) -> dict[str, str]:
        """The engine's environment for this storage, ``paths`` giving each directory's path by
        ``"dir:<i>"`` / ``"mirror:<i>"``: ``SNAP``, ``COLI_MODEL_DIRS``, ``COLI_MODEL_MIRROR``,
        ``COLI_DISK_WEIGHTS`` and ``COLI_MIR_STRIPE``/``DIRECT`` (only those that apply)."""
        env = {"SNAP": paths["dir:0"]}
        if len(self.record.dirs) > 1:
            env["COLI_MODEL_DIRS"] = ";".join(paths[f"dir:{i}"] for i in range(1, len(self.record.dirs)))
        if self.record.mirrors:
            env["COLI_MODEL_MIRROR"] = ";".join(paths[f"mirror:{i}"] for i in range(len(self.record.mirrors)))
            env["COLI_DISK_WEIGHTS"] = ",".join(f"{w:.3g}" for w in self.weights)
            if not self.record.stripe:
                env["COLI_MIR_STRIPE"] = "0"
        if self.record.direct:
            env["DIRECT"] = "1"
        return env


def address_map(storage: Storage, layout: Layout, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which drive serves each byte of the replay's address space (file ``f`` at ``bases[f]``):
    ``(seg_start, seg_drive)`` for :func:`replay.model.device.split_storage`. Each expert's reads
    (:meth:`Storage.expert_extents`: routed, striped, widened) are painted in layout order, a byte
    two widened reads share going to the first; every other byte is its file's primary drive's."""
    ivs = []
    for li, layer in enumerate(layout.layers):
        for e in range(layout.n_experts):
            for f, off, n, d in storage.expert_extents(layer, e, layout.expert_loc[li, e]):
                ivs.append((int(bases[f]) + off, int(bases[f]) + off + n, d))
    ivs.sort(key=lambda t: t[0])
    primary = storage.file_drive[0]
    ends = [int(bases[f]) + int(layout.file_sizes[f]) for f in range(len(layout.files))]
    marks: list[tuple[int, int]] = []                          # (address, drive from there on)

    def background(lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` no expert read covers: each file's primary drive."""
        f = max(int(np.searchsorted(bases, lo, side="right")) - 1, 0)
        marks.append((lo, int(primary[f])))
        for g in range(f + 1, len(bases)):
            if bases[g] >= hi:
                break
            marks.append((int(bases[g]), int(primary[g])))

    cur = 0
    for lo, hi, d in ivs:
        lo = max(lo, cur)
        if lo >= hi:
            continue
        if lo > cur:
            background(cur, lo)
        marks.append((lo, d))
        cur = hi
    background(cur, max(ends) + 1)
    starts, drives = [], []
    for at, d in marks:                                         # ascending; a later mark at one address wins
        if starts and starts[-1] == at:
            starts.pop()
            drives.pop()
        if not drives or drives[-1] != d:
            starts.append(at)
            drives.append(d)
    return np.array(starts, dtype=np.int64), np.array(drives, dtype=np.int64)


@dataclass(frozen=True)
class StorageProfile(ArrayProfile):
    """Independent drives as the compiled timing model takes them: one member per drive (split
    rule ``storage``), each with its own rates; a layout's reads reach them by
    :func:`address_map`. A layout whose files the description does not list (a gate's baseline)
    is placed as the converter's shards would be by hand: split evenly by name over the same
    split drives, without a mirror. The drives must agree on queue slots, request limit and
    service discipline; an array (RAID-0) as one of several drives is not modelled here."""

    record: StorageRecord | None = None
    drives: tuple = ()

    def address_map(self, layout: Layout, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        names = {s for d in self.record.dirs for s in d.shards}
        rec = self.record if names == set(layout.files) else even_split(layout, self.record)
        profiles = {d.name: p for d, p in zip(self.record.drives, self.drives)}
        return address_map(Storage(rec, profiles, layout, self.name), layout, bases)

    def to_json(self) -> dict:
        return {"name": self.name, "storage": self.record.to_json(), "drives": [p.to_json() for p in self.drives]}

    @property
    def full_bandwidth(self) -> float:
        """The drives' large-read ceilings added up."""
        return float(sum(p.full_bandwidth for p in self.drives))

    def scaled(self, factor: float) -> "StorageProfile":
        """Every drive ``factor`` times as fast (:meth:`ArrayProfile.scaled`)."""
        return replace(super().scaled(factor), drives=tuple(p.scaled(factor) for p in self.drives))


def even_split(layout: Layout, record: StorageRecord) -> StorageRecord:
    """``layout``'s files split by name over ``record``'s split drives in equal runs, no mirror."""
    names = sorted(layout.files)
    k = len(record.dirs)
    cuts = [round(i * len(names) / k) for i in range(k + 1)]
    return StorageRecord(record.drives, [DirectorySpec(record.dirs[i].drive, names[cuts[i]:cuts[i + 1]]) for i in range(k)])


def storage_profile(path: str | os.PathLike) -> StorageProfile:
    """A storage description as a device for the compiled timing model (:class:`StorageProfile`);
    its readahead (``read_ahead_bytes``, ``readahead_request_bytes``), copy rates
    (``memory_bandwidth``, ``unaligned_memory_bandwidth``) and ``loader_handoff`` (the host's)
    are the first drive's profile's."""
    rec, profiles = load_storage(path)
    drives = tuple(profiles[d.name] for d in rec.drives)
    for p in drives:
        if p.members != 1:
            raise InputError(path, f"drive profile {p.name!r} is an array of {p.members}; as one of several drives "
                                   "only single drives are modelled")
    first = drives[0].drive
    for p in drives[1:]:
        d = p.drive
        if (d.queue_slots, d.max_request_bytes, d.service) != (first.queue_slots, first.max_request_bytes, first.service):
            raise InputError(path, "the drives must agree on queue_slots, max_request_bytes and service")
    return StorageProfile(name=f"storage:{Path(path).name}", drive=first, members=len(drives), chunk_bytes=0,
                          split_rule="storage", host_bandwidth=float(sum(p.host_bandwidth for p in drives)),
                          direct_alignment=DIRECT_ALIGNMENT, read_ahead_bytes=drives[0].read_ahead_bytes,
                          memory_bandwidth=drives[0].memory_bandwidth,
                          unaligned_memory_bandwidth=drives[0].unaligned_memory_bandwidth,
                          readahead_request_bytes=drives[0].readahead_request_bytes,
                          loader_handoff=drives[0].loader_handoff,
                          description="independent drives: " + ", ".join(f"{d.name} ({p.name})" for d, p in zip(rec.drives, drives)),
                          record=rec, drives=drives)
