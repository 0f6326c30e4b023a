"""Read buffers for the real read path: the harness (:mod:`replay.physical.measure`) and calibration.

Where a read's bytes land decides how the system splits it. An O_DIRECT read of ``s`` bytes
reaches the drive as requests of at most ``max_sectors_kb`` (the ``max_request_bytes`` m of
:mod:`replay.model.device`) *and* at most ``max_segments`` physically contiguous pieces of the buffer.
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
buffer is still correct, only made of small pages). A huge page backs only a whole, aligned
stretch of a mapping: a buffer starting at a chance offset within one had its first and last
partial stretches in small pages (about 11% of the buffers' memory, and a start offset anywhere
in 0-2 MiB, so again a speed that differed from buffer to buffer). Each buffer therefore starts
on a huge-page boundary and is a whole number of huge pages.

A runtime that does not ask for huge pages reads into small pages: colibrì's buffers come from
``posix_memalign`` without ``MADV_HUGEPAGE``, so they are huge pages only where
``transparent_hugepage`` is ``always``. ``read_buffer(n, huge_pages=False)`` is such a buffer
(private anonymous memory, page-aligned, nothing requested), the kind ``relayout calibrate
--buffers engine`` measures the drive through (:data:`BUFFER_KINDS`). Its pages are faulted in
a shuffled order, so that none lie physically next to each other by the chance of a fresh
allocation: a fresh region touched in order is often backed by contiguous pages, whose segments
the block layer merges into requests larger than colibrì's long-lived slabs get (calibrations of
the fixture's disk through such buffers fitted 1.3-2.9 GB/s within two hours, while the engine's
O_DIRECT reads ran at about 1.45 GB/s on two days: ``docs/BENCHMARKS.md``).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import numpy as np

PAGE = 4096
"""Alignment of every buffer and of O_DIRECT offsets and lengths (bytes)."""


def huge_page_bytes() -> int:
    """The transparent huge page size (bytes): the system's ``hpage_pmd_size``, else 2 MiB."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 * 1024 * 1024


HUGE_PAGE = huge_page_bytes()

BUFFER_KINDS = ("engine", "huge-pages")
"""The read buffers calibration can read into: ``engine``, as colibrì's (no huge pages asked
for: ``read_buffer(n, huge_pages=False)``); ``huge-pages``, the relayout harness's
(``read_buffer(n)``)."""


def read_buffer(nbytes: int, huge_pages: bool = True) -> memoryview:
    """A writable buffer of at least ``nbytes`` bytes (a whole number of pages, at least one),
    private anonymous memory, every page touched so that no timed read faults one in.

    ``huge_pages`` (the harness's buffers): starting on a huge-page boundary, with transparent
    huge pages requested over whole huge pages. Otherwise (a runtime's buffers that ask for
    nothing, as colibrì's ``posix_memalign`` ones): page-aligned, no advice given, so the system
    backs it with huge pages only where ``transparent_hugepage`` is ``always``."""
    n = max(PAGE, -(-nbytes // PAGE) * PAGE)
    if not huge_pages:
        mem = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        pages = np.frombuffer(mem, dtype=np.uint8)
        pages[np.random.default_rng(n).permutation(n // PAGE) * PAGE] = 0   # faulted in a shuffled order: scattered
        return memoryview(mem)
    span = -(-n // HUGE_PAGE) * HUGE_PAGE
    mem = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass                               # no transparent huge pages here: small pages
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mem)) % HUGE_PAGE
    mem[start:start + span] = bytes(span)
    return memoryview(mem)[start:start + n]
