"""How fast page-cache hits copy when several threads copy at once.

Usage::

    python benchmarks/copy_threads.py FILE [--bytes 1769472] [--reads 200] [--threads 1,2,3,4]

FILE is read (only read) whole once, so the page cache holds it; then for each thread count every
thread preads ``--reads`` blocks of ``--bytes`` (default: one storage-bound fixture expert) from
random 4 KiB-aligned offsets into its own buffer as colibrì's (``replay.physical.buffers.read_buffer``),
all threads at once (``os.preadv`` releases the GIL). It prints each count's rate per thread
(bytes over the thread's own seconds, GB/s, the unit of the engine's ``[PROF] DISK-CLASS`` line)
and the aggregate (all bytes over the wall time), and the per-thread rate against one thread's.
``relayout calibrate``'s ``memory_bandwidth`` is the one-thread rate.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay.physical.buffers import read_buffer  # noqa: E402

PAGE = 4096


def _warm(fd: int, size: int) -> None:
    off = 0
    while off < size:
        got = os.pread(fd, 64 << 20, off)
        if not got:
            break
        off += len(got)


def copy_rates(fd: int, size: int, nbytes: int, reads: int, threads: int, seed: int = 0) -> tuple[float, float]:
    """(per-thread rate, aggregate rate) in bytes/s for ``threads`` threads each copying ``reads``
    page-cache hits of ``nbytes`` at once."""
    rng = np.random.default_rng(seed)
    bufs = [read_buffer(nbytes, huge_pages=False) for _ in range(threads)]
    offsets = [(rng.integers(0, (size - nbytes) // PAGE, reads) * PAGE).tolist() for _ in range(threads)]
    seconds = [0.0] * threads

    def work(i: int) -> None:
        t = time.perf_counter()
        for off in offsets[i]:
            os.preadv(fd, [bufs[i]], off)
        seconds[i] = time.perf_counter() - t

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    return reads * nbytes / float(np.mean(seconds)), threads * reads * nbytes / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--bytes", type=int, default=1_769_472, help="bytes per read (default: one fixture expert)")
    ap.add_argument("--reads", type=int, default=200, help="reads per thread")
    ap.add_argument("--threads", default="1,2,3,4", help="thread counts, comma-separated")
    args = ap.parse_args(argv)
    fd = os.open(args.file, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < args.bytes + PAGE:
            print(f"{args.file}: {size} B, smaller than one read", file=sys.stderr)
            return 2
        _warm(fd, size)
        one = None
        for n in (int(x) for x in args.threads.split(",")):
            per, agg = copy_rates(fd, size, args.bytes, args.reads, n)
            one = one or per
            print(f"{n} thread(s): {per / 1e9:6.2f} GB/s per thread ({per / one:.2f}x one thread's), "
                  f"{agg / 1e9:6.2f} GB/s in all")
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
