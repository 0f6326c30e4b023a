"""Storage devices: an NVMe drive as a queue, a RAID-0 array of them, and how a read is split across members.

A drive is ``Q`` queue slots and one data channel (request latency ``a``, one request's stream
rate ``b_1``, the channel's rate ``B`` and its per-request time ``c``), served in order or shared
fairly among the reads in it; an array stripes a logical address space over its members by the
``md``, ``apple`` or ``none`` rule behind a host link. Profiles are data
(``manifests/devices/*.json``); docs/MODEL.md ("Drives and arrays") states the queue model, the
service disciplines and the splitting rules. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np
from numba import njit

from containers.errors import InputError
from containers.hashing import digest_of
from containers.jsonfile import load_shipped

from replay.model.jit import HELPER, LOOP, trailing_zeros

DEFAULT_READ_AHEAD_BYTES = 128 * 1024
"""Linux's default readahead maximum, ``read_ahead_kb`` 128 (bytes)."""
DEFAULT_MEMORY_BANDWIDTH = 10e9
"""The page-cache copy rate a profile that does not give one has (bytes/s, one thread)."""
COPY_ALIGNMENT = 64
"""A page-cache hit whose file offset is a multiple of this many bytes (a cache line) is copied at
``memory_bandwidth``, any other at ``unaligned_memory_bandwidth`` (:func:`copy_seconds`)."""

MAX_MEMBERS = 256
"""The most drives an array profile may stripe over."""
MIN_CHUNK = 512
"""The smallest stripe chunk of an array, bytes (a sector)."""
MAX_ALIGNMENT = 1 << 20
"""The largest O_DIRECT alignment a profile may give, bytes (devices align to 512 B or 4 KiB; every
read is widened to it, so a larger one only makes the model read, and take, longer)."""
MAX_QUEUE_SLOTS = 65536
"""The most requests a drive may serve at once (NVMe's deepest queue)."""
MAX_RATE = 1e16
"""The fastest drive, stream or host link a profile may give, bytes/s."""
MAX_REQUEST_SECONDS = 60.0
"""The longest per-request latency or channel time a profile may give, s."""

SPLIT_RULES = ("none", "md", "apple", "storage")
"""Split rules; the compiled timing model takes a rule as its index here. ``storage``: independent
drives, an address map saying which drive serves each byte (:mod:`replay.model.storage`)."""
APPLE = SPLIT_RULES.index("apple")
STORAGE = SPLIT_RULES.index("storage")


@njit(**HELPER)
def copy_seconds(n, offset, dev):
    """Seconds one thread takes to copy ``n`` bytes the page cache serves from file offset
    ``offset`` (bytes; any address whose files start on cache lines) into a page-aligned read
    buffer: at the compiled device's ``memory_bandwidth`` when ``offset`` starts a cache line
    (:data:`COPY_ALIGNMENT`), else at its ``unaligned_memory_bandwidth``."""
    if offset % COPY_ALIGNMENT == 0:
        return n / dev.memory_bandwidth
    return n / dev.unaligned_memory_bandwidth


@dataclass(frozen=True)
class DriveProfile:
    """One NVMe drive as a queue (the module docstring's equations). Times in seconds, rates in bytes/s.

    ``request_seconds`` a, ``bandwidth`` B (the drive's limit), ``queue_slots`` Q (requests served
    at once, default 32), ``stream_bandwidth`` b_1 (one request's own rate; ``None``, the default
    for older profiles, means ``B``), ``max_request_bytes`` m (bytes: the
    largest request the operating system sends the drive, Linux ``max_sectors_kb`` x 1024;
    ``None`` means reads are not split), ``service`` (``in-order`` or ``shared``: the module
    docstring's service discipline; ``in-order`` for profiles written before it was measured),
    ``request_channel_seconds`` c (s each request holds the data channel beyond its bytes; 0, the
    default, for profiles written before it was measured).
    """

    name: str
    request_seconds: float
    bandwidth: float
    queue_slots: int = 32
    stream_bandwidth: float | None = None
    max_request_bytes: int | None = None
    service: str = "in-order"
    request_channel_seconds: float = 0.0

    @property
    def request_bandwidth(self) -> float:
        """b_1 as the model uses it: ``stream_bandwidth``, ``bandwidth`` when unset, at most ``bandwidth``."""
        return self.bandwidth if self.stream_bandwidth is None else min(self.stream_bandwidth, self.bandwidth)

    @property
    def max_request(self) -> int:
        """m as the compiled model takes it: bytes, 0 for no limit."""
        return 0 if self.max_request_bytes is None else int(self.max_request_bytes)


