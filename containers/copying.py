"""Moving bytes for the rewrite: ranges copied with ``copy_file_range`` (else ``pread``/``pwrite``),
writes streamed from a background thread, writeback started early, and the source read ahead of
the copy with ``posix_fadvise(WILLNEED)`` so the hashing thread finds it in the page cache.
Sizes are bytes; every source read uses ``pread`` or ``copy_file_range``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from concurrent.futures import Future

import xxhash

from .container import Container
from .errors import InputError
from .output_files import OutputFile, tensor_specs
from .sources import FileRange
from .sparse import DataMap, data_map, is_zero


COPY_CHUNK = 64 * 1024 * 1024


ADVISE_BYTES = 64 * 1024 * 1024
"""Contiguous source bytes advised (``POSIX_FADV_WILLNEED``) in one call, about one span ahead."""


BLOCK_BYTES = 4096


WRITEBACK_BYTES = 128 * 1024 * 1024
"""Bytes copied into an output file between two starts of its writeback (:func:`start_writeback`)."""


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int, buf: bytearray, where: Path) -> None:
    use_kernel = hasattr(os, "copy_file_range")
    while n > 0:
        step = min(n, COPY_CHUNK)
        done = 0
        if use_kernel:
            try:
                done = os.copy_file_range(src_fd, dst_fd, step, src_off, dst_off)
            except OSError as exc:
                if exc.errno not in (18, 22, 38, 95):     # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: fall back
                    raise
                use_kernel = False
                continue
        else:
            view = memoryview(buf)[: min(step, len(buf))]
            got = os.preadv(src_fd, [view], src_off)
            if got <= 0:
                raise InputError(where, f"source ends before byte {src_off + n} (truncated?)")
            done = os.pwritev(dst_fd, [view[:got]], dst_off)
        if done <= 0:
            raise InputError(where, f"source ends before byte {src_off + n} (truncated?)")
        src_off += done
        dst_off += done
        n -= done


def write_stream(fd: int, begin: int, source) -> Future:
    """Write a gathered source (a column segment) at ``begin``, hashing it on the way.

    An all-zero chunk is hashed but not written (the file was extended with zeros), so zeros
    stay holes.
    """
    h = xxhash.xxh3_128()
    pos = begin
    for chunk in source.chunks():
        view = memoryview(chunk)
        if is_zero(view):
            h.update(view)
            pos += len(view)
            continue
        while view:
            n = os.pwrite(fd, view, pos)
            h.update(view[:n])
            view = view[n:]
            pos += n
    if pos - begin != source.nbytes:
        raise InputError(None, f"{source.describe()} gave {pos - begin} bytes, expected {source.nbytes}")
    done: Future = Future()
    done.set_result(h.hexdigest())
    return done


def _libc_sync_file_range():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the disk now, without waiting (Linux ``sync_file_range``).

    Durability still comes from the fsync in :func:`_finish_file`; this only keeps dirty pages
    from piling up, so that fsync has little left to do and the disk writes while we copy.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, SYNC_FILE_RANGE_WRITE)


class Sources:
    """The source files a rewrite reads, each opened read-only once, with its data map."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, DataMap] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def map(self, path: Path) -> DataMap:
        """Where the file's data lies (no probe for a dense file; see :mod:`containers.sparse`)."""
        if path not in self._maps:
            self._maps[path] = data_map(self.fd(path))
        return self._maps[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bytes_to_allocate(src: Container, files: list[OutputFile], sources: Sources) -> int:
    """Bytes the rewrite will allocate for ``files``: their sizes, less the holes of sparse sources.

    A copied data run may allocate a block more at each end (unaligned), counted as such.
    """
    total = 0
    for of in files:
        specs = tensor_specs(src, of)
        if not any(isinstance(s.source, FileRange) and sources.map(s.source.path).sparse for s in specs):
            total += of.size
            continue
        total += min(off for _, off in of.tensors)
        for spec in specs:
            rng = spec.source
            if isinstance(rng, FileRange):
                dmap = sources.map(rng.path)
                end = rng.offset + rng.nbytes
                total += dmap.data_bytes(rng.offset, end) + 2 * BLOCK_BYTES * dmap.data_pieces(rng.offset, end)
            else:
                total += rng.nbytes
    return total


def advise_willneed(fd: int, runs: list[tuple[int, int]]) -> None:
    for a, b in runs:
        try:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):
            pass


class ReadAhead:
    """``WILLNEED`` advice for the sources of one output file, each byte advised once.

    Consecutive sources that are contiguous in one file are merged into spans of up to
    :data:`ADVISE_BYTES`; when source ``i`` is copied, its span and the next are advised. Only
    data runs are advised (a hole would be read ahead as zero pages).
    """

    def __init__(self, srcs: list, sources: Sources, hints: ThreadPoolExecutor):
        self.sources = sources
        self.hints = hints
        self.spans: list[list] = []       # [path, begin, end]
        self.span_of: list[int] = []
        for rng in srcs:
            begin = rng.offset
            end = begin + (rng.nbytes if isinstance(rng, FileRange) else rng.rows * rng.row_bytes)
            last = self.spans[-1] if self.spans else None
            if last is not None and last[0] == rng.path and last[2] == begin and end - last[1] <= ADVISE_BYTES:
                last[2] = end
            else:
                self.spans.append([rng.path, begin, end])
            self.span_of.append(len(self.spans) - 1)
        self.advised = 0

    def advance(self, i: int) -> None:
        """Source ``i`` is about to be copied."""
        want = min(len(self.spans), self.span_of[i] + 2)
        while self.advised < want:
            path, begin, end = self.spans[self.advised]
            fd, dmap = self.sources.fd(path), self.sources.map(path)
            runs = [(a, b) for a, b, is_data in dmap.runs(begin, end) if is_data]
            self.hints.submit(advise_willneed, fd, runs)
            self.advised += 1
