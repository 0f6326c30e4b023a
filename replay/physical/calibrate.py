"""``relayout calibrate PATH``: measure the device holding PATH and fit a device profile.

Reads of 4 KiB to 32 MiB at random aligned offsets, at queue depths 1 to 32 (one thread per
outstanding request), each cell for a fixed time. The page cache is bypassed with O_DIRECT where
the file system allows it, else the test file is evicted with ``posix_fadvise`` before each cell;
the profile says which. The fit, for the queue model of :mod:`replay.model.device` (a drive of ``Q``
slots, per-request latency ``l(s) = a + s / b_1`` s, data channel ``B`` bytes/s that each request
also holds ``c`` s beyond its bytes), for reads of ``s`` bytes that the system does not split:

    X(s, q) = min(min(q, Q) * s / (a + max(s / b_1, c + s / B)), s / (c + s / B))   [bytes/s]

is fitted to every cell of the grid at once (:func:`fit_queue_model`): least squares on
``log X`` over ``(a, b_1, B, c)`` for each integer ``Q`` from 1 to the deepest queue measured, the
best ``Q`` kept (the largest among equals: a drive that never saturates its slots within the grid
gets the deepest queue measured). The profile carries each cell's measured and fitted
throughput and the relative error ``fitted / measured - 1``, and a summary (RMS and largest
``|log(fitted / measured)|``), under ``calibration.fit``.

How concurrent reads complete is measured first (:func:`completion_spread`): in arrival order,
or together (:func:`drive_service`). That is the profile's service discipline, and a ``shared``
drive is fitted with its own steady-state equation (:func:`replay.model.device.queue_throughput` with
``shared``: ``min(q s / (a + max(s / (k b_1), k c + s / B)), Q s / a, s / (k c + s / B))``, a
read holding one slot, for the command only). What merging two reads into one saves is then measured directly
(:func:`merge_saving`: two back-to-back reads against one of their joint size) and reported beside
what the fitted model predicts for it, which is what coalescing's gain rests on; the fit does not
use it. The page-cache copy rate (:func:`page_cache_copy`: buffered reads the page cache serves,
copied into read buffers by one thread, and by 2 and 4 at once) is measured last; its one-thread
rate is the profile's ``memory_bandwidth``, and one thread's rate for reads that start inside a
cache line, as most safetensors tensors do, its ``unaligned_memory_bandwidth``. Then what handing
a block of loads to colibrì's PIPE=1 loader pool costs on this host, by pool size
(:func:`replay.physical.loader_handoff.loader_handoff`), the profile's ``loader_handoff``.

The reads land in buffers of the kind asked for (:data:`replay.physical.buffers.BUFFER_KINDS`):
``engine``, as colibrì's (``posix_memalign``, no huge pages asked for), or ``huge-pages``, the
relayout harness's. Under O_DIRECT a buffer of scattered base pages caps a request at
``max_segments`` pages (:func:`small_page_request_limit`), so with ``engine`` buffers the request
limit the fit uses and the profile gives is the smaller of that and the system's
``max_sectors_kb``, unless ``transparent_hugepage`` is ``always`` (:func:`buffer_request_limit`).

PATH may be a file (read only) or a directory (a test file is written there under an
unpredictable name, created exclusively, fsynced, and removed however the calibration ends).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.atomic import create_temp, describe_os_error, fsync_fd, open_dir, remove_temps
from containers.errors import InputError

from replay.physical.buffers import BUFFER_KINDS, read_buffer
from replay.physical.copy_rate import page_cache_copy
from replay.physical.loader_handoff import loader_handoff
from replay.physical.request_limits import (BUFFER_REASONS, buffer_request_limit, small_page_request_limit,
                                            system_max_request_bytes, system_read_ahead_bytes)
from replay.model.device import DEFAULT_READ_AHEAD_BYTES, DriveProfile, queue_throughput, read_alone_seconds

SIZES = (4096, 65536, 524288, 4 * 1024 * 1024, 32 * 1024 * 1024)
LOG_RANGE = (np.log(1e-12), np.log(1e15))
"""The range the fit searches each parameter in (s or bytes/s, as natural logs): wide enough for
any drive, narrow enough that no rate or time under- or overflows."""
MAX_FITTED_SLOTS = 256
"""The deepest drive queue the fit considers (requests)."""
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


MIN_FILE_BYTES = 64 * 1024 * 1024
"""The smallest file calibration reads (twice its largest test read)."""
MIN_CELL_SECONDS = 0.05
MAX_CELL_SECONDS = 60.0


def _cell(path: Path, size: int, depth: int, seconds: float, seed: int, huge_pages: bool = True) -> Cell:
    """``depth`` threads reading ``size`` bytes at random aligned offsets of ``path`` for
    ``seconds``, page cache bypassed, each into its own buffer (:func:`read_buffer` of the kind
    ``huge_pages`` says)."""
    fd, direct = _open(path)
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    file_size = os.fstat(fd).st_size
    slots = max(1, (file_size - size) // ALIGN)
    bufs = [read_buffer(size, huge_pages) for _ in range(depth)]
    stop = time.perf_counter() + seconds
    lat: list[float] = []
    lock = threading.Lock()

    def worker(k: int):
        rng = np.random.default_rng([seed, k])
        buf = memoryview(bufs[k])[:size]
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


SPREAD_READ_BYTES = 16 * 1024 * 1024
SPREAD_DEPTH = 8
SPREAD_ROUNDS = 5


def completion_spread(path: str | os.PathLike, depth: int = SPREAD_DEPTH, size: int = SPREAD_READ_BYTES,
                      rounds: int = SPREAD_ROUNDS, huge_pages: bool = True) -> dict:
    """How the device serves concurrent reads: ``depth`` threads released together each read
    ``size`` bytes (fewer if the file is small) at their own aligned offset, ``rounds`` times
    (page cache bypassed as :func:`calibrate` does it). Per round, the time from the first read's
    start to the first completion over the time to the last one.

    A drive that serves requests in arrival order (:mod:`replay.model.device`'s ``in-order`` drive)
    completes them one after another: ``first_over_last`` about ``1 / depth``. One that shares
    itself among them (``shared``) completes them together: near 1 (this project's virtio disk:
    0.98-0.99). :func:`drive_service` turns it into the profile's discipline. A layer's demand
    reads are such a batch: in order, the compute thread works on the first experts while the
    later ones arrive; shared, it cannot. ``huge_pages``: the kind of read buffer
    (:func:`replay.physical.buffers.read_buffer`).

    Returns ``depth``, ``size`` (bytes), ``rounds``, ``first_over_last`` (median over the rounds)
    and ``in_order`` (``1 / depth``, what an in-order drive gives, latency aside).
    """
    fd, direct = _open(Path(path))
    try:
        file_size = os.fstat(fd).st_size
        size = min(size, file_size // depth // ALIGN * ALIGN)
        if size <= 0:
            raise InputError(Path(path), f"too small for {depth} concurrent reads")
        bufs = [read_buffer(size, huge_pages) for _ in range(depth)]
        bases = (file_size - depth * size) // ALIGN + 1      # aligned places for a round's reads
        ratios, failed = [], []
        for r in range(rounds):
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            gate = threading.Barrier(depth)
            spans = [(0, 0)] * depth
            base = (r * depth * size // ALIGN % bases) * ALIGN

            def worker(k: int) -> None:
                gate.wait()
                t = time.perf_counter_ns()
                try:
                    os.preadv(fd, [bufs[k]], base + k * size)
                except OSError as exc:
                    failed.append(exc)
                spans[k] = (t, time.perf_counter_ns())

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(depth)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if failed:
                raise InputError(Path(path), f"read failed: {failed[0].strerror or failed[0]}")
            start = min(t for t, _ in spans)
            ends = [e - start for _, e in spans]
            ratios.append(min(ends) / max(ends))
    finally:
        os.close(fd)
    return {"depth": depth, "size": size, "rounds": rounds, "first_over_last": float(np.median(ratios)),
            "in_order": 1.0 / depth}


MERGE_PAIRS = 300
"""Repetitions of :func:`merge_saving` (each: two back-to-back reads and one merged read)."""
MERGE_BYTES = 4 * 1024 * 1024
"""The merged read of :func:`merge_saving` in :func:`calibrate` (bytes): two reads of half of it,
or of half the system's request limit when that is smaller, so that the merged read is one
request (large reads, as expert reads are: Qwen3-30B-A3B's are 2.4 MB, GLM-5.2's 19 MB)."""


def merge_timings(path: str | os.PathLike, size: int, pairs: int = MERGE_PAIRS, lone: bool = False,
                  gaps_us=(), seed: int = 0, huge_pages: bool = True) -> dict:
    """Seconds of reads on the device holding ``path`` (read only, page cache bypassed as
    :func:`calibrate` does it), ``pairs`` repetitions, the kinds in random order within each, each
    read at a random aligned offset: ``"pair"``, two reads of ``size`` bytes (aligned down to 4 KiB)
    one straight after the other, as a loader thread issues a layer's experts; ``"merged"``, one
    read of ``2 size`` bytes (the two merged); with ``lone``, ``"one"``, a single read of ``size``;
    for each ``g`` in ``gaps_us``, ``("gap", g)``: two reads of ``size`` with the second issued
    ``g`` us after the first completed (the thread busy meanwhile; the gap not counted).
    ``huge_pages``: the kind of read buffer (:func:`replay.physical.buffers.read_buffer`).

    Returns each kind's seconds per repetition (numpy arrays, paired by index) and ``size``.
    """
    path = Path(path)
    size = max(ALIGN, size // ALIGN * ALIGN)
    kinds = ["pair", "merged", *(["one"] if lone else []), *(("gap", g) for g in gaps_us)]
    times = {k: [] for k in kinds}
    fd, direct = _open(path)
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 2 * size + ALIGN:
            raise InputError(path, f"too small for a {2 * size}-byte merged read")
        first, second = read_buffer(2 * size, huge_pages), read_buffer(size, huge_pages)
        rng = np.random.default_rng(seed)

        def offset(n: int) -> int:
            return int(rng.integers(0, (file_size - n) // ALIGN)) * ALIGN

        for _ in range(pairs):
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for i in rng.permutation(len(kinds)):
                kind = kinds[i]
                if kind == "merged":
                    o = offset(2 * size)
                    t = time.perf_counter_ns()
                    os.preadv(fd, [first[:2 * size]], o)
                elif kind == "one":
                    o = offset(size)
                    t = time.perf_counter_ns()
                    os.preadv(fd, [first[:size]], o)
                else:
                    gap_ns = 0 if kind == "pair" else int(kind[1] * 1000)
                    o1, o2 = offset(size), offset(size)
                    t = time.perf_counter_ns()
                    os.preadv(fd, [first[:size]], o1)
                    until = time.perf_counter_ns() + gap_ns
                    while time.perf_counter_ns() < until:
                        pass
                    os.preadv(fd, [second[:size]], o2)
                    t += gap_ns
                times[kind].append((time.perf_counter_ns() - t) * 1e-9)
    except OSError as exc:
        raise InputError(path, f"read failed: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return {"size": size, **{k: np.array(v) for k, v in times.items()}}


def median_interval(x: np.ndarray, seed: int = 0, draws: int = 1000) -> tuple[float, float, float]:
    """The median of ``x`` and its 95% bootstrap interval (``draws`` resamples)."""
    boot = np.median(np.random.default_rng(seed).choice(x, (draws, len(x))), axis=1)
    return float(np.median(x)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def merge_saving(path: str | os.PathLike, size: int, pairs: int = MERGE_PAIRS, seed: int = 0,
                 huge_pages: bool = True) -> dict:
    """What merging two reads into one saves on the device holding ``path``, measured the way a
    loader thread reads (:func:`merge_timings`: two back-to-back reads of ``size`` bytes against
    one of ``2 size``, ``pairs`` times, into read buffers of the kind ``huge_pages`` says).

    The queue model (:mod:`replay.model.device`) predicts the saving from the fitted parameters:
    ``2 l(s) - l(2 s)`` for lone reads (:func:`replay.model.device.read_alone_seconds`), the command ``a``
    plus up to ``c`` per request the merge removes (all of it where the channel, not the read's
    own stream, is the bottleneck). What coalescing saves per merged read rests on it, and the
    grid infers ``a`` mostly from small reads; this measures it on large reads, back to back.

    Returns ``size`` (bytes), ``pairs``, the medians ``pair_seconds`` and ``merged_seconds``, and
    ``saving_seconds`` (the median of the paired differences) with its 95% bootstrap interval
    ``saving_low_seconds``, ``saving_high_seconds``.
    """
    t = merge_timings(path, size, pairs, seed=seed, huge_pages=huge_pages)
    saving, low, high = median_interval(t["pair"] - t["merged"], seed)
    return {"size": t["size"], "pairs": pairs, "pair_seconds": float(np.median(t["pair"])),
            "merged_seconds": float(np.median(t["merged"])), "saving_seconds": saving,
            "saving_low_seconds": low, "saving_high_seconds": high}


PROBE_SECONDS = 1.0


def probe_rate(path: str | os.PathLike, size: int, depth: int, seconds: float = PROBE_SECONDS, seed: int = 0,
               huge_pages: bool = True) -> float:
    """The disk's rate now (bytes/s): ``depth`` outstanding random aligned reads of ``size`` bytes
    of the file at ``path`` (only read, page cache bypassed as :func:`calibrate` does it) for
    ``seconds``, into read buffers of the kind ``huge_pages`` says. One cell of the calibration
    grid, to follow a disk whose speed drifts (``relayout validate``). The file must hold at least
    ``size`` bytes plus one alignment unit.
    """
    path = Path(path)
    if path.stat().st_size < size + ALIGN:
        raise InputError(path, f"too small for a {size}-byte probe read")
    return _cell(path, size, depth, seconds, seed, huge_pages).throughput


READ_ONCE_BYTES = 4 * 1024 * 1024
READ_ONCE_DEPTH = 8


def read_once(paths: list, progress=None) -> tuple[int, float]:
    """Read every byte of the files at ``paths`` once, page cache bypassed as :func:`calibrate`
    does it: :data:`READ_ONCE_DEPTH` threads take the next :data:`READ_ONCE_BYTES` chunk in file
    order. Returns ``(bytes read, seconds)``; a failed read raises :class:`InputError` naming the file.

    Why: a virtual disk may serve a file at another speed the first time it is read (a cloud
    volume fetching blocks lazily, a host's cache below the guest); on this project's VM files
    that had never been read often read at 0.43-0.73 GB/s and at 0.61-1.05 GB/s the next time,
    though not always (``docs/BENCHMARKS.md``). A layout measured on such blocks against one
    read before would be credited or charged with the difference.
    ``progress``: called with the bytes of each chunk read (e.g. a tqdm bar's ``update``).
    """
    jobs = []
    fds = []
    try:
        for p in paths:
            fd, direct = _open(Path(p))
            fds.append(fd)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            jobs += [(p, fd, off, min(READ_ONCE_BYTES, size - off)) for off in range(0, size, READ_ONCE_BYTES)]
        nxt = iter(jobs)
        lock = threading.Lock()
        total, failed = [0], []

        def worker():
            buf = read_buffer(READ_ONCE_BYTES)
            while not failed:
                with lock:
                    job = next(nxt, None)
                if job is None:
                    return
                path, fd, off, n = job
                try:
                    got = os.preadv(fd, [memoryview(buf)[:-(-n // ALIGN) * ALIGN]], off)
                except OSError as exc:
                    failed.append(InputError(path, f"read failed at byte {off}: {exc.strerror or exc}"))
                    return
                with lock:
                    total[0] += got
                    if progress is not None:
                        progress(got)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(READ_ONCE_DEPTH)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if failed:
            raise failed[0]
        return total[0], time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def calibrate(target: str | os.PathLike, size_mb: int = 1024, seconds: float = 0.4, name: str | None = None,
              buffers: str = "huge-pages") -> dict:
    """Measure and fit; returns a device profile (JSON-ready) with the measurements attached.

    ``size_mb`` (MiB, >= 64) sizes the test file written in a directory ``target``; ``seconds``
    (0.05-60) is the time spent on each (request size, queue depth) cell and on each thread count
    of the page-cache copy; ``buffers`` (:data:`replay.physical.buffers.BUFFER_KINDS`) the read
    buffers: ``huge-pages`` (the default here), those of the relayout harness that ``relayout
    validate`` measures with; ``engine``, colibrì's kind (``relayout calibrate``'s default).
    """
    if buffers not in BUFFER_KINDS:
        raise InputError(None, f"--buffers must be one of {', '.join(BUFFER_KINDS)}, got {buffers!r}")
    if not MIN_CELL_SECONDS <= seconds <= MAX_CELL_SECONDS:
        raise InputError(None, f"--seconds must be between {MIN_CELL_SECONDS} and {MAX_CELL_SECONDS} (time per cell), got {seconds}")
    if size_mb < 64:
        raise InputError(None, f"--size-mb must be at least 64 (the largest test read is 32 MiB), got {size_mb}")
    target = Path(target)
    with _test_file(target, size_mb * 1024 * 1024) as path:
        return _calibrate(path, target, seconds, name, buffers)


@contextlib.contextmanager
def _test_file(target: Path, size: int):
    """The file calibration reads: ``target`` itself when it is a file, else a test file written in
    directory ``target`` under an unpredictable name, created exclusively (never through a link)
    and removed however the calibration ends (an error, Ctrl-C)."""
    if target.is_dir():
        dir_fd = open_dir(target, target / ".relayout-calibrate")
        made: list[str] = []
        try:
            try:
                fd, name = create_temp(dir_fd, "relayout-calibrate", made=made)
                _write_test_file(fd, target / name, size)
            except OSError as exc:
                raise InputError(target / (made[-1] if made else ".relayout-calibrate"), describe_os_error(exc)) from None
            yield target / name
        finally:
            remove_temps(dir_fd, made)
            os.close(dir_fd)
    elif target.is_file():
        if target.stat().st_size < MIN_FILE_BYTES:
            raise InputError(target, "too small to calibrate on (needs >= 64 MB); give its directory instead")
        yield target
    else:
        raise InputError(target, "no such file or directory")


def _calibrate(path: Path, target: Path, seconds: float, name: str | None, buffers: str) -> dict:
    """:func:`calibrate` on the file ``path`` (``target``: what the user named) into ``buffers``."""
    fd, direct = _open(path)
    os.close(fd)
    huge = buffers == "huge-pages"
    system_request = system_max_request_bytes(path)        # while the test file exists
    read_ahead = system_read_ahead_bytes(path)
    page_limit = small_page_request_limit(path)
    max_request, limit_reason = buffer_request_limit(system_request, page_limit, huge, direct)
    cells = [_cell(path, s, d, seconds, i, huge) for i, (s, d) in enumerate((s, d) for s in SIZES for d in DEPTHS)]
    spread = completion_spread(path, huge_pages=huge)
    merge = merge_saving(path, min(max_request or MERGE_BYTES, MERGE_BYTES) // 2, huge_pages=huge)   # merged: one request
    copy = page_cache_copy(path, seconds, huge)
    handoff = loader_handoff()
    service = drive_service(spread)
    fit = fit_queue_model([c.size for c in cells], [c.depth for c in cells], [c.throughput for c in cells],
                          max_request or 0, shared=service == "shared")
    a, b1, bandwidth, slots = fit["request_seconds"], fit["stream_bandwidth"], fit["bandwidth"], fit["queue_slots"]
    c = fit["request_channel_seconds"]
    fitted = DriveProfile("fitted", a, bandwidth, slots, b1, max_request, service, c)
    merge["predicted_saving_seconds"] = 2 * read_alone_seconds(fitted, merge["size"]) - read_alone_seconds(fitted, 2 * merge["size"])
    control = "O_DIRECT (page cache bypassed)" if direct else "posix_fadvise DONTNEED before each cell (O_DIRECT unavailable)"
    limit = f"{max_request // 1024} KiB" if max_request else "none known"
    return {
        "name": name or f"calibrated-{target.name or 'device'}",
        "description": f"Calibrated on {path} ({os.stat(target).st_dev:#x}); cache control: {control}; read buffers: "
                       f"{buffers}, {BUFFER_REASONS[buffers]}; largest request {limit} ({limit_reason}); readahead "
                       + (f"{read_ahead // 1024} KiB (queue/read_ahead_kb)." if read_ahead is not None
                          else "unknown, Linux's default 128 KiB assumed."),
        "members": 1,
        "chunk_bytes": 0,
        "split_rule": "none",
        "host_bandwidth": bandwidth,
        "direct_alignment": ALIGN,
        "page_cache_fraction": 0.0,
        "read_ahead_bytes": read_ahead if read_ahead is not None else DEFAULT_READ_AHEAD_BYTES,
        "memory_bandwidth": copy["bytes_per_second"],
        "unaligned_memory_bandwidth": copy["unaligned_bytes_per_second"],
        "readahead_request_bytes": system_request,
        **({"loader_handoff": {"workers": handoff["workers"], "seconds": handoff["seconds"]}}
           if handoff and handoff["seconds"] else {}),
        "drive": {"name": "calibrated", "request_seconds": a, "bandwidth": bandwidth, "queue_slots": slots,
                  "stream_bandwidth": b1, "max_request_bytes": max_request, "service": service,
                  "request_channel_seconds": c},
        "calibration": {
            "cache_control": control,
            "buffers": {"kind": buffers, "what": BUFFER_REASONS[buffers]},
            "request_limit": {"bytes": max_request, "system_bytes": system_request, "reason": limit_reason},
            "cells": [{"size": c.size, "depth": c.depth, "requests": c.requests, "mean_latency_s": c.mean_latency,
                       "throughput_Bps": c.throughput, "iops": c.iops, "fitted_Bps": f["fitted_Bps"], "error": f["error"]}
                      for c, f in zip(cells, fit["cells"])],
            "fit": {k: v for k, v in fit.items() if k != "cells"},
            "small_page_request_limit": page_limit,
            "completion_spread": spread,
            "merge": merge,
            "page_cache_copy": copy,
            "loader_handoff": handoff or {"workers": [], "seconds": [], "error": "not measured off Linux"},
        },
    }


FIT_MODELS = {
    "in-order": "X(s, q) = min(min(q k, Q) * p / (a + max(p / b_1, c + p / B)), p / (c + p / B)) bytes/s, "
                "k = ceil(s / m), p = s / k; least squares on log X over every cell",
    "shared": "X(s, q) = min(q s / (a + max(s / (k b_1), k c + s / B)), Q s / a, s / (k c + s / B)) bytes/s, "
              "k = ceil(s / m); least squares on log X over every cell",
}


def drive_service(spread: dict) -> str:
    """The service discipline (:data:`replay.model.device.SERVICES`) a :func:`completion_spread`
    measurement shows: ``shared`` when the first of the reads released together completed nearer
    the last (ratio 1) than an in-order drive's ``1 / depth``, else ``in-order``."""
    return "shared" if spread["first_over_last"] >= (1 + spread["in_order"]) / 2 else "in-order"


def fit_queue_model(sizes, depths, throughput, max_request: int = 0, shared: bool = False) -> dict:
    """Fit the queue model (module docstring) to measured cells: ``sizes`` (bytes), ``depths``
    (outstanding reads) and ``throughput`` (bytes/s), one entry per cell; ``max_request`` (bytes,
    0 for none) is the system's request limit, ``m``; ``shared``: fit a shared drive's equation.

    Returns ``request_seconds`` a (s), ``stream_bandwidth`` b_1 and ``bandwidth`` B (bytes/s),
    ``queue_slots`` Q, ``request_channel_seconds`` c (s), and the fit's error: per cell (``cells``: size, depth, measured and
    fitted bytes/s, ``error`` = fitted / measured - 1) and its summary (``rms_log_error``,
    ``max_abs_log_error``: of ``log(fitted / measured)``; ``worst_cell``).
    """
    from scipy.optimize import least_squares

    s = np.asarray(sizes, dtype=float)
    q = np.asarray(depths, dtype=float)
    x = np.asarray(throughput, dtype=float)
    ok = np.isfinite(x) & (x > 0)
    if ok.sum() < 3:
        raise InputError(None, "calibration measured fewer than three cells with any throughput: nothing to fit")
    s_ok, q_ok, logx = s[ok], q[ok], np.log(x[ok])
    small = s_ok == s_ok.min()
    qd1 = q_ok == q_ok.min()
    # a start: the smallest reads' latency at the shallowest queue, the best rate, the largest reads' QD1 rate
    a0 = float(np.median(q_ok[small & qd1] * s_ok[small & qd1] / x[ok][small & qd1])) if (small & qd1).any() else 1e-4
    B0 = float(x[ok].max())
    big1 = qd1 & (s_ok == s_ok.max())
    b0 = float(x[ok][big1].max()) if big1.any() else B0
    c0 = float(0.5 * s_ok[small].min() / x[ok][small].max()) if small.any() else 1e-6   # half the best small-read IOPS' period

    def resid(theta, Q):
        a, b1, B, c = np.exp(np.clip(theta, *LOG_RANGE))
        return np.log(queue_throughput(a, b1, B, Q, s_ok, q_ok, max_request, shared=shared, request_channel_seconds=c)) - logx

    k = np.ceil(s_ok / max_request) if max_request > 0 else np.ones_like(s_ok)
    best = None
    for Q in range(1, int(min((q_ok * k).max(), MAX_FITTED_SLOTS)) + 1):
        runs = []
        for start in ((a0, b0, B0, c0), (a0 * 0.5, b0 * 0.5, B0, c0), (a0, B0, B0, c0 * 1e-3),
                      (a0 * 0.2, b0, B0 * 1.2, c0), (a0 - min(c0, a0 / 2), B0, B0, c0)):
            r = least_squares(resid, np.log(np.maximum(start, 1e-12)), args=(Q,), method="lm", xtol=1e-12, ftol=1e-12)
            runs.append(r)
        r = min(runs, key=lambda r: r.cost)
        if best is None or r.cost <= best[0].cost * (1 + 1e-9) + 1e-15:
            best = (r, Q)
    r, Q = best
    a, b1, B, c = (float(v) for v in np.exp(np.clip(r.x, *LOG_RANGE)))
    b1 = min(b1, B)
    fitted = queue_throughput(a, b1, B, Q, s, q, max_request, shared=shared, request_channel_seconds=c)
    err = np.where(ok, fitted / np.where(ok, x, 1.0) - 1, np.nan)
    logerr = np.abs(np.log(fitted[ok] / x[ok]))
    worst = int(np.flatnonzero(ok)[np.argmax(logerr)])
    service = "shared" if shared else "in-order"
    return {
        "model": FIT_MODELS[service], "service": service,
        "request_seconds": a, "stream_bandwidth": b1, "bandwidth": B, "queue_slots": int(Q), "request_channel_seconds": c,
        "max_request_bytes": int(max_request) or None,
        "rms_log_error": float(np.sqrt(np.mean(logerr ** 2))), "max_abs_log_error": float(logerr.max()),
        "worst_cell": {"size": int(s[worst]), "depth": int(q[worst]), "error": float(err[worst])},
        "cells": [{"size": int(si), "depth": int(qi), "measured_Bps": float(xi), "fitted_Bps": float(fi),
                   "error": (float(ei) if np.isfinite(ei) else None)}
                  for si, qi, xi, fi, ei in zip(s, q, x, fitted, err)],
    }


def _write_test_file(fd: int, path: Path, size: int) -> None:
    """Fill the new file ``fd`` (at ``path``) with ``size`` random bytes and fsync it; the descriptor is closed."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 2**63, size=(8 * 1024 * 1024) // 8, dtype=np.uint64).tobytes()
    with os.fdopen(fd, "wb") as fh:
        left = size
        while left > 0:
            fh.write(block[: min(left, len(block))])
            left -= len(block)
        fh.flush()
        fsync_fd(fh.fileno())
