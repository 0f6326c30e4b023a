"""The page cache under the runtime's buffered scale reads, with Linux's readahead.

:func:`buffered_read` decides, pread by pread, which scale reads reach the drive and which pages
the kernel's readahead brings in with them; :func:`checkpoint` and :func:`undo` let a dropped
prefetch load leave no trace. docs/MODEL.md ("The page cache and readahead") states the rules,
after Linux's ``mm/readahead.c`` and ``mm/filemap.c``. Units: pages of 4 KiB (:data:`PAGE_BYTES`)
and bytes.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.jit import HELPER, trailing_zeros

PAGE_BYTES = 4096
"""The page cache's unit (bytes)."""

CACHED, MARK = 1, 2
"""Bits of a page's state."""

RA_START, RA_SIZE, RA_ASYNC, RA_PREV, RA_ORDER = 0, 1, 2, 3, 4

MAX_FOLIO_ORDER = 9
"""The largest folio the page cache builds a readahead window of: 2 MiB of 4 KiB pages (ext4 and
XFS on x86-64, Linux 6.16 on)."""

PageCache = namedtuple("PageCache", "state first offset count file_pages ra max_pages session log_key log_old log_n "
                                     "settled epoch")
"""The page cache of a layout's files (see the module docstring). ``state`` [P] uint8 (bits
:data:`CACHED`, :data:`MARK`) for every tracked page; per file [F]: ``first`` (its first tracked
page), ``offset`` (where its pages start in ``state``), ``count`` (tracked pages),
``file_pages`` (pages in the file), ``ra`` [F, 4] (window start, size, async size, pages;
``prev_pos``, bytes); ``max_pages`` [2] (the readahead maximum M and the device's largest
request, pages); ``session`` [1] (the
session whose pages are cached; -1 none); the undo log: ``log_key``, ``log_old`` [C] (a page's
place in ``state``, or ``-1 - (5 f + field)`` for a window field, and the value it had) and
``log_n`` [1] (entries; -1: not logging); ``settled`` [L, E] and ``epoch`` [1]: the experts whose
scale pages are all cached and unmarked since the page cache was last emptied (``settled`` holds
the ``epoch`` it was so in), whose scale reads the cache then serves without looking at a page
(:func:`scales_settled`)."""


