"""Where tensor bytes come from when a shard is written: a byte range of an existing file, a
column block of a row-major region (a split segment), deterministic pseudo-random bytes for
synthetic containers, or a short stamp followed by zeros (sparse synthetic containers).

A source knows its length and yields its bytes in bounded chunks, so writers never hold a
whole tensor in memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import xxhash

from .errors import InputError

CHUNK_BYTES = 8 * 1024 * 1024
"""Default chunk size for streaming copies (bytes)."""


class ByteSource(Protocol):
    nbytes: int

    def chunks(self) -> Iterator[bytes | memoryview]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class FileRange:
    """``nbytes`` bytes of ``path`` starting at absolute offset ``offset``; read-only."""

    path: Path
    offset: int
    nbytes: int
    chunk_bytes: int = CHUNK_BYTES

    def chunks(self) -> Iterator[memoryview]:
        buf = bytearray(min(self.chunk_bytes, max(self.nbytes, 1)))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pos, left = self.offset, self.nbytes
            while left > 0:
                want = min(left, len(buf))
                got = os.preadv(fd, [memoryview(buf)[:want]], pos)
                if got <= 0:
                    raise InputError(self.path, f"unexpected end of file at byte {pos} (truncated?)")
                yield memoryview(buf)[:got]
                pos += got
                left -= got
        finally:
            os.close(fd)

    def describe(self) -> str:
        return f"{self.path}@{self.offset}"


def _seed_for(seed: int, key: str) -> int:
    return xxhash.xxh64_intdigest(key.encode(), seed=seed & 0xFFFFFFFFFFFFFFFF)


_POOL_WORDS = 2 * 1024 * 1024  # 16 MiB of uint64 words
_GOLDEN = 0x9E3779B97F4A7C15
_U64 = 0xFFFFFFFFFFFFFFFF


@functools.lru_cache(maxsize=4)
def _random_pool(seed: int) -> np.ndarray:
    rng = np.random.Generator(np.random.SFC64(seed & 0xFFFFFFFFFFFFFFFF))
    return rng.integers(0, 2**64, size=_POOL_WORDS, dtype=np.uint64, endpoint=False)


@dataclass(frozen=True)
class SeededBytes:
    """Deterministic pseudo-random bytes keyed by ``(seed, key)``.

    Bytes are a key-dependent window of a 16 MiB random pool XORed with a key- and
    cycle-dependent word, so distinct keys give distinct bytes at several GB/s. The stream is
    produced in fixed 4 MiB blocks: the bytes do not depend on how a consumer reads them.
    """

    seed: int
    key: str
    nbytes: int
    block_bytes: int = 4 * 1024 * 1024

    def chunks(self) -> Iterator[bytes]:
        pool = _random_pool(self.seed)
        h = _seed_for(self.seed, self.key)
        start = h % _POOL_WORDS
        mask = xxhash.xxh64_intdigest(self.key.encode(), seed=h)
        total_words = (self.nbytes + 7) // 8
        block_words = self.block_bytes // 8
        done = 0
        for j0 in range(0, total_words, block_words):
            j1 = min(total_words, j0 + block_words)
            parts = []
            j = j0
            while j < j1:
                cycle, off = divmod(start + j, _POOL_WORDS)
                take = min(j1 - j, _POOL_WORDS - off)
                parts.append(pool[off : off + take] ^ np.uint64((mask + cycle * _GOLDEN) & _U64))
                j += take
            words = parts[0] if len(parts) == 1 else np.concatenate(parts)
            n = min(self.nbytes - done, len(words) * 8)
            yield words.tobytes()[:n]
            done += n

    def describe(self) -> str:
        return f"seeded bytes {self.key!r}"


@dataclass(frozen=True)
class SeededScales:
    """Deterministic positive float32 quantisation scales (``nbytes`` must be a multiple of 4)."""

    seed: int
    key: str
    nbytes: int
    block_floats: int = 1024 * 1024

    def chunks(self) -> Iterator[bytes]:
        rng = np.random.Generator(np.random.PCG64(_seed_for(self.seed, self.key)))
        left = self.nbytes // 4
        while left > 0:
            n = min(left, self.block_floats)
            yield rng.uniform(1e-3, 3e-2, size=n).astype("<f4").tobytes()
            left -= n

    def describe(self) -> str:
        return f"seeded scales {self.key!r}"


@dataclass(frozen=True)
class Stamped:
    """``nbytes`` bytes: ``stamp``'s bytes first, zeros after (a sparse synthetic tensor).

    :meth:`chunks` yields every byte (the zeros included), so any consumer sees the same bytes;
    a writer that can leave holes writes only :meth:`data` and seeks over the rest.
    """

    stamp: ByteSource
    nbytes: int
    chunk_bytes: int = CHUNK_BYTES

    def __post_init__(self):
        if self.stamp.nbytes > self.nbytes:
            raise ValueError(f"stamp of {self.stamp.nbytes} bytes is longer than the {self.nbytes}-byte source")

    def data(self) -> Iterator[tuple[int, bytes | memoryview]]:
        """``(offset, chunk)`` for the non-zero part: the stamp at offset 0."""
        pos = 0
        for chunk in self.stamp.chunks():
            yield pos, chunk
            pos += len(chunk)

    def chunks(self) -> Iterator[bytes | memoryview]:
        yield from self.stamp.chunks()
        zeros = memoryview(bytes(min(self.chunk_bytes, max(self.nbytes - self.stamp.nbytes, 1))))
        left = self.nbytes - self.stamp.nbytes
        while left > 0:
            k = min(left, len(zeros))
            yield zeros[:k]
            left -= k

    def describe(self) -> str:
        return f"{self.stamp.describe()} then zeros to {self.nbytes} bytes"


@dataclass(frozen=True)
class StridedRange:
    """Bytes ``[start, start+length)`` of every row of a row-major region of ``path``.

    The region begins at ``offset`` and has ``rows`` rows of ``row_bytes`` bytes; rows are read in
    blocks of at most ``chunk_bytes`` and their slices concatenated (a column block of a matrix).
    """

    path: Path
    offset: int
    rows: int
    row_bytes: int
    start: int
    length: int
    chunk_bytes: int = CHUNK_BYTES

    @property
    def nbytes(self) -> int:
        return self.rows * self.length

    def chunks(self) -> Iterator[bytes]:
        per = max(1, self.chunk_bytes // max(self.row_bytes, 1))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for r0 in range(0, self.rows, per):
                n = min(per, self.rows - r0)
                want = n * self.row_bytes
                block = os.pread(fd, want, self.offset + r0 * self.row_bytes)
                if len(block) != want:
                    raise InputError(self.path, f"unexpected end of file near byte {self.offset + r0 * self.row_bytes} (truncated?)")
                rows = np.frombuffer(block, dtype=np.uint8).reshape(n, self.row_bytes)
                yield rows[:, self.start : self.start + self.length].tobytes()
        finally:
            os.close(fd)

    def describe(self) -> str:
        return f"{self.path}@{self.offset} (columns {self.start}+{self.length} of {self.rows} rows)"
