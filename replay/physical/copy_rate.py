"""The page-cache copy rate: how fast threads copy buffered reads the page cache serves into their
read buffers (a runtime's page-cache hit), measured on a region of a file held in the page cache.
Bytes and bytes/s.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from containers.errors import InputError

from replay.physical.buffers import read_buffer
from replay.physical.residency import open_residency


COPY_READ_BYTES = 2 * 1024 * 1024
"""The size of each buffered read :func:`page_cache_copy` times (bytes): an expert-sized read."""
COPY_REGION_BYTES = 256 * 1024 * 1024
"""The most of the file :func:`page_cache_copy` reads from (bytes): far more than a CPU's caches
hold, so the bytes come from memory, as a runtime's page-cache hits over a large model do."""
COPY_DESTINATION_BYTES = 32 * 1024 * 1024
"""Each copying thread's read buffers together (bytes): reads land in them in turn, so that the
destination is not a CPU-cached buffer either."""
COPY_THREADS = (1, 2, 4)
"""The thread counts :func:`page_cache_copy` measures (the first gives ``memory_bandwidth``)."""
UNALIGNED_SHIFT = 8
"""Bytes past a page boundary at which :func:`page_cache_copy`'s unaligned reads start (inside a
cache line, as a safetensors tensor's data usually starts: the profile's
``unaligned_memory_bandwidth``)."""
PAIRED_TRIALS = 5
"""Trials of one thread's aligned then unaligned reads, taken in turn (:func:`unaligned_factor`)."""


def unaligned_factor(ratios: list[float]) -> float:
    """How much faster one thread copies reads off the cache line than on it, from paired trials'
    ratios (unaligned over aligned, each pair taken back to back): their median when every pair
    says the same (all above 1, or all below), else 1.0 (the difference is not told apart from
    the trials' noise, so the model is given none)."""
    if not ratios or min(ratios) <= 1.0 <= max(ratios):
        return 1.0
    s = sorted(ratios)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def page_cache_copy(path: str | os.PathLike, seconds: float, huge_pages: bool = True,
                    threads: tuple[int, ...] = COPY_THREADS, size: int = COPY_READ_BYTES,
                    region: int = COPY_REGION_BYTES) -> dict:
    """How fast buffered reads that the page cache serves are copied into read buffers.

    The first ``region`` bytes of ``path`` (only read; at most its size, whole reads of ``size``)
    are read once buffered, which brings them into the page cache; then, for each count ``n`` in
    ``threads``, ``n`` threads released together each issue buffered preads of ``size`` bytes
    through the region (each from its own place, in file order, round and round) into their own
    buffers (:func:`replay.physical.buffers.read_buffer` of the kind ``huge_pages`` says,
    :data:`COPY_DESTINATION_BYTES` a thread, used in turn) for ``seconds``. Then one thread
    takes :data:`PAIRED_TRIALS` pairs of half as long, the same reads then every read starting
    :data:`UNALIGNED_SHIFT` bytes later, off the cache line (the kernel's copy into a page-aligned
    buffer can be slower then); the unaligned rate is the first count's per-thread rate times
    :func:`unaligned_factor` of the pairs' ratios.

    Parameters
    ----------
    path : the file to read.
    seconds : time per thread count (s).
    huge_pages : read into the harness's huge-page buffers (True) or buffers as colibrì's (False).
    threads : the thread counts, the first the one whose rate is ``bytes_per_second``.
    size : bytes per read.
    region : bytes of the file read from, at most.

    Returns
    -------
    ``read_bytes``, ``region_bytes``, ``seconds``, ``rates`` (per count: ``threads``,
    ``bytes_per_second`` all threads together and ``per_thread_Bps``, bytes/s), ``bytes_per_second``
    (the first count's aggregate rate), ``unaligned_shift``, ``unaligned_ratios`` (the pairs') and
    ``unaligned_bytes_per_second`` (one thread, reads off the cache line, bytes/s), ``cores`` (CPUs this process may run on) and
    ``resident_fraction`` (of the region's pages in the page cache after the measurement, None
    where the system does not say: below 1, some reads waited for the drive and the rates are low).
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        region = min(region, file_size) // size * size
        if region < 2 * size:
            raise InputError(path, f"too small for two {size}-byte page-cache reads")
        bufs = [read_buffer(max(COPY_DESTINATION_BYTES, size), huge_pages) for _ in range(max(threads))]
        for off in range(0, region, size):                     # into the page cache
            os.preadv(fd, [bufs[0][:size]], off)
        rates = [timed_copy_rate(fd, n, seconds, size, region, bufs) for n in threads]
        shifted = region if region + UNALIGNED_SHIFT <= file_size else region - size
        ratios = [timed_copy_rate(fd, 1, seconds / 2, size, shifted, bufs, UNALIGNED_SHIFT)
                  / timed_copy_rate(fd, 1, seconds / 2, size, shifted, bufs) for _ in range(PAIRED_TRIALS)]
        unaligned = rates[0] / threads[0] * unaligned_factor(ratios)
        resident = None
        residency = open_residency([fd], [path])
        if residency is not None:
            try:
                resident = residency[0].cached_run(0, region) / region
            finally:
                residency[0].close()
    except OSError as exc:
        raise InputError(path, f"read failed: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    return {"read_bytes": size, "region_bytes": region, "seconds": seconds,
            "rates": [{"threads": n, "bytes_per_second": r, "per_thread_Bps": r / n} for n, r in zip(threads, rates)],
            "bytes_per_second": rates[0], "unaligned_shift": UNALIGNED_SHIFT, "unaligned_ratios": ratios,
            "unaligned_bytes_per_second": unaligned,
            "cores": cores, "resident_fraction": resident}


def timed_copy_rate(fd: int, n: int, seconds: float, size: int, region: int, bufs: list, shift: int = 0) -> float:
    """Bytes/s that ``n`` threads together copy with buffered preads of ``size`` bytes from the
    first ``region`` bytes of ``fd`` (each read ``shift`` bytes past a multiple of ``size``) into
    ``bufs[k]`` (thread k's, used ``size`` bytes at a time in turn) in ``seconds``
    (:func:`page_cache_copy`)."""
    started: list[float] = []
    gate = threading.Barrier(n, action=lambda: started.append(time.perf_counter()))
    copied = [0] * n
    ended = [0.0] * n
    failed: list[OSError] = []
    reads = region // size

    def worker(k: int) -> None:
        slots = len(bufs[k]) // size
        i, slot = k * reads // n, 0
        gate.wait()
        stop = started[0] + seconds
        while time.perf_counter() < stop:
            try:
                copied[k] += os.preadv(fd, [bufs[k][slot * size:(slot + 1) * size]], (i % reads) * size + shift)
            except OSError as exc:
                failed.append(exc)
                break
            i, slot = i + 1, (slot + 1) % slots
        ended[k] = time.perf_counter()

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if failed:
        raise failed[0]
    return sum(copied) / (max(ended) - started[0])
