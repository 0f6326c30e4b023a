"""One (forward, layer) instance of the timing model: load jobs, reads, the reader pool, the compute thread.

Compiled with numba: an instance is a small sequential event simulation (a handful of jobs of a
few reads each) and a trace holds hundreds of thousands of them, so a plain loop compiled to
machine code is both the clearest form of the model and several times faster than vectorising
across instances with numpy. :func:`simulate_instances` walks the instances in order; the model
itself is described in :mod:`replay.model.engine`.

**Interface.** Every input and output is a named tuple of arrays and numbers (numba passes one
to compiled code field by field, as if each were an argument; the stages that take many are
inlined into the loop, :mod:`replay.model.jit`):

* the instances and their batch unions: :class:`replay.model.unions.Instances`;
* what is read where: :class:`LayoutArrays`; how it is read: :class:`ReadPolicy`; from what:
  :class:`Device`; what is already in RAM: :class:`RamTiers`; what the coupled prefetch source
  predicts from, and the controller's state: :class:`replay.model.admission.Prefetcher`;
* the outputs, filled in place: :class:`replay.model.engine.Results`, whose fields are declared once,
  on the public result dataclasses (:class:`replay.model.engine.InstanceResult` and the others), so a
  new metric is one field there plus the line here that fills it;
* the working arrays: :class:`Work`, allocated once per replay by the caller with
  :func:`new_work`, sized by the largest batch union, and carried from call to call.

Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.admission import (
    OBSERVE,
    TOP_K,
    admit_listed,
    backed_off,
    choose,
    load_seconds,
    record_demand,
    record_outcome,
)
from replay.model.device import largest_request, split_device
from replay.model.jit import HELPER, LOOP, STAGE, fetch_lines
from replay.model.predictors import (
    FUSED,
    add_reliability,
    fused_probabilities,
    most_probable,
    next_layer_probabilities,
    observe_sources,
    observe_union,
)
from replay.model.pagecache import (
    PAGE_BYTES,
    buffered_read,
    cached_read,
    checkpoint,
    note_settled,
    scales_settled,
    start_session,
    stop_logging,
    undo,
)
from replay.model.prefetch import COUPLED, ORACLE, predict_next
from replay.model.readplan import SCALE, WEIGHT, ReadPlan, plan_layer
from replay.model.runtime import lru_add, lru_start, lru_touch
from replay.model.weightcache import wc_add, wc_hit, wc_start

MEMORY_BANDWIDTH = 10e9
"""Bytes/s for reads served from the OS page cache."""

SMALL_READ_BYTES = 256 * 1024
"""Reads up to this size queue among themselves, beside the large transfers, as a drive's internal
parallelism serves them (their transfer time still delays the large transfers)."""

WARM_BUCKETS = 10_000
"""A weight read is warm when a hash of its (file, 4 KiB page) falls in the first
``page_cache_fraction`` of this many buckets."""

PREFETCH_SLOTS = 64
"""Most experts one prefetch prediction can hold (``RuntimeConfig.prefetch_experts`` is 1-64)."""

# ------------------------------------------------------------------------------------- inputs

LayoutArrays = namedtuple(
    "LayoutArrays", "rank adjacent pos_file pos_off wbytes ebytes seconds top_resident top_fraction wloc sloc bases")
"""A layout as arrays (:func:`replay.model.engine.layout_arrays`).

Per layout layer and expert [L, E]: ``rank`` (issue order: place in the layer's physical order,
file then offset), ``adjacent`` (the three weight tensors are byte-adjacent in one file: one
pread), ``pos_file`` and ``pos_off`` (where its first weight byte is: file index, byte offset),
``wbytes`` (weight bytes), ``ebytes`` (expert bytes, weights and scales), ``seconds`` (its matmul
per position, s), ``top_resident`` (its top segment is resident in RAM, bool). Per layer [L]:
``top_fraction`` (the FFN share of a top segment, 0-1). ``wloc``, ``sloc`` [L, E, 3, (file,
offset, bytes)]: the weight and scale tensors' extents. ``bases`` [files]: each file's byte
address in the array's logical address space."""

ReadPolicy = namedtuple("ReadPolicy", "coalesce gap_bytes span_bytes direct alignment workers warm_fraction "
                                      "dense_seconds prefetch prefetch_experts admission prefetch_bytes candidates "
                                      "min_probability cancel_stale adaptive_budget backoff blocking routing_order")
"""How the runtime reads (:func:`replay.model.engine.read_policy`): ``coalesce`` (bool) with its largest
``gap_bytes`` and ``span_bytes``; ``direct`` (O_DIRECT weight reads, bool) widened to
``alignment`` bytes; ``workers`` (loads in flight); ``warm_fraction`` (the device's declared
page-cache share of weight reads, 0-1); ``dense_seconds`` (per layer, before it is routed, s);
``prefetch`` (the source, an index into ``MODEL_SOURCES``; ``replay.model.config.FUSED`` for several)
and ``prefetch_experts`` (its K, or the queue-slot budget Q); ``admission`` (an index into ``ADMISSION_POLICIES``), ``prefetch_bytes``
(B per layer, 0 none), ``candidates``, ``min_probability``, and the tail controls ``cancel_stale``,
``adaptive_budget``, ``backoff`` (:mod:`replay.model.admission`); ``blocking`` (colibrì's PIPE=0: the
compute thread waits for all of a layer's demand loads before its first matmul) and
``routing_order`` (misses issued, waited for and promoted into the LRU in routing order, hits
computed between them in that order, as colibrì's ``moe()`` does; else physical order with the
resident work first)."""

Device = namedtuple("Device", "members chunk rule request_seconds bandwidth queue_slots host_bandwidth full_bandwidth "
                               "stream_bandwidth max_request shared request_channel m_request m_bandwidth m_stream "
                               "m_channel seg_start seg_drive")
"""A :class:`replay.model.device.ArrayProfile` as plain numbers (:func:`replay.model.engine.device_numbers`):
``members``, ``chunk`` (stripe bytes), ``rule`` (an index into ``SPLIT_RULES``); per drive
``request_seconds`` a (s), ``bandwidth`` B (bytes/s), ``queue_slots`` Q and ``stream_bandwidth``
b_1 (bytes/s, at most B: :mod:`replay.model.device`'s queue model), ``max_request`` (bytes, the
system's largest drive request, 0 for none), ``shared`` (the drives share their channel among
the reads in them, bool: :mod:`replay.model.device`'s service discipline), ``request_channel`` c (s
each request holds the channel beyond its bytes); ``host_bandwidth`` and
``full_bandwidth`` (the array's large-read ceiling), bytes/s. Per member [M], what the reads use:
``m_request`` a, ``m_bandwidth`` B, ``m_stream`` b_1, ``m_channel`` c (the drive's figures on
every member of an array; each drive's own on independent drives); ``seg_start``, ``seg_drive``
the address map of independent drives (rule ``storage``: :func:`replay.model.device.split_storage`;
empty otherwise)."""

