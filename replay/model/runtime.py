"""The runtime's RAM tier for whole experts: an exact per-layer LRU, compiled.

This follows the colibrì demand path: per MoE layer of a forward, route all
positions, take the batch union of unique experts, serve each from the pinned store, then from a
per-layer LRU in RAM, and load the misses from storage.

The LRU is a doubly linked list per layer in flat arrays (O(1) touch, add and evict). The
timing model (:mod:`replay.model.instance`) runs it inside its loop over instances, in time order, so
prefetched experts enter it too; :func:`lru_hits` is the same demand-only pass on its own (a
reference the tests compare with an ``OrderedDict``). Each session starts with a cold LRU;
pinned experts are loaded before the run starts. :class:`Heat` keeps what colibrì's prefetch
eviction guard weighs (:func:`guard_protects`). Knobs and budgets: :mod:`replay.model.config`.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.jit import HELPER, LOOP

Lru = namedtuple("Lru", "capacity newer older cached oldest newest size session")
"""Per-layer LRUs over expert ids. ``capacity`` [L] in experts (0 = no cache); per [L, E] the
newer and older neighbour in the layer's list (-1 ends it) and membership; per [L] the oldest
and newest expert, the size, and the session the contents belong to. Every step is O(1)."""


def new_lru(capacity: np.ndarray, n_experts: int) -> Lru:
    L = len(capacity)
    return Lru(np.asarray(capacity, dtype=np.int64), np.full((L, n_experts), -1, dtype=np.int64),
               np.full((L, n_experts), -1, dtype=np.int64), np.zeros((L, n_experts), dtype=bool),
               np.full(L, -1, dtype=np.int64), np.full(L, -1, dtype=np.int64), np.zeros(L, dtype=np.int64),
               np.full(L, -1, dtype=np.int64))


def lru_hits(
    inst_layer: np.ndarray,
    inst_session: np.ndarray,
    sel_start: np.ndarray,
    sel_expert: np.ndarray,
    capacity: np.ndarray,
    pinned: np.ndarray,
    rank: np.ndarray | None = None,
) -> np.ndarray:
    """Which union selections are served from RAM, demand loads only (the replay model runs the
    same steps inside its timing loop, where prefetched experts enter the LRU too).

    Instances (one per forward and layer) are in time order; instance ``i``'s union experts are
    ``sel_expert[sel_start[i]:sel_start[i+1]]``, ascending. ``rank`` [L, E]: each expert's place in
    its layer's physical order (:func:`replay.model.engine.layout_arrays`); an instance's misses enter
    the LRU in that order, the order their loads are issued and complete in (default: by id, the
    stock order). Returns a boolean hit mask over the selections.
    """
    hits = np.zeros(len(sel_expert), dtype=bool)
    if rank is None:
        rank = np.tile(np.arange(pinned.shape[1], dtype=np.int64), (pinned.shape[0], 1))
    _demand_pass(np.asarray(inst_layer, dtype=np.int64), np.asarray(inst_session, dtype=np.int64),
                 np.asarray(sel_start, dtype=np.int64), np.asarray(sel_expert, dtype=np.int64),
                 np.asarray(pinned, dtype=bool), np.asarray(rank, dtype=np.int64), new_lru(capacity, pinned.shape[1]), hits)
    return hits


@njit(**LOOP)
def _demand_pass(inst_layer, inst_session, starts, sel_expert, pinned, rank, lru, hits):
    """Marks ``hits``: pinned experts, then each layer's LRU (see :func:`lru_touch`, :func:`lru_add`);
    an instance's misses enter the LRU by ``rank``."""
    missed = np.empty(max(1, pinned.shape[1]), np.int64)
    for i in range(len(inst_layer)):
        li = inst_layer[i]
        lru_start(lru, li, inst_session[i])
        n_missed = 0
        for j in range(starts[i], starts[i + 1]):
            e = sel_expert[j]
            hits[j] = pinned[li, e] or lru_touch(lru, li, e)
            if not hits[j]:
                q = n_missed                         # insert by physical place
                while q > 0 and rank[li, missed[q - 1]] > rank[li, e]:
                    missed[q] = missed[q - 1]
                    q -= 1
                missed[q] = e
                n_missed += 1
        for m in range(n_missed):
            lru_add(lru, li, missed[m])


