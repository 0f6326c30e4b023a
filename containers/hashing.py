"""Streaming xxh3-128 hashing of whole files and of the tensor byte ranges inside them.

Each file is read once, sequentially, in fixed-size chunks into one reusable buffer (memory is
bounded by the chunk size whatever the file size). A reader thread fills the next buffer while
the caller's thread hashes the current one; xxhash releases the GIL, so the two overlap.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import xxhash

from .errors import InputError

CHUNK_BYTES = 16 * 1024 * 1024
"""Read size for hashing (bytes)."""


def iter_file_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES, start: int = 0, length: int | None = None) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, chunk)`` covering ``length`` bytes of ``path`` from ``start``.

    Two buffers rotate between a reader thread and the consumer, so reading overlaps the
    consumer's work. Each yielded chunk is valid until the next one is requested.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size if length is None else start + length
        try:
            os.posix_fadvise(fd, start, size - start, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        free: queue.Queue = queue.Queue()
        for _ in range(2):
            free.put(bytearray(chunk_bytes))
        full: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        def reader():
            pos = start
            try:
                while pos < size and not stop.is_set():
                    buf = free.get()
                    if buf is None:
                        return
                    want = min(chunk_bytes, size - pos)
                    got = os.preadv(fd, [memoryview(buf)[:want]], pos)
                    if got <= 0:
                        full.put(InputError(path, f"unexpected end of file at byte {pos} (truncated?)"))
                        return
                    full.put((pos, buf, got))
                    pos += got
                full.put(None)
            except OSError as exc:
                full.put(InputError(path, exc.strerror or str(exc)))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            while True:
                item = full.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                pos, buf, got = item
                yield pos, memoryview(buf)[:got]
                free.put(buf)
        finally:
            stop.set()
            free.put(None)
            t.join()
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Range:
    """A named byte range ``[begin, end)`` of a file (absolute offsets)."""

    name: str
    begin: int
    end: int


def hash_file(
    path: Path,
    ranges: Sequence[Range] = (),
    on_bytes: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[str, dict[str, str]]:
    """Hash a whole file and each of ``ranges`` in one sequential pass.

    Returns ``(file xxh3-128 hex, {range name: xxh3-128 hex})``. Ranges must not overlap.
    """
    file_h = xxhash.xxh3_128()
    ordered = sorted((r for r in ranges), key=lambda r: r.begin)
    hashers = {r.name: xxhash.xxh3_128() for r in ordered}
    i = 0
    for pos, chunk in iter_file_chunks(path, chunk_bytes):
        file_h.update(chunk)
        end = pos + len(chunk)
        while i < len(ordered) and ordered[i].end <= pos:
            i += 1
        j = i
        while j < len(ordered) and ordered[j].begin < end:
            r = ordered[j]
            a, b = max(r.begin, pos), min(r.end, end)
            if a < b:
                hashers[r.name].update(chunk[a - pos : b - pos])
            j += 1
        if on_bytes is not None:
            on_bytes(len(chunk))
    return file_h.hexdigest(), {name: h.hexdigest() for name, h in hashers.items()}


def digest_of(obj_bytes: bytes) -> str:
    """xxh3-128 hex digest of a byte string."""
    return xxhash.xxh3_128_hexdigest(obj_bytes)