RamTiers = namedtuple("RamTiers", "pinned lru pages weights")
"""What is in RAM, carried from instance to instance: ``pinned`` [L, E] bool (the pinned store),
``lru`` (the per-layer LRUs, :class:`replay.model.runtime.Lru`), ``pages`` (the page cache under the
buffered scale reads, with the kernel's readahead: :class:`replay.model.pagecache.PageCache`),
``weights`` (the page cache under buffered weight reads: :class:`replay.model.weightcache.WeightCache`)."""

# the prefetcher's inputs and state: replay.model.admission.Prefetcher (a prediction source and the controller)

# ------------------------------------------------------------------------ per-call working arrays

Misses = namedtuple("Misses", "expert top comp first ready wlen sbytes skip wjob sjob wait pre cached")
"""One instance's misses [K], in issue order (physical; routing order under
``ReadPolicy.routing_order``): ``expert``; ``top`` (its top segment is
resident: only the bottom is read); ``comp`` (its matmul over all positions, s); ``first`` (some
of its scale preads went to the drive: set when its reads are planned); ``ready`` (>= 0: a
prefetch of it is in flight and completes then, s; -1: a demand load); ``wlen`` (weight bytes
it reads); ``sbytes`` (its scale bytes); ``skip`` (its prefetch is in flight: nothing to read); ``wjob``,
``sjob`` (the jobs carrying its weights and its scales); ``wait`` (s the compute thread waited for
it); ``pre`` (under ``ReadPolicy.routing_order``: the resident work routed between the previous miss and
this one, s); ``cached`` (its weights are in the page cache: :mod:`replay.model.weightcache`)."""

Jobs = namedtuple("Jobs", "first_read tail done")
"""The reader pool's jobs [2K]: ``first_read`` [2K+1] (each job's first read; one past the
last), ``tail`` (page-cache time after its reads, s), ``done`` (its completion time, s)."""

Reads = namedtuple("Reads", "addr length warm")
"""Queued preads [R]: logical address and length (bytes), and ``warm`` (served from RAM)."""

Workers = namedtuple("Workers", "free job pos")
"""The reader pool [W]: each worker's free time (s), its job (-1 idle) and next read in it."""

Drives = namedtuple("Drives", "free small_free host busy pieces nbytes member_bytes slots head")
"""The drives' state, carried between instances when a prefetch source runs. Per member [M]:
the large-transfer and small-read channels' free times (s); ``host`` [2]: the host link's large
and small channels' free times (s); ``busy`` [1]: until when the array has a read outstanding
(s); ``pieces``, ``nbytes`` [M]: one read's split (scratch);
``member_bytes`` [M]: bytes each member transferred over the whole replay; ``slots`` [M, Q]:
when each of a member's queue slots frees (s), a ring sorted by that time from ``head`` [M]
(the slot that frees first) on, so a request takes its slot in one step (:func:`_take_slot`)."""

Prefetched = namedtuple("Prefetched", "ready nbytes experts score touched")
"""Prefetches made for the next instance. Per expert [E]: ``ready`` (in the next instance's
clock, s; inf: none), ``nbytes`` (expert bytes). ``experts`` [64]: the list, in load order.
``score``, ``touched`` [E]: the predictor's scratch (:func:`replay.model.prefetch.predict_next`)."""

Single = namedtuple("Single", "expert skip top wlen")
"""One prefetch load as :func:`replay.model.readplan.plan_layer` takes it: arrays [1]."""

Pilot = namedtuple("Pilot", "state free mark n_plan nbytes")
"""The prefetch thread's loads queued at routing (:func:`_queue_at_routing`), as jobs after the
layer's demand jobs. ``state`` [4]: the first of its jobs, the next to start (or under way), one
past the last, and the next read's place in the job under way; ``free`` [1]: when it issues its
next read (s); per queued load [64]: the page cache's undo-log position before it was planned
(:func:`replay.model.pagecache.checkpoint`: a dropped load's scale reads are undone), its planned
preads and bytes."""

PILOT_FIRST, PILOT_NEXT, PILOT_END, PILOT_POS = 0, 1, 2, 3

Sharing = namedtuple("Sharing", "enter size cap rem clock level active last next_done done_by next_enter enter_by "
                                 "parts issued busy")
"""Shared drives' channels while the reader pool runs (:func:`_shared_pool`). Per member and
issuer [M, W+1] (the workers, then the prefetch thread), for the read the issuer has in flight:
``enter`` (when its bytes enter the member's channel, s; inf: not waiting), ``size`` (its work
on the member: its bytes and ``c C`` for each of its ``p`` requests, bytes), ``cap`` (its own rate
there, in work per s: its bytes in the time of its largest request at ``b_1``, ``p b_1`` when its
requests are equal), ``rem`` (work it still has to pass; inf: not in
the channel). Per member [M]: ``clock`` (s: ``rem`` is
as of then; the channel serves nothing before its first value: it is busy until then with reads
issued before the pool), ``level`` (the fair share, work/s: a read in the channel passes
``min(cap, level)``), ``active`` (reads in the channel), ``last`` (when its last read left, s),
and its next events as they stand (:func:`_member_events`): ``next_done`` (s) when the first
read, issuer ``done_by``'s, leaves it, ``next_enter`` (s) when the first waiting one,
``enter_by``'s, enters it. Per issuer [W+1]: ``parts`` (members its read is still on),
``issued`` (s). ``busy`` [2]: drive reads in flight, and when the array last became busy (s)."""

Work = namedtuple("Work", "miss jobs reads workers drives pending plan single pilot share")
"""Every working array of one replay, carried over its :func:`simulate_instances` calls:
:class:`Misses`, :class:`Jobs`, :class:`Reads`, :class:`Workers`, :class:`Drives`, :class:`Prefetched`, the read plan
(:data:`replay.model.readplan.ReadPlan`), :class:`Single`, :class:`Pilot` and :class:`Sharing`."""


