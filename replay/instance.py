"""One (forward, layer) instance of the timing model: load jobs, reads, the reader pool, the compute thread.

Compiled with numba: an instance is a small sequential event simulation (a handful of jobs of a
few reads each) and a trace holds hundreds of thousands of them, so a plain loop compiled to
machine code is both the clearest form of the model and several times faster than vectorising
across instances with numpy. :func:`simulate_instances` walks the instances in order; the model
itself is described in :mod:`replay.engine`.

Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from .device import split_read
from .jit import HELPER, LOOP
from .prefetch import predict_next
from .runtime import lru_add, lru_start, lru_touch

MEMORY_BANDWIDTH = 10e9
"""Bytes/s for reads served from the OS page cache."""

SMALL_READ_BYTES = 256 * 1024
"""Reads up to this size queue among themselves, beside the large transfers, as a drive's internal
parallelism serves them (their transfer time still delays the large transfers)."""

WARM_BUCKETS = 10_000
"""A weight read is warm when a hash of its (file, 4 KiB page) falls in the first
``page_cache_fraction`` of this many buckets."""

LayoutArrays = namedtuple(
    "LayoutArrays", "rank adjacent pos_file pos_off wbytes ebytes seconds top_resident top_fraction wloc sloc bases")
"""A layout as arrays. Per [L, E]: issue rank (place in the layer's physical order), weights in one
extent, first weight byte (file, offset), weight bytes, expert bytes (weights and scales), matmul
seconds per position, top segment resident. Per layer [L]: the FFN share of a top segment.
Weight and scale extents [L, E, 3, (file, offset, bytes)]; file base addresses [F]."""

ReadPolicy = namedtuple("ReadPolicy", "coalesce gap_bytes span_bytes direct alignment workers warm_fraction "
                                      "dense_seconds prefetch prefetch_experts")
"""How the runtime reads: coalescing (largest gap and span, bytes), O_DIRECT (alignment, bytes),
loads in flight, the device's declared page-cache fraction of weight reads, the dense time before
a layer is routed (s), the prefetch source (index into ``PREFETCH_SOURCES``) and its K."""

Array = namedtuple("Array", "members chunk rule request_seconds bandwidth queue_slots host_bandwidth full_bandwidth")
"""A :class:`replay.device.ArrayProfile` as plain numbers (``rule`` indexes ``SPLIT_RULES``)."""

Results = namedtuple("Results", "union_experts union_bytes hits matmul stall oracle misses reads read_bytes "
                                "expert_wait member_bytes member_requests residence "
                                "pf_loads pf_bytes pf_required pf_timely pf_timely_n pf_slack pf_unused")
"""Outputs, filled in place. Per instance [I]: union experts and bytes, RAM hits, matmul time of
all positions (s), stall and oracle stall (s), misses, reads, bytes read (prefetch included).
[L, E]: the compute thread's wait right before each expert's matmul (s). Per member [M]: bytes
transferred, requests, residence (s). Prefetch, per instance [I]: experts and bytes the
prefetcher loaded while this instance ran (for the next layer); of this instance's experts, the
bytes not already in RAM (required: misses and prefetched ones) and those ready before the
compute thread needed them (timely: a prefetch, or a demand load that finished early); the
timely prefetches' count and lead slack (s); prefetched bytes it did not use."""


@njit(**LOOP)
def simulate_instances(inst_fwd, inst_li, inst_session, sel_start, sel_e, sel_mult, pinned, lru, targets, counts, lay, pol,
                       dev, out):
    """Time every instance, in order. Instance ``i`` is layer ``inst_li[i]`` of forward
    ``inst_fwd[i]`` of session ``inst_session[i]``; its union experts are
    ``sel_e[sel_start[i]:sel_start[i+1]]``, each needed by ``sel_mult`` positions. ``pinned`` [L, E]
    and ``lru`` (:class:`replay.runtime.Lru`) are the RAM tiers; ``targets`` and ``counts`` the
    coupled prefetch source's table (:func:`replay.prefetch.coupling_table`). Results go into ``out``.
    """
    I = len(sel_start) - 1
    L, E = lay.rank.shape
    K = 1
    for i in range(I):
        K = max(K, sel_start[i + 1] - sel_start[i])
    seen = np.full((L, E), -1, np.int64)  # the session that last accessed each expert (scale pages cached)
    # the misses of one instance, in issue (physical) order
    miss_e = np.empty(K, np.int64)
    miss_top = np.empty(K, np.bool_)     # its top segment is resident: only the bottom is read
    miss_comp = np.empty(K)              # its matmul time over all positions (s)
    miss_first = np.empty(K, np.bool_)   # first access in the session: its scales are not yet in the page cache
    miss_ready = np.empty(K)             # >= 0: a prefetch of it is in flight and completes then (s); -1: demand
    missed = np.empty(K, np.int64)       # the misses in lookup order, for the LRU
    wlen = np.empty(K, np.int64)         # weight bytes it reads
    sbytes = np.empty(K, np.int64)       # its scale bytes
    new_job = np.empty(K, np.bool_)      # it starts a new weight job
    wjob = np.empty(K, np.int64)         # the job carrying its weights
    sjob = np.empty(K, np.int64)         # the job carrying its scales
    # the reader pool's jobs and reads
    job_read = np.empty(2 * K + 1, np.int64)   # first read of each job; one past the last
    job_tail = np.empty(2 * K)           # page-cache time after a job's reads (s)
    job_done = np.empty(2 * K)           # completion time of each job (s)
    R = max(8 * K, 7)
    r_addr = np.empty(R, np.int64)
    r_len = np.empty(R, np.int64)
    r_warm = np.empty(R, np.bool_)
    wfree = np.empty(pol.workers)        # each worker's free time (s)
    wjob_of = np.empty(pol.workers, np.int64)  # each worker's job, -1 when idle
    wpos = np.empty(pol.workers, np.int64)     # its next read within that job
    mfree = np.zeros(dev.members)        # each member's large-transfer channel free time (s)
    sfree = np.zeros(dev.members)        # each member's small-read channel free time (s)
    host = np.zeros(2)                   # the host link's large / small channel free times (s)
    pieces = np.empty(dev.members, np.int64)
    nbytes = np.empty(dev.members, np.int64)
    # prefetches made for the next instance: ready time in its clock (s), bytes, and the list
    pf_for = -1
    pf_ready = np.full(E, np.inf)
    pf_bytes = np.zeros(E, np.int64)
    pf_list = np.empty(64, np.int64)
    pf_n = 0
    score = np.zeros(E, np.int64)         # the prefetch predictor's scratch
    touched = np.empty(E, np.int64)
    for i in range(I):
        li = inst_li[i]
        lru_start(lru, li, inst_session[i])
        if pf_for != i:
            pf_n = 0
        k, resident = _select(i, li, sel_start, sel_e, sel_mult, inst_session[i], seen, pinned, lru, lay, out,
                              pf_ready, pf_bytes, pf_list, pf_n,
                              miss_e, miss_top, miss_comp, miss_first, miss_ready, missed)
        pilot_free = 0.0                         # when the prefetcher's last load (used or not) completes
        for p in range(pf_n):
            pilot_free = max(pilot_free, pf_ready[pf_list[p]])
            pf_ready[pf_list[p]] = np.inf
        n_jobs, end = 0, resident
        if k > 0:
            _weight_jobs(li, k, miss_e, miss_top, miss_ready, lay, pol, wlen, new_job)
            n_jobs = _plan_reads(i, li, k, miss_e, miss_top, miss_first, miss_ready, lay, pol, out, wlen, new_job,
                                 sbytes, wjob, sjob, job_read, job_tail, r_addr, r_len, r_warm)
            _reader_pool(n_jobs, pol.workers, job_read, job_tail, r_addr, r_len, r_warm, dev,
                         out.member_bytes, out.member_requests, out.residence, job_done,
                         wfree, wjob_of, wpos, mfree, sfree, host, pieces, nbytes)
            end = _compute_thread(i, li, k, miss_e, miss_top, miss_comp, miss_first, miss_ready, resident, lay, dev,
                                  wlen, sbytes, wjob, sjob, job_done, out)
        if pol.prefetch == 0:
            for m in range(dev.members):
                mfree[m], sfree[m] = 0.0, 0.0
            host[0], host[1] = 0.0, 0.0
            continue
        # the prefetcher starts once this layer's demand loads, and its own previous load, are done
        start = pilot_free
        for j in range(n_jobs):
            start = max(start, job_done[j])
        next_at = end + pol.dense_seconds      # the next layer is routed then: later loads are dropped
        pf_n = 0
        if i + 1 < I and inst_fwd[i + 1] == inst_fwd[i] and inst_li[i + 1] == li + 1:
            lru_start(lru, li + 1, inst_session[i])
            pf_n = _prefetch(i, li + 1, inst_session[i], start, next_at, sel_start, sel_e, sel_mult, targets, counts,
                             score, touched, seen, pinned, lru, lay, pol, dev, out, pf_ready, pf_bytes, pf_list,
                             r_addr, r_len, r_warm, mfree, sfree, host, pieces, nbytes)
            pf_for = i + 1
        for m in range(dev.members):           # the drives' state, in the next instance's clock
            mfree[m], sfree[m] = max(mfree[m] - next_at, 0.0), max(sfree[m] - next_at, 0.0)
        host[0], host[1] = max(host[0] - next_at, 0.0), max(host[1] - next_at, 0.0)


@njit(**HELPER)
def _select(i, li, sel_start, sel_e, sel_mult, session, seen, pinned, lru, lay, out, pf_ready, pf_bytes, pf_list, pf_n,
            miss_e, miss_top, miss_comp, miss_first, miss_ready, missed):
    """Serve instance ``i``'s union from the RAM tiers; list its misses in issue order.

    An expert is served by the pinned store, then the layer's LRU, then (with no LRU) a prefetch
    that completed before routing; a prefetch still in flight makes a miss that waits for it
    instead of reading. The misses then enter the LRU. Counts the union, hits, matmul time and the
    prefetch metrics. Returns the number of misses and the compute on resident work (s): the
    matmuls of experts in RAM and the top parts of missing experts whose top segment is resident.
    """
    rank, seconds, ebytes, top_resident = lay.rank[li], lay.seconds[li], lay.ebytes[li], lay.top_resident[li]
    top_fraction = lay.top_fraction[li]
    layer_seen, layer_pinned = seen[li], pinned[li]
    no_cache = lru.capacity[li] <= 0
    k, hits, n_missed = 0, 0, 0
    union_bytes, matmul, on_hits, on_tops = 0.0, 0.0, 0.0, 0.0
    for j in range(sel_start[i], sel_start[i + 1]):
        e = sel_e[j]
        comp = seconds[e] * sel_mult[j]
        union_bytes += ebytes[e]
        matmul += comp
        first = layer_seen[e] != session
        layer_seen[e] = session
        if layer_pinned[e]:
            hits += 1
            on_hits += comp
            continue
        prefetched = pf_ready[e] < np.inf
        if prefetched or not lru.cached[li, e]:
            out.pf_required[i] += ebytes[e]
        if lru_touch(lru, li, e) or (no_cache and prefetched and pf_ready[e] <= 0):
            hits += 1
            on_hits += comp
            if prefetched:
                out.pf_timely[i] += pf_bytes[e]
                out.pf_timely_n[i] += 1
                out.pf_slack[i] += -pf_ready[e]
            continue
        missed[n_missed] = e
        n_missed += 1
        if top_resident[e]:
            on_tops += comp * top_fraction
        q = k                                    # insert by physical place
        while q > 0 and rank[miss_e[q - 1]] > rank[e]:
            miss_e[q], miss_top[q], miss_comp[q] = miss_e[q - 1], miss_top[q - 1], miss_comp[q - 1]
            miss_first[q], miss_ready[q] = miss_first[q - 1], miss_ready[q - 1]
            q -= 1
        miss_e[q], miss_top[q], miss_comp[q], miss_first[q] = e, top_resident[e], comp, first
        miss_ready[q] = pf_ready[e] if prefetched and pf_ready[e] > 0 else -1.0
        k += 1
    for m in range(n_missed):
        lru_add(lru, li, missed[m])
    for p in range(pf_n):                        # prefetched, not selected: wasted (an LRU keeps them)
        e = pf_list[p]
        if not _selected(e, sel_e, sel_start[i], sel_start[i + 1]):
            out.pf_unused[i] += pf_bytes[e]
            if pf_ready[e] > 0:
                lru_add(lru, li, e)
    out.hits[i] = hits
    out.union_experts[i] = sel_start[i + 1] - sel_start[i]
    out.union_bytes[i] = union_bytes
    out.matmul[i] = matmul
    out.misses[i] = k
    return k, on_hits + on_tops


@njit(**HELPER)
def _selected(e, sel_e, a, b):
    for j in range(a, b):
        if sel_e[j] == e:
            return True
    return False


@njit(**HELPER)
def _one_extent(adjacent, e, top):
    """An expert's weights are read as one extent: byte-adjacent, or only its bottom segment."""
    return adjacent[e] or top


@njit(**HELPER)
def _weight_jobs(li, k, miss_e, miss_top, miss_ready, lay, pol, wlen, new_job):
    """Weight bytes per miss, and which misses start a new weight job.

    Without coalescing every miss is a job. With it, runs of one-extent experts contiguous in one
    file (gap <= ``gap_bytes``) share a job, cut every ``span_bytes`` from the run's start. A miss
    whose prefetch is in flight is no job and ends a run.
    """
    adjacent, wbytes, pos_file, pos_off = lay.adjacent[li], lay.wbytes[li], lay.pos_file[li], lay.pos_off[li]
    keep_top = 1.0 - lay.top_fraction[li]
    run_start = 0
    prev_chunk = -1
    for p in range(k):
        e = miss_e[p]
        wlen[p] = np.int64(np.ceil(wbytes[e] * (keep_top if miss_top[p] else 1.0)))
        start = pos_off[e]
        brk = True
        if pol.coalesce and p > 0 and miss_ready[p] < 0 and miss_ready[p - 1] < 0:
            f = miss_e[p - 1]
            if (_one_extent(adjacent, e, miss_top[p]) and _one_extent(adjacent, f, miss_top[p - 1])
                    and pos_file[e] == pos_file[f]):
                gap = start - (pos_off[f] + wlen[p - 1])
                brk = not (0 <= gap <= pol.gap_bytes)
        if brk:
            run_start = start
        chunk = (max(start + wlen[p] - run_start, 1) - 1) // pol.span_bytes
        new_job[p] = brk or chunk != prev_chunk
        prev_chunk = chunk


@njit(**HELPER)
def _plan_reads(i, li, k, miss_e, miss_top, miss_first, miss_ready, lay, pol, out, wlen, new_job,
                sbytes, wjob, sjob, job_read, job_tail, r_addr, r_len, r_warm):
    """The reader pool's jobs and their reads, in issue order; returns the number of jobs.

    A weight job of several experts reads their span once; a job of one expert reads its extent,
    or its three weight tensors when they are not adjacent. Each expert's three buffered scale
    preads follow in the same job, or, with coalescing, in a job of their own queued right after,
    so other workers take them. Scales go to the drives only on the expert's first access in the
    session; otherwise they, like warm weight reads, cost memory time at the end of their job. A
    job left with no drive read keeps one empty warm read to carry it. Reads and bytes read
    (O_DIRECT-widened weights, whole scales) are counted into ``out``.
    """
    adjacent, pos_file, pos_off, wloc = lay.adjacent[li], lay.pos_file[li], lay.pos_off[li], lay.wloc[li]
    sloc, bases = lay.sloc[li], lay.bases
    keep_top = 1.0 - lay.top_fraction[li]
    n_jobs, n_reads = 0, 0
    n_weight, read_bytes = 0, 0
    p = 0
    while p < k:
        q = p + 1
        while q < k and not new_job[q]:
            q += 1
        e = miss_e[p]
        if miss_ready[p] >= 0:                   # its prefetch is in flight: nothing to read
            wjob[p], sjob[p], sbytes[p] = -1, -1, 0
            p = q
            continue
        job = n_jobs
        n_jobs += 1
        job_read[job] = n_reads
        wtail = 0.0
        three = q - p == 1 and not _one_extent(adjacent, e, miss_top[p])
        for t in range(3 if three else 1):
            if three:
                file, off, n = wloc[e, t, 0], wloc[e, t, 1], wloc[e, t, 2]
            else:   # the span of a merged job, or one expert's extent
                file, off, n = pos_file[e], pos_off[e], pos_off[miss_e[q - 1]] + wlen[q - 1] - pos_off[e]
            n_reads, wtail, n = _weight_read(file, off, n, bases, pol, n_reads, wtail, r_addr, r_len, r_warm)
            n_weight += 1
            read_bytes += n
        if pol.coalesce:
            job_tail[job] = wtail
            n_reads = _close_job(job, job_read, n_reads, r_addr, r_len, r_warm)
        for r in range(p, q):
            wjob[r] = job
            if pol.coalesce:
                job = n_jobs
                n_jobs += 1
                job_read[job] = n_reads
            sjob[r] = job
            n_reads, stail, sbytes[r] = _scale_reads(sloc, miss_e[r], keep_top if miss_top[r] else 1.0, miss_first[r],
                                                     bases, n_reads, r_addr, r_len, r_warm)
            read_bytes += sbytes[r]
            n_weight += 3
            job_tail[job] = stail if pol.coalesce else stail + wtail
            n_reads = _close_job(job, job_read, n_reads, r_addr, r_len, r_warm)
        p = q
    job_read[n_jobs] = n_reads
    out.reads[i] = n_weight
    out.read_bytes[i] = read_bytes
    return n_jobs


@njit(**HELPER)
def _weight_read(file, off, n, bases, pol, n_reads, wtail, r_addr, r_len, r_warm):
    """Queue one weight read of ``n`` bytes at ``off`` in ``file`` (O_DIRECT widens it); a warm one
    adds its memory time to ``wtail`` instead. Returns the new read count, tail (s) and bytes read."""
    addr = bases[file] + off
    if pol.direct:
        end = -(-(addr + n) // pol.alignment) * pol.alignment
        addr = addr // pol.alignment * pol.alignment
        n = end - addr
    if pol.warm_fraction > 0 and (file * 1_000_003 + off // 4096) % WARM_BUCKETS < pol.warm_fraction * WARM_BUCKETS:
        return n_reads, wtail + n / MEMORY_BANDWIDTH, n
    r_addr[n_reads], r_len[n_reads], r_warm[n_reads] = addr, n, False
    return n_reads + 1, wtail, n


@njit(**HELPER)
def _scale_reads(sloc, e, keep, first, bases, n_reads, r_addr, r_len, r_warm):
    """Queue expert ``e``'s three scale preads (extents ``sloc[e]`` [3, (file, offset, bytes)], the
    share ``keep`` of them still to read) if this is its first access in the session.

    Returns the new read count, the page-cache time when they are warm (s), and their bytes.
    """
    total = 0
    for t in range(3):
        n = np.int64(np.ceil(sloc[e, t, 2] * keep))
        total += n
        if first:
            r_addr[n_reads], r_len[n_reads], r_warm[n_reads] = bases[sloc[e, t, 0]] + sloc[e, t, 1], n, False
            n_reads += 1
    return n_reads, 0.0 if first else total / MEMORY_BANDWIDTH, total


@njit(**HELPER)
def _close_job(job, job_read, n_reads, r_addr, r_len, r_warm):
    """Give a job with no drive read one empty warm read, so the pool still runs it."""
    if n_reads == job_read[job]:
        r_addr[n_reads], r_len[n_reads], r_warm[n_reads] = 0, 0, True
        n_reads += 1
    return n_reads


@njit(**HELPER)
def _reader_pool(n_jobs, workers, job_read, job_tail, r_addr, r_len, r_warm, dev, member_bytes, member_requests, residence,
                 job_done, wfree, wjob, wpos, mfree, sfree, host, pieces, nbytes):
    """Event-ordered reader pool: ``job_done`` [n_jobs] gets each job's completion time (s).

    Workers take jobs in issue order and run each job's reads one after another; at every step the
    worker that is free earliest (lowest index on ties) issues its next read, so reads reach the
    drives in time order. The drives' state (``mfree``, ``sfree``, ``host``) is the caller's.
    """
    W = min(workers, n_jobs)
    for w in range(W):
        wfree[w], wjob[w], wpos[w] = 0.0, -1, 0
    next_job = 0
    while True:
        w, t = -1, np.inf
        for v in range(W):
            if (wjob[v] >= 0 or next_job < n_jobs) and wfree[v] < t:
                w, t = v, wfree[v]
        if w < 0:
            return
        if wjob[w] < 0:
            wjob[w], wpos[w] = next_job, 0
            next_job += 1
        job = wjob[w]
        r = job_read[job] + wpos[w]
        done = _serve_read(r_addr[r], r_len[r], r_warm[r], t, dev, member_bytes, member_requests, residence, mfree, sfree, host, pieces, nbytes)
        wpos[w] += 1
        if r + 1 == job_read[job + 1]:
            done += job_tail[job]
            job_done[job] = done
            wjob[w] = -1
        wfree[w] = done


@njit(**HELPER)
def _serve_read(addr, n, warm, t, dev, member_bytes, member_requests, residence, mfree, sfree, host, pieces, nbytes):
    """Serve one read issued at ``t`` (s); returns its completion time (s).

    The read is split over the members. A member overlaps the per-request cost of up to
    ``queue_slots`` requests but transfers large reads one at a time; small reads (up to
    ``SMALL_READ_BYTES``) queue among themselves beside the large ones and delay them by their own
    transfer time. The host link (``host``: large, small channel free times) caps the aggregate
    rate the same way. A warm read costs memory time only.
    """
    if warm:
        return t + n / MEMORY_BANDWIDTH
    split_read(addr, n, dev.members, dev.chunk, dev.rule, pieces, nbytes)
    small = n <= SMALL_READ_BYTES
    done = -np.inf
    for m in range(dev.members):
        member_bytes[m] += nbytes[m]
        member_requests[m] += pieces[m]
        if nbytes[m] > 0:
            xfer = nbytes[m] / dev.bandwidth
            ready = t + dev.request_seconds * np.ceil(pieces[m] / dev.queue_slots)
            mdone = max(ready, sfree[m] if small else mfree[m]) + xfer
            residence[m] += mdone - t
            if small:
                mfree[m] += xfer
                sfree[m] = mdone
            else:
                mfree[m] = mdone
            done = max(done, mdone)
    xfer = n / dev.host_bandwidth
    if small:
        hdone = max(host[1], t) + xfer
        host[0] += xfer
        host[1] = hdone
    else:
        hdone = max(host[0], t) + xfer
        host[0] = hdone
    return max(done, hdone)


@njit(**HELPER)
def _compute_thread(i, li, k, miss_e, miss_top, miss_comp, miss_first, miss_ready, resident, lay, dev, wlen, sbytes,
                    wjob, sjob, job_done, out):
    """The compute thread runs resident work, then, in issue order, waits for each missing expert
    and runs its matmul (only the bottom part when its top is resident). Stall is the time it
    waits, on that critical path. The oracle's thread does the same with bytes streaming at the
    array's full bandwidth with no per-request cost. Returns when the layer's compute ends (s)."""
    expert_wait = out.expert_wait[li]
    keep_top = 1 - lay.top_fraction[li]
    ebytes = lay.ebytes[li]
    t = resident
    t_oracle = resident
    stall, oracle, streamed = 0.0, 0.0, 0.0
    for p in range(k):
        comp = miss_comp[p] * keep_top if miss_top[p] else miss_comp[p]
        if miss_ready[p] >= 0:                   # a prefetch in flight
            ready = miss_ready[p]
            if ready <= t:
                out.pf_timely[i] += ebytes[miss_e[p]]
                out.pf_timely_n[i] += 1
                out.pf_slack[i] += t - ready
        else:
            ready = max(job_done[wjob[p]], job_done[sjob[p]])
            if ready <= t:                       # a demand load that finished before it was needed
                out.pf_timely[i] += ebytes[miss_e[p]]
        wait = max(ready - t, 0.0)
        t = t + wait + comp
        stall += wait
        expert_wait[miss_e[p]] += wait
        streamed += wlen[p] + (sbytes[p] if miss_first[p] else 0)
        wait = max(streamed / dev.full_bandwidth - t_oracle, 0.0)
        t_oracle = t_oracle + wait + comp
        oracle += wait
    out.stall[i] = stall
    out.oracle[i] = oracle
    return t


@njit(**HELPER)
def _prefetch(i, li, session, start, deadline, sel_start, sel_e, sel_mult, targets, counts, score, touched, seen, pinned,
              lru, lay, pol, dev,
              out, pf_ready, pf_bytes, pf_list, r_addr, r_len, r_warm, mfree, sfree, host, pieces, nbytes):
    """The prefetcher's loads for layer ``li``, the next one, while instance ``i`` runs.

    It predicts up to K experts (:func:`replay.prefetch.predict_next`), skips those already in
    RAM, and loads the rest one at a time, best first, from ``start`` (this layer's demand loads
    done) until ``deadline`` (the next layer is routed): a load not started by then is dropped,
    one in flight completes. A load reads the expert's weights and, on its first access in the
    session, its scales; it enters the LRU when it completes before the deadline. Records each
    expert's ready time in the next instance's clock and returns how many were loaded.
    """
    n = predict_next(pol.prefetch, i, li - 1, sel_start, sel_e, sel_mult, targets, counts, pol.prefetch_experts, score,
                     touched, pf_list)
    adjacent, pos_file, pos_off, wloc = lay.adjacent[li], lay.pos_file[li], lay.pos_off[li], lay.wloc[li]
    sloc, bases, wbytes = lay.sloc[li], lay.bases, lay.wbytes[li]
    keep_top = 1.0 - lay.top_fraction[li]
    t = start
    loaded = 0
    for p in range(n):
        e = pf_list[p]
        if pinned[li, e] or lru.cached[li, e]:
            continue
        if t >= deadline:
            break
        top = lay.top_resident[li, e]
        n_reads, tail, total = 0, 0.0, 0
        if _one_extent(adjacent, e, top):
            n_reads, tail, nb = _weight_read(pos_file[e], pos_off[e], np.int64(np.ceil(wbytes[e] * (keep_top if top else 1.0))),
                                             bases, pol, n_reads, tail, r_addr, r_len, r_warm)
            total += nb
        else:
            for x in range(3):
                n_reads, tail, nb = _weight_read(wloc[e, x, 0], wloc[e, x, 1], wloc[e, x, 2], bases, pol, n_reads, tail,
                                                 r_addr, r_len, r_warm)
                total += nb
        n_reads, stail, sb = _scale_reads(sloc, e, keep_top if top else 1.0, seen[li, e] != session, bases, n_reads,
                                          r_addr, r_len, r_warm)
        seen[li, e] = session
        out.reads[i] += (1 if _one_extent(adjacent, e, top) else 3) + 3
        out.read_bytes[i] += total + sb
        for r in range(n_reads):
            t = _serve_read(r_addr[r], r_len[r], r_warm[r], t, dev, out.member_bytes, out.member_requests,
                            out.residence, mfree, sfree, host, pieces, nbytes)
        t += tail + stail
        pf_ready[e] = t - deadline
        pf_bytes[e] = lay.ebytes[li, e]
        out.pf_loads[i] += 1
        out.pf_bytes[i] += pf_bytes[e]
        pf_list[loaded] = e
        loaded += 1
        if t <= deadline:
            lru_add(lru, li, e)
    return loaded