def _plain(x: float) -> str:
    """A bound as written: whole numbers in digits, others in %g."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


SERVICES = ("in-order", "shared")
"""Service disciplines of a drive's data channel (the module docstring)."""


def queue_throughput(request_seconds, stream_bandwidth, bandwidth, queue_slots, size, depth, max_request=0, *,
                     shared=False, request_channel_seconds=0.0):
    """Steady-state aggregate rate (bytes/s) of ``depth`` outstanding reads of ``size`` bytes on
    one drive, each reaching it as ``k = ceil(s / m)`` requests of ``p = s / k`` bytes
    (``m = max_request`` bytes, 0 for no limit), each request holding the channel ``c =
    request_channel_seconds`` (s) beyond its bytes. In order:
    ``min(min(q k, Q) * p / (a + max(p / b_1, c + p / B)), p / (c + p / B))``; ``shared``:
    ``min(q s / (a + max(s / (k b_1), k c + s / B)), Q s / a, s / (k c + s / B))`` (a read holds
    one slot, for the command only). ``b_1`` above ``B`` counts as ``B``. Broadcasts over
    ``size`` and ``depth``; the requests' stream term takes the largest request, ``min(s, m)``
    (:func:`largest_request`), which is ``p`` when ``m`` divides ``s``."""
    size = np.asarray(size, dtype=float)
    k = np.ceil(size / max_request) if max_request > 0 else np.ones_like(size)
    b1 = min(stream_bandwidth, bandwidth)
    c = request_channel_seconds
    piece = size / k
    requests = np.asarray(depth, dtype=float) * k
    largest = np.minimum(size, max_request) if max_request > 0 else size
    if shared:
        channel = k * c + size / bandwidth
        own = np.asarray(depth, dtype=float) * size / (request_seconds + np.maximum(largest / b1, channel))
        commands = queue_slots * size / request_seconds if request_seconds > 0 else np.inf
        return np.minimum(np.minimum(own, commands), size / channel)
    q = np.minimum(requests, queue_slots)
    channel = c + piece / bandwidth
    return np.minimum(q * piece / (request_seconds + np.maximum(largest / b1, channel)), piece / channel)


def read_alone_seconds(drive: DriveProfile, size: int) -> float:
    """Seconds one read of ``size`` bytes takes on ``drive`` with nothing else in it (the module
    docstring's equations, no host link): on a shared drive ``a + max(r / b_1, k c + s / B)``
    for its ``k = ceil(s / m)`` requests, the largest of ``r = min(s, m)`` bytes; in order, each
    request as the queue equations serve it (the same when the drive has ``k`` slots or more)."""
    a, B, b1, c = drive.request_seconds, drive.bandwidth, drive.request_bandwidth, drive.request_channel_seconds
    m = drive.max_request
    k = -(-int(size) // m) if m > 0 else 1
    piece = size / k
    largest = largest_request(int(size), 1, 0, 0, m)
    if drive.service == "shared":
        return a + max(largest / b1, k * c + size / B)
    slots = [0.0] * min(k, drive.queue_slots)          # when each slot frees (s), a heap
    channel = done = 0.0
    for _ in range(k):
        t0 = heapq.heappop(slots)
        channel = max(t0 + a, channel) + c + piece / B
        end = max(t0 + a + largest / b1, channel)
        heapq.heappush(slots, end)
        done = max(done, end)
    return done


@dataclass(frozen=True)
class LoaderHandoff:
    """What handing a block of loads to a parked loader pool on the compute thread's core costs
    (colibrì's PIPE=1 under its bound OpenMP team), by pool size: ``seconds[i]`` for a pool of
    ``workers[i]`` threads, ascending (:mod:`replay.physical.loader_handoff` measures it)."""

    workers: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        w, s = tuple(self.workers), tuple(self.seconds)
        object.__setattr__(self, "workers", w)
        object.__setattr__(self, "seconds", s)
        if (not w or len(w) != len(s) or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64 for n in w)
                or list(w) != sorted(set(w))):
            raise InputError(None, f"loader_handoff.workers is {list(w)!r}: pool sizes of 1-64, ascending, one per "
                                   f"handoff in seconds")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not 0 <= x <= 0.01 for x in s):
            raise InputError(None, f"loader_handoff.seconds is {list(s)!r}: finite times of 0 to 0.01 s")

    def for_pool(self, workers: int) -> float:
        """The handoff (s) for a pool of ``workers`` threads: linear between the measured sizes,
        the nearest one's beyond them."""
        return float(np.interp(workers, self.workers, self.seconds))


