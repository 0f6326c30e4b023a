"""Holes in files: where a file's data lies, so holes are hashed and copied without being read.

A sparse file (one with unallocated ranges, "holes", that read as zeros) is handled without ever
filling it in: :func:`data_map` asks the file system where data lies (``lseek`` with
``SEEK_DATA``/``SEEK_HOLE``), hashing feeds the hasher zeros from one small reusable buffer for
a hole (:func:`feed_zeros`: the digest is the same as if the zeros had been read, so a file's
digest does not depend on whether it is stored sparse or dense), and the rewriter copies only
the data ranges into a destination file that was extended with ``ftruncate`` (its holes stay
holes).

A dense file pays nothing: when ``fstat`` says the blocks allocated cover the file's size
(``st_blocks * 512 >= st_size``), the file is taken to have no holes and no ``lseek`` is made.
File systems without ``SEEK_DATA`` are treated as dense (correct, only slower on sparse files).
All offsets and sizes are in bytes.
"""

from __future__ import annotations

import bisect
import errno
import os
from dataclasses import dataclass
from typing import Iterator

ZERO_CHUNK_BYTES = 4 * 1024 * 1024
"""Zeros fed to a hasher per call for a hole (a buffer small enough to stay in the CPU cache)."""

_ZERO_BYTES = bytes(ZERO_CHUNK_BYTES)
_ZEROS = memoryview(_ZERO_BYTES)

_SEEK_DATA = getattr(os, "SEEK_DATA", None)
_SEEK_HOLE = getattr(os, "SEEK_HOLE", None)


@dataclass(frozen=True)
class DataMap:
    """Where data lies in ``[begin, end)`` of a file: sorted, disjoint ``(a, b)`` extents.

    ``extents is None`` means all of ``[begin, end)`` is data (a dense file, or a file system
    that cannot tell). Bytes outside the extents read as zeros.
    """

    begin: int
    end: int
    extents: tuple[tuple[int, int], ...] | None

    @property
    def sparse(self) -> bool:
        return self.extents is not None

    def runs(self, begin: int, end: int) -> Iterator[tuple[int, int, bool]]:
        """``(a, b, is_data)`` runs covering ``[begin, end)`` in order (``begin..end`` within the map)."""
        if begin >= end:
            return
        if self.extents is None:
            yield begin, end, True
            return
        starts = [a for a, _ in self.extents]
        i = max(0, bisect.bisect_right(starts, begin) - 1)
        pos = begin
        while pos < end and i < len(self.extents):
            a, b = self.extents[i]
            i += 1
            if b <= pos:
                continue
            if a >= end:
                break
            if a > pos:
                yield pos, a, False
                pos = a
            stop = min(b, end)
            yield pos, stop, True
            pos = stop
        if pos < end:
            yield pos, end, False

    def data_bytes(self, begin: int, end: int) -> int:
        """Bytes of ``[begin, end)`` that lie in data extents (all of them for a dense file)."""
        return sum(b - a for a, b, data in self.runs(begin, end) if data)

    def data_pieces(self, begin: int, end: int) -> int:
        """Number of data runs in ``[begin, end)``."""
        return sum(1 for _, _, data in self.runs(begin, end) if data)


def data_map(fd: int, st: os.stat_result | None = None, begin: int = 0, end: int | None = None) -> DataMap:
    """The data extents of ``[begin, end)`` (default: the whole file) of the open file ``fd``.

    No ``lseek`` is made when the file's allocated blocks cover its size (a dense file).
    """
    st = st if st is not None else os.fstat(fd)
    end = st.st_size if end is None else min(end, st.st_size)
    if begin >= end or _SEEK_DATA is None or st.st_blocks * 512 >= st.st_size:
        return DataMap(begin, max(begin, end), None)
    extents = []
    pos = begin
    while pos < end:
        try:
            a = os.lseek(fd, pos, _SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:        # no data after pos: the rest is a hole
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return DataMap(begin, end, None)
            raise
        if a >= end:
            break
        b = min(os.lseek(fd, a, _SEEK_HOLE), end)
        extents.append((a, b))
        pos = b
    return DataMap(begin, end, tuple(extents))


def feed_zeros(hasher, n: int) -> None:
    """Update ``hasher`` with ``n`` zero bytes without reading or allocating them."""
    while n > 0:
        k = min(n, ZERO_CHUNK_BYTES)
        hasher.update(_ZEROS[:k])
        n -= k


def is_zero(chunk) -> bool:
    """True when every byte of ``chunk`` is zero (``memcmp`` with the zero buffer, block by block)."""
    view = memoryview(chunk).cast("B")
    return all(_ZERO_BYTES.startswith(view[pos : pos + ZERO_CHUNK_BYTES]) for pos in range(0, len(view), ZERO_CHUNK_BYTES))


__all__ = ["DataMap", "data_map", "feed_zeros", "is_zero", "ZERO_CHUNK_BYTES"]