def new_page_cache(sloc: np.ndarray, file_sizes, read_ahead_bytes: int, undo_reads: int,
                   max_request_bytes: int | None = None) -> PageCache:
    """An empty page cache for a layout whose scale tensors sit at ``sloc`` [L, E, 3, (file,
    offset, bytes)], with files of ``file_sizes`` (bytes) read with a readahead maximum of
    ``read_ahead_bytes`` on a device whose largest request is ``max_request_bytes`` (Linux
    ``io_pages``: a read larger than the readahead maximum may have a window that large; None:
    no larger). ``undo_reads`` sizes the undo log: the scale preads one logged stretch may hold.

    A pread of r pages caches pages only in [i, j + 2W), W = max(M, r) the largest window
    (synchronous windows start before j and take at most W pages; asynchronous ones start within
    W of a mark before j and take at most W), each page logged at most twice (cached with its
    mark, the mark cleared); its loop meets each page once, a synchronous and an asynchronous
    window each (four window fields apiece), and sets ``prev_pos``: at most 10 r + 4 W + 1 log
    entries, which bounds the log (the largest scale pread of the layout).

    Memory: one byte per tracked page (a file's scale extent plus the largest window either
    side: for the converter's layouts, which keep scales together, about the scales' size /
    4096) and 16 bytes per log entry."""
    F = len(file_sizes)
    M = max(int(read_ahead_bytes) // PAGE_BYTES, 0)
    io = max(int(max_request_bytes or 0) // PAGE_BYTES, M)
    r = int(((sloc[..., 1] % PAGE_BYTES + sloc[..., 2] + PAGE_BYTES - 1) // PAGE_BYTES).max(initial=1))
    W = max(M, min(r, io), 1)
    file_pages = np.array([-(-int(s) // PAGE_BYTES) for s in file_sizes], dtype=np.int64)
    first = np.zeros(F, dtype=np.int64)
    count = np.zeros(F, dtype=np.int64)
    loc = sloc.reshape(-1, 3)
    loc = loc[loc[:, 2] > 0]
    for f in range(F):
        mine = loc[loc[:, 0] == f]
        if len(mine):
            lo = max(int(mine[:, 1].min()) // PAGE_BYTES - W, 0)
            hi = min(-(-int((mine[:, 1] + mine[:, 2]).max()) // PAGE_BYTES) + W, int(file_pages[f]))
            first[f], count[f] = lo, hi - lo
    offset = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    ra = np.zeros((F, 5), dtype=np.int64)
    ra[:, RA_PREV] = -1
    cap = max(1, int(undo_reads) * (10 * r + 4 * W + 1))
    return PageCache(np.zeros(int(count.sum()), dtype=np.uint8), first, offset, count, file_pages, ra,
                     np.array([M, io], dtype=np.int64), np.array([-1], dtype=np.int64),
                     np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), np.array([-1], dtype=np.int64),
                     np.full(sloc.shape[:2], -1, dtype=np.int64), np.zeros(1, dtype=np.int64))


@njit(**HELPER)
def start_session(pc, session):
    """Make ``session`` the one cached: a new session starts with no page cached (windows stay)."""
    if pc.session[0] != session:
        pc.state[:] = 0
        pc.session[0] = session
        pc.epoch[0] += 1


@njit(**HELPER)
def checkpoint(pc):
    """Start (or continue) logging changes; returns the log position to :func:`undo` to."""
    if pc.log_n[0] < 0:
        pc.log_n[0] = 0
    return pc.log_n[0]


@njit(**HELPER)
def undo(pc, mark):
    """Revert every change logged since ``mark`` (a :func:`checkpoint`), newest first."""
    for q in range(pc.log_n[0] - 1, mark - 1, -1):
        key = pc.log_key[q]
        if key >= 0:
            pc.state[key] = pc.log_old[q]
        else:
            k = -1 - key
            pc.ra[k // 5, k % 5] = pc.log_old[q]
    pc.log_n[0] = mark


@njit(**HELPER)
def stop_logging(pc):
    """Drop the log (its changes stay)."""
    pc.log_n[0] = -1


@njit(**HELPER)
def _log(pc, key, old):
    n = pc.log_n[0]
    if n >= 0:
        if n == len(pc.log_key):
            raise RuntimeError("the page cache's undo log is full: more scale preads were logged than it was sized for")
        pc.log_key[n], pc.log_old[n] = key, old
        pc.log_n[0] = n + 1


@njit(**HELPER)
def _max_pages(pc, r):
    """The kernel's ``ractl_max_pages``: the readahead maximum, or up to the device's largest
    request for a read of ``r`` pages larger than it."""
    M, io = pc.max_pages[0], pc.max_pages[1]
    if r > M and io > M:
        return min(r, io)
    return M


@njit(**HELPER)
def _slot(pc, f, p):
    """``p``'s place in ``state``, or -1 when the page is not tracked."""
    q = p - pc.first[f]
    if q < 0 or q >= pc.count[f]:
        return -1
    return pc.offset[f] + q


@njit(**HELPER)
def _bits(pc, f, p):
    s = _slot(pc, f, p)
    return pc.state[s] if s >= 0 else 0


@njit(**HELPER)
def _set(pc, f, p, bits):
    s = _slot(pc, f, p)
    if s >= 0 and pc.state[s] != bits:
        _log(pc, s, pc.state[s])
        pc.state[s] = bits


@njit(**HELPER)
def _set_ra(pc, f, field, value):
    if pc.ra[f, field] != value:
        _log(pc, -1 - (5 * f + field), pc.ra[f, field])
        pc.ra[f, field] = value


@njit(**HELPER)
def _init_size(r, M):
    n = 1
    while n < r:
        n *= 2
    if n <= M // 32:
        return 4 * n
    if n <= M // 4:
        return 2 * n
    return M


@njit(**HELPER)
def _next_size(cur, M):
    if cur < M // 16:
        return 4 * cur
    if cur <= M // 2:
        return 2 * cur
    return M


@njit(**HELPER)
def _log2(x):
    n = 0
    while x > 1:
        x >>= 1
        n += 1
    return n


@njit(**HELPER)
def _read_pages(pc, f, start, n, lookahead):
    """Cache the pages of [start, start + n) not cached, one by one (clipped at the end of the
    file), and mark page ``start + n - lookahead`` when this reads it (none when ``lookahead``
    exceeds ``n``). Returns the pages read."""
    n = min(n, pc.file_pages[f] - start)
    mark = n - lookahead if lookahead <= n else -1
    read = 0
    for q in range(max(n, 0)):
        if _bits(pc, f, start + q) & CACHED:
            continue
        _set(pc, f, start + q, CACHED | (MARK if q == mark else 0))
        read += 1
    return read


@njit(**HELPER)
def _window(pc, f, start, size, lookahead, order):
    """Read the window [start, start + size) of folios of up to ``2 ** order`` pages, the first
    page of the marked folio at ``start + size - lookahead`` (the kernel's ``page_cache_ra_order``:
    a folio is aligned to its size and stops at the end of the file; at a page already cached the
    rest is read page by page). Sets the file's window. Returns the pages read."""
    _set_ra(pc, f, RA_START, start)
    _set_ra(pc, f, RA_SIZE, size)
    _set_ra(pc, f, RA_ASYNC, lookahead)
    order = min(MAX_FOLIO_ORDER, order, _log2(size))
    _set_ra(pc, f, RA_ORDER, order)
    limit = min(pc.file_pages[f] - 1, start + size - 1)
    mark = start + size - lookahead
    index, read = start, 0
    while index <= limit:
        o = order
        if index & ((1 << o) - 1):
            o = trailing_zeros(index)
        while o > 0 and index + (1 << o) - 1 > limit:
            o -= 1
        n = 1 << o
        for q in range(n):
            if _bits(pc, f, index + q) & CACHED:
                return read + _read_pages(pc, f, index, size - (index - start), lookahead)
        marked = index == mark // n * n
        for q in range(n):
            _set(pc, f, index + q, CACHED | (MARK if marked else 0))
        read += n
        index += n
    return read


@njit(**HELPER)
def _sync_readahead(pc, f, p, r):
    """The kernel's readahead for a miss at page ``p`` of a read of ``r`` pages from there;
    returns the pages it read."""
    if pc.max_pages[0] <= 0:
        return _read_pages(pc, f, p, 1, 2)
    M = _max_pages(pc, r)
    prev = pc.ra[f, RA_PREV]
    if p == 0 or r > M or (prev >= 0 and 0 <= p - prev // PAGE_BYTES <= 1):
        size = _init_size(r, M)
        return _window(pc, f, p, size, size - r if size > r else size // 2, 0)
    h = 0
    while h < M and p - 1 - h >= 0 and _bits(pc, f, p - 1 - h) & CACHED:
        h += 1
    if h <= r:
        return _read_pages(pc, f, p, r, r + 1)
    if p - h == 0:
        h *= 2
    return _window(pc, f, p, min(h + r, M), 1, 0)


@njit(**HELPER)
def _async_readahead(pc, f, p, n, r):
    """The kernel's readahead on reaching the marked folio of ``n`` pages at page ``p``, with
    ``r`` pages of the read from ``p`` on (its mark is cleared). Returns the pages it read."""
    for q in range(n):
        _set(pc, f, p + q, _bits(pc, f, p + q) & ~MARK)
    if pc.max_pages[0] <= 0:
        return 0
    M = _max_pages(pc, r)
    start, size, lookahead = pc.ra[f, RA_START], pc.ra[f, RA_SIZE], pc.ra[f, RA_ASYNC]
    if p == (start + size - lookahead) // n * n:
        start, size = start + size, max(size, _next_size(size, M))
    else:
        s = p + 1
        while s - p <= M and _bits(pc, f, s) & CACHED:
            s += 1
        if s - p > M:
            return 0
        start, size = s, _next_size(s - p + r, M)
    order = pc.ra[f, RA_ORDER] + 2
    align = 1 << min(order, trailing_zeros(M))
    end = start + size
    aligned = end // align * align
    if aligned > start:
        size -= end - aligned
    return _window(pc, f, start, size, size, order)


@njit(**HELPER)
def buffered_read(pc, f, off, n):
    """One buffered pread of ``n`` bytes at byte ``off`` of file ``f``, as the kernel serves it
    (the module docstring). Returns the pages the pread waited for from the drive (0: the page
    cache served it) and the first of them."""
    i = off // PAGE_BYTES
    j = -(-(off + n) // PAGE_BYTES)
    waited, first_wait = 0, -1
    p = i
    while p < j:
        if not _bits(pc, f, p) & CACHED:
            got = _sync_readahead(pc, f, p, j - p)
            if first_wait < 0:
                first_wait = p
            waited += max(got, 1)
            if not _bits(pc, f, p) & CACHED:      # nothing tracked here: the page is read on its own
                _set(pc, f, p, CACHED)
        last = p                                  # the batch: cached pages up to the first marked folio
        while last + 1 < j and not _bits(pc, f, last) & MARK and _bits(pc, f, last + 1) & CACHED:
            last += 1
        if _bits(pc, f, last) & MARK:
            a, b = last, last
            while _bits(pc, f, a - 1) & MARK:
                a -= 1
            while _bits(pc, f, b + 1) & MARK:
                b += 1
            missing = b + 1                       # the read's next page not cached, if any
            while missing < j and _bits(pc, f, missing) & CACHED:
                missing += 1
            got = _async_readahead(pc, f, a, b - a + 1, j - a)
            if missing < j and _bits(pc, f, missing) & CACHED:   # the read waits for that window
                waited += got
                if first_wait < 0:
                    first_wait = missing
            last = b
        p = last + 1
    _set_ra(pc, f, RA_PREV, off + n)
    return waited, first_wait


@njit(**HELPER)
def pages_cached(pc, f, off, n):
    """Whether every page of bytes [off, off + n) of file ``f`` is cached (changes nothing)."""
    for p in range(off // PAGE_BYTES, -(-(off + n) // PAGE_BYTES)):
        if not _bits(pc, f, p) & CACHED:
            return False
    return True


@njit(**HELPER)
def scales_cached(pc, sloc):
    """Whether the page cache holds all of one expert's scale tensors, ``sloc`` [3, (file,
    offset, bytes)] (changes nothing)."""
    for s in range(sloc.shape[0]):
        if sloc[s, 2] > 0 and not pages_cached(pc, sloc[s, 0], sloc[s, 1], sloc[s, 2]):
            return False
    return True


@njit(**HELPER)
def scales_settled(pc, li, e):
    """Whether expert ``e`` of layer index ``li`` has every scale page cached and unmarked: then
    each of its scale preads is served from the cache and changes only ``prev_pos``
    (:func:`cached_read`), as :func:`buffered_read` would find. (A cached page is never marked
    again and, outside an undo, never dropped within a session.)"""
    return pc.settled[li, e] == pc.epoch[0]


@njit(**HELPER)
def cached_read(pc, f, off, n):
    """:func:`buffered_read` of a pread known to be served from the cache with no mark on its way."""
    _set_ra(pc, f, RA_PREV, off + n)


@njit(**HELPER)
def note_settled(pc, li, e, sloc):
    """After expert ``e``'s scale preads: remember when all its scale pages, ``sloc`` [3, (file,
    offset, bytes)], are cached and unmarked (not while logging, which an undo could revert)."""
    if pc.log_n[0] >= 0 or pc.settled[li, e] == pc.epoch[0]:
        return
    for t in range(sloc.shape[0]):
        f, off, n = sloc[t, 0], sloc[t, 1], sloc[t, 2]
        for p in range(off // PAGE_BYTES, -(-(off + n) // PAGE_BYTES)):
            if _bits(pc, f, p) != CACHED:
                return
    pc.settled[li, e] = pc.epoch[0]
