"""The compiled model's inputs and working state, as named tuples of arrays and numbers.

numba passes a named tuple to compiled code field by field, as if each were an argument, so the
model's stages take these bundles instead of long argument lists. :func:`new_work` allocates the
working arrays once per replay, sized by the largest batch union. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.jit import LOOP
from replay.model.readplan import ReadPlan

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
                                      "min_probability cancel_stale adaptive_budget backoff blocking routing_order "
                                      "team_held_cores handoff copy_cores pilot_precision couple_experts evict_guard prefetch_hints layer_barrier "
                                      "short_forwards")
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
resident work first); ``team_held_cores`` (cores the OpenMP team keeps from page-cache copies:
when not 0, copies run only on the cores it leaves, and beside the matmuls only on those the
matmuls leave, :func:`replay.model.demand.compute_thread`); ``handoff`` (s: what handing a
block of demand loads to the loader pool costs, before its first load starts and on the core
its copies take, 0 none: ``RuntimeConfig.loaders_on_compute_core``); ``copy_cores`` (the cores copies may
use, the machine's less those; 0: copies not bounded); ``pilot_precision`` (the pilot source's
share of correct predictions, 0-1: :func:`replay.model.prefetch.predict_next`); ``couple_experts``
(COUPLE_K: the pair table's best experts queued after the pilot's, 0 none); ``evict_guard`` (a
prefetch load may evict a warm expert only when clearly hotter: :func:`replay.model.runtime.guard_protects`);
``prefetch_hints`` (the prefetch thread's loads are page-cache hints: colibrì's ``PILOT=1`` or
``COUPLE`` without ``PILOT_REAL``); ``layer_barrier`` (a layer waits, whole, for the prefetch
load in flight on it, as other time, and every started load enters the LRU: colibrì's
``PILOT_REAL``); ``short_forwards`` (the prefetch thread works for forwards of at most
:data:`replay.model.prefetching.PILOT_MAX_POSITIONS` positions only: every colibrì configuration)."""

