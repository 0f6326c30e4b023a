"""Read buffers for the real read path: the harness (:mod:`replay.measure`) and calibration.

Where a read's bytes land decides how the system splits it. An O_DIRECT read of ``s`` bytes
reaches the drive as requests of at most ``max_sectors_kb`` (the ``max_request_bytes`` m of
:mod:`replay.device`) *and* at most ``max_segments`` physically contiguous pieces of the buffer.
A buffer of 4 KiB pages scattered over physical memory caps a request at ``max_segments`` x
4 KiB (254 x 4 KiB, about 1 MiB, on this project's virtio disk, where m is 4 MiB), and how
scattered a fresh buffer is, is chance: identical reads into buffers allocated one after the
other ran at persistently different speeds, medians 49-70 ms and 58-73 ms per batch of eight
18.9 MB reads in two rounds (``docs/BENCHMARKS.md``), and runs of a validation measured step by
step in lockstep differed by up to 2x for their whole length. Backed by 2 MiB transparent huge
pages, a buffer's pieces are large enough that m is the limit, as the model assumes: the same
reads then ran at 44-47 and 50-54 ms in every buffer.

Python's ``mmap.mmap(-1, n)`` is shared memory, which the kernel does not back with huge pages
unless its shmem setting allows; the buffers here are private anonymous memory with
``MADV_HUGEPAGE`` (taken where ``transparent_hugepage`` is ``always`` or ``madvise``; elsewhere the
buffer is still correct, only made of small pages).
"""

from __future__ import annotations

import mmap

PAGE = 4096
"""Alignment of every buffer and of O_DIRECT offsets and lengths (bytes)."""


def read_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``nbytes`` bytes (at least one page), private anonymous
    memory with transparent huge pages requested, every page touched so that no timed read
    faults one in."""
    n = max(PAGE, -(-nbytes // PAGE) * PAGE)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass                               # no transparent huge pages here: small pages
    buf[:] = bytes(n)
    return buf