@njit(**LOOP)
def new_work(K, E, W, M, Q):
    """Working arrays for batch unions of up to ``K`` experts out of ``E``, ``W`` workers and ``M``
    array members of ``Q`` queue slots (a job has at most three weight reads or one span, and three
    scale reads; the prefetch thread's queued loads, up to :data:`PREFETCH_SLOTS` of at most eight
    reads each, follow the demand jobs)."""
    miss = Misses(np.empty(K, np.int64), np.empty(K, np.bool_), np.empty(K), np.empty(K, np.bool_), np.empty(K),
                  np.empty(K, np.int64), np.empty(K, np.int64), np.empty(K, np.bool_),
                  np.empty(K, np.int64), np.empty(K, np.int64), np.empty(K), np.zeros(K), np.zeros(K, np.bool_))
    J = 2 * K + PREFETCH_SLOTS
    jobs = Jobs(np.empty(J + 1, np.int64), np.empty(J), np.empty(J))
    R = max(8 * K, 7) + 8 * PREFETCH_SLOTS
    reads = Reads(np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.bool_))
    workers = Workers(np.empty(W), np.empty(W, np.int64), np.empty(W, np.int64))
    drives = Drives(np.zeros(M), np.zeros(M), np.zeros(2), np.zeros(1), np.empty(M, np.int64), np.empty(M, np.int64),
                    np.zeros(M, np.int64), np.zeros((M, Q)), np.zeros(M, np.int64))
    pending = Prefetched(np.full(E, np.inf), np.zeros(E, np.int64), np.empty(PREFETCH_SLOTS, np.int64),
                         np.zeros(E, np.int64), np.empty(E, np.int64))
    R = max(6 * K, 6)
    plan = ReadPlan(np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64),
                    np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64))
    single = Single(np.empty(1, np.int64), np.zeros(1, np.bool_), np.empty(1, np.bool_), np.empty(1, np.int64))
    pilot = Pilot(np.zeros(4, np.int64), np.zeros(1), np.empty(PREFETCH_SLOTS, np.int64),
                  np.empty(PREFETCH_SLOTS, np.int64), np.empty(PREFETCH_SLOTS, np.int64))
    share = Sharing(np.full((M, W + 1), np.inf), np.zeros((M, W + 1)), np.zeros((M, W + 1)),
                    np.full((M, W + 1), np.inf), np.zeros(M), np.zeros(M), np.zeros(M, np.int64), np.zeros(M),
                    np.full(M, np.inf), np.zeros(M, np.int64), np.full(M, np.inf), np.zeros(M, np.int64),
                    np.zeros(W + 1, np.int64), np.zeros(W + 1), np.zeros(2))
    return Work(miss, jobs, reads, workers, drives, pending, plan, single, pilot, share)


# ------------------------------------------------------------------------------------- the loop

@njit(**LOOP)
def simulate_instances(inst, ram, table, lay, pol, dev, work, out):
    """Time every instance of ``inst`` (:class:`replay.model.unions.Instances`), in order.

    Instance ``i`` is layer ``inst.layer[i]`` of forward ``inst.forward[i]`` of session
    ``inst.session[i]``; its union experts are ``inst.sel_e[inst.sel_start[i]:inst.sel_start[i+1]]``,
    each needed by ``inst.sel_mult`` positions. ``ram`` (:class:`RamTiers`) is updated as the
    replay goes; ``table`` (:class:`replay.model.admission.Prefetcher`) feeds the prefetcher. ``work``
    (:func:`new_work`, sized for the largest batch union) is the caller's and carries the drives'
    state from call to call, so consecutive calls over consecutive whole forwards replay as one
    call over all of them. Results go into ``out`` (:class:`replay.model.engine.Results`, zeroed).
    Runs the loop, :func:`_run`.
    """
    _run(inst, ram, table, lay, pol, dev, work, out)


@njit(**HELPER)
def _run(inst, ram, table, lay, pol, dev, work, out):
    """The loop of :func:`simulate_instances`, over working arrays it was given (so, like every
    helper, built without reference counting)."""
    inst_fwd, inst_li, inst_session = inst.forward, inst.layer, inst.session
    I = len(inst.sel_start) - 1
    miss, jobs, reads, workers, drives, pending = work.miss, work.jobs, work.reads, work.workers, work.drives, work.pending
    plan, pilot = work.plan, work.pilot
    mfree, sfree, host, job_done, slots = drives.free, drives.small_free, drives.host, jobs.done, drives.slots
    pf_ready, pf_list = pending.ready, pending.experts
    lru, res, usage = ram.lru, out.instance, out.device
    pf_for = -1                                  # the instance the pending prefetches are for
    pf_n = 0
    ctl = table.control
    ctl.q_for[0] = -1
    learning = pol.prefetch != 0 and pol.admission != TOP_K     # the controller measures what misses cost
    at_routing = runtime_rule(pol, table)
    for i in range(I):
        li = inst_li[i]
        if i + 1 < I:
            _fetch_rows(i + 1, inst, table.source, ram, lay, learning, out)
        lru_start(lru, li, inst_session[i])
        start_session(ram.pages, inst_session[i])
        wc_start(ram.weights, inst_session[i])
        if pf_for != i:
            pf_n = 0
        if pol.prefetch == FUSED:
            observe_sources(table.sources, li, inst_fwd[i], inst_session[i], inst.sel_e, inst.sel_start[i],
                            inst.sel_start[i + 1])
        elif pol.prefetch != 0:
            observe_union(table.source, li, inst_fwd[i], inst_session[i], inst.sel_e, inst.sel_start[i],
                          inst.sel_start[i + 1])
        k, resident = _select(i, li, inst, ram, lay, pol, pending, pf_n, miss, out)
        if pol.backoff and pf_n > 0:
            _prefetch_outcome(i, li, inst, pending, pf_n, lay, pol, dev, ctl)
        pilot_free = 0.0                         # when the prefetcher's load in flight at routing completes
        for p in range(pf_n):
            pilot_free = max(pilot_free, pf_ready[pf_list[p]])
            pf_ready[pf_list[p]] = np.inf
        has_next = i + 1 < I and inst_fwd[i + 1] == inst_fwd[i] and inst_li[i + 1] == li + 1
        n_jobs, end = 0, resident
        jobs.first_read[0] = 0
        if k > 0:
            n_jobs = _plan_reads(i, li, k, miss, lay, pol, ram.pages, ram.weights, plan, jobs, reads, res)
        pilot.state[PILOT_FIRST], pilot.state[PILOT_NEXT], pilot.state[PILOT_END] = n_jobs, n_jobs, n_jobs
        pilot.state[PILOT_POS] = 0
        pilot.free[0] = pilot_free
        if at_routing and has_next:              # the runtime queues L+1's predictions when L is routed
            lru_start(lru, li + 1, inst_session[i])
            _queue_at_routing(i, li + 1, inst, table, ram, lay, pol, pending, plan, work.single,
                              jobs, reads, n_jobs, pilot, out)
        if k > 0:
            if dev.shared:
                _shared_pool(n_jobs, pol.workers, pilot_free, jobs, reads, workers, pilot, dev, drives, usage,
                             work.share)
            else:
                _reader_pool(n_jobs, pol.workers, pilot_free, jobs, reads, workers, pilot, dev, drives, usage)
            end = _compute_thread(i, li, k, miss, resident, lay, pol, dev, jobs, out)
            for j in range(n_jobs):
                out.prefetch.demand_done[i] = max(out.prefetch.demand_done[i], job_done[j])
        if learning:
            _feedback(i, li, k, miss, lay, pol, dev, ctl, out)
        if pol.prefetch == 0:
            for m in range(dev.members):
                mfree[m], sfree[m] = 0.0, 0.0
                for q in range(dev.queue_slots):
                    slots[m, q] = 0.0
            host[0], host[1] = 0.0, 0.0
            drives.busy[0] = 0.0
            continue
        next_at = end + pol.dense_seconds      # the next layer is routed then: later loads are dropped
        pf_n = 0
        if at_routing and has_next:
            _pilot_rest(next_at, jobs, reads, pilot, dev, drives, usage)
            pf_n = _pilot_outcome(i, li + 1, next_at, lay, pending, ram, jobs, pilot, out)
            pf_for = i + 1
        elif has_next:
            # a controlled prefetcher starts once this layer's demand loads, and its own load in flight, are done
            start = pilot_free
            for j in range(n_jobs):
                start = max(start, job_done[j])
            lru_start(lru, li + 1, inst_session[i])
            pf_n = _prefetch(i, li + 1, start, next_at, inst, table, ram, lay, pol, dev, pending,
                             plan, work.single, reads, drives, out)
            pf_for = i + 1
        for m in range(dev.members):           # the drives' state, in the next instance's clock
            mfree[m], sfree[m] = max(mfree[m] - next_at, 0.0), max(sfree[m] - next_at, 0.0)
            for q in range(dev.queue_slots):
                slots[m, q] = max(slots[m, q] - next_at, 0.0)
        host[0], host[1] = max(host[0] - next_at, 0.0), max(host[1] - next_at, 0.0)
        drives.busy[0] = max(drives.busy[0] - next_at, 0.0)
    for m in range(dev.members):
        usage.transfer_seconds[m] = drives.member_bytes[m] / dev.m_bandwidth[m]


