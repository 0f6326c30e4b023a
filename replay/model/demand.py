"""The demand path of one instance in the compiled model: misses, their reads, the compute thread.

:func:`select_misses` serves the instance's batch union from the RAM tiers and lists its misses
in issue order; :func:`plan_reads` turns them into the reader pool's jobs and reads
(:func:`replay.model.readplan.plan_layer`, through the page caches); after the pool has run
(:mod:`replay.model.readers`), :func:`compute_thread` walks the misses as the runtime's compute
thread does and measures the stall on that critical path. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.model.device import copy_seconds
from replay.model.jit import HELPER, STAGE
from replay.model.pagecache import (PAGE_BYTES, buffered_read, cached_pages, cached_read, exact_read, note_settled,
                                    pages_cached, scales_settled)
from replay.model.readplan import SCALE, WEIGHT, Coalescing, layer_place, plan_layer
from replay.model.runtime import lru_add, lru_touch
from replay.model.state import PILOT_FIRST, PILOT_NEXT, WARM_BUCKETS


@njit(**STAGE)
def select_misses(i, li, x, work, pf_n, out):
    """Serve instance ``i``'s union from the RAM tiers; list its misses in issue order in ``miss``.

    An expert is served by the pinned store, then the layer's LRU, then (with no LRU) a prefetch
    that completed before routing; a prefetch still in flight makes a miss that waits for it
    instead of reading. The misses then enter the LRU in issue (physical) order, the order their
    loads complete in and the harness (:mod:`replay.physical.measure`) inserts them in. Under
    ``pol.routing_order`` the union is met in routing order (``inst.sel_order``), the misses are
    listed in that order with the resident work routed before each (``miss.pre``), and, as
    colibrì promotes its loaded slabs, the last ``min(k, cap)`` misses enter the LRU, the last
    one first. Counts the union, hits, compute time (dense and
    matmuls) and the prefetch metrics. Returns the number of misses and the compute on resident work (s): the
    matmuls of experts in RAM and the top parts of missing experts whose top segment is resident.
    ``x``: :class:`replay.model.state.Inputs`; ``work``: :class:`replay.model.state.Work`.
    """
    inst, ram, lay, pol = x.inst, x.ram, x.lay, x.pol
    pending, miss = work.pending, work.miss
    sel_e, sel_mult, a, b = inst.sel_e, inst.sel_mult, inst.sel_start[i], inst.sel_start[i + 1]
    lru = ram.lru
    rank, seconds, ebytes, top_resident = lay.rank[li], lay.seconds[li], lay.ebytes[li], lay.top_resident[li]
    top_fraction = lay.top_fraction[li]
    layer_pinned = ram.pinned[li]
    pf_ready, pf_bytes = pending.ready, pending.nbytes
    miss_e, miss_top, miss_comp, miss_ready = miss.expert, miss.top, miss.comp, miss.ready
    res, pf = out.instance, out.prefetch
    no_cache = lru.capacity[li] <= 0
    routed = pol.routing_order
    k, hits = 0, 0
    union_bytes, matmul, on_hits, on_tops, pre = 0.0, 0.0, 0.0, 0.0, 0.0
    for r in range(a, b):
        j = inst.sel_order[r] if routed else r
        e = sel_e[j]
        comp = seconds[e] * sel_mult[j]
        union_bytes += ebytes[e]
        matmul += comp
        if layer_pinned[e]:
            hits += 1
            on_hits += comp
            pre += comp
            continue
        prefetched = pf_ready[e] < np.inf
        if prefetched or not lru.cached[li, e]:
            pf.required[i] += ebytes[e]
        if lru_touch(lru, li, e) or (no_cache and prefetched and pf_ready[e] <= 0):
            hits += 1
            on_hits += comp
            pre += comp
            if prefetched:
                pf.timely[i] += pf_bytes[e]
                pf.timely_n[i] += 1
                pf.slack[i] += -pf_ready[e]
            continue
        if top_resident[e]:
            on_tops += comp * top_fraction
            pre += comp * top_fraction
        q = k                                    # insert by physical place (in routing order: append)
        while not routed and q > 0 and rank[miss_e[q - 1]] > rank[e]:
            miss_e[q], miss_top[q], miss_comp[q] = miss_e[q - 1], miss_top[q - 1], miss_comp[q - 1]
            miss_ready[q] = miss_ready[q - 1]
            q -= 1
        miss_e[q], miss_top[q], miss_comp[q] = e, top_resident[e], comp
        miss_ready[q] = pf_ready[e] if prefetched and pf_ready[e] > 0 else -1.0
        if routed:
            miss.pre[q] = pre
            pre = 0.0
        k += 1
    if routed:                                   # colibrì's promotion: the last min(k, cap) misses, the last one first
        for m in range(min(k, lru.capacity[li])):
            lru_add(lru, li, miss_e[k - 1 - m])
    else:
        for m in range(k):                       # in issue order, as their loads complete and the runtime stamps them
            lru_add(lru, li, miss_e[m])
    for p in range(pf_n):                        # prefetched, not selected: wasted (an LRU keeps them)
        e = pending.experts[p]
        if not is_selected(e, sel_e, a, b):
            pf.unused[i] += pf_bytes[e]
            if pf_ready[e] > 0 and not pol.layer_barrier:    # in flight: it enters once loaded (with the barrier, it did)
                lru_add(lru, li, e)
    res.hits[i] = hits
    res.union_experts[i] = b - a
    res.union_bytes[i] = union_bytes
    res.compute[i] = pol.dense_seconds + matmul
    res.misses[i] = k
    return k, on_hits + on_tops


@njit(**HELPER)
def is_selected(e, sel_e, a, b):
    for j in range(a, b):
        if sel_e[j] == e:
            return True
    return False


@njit(**STAGE)
def plan_reads(i, li, k, x, work, res):
    """The reader pool's jobs and their reads, in issue order, as :func:`replay.model.readplan.plan_layer`
    plans them (the harness executes the same plan); returns the number of jobs.

    Fills ``miss.wlen``, ``miss.sbytes``, ``miss.first`` and the jobs carrying each miss's
    weights and scales (``miss.wjob``, ``miss.sjob``; -1 for a miss whose prefetch is in
    flight). Weight reads are O_DIRECT-widened here. A scale pread goes to the drive when the page
    cache ``pages`` cannot serve it (:func:`replay.model.pagecache.buffered_read`, in issue order), as
    one read of the pages the kernel's readahead reads for it; otherwise it, like a warm weight
    read, costs memory time at the end of its job. A job left with no drive read keeps one empty
    warm read to carry it. When the page cache tracks weights, a buffered weight read goes
    through it too (:func:`paged_weight_read`); ``miss.cached``: every page of the miss's weight
    reads was cached when planned. Reads, the reads that reach the drives, and bytes read
    (O_DIRECT-widened weights, whole scales) go into ``res`` (the instance outputs).
    """
    lay, pol, dev, pages = x.lay, x.pol, x.dev, x.ram.pages
    paged = pages.weights[0] > 0
    miss, plan, jobs, reads = work.miss, work.plan, work.jobs, work.reads
    miss_e, wjob, sjob, sbytes, skip = miss.expert, miss.wjob, miss.sjob, miss.sbytes, miss.skip
    for p in range(k):
        skip[p] = miss.ready[p] >= 0
        wjob[p], sjob[p], sbytes[p], miss.first[p] = -1, -1, 0, False
        miss.cached[p] = not skip[p] and paged
    n_plan, n_jobs = plan_layer(miss_e, k, skip, miss.top, layer_place(lay, li),
                                Coalescing(pol.coalesce, pol.gap_bytes, pol.span_bytes), miss.wlen, plan)
    bases = lay.bases
    job_read, job_tail = jobs.first_read, jobs.tail
    n_reads, read_bytes, drive_reads = 0, 0, 0
    job, wtail, scale_tail = -1, 0.0, 0.0
    settled = False
    for r in range(n_plan):
        if plan.job[r] != job:
            if job >= 0:
                job_tail[job] = wtail + scale_tail
                n_reads = close_job(job, job_read, n_reads, reads)
            job = plan.job[r]
            job_read[job] = n_reads
            wtail, scale_tail = 0.0, 0.0
        f, n, a = plan.file[r], plan.length[r], plan.first[r]
        if plan.kind[r] == WEIGHT:
            queued = n_reads
            if paged:
                hit = pages_cached(pages, f, plan.offset[r], n)
                for m in range(a, plan.last[r] + 1):
                    miss.cached[m] = miss.cached[m] and hit
                n_reads, wtail = paged_weight_read(f, plan.offset[r], n, pages, dev, bases, n_reads, wtail, reads)
            else:
                n_reads, wtail, n = weight_read(f, plan.offset[r], n, bases, pol, dev, n_reads, wtail, reads)
            drive_reads += n_reads - queued
            for m in range(a, plan.last[r] + 1):
                wjob[m] = job
        else:
            sjob[a] = job
            if sbytes[a] == 0:                   # its first scale read
                settled = scales_settled(pages, li, miss_e[a])
            sbytes[a] += n
            n_reads, queued = scale_read(f, plan.offset[r], n, settled, pages, bases, n_reads, reads)
            if not settled and (r + 1 == n_plan or plan.first[r + 1] != a or plan.kind[r + 1] != SCALE):
                note_settled(pages, li, miss_e[a], lay.sloc[li, miss_e[a]])
            if queued:
                drive_reads += 1
                miss.first[a] = True
            else:
                scale_tail += copy_seconds(n, plan.offset[r], dev)
        read_bytes += n
    if job >= 0:
        job_tail[job] = wtail + scale_tail
        n_reads = close_job(job, job_read, n_reads, reads)
    job_read[n_jobs] = n_reads
    res.reads[i] = n_plan
    res.drive_reads[i] = drive_reads
    res.read_bytes[i] = read_bytes
    return n_jobs


@njit(**HELPER)
def weight_read(file, off, n, bases, pol, dev, n_reads, wtail, reads):
    """Queue one weight read of ``n`` bytes at ``off`` in ``file`` (O_DIRECT widens it); a warm one
    adds its copy time (:func:`replay.model.device.copy_seconds` on the device ``dev``) to ``wtail``
    instead. Returns the new read count, tail (s) and bytes read."""
    addr = bases[file] + off
    if pol.direct:
        end = -(-(addr + n) // pol.alignment) * pol.alignment
        addr = addr // pol.alignment * pol.alignment
        n = end - addr
    if pol.warm_fraction > 0 and (file * 1_000_003 + off // 4096) % WARM_BUCKETS < pol.warm_fraction * WARM_BUCKETS:
        return n_reads, wtail + copy_seconds(n, addr, dev), n
    reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = addr, n, False
    return n_reads + 1, wtail, n


@njit(**HELPER)
def paged_weight_read(file, off, n, pages, dev, bases, n_reads, wtail, reads):
    """One weight read of ``n`` bytes at ``off`` in ``file`` through the page cache ``pages``:
    a buffered pread (:func:`replay.model.pagecache.buffered_read`, with the kernel's readahead)
    or, when its weights are mapped views (``pages.weights`` 2, colibrì's COLI_MMAP=1), a touch
    of mapped pages after ``MADV_WILLNEED`` (:func:`replay.model.pagecache.exact_read`).
    The pages it waits for from the drive make one drive read; the pages the cache held cost
    their copy time (added to ``wtail``). Returns the new read count and tail (s)."""
    warm = cached_pages(pages, file, off, n)
    if pages.weights[0] == 2:
        waited, page = exact_read(pages, file, off, n)
    else:
        waited, page = buffered_read(pages, file, off, n)
    if warm:
        wtail += copy_seconds(min(warm * PAGE_BYTES, n), off, dev)
    return queue_pages(file, page, waited, bases, n_reads, reads), wtail


@njit(**HELPER)
def queue_pages(file, page, count, bases, n_reads, reads):
    """Queue the drive read of ``count`` pages of ``file`` from ``page`` on (what a page-cache
    read waited for; none when ``count`` is 0). Returns the new read count."""
    if count == 0:
        return n_reads
    reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = bases[file] + page * PAGE_BYTES, count * PAGE_BYTES, False
    return n_reads + 1


@njit(**HELPER)
def scale_read(file, off, n, settled, pages, bases, n_reads, reads):
    """Queue one buffered scale pread of ``n`` bytes at ``off`` in ``file`` when the page cache
    ``pages`` cannot serve it (:func:`replay.model.pagecache.buffered_read`; ``settled``: the expert's
    scale pages are all cached, :func:`replay.model.pagecache.cached_read`), as one drive read of the
    pages the kernel reads for it. Returns the new read count and whether it queued one."""
    if settled:
        cached_read(pages, file, off, n)
        return n_reads, False
    waited, page = buffered_read(pages, file, off, n)
    return queue_pages(file, page, waited, bases, n_reads, reads), waited > 0


@njit(**HELPER)
def close_job(job, job_read, n_reads, reads):
    """Give a job with no drive read one empty warm read, so the pool still runs it."""
    if n_reads == job_read[job]:
        reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = 0, 0, True
        n_reads += 1
    return n_reads


@njit(**STAGE)
def compute_thread(i, li, k, resident, n_jobs, x, work, out):
    """The compute thread runs resident work, then, in issue order, waits for each missing expert
    and runs its matmul (only the bottom part when its top is resident). Stall is the time it
    waits, on that critical path. The oracle's thread does the same with bytes streaming at the
    array's full bandwidth with no per-request cost, page-cache hits free
    (:func:`_oracle_seconds`). Returns when the layer's compute ends (s).

    When copies are bounded by the machine's ``C`` cores (``RuntimeConfig.cpu_cores``, an engine
    configuration), the matmuls run on an OpenMP team as wide as the machine, so they and the
    ``n_jobs`` demand jobs' page-cache copies (``jobs.tail``) share the cores: the layer ends no
    earlier than its compute time plus its copies' time over the cores they can have, and the
    compute thread waits for the difference at its last miss (:func:`_shared_cores`).

    Under ``pol.routing_order`` it runs the union in routing order instead: before each miss the
    resident work routed before it (``miss.pre``), the rest after the last miss. Under
    ``pol.blocking`` (colibrì's PIPE=0) it first waits until every miss has arrived (the whole
    wait is charged to the miss that arrived last), then runs all the layer's matmuls; its oracle
    waits for all the bytes streamed at full bandwidth (:func:`_oracle_seconds`)."""
    lay, pol, dev, miss, jobs = x.lay, x.pol, x.dev, work.miss, work.jobs
    if pol.blocking:
        return _blocked_compute(i, li, k, resident, x, work, out)
    res, pf = out.instance, out.prefetch
    expert_wait = res.expert_wait[li]
    miss_e, miss_comp, miss_ready, job_done = miss.expert, miss.comp, miss.ready, jobs.done
    keep_top = 1 - lay.top_fraction[li]
    ebytes = lay.ebytes[li]
    routed = pol.routing_order
    t = 0.0 if routed else resident
    t_oracle = t
    done_pre = 0.0
    stall, oracle, streamed = 0.0, 0.0, 0.0
    for p in range(k):
        if routed:
            t += miss.pre[p]
            t_oracle += miss.pre[p]
            done_pre += miss.pre[p]
        comp = miss_comp[p] * keep_top if miss.top[p] else miss_comp[p]
        if miss_ready[p] >= 0:                   # a prefetch in flight
            ready = miss_ready[p]
            if ready <= t:
                pf.timely[i] += ebytes[miss_e[p]]
                pf.timely_n[i] += 1
                pf.slack[i] += t - ready
        else:
            ready = max(job_done[miss.wjob[p]], job_done[miss.sjob[p]])
            if ready <= t:                       # a demand load that finished before it was needed
                pf.timely[i] += ebytes[miss_e[p]]
        wait = max(ready - t, 0.0)
        miss.wait[p] = wait
        t = t + wait + comp
        stall += wait
        expert_wait[miss_e[p]] += wait
        streamed += _oracle_seconds(miss, p, dev)
        wait = max(streamed - t_oracle, 0.0)
        t_oracle = t_oracle + wait + comp
        oracle += wait
    if routed:
        t += max(resident - done_pre, 0.0)
    extra = _shared_cores(t, resident, k, n_jobs, keep_top, pol.team_held_cores, pol.copy_cores, pol.handoff, work)
    if extra > 0.0:
        miss.wait[k - 1] += extra
        expert_wait[miss_e[k - 1]] += extra
        stall += extra
        t += extra
    res.stall[i] = stall
    res.oracle_stall[i] = oracle
    return t


@njit(**HELPER)
def _shared_cores(end, resident, k, n_jobs, keep_top, held, cores, handoff, work):
    """How much later than ``end`` (s) a layer's compute ends because its matmuls and its demand
    jobs' page-cache copies share the machine's cores (:func:`compute_thread`); 0 when copies are
    not bounded by cores.

    ``busy`` is the layer's compute (``resident`` and every miss's matmul, s), ``copies`` its
    copies' time on one core (s: its demand jobs', and the prefetch thread's loads completed
    while its demand jobs ran, which take the same cores) and ``cores`` the cores copies may use
    (``RuntimeConfig.copy_cores``: the machine's less the ``held`` the OpenMP team keeps,
    ``RuntimeConfig.team_held_cores``). When the team keeps none, the matmuls and the copies
    share all the cores: the layer ends no earlier than ``busy + copies / cores``. When it keeps
    some, the compute thread's matmuls take one of the ``cores`` while it computes, so the copies
    get ``cores - 1`` then and ``cores`` while it waits: the layer ends no earlier than ``busy +
    max(copies - (cores - 1) busy, 0) / cores`` (with one core: the matmuls, then the copies).
    Fewer copying threads than cores (``RuntimeConfig.copy_threads``) bound the copies' own
    timing (the copy slots), not this. The loader pool's ``handoff`` (s, once for the block)
    counts as copy time: its wake-ups run on the cores the copies take.
    """
    if cores == 0:
        return 0.0
    miss, jobs = work.miss, work.jobs
    busy = resident
    for p in range(k):
        busy += miss.comp[p] * keep_top if miss.top[p] else miss.comp[p]
    copies = handoff if n_jobs > 0 else 0.0
    for j in range(n_jobs):
        copies += jobs.tail[j]
    pilot = work.pilot
    for j in range(pilot.state[PILOT_FIRST], pilot.state[PILOT_NEXT]):   # the prefetch threads', done by now
        if not _under_way(pilot.job, j):
            copies += jobs.tail[j]
    if held == 0:
        return max(busy + copies / cores - end, 0.0)
    return max(busy + max(copies - (cores - 1) * busy, 0.0) / cores - end, 0.0)


@njit(**HELPER)
def _under_way(threads, job):
    """Whether a prefetch thread (``threads``: each one's job under way, -1 none) has ``job`` under way."""
    for v in range(len(threads)):
        if threads[v] == job:
            return True
    return False


@njit(**HELPER)
def _oracle_seconds(miss, p, dev):
    """The oracle's time for miss ``p``'s bytes from the drives (s): its weights (unless the page
    cache holds them) and its scales read for the first time, at the array's full bandwidth with
    no per-request cost. Weights the page cache serves whole cost the oracle nothing: their
    copies overlap in the read path. Which those are depends on the layout (the readahead of a
    neighbour's read may have cached them), so the oracle bounds the stall of this layout's
    replay; a miss partly cached counts all its weight bytes."""
    scales = miss.sbytes[p] if miss.first[p] else 0
    weights = 0 if miss.cached[p] else miss.wlen[p]
    return (weights + scales) / dev.full_bandwidth


@njit(**STAGE)
def _blocked_compute(i, li, k, resident, x, work, out):
    """:func:`compute_thread` under colibrì's PIPE=0: the thread is blocked from routing until
    the last of the layer's ``k`` misses has arrived, then runs the resident work and every
    miss's matmul. Returns when the layer's compute ends (s)."""
    lay, dev, miss, jobs = x.lay, x.dev, work.miss, work.jobs
    res, pf = out.instance, out.prefetch
    miss_e, miss_comp, miss_ready, job_done = miss.expert, miss.comp, miss.ready, jobs.done
    keep_top = 1 - lay.top_fraction[li]
    ebytes = lay.ebytes[li]
    ready_all, last, comps, streamed = 0.0, -1, 0.0, 0.0
    for p in range(k):
        if miss_ready[p] >= 0:                   # a prefetch in flight
            ready = miss_ready[p]
        else:
            ready = max(job_done[miss.wjob[p]], job_done[miss.sjob[p]])
        if ready <= 0.0:
            pf.timely[i] += ebytes[miss_e[p]]
            if miss_ready[p] >= 0:
                pf.timely_n[i] += 1
                pf.slack[i] += -ready
        if last < 0 or ready > ready_all:
            ready_all, last = max(ready, 0.0), p
        miss.wait[p] = 0.0
        comps += miss_comp[p] * keep_top if miss.top[p] else miss_comp[p]
        streamed += _oracle_seconds(miss, p, dev)
    if last >= 0:
        miss.wait[last] = ready_all
        res.expert_wait[li, miss_e[last]] += ready_all
    res.stall[i] = ready_all
    res.oracle_stall[i] = streamed
    return ready_all + resident + comps