Device = namedtuple("Device", "members chunk rule request_seconds bandwidth queue_slots host_bandwidth full_bandwidth "
                               "stream_bandwidth max_request shared request_channel m_request m_bandwidth m_stream "
                               "m_channel seg_start seg_drive memory_bandwidth unaligned_memory_bandwidth")
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
empty otherwise); ``memory_bandwidth`` and ``unaligned_memory_bandwidth`` (bytes/s one thread
copies a page-cache hit into its read buffer at, when the hit starts on a cache line and when not:
:func:`replay.model.device.copy_seconds`)."""

RamTiers = namedtuple("RamTiers", "pinned lru pages heat")
"""What is in RAM, carried from instance to instance: ``pinned`` [L, E] bool (the pinned store),
``lru`` (the per-layer LRUs, :class:`replay.model.runtime.Lru`), ``pages`` (the page cache under the
buffered scale reads and, when it has memory for them, the weight reads, with the kernel's
readahead: :class:`replay.model.pagecache.PageCache`), ``heat`` (how often and how recently the session routed each expert: :class:`replay.model.runtime.Heat`)."""

Inputs = namedtuple("Inputs", "inst ram table lay pol dev")
"""What one call of the compiled loop reads, bundled for its stages: the instances
(:class:`replay.model.unions.Instances`), the :class:`RamTiers`, the prefetcher
(:class:`replay.model.controller.Prefetcher`: a prediction source and the controller's state),
the :class:`LayoutArrays`, the :class:`ReadPolicy` and the :class:`Device`."""

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
this one, s); ``cached`` (every page of its weight reads was in the page cache when they were planned:
:mod:`replay.model.pagecache`)."""

Jobs = namedtuple("Jobs", "first_read tail done")
"""The reader pool's jobs [2K]: ``first_read`` [2K+1] (each job's first read; one past the
last), ``tail`` (its page-cache copies after its reads, s: one copy on one core,
:func:`replay.model.readers.copy_done`), ``done`` (its completion time, s)."""

Reads = namedtuple("Reads", "addr length warm")
"""Queued preads [R]: logical address and length (bytes), and ``warm`` (served from RAM)."""

Workers = namedtuple("Workers", "free job pos")
"""The reader pool [W]: each worker's free time (s), its job (-1 idle) and next read in it."""

Drives = namedtuple("Drives", "free small_free host busy pieces nbytes member_bytes slots head copies")
"""The drives' state, and the cores' copies, carried between instances when a prefetch source runs. Per member [M]:
the large-transfer and small-read channels' free times (s); ``host`` [2]: the host link's large
and small channels' free times (s); ``busy`` [1]: until when the array has a read outstanding
(s); ``pieces``, ``nbytes`` [M]: one read's split (scratch);
``member_bytes`` [M]: bytes each member transferred over the whole replay; ``slots`` [M, Q]:
when each of a member's queue slots frees (s), a ring sorted by that time from ``head`` [M]
(the slot that frees first) on, so a request takes its slot in one step (:func:`replay.model.readers._take_slot`).
``copies`` [C]: when each of the machine's ``C`` copy slots (its cores, ``RuntimeConfig.cpu_cores``)
frees (s); empty: copies are not bounded (:func:`replay.model.readers.copy_done`)."""

Prefetched = namedtuple("Prefetched", "ready nbytes experts score touched")
"""Prefetches made for the next instance. Per expert [E]: ``ready`` (in the next instance's
clock, s; inf: none), ``nbytes`` (expert bytes). ``experts`` [64]: the list, in load order.
``score``, ``touched`` [E]: the predictor's scratch (:func:`replay.model.prefetch.predict_next`)."""

Single = namedtuple("Single", "expert skip top wlen")
"""One prefetch load as :func:`replay.model.readplan.plan_layer` takes it: arrays [1]."""

Pilot = namedtuple("Pilot", "state free job pos mark n_plan nbytes")
"""The prefetch threads' loads queued at routing (:func:`replay.model.prefetching.queue_at_routing`), as jobs after the
layer's demand jobs, taken in queue order by the first thread free (colibrì's ring: one thread, or
PILOT_WORKERS under PILOT_REAL). ``state`` [3]: the first of its jobs, the next no thread has taken,
one past the last. Per thread [T]: ``free`` (when it issues its next read, s), ``job`` (the job it
has under way, -1 none), ``pos`` (the next read's place in it). Per queued load [64]: the page
cache's undo-log position before it was planned (:func:`replay.model.pagecache.checkpoint`: a dropped
load's scale reads are undone), its planned preads and bytes."""

PILOT_FIRST, PILOT_NEXT, PILOT_END = 0, 1, 2

Sharing = namedtuple("Sharing", "enter size cap rem clock level active last next_done done_by next_enter enter_by "
                                 "parts issued busy")
"""Shared drives' channels while the reader pool runs (:func:`replay.model.readers.shared_pool`). Per member and
issuer [M, W+T] (the workers, then the prefetch threads), for the read the issuer has in flight:
``enter`` (when its bytes enter the member's channel, s; inf: not waiting), ``size`` (its work
on the member: its bytes and ``c C`` for each of its ``p`` requests, bytes), ``cap`` (its own rate
there, in work per s: its bytes in the time of its largest request at ``b_1``, ``p b_1`` when its
requests are equal), ``rem`` (work it still has to pass; inf: not in
the channel). Per member [M]: ``clock`` (s: ``rem`` is
as of then; the channel serves nothing before its first value: it is busy until then with reads
issued before the pool), ``level`` (the fair share, work/s: a read in the channel passes
``min(cap, level)``), ``active`` (reads in the channel), ``last`` (when its last read left, s),
and its next events as they stand (:func:`replay.model.readers._member_events`): ``next_done`` (s) when the first
read, issuer ``done_by``'s, leaves it, ``next_enter`` (s) when the first waiting one,
``enter_by``'s, enters it. Per issuer [W+T]: ``parts`` (members its read is still on),
``issued`` (s). ``busy`` [2]: drive reads in flight, and when the array last became busy (s)."""

Work = namedtuple("Work", "miss jobs reads workers drives pending plan single pilot share")
"""Every working array of one replay, carried over its :func:`replay.model.instance.simulate_instances` calls:
:class:`Misses`, :class:`Jobs`, :class:`Reads`, :class:`Workers`, :class:`Drives`, :class:`Prefetched`, the read plan
(:data:`replay.model.readplan.ReadPlan`), :class:`Single`, :class:`Pilot` and :class:`Sharing`."""

Pool = namedtuple("Pool", "jobs workers pilot drives share")
"""The reader pool's share of :class:`Work` (:mod:`replay.model.readers`): :class:`Jobs`,
:class:`Workers`, :class:`Pilot`, :class:`Drives`, :class:`Sharing`."""

Load = namedtuple("Load", "expert n_plan nbytes done")
"""One completed prefetch load: the ``expert``, its planned preads ``n_plan``, its bytes
``nbytes`` and its completion time ``done`` (s, this instance's clock)."""


@njit(**LOOP)
def new_work(K, E, W, M, Q, C, T=1):
    """Working arrays for batch unions of up to ``K`` experts out of ``E``, ``W`` workers, ``M``
    array members of ``Q`` queue slots, ``C`` cores for copies (0: copies not bounded) and ``T``
    prefetch threads. A job has at most three weight reads or one span, and three scale reads;
    the prefetch threads' queued loads, up to :data:`PREFETCH_SLOTS` of at most eight reads each,
    follow the demand jobs."""
    miss = Misses(np.empty(K, np.int64), np.empty(K, np.bool_), np.empty(K), np.empty(K, np.bool_), np.empty(K),
                  np.empty(K, np.int64), np.empty(K, np.int64), np.empty(K, np.bool_),
                  np.empty(K, np.int64), np.empty(K, np.int64), np.empty(K), np.zeros(K), np.zeros(K, np.bool_))
    J = 2 * K + PREFETCH_SLOTS
    jobs = Jobs(np.empty(J + 1, np.int64), np.empty(J), np.empty(J))
    R = max(8 * K, 7) + 8 * PREFETCH_SLOTS
    reads = Reads(np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.bool_))
    workers = Workers(np.empty(W), np.empty(W, np.int64), np.empty(W, np.int64))
    drives = Drives(np.zeros(M), np.zeros(M), np.zeros(2), np.zeros(1), np.empty(M, np.int64), np.empty(M, np.int64),
                    np.zeros(M, np.int64), np.zeros((M, Q)), np.zeros(M, np.int64), np.zeros(C))
    pending = Prefetched(np.full(E, np.inf), np.zeros(E, np.int64), np.empty(PREFETCH_SLOTS, np.int64),
                         np.zeros(E, np.int64), np.empty(E, np.int64))
    R = max(6 * K, 6)
    plan = ReadPlan(np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64),
                    np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64))
    single = Single(np.empty(1, np.int64), np.zeros(1, np.bool_), np.empty(1, np.bool_), np.empty(1, np.int64))
    pilot = Pilot(np.zeros(3, np.int64), np.zeros(T), np.full(T, -1, np.int64), np.zeros(T, np.int64),
                  np.empty(PREFETCH_SLOTS, np.int64),
                  np.empty(PREFETCH_SLOTS, np.int64), np.empty(PREFETCH_SLOTS, np.int64))
    share = Sharing(np.full((M, W + T), np.inf), np.zeros((M, W + T)), np.zeros((M, W + T)),
                    np.full((M, W + T), np.inf), np.zeros(M), np.zeros(M), np.zeros(M, np.int64), np.zeros(M),
                    np.full(M, np.inf), np.zeros(M, np.int64), np.full(M, np.inf), np.zeros(M, np.int64),
                    np.zeros(W + T, np.int64), np.zeros(W + T), np.zeros(2))
    return Work(miss, jobs, reads, workers, drives, pending, plan, single, pilot, share)


