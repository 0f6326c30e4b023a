"""Vertical expert splits: which experts keep a top segment in RAM.

A SwiGLU expert splits exactly along its FFN dimension: the top segment is rows [0, rF) of gate
and up plus columns [0, rF) of down, and y = y_top + y_bottom. ``rF`` is rounded to whole
quantisation groups (group-G formats group the input dimension, which for down is the FFN
dimension) and to whole bytes of packed weights. With per-row scales, down's scales belong to its output rows
and are needed by both segments, so each segment carries a copy.

Resident tops are chosen greedily by value per byte under a RAM budget:

* ``heat``: selections per byte;
* ``stall``: expected stall avoided per resident byte, in closed form: a needed expert whose top
  is resident saves reading the top segment on the critical path (one request cost plus its bytes
  at the array's bandwidth), but only when the expert is not already in the LRU cache. The LRU
  hit probability comes from Che's approximation: with per-token need probability p_e and a
  cache of c experts, hit_e = 1 - exp(-p_e T) where T solves sum_e (1 - exp(-p_e T)) = c.
* ``replay``: the replay model's own account. The training sessions are replayed through the
  packed layout on a device profile with the LRU budget; each expert is credited with the time
  the compute thread waited right before its matmul; a resident top removes the top's share of
  that wait (first order: queueing effects on the other experts are ignored). Value per byte =
  wait x top share / top bytes.
"""

from __future__ import annotations

import numpy as np

from containers.errors import InputError
from replay.model.config import greedy_by_value
from replay.control.splitsizes import SegmentSizes, segment_sizes, tops_by_wait

RULES = ("heat", "stall", "replay")

__all__ = ["RULES", "SegmentSizes", "che_hit_probability", "choose_resident", "choose_resident_by_wait", "segment_sizes"]


def che_hit_probability(p: np.ndarray, capacity: float) -> np.ndarray:
    """Che's approximation of LRU hit probability per item for need probabilities ``p``.

    Parameters
    ----------
    p : per-item probability of being needed per token.
    capacity : the cache's size in items.

    Returns
    -------
    Per-item hit probability; items never needed never hit, and a cache holding every needed
    item hits all of them.

    >>> che_hit_probability(np.array([0.5, 0.5, 0.0]), 5.0)
    array([1., 1., 0.])
    """
    if capacity <= 0:
        return np.zeros_like(p)
    if capacity >= (p > 0).sum():
        return (p > 0).astype(float)
    lo, hi = 0.0, 1.0
    while np.sum(1 - np.exp(-p * hi)) < capacity:
        hi *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        if np.sum(1 - np.exp(-p * mid)) < capacity:
            lo = mid
        else:
            hi = mid
    return 1 - np.exp(-p * (lo + hi) / 2)


def choose_resident(
    heat: np.ndarray,
    tokens: int,
    sizes: list[SegmentSizes],
    expert_bytes: list[int],
    ram_budget: int,
    rule: str = "stall",
    cache_bytes: int = 0,
    *,
    request_seconds: float = 80e-6,
    bandwidth: float = 12e9,
) -> list[np.ndarray]:
    """Experts (per layer) whose top segment stays resident, best value per byte first.

    ``heat`` [L, E]: training selections; ``tokens``: training tokens; ``sizes`` and
    ``expert_bytes`` per layer; ``ram_budget`` bytes for tops; ``cache_bytes`` the LRU budget
    that competes for the same experts (the ``stall`` rule discounts what the cache already holds).
    """
    if rule not in RULES:
        raise InputError(None, f"unknown split rule {rule!r} (choose {', '.join(RULES)})")
    L, E = heat.shape
    p = heat / max(tokens, 1)
    value = np.zeros((L, E))
    top = np.array([s.top_bytes for s in sizes], dtype=np.float64)
    for li in range(L):
        if rule == "heat":
            value[li] = p[li] / top[li]
        else:
            per_layer_cache = cache_bytes / L / max(expert_bytes[li], 1)
            miss = 1 - che_hit_probability(p[li], per_layer_cache)
            value[li] = p[li] * miss * (request_seconds + top[li] / bandwidth) / top[li]
    return _per_layer(greedy_by_value(value, top, ram_budget))


def _per_layer(mask: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(row).astype(np.int64) for row in mask]


def choose_resident_by_wait(expert_wait: np.ndarray, top_fraction: np.ndarray, sizes: list[SegmentSizes],
                            ram_budget: int) -> list[np.ndarray]:
    """Tops to keep resident, by replayed wait avoided per byte (the ``replay`` rule)."""
    return _per_layer(tops_by_wait(expert_wait, top_fraction, np.array([s.top_bytes for s in sizes], dtype=np.float64), ram_budget))