@dataclass(frozen=True)
class ArrayProfile:
    """A RAID-0 array (or a single drive) behind a host link.

    ``read_ahead_bytes``: the system's readahead maximum (bytes). ``memory_bandwidth``: the rate
    (bytes/s) at which one thread copies a buffered read that the page cache serves into its read
    buffer when the read starts on a cache line (its file offset a multiple of
    :data:`COPY_ALIGNMENT`; a page-cache hit's rate; ``relayout calibrate`` measures it, 10e9 where
    a profile does not give it). ``unaligned_memory_bandwidth``: the same for a read starting
    elsewhere in a cache line, as safetensors tensors usually do (the kernel's copy into a
    page-aligned buffer is then slower; None: as ``memory_bandwidth``). ``readahead_request_bytes``:
    the largest readahead window a read larger than ``read_ahead_bytes`` may take, Linux's
    ``io_pages`` (``queue/max_sectors_kb`` x 1024, whatever the buffers' segments); None: as the
    drive's ``max_request_bytes``. ``loader_handoff``: what a block of loads handed to a parked
    loader pool on the compute thread's core costs on this host (:class:`LoaderHandoff`; None: not
    measured, no cost).
    """

    name: str
    drive: DriveProfile
    members: int
    chunk_bytes: int
    split_rule: str
    host_bandwidth: float
    direct_alignment: int = 4096
    page_cache_fraction: float = 0.0
    description: str = ""
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES
    memory_bandwidth: float = DEFAULT_MEMORY_BANDWIDTH
    unaligned_memory_bandwidth: float | None = None
    readahead_request_bytes: int | None = None
    loader_handoff: LoaderHandoff | None = None

    def __post_init__(self):
        if isinstance(self.loader_handoff, dict):
            h = self.loader_handoff
            if set(h) != {"workers", "seconds"}:
                raise InputError(self.name, f"loader_handoff has {sorted(h)}, not workers and seconds")
            try:
                object.__setattr__(self, "loader_handoff", LoaderHandoff(h["workers"], h["seconds"]))
            except InputError as exc:
                raise InputError(self.name, exc.problem) from None
            except TypeError:
                raise InputError(self.name, "loader_handoff's workers and seconds must be lists") from None
        elif self.loader_handoff is not None and not isinstance(self.loader_handoff, LoaderHandoff):
            raise InputError(self.name, f"loader_handoff is {self.loader_handoff!r}, not workers and seconds")
        for what, value, kind in (("members", self.members, int), ("chunk_bytes", self.chunk_bytes, int),
                                  ("direct_alignment", self.direct_alignment, int), ("queue_slots", self.drive.queue_slots, int),
                                  ("host_bandwidth", self.host_bandwidth, float), ("page_cache_fraction", self.page_cache_fraction, float),
                                  ("request_seconds", self.drive.request_seconds, float), ("bandwidth", self.drive.bandwidth, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or (kind is int and not isinstance(value, int)):
                raise InputError(self.name, f"{what} is {value!r}, not a finite {'integer' if kind is int else 'number'}")
        d = self.drive
        for what, value, lo, hi in (("members", self.members, 1, MAX_MEMBERS), ("chunk_bytes", self.chunk_bytes, 0, 1 << 34),
                                    ("direct_alignment", self.direct_alignment, 1, MAX_ALIGNMENT),
                                    ("queue_slots", d.queue_slots, 1, MAX_QUEUE_SLOTS),
                                    ("host_bandwidth", self.host_bandwidth, 0, MAX_RATE), ("bandwidth", d.bandwidth, 0, MAX_RATE),
                                    ("request_seconds", d.request_seconds, 0, MAX_REQUEST_SECONDS),
                                    ("request_channel_seconds", d.request_channel_seconds, 0, MAX_REQUEST_SECONDS)):
            if isinstance(value, (int, float)) and math.isfinite(value) and not lo <= value <= hi:
                raise InputError(self.name, f"{what} is {value!r}, outside {lo} to {_plain(hi)}")
        if self.members > 1 and self.split_rule != "storage" and self.chunk_bytes < MIN_CHUNK:
            raise InputError(self.name, f"chunk_bytes is {self.chunk_bytes!r}: an array's chunks are at least {MIN_CHUNK} bytes")
        if self.split_rule not in SPLIT_RULES:
            raise InputError(self.name, f"unknown split rule {self.split_rule!r} (choose {', '.join(SPLIT_RULES)})")
        if self.members < 1 or (self.members > 1 and self.split_rule != "storage" and self.chunk_bytes <= 0):
            raise InputError(self.name, "an array needs members >= 1 and a positive chunk size")
        if self.split_rule == "none" and self.members != 1:
            raise InputError(self.name, "split rule 'none' is for a single drive")
        if self.direct_alignment < 1:
            raise InputError(self.name, "direct_alignment must be >= 1 byte")
        if not 0 <= self.page_cache_fraction <= 1:
            raise InputError(self.name, "page_cache_fraction must be in [0, 1]")
        r = self.read_ahead_bytes
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 1 << 30:
            raise InputError(self.name, f"read_ahead_bytes is {r!r}, not an integer of 0 to 1 GiB")
        io = self.readahead_request_bytes
        if io is not None and (isinstance(io, bool) or not isinstance(io, int) or not 512 <= io <= 1 << 34):
            raise InputError(self.name, f"readahead_request_bytes is {io!r}, not an integer of 512 bytes to 16 GiB "
                                        "(or null: the drive's max_request_bytes)")
        if self.drive.request_seconds < 0 or self.drive.bandwidth <= 0 or self.host_bandwidth <= 0 or self.drive.queue_slots < 1:
            raise InputError(self.name, "request cost must be >= 0, bandwidths and queue slots positive")
        b1 = self.drive.stream_bandwidth
        if b1 is not None and (isinstance(b1, bool) or not isinstance(b1, (int, float)) or not math.isfinite(b1) or not 0 < b1 <= MAX_RATE):
            raise InputError(self.name, f"stream_bandwidth is {b1!r}, not a positive finite number (or null: = bandwidth)")
        m = self.drive.max_request_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or not 512 <= m <= 1 << 34):
            raise InputError(self.name, f"max_request_bytes is {m!r}, not an integer of 512 bytes to 16 GiB (or null: reads are not split)")
        c = self.drive.request_channel_seconds
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise InputError(self.name, f"request_channel_seconds is {c!r}, not a finite number >= 0")
        if self.drive.service not in SERVICES:
            raise InputError(self.name, f"unknown drive service {self.drive.service!r} (choose {', '.join(SERVICES)})")
        mb = self.memory_bandwidth
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or not 0 < mb <= MAX_RATE:
            raise InputError(self.name, f"memory_bandwidth is {mb!r}, not a finite number of bytes/s above 0 and at most "
                                        f"{_plain(MAX_RATE)}")
        ub = self.unaligned_memory_bandwidth
        if ub is not None and (isinstance(ub, bool) or not isinstance(ub, (int, float)) or not math.isfinite(ub)
                               or not 0 < ub <= MAX_RATE):
            raise InputError(self.name, f"unaligned_memory_bandwidth is {ub!r}, not a finite number of bytes/s above 0 "
                                        f"and at most {_plain(MAX_RATE)} (or null: as memory_bandwidth)")

    @property
    def readahead_request(self) -> int | None:
        """The largest readahead window a large read may take (bytes; None: no larger than the readahead maximum)."""
        return self.readahead_request_bytes if self.readahead_request_bytes is not None else self.drive.max_request_bytes

    @property
    def unaligned_copy_rate(self) -> float:
        """Bytes/s one thread copies a page-cache hit that does not start on a cache line."""
        return self.memory_bandwidth if self.unaligned_memory_bandwidth is None else float(self.unaligned_memory_bandwidth)

    @property
    def full_bandwidth(self) -> float:
        """The array's large-read ceiling: members x drive bandwidth, capped by the host link."""
        return min(self.members * self.drive.bandwidth, self.host_bandwidth)

    def steady_rate(self, size: int, depth: int) -> float:
        """Bytes/s of ``depth`` outstanding reads of ``size`` bytes in steady state, each spread
        evenly over the members (:func:`queue_throughput` per member), capped by the host link.
        Exact for a single drive; for an array it ignores how chunk boundaries split a read."""
        d = self.drive
        per_member = queue_throughput(d.request_seconds, d.request_bandwidth, d.bandwidth, d.queue_slots,
                                      size / self.members, depth, d.max_request, shared=d.service == "shared",
                                      request_channel_seconds=d.request_channel_seconds)
        return float(min(self.members * per_member, self.host_bandwidth))

    def scaled(self, factor: float) -> "ArrayProfile":
        """This array with every drive and host rate ``factor`` times as fast (bandwidths x
        ``factor``, request cost and request channel time / ``factor``): the same drives at another speed, e.g. a disk
        measured ``factor`` times as fast as when it was calibrated."""
        if not (math.isfinite(factor) and factor > 0):
            raise InputError(self.name, f"a speed factor must be positive and finite, got {factor!r}")
        d = self.drive
        b1 = None if d.stream_bandwidth is None else d.stream_bandwidth * factor
        drive = replace(d, request_seconds=d.request_seconds / factor, bandwidth=d.bandwidth * factor, stream_bandwidth=b1,
                        request_channel_seconds=d.request_channel_seconds / factor)
        return replace(self, drive=drive, host_bandwidth=self.host_bandwidth * factor)

    def to_json(self) -> dict:
        """The profile as JSON; a drive without request channel time (``c = 0``), a profile
        with Linux's default readahead (128 KiB) and one with the default page-cache copy rate
        (10e9 bytes/s) or none for unaligned copies, the readahead's request or the loader handoff are written without the field, as profiles were
        before it existed, so that their digests stay what they were."""
        obj = asdict(self)
        if not self.drive.request_channel_seconds:
            del obj["drive"]["request_channel_seconds"]
        if self.read_ahead_bytes == DEFAULT_READ_AHEAD_BYTES:
            del obj["read_ahead_bytes"]
        if self.memory_bandwidth == DEFAULT_MEMORY_BANDWIDTH:
            del obj["memory_bandwidth"]
        if self.unaligned_memory_bandwidth is None:
            del obj["unaligned_memory_bandwidth"]
        if self.readahead_request_bytes is None:
            del obj["readahead_request_bytes"]
        if self.loader_handoff is None:
            del obj["loader_handoff"]
        else:
            obj["loader_handoff"] = {"workers": list(self.loader_handoff.workers),
                                     "seconds": list(self.loader_handoff.seconds)}
        return obj

    def digest(self) -> str:
        return digest_of(json.dumps(self.to_json(), sort_keys=True).encode())


def load_device(name_or_path: str) -> ArrayProfile:
    """Load a shipped profile by name, or a profile JSON (e.g. from ``relayout calibrate``)."""
    obj, where = load_shipped("devices", name_or_path, "device profile")
    try:
        obj = {k: v for k, v in obj.items() if k in ArrayProfile.__dataclass_fields__}
        drive = obj.pop("drive")
        drive = DriveProfile(**{k: v for k, v in drive.items() if k in DriveProfile.__dataclass_fields__})
        return ArrayProfile(drive=drive, **obj)
    except InputError as exc:
        raise InputError(where, f"device profile {exc.where}: {exc.problem}" if exc.where else exc.problem) from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InputError(where, f"not a valid device profile ({exc})") from None


@njit(**HELPER)
def split_read(start: int, length: int, members: int, chunk: int, rule: int, max_request: int,
               pieces: np.ndarray, nbytes: np.ndarray) -> None:
    """How one read ``[start, start+length)`` of the logical address space lands on the members.

    Fills ``pieces`` (member requests) and ``nbytes`` (bytes each member transfers), int64
    [members]; ``rule`` is an index into :data:`SPLIT_RULES`. Exact for both splitting rules; a
    member's share is then split into requests of at most ``max_request`` bytes (0: no limit).
    Divisions by a chunk size, member count or request limit that is a power of two (every
    shipped profile's) are shifts and masks: the same integers at a fraction of a division's cost
    (the Mac Pro profile's reads split in about 60-70% of the time).
    """
    if length <= 0:
        for m in range(members):
            pieces[m], nbytes[m] = 0, 0
        return
    if members == 1:
        pieces[0] = 1
        nbytes[0] = length
        _limit_requests(members, max_request, pieces, nbytes)
        return
    if _power_of_two(chunk) and _power_of_two(members):    # the same numbers by shifts and masks
        shift, mask = trailing_zeros(chunk), members - 1
        c0 = start >> shift                             # first and last chunk of the read
        c1 = (start + length - 1) >> shift
        rounds, extra = (c1 - c0 + 1) >> trailing_zeros(members), (c1 - c0 + 1) & mask
        first, last = c0 & mask, c1 & mask
    else:
        c0 = start // chunk
        c1 = (start + length - 1) // chunk
        rounds, extra = divmod(c1 - c0 + 1, members)     # chunks go round the members from c0's
        first, last = c0 % members, c1 % members
    for m in range(members):
        d = m - first if m >= first else m - first + members    # rank of member m in the round
        pieces[m] = rounds + 1 if d < extra else rounds
        nbytes[m] = pieces[m] * chunk
    nbytes[first] -= start - c0 * chunk                 # bytes of the first chunk before the read
    nbytes[last] -= (c1 + 1) * chunk - start - length   # bytes of the last chunk after it
    if rule == APPLE:
        for m in range(members):
            pieces[m] = 1 if nbytes[m] > 0 else 0
    _limit_requests(members, max_request, pieces, nbytes)


@njit(**HELPER)
def _limit_requests(members, max_request, pieces, nbytes):
    """At least ``ceil(nbytes / max_request)`` requests per member (the system's request limit)."""
    if max_request > 0 and _power_of_two(max_request):
        shift = trailing_zeros(max_request)
        for m in range(members):
            pieces[m] = max(pieces[m], -((-nbytes[m]) >> shift))
    elif max_request > 0:
        for m in range(members):
            pieces[m] = max(pieces[m], -(-nbytes[m] // max_request))


@njit(**HELPER)
def largest_request(nbytes: int, members: int, chunk: int, rule: int, max_request: int) -> int:
    """The largest request (bytes) a member's ``nbytes`` of one read reach it as: the system splits
    at ``max_request`` (0: no limit) into requests of that size and one of the rest, md at its
    ``chunk`` boundaries (``rule`` an index into :data:`SPLIT_RULES`; AppleRAID gives each member
    one request before the system's split). Its requests stream side by side, each at ``b_1``, so
    the read streams in this request's time (:mod:`replay.model.device`'s equations)."""
    big = nbytes
    if max_request > 0:
        big = min(big, max_request)
    if members > 1 and rule != APPLE and rule != STORAGE:
        big = min(big, chunk)
    return big


@njit(**HELPER)
def split_device(addr: int, length: int, dev, pieces: np.ndarray, nbytes: np.ndarray) -> None:
    """:func:`split_read` for the compiled model's device ``dev`` (:data:`replay.model.state.Device`):
    on independent drives (rule ``storage``) by its address map, else over the array's members."""
    if dev.rule == STORAGE:
        split_storage(addr, length, dev.seg_start, dev.seg_drive, dev.members, dev.max_request, pieces, nbytes)
    else:
        split_read(addr, length, dev.members, dev.chunk, dev.rule, dev.max_request, pieces, nbytes)


@njit(**HELPER)
def split_storage(start: int, length: int, seg_start: np.ndarray, seg_drive: np.ndarray, drives: int, max_request: int,
                  pieces: np.ndarray, nbytes: np.ndarray) -> None:
    """How one read ``[start, start+length)`` lands on independent drives: the address map's
    segments (``seg_start`` [S] ascending, the first 0; segment ``i`` runs to ``seg_start[i+1]``,
    the last to the end; ``seg_drive`` [S] its drive, neighbours on different drives) each give
    the drive they cross one request of the bytes crossed; then the system's request limit
    ``max_request`` (0: none). Fills ``pieces`` and ``nbytes`` [drives]."""
    for d in range(drives):
        pieces[d], nbytes[d] = 0, 0
    if length <= 0:
        return
    i = np.searchsorted(seg_start, start, side="right") - 1
    pos, end, S = start, start + length, len(seg_start)
    while pos < end:
        stop = min(end, seg_start[i + 1]) if i + 1 < S else end
        d = seg_drive[i]
        nbytes[d] += stop - pos
        pieces[d] += 1
        pos = stop
        i += 1
    _limit_requests(drives, max_request, pieces, nbytes)


@njit(**HELPER)
def _power_of_two(n):
    """``n`` (> 0) is a power of two: a division by it can be a shift (:func:`replay.model.jit.trailing_zeros`)."""
    return n & (n - 1) == 0


@njit(**LOOP)
def _split_reads(start, length, members, chunk, rule, max_request):
    pieces = np.zeros((len(start), members), dtype=np.int64)
    nbytes = np.zeros((len(start), members), dtype=np.int64)
    for i in range(len(start)):
        split_read(start[i], length[i], members, chunk, rule, max_request, pieces[i], nbytes[i])
    return pieces, nbytes


def member_split(device: ArrayProfile, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`split_read` over arrays of reads: ``(pieces, nbytes)``, each int64 [R, members]."""
    return _split_reads(np.asarray(start, dtype=np.int64), np.asarray(length, dtype=np.int64),
                        device.members, device.chunk_bytes, SPLIT_RULES.index(device.split_rule),
                        device.drive.max_request)
