"""Which pages of a file the page cache holds, asked without reading them (Linux ``mincore``).

The harness (:mod:`replay.physical.measure`) classifies each buffered read before issuing it: a read
whose every page the page cache holds, read (up to date), is served from it; any other waits
for the drive. Linux's ``mincore`` reports a page only once its read has completed
(``mincore_page``: ``folio_test_uptodate``), so a read that finds its pages still being read by
an earlier readahead counts as waiting for the drive, which it does, though it issues no
request of its own; :mod:`replay.model.pagecache` counts it as served from the cache. (``RWF_NOWAIT``,
the test this replaces, races: it also succeeds when a read's own readahead completes before
it looks, which on a fast virtual disk takes microseconds.)

Linux answers ``mincore`` about the page cache only for a file the caller owns or may write
(otherwise it reports every page held: :func:`residency_visible` says which);
other systems have no such call for files and get ``None`` from :func:`open_residency`.

References
----------
mincore(2), Linux man-pages; ``can_do_mincore`` and ``mincore_page`` in Linux ``mm/mincore.c``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

import numpy as np

PAGE_BYTES = mmap.PAGESIZE
"""The page cache's unit (bytes)."""


def residency_visible(path: str | os.PathLike) -> bool:
    """Whether Linux's ``mincore`` reports the page cache for ``path`` to this process: the
    caller owns the file, may write it, or is root (``can_do_mincore``: the owner, write
    permission, or ``CAP_FOWNER``); otherwise the kernel reports every page as held and the
    answer would be worthless. Root without ``CAP_FOWNER`` (a user namespace, a file system that
    squashes root) is taken at its uid and would get that worthless answer."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    effective = os.access in os.supports_effective_ids
    return os.geteuid() in (0, st.st_uid) or os.access(path, os.W_OK, effective_ids=effective)


class FileResidency:
    """Page-cache residency of one open file, through a read-only shared mapping that is never
    touched (it reserves no memory, so a file of any size maps).

    Parameters
    ----------
    fd : int
        A descriptor of the file, open for reading.
    size : int
        The file's size (bytes); an empty file holds nothing to read.
    """

    def __init__(self, fd: int, size: int):
        self._size = size
        self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size > 0 else None
        self._addr = 0
        if self._map is not None:
            view = np.frombuffer(self._map, dtype=np.uint8)
            self._addr = view.ctypes.data
            del view                             # releases the export, so close() can unmap
        self._libc = ctypes.PyDLL(None, use_errno=True)     # keeps the GIL: the call takes well under a microsecond
        self._libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._libc.mincore.restype = ctypes.c_int
        self._local = threading.local()

    def _pages(self, start: int, n: int) -> bytes:
        """``mincore``'s answer for ``n`` pages from page-aligned byte ``start``: a byte a page,
        its lowest bit set where held (the other bits are reserved)."""
        vec = getattr(self._local, "vec", None)
        if vec is None or len(vec) < n:
            vec = (ctypes.c_ubyte * max(n, 64))()
            self._local.vec = vec
        if self._libc.mincore(self._addr + start, n * PAGE_BYTES, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
        return ctypes.string_at(vec, n)

    def cached(self, offset: int, length: int) -> bool:
        """Whether every page holding bytes ``[offset, offset + length)`` is in the page cache
        (about 2 us a call: the harness asks before every buffered read). A range that holds no
        byte of the file (empty, or at or past its end) has nothing to wait for: True."""
        end = min(offset + length, self._size)
        if end <= offset:
            return True
        first = offset // PAGE_BYTES * PAGE_BYTES
        n = -(-(end - first) // PAGE_BYTES)
        held = self._pages(first, n)
        return held.count(1) == n or all(b & 1 for b in held)

    def cached_run(self, start: int, limit: int) -> int:
        """Bytes held contiguously from page-aligned byte ``start``, looking at most ``limit``
        bytes (a file's partial last page counts for the bytes it holds)."""
        span = min(limit, self._size - start)
        if span <= 0:
            return 0
        n = -(-span // PAGE_BYTES)
        missing = np.flatnonzero((np.frombuffer(self._pages(start, n), dtype=np.uint8) & 1) == 0)
        return int(min(missing[0] * PAGE_BYTES, span) if len(missing) else span)

    def close(self) -> None:
        """Unmap the file (the descriptor stays the caller's)."""
        if self._map is not None:
            self._map.close()


def open_residency(fds: list[int], paths: list[str | os.PathLike]) -> list[FileResidency] | None:
    """A :class:`FileResidency` per descriptor (``fds[i]`` open on ``paths[i]``), or None when
    this system cannot tell residency for all of them (not Linux, a file this process neither
    owns nor may write, or a file that cannot be mapped)."""
    if len(fds) != len(paths):
        raise ValueError("one path per descriptor")
    if not all(residency_visible(p) for p in paths):
        return None
    out: list[FileResidency] = []
    try:
        for fd in fds:
            out.append(FileResidency(fd, os.fstat(fd).st_size))
    except (OSError, ValueError):
        for r in out:
            r.close()
        return None
    return out
