"""The page cache under the runtime's buffered reads, with Linux's readahead and a memory budget.

:func:`buffered_read` decides, pread by pread, which reads reach the drive and which pages the
kernel's readahead brings in with them; :func:`exact_read` caches just the pages asked for (a
``MADV_WILLNEED`` or a mapped view's touch). It always tracks the experts' scale pages and,
when the run reads weights buffered with a page cache for them, their weight pages too. With a
budget smaller than the pages tracked, the least recently read 64 KiB blocks
(:data:`BLOCK_PAGES`) are evicted first once a read is done (Linux keeps an active and an
inactive list; one recency order is the approximation). :func:`checkpoint` and :func:`undo` let
a dropped prefetch load leave no trace; nothing is evicted while they log. docs/MODEL.md ("The
page cache and readahead") states the rules, after Linux's ``mm/readahead.c`` and
``mm/filemap.c``. Units: pages of 4 KiB (:data:`PAGE_BYTES`) and bytes.
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

BLOCK_PAGES = 16
"""The pages evicted together: a 64 KiB block of ``state``."""

RUN, MARKED, PAGE = 0, 1, 2
"""Kinds of an undo-log entry for pages: a run of pages that were not cached, a run that was
cached and marked, one page with its old bits."""

PageCache = namedtuple("PageCache", "state first offset count file_pages ra max_pages session log_key log_old log_n "
                                     "settled epoch weights budget stamp ring")
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
(:func:`scales_settled`); ``weights`` [1] (0: weight reads bypass it; 1: it tracks the
weights' pages, read by buffered preads; 2: the same, read as mapped views); ``budget`` [6]: the pages it may hold (-1: no bound), the pages cached, the
ring's oldest entry and its entries, the last stamp, the log position of the last
:func:`checkpoint`; ``stamp`` [B] (each block's last use) and ``ring`` [B + 1, 3] (uses in
order: first block, blocks, stamp; an entry whose blocks were used again since is stale, so at
most one per block is not).

A log entry for pages has ``log_key`` = its first place in ``state`` and ``log_old`` = 4 n +
kind (:data:`RUN`, :data:`MARKED`: n pages; :data:`PAGE`: n the page's old bits)."""

CAP, USED, TAIL, ENTRIES, CLOCK, MARK_AT = 0, 1, 2, 3, 4, 5