@njit(**STAGE)
def _fetch_rows(i, inst, src, ram, lay, choosing, out):
    """Start bringing into the CPU caches what instance ``i`` reads per union expert (its RAM
    tiers, layout rows and, for the coupled source, its pair-table rows) and, when its prefetcher
    ``choosing`` will rank the next layer's experts (:func:`replay.model.admission.choose`), the rows
    that ranking scans, so those reads, spread over tables of megabytes, do not each wait for
    memory in turn when it runs."""
    li = inst.layer[i]
    if choosing and li + 1 < len(lay.top_fraction):
        fetch_lines(ram.pinned[li + 1])
        fetch_lines(ram.lru.cached[li + 1])
        fetch_lines(lay.seconds[li + 1])
        fetch_lines(lay.wbytes[li + 1])
        fetch_lines(lay.ebytes[li + 1])
        fetch_lines(lay.rank[li + 1])
        fetch_lines(lay.top_resident[li + 1])
    coupled = src.kind == COUPLED
    lru = ram.lru
    for j in range(inst.sel_start[i], inst.sel_start[i + 1]):
        e = inst.sel_e[j]
        if coupled:
            fetch_lines(src.targets[li, e])
            fetch_lines(src.counts[li, e])
            fetch_lines(src.selections[li, e:e + 1])
        fetch_lines(ram.pinned[li, e:e + 1])
        fetch_lines(lru.cached[li, e:e + 1])
        fetch_lines(lru.newer[li, e:e + 1])
        fetch_lines(lru.older[li, e:e + 1])
        fetch_lines(lay.seconds[li, e:e + 1])
        fetch_lines(lay.ebytes[li, e:e + 1])
        fetch_lines(lay.rank[li, e:e + 1])
        fetch_lines(lay.top_resident[li, e:e + 1])
        fetch_lines(lay.adjacent[li, e:e + 1])
        fetch_lines(lay.pos_file[li, e:e + 1])
        fetch_lines(lay.pos_off[li, e:e + 1])
        fetch_lines(lay.wbytes[li, e:e + 1])
        fetch_lines(lay.sloc[li, e])
        fetch_lines(out.instance.expert_wait[li, e:e + 1])


