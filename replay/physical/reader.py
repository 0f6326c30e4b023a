"""The harness's reads of a container's files, and how each read's bytes were served.

:class:`Reader` holds per-file descriptors (an O_DIRECT twin where the file system allows it)
and per-thread aligned read buffers (:func:`replay.physical.buffers.read_buffer`); it issues one
read as the runtime does (``pread``, O_DIRECT ranges widened to 4 KiB, reads longer than
:data:`MAX_READ` in pieces of that size, bytes discarded) and says where it was served, as an
:class:`IoTally`: O_DIRECT reads, and buffered reads the page cache could not serve, count on the
drive; buffered reads whose every page the page cache holds, read, count on the page cache
(``mincore`` asked before each read, :mod:`replay.physical.residency`; where Linux will not say,
for a file this process neither owns nor may write, each read is first tried with
``RWF_NOWAIT``, which succeeds only from the cache but races with a fast drive); reads neither
test can classify are ``unclassified``. Bytes; one request per read, whatever its pieces.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from containers.errors import InputError

from replay.physical.buffers import read_buffer
from replay.physical.residency import open_residency

MAX_READ = 64 * 1024 * 1024
"""Longest single ``pread`` (bytes): a longer read is issued in pieces of this size."""

ALIGN = 4096
"""O_DIRECT alignment of offsets and lengths (bytes)."""


@dataclass(frozen=True, slots=True)
class IoTally:
    """Requests and bytes of one or more reads, by where they were served (requests; bytes).

    The field names and order are the STALL_TRACE's read-accounting fields
    (:data:`replay.formats.stalltrace.IO_FIELDS`).

    >>> a = IoTally(drive_requests=1, drive_bytes=4096)
    >>> b = IoTally(page_cache_requests=1, page_cache_bytes=512)
    >>> (a + b).tier, b.tier, IoTally().tier
    ('nvme', 'os_cache', 'nvme')
    """

    drive_requests: int = 0
    drive_bytes: int = 0
    page_cache_requests: int = 0
    page_cache_bytes: int = 0
    unclassified_requests: int = 0
    unclassified_bytes: int = 0

    def __add__(self, other: "IoTally") -> "IoTally":
        return IoTally(
            drive_requests=self.drive_requests + other.drive_requests,
            drive_bytes=self.drive_bytes + other.drive_bytes,
            page_cache_requests=self.page_cache_requests + other.page_cache_requests,
            page_cache_bytes=self.page_cache_bytes + other.page_cache_bytes,
            unclassified_requests=self.unclassified_requests + other.unclassified_requests,
            unclassified_bytes=self.unclassified_bytes + other.unclassified_bytes,
        )

    @property
    def tier(self) -> str:
        """Where a loaded expert's bytes came from (``tier_served``): ``nvme`` when any request
        reached the drive or could not be classified (or none was served from the page cache),
        else ``os_cache``."""
        if self.drive_requests or self.unclassified_requests or not self.page_cache_requests:
            return "nvme"
        return "os_cache"

    def to_json(self) -> dict:
        """The STALL_TRACE read-accounting fields, in :data:`~replay.formats.stalltrace.IO_FIELDS` order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


IO_ZERO = IoTally()
"""No read."""

_DRIVE, _PAGE_CACHE, _UNCLASSIFIED = "drive", "page_cache", "unclassified"


class Reader:
    """Per-file descriptors (O_DIRECT twin when possible) and per-thread aligned buffers.

    Parameters
    ----------
    files : list of Path
        The container's files, in the layout's file order.
    direct : bool
        Open an O_DIRECT twin of each file (weights are read through it where the file system
        allows O_DIRECT).
    """

    def __init__(self, files: list[Path], direct: bool):
        self.buffered = [os.open(p, os.O_RDONLY) for p in files]
        self.direct = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files]
                probe = mmap.mmap(-1, ALIGN)
                os.preadv(fds[0], [probe], 0)
                self.direct = fds
            except OSError:
                self.direct = None
        self.local = threading.local()
        self.residency = open_residency(self.buffered, files)
        self.nowait = self.residency is None and hasattr(os, "RWF_NOWAIT")

    @property
    def page_cache_test(self) -> str:
        """How buffered reads are told apart: ``mincore`` (asked before each read),
        ``RWF_NOWAIT`` (tried first; races with a fast drive, counting too few drive reads) or
        ``none`` (unclassified)."""
        return "mincore" if self.residency is not None else "RWF_NOWAIT" if self.nowait else "none"

    def _buffer(self, n: int) -> memoryview:
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < n:
            buf = read_buffer(n)
            self.local.buf = buf
        return buf

    def prepare(self, n: int) -> None:
        """Give the calling thread its buffer for reads of up to ``n`` bytes
        (:func:`replay.physical.buffers.read_buffer`: huge pages, touched, so its first timed read does
        not fault them in)."""
        self._buffer(min(n, MAX_READ))

    def read(self, f: int, off: int, n: int, direct: bool) -> IoTally:
        """Read bytes ``[off, off + n)`` of file ``f``; returns how they were served: one
        request, counted where its first piece was served, and the bytes of every piece where
        each was."""
        direct = direct and self.direct is not None
        if direct:
            a = off // ALIGN * ALIGN
            e = -(-(off + n) // ALIGN) * ALIGN
            fd, off, n = self.direct[f], a, e - a
        else:
            fd = self.buffered[f]
        requests = {_DRIVE: 0, _PAGE_CACHE: 0, _UNCLASSIFIED: 0}
        nbytes = {_DRIVE: 0, _PAGE_CACHE: 0, _UNCLASSIFIED: 0}
        counted = False
        while n > 0:
            step = min(n, MAX_READ)
            view = memoryview(self._buffer(min(step, MAX_READ)))[:step]
            where, done = _DRIVE, False
            if not direct:
                where = _UNCLASSIFIED
                if self.residency is not None:     # asked first; the read itself is always issued, as the kernel's
                    where = _PAGE_CACHE if self.residency[f].cached(off, step) else _DRIVE   # readahead follows the reads it sees
                elif self.nowait:
                    where = _DRIVE
                    try:
                        if os.preadv(fd, [view], off, os.RWF_NOWAIT) == step:
                            where, done = _PAGE_CACHE, True    # served by the page cache
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.nowait, where = False, _UNCLASSIFIED   # not supported here: unclassified from now on
            if not done:
                got = os.preadv(fd, [view], off)
                if got < step:
                    if direct and got >= 0:
                        requests[_DRIVE] += 0 if counted else 1
                        nbytes[_DRIVE] += got
                        return _tally(requests, nbytes)   # an O_DIRECT window may reach past the end of the file
                    raise InputError(None, f"short read at byte {off}")
            if not counted:               # one request per read, as the runtime issues it, whatever the pieces
                requests[where] += 1
                counted = True
            nbytes[where] += step
            off += step
            n -= step
        return _tally(requests, nbytes)

    def close(self) -> None:
        """Close the descriptors and the residency mappings."""
        for r in self.residency or []:
            r.close()
        for fd in self.buffered + (self.direct or []):
            os.close(fd)


def _tally(requests: dict, nbytes: dict) -> IoTally:
    return IoTally(drive_requests=requests[_DRIVE], drive_bytes=nbytes[_DRIVE],
                   page_cache_requests=requests[_PAGE_CACHE], page_cache_bytes=nbytes[_PAGE_CACHE],
                   unclassified_requests=requests[_UNCLASSIFIED], unclassified_bytes=nbytes[_UNCLASSIFIED])
