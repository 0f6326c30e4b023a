"""The compiled model's loop: every (forward, layer) instance of a chunk, in time order.

An instance is a small sequential event simulation (a handful of jobs of a few reads each) and a
trace holds hundreds of thousands of them, so a plain loop compiled with numba is both the
clearest form of the model and several times faster than vectorising across instances.
:func:`simulate_instances` walks them, carrying the RAM tiers, the drives and the pending
prefetches from one to the next, and calls the stages: the demand path
(:mod:`replay.model.demand`), the reader pool (:mod:`replay.model.readers`) and the prefetch thread
(:mod:`replay.model.prefetching`). Its inputs and working arrays are the named tuples of
:mod:`replay.model.state`; its outputs :class:`replay.model.engine.Results`, filled in place. The
model is specified in docs/MODEL.md. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.model.controller import TOP_K
from replay.model.demand import compute_thread, plan_reads, select_misses
from replay.model.jit import HELPER, LOOP, STAGE, fetch_lines
from replay.model.pagecache import start_session
from replay.model.predictors import FUSED, observe_sources, observe_union
from replay.model.prefetch import COUPLED
from replay.model.prefetching import (
    controlled_prefetch,
    feedback,
    pilot_outcome,
    pilot_rest,
    prefetch_outcome,
    queue_at_routing,
    runtime_rule,
)
from replay.model.readers import reader_pool, shared_pool
from replay.model.runtime import heat_route, lru_start
from replay.model.state import PILOT_END, PILOT_FIRST, PILOT_NEXT, Inputs, Pool


@njit(**LOOP)
def simulate_instances(inst, ram, table, lay, pol, dev, work, out):
    """Time every instance of ``inst`` (:class:`replay.model.unions.Instances`), in order.

    Instance ``i`` is layer ``inst.layer[i]`` of forward ``inst.forward[i]`` of session
    ``inst.session[i]``; its union experts are ``inst.sel_e[inst.sel_start[i]:inst.sel_start[i+1]]``,
    each needed by ``inst.sel_mult`` positions. ``ram`` (:class:`replay.model.state.RamTiers`) is updated as the
    replay goes; ``table`` (:class:`replay.model.controller.Prefetcher`) feeds the prefetcher. ``work``
    (:func:`replay.model.state.new_work`, sized for the largest batch union) is the caller's and carries the drives'
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
    x = Inputs(inst, ram, table, lay, pol, dev)
    jobs, reads, drives, pending = work.jobs, work.reads, work.drives, work.pending
    pilot = work.pilot
    pool = Pool(jobs, work.workers, pilot, drives, work.share)
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
        if pf_for != i:
            pf_n = 0
        if pol.prefetch == FUSED:
            observe_sources(table.sources, li, inst_fwd[i], inst_session[i], inst.sel_e, inst.sel_start[i],
                            inst.sel_start[i + 1])
        elif pol.prefetch != 0:
            observe_union(table.source, li, inst_fwd[i], inst_session[i], inst.sel_e, inst.sel_start[i],
                          inst.sel_start[i + 1])
        heat_route(ram.heat, li, inst_session[i], inst.sel_e, inst.sel_mult, inst.sel_start[i], inst.sel_start[i + 1])
        k, resident = select_misses(i, li, x, work, pf_n, out)
        if pol.backoff and pf_n > 0:
            prefetch_outcome(i, li, pf_n, x, work)
        pilot_free = 0.0                         # when the prefetcher's load in flight at routing completes
        for p in range(pf_n):
            pilot_free = max(pilot_free, pf_ready[pf_list[p]])
            pf_ready[pf_list[p]] = np.inf
        if pol.layer_barrier and pilot_free > 0.0:   # the whole layer waits for it: other time, not stall
            out.prefetch.barrier[i] = pilot_free
            _advance(drives, dev, pilot_free)
            pilot_free = 0.0
        has_next = i + 1 < I and inst_fwd[i + 1] == inst_fwd[i] and inst_li[i + 1] == li + 1
        n_jobs, end = 0, resident
        jobs.first_read[0] = 0
        if k > 0:
            n_jobs = plan_reads(i, li, k, x, work, res)
        pilot.state[PILOT_FIRST], pilot.state[PILOT_NEXT], pilot.state[PILOT_END] = n_jobs, n_jobs, n_jobs
        pilot.free[:] = pilot_free
        pilot.job[:] = -1
        if at_routing and has_next:              # the runtime queues L+1's predictions when L is routed
            lru_start(lru, li + 1, inst_session[i])
            queue_at_routing(i, li + 1, x, work, n_jobs, out)
        if k > 0:
            start = pilot_free + pol.handoff if n_jobs > 0 else pilot_free    # the loader pool's handoff
            if dev.shared:
                shared_pool(n_jobs, pol.workers, start, pool, reads, dev, usage)
            else:
                reader_pool(n_jobs, pol.workers, start, pool, reads, dev, usage)
            end = compute_thread(i, li, k, resident, n_jobs, x, work, out)
            for j in range(n_jobs):
                out.prefetch.demand_done[i] = max(out.prefetch.demand_done[i], job_done[j])
        if learning:
            feedback(i, li, k, x, work, out)
        if pol.prefetch == 0:
            for m in range(dev.members):
                mfree[m], sfree[m] = 0.0, 0.0
                for q in range(dev.queue_slots):
                    slots[m, q] = 0.0
            host[0], host[1] = 0.0, 0.0
            drives.busy[0] = 0.0
            drives.copies[:] = 0.0
            continue
        next_at = end + pol.dense_seconds      # the next layer is routed then: later loads are dropped
        pf_n = 0
        if at_routing and has_next:
            pilot_rest(next_at, jobs, reads, pilot, dev, drives, usage)
            pf_n = pilot_outcome(i, li + 1, next_at, x, work, out)
            pf_for = i + 1
        elif has_next:
            # a controlled prefetcher starts once this layer's demand loads, and its own load in flight, are done
            start = pilot_free
            for j in range(n_jobs):
                start = max(start, job_done[j])
            lru_start(lru, li + 1, inst_session[i])
            pf_n = controlled_prefetch(i, li + 1, start, next_at, x, work, out)
            pf_for = i + 1
        _advance(drives, dev, next_at)          # the drives' state, in the next instance's clock
    for m in range(dev.members):
        usage.transfer_seconds[m] = drives.member_bytes[m] / dev.m_bandwidth[m]


@njit(**HELPER)
def _advance(drives, dev, dt):
    """Move the drives' and the cores' state ``dt`` seconds on: their times, in a clock that
    starts ``dt`` later (a time already past becomes 0)."""
    for m in range(dev.members):
        drives.free[m], drives.small_free[m] = max(drives.free[m] - dt, 0.0), max(drives.small_free[m] - dt, 0.0)
        for q in range(dev.queue_slots):
            drives.slots[m, q] = max(drives.slots[m, q] - dt, 0.0)
    drives.host[0], drives.host[1] = max(drives.host[0] - dt, 0.0), max(drives.host[1] - dt, 0.0)
    drives.busy[0] = max(drives.busy[0] - dt, 0.0)
    for c in range(len(drives.copies)):
        drives.copies[c] = max(drives.copies[c] - dt, 0.0)


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