@njit(**HELPER)
def _select(i, li, inst, ram, lay, pol, pending, pf_n, miss, out):
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
    """
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
        if not _selected(e, sel_e, a, b):
            pf.unused[i] += pf_bytes[e]
            if pf_ready[e] > 0:
                lru_add(lru, li, e)
    res.hits[i] = hits
    res.union_experts[i] = b - a
    res.union_bytes[i] = union_bytes
    res.compute[i] = pol.dense_seconds + matmul
    res.misses[i] = k
    return k, on_hits + on_tops


@njit(**HELPER)
def _selected(e, sel_e, a, b):
    for j in range(a, b):
        if sel_e[j] == e:
            return True
    return False


@njit(**STAGE)
def _plan_reads(i, li, k, miss, lay, pol, pages, weights, plan, jobs, reads, res):
    """The reader pool's jobs and their reads, in issue order, as :func:`replay.model.readplan.plan_layer`
    plans them (the harness executes the same plan); returns the number of jobs.

    Fills ``miss.wlen``, ``miss.sbytes``, ``miss.first`` and the jobs carrying each miss's
    weights and scales (``miss.wjob``, ``miss.sjob``; -1 for a miss whose prefetch is in
    flight). Weight reads are O_DIRECT-widened here. A scale pread goes to the drive when the page
    cache ``pages`` cannot serve it (:func:`replay.model.pagecache.buffered_read`, in issue order), as
    one read of the pages the kernel's readahead reads for it; otherwise it, like a warm weight
    read, costs memory time at the end of its job. A job left with no drive read keeps one empty
    warm read to carry it. A buffered weight read of experts whose weights the page cache
    ``weights`` holds (:mod:`replay.model.weightcache`) is served from memory; the others, once read,
    enter it. Reads, the reads that reach the drives, and bytes read
    (O_DIRECT-widened weights, whole scales) go into ``res`` (the instance outputs).
    """
    miss_e, wjob, sjob, sbytes, skip = miss.expert, miss.wjob, miss.sjob, miss.sbytes, miss.skip
    for p in range(k):
        skip[p] = miss.ready[p] >= 0
        wjob[p], sjob[p], sbytes[p], miss.first[p] = -1, -1, 0, False
        miss.cached[p] = not skip[p] and wc_hit(weights, li, miss_e[p])
    n_plan, n_jobs = plan_layer(miss_e, k, skip, miss.top, 1.0 - lay.top_fraction[li], lay.adjacent[li],
                                lay.pos_file[li], lay.pos_off[li], lay.wbytes[li], lay.wloc[li], lay.sloc[li],
                                pol.coalesce, pol.gap_bytes, pol.span_bytes, miss.wlen, plan)
    bases = lay.bases
    job_read, job_tail = jobs.first_read, jobs.tail
    n_reads, read_bytes, drive_reads = 0, 0, 0
    job, wtail, warm_scales, has_warm_scales = -1, 0.0, 0, False
    settled = False
    for r in range(n_plan):
        if plan.job[r] != job:
            if job >= 0:
                job_tail[job] = wtail + (warm_scales / MEMORY_BANDWIDTH if has_warm_scales else 0.0)
                n_reads = _close_job(job, job_read, n_reads, reads)
            job = plan.job[r]
            job_read[job] = n_reads
            wtail, warm_scales, has_warm_scales = 0.0, 0, False
        f, n, a = plan.file[r], plan.length[r], plan.first[r]
        if plan.kind[r] == WEIGHT:
            cached = True
            for m in range(a, plan.last[r] + 1):
                cached = cached and miss.cached[m]
            if cached:
                wtail += n / MEMORY_BANDWIDTH
            else:
                queued = n_reads
                n_reads, wtail, n = _weight_read(f, plan.offset[r], n, bases, pol, n_reads, wtail, reads)
                drive_reads += n_reads - queued
            for m in range(a, plan.last[r] + 1):
                wjob[m] = job
        else:
            sjob[a] = job
            if sbytes[a] == 0:                   # its first scale read
                settled = scales_settled(pages, li, miss_e[a])
            sbytes[a] += n
            n_reads, queued = _scale_read(f, plan.offset[r], n, settled, pages, bases, n_reads, reads)
            if not settled and (r + 1 == n_plan or plan.first[r + 1] != a or plan.kind[r + 1] != SCALE):
                note_settled(pages, li, miss_e[a], lay.sloc[li, miss_e[a]])
            if queued:
                drive_reads += 1
                miss.first[a] = True
            else:
                warm_scales += n
                has_warm_scales = True
        read_bytes += n
    if job >= 0:
        job_tail[job] = wtail + (warm_scales / MEMORY_BANDWIDTH if has_warm_scales else 0.0)
        n_reads = _close_job(job, job_read, n_reads, reads)
    job_read[n_jobs] = n_reads
    for p in range(k):
        if not skip[p] and not miss.cached[p]:
            wc_add(weights, li, miss_e[p])
    res.reads[i] = n_plan
    res.drive_reads[i] = drive_reads
    res.read_bytes[i] = read_bytes
    return n_jobs


@njit(**HELPER)
def _weight_read(file, off, n, bases, pol, n_reads, wtail, reads):
    """Queue one weight read of ``n`` bytes at ``off`` in ``file`` (O_DIRECT widens it); a warm one
    adds its memory time to ``wtail`` instead. Returns the new read count, tail (s) and bytes read."""
    addr = bases[file] + off
    if pol.direct:
        end = -(-(addr + n) // pol.alignment) * pol.alignment
        addr = addr // pol.alignment * pol.alignment
        n = end - addr
    if pol.warm_fraction > 0 and (file * 1_000_003 + off // 4096) % WARM_BUCKETS < pol.warm_fraction * WARM_BUCKETS:
        return n_reads, wtail + n / MEMORY_BANDWIDTH, n
    reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = addr, n, False
    return n_reads + 1, wtail, n


@njit(**HELPER)
def _scale_read(file, off, n, settled, pages, bases, n_reads, reads):
    """Queue one buffered scale pread of ``n`` bytes at ``off`` in ``file`` when the page cache
    ``pages`` cannot serve it (:func:`replay.model.pagecache.buffered_read`; ``settled``: the expert's
    scale pages are all cached, :func:`replay.model.pagecache.cached_read`), as one drive read of the
    pages the kernel reads for it. Returns the new read count and whether it queued one."""
    if settled:
        cached_read(pages, file, off, n)
        return n_reads, False
    waited, page = buffered_read(pages, file, off, n)
    if waited == 0:
        return n_reads, False
    reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = bases[file] + page * PAGE_BYTES, waited * PAGE_BYTES, False
    return n_reads + 1, True


@njit(**HELPER)
def _close_job(job, job_read, n_reads, reads):
    """Give a job with no drive read one empty warm read, so the pool still runs it."""
    if n_reads == job_read[job]:
        reads.addr[n_reads], reads.length[n_reads], reads.warm[n_reads] = 0, 0, True
        n_reads += 1
    return n_reads


@njit(**STAGE)
def _reader_pool(n_jobs, n_workers, start, jobs, reads, workers, pilot, dev, drives, usage):
    """Event-ordered reader pool: ``jobs.done`` [n_jobs] gets each job's completion time (s).

    Workers take jobs in issue order from ``start`` (s: the prefetch load in flight when the
    layer was routed has completed, as colibrì's ``moe()`` waits for it) and run each job's reads
    one after another; at every step the worker that is free earliest (lowest index on ties)
    issues its next read, so reads reach the drives in time order. The prefetch thread
    (``pilot``), when loads were queued at routing, is one more such reader with its own jobs: it
    issues its next read when it is free first (it wins ties: its loads were queued before the
    demand loads). Returns once every demand read is issued; the prefetch thread's remaining
    reads are :func:`_pilot_rest`'s. The drives' state (``drives``) is the caller's; ``usage``
    (the device outputs) accumulates per member.
    """
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
        if pilot.state[PILOT_NEXT] < pilot.state[PILOT_END] and pilot.free[0] <= t:
            _pilot_read(jobs, reads, pilot, dev, drives, usage)
            continue
        if wjob[w] < 0:
            wjob[w], wpos[w] = next_job, 0
            next_job += 1
        job = wjob[w]
        r = job_read[job] + wpos[w]
        done = _serve_read(reads.addr[r], reads.length[r], reads.warm[r], t, dev, drives, usage)
        wpos[w] += 1
        if r + 1 == job_read[job + 1]:
            done += jobs.tail[job]
            jobs.done[job] = done
            wjob[w] = -1
        wfree[w] = done


@njit(**HELPER)
def _pilot_read(jobs, reads, pilot, dev, drives, usage):
    """The prefetch thread issues its next read at its free time; a load's last read (plus its
    page-cache tail) completes the load's job."""
    state = pilot.state
    job = state[PILOT_NEXT]
    r = jobs.first_read[job] + state[PILOT_POS]
    done = _serve_read(reads.addr[r], reads.length[r], reads.warm[r], pilot.free[0], dev, drives, usage)
    state[PILOT_POS] += 1
    if r + 1 == jobs.first_read[job + 1]:
        done += jobs.tail[job]
        jobs.done[job] = done
        state[PILOT_NEXT], state[PILOT_POS] = job + 1, 0
    pilot.free[0] = done


