"""What the kernel caches around an expert's scale reads: its readahead, measured on this disk.

Usage: python benchmarks/readahead.py FILE [--sizes BYTES,...] [--reps N] [--seed S]

The runtime reads an expert's three scale tensors with buffered preads, one after the other
(``--sizes``: default a Qwen3-30B-A3B expert's down, gate and up scales, 8192, 3072 and 3072
bytes; GLM-5.2's per-row scales are 24576, 8192, 8192). The replay model reads them from the
drive at the expert's first access in a session and counts everything else as cached; the
kernel also reads ahead of a buffered read, so the scales of the experts stored after it may be
cached before they are read (``docs/BENCHMARKS.md``, "The harness's own waits": the harness
sent 1.35-2.07 times fewer preads to the drive than the model).

Each repetition drops FILE from the page cache (:func:`replay.physical.measure.drop_cache`),
issues the scale reads at a random 4 KiB-aligned offset, and after each read counts the
contiguous bytes cached from the page after the one holding the last byte read so far, with
``mincore`` on a mapping of the file (which looks without reading). Printed: the device's
``read_ahead_kb`` and, per read, the median and range of the bytes cached ahead of it. FILE
must be at least 33 MiB, on the disk under test, and yours or writable by you (Linux's
``mincore`` reports every page of any other file as cached); it is only read.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from replay.physical.request_limits import system_read_ahead_bytes
from replay.physical.measure import drop_cache
from replay.physical.residency import PAGE_BYTES as PAGE
from replay.physical.residency import FileResidency, residency_visible

SCAN_BYTES = 32 * 1024 * 1024
"""How far past the reads the scan looks for cached pages (bytes)."""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--sizes", default="8192,3072,3072", help="the scale reads' sizes in bytes, in read order")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) <= 0 or a.reps < 1:
        print("--sizes takes positive byte counts, --reps at least 1", file=sys.stderr)
        return 2
    size = os.path.getsize(a.file)
    span = sum(sizes)
    if size < span + SCAN_BYTES + PAGE:
        print(f"{a.file}: needs at least {(span + SCAN_BYTES) // 2**20 + 1} MiB", file=sys.stderr)
        return 2
    if not residency_visible(a.file):
        print(f"{a.file}: not yours or writable by you, so mincore would report every page cached", file=sys.stderr)
        return 2
    rng = np.random.default_rng(a.seed)
    fd = os.open(a.file, os.O_RDONLY)
    res = FileResidency(fd, size)
    ahead = [[] for _ in sizes]
    try:
        for _ in range(a.reps):
            drop_cache([a.file])
            off = int(rng.integers(0, (size - span - SCAN_BYTES) // PAGE)) * PAGE
            if res.cached_run(off, span + SCAN_BYTES):
                print(f"{a.file}: its pages stay cached when dropped (tmpfs?): nothing to measure", file=sys.stderr)
                return 2
            pos = off
            for i, n in enumerate(sizes):
                os.pread(fd, n, pos)
                pos += n
                end = -(-pos // PAGE) * PAGE                 # the page after the last byte read
                ahead[i].append(res.cached_run(end, SCAN_BYTES))
    finally:
        res.close()
        os.close(fd)
    ra = system_read_ahead_bytes(a.file)
    ra = ra // 1024 if ra is not None else None
    print(f"{a.file}: read_ahead_kb {ra if ra is not None else 'unknown'}; scale reads {sizes} bytes, {a.reps} repetitions")
    for i, (n, xs) in enumerate(zip(sizes, ahead)):
        x = np.array(xs) / 1024
        print(f"  after read {i + 1} ({n} B): cached ahead median {np.median(x):.0f} KiB (min {x.min():.0f}, max {x.max():.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