def new_page_cache(sloc: np.ndarray, file_sizes, read_ahead_bytes: int, undo_reads: int,
                   max_request_bytes: int | None = None, wloc: np.ndarray | None = None,
                   budget_bytes: int = -1, mapped: bool = False) -> PageCache:
    """An empty page cache for a layout whose scale tensors sit at ``sloc`` [L, E, 3, (file,
    offset, bytes)] and, when ``wloc`` (the same for the weight tensors) is given, whose weight
    pages it tracks too, with files of ``file_sizes`` (bytes) read with a readahead maximum of
    ``read_ahead_bytes`` on a device whose largest request is ``max_request_bytes`` (Linux
    ``io_pages``: a read larger than the readahead maximum may have a window that large; None:
    no larger). ``budget_bytes``: the memory it may hold (-1: no bound); ``mapped``: the weights
    are mapped views (``weights`` 2). ``undo_reads`` sizes the
    undo log: the preads one logged stretch may hold.

    A pread of r pages caches pages only in [i, j + 2W), W = max(M, r) the largest window; the
    log keeps runs of pages (one per window or folio read and per marked folio met, more where
    cached pages interrupt them) and the window fields it sets: at most 10 r + 4 W + 1 entries
    for the largest scale pread. A weight pread of r pages meets at most log2(M) + r / M + 2
    windows (they grow to M or more), each at most 8 entries, and the log allows its runs one
    interruption by cached pages per 64 KiB block: the larger of the two sizes the log per
    pread, and a stretch beyond it raises.

    Memory: one byte per tracked page (each file's scale and, when tracked, weight extents plus
    the largest window either side, from a 64 KiB block's start), 16 bytes per log entry and,
    under a budget, 32 bytes per 64 KiB block tracked (its stamp and a ring entry)."""
    F = len(file_sizes)
    M = max(int(read_ahead_bytes) // PAGE_BYTES, 0)
    io = max(int(max_request_bytes or 0) // PAGE_BYTES, M)
    r = int(((sloc[..., 1] % PAGE_BYTES + sloc[..., 2] + PAGE_BYTES - 1) // PAGE_BYTES).max(initial=1))
    W = max(M, min(r, io), 1)
    per_read = 10 * r + 4 * W + 1
    if wloc is not None:
        wr = int(((wloc[..., 1] % PAGE_BYTES + wloc[..., 2] + PAGE_BYTES - 1) // PAGE_BYTES).max(initial=1))
        W = max(W, min(wr, io))
        windows = int(np.log2(M)) + -(-wr // M) + 2 if M > 0 else 0
        per_read = max(per_read, 8 * windows + 2 * -(-(wr + 2 * W) // BLOCK_PAGES) + 1)
    file_pages = np.array([-(-int(s) // PAGE_BYTES) for s in file_sizes], dtype=np.int64)
    first = np.zeros(F, dtype=np.int64)
    count = np.zeros(F, dtype=np.int64)
    loc = sloc.reshape(-1, 3) if wloc is None else np.concatenate([sloc.reshape(-1, 3), wloc.reshape(-1, 3)])
    loc = loc[loc[:, 2] > 0]
    for f in range(F):
        mine = loc[loc[:, 0] == f]
        if len(mine):
            lo = max(int(mine[:, 1].min()) // PAGE_BYTES - W, 0) // BLOCK_PAGES * BLOCK_PAGES
            hi = min(-(-int((mine[:, 1] + mine[:, 2]).max()) // PAGE_BYTES) + W, int(file_pages[f]))
            first[f], count[f] = lo, hi - lo
    spans = -(-count // BLOCK_PAGES) * BLOCK_PAGES          # each file's blocks start where its pages' do
    offset = np.concatenate([[0], np.cumsum(spans)[:-1]]).astype(np.int64)
    ra = np.zeros((F, 5), dtype=np.int64)
    ra[:, RA_PREV] = -1
    cap = max(1, int(undo_reads) * per_read)
    pages = int(spans.sum())
    limit = -1 if budget_bytes < 0 or budget_bytes // PAGE_BYTES >= count.sum() else int(budget_bytes) // PAGE_BYTES
    blocks = -(-pages // BLOCK_PAGES) if limit >= 0 else 0
    ring = blocks + 1 if limit >= 0 else 1
    return PageCache(np.zeros(pages, dtype=np.uint8), first, offset, count, file_pages, ra,
                     np.array([M, io], dtype=np.int64), np.array([-1], dtype=np.int64),
                     np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), np.array([-1], dtype=np.int64),
                     np.full(sloc.shape[:2], -1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                     np.array([0 if wloc is None else 2 if mapped else 1], dtype=np.int64), np.array([limit, 0, 0, 0, 0, 0], dtype=np.int64),
                     np.zeros(blocks, dtype=np.int64), np.zeros((ring, 3), dtype=np.int64))


@njit(**HELPER)
def start_session(pc, session):
    """Make ``session`` the one cached: a new session starts with no page cached (windows stay)."""
    if pc.session[0] != session:
        pc.state[:] = 0
        pc.session[0] = session
        pc.epoch[0] += 1
        pc.budget[USED] = pc.budget[TAIL] = pc.budget[ENTRIES] = 0


@njit(**HELPER)
def checkpoint(pc):
    """Start (or continue) logging changes; returns the log position to :func:`undo` to."""
    if pc.log_n[0] < 0:
        pc.log_n[0] = 0
    pc.budget[MARK_AT] = pc.log_n[0]
    return pc.log_n[0]


@njit(**HELPER)
def undo(pc, mark):
    """Revert every change logged since ``mark`` (a :func:`checkpoint`), newest first."""
    for q in range(pc.log_n[0] - 1, mark - 1, -1):
        key, old = pc.log_key[q], pc.log_old[q]
        if key < 0:
            k = -1 - key
            pc.ra[k // 5, k % 5] = old
            continue
        n, kind = old >> 2, old & 3
        if kind == PAGE:
            _put(pc, key, n)
        else:
            for s in range(key, key + n):
                _put(pc, s, 0 if kind == RUN else pc.state[s] | MARK)
    pc.log_n[0] = mark


@njit(**HELPER)
def stop_logging(pc):
    """Drop the log (its changes stay) and evict what the budget no longer holds."""
    pc.log_n[0] = -1
    _evict(pc)


@njit(**HELPER)
def _log(pc, key, old):
    n = pc.log_n[0]
    if n >= 0:
        if n == len(pc.log_key):
            raise RuntimeError("the page cache's undo log is full: more preads were logged than it was sized for")
        pc.log_key[n], pc.log_old[n] = key, old
        pc.log_n[0] = n + 1


@njit(**HELPER)
def _log_pages(pc, s, n, kind):
    """Log that ``n`` pages from place ``s`` were :data:`RUN` or :data:`MARKED` (a run following
    the last entry's, of its kind, since the last :func:`checkpoint`, extends it)."""
    q = pc.log_n[0] - 1
    if q >= pc.budget[MARK_AT] and pc.log_key[q] >= 0 and pc.log_old[q] & 3 == kind and pc.log_key[q] + (pc.log_old[q] >> 2) == s:
        pc.log_old[q] += 4 * n
        return
    _log(pc, s, 4 * n + kind)


@njit(**HELPER)
def _put(pc, s, bits):
    """Set place ``s`` of ``state`` to ``bits``, counting the pages cached (not logged)."""
    pc.budget[USED] += (bits & CACHED) - (pc.state[s] & CACHED)
    pc.state[s] = bits


@njit(**HELPER)
def _touch(pc, f, p, n):
    """Pages [p, p + n) of file ``f`` were used: their blocks become the most recently used. The
    ring holds one entry more than there are blocks, and at most one live entry per block, so
    a full ring always has a stale entry to drop."""
    if pc.budget[CAP] < 0:
        return
    lo = max(p - pc.first[f], 0)
    hi = min(p + n - pc.first[f], pc.count[f])
    if hi <= lo:
        return
    b0 = (pc.offset[f] + lo) // BLOCK_PAGES
    b1 = (pc.offset[f] + hi - 1) // BLOCK_PAGES
    if pc.budget[ENTRIES] == len(pc.ring):
        _compact(pc)
    pc.budget[CLOCK] += 1
    t = pc.budget[CLOCK]
    pc.stamp[b0:b1 + 1] = t
    at = (pc.budget[TAIL] + pc.budget[ENTRIES]) % len(pc.ring)
    pc.ring[at, 0], pc.ring[at, 1], pc.ring[at, 2] = b0, b1 - b0 + 1, t
    pc.budget[ENTRIES] += 1


@njit(**HELPER)
def _live(pc, at):
    b0, nb, t = pc.ring[at, 0], pc.ring[at, 1], pc.ring[at, 2]
    for b in range(b0, b0 + nb):
        if pc.stamp[b] == t:
            return True
    return False


@njit(**HELPER)
def _compact(pc):
    """Drop the ring's stale entries, keeping the others in order from place 0."""
    R, kept = len(pc.ring), 0
    for q in range(pc.budget[ENTRIES]):
        at = (pc.budget[TAIL] + q) % R
        if _live(pc, at):
            kept_at = (pc.budget[TAIL] + kept) % R
            pc.ring[kept_at, 0], pc.ring[kept_at, 1], pc.ring[kept_at, 2] = pc.ring[at, 0], pc.ring[at, 1], pc.ring[at, 2]
            kept += 1
    pc.budget[ENTRIES] = kept


@njit(**HELPER)
def _evict_oldest(pc):
    """Evict the blocks of the ring's oldest entry not used since (never while logging)."""
    at = pc.budget[TAIL]
    b0, nb, t = pc.ring[at, 0], pc.ring[at, 1], pc.ring[at, 2]
    pc.budget[TAIL] = (at + 1) % len(pc.ring)
    pc.budget[ENTRIES] -= 1
    dropped = False
    for b in range(b0, b0 + nb):
        if pc.stamp[b] != t:
            continue
        for s in range(b * BLOCK_PAGES, min((b + 1) * BLOCK_PAGES, len(pc.state))):
            if pc.state[s]:
                _put(pc, s, 0)
                dropped = True
    if dropped:
        pc.epoch[0] += 1


@njit(**HELPER)
def _evict(pc):
    """Evict the least recently used blocks until the budget holds (not while logging)."""
    while pc.log_n[0] < 0 and pc.budget[USED] > pc.budget[CAP] >= 0 and pc.budget[ENTRIES] > 0:
        _evict_oldest(pc)


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
        _log(pc, s, 4 * pc.state[s] + PAGE)
        _put(pc, s, bits)


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
    _touch(pc, f, start, n)
    read = 0
    for q in range(max(n, 0)):
        if _bits(pc, f, start + q) & CACHED:
            continue
        _fill(pc, f, start + q, CACHED | (MARK if q == mark else 0))
        read += 1
    return read


@njit(**HELPER)
def _fill(pc, f, p, bits):
    """Cache page ``p`` of file ``f`` (not cached) with ``bits``, logged as part of a run."""
    s = _slot(pc, f, p)
    if s >= 0:
        if pc.log_n[0] >= 0:
            _log_pages(pc, s, 1, RUN)
        _put(pc, s, bits)


@njit(**HELPER)
def _unmark(pc, f, p):
    """Clear page ``p``'s mark, logged as part of a run."""
    s = _slot(pc, f, p)
    if s >= 0 and pc.state[s] & MARK:
        if pc.log_n[0] >= 0:
            _log_pages(pc, s, 1, MARKED)
        pc.state[s] &= ~MARK


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
    _touch(pc, f, start, size)
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
            _fill(pc, f, index + q, CACHED | (MARK if marked else 0))
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
        _unmark(pc, f, p + q)
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
    (the module docstring). Returns the pages it read from the drive and the first of them: its
    synchronous windows and the asynchronous ones it started on reaching a mark (0: the page
    cache served it and it started none). The kernel does not wait for an asynchronous window
    the pread does not need, but the drive serves it all the same: the model makes them one read
    with the rest, which the pread waits for."""
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
            if got:
                waited += got
                if first_wait < 0:
                    first_wait = missing if missing < j else pc.ra[f, RA_START]
            last = b
        p = last + 1
    _set_ra(pc, f, RA_PREV, off + n)
    _touch(pc, f, i, j - i)
    _evict(pc)
    return waited, first_wait


@njit(**HELPER)
def exact_read(pc, f, off, n):
    """A read of just bytes [off, off + n) of file ``f``, no readahead (``MADV_WILLNEED``, or a
    mapped view's pages touched after it): caches the pages not cached. Returns the pages from
    the first not cached to the last (the drive read that brings them in; 0: all cached) and
    the first of them."""
    i = off // PAGE_BYTES
    j = -(-(off + n) // PAGE_BYTES)
    lo, hi = -1, -1
    for p in range(i, j):
        if not _bits(pc, f, p) & CACHED:
            if lo < 0:
                lo = p
            hi = p
            _fill(pc, f, p, CACHED)
    _touch(pc, f, i, j - i)
    _evict(pc)
    return (hi - lo + 1 if lo >= 0 else 0), lo


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
    again; an eviction moves ``epoch`` on.)"""
    return pc.settled[li, e] == pc.epoch[0]


@njit(**HELPER)
def cached_read(pc, f, off, n):
    """:func:`buffered_read` of a pread known to be served from the cache with no mark on its way."""
    _set_ra(pc, f, RA_PREV, off + n)
    _touch(pc, f, off // PAGE_BYTES, -(-(off + n) // PAGE_BYTES) - off // PAGE_BYTES)


@njit(**HELPER)
def cached_pages(pc, f, off, n):
    """How many pages of bytes [off, off + n) of file ``f`` are cached (changes nothing)."""
    k = 0
    for p in range(off // PAGE_BYTES, -(-(off + n) // PAGE_BYTES)):
        if _bits(pc, f, p) & CACHED:
            k += 1
    return k


@njit(**HELPER)
def weights_cached(pc, wloc):
    """Whether the page cache tracks weights and holds all of one expert's weight tensors,
    ``wloc`` [3, (file, offset, bytes)] (changes nothing)."""
    return pc.weights[0] > 0 and scales_cached(pc, wloc)


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
