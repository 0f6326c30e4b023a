"""Storage devices: an NVMe drive, a RAID-0 array of them, and how a read is split across members.

A **drive** serves a request with a fixed per-request cost (``request_seconds``: command,
flash and completion latency) that overlaps across up to ``queue_slots`` outstanding requests,
and a transfer at ``bandwidth`` bytes/s that does not overlap (one data channel per drive).

An **array** stripes a logical address space over ``members`` drives in chunks of
``chunk_bytes``. Two splitting rules (FACTS section 5):

* ``md`` (Linux md): a request is split at every chunk boundary; each piece is a member request.
* ``apple`` (AppleRAID): each member gets one contiguous request covering all its pieces.
* ``none``: a single drive.

A **host ceiling** (``host_bandwidth``, the PCIe slot or switch) caps the array's aggregate
transfer rate. O_DIRECT reads are widened to ``direct_alignment`` boundaries. A
``page_cache_fraction`` of expert reads can be declared warm (served from RAM).

Profiles are data: ``manifests/devices/*.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from containers.errors import InputError
from containers.hashing import digest_of
from containers.jsonfile import load_shipped

SPLIT_RULES = ("md", "apple", "none")


@dataclass(frozen=True)
class DriveProfile:
    """One NVMe drive. Times in seconds, rates in bytes/s."""

    name: str
    request_seconds: float
    bandwidth: float
    queue_slots: int = 32


@dataclass(frozen=True)
class ArrayProfile:
    """A RAID-0 array (or a single drive) behind a host link."""

    name: str
    drive: DriveProfile
    members: int
    chunk_bytes: int
    split_rule: str
    host_bandwidth: float
    direct_alignment: int = 4096
    page_cache_fraction: float = 0.0
    description: str = ""

    def __post_init__(self):
        if self.split_rule not in SPLIT_RULES:
            raise InputError(self.name, f"unknown split rule {self.split_rule!r} (choose {', '.join(SPLIT_RULES)})")
        if self.members < 1 or (self.members > 1 and self.chunk_bytes <= 0):
            raise InputError(self.name, "an array needs members >= 1 and a positive chunk size")
        if self.split_rule == "none" and self.members != 1:
            raise InputError(self.name, "split rule 'none' is for a single drive")
        if not 0 <= self.page_cache_fraction <= 1:
            raise InputError(self.name, "page_cache_fraction must be in [0, 1]")
        if self.drive.request_seconds < 0 or self.drive.bandwidth <= 0 or self.host_bandwidth <= 0 or self.drive.queue_slots < 1:
            raise InputError(self.name, "request cost must be >= 0, bandwidths and queue slots positive")

    @property
    def full_bandwidth(self) -> float:
        """The array's large-read ceiling: members x drive bandwidth, capped by the host link."""
        return min(self.members * self.drive.bandwidth, self.host_bandwidth)

    def to_json(self) -> dict:
        return asdict(self)

    def digest(self) -> str:
        return digest_of(json.dumps(self.to_json(), sort_keys=True).encode())


def load_device(name_or_path: str) -> ArrayProfile:
    """Load a shipped profile by name, or a profile JSON (e.g. from ``relayout calibrate``)."""
    obj, where = load_shipped("devices", name_or_path, "device profile")
    try:
        obj = {k: v for k, v in obj.items() if k in ArrayProfile.__dataclass_fields__}
        drive = DriveProfile(**obj.pop("drive"))
        return ArrayProfile(drive=drive, **obj)
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(where, f"not a valid device profile ({exc})") from None


def member_split(device: ArrayProfile, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How reads ``[start, start+length)`` of the logical address space land on members.

    Returns ``(pieces, nbytes)``, each int64 [R, members]: the number of member requests and the
    bytes each member transfers. Vectorised over reads; exact for both splitting rules.
    """
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    R, M = len(start), device.members
    if M == 1:
        return (length > 0).astype(np.int64)[:, None], length[:, None].copy()
    c = device.chunk_bytes
    end = start + length
    c0 = start // c
    c1 = (np.maximum(end, start + 1) - 1) // c
    m = np.arange(M)[None, :]
    first = c0[:, None] + (m - c0[:, None]) % M           # first chunk index on member m
    pieces = np.where(first <= c1[:, None], (c1[:, None] - first) // M + 1, 0)
    nbytes = pieces * c
    head = start - c0 * c                                   # bytes of the first chunk before the read
    tail = (c1 + 1) * c - end                                # bytes of the last chunk after the read
    rows = np.arange(R)
    nbytes[rows, c0 % M] -= head      # one index per row: plain fancy assignment is exact
    nbytes[rows, c1 % M] -= tail
    empty = length <= 0
    pieces[empty] = 0
    nbytes[empty] = 0
    if device.split_rule == "apple":
        pieces = (nbytes > 0).astype(np.int64)
    return pieces, nbytes


def widen_direct(start: np.ndarray, length: np.ndarray, alignment: int) -> tuple[np.ndarray, np.ndarray]:
    """O_DIRECT window: start rounded down, end rounded up to ``alignment``."""
    a = np.asarray(start, dtype=np.int64) // alignment * alignment
    e = -(-(np.asarray(start, dtype=np.int64) + length) // alignment) * alignment
    return a, e - a
