"""The read path: which preads one (forward, layer)'s missing experts cause, and in which jobs.

One compiled function, :func:`plan_layer`, plans them for both the timing model
(:mod:`replay.model.demand` and :mod:`replay.model.prefetching`, from the compiled loop) and the
measurement harness (:mod:`replay.physical.measure`, from Python per layer), so the two cannot
disagree about what is read. docs/MODEL.md ("The read plan") states its input, output, jobs and
coalescing cap, and what each side adds. Units: bytes.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.jit import LOOP

WEIGHT = 0
SCALE = 1

ReadPlan = namedtuple("ReadPlan", "file offset length first last kind job")
"""One layer's planned reads [R] (see the module docstring); int64 arrays."""

PLAN = dict(LOOP, inline="always")
"""Inlined into the model's loop (like its stages, :mod:`replay.model.jit`) and callable from Python."""

LayerPlace = namedtuple("LayerPlace", "keep adjacent pos_file pos_off wbytes wloc sloc")
"""Where one layer's experts are, as :func:`plan_layer` reads it: ``keep`` (the bottom share of
an expert's bytes read when its top segment is resident, 0-1), then the layer's
:class:`replay.model.state.LayoutArrays` rows: ``adjacent``, ``pos_file``, ``pos_off``,
``wbytes`` [E], ``wloc``, ``sloc`` [E, 3, 3]. Build it by keyword in Python; the model's loop
takes it from its layout arrays with :func:`layer_place`."""

Coalescing = namedtuple("Coalescing", "coalesce gap_bytes max_bytes")
"""The coalescing policy: ``coalesce`` (bool), the largest gap (bytes) a run may bridge and the
most bytes one coalesced read may span."""


def new_plan(k: int) -> ReadPlan:
    """A :data:`ReadPlan` large enough for ``k`` misses (at most three weight and three scale reads each)."""
    R = max(6 * k, 6)
    return ReadPlan(*(np.empty(R, np.int64) for _ in ReadPlan._fields))


@njit(**PLAN)
def layer_place(lay, li):
    """The :data:`LayerPlace` of layer ``li`` of the layout arrays ``lay``
    (:class:`replay.model.state.LayoutArrays`)."""
    return LayerPlace(1.0 - lay.top_fraction[li], lay.adjacent[li], lay.pos_file[li], lay.pos_off[li], lay.wbytes[li],
                      lay.wloc[li], lay.sloc[li])


@njit(**PLAN)
def plan_layer(experts, k, skip, top, place, policy, wlen, plan):
    """Plan the reads of the ``k`` misses ``experts[:k]`` (issue order).

    Parameters
    ----------
    experts : int64 array [>= k]
        The misses, in issue order.
    k : int
        How many.
    skip, top : bool arrays [>= k]
        ``skip[p]``: miss ``p``'s prefetch is in flight (nothing to read); ``top[p]``: its top
        segment is resident (only the bottom share ``place.keep`` is read).
    place : LayerPlace
        The layer's layout arrays.
    policy : Coalescing
        The coalescing policy.
    wlen : int64 array [>= k]
        Filled with each miss's weight bytes read.
    plan : ReadPlan
        Filled with the reads, from index 0.

    Returns
    -------
    (reads, jobs) : the number of reads and of reader-pool jobs planned.
    """
    keep, adjacent, pos_file, pos_off = place.keep, place.adjacent, place.pos_file, place.pos_off
    wbytes, wloc, sloc = place.wbytes, place.wloc, place.sloc
    coalesce, gap_bytes, max_bytes = policy.coalesce, policy.gap_bytes, policy.max_bytes
    for p in range(k):
        wlen[p] = np.int64(np.ceil(wbytes[experts[p]] * (keep if top[p] else 1.0)))
    n_reads, n_jobs = 0, 0
    p = 0
    while p < k:
        e = experts[p]
        if skip[p]:
            p += 1
            continue
        q = p + 1
        one = adjacent[e] or top[p]
        if coalesce and one:
            f, start = pos_file[e], pos_off[e]
            while q < k and not skip[q]:
                e2 = experts[q]
                if not (adjacent[e2] or top[q]) or pos_file[e2] != f:
                    break
                gap = pos_off[e2] - (pos_off[experts[q - 1]] + wlen[q - 1])
                if not (0 <= gap <= gap_bytes) or pos_off[e2] + wlen[q] - start > max_bytes:
                    break
                q += 1
        job = n_jobs
        n_jobs += 1
        if one:
            last = experts[q - 1]
            n_reads = _put(plan, n_reads, (pos_file[e], pos_off[e], pos_off[last] + wlen[q - 1] - pos_off[e]), p, q - 1,
                           WEIGHT, job)
        else:
            for t in range(3):
                n_reads = _put(plan, n_reads, (wloc[e, t, 0], wloc[e, t, 1], wloc[e, t, 2]), p, p, WEIGHT, job)
        for r in range(p, q):
            if coalesce:
                job = n_jobs
                n_jobs += 1
            share = keep if top[r] else 1.0
            for t in range(3):
                n_reads = _put(plan, n_reads, (sloc[experts[r], t, 0], sloc[experts[r], t, 1],
                                               np.int64(np.ceil(sloc[experts[r], t, 2] * share))), r, r, SCALE, job)
        p = q
    return n_reads, n_jobs


@njit(**PLAN)
def _put(plan, n, extent, first, last, kind, job):
    """Read ``n`` of ``plan``: ``extent`` (file, offset, length), the misses ``first`` to ``last``
    it serves, its ``kind`` and ``job``; returns ``n + 1``."""
    plan.file[n], plan.offset[n], plan.length[n] = extent
    plan.first[n], plan.last[n], plan.kind[n], plan.job[n] = first, last, kind, job
    return n + 1
