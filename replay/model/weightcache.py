"""The page cache under buffered weight reads: whole experts, the least recently read evicted first.

With buffered weight reads (colibrì's default, ``DIRECT=0``) the kernel keeps the pages an
expert's weight pread brought in, and a later pread of the same bytes is served from memory: in
a run whose prompts' prefill reads most experts, most decode misses of the runtime's own LRU are
such re-reads (docs/ENGINE_MODEL.md). This module keeps that state at the granularity of one
expert's weights: an expert whose weight read reached the drive is cached; caching more than the
budget evicts the least recently read experts first (Linux's page cache keeps an active and an
inactive list; one recency order is the approximation). O_DIRECT reads neither use nor fill it;
with a budget of 0 every buffered weight read reaches the drive. Each session starts with it
empty, as the model starts a session cold (:func:`wc_start`).

The list is doubly linked over flat arrays indexed ``li * E + e`` (O(1) touch, add, evict).
Bytes.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.jit import HELPER

WeightCache = namedtuple("WeightCache", "capacity used nbytes cached newer older ends session")
"""``capacity`` [1] (bytes, 0: no page cache for weights), ``used`` [1] (bytes cached); per
layout layer and expert [L, E]: ``nbytes`` (its weight bytes), ``cached``; per ``li * E + e``:
``newer``, ``older`` (neighbours in recency order, -1 ends it); ``ends`` [2]: the least and the
most recently read (-1: empty); ``session`` [1]: the session its contents belong to."""


def new_weight_cache(capacity: int, wbytes: np.ndarray) -> WeightCache:
    """An empty page cache of ``capacity`` bytes for experts of ``wbytes`` [L, E] weight bytes."""
    L, E = wbytes.shape
    return WeightCache(np.array([max(int(capacity), 0)], np.int64), np.zeros(1, np.int64),
                       np.ascontiguousarray(wbytes, dtype=np.int64), np.zeros((L, E), np.bool_),
                       np.full(L * E, -1, np.int64), np.full(L * E, -1, np.int64), np.full(2, -1, np.int64),
                       np.full(1, -1, np.int64))


@njit(**HELPER)
def wc_start(wc, session):
    """Empty the cache when a new session starts."""
    if wc.session[0] == session:
        return
    wc.session[0] = session
    E = wc.cached.shape[1]
    k = wc.ends[0]
    while k >= 0:
        wc.cached[k // E, k % E] = False
        k = wc.newer[k]
    wc.ends[0] = wc.ends[1] = -1
    wc.used[0] = 0


@njit(**HELPER)
def wc_hit(wc, li, e):
    """Whether expert ``e`` of layer ``li``'s weights are cached; a hit becomes the most recently read."""
    if not wc.cached[li, e]:
        return False
    k = li * wc.cached.shape[1] + e
    _unlink(wc, k)
    _append(wc, k)
    return True


@njit(**HELPER)
def wc_add(wc, li, e):
    """Expert ``e`` of layer ``li``'s weights were read from the drive: cache them as the most
    recently read, evicting the least recently read until the budget holds (an expert larger than
    the budget is not cached)."""
    n = wc.nbytes[li, e]
    if wc.capacity[0] == 0 or wc.cached[li, e] or n > wc.capacity[0]:
        return
    E = wc.cached.shape[1]
    k = li * E + e
    wc.cached[li, e] = True
    _append(wc, k)
    wc.used[0] += n
    while wc.used[0] > wc.capacity[0]:
        old = wc.ends[0]
        _unlink(wc, old)
        wc.cached[old // E, old % E] = False
        wc.used[0] -= wc.nbytes[old // E, old % E]


@njit(**HELPER)
def _unlink(wc, k):
    n, o = wc.newer[k], wc.older[k]
    if o >= 0:
        wc.newer[o] = n
    else:
        wc.ends[0] = n
    if n >= 0:
        wc.older[n] = o
    else:
        wc.ends[1] = o


@njit(**HELPER)
def _append(wc, k):
    wc.older[k] = wc.ends[1]
    wc.newer[k] = -1
    if wc.ends[1] >= 0:
        wc.newer[wc.ends[1]] = k
    else:
        wc.ends[0] = k
    wc.ends[1] = k
