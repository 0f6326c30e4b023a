"""The reader pool and the drives that serve its reads, in the compiled model.

Workers (and the prefetch threads) take one instance's jobs in issue order and issue their reads
in time order (:func:`reader_pool`); each read is split over the array's members and served by
their queues, in order (:func:`serve_read`) or sharing each drive's channel fairly among the reads
in it (:func:`shared_pool`, an event simulation): the queue model and service disciplines of
:mod:`replay.model.device`. What the page cache serves is a copy into the reader's buffer, CPU
work at the device's copy rate per thread (``memory_bandwidth``, or ``unaligned_memory_bandwidth``
for a read that does not start on a cache line: :func:`replay.model.device.copy_seconds`), at most
one per core at once (:func:`copy_done`). The drives' state and the cores' copies are carried between instances in
:class:`replay.model.state.Drives`. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.model.device import copy_seconds, largest_request, split_device
from replay.model.jit import HELPER, STAGE
from replay.model.state import PILOT_END, PILOT_NEXT, SMALL_READ_BYTES


@njit(**STAGE)
def reader_pool(n_jobs, n_workers, start, pool, reads, dev, usage):
    """Event-ordered reader pool: ``jobs.done`` [n_jobs] gets each job's completion time (s).

    Workers take jobs in issue order from ``start`` (s: the prefetch load in flight when the
    layer was routed has completed, as colibrì's ``moe()`` waits for it) and run each job's reads
    one after another; at every step the worker that is free earliest (lowest index on ties)
    issues its next read, so reads reach the drives in time order. After a job's last read the
    worker copies what the page cache served (the job's ``tail``, :func:`copy_done`); when the
    copies are bounded by the cores, that copy takes its core in time order too, as one more
    event of the worker at its reads' end. The prefetch threads
    (``pilot``), when loads were queued at routing, are more such readers with their own jobs
    (:func:`pilot_issuer`): one issues its next read when it is free first (they win ties: their
    loads were queued before the demand loads). Returns once every demand job's completion is
    known; the prefetch threads' remaining reads are :func:`replay.model.prefetching.pilot_rest`'s. The drives' state (``drives``) is the caller's; ``usage``
    (the device outputs) accumulates per member.
    """
    jobs, workers, pilot, drives = pool.jobs, pool.workers, pool.pilot, pool.drives
    job_read, wfree, wjob, wpos = jobs.first_read, workers.free, workers.job, workers.pos
    W = min(n_workers, n_jobs)
    for w in range(W):
        wfree[w], wjob[w], wpos[w] = start, -1, 0
    next_job = 0
    while True:
        w, t = -1, np.inf
        for v in range(W):
            if (wjob[v] >= 0 or next_job < n_jobs) and wfree[v] < t:
                w, t = v, wfree[v]
        if w < 0:
            return
        v, tv = pilot_issuer(pilot, np.inf)
        if v >= 0 and tv <= t:
            pilot_read(jobs, reads, pilot, v, dev, drives, usage)
            continue
        if wjob[w] < 0:
            wjob[w], wpos[w] = next_job, 0
            next_job += 1
        job = wjob[w]
        r = job_read[job] + wpos[w]
        if r == job_read[job + 1]:               # its reads are done: its copies take a core
            done = copy_done(t, jobs.tail[job], drives.copies)
        else:
            done = serve_read(reads.addr[r], reads.length[r], reads.warm[r], t, dev, drives, usage)
            wpos[w] += 1
            if r + 1 < job_read[job + 1] or copy_waits(jobs.tail[job], drives.copies):
                wfree[w] = done
                continue
            done += jobs.tail[job]
        jobs.done[job] = done
        wjob[w] = -1
        wfree[w] = done


@njit(**HELPER)
def pilot_issuer(pilot, deadline):
    """The prefetch thread (``pilot``: :class:`replay.model.state.Pilot`) that issues next: of
    those with a load under way, and, while loads wait in the queue, those free before
    ``deadline`` (s; inf: none), the one free first (lowest index on ties; one with a read in
    flight is free at inf). Returns the thread and its free time (s), or -1 and inf."""
    w, t = -1, np.inf
    queued = pilot.state[PILOT_NEXT] < pilot.state[PILOT_END]
    for v in range(len(pilot.free)):
        f = pilot.free[v]
        if f < t and (pilot.job[v] >= 0 or (queued and f < deadline)):
            w, t = v, f
    return w, t


@njit(**HELPER)
def pilot_job(pilot, v):
    """Prefetch thread ``v``'s job under way, taking the next queued load when it has none."""
    if pilot.job[v] < 0:
        pilot.job[v], pilot.pos[v] = pilot.state[PILOT_NEXT], 0
        pilot.state[PILOT_NEXT] += 1
    return pilot.job[v]


@njit(**HELPER)
def pilot_read(jobs, reads, pilot, v, dev, drives, usage):
    """Prefetch thread ``v`` issues its next read at its free time, taking the next queued load
    when it has none under way; a load's last read, then its page-cache copies (its job's
    ``tail``, :func:`copy_done`: when they wait for a core, as the thread's next step), complete
    the load's job."""
    job, t = pilot_job(pilot, v), pilot.free[v]
    r = jobs.first_read[job] + pilot.pos[v]
    if r == jobs.first_read[job + 1]:            # its reads are done: its copies take a core
        done = copy_done(t, jobs.tail[job], drives.copies)
    else:
        done = serve_read(reads.addr[r], reads.length[r], reads.warm[r], t, dev, drives, usage)
        pilot.pos[v] += 1
        if r + 1 < jobs.first_read[job + 1] or copy_waits(jobs.tail[job], drives.copies):
            pilot.free[v] = done
            return
        done += jobs.tail[job]
    jobs.done[job] = done
    pilot.job[v] = -1
    pilot.free[v] = done


@njit(**HELPER)
def copy_waits(seconds, copies):
    """A copy of ``seconds`` (s) takes one of the cores ``copies`` (their free times, s; empty:
    copies are not bounded), so it is timed as an event of its own, in time order with the reads."""
    return len(copies) > 0 and seconds > 0.0


@njit(**HELPER)
def copy_done(ready, seconds, copies):
    """When a copy of ``seconds`` (s: its bytes over the device's ``memory_bandwidth``), ready at
    ``ready`` (s), is done. Copies are CPU work: with ``copies`` [C] (when each of the machine's
    ``C`` cores frees, s) it takes the core that frees first, from ``max(ready, free)`` on, and
    holds it until done; with none (``C`` = 0, copies not bounded) it starts at ``ready``."""
    if not copy_waits(seconds, copies):
        return ready + seconds
    c = 0
    for q in range(1, len(copies)):
        if copies[q] < copies[c]:
            c = q
    done = max(ready, copies[c]) + seconds
    copies[c] = done
    return done


@njit(**STAGE)
def serve_read(addr, n, warm, t, dev, drives, usage):
    """Serve one read of ``n`` bytes at logical address ``addr`` issued at ``t`` (s); returns its
    completion time (s).

    The read is split over the members; a member's share is ``pieces`` requests, each served as
    :mod:`replay.model.device` states: it takes the queue slot that frees first (at ``t`` or later:
    ``t0``), its ``s`` bytes (the share over ``pieces``) pass the member's data channel at
    ``bandwidth`` after its latency ``request_seconds``, holding it ``c`` more (``channel =
    max(t0 + a, channel) + c + s / B``), and it completes at ``max(t0 + a + r / b_1, channel)``,
    ``r`` the share's largest request (:func:`replay.model.device.largest_request`: the system's split
    is not even, and the requests stream side by side). Small reads (up to ``SMALL_READ_BYTES``) use a channel
    of their own beside the large transfers and delay them by their own channel time. The host
    link (``drives.host``: large, small channel free times) caps the aggregate rate the same way.
    A warm read is a copy from the page cache only (:func:`copy_done`, at
    :func:`replay.model.device.copy_seconds`). Bytes go into
    ``drives.member_bytes``, requests and residence (s) into ``usage``, and the time the read
    keeps the array busy beyond the reads before it (reads arrive in time order) into
    ``usage.busy_seconds``.
    """
    if warm:
        return copy_done(t, copy_seconds(n, addr, dev), drives.copies)
    if dev.shared:
        return _serve_shared(addr, n, t, dev, drives, usage)
    pieces, nbytes, mfree, sfree, host = drives.pieces, drives.nbytes, drives.free, drives.small_free, drives.host
    slots = drives.slots
    split_device(addr, n, dev, pieces, nbytes)
    small = n <= SMALL_READ_BYTES
    Q = dev.queue_slots
    done = -np.inf
    for m in range(dev.members):
        drives.member_bytes[m] += nbytes[m]
        usage.requests[m] += pieces[m]
        if nbytes[m] > 0:
            a = dev.m_request[m]
            size = nbytes[m] / pieces[m]
            xfer = dev.m_channel[m] + size / dev.m_bandwidth[m]
            serve = a + largest_request(nbytes[m], dev.members, dev.chunk, dev.rule, dev.max_request) / dev.m_stream[m]
            chan = sfree[m] if small else mfree[m]
            mdone = t
            for _ in range(pieces[m]):
                t0 = max(slots[m, drives.head[m]], t)     # the slot that frees first
                chan = max(t0 + a, chan) + xfer
                d = max(t0 + serve, chan)
                _take_slot(slots[m], drives.head, m, Q, d)
                mdone = max(mdone, d)
            usage.residence_seconds[m] += mdone - t
            if small:
                mfree[m] += pieces[m] * dev.m_channel[m] + nbytes[m] / dev.m_bandwidth[m]
                sfree[m] = chan
            else:
                mfree[m] = chan
            done = max(done, mdone)
    xfer = n / dev.host_bandwidth
    if small:
        hdone = max(host[1], t) + xfer
        host[0] += xfer
        host[1] = hdone
    else:
        hdone = max(host[0], t) + xfer
        host[0] = hdone
    done = max(done, hdone)
    _count_busy(t, done, drives, usage)
    return done


@njit(**HELPER)
def _serve_shared(addr, n, t, dev, drives, usage):
    """:func:`serve_read` on shared drives (:mod:`replay.model.device`'s service discipline), for a read
    issued on its own: on each member it holds the slot that frees first for the latency ``a``
    (:func:`_command`), and from when it has passed it, and the member's channel is free of the
    reads before it, it takes ``max(r / b_1, p c + s / C)`` for its ``p`` requests of ``s`` bytes
    in all, the largest of ``r`` (:func:`replay.model.device.largest_request`; ``C``:
    :func:`_channel_rate`). Returns its completion time (s)."""
    pieces, nbytes, mfree = drives.pieces, drives.nbytes, drives.free
    split_device(addr, n, dev, pieces, nbytes)
    done = t
    for m in range(dev.members):
        drives.member_bytes[m] += nbytes[m]
        usage.requests[m] += pieces[m]
        if nbytes[m] > 0:
            C = _channel_rate(dev, m)
            entry = _command(m, t, dev, drives)
            big = largest_request(nbytes[m], dev.members, dev.chunk, dev.rule, dev.max_request)
            mdone = max(entry, mfree[m]) + max(big / dev.m_stream[m], pieces[m] * dev.m_channel[m] + nbytes[m] / C)
            mfree[m] = mdone
            usage.residence_seconds[m] += mdone - t
            done = max(done, mdone)
    _count_busy(t, done, drives, usage)
    return done


@njit(**STAGE)
def _count_busy(t, done, drives, usage):
    """The array was busy from ``t`` to ``done`` (s): add to ``usage.busy_seconds`` what the
    periods counted so far (``drives.busy``: until when) do not already cover; periods arrive in
    order of their start."""
    usage.busy_seconds[0] += max(done - max(t, drives.busy[0]), 0.0)
    drives.busy[0] = max(drives.busy[0], done)


@njit(**HELPER)
def _channel_rate(dev, m):
    """Shared member ``m``'s channel rate C (bytes/s): the drive's, or its even share of the host link."""
    return min(dev.m_bandwidth[m], dev.host_bandwidth / dev.members)


@njit(**HELPER)
def _command(m, t, dev, drives):
    """A read issued to shared member ``m`` at ``t`` (s) holds the slot that frees first for the
    latency ``a`` (one command per read, however many requests the system split it into); returns
    when it has passed it (s): the read's bytes enter the channel then."""
    t0 = max(drives.slots[m, drives.head[m]], t)
    _take_slot(drives.slots[m], drives.head, m, dev.queue_slots, t0 + dev.m_request[m])
    return t0 + dev.m_request[m]


@njit(**HELPER)
def shared_pool(n_jobs, n_workers, start, pool, reads, dev, usage):
    """The reader pool (:func:`reader_pool`: the same workers, jobs and prefetch threads) on shared
    drives (:mod:`replay.model.device`'s service discipline), as an event simulation: a read's
    completion depends on the reads issued after it, so it is known only when it happens.

    Events, earliest first (on a tie: a read leaving a channel, then one entering, then an issue):
    an issuer (a worker, or a prefetch thread, :func:`pilot_issuer`, when it is free first)
    issues its next read, which holds a command slot on each member for the latency ``a``
    (:func:`_command`); its bytes there then enter the member's channel; the ``n``
    reads in a channel share its rate ``C`` fairly, each passing ``min(cap, level)`` of its work
    per s (its bytes and its requests' channel time, :func:`_shared_issue`; ``level`` such that
    the rates add up to ``C``, or unbounded when the caps do not reach it:
    :func:`_member_events`); a read completes when its work has left every member's channel,
    its issuer is then free (after its job's page-cache copies, when it was the job's last read;
    when they wait for a core, :func:`copy_done`, they are the issuer's next event).
    Runs until every demand job is done and the prefetch threads' reads in flight, if any, have
    completed (they issue no read after the last demand job: their remaining loads are
    :func:`replay.model.prefetching.pilot_rest`'s). A channel serves nothing before the reads issued before the pool
    have left it (``drives.free``), which then holds when this pool's last read left.
    """
    jobs, workers, pilot, drives, share = pool.jobs, pool.workers, pool.pilot, pool.drives, pool.share
    job_read, wfree, wjob, wpos = jobs.first_read, workers.free, workers.job, workers.pos
    rem, enter = share.rem, share.enter
    W = min(n_workers, n_jobs)
    P = len(share.parts) - len(pilot.free)       # the first prefetch thread's issuer index
    M = dev.members
    for w in range(W):
        wfree[w], wjob[w], wpos[w] = start, -1, 0
    for m in range(M):
        share.clock[m], share.active[m] = max(start, drives.free[m]), 0
        share.last[m] = drives.free[m]
        share.next_done[m], share.next_enter[m] = np.inf, np.inf
        for j in range(rem.shape[1]):
            enter[m, j], rem[m, j] = np.inf, np.inf
    share.busy[0] = 0.0
    next_job, left = 0, n_jobs
    while True:
        tc, mc, te, me = np.inf, -1, np.inf, -1  # the next read to leave a channel, and to enter one
        for m in range(M):
            if share.next_done[m] < tc:
                tc, mc = share.next_done[m], m
            if share.next_enter[m] < te:
                te, me = share.next_enter[m], m
        ti, w = np.inf, -1                       # the next issue
        if left > 0:
            for v in range(W):
                if wfree[v] < ti and (wjob[v] >= 0 or next_job < n_jobs):
                    w, ti = v, wfree[v]
            v, tv = pilot_issuer(pilot, np.inf)
            if v >= 0 and tv <= ti:
                w, ti = P + v, tv
        if tc <= te and tc <= ti:
            if tc == np.inf:
                break
            jc = share.done_by[mc]
            _advance_channel(share, mc, tc)
            rem[mc, jc] = np.inf
            share.active[mc] -= 1
            share.last[mc] = max(share.last[mc], tc)
            usage.residence_seconds[mc] += tc - share.issued[jc]
            _member_events(share, mc, _channel_rate(dev, mc))
            share.parts[jc] -= 1
            if share.parts[jc] == 0:
                left -= _shared_read_done(jc, P, tc, True, pool, usage)
        elif te <= ti:
            je = share.enter_by[me]
            _advance_channel(share, me, te)
            rem[me, je] = share.size[me, je]
            share.active[me] += 1
            enter[me, je] = np.inf
            _member_events(share, me, _channel_rate(dev, me))
        else:
            if w >= P:
                v = w - P
                job = pilot_job(pilot, v)
                r = job_read[job] + pilot.pos[v]
            else:
                if wjob[w] < 0:
                    wjob[w], wpos[w] = next_job, 0
                    next_job += 1
                job = wjob[w]
                r = job_read[job] + wpos[w]
            if r == job_read[job + 1]:           # its reads are done: its copies take a core
                left -= _shared_job_done(w, P, copy_done(ti, jobs.tail[job], drives.copies), pool)
            elif reads.warm[r] or not _shared_issue(w, r, ti, reads, dev, drives, usage, share):
                d = copy_done(ti, copy_seconds(reads.length[r], reads.addr[r], dev), drives.copies)
                left -= _shared_read_done(w, P, d, False, pool, usage)
            else:
                if w >= P:
                    pilot.free[w - P] = np.inf
                else:
                    wfree[w] = np.inf
    for m in range(M):
        drives.free[m] = share.last[m]


@njit(**HELPER)
def _member_events(share, m, C):
    """Member ``m``'s fair share and next events in its present state (after each change to it).

    The ``level`` is the fair share of ``C`` among the reads in the channel (water filling): a
    read whose own rate ``cap`` is below it passes at its cap, the others at the level, and the
    rates add up to ``C``; when every cap is below ``C / n`` together, they all pass at their caps
    (level inf). Then: when the first read leaves the channel and which issuer's (the lowest on a
    tie), and when the first waiting read enters it."""
    n = share.active[m]
    level = C / n if n > 0 else np.inf
    for _ in range(n):                           # raise the level while capped reads leave it spare capacity
        capped, spare = 0, C
        for j in range(share.rem.shape[1]):
            if share.rem[m, j] < np.inf and share.cap[m, j] < level:
                capped += 1
                spare -= share.cap[m, j]
        new = spare / (n - capped) if capped < n else np.inf
        if new <= level:
            break
        level = new
    share.level[m] = level
    td, jd, te, je = np.inf, -1, np.inf, -1
    for j in range(share.rem.shape[1]):
        if share.rem[m, j] < np.inf:
            d = share.clock[m] + max(share.rem[m, j], 0.0) / min(share.cap[m, j], level)
            if d < td:
                td, jd = d, j
        if share.enter[m, j] < te:
            te, je = share.enter[m, j], j
    share.next_done[m], share.done_by[m], share.next_enter[m], share.enter_by[m] = td, jd, te, je


@njit(**HELPER)
def _advance_channel(share, m, t):
    """Bring member ``m``'s shared channel to time ``t`` (s): each read in it has passed
    ``min(cap, level)`` of its work per s since ``clock``."""
    if t > share.clock[m]:
        dt = t - share.clock[m]
        for j in range(share.rem.shape[1]):
            if share.rem[m, j] < np.inf:
                share.rem[m, j] -= dt * min(share.cap[m, j], share.level[m])
        share.clock[m] = t


@njit(**HELPER)
def _shared_issue(j, r, t, reads, dev, drives, usage, share):
    """Issuer ``j`` issues drive read ``r`` at ``t`` (s) in :func:`shared_pool`: split over the
    members, on each it holds a command slot and waits to enter the channel. Returns
    whether it reads any byte (an empty read completes at once)."""
    pieces, nbytes = drives.pieces, drives.nbytes
    split_device(reads.addr[r], reads.length[r], dev, pieces, nbytes)
    share.issued[j] = t
    parts = 0
    for m in range(dev.members):
        drives.member_bytes[m] += nbytes[m]
        usage.requests[m] += pieces[m]
        if nbytes[m] > 0:
            C = _channel_rate(dev, m)
            share.enter[m, j] = _command(m, t, dev, drives)
            work = nbytes[m] + pieces[m] * dev.m_channel[m] * C    # its bytes and its requests' channel time
            share.size[m, j] = work
            big = largest_request(nbytes[m], dev.members, dev.chunk, dev.rule, dev.max_request)
            share.cap[m, j] = dev.m_stream[m] * (work / big)   # its bytes in the time of its largest request
            if share.enter[m, j] < share.next_enter[m]:
                share.next_enter[m], share.enter_by[m] = share.enter[m, j], j
            parts += 1
    share.parts[j] = parts
    if parts == 0:
        return False
    if share.busy[0] == 0:
        share.busy[1] = t
    share.busy[0] += 1
    return True


@njit(**HELPER)
def _shared_read_done(j, P, d, drive, pool, usage):
    """Issuer ``j``'s read completed at ``d`` (s; a ``drive`` read, or a warm one): the array's busy
    time when it was the last drive read in flight, then the issuer's job as :func:`reader_pool`
    and :func:`pilot_read` keep it (``pool``: :class:`replay.model.state.Pool`): after its last
    read, its copies (at once, or as the issuer's next event when they wait for a core). Returns
    1 when a demand job completed, else 0."""
    jobs, workers, pilot, drives, share = pool.jobs, pool.workers, pool.pilot, pool.drives, pool.share
    if drive:
        share.busy[0] -= 1
        if share.busy[0] == 0:
            _count_busy(share.busy[1], d, drives, usage)
    if j >= P:
        job = pilot.job[j - P]
        pilot.pos[j - P] += 1
        last = jobs.first_read[job] + pilot.pos[j - P] == jobs.first_read[job + 1]
    else:
        job = workers.job[j]
        workers.pos[j] += 1
        last = jobs.first_read[job] + workers.pos[j] == jobs.first_read[job + 1]
    if not last or copy_waits(jobs.tail[job], drives.copies):
        if j >= P:
            pilot.free[j - P] = d
        else:
            workers.free[j] = d
        return 0
    return _shared_job_done(j, P, d + jobs.tail[job], pool)


@njit(**HELPER)
def _shared_job_done(j, P, d, pool):
    """Issuer ``j``'s job completed at ``d`` (s), its copies included: the issuer is free then.
    Returns 1 when it was a demand job, else 0."""
    jobs, workers, pilot = pool.jobs, pool.workers, pool.pilot
    if j >= P:
        jobs.done[pilot.job[j - P]] = d
        pilot.job[j - P] = -1
        pilot.free[j - P] = d
        return 0
    jobs.done[workers.job[j]] = d
    workers.job[j] = -1
    workers.free[j] = d
    return 1


@njit(**HELPER)
def _take_slot(ring, head, m, Q, done):
    """Give member ``m``'s first-freeing queue slot (``ring[head[m]]``) to a request completing at
    ``done`` (s), keeping ``ring`` [Q] sorted from ``head[m]`` on: the slot leaves the front and
    re-enters at its place from the back (requests reach a drive in time order, so it is mostly
    the back: one step)."""
    h = head[m]
    head[m] = h + 1 if h + 1 < Q else 0
    p = h                                        # the back of the ring, now the free position
    for _ in range(Q - 1):
        prev = p - 1 if p > 0 else Q - 1
        if ring[prev] <= done:
            break
        ring[p] = ring[prev]
        p = prev
    ring[p] = done