@njit(**HELPER)
def lru_start(lru, li, session):
    """Empty layer ``li``'s LRU when a new session starts (each session is a fresh run)."""
    if session == lru.session[li]:
        return
    lru.session[li] = session
    e = lru.oldest[li]
    while e >= 0:
        lru.cached[li, e] = False
        e = lru.newer[li, e]
    lru.oldest[li] = lru.newest[li] = -1
    lru.size[li] = 0


@njit(**HELPER)
def lru_touch(lru, li, e):
    """Look ``e`` up in layer ``li``'s LRU; a hit becomes the most recently used. Returns the hit."""
    if not lru.cached[li, e]:
        return False
    _unlink(lru, li, e)
    _append(lru, li, e)
    return True


@njit(**HELPER)
def lru_add(lru, li, e):
    """Insert ``e`` as the most recently used, then evict the least recently used down to the
    capacity (an instance inserts all its misses after its lookups)."""
    if lru.capacity[li] <= 0 or lru.cached[li, e]:
        return
    lru.cached[li, e] = True
    _append(lru, li, e)
    lru.size[li] += 1
    while lru.size[li] > lru.capacity[li]:
        old = lru.oldest[li]
        _unlink(lru, li, old)
        lru.cached[li, old] = False
        lru.size[li] -= 1


@njit(**HELPER)
def _unlink(lru, li, e):
    n, o = lru.newer[li, e], lru.older[li, e]
    if o >= 0:
        lru.newer[li, o] = n
    else:
        lru.oldest[li] = n
    if n >= 0:
        lru.older[li, n] = o
    else:
        lru.newest[li] = o


@njit(**HELPER)
def _append(lru, li, e):
    """Make ``e`` the most recently used expert of layer ``li``."""
    lru.older[li, e] = lru.newest[li]
    lru.newer[li, e] = -1
    if lru.newest[li] >= 0:
        lru.newer[li, lru.newest[li]] = e
    else:
        lru.oldest[li] = e
    lru.newest[li] = e


Heat = namedtuple("Heat", "count last clock session")
"""How often and how recently the session routed each expert, as colibrì keeps it (``eheat``,
``elast``, ``eaccess_clock``): ``count`` [L, E] (positions that selected it), ``last`` [L, E] (the
clock at its last selection), ``clock`` [1] (selections so far, every layer; one process, one
session), ``session`` [1] (the session they belong to)."""

GUARD_MIN_HEAT = 2
"""A victim the guard may protect has been selected at least this often (colibrì's ``vh>=2``)."""


def new_heat(n_layers: int, n_experts: int) -> Heat:
    return Heat(np.zeros((n_layers, n_experts), np.int64), np.zeros((n_layers, n_experts), np.int64),
                np.zeros(1, np.int64), np.full(1, -1, np.int64))


@njit(**HELPER)
def heat_route(heat, li, session, sel_e, sel_mult, a, b):
    """Layer ``li`` routed the experts ``sel_e[a:b]``, each by ``sel_mult`` positions, in
    ``session`` (a new session starts from nothing, as a new process does): count them and stamp
    each with the clock after the layer's selections."""
    if session != heat.session[0]:
        heat.session[0] = session
        heat.count[:, :] = 0
        heat.last[:, :] = 0
        heat.clock[0] = 0
    for j in range(a, b):
        heat.clock[0] += sel_mult[j]
    for j in range(a, b):
        heat.count[li, sel_e[j]] += sel_mult[j]
        heat.last[li, sel_e[j]] = heat.clock[0]


@njit(**HELPER)
def _lfru_score(heat, li, e):
    """colibrì's ``tier_lfru_score``: the selections, 256 points each, plus up to 255 points for
    a selection among the last 255 of the clock."""
    age = heat.clock[0] - heat.last[li, e]
    return (heat.count[li, e] << 8) + (255 - age if age < 255 else 0)


@njit(**HELPER)
def guard_protects(heat, li, victim, e):
    """colibrì's prefetch eviction guard (``PILOT_EVICT_GUARD``, on by default): a speculative
    load of expert ``e`` of layer ``li`` does not evict ``victim`` when the victim is warm (selected
    at least :data:`GUARD_MIN_HEAT` times) and its score (:func:`_lfru_score`) plus a quarter plus
    four selections' worth is above ``e``'s; the load is then dropped."""
    if heat.count[li, victim] < GUARD_MIN_HEAT:
        return False
    vs = _lfru_score(heat, li, victim)
    return vs + (vs >> 2) + (4 << 8) > _lfru_score(heat, li, e)
