"""The runtime being modelled: its knobs, and its RAM tiers (pinned experts, per-layer LRU).

This follows the colibrì demand path (FACTS section 2): per MoE layer of a forward, route all
positions, take the batch union of unique experts, serve each from the pinned store, then from a
per-layer LRU in RAM, and load the misses from storage with a pool of reader workers.

Cache state does not depend on timing (loads are demand-only), so hits and misses are computed
first, for the whole trace, and the timing model runs afterwards. Each session is a separate run
that starts with a cold LRU (pinned experts are loaded before the run starts).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import asdict, dataclass

import numpy as np
from numba import njit

from containers.errors import InputError

from .jit import HELPER, LOOP

PREFETCH_SOURCES = ("none", "oracle", "coupled")
"""Prefetch sources (see :mod:`replay.prefetch`); the compiled model takes a source as its index here."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Runtime knobs and the compute model. Bytes, seconds, bytes/s."""

    ram_bytes: int = 0                 # LRU budget for whole experts (0 = no cache)
    workers: int = 8                   # reader workers (PIPE_WORKERS), 1-16
    batched: bool = False              # io_uring-style queue: up to 64 loads in flight
    coalesce: bool = False             # one read for experts contiguous in one file
    coalesce_max_bytes: int = 256 * 1024 * 1024
    coalesce_gap_bytes: int = 64 * 1024
    direct: bool = True                # O_DIRECT weight reads (scales are always buffered)
    pin_bytes: int = 0                 # hottest experts pinned in RAM (by training heat)
    dense_seconds: float = 1.0e-3      # per layer and forward, before routing: attention, router
    compute_bytes_per_second: float = 50e9  # an expert's matmul streams its weights at this rate, per position
    other_seconds_per_token: float = 0.0    # O in TPOT = C + S + O
    prefetch: str = "none"             # prefetch source for the next layer: none, oracle, coupled
    prefetch_experts: int = 6          # K: experts predicted per layer (colibrì PILOT_K)

    def __post_init__(self):
        if not self.batched and not 1 <= self.workers <= 16:
            raise InputError(None, f"--workers must be 1-16 (got {self.workers})")
        if self.ram_bytes < 0 or self.pin_bytes < 0:
            raise InputError(None, "RAM budgets must be >= 0")
        if self.coalesce_max_bytes < 1 or self.coalesce_gap_bytes < 0:
            raise InputError(None, "coalescing needs a span of at least 1 byte and a gap >= 0")
        if self.prefetch not in PREFETCH_SOURCES:
            raise InputError(None, f"unknown prefetch source {self.prefetch!r} (choose {', '.join(PREFETCH_SOURCES)})")
        if not 1 <= self.prefetch_experts <= 64:
            raise InputError(None, f"--prefetch-experts must be 1-64 (got {self.prefetch_experts})")
        if self.compute_bytes_per_second <= 0 or self.dense_seconds < 0:
            raise InputError(None, "compute model needs a positive rate and non-negative dense time")

    @property
    def in_flight(self) -> int:
        """Loads that can be outstanding at once."""
        return 64 if self.batched else self.workers

    def to_json(self) -> dict:
        return asdict(self)


def lru_capacities(ram_bytes: int, expert_bytes: np.ndarray) -> np.ndarray:
    """Experts each layer's LRU holds when ``ram_bytes`` is shared evenly by the layers."""
    L = len(expert_bytes)
    if ram_bytes <= 0:
        return np.zeros(L, dtype=np.int64)
    return (ram_bytes // L // np.maximum(expert_bytes, 1)).astype(np.int64)


def greedy_by_value(value: np.ndarray, cost: np.ndarray, budget: float) -> np.ndarray:
    """Boolean [L, E]: items taken best value first (ties by layer, then id) while they fit.

    ``value`` [L, E] is value per byte; ``cost`` [L] bytes per item of a layer. Items of value
    <= 0 are never taken; an item that does not fit is skipped and smaller ones may still fit.
    """
    L, E = value.shape
    out = np.zeros((L, E), dtype=bool)
    order = np.lexsort((np.tile(np.arange(E), L), np.repeat(np.arange(L), E), -value.ravel()))
    used = 0.0
    for flat in order.tolist():
        li, e = divmod(flat, E)
        if value[li, e] <= 0:
            break
        if used + cost[li] > budget:
            continue
        used += cost[li]
        out[li, e] = True
    return out


def pinned_experts(heat: np.ndarray, expert_bytes: np.ndarray, pin_bytes: int) -> np.ndarray:
    """Boolean [L, E]: hottest experts (selections per byte) until ``pin_bytes`` is used."""
    if pin_bytes <= 0:
        return np.zeros(heat.shape, dtype=bool)
    return greedy_by_value(heat / np.maximum(expert_bytes, 1)[:, None], np.asarray(expert_bytes, dtype=np.float64), pin_bytes)


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
) -> np.ndarray:
    """Which union selections are served from RAM, demand loads only (the replay model runs the
    same steps inside its timing loop, where prefetched experts enter the LRU too).

    Instances (one per forward and layer) are in time order; instance ``i``'s union experts are
    ``sel_expert[sel_start[i]:sel_start[i+1]]``, ascending. Returns a boolean hit mask over them.
    """
    hits = np.zeros(len(sel_expert), dtype=bool)
    _demand_pass(np.asarray(inst_layer, dtype=np.int64), np.asarray(inst_session, dtype=np.int64),
                 np.asarray(sel_start, dtype=np.int64), np.asarray(sel_expert, dtype=np.int64),
                 np.asarray(pinned, dtype=bool), new_lru(capacity, pinned.shape[1]), hits)
    return hits


@njit(**LOOP)
def _demand_pass(inst_layer, inst_session, starts, sel_expert, pinned, lru, hits):
    """Marks ``hits``: pinned experts, then each layer's LRU (see :func:`lru_touch`, :func:`lru_add`)."""
    missed = np.empty(max(1, pinned.shape[1]), np.int64)
    for i in range(len(inst_layer)):
        li = inst_layer[i]
        lru_start(lru, li, inst_session[i])
        n_missed = 0
        for j in range(starts[i], starts[i + 1]):
            e = sel_expert[j]
            hits[j] = pinned[li, e] or lru_touch(lru, li, e)
            if not hits[j]:
                missed[n_missed] = e
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
