"""``relayout calibrate PATH``: measure the device holding PATH and fit a device profile.

Reads of 4 KiB to 32 MiB at random aligned offsets, at queue depths 1 to 32 (one thread per
outstanding request), each cell for a fixed time. The page cache is bypassed with O_DIRECT where
the file system allows it, else the test file is evicted with ``posix_fadvise`` before each cell;
the profile says which. The fit, for the single-drive model of :mod:`replay.device`:

* ``bandwidth``: the median throughput of large (>= 4 MiB) reads over all queue depths (the best
  cell overstates a drive that cannot sustain it);
* ``request_seconds``: the 4 KiB latency at queue depth 1 minus its transfer time;
* ``queue_slots``: 4 KiB IOPS at the deepest queue x ``request_seconds`` (Little's law).

PATH may be a file (read only) or a directory (a temporary test file is written there, fsynced,
and removed afterwards).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.errors import InputError

SIZES = (4096, 65536, 524288, 4 * 1024 * 1024, 32 * 1024 * 1024)
DEPTHS = (1, 4, 16, 32)
ALIGN = 4096


@dataclass
class Cell:
    size: int
    depth: int
    requests: int
    seconds: float
    mean_latency: float

    @property
    def throughput(self) -> float:
        return self.requests * self.size / self.seconds

    @property
    def iops(self) -> float:
        return self.requests / self.seconds


def _open(path: Path) -> tuple[int, bool]:
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            probe = mmap.mmap(-1, ALIGN)
            os.preadv(fd, [probe], 0)
            return fd, True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False


MIN_CELL_SECONDS = 0.05
MAX_CELL_SECONDS = 60.0


def _cell(path: Path, size: int, depth: int, seconds: float, seed: int) -> Cell:
    fd, direct = _open(path)
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    file_size = os.fstat(fd).st_size
    slots = max(1, (file_size - size) // ALIGN)
    stop = time.perf_counter() + seconds
    lat: list[float] = []
    lock = threading.Lock()

    def worker(k: int):
        rng = np.random.default_rng([seed, k])
        buf = mmap.mmap(-1, size)
        mine = []
        while time.perf_counter() < stop:
            off = int(rng.integers(0, slots)) * ALIGN
            t = time.perf_counter()
            os.preadv(fd, [buf], off)
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(depth)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return Cell(size, depth, len(lat), elapsed, float(np.mean(lat)) if lat else float("nan"))


def calibrate(target: str | os.PathLike, size_mb: int = 1024, seconds: float = 0.4, name: str | None = None) -> dict:
    """Measure and fit; returns a device profile (JSON-ready) with the measurements attached.

    ``size_mb`` (MiB, >= 64) sizes the test file written in a directory ``target``; ``seconds``
    (0.05-60) is the time spent on each (request size, queue depth) cell.
    """
    if not MIN_CELL_SECONDS <= seconds <= MAX_CELL_SECONDS:
        raise InputError(None, f"--seconds must be between {MIN_CELL_SECONDS} and {MAX_CELL_SECONDS} (time per cell), got {seconds}")
    if size_mb < 64:
        raise InputError(None, f"--size-mb must be at least 64 (the largest test read is 32 MiB), got {size_mb}")
    target = Path(target)
    made = None
    if target.is_dir():
        made = target / f".relayout-calibrate-{os.getpid()}"
        _write_test_file(made, size_mb * 1024 * 1024)
        path = made
    elif target.is_file():
        path = target
        if path.stat().st_size < 64 * 1024 * 1024:
            raise InputError(path, "too small to calibrate on (needs >= 64 MB); give its directory instead")
    else:
        raise InputError(target, "no such file or directory")
    try:
        _, direct = _open(path)
        cells = [_cell(path, s, d, seconds, i) for i, (s, d) in enumerate((s, d) for s in SIZES for d in DEPTHS)]
    finally:
        if made is not None:
            made.unlink(missing_ok=True)
    big = [c for c in cells if c.size >= 4 * 1024 * 1024]
    bandwidth = float(np.median([c.throughput for c in big]))
    small_qd1 = next(c for c in cells if c.size == SIZES[0] and c.depth == 1)
    request_seconds = max(0.0, small_qd1.mean_latency - SIZES[0] / bandwidth)
    deep = max((c for c in cells if c.size == SIZES[0]), key=lambda c: c.depth)
    slots = int(np.clip(round(deep.iops * max(request_seconds, 1e-6)), 1, 256))
    control = "O_DIRECT (page cache bypassed)" if direct else "posix_fadvise DONTNEED before each cell (O_DIRECT unavailable)"
    return {
        "name": name or f"calibrated-{target.name or 'device'}",
        "description": f"Calibrated on {path} ({os.stat(target).st_dev:#x}); cache control: {control}.",
        "members": 1,
        "chunk_bytes": 0,
        "split_rule": "none",
        "host_bandwidth": bandwidth,
        "direct_alignment": ALIGN,
        "page_cache_fraction": 0.0,
        "drive": {"name": "calibrated", "request_seconds": request_seconds, "bandwidth": bandwidth, "queue_slots": slots},
        "calibration": {
            "cache_control": control,
            "cells": [{"size": c.size, "depth": c.depth, "requests": c.requests, "mean_latency_s": c.mean_latency,
                       "throughput_Bps": c.throughput, "iops": c.iops} for c in cells],
        },
    }


def _write_test_file(path: Path, size: int) -> None:
    rng = np.random.default_rng(0)
    block = rng.integers(0, 2**63, size=(8 * 1024 * 1024) // 8, dtype=np.uint64).tobytes()
    try:
        with open(path, "wb") as fh:
            left = size
            while left > 0:
                fh.write(block[: min(left, len(block))])
                left -= len(block)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise InputError(path, exc.strerror or str(exc)) from None