@njit(**STAGE)
def _serve_read(addr, n, warm, t, dev, drives, usage):
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
    A warm read costs memory time only. Bytes go into ``drives.member_bytes``, requests and
    residence (s) into ``usage``, and the time the read keeps the array busy beyond the reads
    before it (reads arrive in time order) into ``usage.busy_seconds``.
    """
    if warm:
        return t + n / MEMORY_BANDWIDTH
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
    """:func:`_serve_read` on shared drives (:mod:`replay.model.device`'s service discipline), for a read
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
def _shared_pool(n_jobs, n_workers, start, jobs, reads, workers, pilot, dev, drives, usage, share):
    """The reader pool (:func:`_reader_pool`: the same workers, jobs and prefetch thread) on shared
    drives (:mod:`replay.model.device`'s service discipline), as an event simulation: a read's
    completion depends on the reads issued after it, so it is known only when it happens.

    Events, earliest first (on a tie: a read leaving a channel, then one entering, then an issue):
    an issuer (a worker, or the prefetch thread when its next load is queued and it is free first)
    issues its next read, which holds a command slot on each member for the latency ``a``
    (:func:`_command`); its bytes there then enter the member's channel; the ``n``
    reads in a channel share its rate ``C`` fairly, each passing ``min(cap, level)`` of its work
    per s (its bytes and its requests' channel time, :func:`_shared_issue`; ``level`` such that
    the rates add up to ``C``, or unbounded when the caps do not reach it:
    :func:`_member_events`); a read completes when its work has left every member's channel,
    its issuer is then free (after its job's page-cache tail, when it was the job's last read).
    Runs until every demand job is done and the prefetch thread's read in flight, if any, has
    completed (the prefetch thread issues no read after the last demand job: its remaining loads
    are :func:`_pilot_rest`'s). A channel serves nothing before the reads issued before the pool
    have left it (``drives.free``), which then holds when this pool's last read left.
    """
    job_read, wfree, wjob, wpos = jobs.first_read, workers.free, workers.job, workers.pos
    rem, enter = share.rem, share.enter
    W = min(n_workers, n_jobs)
    P = len(share.parts) - 1                     # the prefetch thread's issuer index
    M = dev.members
    for w in range(W):
        wfree[w], wjob[w], wpos[w] = start, -1, 0
    for m in range(M):
        share.clock[m], share.active[m] = max(start, drives.free[m]), 0
        share.last[m] = drives.free[m]
        share.next_done[m], share.next_enter[m] = np.inf, np.inf
        for j in range(P + 1):
            enter[m, j], rem[m, j] = np.inf, np.inf
    share.busy[0] = 0.0
    next_job, left, pilot_busy = 0, n_jobs, False
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
            if not pilot_busy and pilot.state[PILOT_NEXT] < pilot.state[PILOT_END] and pilot.free[0] <= ti:
                w, ti = P, pilot.free[0]
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
                if jc == P:
                    pilot_busy = False
                left -= _shared_read_done(jc, P, tc, True, jobs, workers, pilot, drives, usage, share)
        elif te <= ti:
            je = share.enter_by[me]
            _advance_channel(share, me, te)
            rem[me, je] = share.size[me, je]
            share.active[me] += 1
            enter[me, je] = np.inf
            _member_events(share, me, _channel_rate(dev, me))
        else:
            if w == P:
                r = job_read[pilot.state[PILOT_NEXT]] + pilot.state[PILOT_POS]
            else:
                if wjob[w] < 0:
                    wjob[w], wpos[w] = next_job, 0
                    next_job += 1
                r = job_read[wjob[w]] + wpos[w]
            if reads.warm[r] or not _shared_issue(w, r, ti, reads, dev, drives, usage, share):
                left -= _shared_read_done(w, P, ti + reads.length[r] / MEMORY_BANDWIDTH, False, jobs, workers, pilot,
                                          drives, usage, share)
            else:
                if w == P:
                    pilot_busy = True
                    pilot.free[0] = np.inf
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
    """Issuer ``j`` issues drive read ``r`` at ``t`` (s) in :func:`_shared_pool`: split over the
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
def _shared_read_done(j, P, d, drive, jobs, workers, pilot, drives, usage, share):
    """Issuer ``j``'s read completed at ``d`` (s; a ``drive`` read, or a warm one): the array's busy
    time when it was the last drive read in flight, then the issuer's job as :func:`_reader_pool`
    and :func:`_pilot_read` keep it. Returns 1 when a demand job completed, else 0."""
    if drive:
        share.busy[0] -= 1
        if share.busy[0] == 0:
            _count_busy(share.busy[1], d, drives, usage)
    if j == P:
        state = pilot.state
        job = state[PILOT_NEXT]
        state[PILOT_POS] += 1
        if jobs.first_read[job] + state[PILOT_POS] == jobs.first_read[job + 1]:
            d += jobs.tail[job]
            jobs.done[job] = d
            state[PILOT_NEXT], state[PILOT_POS] = job + 1, 0
        pilot.free[0] = d
        return 0
    job = workers.job[j]
    workers.pos[j] += 1
    last = jobs.first_read[job] + workers.pos[j] == jobs.first_read[job + 1]
    if last:
        d += jobs.tail[job]
        jobs.done[job] = d
        workers.job[j] = -1
    workers.free[j] = d
    return 1 if last else 0


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


@njit(**HELPER)
def _compute_thread(i, li, k, miss, resident, lay, pol, dev, jobs, out):
    """The compute thread runs resident work, then, in issue order, waits for each missing expert
    and runs its matmul (only the bottom part when its top is resident). Stall is the time it
    waits, on that critical path. The oracle's thread does the same with bytes streaming at the
    array's full bandwidth with no per-request cost. Returns when the layer's compute ends (s).

    Under ``pol.routing_order`` it runs the union in routing order instead: before each miss the
    resident work routed before it (``miss.pre``), the rest after the last miss. Under
    ``pol.blocking`` (colibrì's PIPE=0) it first waits until every miss has arrived (the whole
    wait is charged to the miss that arrived last), then runs all the layer's matmuls; its oracle
    waits for all the bytes streamed at full bandwidth."""
    if pol.blocking:
        return _blocked_compute(i, li, k, miss, resident, lay, dev, jobs, out)
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
        streamed += miss.wlen[p] + (miss.sbytes[p] if miss.first[p] else 0)
        wait = max(streamed / dev.full_bandwidth - t_oracle, 0.0)
        t_oracle = t_oracle + wait + comp
        oracle += wait
    res.stall[i] = stall
    res.oracle_stall[i] = oracle
    if routed:
        t += max(resident - done_pre, 0.0)
    return t


@njit(**HELPER)
def _blocked_compute(i, li, k, miss, resident, lay, dev, jobs, out):
    """:func:`_compute_thread` under colibrì's PIPE=0: the thread is blocked from routing until
    the last of the layer's ``k`` misses has arrived, then runs the resident work and every
    miss's matmul. Returns when the layer's compute ends (s)."""
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
        streamed += miss.wlen[p] + (miss.sbytes[p] if miss.first[p] else 0)
    if last >= 0:
        miss.wait[last] = ready_all
        res.expert_wait[li, miss_e[last]] += ready_all
    res.stall[i] = ready_all
    res.oracle_stall[i] = streamed / dev.full_bandwidth
    return ready_all + resident + comps


@njit(**HELPER)
def runtime_rule(pol, table):
    """Whether the prefetcher runs as the runtime does: top-K with none of the controls (byte or
    adaptive budget, per-source caps, stale cancellation, backoff). Then it queues its loads when
    the layer is routed, beside the layer's demand loads (colibrì's ``couple_prefetch`` right after
    the router); a controlled prefetcher keeps demand's strict priority and starts once the
    layer's demand loads are done (seed 5.3)."""
    return (pol.prefetch != 0 and pol.admission == TOP_K and pol.prefetch_bytes == 0 and not pol.adaptive_budget
            and not pol.cancel_stale and not pol.backoff and not table.fusion.caps)


