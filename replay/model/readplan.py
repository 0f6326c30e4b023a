"""The read path: which preads one (forward, layer)'s missing experts cause, and in which jobs.

One compiled function, :func:`plan_layer`, plans them for both the timing model
(:mod:`replay.model.instance`, which calls it from its compiled loop) and the measurement harness
(:mod:`replay.physical.measure`, which calls it from Python per layer and executes the reads it returns),
so the two cannot disagree about what is read.

**Input.** The layer's missing experts in issue order (the layer's physical order: file, then
offset of the first weight byte, ``LayoutArrays.rank``), a flag per miss for a prefetch already in
flight (nothing to read), a flag per miss for a resident top segment (only the bottom share
``keep`` of its bytes is read, as one extent at the expert's place), the layer's layout arrays
(:class:`replay.model.instance.LayoutArrays` fields for that layer) and the coalescing policy.

**Output.** Reads [R] in issue order, filled into a :data:`ReadPlan`: ``file`` (index),
``offset`` and ``length`` (bytes, as the layout places them: no O_DIRECT widening), ``first`` and
``last`` (the misses it serves, positions in the issue order), ``kind`` (:data:`WEIGHT` or
:data:`SCALE`) and ``job`` (the reader-pool job that carries it; jobs are numbered in issue
order, and a job's reads are consecutive). Per miss, ``wlen`` gets its weight bytes.

**Jobs.** Without coalescing every miss with something to read is one job: its weight read (one
pread when its three weight tensors are byte-adjacent in one file, or only its bottom segment is
read; else three, in slot order gate, up, down), then its three scale preads. With coalescing,
a run of one-extent misses contiguous in one file shares one weight read (their span), and each
miss's three scale preads follow as a job of their own, so other workers take them. A miss whose
prefetch is in flight reads nothing and ends a run.

**Coalescing cap.** Miss ``p`` joins the run of miss ``p - 1`` when both are one-extent, neither
is in flight, they are in one file, the gap from the end of ``p - 1``'s bytes to ``p``'s start is
``0 <= gap <= gap_bytes``, and the run's span from its first byte to the end of ``p``'s bytes
(gaps included) stays ``<= max_bytes``. So a coalesced read (two or more experts) never exceeds
``max_bytes``; a single expert larger than the cap is still read whole, on its own.

**What each side adds.** The model widens O_DIRECT weight reads to the device's
``direct_alignment`` in the array's logical address space (files start at 1 MiB boundaries,
:data:`replay.model.engine.FILE_ALIGNMENT`, so for alignments dividing 1 MiB this is the same window as
widening the file offset), decides which scale reads the page cache serves with the kernel's
readahead (:mod:`replay.model.pagecache`), and treats a declared share of weight reads as page-cache
hits. The harness widens O_DIRECT reads to
4 KiB file offsets (its aligned buffers; the window may reach past the end of the file) and
issues every read, scales always buffered.
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


def new_plan(k: int) -> ReadPlan:
    """A :data:`ReadPlan` large enough for ``k`` misses (at most three weight and three scale reads each)."""
    R = max(6 * k, 6)
    return ReadPlan(*(np.empty(R, np.int64) for _ in ReadPlan._fields))


@njit(**PLAN)
def plan_layer(experts, k, skip, top, keep, adjacent, pos_file, pos_off, wbytes, wloc, sloc, coalesce, gap_bytes,
               max_bytes, wlen, plan):
    """Plan the reads of the ``k`` misses ``experts[:k]`` (issue order); returns (reads, jobs).

    ``skip[p]``: miss ``p``'s prefetch is in flight; ``top[p]``: only its bottom share ``keep`` is
    read. ``adjacent``, ``pos_file``, ``pos_off``, ``wbytes`` [E], ``wloc``, ``sloc`` [E, 3, 3]:
    the layer's layout arrays. ``coalesce`` with ``gap_bytes`` and ``max_bytes``: the policy.
    Fills ``wlen`` [k] and ``plan`` (:data:`ReadPlan`, from index 0).
    """
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
            n_reads = _put(plan, n_reads, pos_file[e], pos_off[e], pos_off[last] + wlen[q - 1] - pos_off[e], p, q - 1,
                           WEIGHT, job)
        else:
            for t in range(3):
                n_reads = _put(plan, n_reads, wloc[e, t, 0], wloc[e, t, 1], wloc[e, t, 2], p, p, WEIGHT, job)
        for r in range(p, q):
            if coalesce:
                job = n_jobs
                n_jobs += 1
            share = keep if top[r] else 1.0
            for t in range(3):
                n_reads = _put(plan, n_reads, sloc[experts[r], t, 0], sloc[experts[r], t, 1],
                               np.int64(np.ceil(sloc[experts[r], t, 2] * share)), r, r, SCALE, job)
        p = q
    return n_reads, n_jobs


@njit(**PLAN)
def _put(plan, n, file, offset, length, first, last, kind, job):
    plan.file[n], plan.offset[n], plan.length[n] = file, offset, length
    plan.first[n], plan.last[n], plan.kind[n], plan.job[n] = first, last, kind, job
    return n + 1
