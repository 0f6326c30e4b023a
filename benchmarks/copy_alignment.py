"""How fast one thread copies page-cache hits, by where in a cache line the read starts.

Usage::

    python benchmarks/copy_alignment.py FILE [--seconds 0.7] [--rounds 3]

FILE is read (only read) in 2 MiB buffered preads over its first 256 MiB, held in the page cache
(``replay.physical.copy_rate``, the measurement ``relayout calibrate`` makes), into page-aligned
buffers as colibrì's (``posix_memalign``, base pages); each round times every start offset in
turn: a page boundary, then 8, 16, 32 and 64 B past it, and 8 B past the next page. It prints
the rate (GB/s) per offset and round and each offset's median over the rounds against the
page-aligned one. The replay model takes two rates from this: ``memory_bandwidth`` (reads that
start on a cache line) and ``unaligned_memory_bandwidth`` (reads 8 B into one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay.physical.buffers import read_buffer  # noqa: E402
from replay.physical.copy_rate import COPY_DESTINATION_BYTES, COPY_READ_BYTES, COPY_REGION_BYTES, timed_copy_rate  # noqa: E402

SHIFTS = (0, 8, 16, 32, 64, 4096 + 8)
"""Bytes past a 2 MiB boundary at which the timed reads start."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--seconds", type=float, default=0.7, help="time per offset and round (s)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    size = COPY_READ_BYTES
    fd = os.open(a.file, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        region = (min(COPY_REGION_BYTES, file_size) - max(SHIFTS)) // size * size
        if region < 2 * size:
            raise SystemExit(f"{a.file}: too small (needs two {size}-byte reads past {max(SHIFTS)} B)")
        bufs = [read_buffer(COPY_DESTINATION_BYTES, False)]
        for off in range(0, region + size, size):                # into the page cache
            os.preadv(fd, [bufs[0][:size]], off)
        rates: dict[int, list[float]] = {s: [] for s in SHIFTS}
        for r in range(a.rounds):
            for s in SHIFTS:
                rates[s].append(timed_copy_rate(fd, 1, a.seconds, size, region, bufs, s))
            print(f"round {r + 1}: " + "  ".join(f"+{s} B {rates[s][-1] / 1e9:.2f}" for s in SHIFTS), flush=True)
    finally:
        os.close(fd)
    base = statistics.median(rates[0])
    print(f"one thread, {size // 2**20} MiB buffered reads over {region // 2**20} MiB of {a.file} in the page cache:")
    for s in SHIFTS:
        m = statistics.median(rates[s])
        print(f"  reads starting {s:5d} B past a page boundary: {m / 1e9:.2f} GB/s (median of {a.rounds}), "
              f"x{m / base:.2f} the page-aligned rate")


if __name__ == "__main__":
    main()