@njit(**STAGE)
def _top_k(i, li, inst, table, pol, pending):
    """The top-K rule's list for layer ``li`` (the next one) while instance ``i`` runs, into
    ``pending.experts``: :func:`replay.model.prefetch.predict_next` for the oracle and coupled sources
    (the runtime's own lists), the K most probable for the others. Returns its length."""
    src = table.source
    if pol.prefetch == ORACLE or pol.prefetch == COUPLED:
        return predict_next(pol.prefetch, i, li - 1, inst.sel_start, inst.sel_e, inst.sel_mult, src.targets,
                            src.counts, pol.prefetch_experts, pending.score, pending.touched, pending.experts)
    if src.kind == FUSED:                        # several sources: their fused probability, each expert credited
        fused_probabilities(table.sources, src, table.fusion.coef, table.fusion.credit, i, li, inst)
    else:
        next_layer_probabilities(src, i, li, inst)
    return most_probable(src.p, pol.prefetch_experts, pending.experts)


@njit(**STAGE)
def _queue_at_routing(i, li, inst, table, ram, lay, pol, pending, plan, single, jobs, reads, n_jobs, pilot,
                      out):
    """Queue the prefetch thread's loads for layer ``li`` (the next one) when instance ``i`` is
    routed, under :func:`runtime_rule`: the top-K list (:func:`_top_k`) less the experts in RAM
    (the runtime checks residency when it queues), each planned as one job (its weights and its
    scales, :func:`replay.model.readplan.plan_layer`, the scales through the page cache) after the
    demand jobs ``[0, n_jobs)``. The list stays in ``pending.experts``; ``pilot`` gets the jobs
    and, per load, where the page cache's undo log stood before it."""
    pf_list = pending.experts
    n = _top_k(i, li, inst, table, pol, pending)
    lru = ram.lru
    n_reads = jobs.first_read[n_jobs]
    job = n_jobs
    for p in range(n):
        e = pf_list[p]
        if ram.pinned[li, e] or lru.cached[li, e]:
            continue
        q = job - n_jobs
        pf_list[q] = e
        pilot.mark[q] = checkpoint(ram.pages)
        jobs.first_read[job] = n_reads
        n_plan, n_reads, jobs.tail[job], total = _plan_load(li, e, lay, pol, plan, single, ram.pages, ram.weights, reads,
                                                            n_reads)
        n_reads = _close_job(job, jobs.first_read, n_reads, reads)
        pilot.n_plan[q], pilot.nbytes[q] = n_plan, total
        job += 1
    jobs.first_read[job] = n_reads
    pilot.state[PILOT_END] = job


@njit(**STAGE)
def _plan_load(li, e, lay, pol, plan, single, pages, weights, reads, n_reads):
    """Plan one prefetch load of expert ``e`` of layer ``li`` (read alone, never coalesced: its
    weights and its scales, :func:`replay.model.readplan.plan_layer`) into ``reads`` from ``n_reads``
    on, its scale preads through the page cache ``pages`` as :func:`_plan_reads` does. Returns
    the preads planned, the reads queued so far, the page-cache time after its drive reads (warm
    weights and scales, s) and its bytes. Its weights come from the page cache ``weights`` when
    it holds them; they enter it when the load completes (:func:`_record_load`)."""
    single.expert[0], single.top[0] = e, lay.top_resident[li, e]
    n_plan, _ = plan_layer(single.expert, 1, single.skip, single.top, 1.0 - lay.top_fraction[li], lay.adjacent[li],
                           lay.pos_file[li], lay.pos_off[li], lay.wbytes[li], lay.wloc[li], lay.sloc[li], False, 0, 1,
                           single.wlen, plan)
    bases = lay.bases
    tail, warm_scales, has_warm_scales, total = 0.0, 0, False, 0
    settled = scales_settled(pages, li, e)
    cached = wc_hit(weights, li, e)
    for r in range(n_plan):
        f, nb = plan.file[r], plan.length[r]
        if plan.kind[r] == WEIGHT and cached:
            tail += nb / MEMORY_BANDWIDTH
        elif plan.kind[r] == WEIGHT:
            n_reads, tail, nb = _weight_read(f, plan.offset[r], nb, bases, pol, n_reads, tail, reads)
        else:
            n_reads, queued = _scale_read(f, plan.offset[r], nb, settled, pages, bases, n_reads, reads)
            if not queued:
                warm_scales += nb
                has_warm_scales = True
        total += nb
    return n_plan, n_reads, tail + (warm_scales / MEMORY_BANDWIDTH if has_warm_scales else 0.0), total


@njit(**STAGE)
def _pilot_rest(deadline, jobs, reads, pilot, dev, drives, usage):
    """The prefetch thread's reads after the layer's last demand read, until ``deadline`` (the
    next layer is routed, s): a load not started by then is dropped, one under way completes."""
    state = pilot.state
    while state[PILOT_NEXT] < state[PILOT_END]:
        if state[PILOT_POS] == 0 and pilot.free[0] >= deadline:
            return
        _pilot_read(jobs, reads, pilot, dev, drives, usage)


@njit(**STAGE)
def _pilot_outcome(i, li, deadline, lay, pending, ram, jobs, pilot, out):
    """What the loads queued at routing for layer ``li`` came to, once the next layer is routed at
    ``deadline`` (s): a started load completed (:func:`_pilot_rest`): its ready time goes into
    ``pending`` in the next instance's clock and, when it completed before ``deadline``, it
    enters the LRU; a dropped one counts as cancelled and its scale reads are undone in the page
    cache (:func:`replay.model.pagecache.undo`). Keeps the
    loaded experts first in ``pending.experts``, in load order (:func:`_record_load`); returns how
    many."""
    pf = out.prefetch
    pf_list = pending.experts
    first, started = pilot.state[PILOT_FIRST], pilot.state[PILOT_NEXT]
    loaded = 0
    n = pilot.state[PILOT_END] - first
    if started < first + n:
        undo(ram.pages, pilot.mark[started - first])
    stop_logging(ram.pages)
    for q in range(n):
        e = pf_list[q]
        if first + q >= started:
            pf.cancelled[i] += 1
            continue
        note_settled(ram.pages, li, e, lay.sloc[li, e])
        loaded = _record_load(i, li, e, pilot.n_plan[q], pilot.nbytes[q], jobs.done[first + q], deadline, lay, pending,
                              ram.lru, ram.weights, out, loaded)
    return loaded


@njit(**HELPER)
def _record_load(i, li, e, n_plan, nbytes, done, deadline, lay, pending, lru, weights, out, loaded):
    """A prefetch load of expert ``e`` of layer ``li`` for instance ``i``, ``n_plan`` preads of
    ``nbytes``, completed at ``done`` (s): count it, keep its ready time in the next instance's
    clock (that layer is routed at ``deadline``, s), list it ``loaded``-th in ``pending.experts``
    and, when it completed before ``deadline``, put it in the LRU. Its weights enter the page
    cache ``weights`` (buffered reads). Returns the loads listed."""
    res, pf = out.instance, out.prefetch
    res.reads[i] += n_plan
    res.read_bytes[i] += nbytes
    pending.ready[e] = done - deadline
    pending.nbytes[e] = lay.ebytes[li, e]
    pf.loads[i] += 1
    pf.issued[i] += pending.nbytes[e]
    pending.experts[loaded] = e
    wc_add(weights, li, e)
    if done <= deadline:
        lru_add(lru, li, e)
    return loaded + 1


