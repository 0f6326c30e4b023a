"""Streaming xxh3-128 hashing of files and of the tensor byte ranges inside them, in one pass.

A file is cut into segments: its tensors, and the bytes between them (header, padding, tail).
Every segment gets its own xxh3-128; the file digest is the xxh3-128 of the file size and the
segment digests in physical order, so every byte of the file is covered exactly once and each
byte is hashed once. (It is therefore not the digest ``xxhsum`` prints for the file.)

Files are read (``pread``) and hashed one window at a time (8 MiB, one reused buffer), so
memory stays bounded whatever the file size, and a file truncated while it is read is an error
naming it (a mapped page past the end would kill the process with SIGBUS). The holes of a
sparse file are not read: they are hashed as zeros (:mod:`containers.sparse`), which gives the
digest a dense copy has. The segments of a window are shared between two threads (xxhash
releases the GIL), and the kernel is asked to read the next window ahead while the current one
is hashed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import xxhash

from .errors import InputError
from .sparse import DataMap, data_map, feed_zeros

WINDOW_BYTES = 8 * 1024 * 1024
"""Bytes read and hashed at a time: small enough that the copy out of the page cache is hashed
from the CPU's cache (hot 512 MB file on this 2-core VM: 1.1-2.1 GB/s, as fast as a 64 MiB
mapping; a 64 MiB read buffer ran at 0.8-0.9 GB/s)."""

_HASH_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-hash")


@dataclass(frozen=True)
class Range:
    """A named byte range ``[begin, end)`` of a file (absolute offsets)."""

    name: str
    begin: int
    end: int


def segments(ranges: Sequence[Range], size: int) -> list[Range]:
    """Tensors plus the gaps between them, covering ``[0, size)`` in order."""
    out, pos = [], 0
    for r in sorted(ranges, key=lambda r: (r.begin, r.end, r.name)):
        if r.begin < pos:
            raise ValueError(f"range {r.name!r} overlaps the previous one")
        if r.begin > pos:
            out.append(Range(f"gap@{pos}", pos, r.begin))
        out.append(r)
        pos = r.end
    if pos < size:
        out.append(Range(f"gap@{pos}", pos, size))
    return out


def file_digest(size: int, segment_digests: Sequence[bytes]) -> str:
    """The file digest from its size and its segments' digests in physical order."""
    return xxhash.xxh3_128_hexdigest(size.to_bytes(8, "little") + b"".join(segment_digests))


def hash_file(
    path: Path,
    ranges: Sequence[Range] = (),
    on_bytes: Callable[[int], None] | None = None,
    window_bytes: int = WINDOW_BYTES,
) -> tuple[str, dict[str, str]]:
    """Hash a file and each of ``ranges`` (absolute, non-overlapping) in one sequential pass.

    Holes of a sparse file are hashed as the zeros they read as, without being read
    (:mod:`containers.sparse`), so the digests do not depend on how the file is stored.
    ``on_bytes`` receives logical bytes (holes included).

    Returns ``(file digest hex, {range name: xxh3-128 hex})``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        size = st.st_size
        if ranges and max(r.end for r in ranges) > size:
            raise InputError(path, f"file is {size} bytes but a tensor ends beyond it (truncated?)")
        segs = segments(ranges, size)
        hashers = [xxhash.xxh3_128() for _ in segs]
        first = 0
        for pos, end, view, base in _windows(fd, data_map(fd, st), 0, size, window_bytes, path):
            while segs[first].end <= pos:
                first += 1
            pieces = []
            j = first
            while j < len(segs) and segs[j].begin < end:
                pieces.append((j, max(segs[j].begin, pos) - base, min(segs[j].end, end) - base))
                j += 1
            _hash_pieces(view, pieces, hashers)
            if on_bytes is not None:
                on_bytes(end - pos)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    digests = [h.digest() for h in hashers]
    names = {r.name for r in ranges}
    per_range = {seg.name: h.hexdigest() for seg, h in zip(segs, hashers) if seg.name in names}
    for r in ranges:
        if r.begin == r.end:
            per_range[r.name] = xxhash.xxh3_128_hexdigest(b"")
    return file_digest(size, digests), per_range


def _windows(fd: int, dmap: DataMap, begin: int, end: int, window_bytes: int, path: Path):
    """``(pos, stop, view, base)`` for consecutive windows ``[pos, stop)`` of ``[begin, end)``.

    In a data run ``view`` holds the file's bytes from ``base == pos`` to ``stop``, read with
    ``pread`` into one reused buffer, and the next window is advised to the kernel; in a hole
    ``view`` is None (the window reads as zeros). A file that ends early (truncated while it is
    read) is one :class:`InputError` naming it, never a fault of a mapped page.
    """
    window_bytes = max(4096, window_bytes)
    buf = None
    for a, b, is_data in dmap.runs(begin, end):
        pos = a
        while pos < b:
            stop = min(b, pos + window_bytes)
            if not is_data:
                yield pos, stop, None, pos
                pos = stop
                continue
            if stop < b:
                _advise(fd, stop, min(window_bytes, b - stop))
            n = stop - pos
            if buf is None:
                buf = bytearray(min(window_bytes, end - begin))
            view = memoryview(buf)[:n]
            try:
                got = 0
                while got < n:
                    k = os.preadv(fd, [view[got:]], pos + got)
                    if k <= 0:
                        raise InputError(path, f"ends at byte {pos + got}, before byte {stop} (truncated while it was read?)")
                    got += k
                yield pos, stop, view, pos
            finally:
                view.release()
            pos = stop


def _hash_pieces(view: memoryview | None, pieces: list[tuple[int, int, int]], hashers) -> None:
    """Hash each (segment index, start, end) piece of a window, sharing the work with a thread.

    ``view`` None: the window is a hole and each piece is that many zeros.
    """
    total = sum(b - a for _, a, b in pieces)
    mine, theirs, acc = [], [], 0
    for piece in pieces:
        (mine if acc < total / 2 else theirs).append(piece)
        acc += piece[2] - piece[1]

    def run(batch):
        for j, a, b in batch:
            if view is None:
                feed_zeros(hashers[j], b - a)
            else:
                hashers[j].update(view[a:b])

    pending = _HASH_POOL.submit(run, theirs) if theirs else None
    run(mine)
    if pending is not None:
        pending.result()


def hash_range(path: Path, begin: int, end: int, window_bytes: int = WINDOW_BYTES) -> str:
    """xxh3-128 hex digest of bytes ``[begin, end)`` of ``path``, read window by window (holes not read)."""
    h = xxhash.xxh3_128()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        if end > st.st_size:
            raise InputError(path, f"range ends at byte {end}, beyond the end of the file (truncated?)")
        for pos, stop, view, base in _windows(fd, data_map(fd, st, begin, end), begin, end, window_bytes, path):
            if view is None:
                feed_zeros(h, stop - pos)
            else:
                h.update(view[pos - base : stop - base])
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    return h.hexdigest()


def gap_digest(data: bytes) -> bytes:
    """Segment digest (raw 16 bytes) of a gap's bytes."""
    return xxhash.xxh3_128_digest(data)


def _advise(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):
        pass


def digest_of(obj_bytes: bytes) -> str:
    """xxh3-128 hex digest of a byte string."""
    return xxhash.xxh3_128_hexdigest(obj_bytes)