@njit(**STAGE)
def _prefetch(i, li, start, deadline, inst, table, ram, lay, pol, dev, pending, plan, single, reads, drives,
              out):
    """A controlled prefetcher's loads for layer ``li``, the next one, while instance ``i`` runs
    (the runtime's own rule queues its loads at routing instead: :func:`_queue_at_routing`).

    Under ``top-k`` it takes the rule's list (:func:`_top_k`) and skips the experts already in
    RAM, keeping, with a byte budget, the adaptive budget or per-source caps, those
    that fit (:func:`replay.model.admission.admit_listed`); under the other policies it admits
    candidates under the budgets (:func:`replay.model.admission.choose`); under ``observe`` it only records the late-need
    probabilities q of layer ``li`` for scoring. With backoff, a backed-off layer loads nothing
    (:func:`replay.model.admission.backed_off`). It loads the list one at a time, in order, from
    ``start`` (this layer's demand loads and the prefetch load in flight at routing done, s)
    until ``deadline`` (the next layer is routed, s): a load not started by then is dropped, one
    in flight completes (with ``cancel_stale``, a load the next layer does not select issues no
    read after ``deadline``: it is cut, its bytes already read are wasted and its scale reads are
    undone in the page cache). A load reads the expert's weights and its scales (through the page
    cache); it enters the LRU when it
    completes before the deadline. Records each expert's ready time in the next instance's clock
    in ``pending`` and returns how many were loaded; dropped and cut loads count as cancelled.
    """
    pf_list = pending.experts
    src, ctl, fusion = table.source, table.control, table.fusion
    res, pf = out.instance, out.prefetch
    if backed_off(li, pol, ctl):
        return 0
    if pol.admission == TOP_K:
        n = _top_k(i, li, inst, table, pol, pending)
        if pol.prefetch_bytes > 0 or pol.adaptive_budget or fusion.caps:
            n = admit_listed(i, li, start, deadline, n, pf_list, ram, lay, pol, dev, drives, ctl, table.charge, pf)
    else:
        n_touched = -1
        if src.kind == FUSED:                    # several sources: their fused probability, each expert credited
            fused_probabilities(table.sources, src, fusion.coef, fusion.credit, i, li, inst)
        else:
            n_touched = next_layer_probabilities(src, i, li, inst)
        if pol.admission == OBSERVE:
            _late_need(li, src.p, ram, ctl)
            ctl.q_for[0] = i + 1
            return 0
        n = choose(i, li, start, deadline, inst, src, n_touched, ram, lay, pol, dev, drives, ctl, table.charge,
                   pf_list, pf)
    lru = ram.lru
    a, b = inst.sel_start[i + 1], inst.sel_start[i + 2]
    t = start
    loaded = 0
    for p in range(n):
        e = pf_list[p]
        if ram.pinned[li, e] or lru.cached[li, e]:
            continue
        if t >= deadline:
            for r in range(p, n):
                if not (ram.pinned[li, pf_list[r]] or lru.cached[li, pf_list[r]]):
                    pf.cancelled[i] += 1
            break
        mark = checkpoint(ram.pages)
        n_plan, n_reads, tail, total = _plan_load(li, e, lay, pol, plan, single, ram.pages, ram.weights, reads, 0)
        stale = pol.cancel_stale and not _selected(e, inst.sel_e, a, b)
        issued, issued_bytes = n_reads, 0
        for r in range(n_reads):
            if stale and t >= deadline:
                issued = r
                break
            t = _serve_read(reads.addr[r], reads.length[r], reads.warm[r], t, dev, drives, out.device)
            issued_bytes += reads.length[r]
        if issued < n_reads:                      # cut: routed without it
            undo(ram.pages, mark)
            stop_logging(ram.pages)
            res.reads[i] += issued
            res.read_bytes[i] += issued_bytes
            pf.issued[i] += issued_bytes
            pf.cancelled[i] += 1
            continue
        stop_logging(ram.pages)
        note_settled(ram.pages, li, e, lay.sloc[li, e])
        t += tail
        loaded = _record_load(i, li, e, n_plan, total, t, deadline, lay, pending, lru, ram.weights, out, loaded)
    return loaded


@njit(**HELPER)
def _late_need(nl, p, ram, ctl):
    """Record q, the late-need probability (seed 5.2), of every expert of layer ``nl``: its
    probability times the layer's measured late share of demand misses, 0 when in RAM."""
    lam = ctl.late_frac[nl]
    for e in range(len(p)):
        ctl.q_pending[e] = 0.0 if ram.pinned[nl, e] or ram.lru.cached[nl, e] else p[e] * lam


@njit(**HELPER)
def _feedback(i, li, k, miss, lay, pol, dev, ctl, out):
    """What instance ``i``'s demand misses cost, for the controller (:func:`replay.model.admission.record_demand`);
    under ``observe``, score the late-need probabilities recorded for it: a candidate's event is
    "a demand miss the compute thread waited for"."""
    late, n, wait, load = 0, 0, 0.0, 0.0
    scoring = ctl.q_for[0] == i
    for p in range(k):
        if miss.ready[p] >= 0:                   # it waited for a prefetch in flight, not a demand load
            continue
        n += 1
        if miss.wait[p] > 0:
            late += 1
            wait += miss.wait[p]
            load += load_seconds(li, miss.expert[p], miss.first[p], lay, pol, dev)
            if scoring:
                ctl.waited[miss.expert[p]] = True
    record_demand(li, late, n, wait, load, ctl)
    if scoring:
        pf = out.prefetch
        for e in range(len(ctl.waited)):
            add_reliability(ctl.q_pending[e], ctl.waited[e], pf.late_n, pf.late_p, pf.late_y, pf.late_sq)
            ctl.waited[e] = False
        ctl.q_for[0] = -1


@njit(**HELPER)
def _prefetch_outcome(i, li, inst, pending, pf_n, lay, pol, dev, ctl):
    """The measured stall-conversion of the prefetches made for instance ``i`` (for backoff,
    :func:`replay.model.admission.record_outcome`): the estimated stall the used ones removed (lambda x
    rho x the part of their load time done before routing) less the drive time the unused ones
    held after routing."""
    saved, wasted = 0.0, 0.0
    a, b = inst.sel_start[i], inst.sel_start[i + 1]
    for p in range(pf_n):
        e = pending.experts[p]
        r = pending.ready[e]
        if _selected(e, inst.sel_e, a, b):
            s = load_seconds(li, e, False, lay, pol, dev)
            saved += ctl.late_frac[li] * ctl.cost_ratio[li] * min(s, max(s - r, 0.0))
        else:
            wasted += max(r, 0.0)
    record_outcome(li, saved, wasted, ctl)
