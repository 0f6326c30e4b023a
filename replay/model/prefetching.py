"""The prefetch thread of the compiled model: what it loads for the next layer, and what that did.

Under the runtime's own rule (top-K, no controls: :func:`runtime_rule`) the loads are queued when
a layer is routed, beside its demand loads (:func:`queue_at_routing`, :func:`pilot_rest`,
:func:`pilot_outcome`); a controlled prefetcher (:func:`controlled_prefetch`: byte or adaptive
budget, caps, stale cancellation, backoff, or an admission policy other than top-K) starts once
the layer's demand loads are done. :func:`feedback` and :func:`prefetch_outcome` report what
the demand misses and the prefetches cost to the controller (:mod:`replay.model.controller`).
Units: bytes, seconds.
"""

from __future__ import annotations

from numba import njit

from replay.model.admission import admit_listed, choose
from replay.model.controller import OBSERVE, TOP_K, backed_off, load_seconds, record_demand, record_outcome
from replay.model.demand import close_job, is_selected, paged_weight_read, queue_pages, scale_read, weight_read
from replay.model.device import copy_seconds
from replay.model.jit import HELPER, STAGE
from replay.model.pagecache import (checkpoint, exact_read, note_settled, pages_cached, scales_settled,
                                    stop_logging, undo, weights_cached)
from replay.model.predictors import (
    FUSED,
    add_reliability,
    fused_probabilities,
    most_probable,
    next_layer_probabilities,
)
from replay.model.prefetch import COUPLED, ORACLE, PILOT, PairTable, RouterPilot, Scratch, Selections, predict_next
from replay.model.readers import copy_done, pilot_issuer, pilot_read, serve_read
from replay.model.readplan import WEIGHT, Coalescing, layer_place, plan_layer
from replay.model.runtime import guard_protects, lru_add
from replay.model.state import PILOT_END, PILOT_FIRST, PILOT_NEXT, Load


PILOT_MAX_POSITIONS = 8
"""colibrì prefetches for the next layer only in forwards of at most this many positions (``S<=8``
in ``moe()``: decode and short drafts, never a long prefill)."""


@njit(**HELPER)
def runtime_rule(pol, table):
    """Whether the prefetcher runs as the runtime does: top-K with none of the controls (byte or
    adaptive budget, per-source caps, stale cancellation, backoff). Then it queues its loads when
    the layer is routed, beside the layer's demand loads (colibrì's ``couple_prefetch`` right after
    the router); a controlled prefetcher keeps demand's strict priority and starts once the
    layer's demand loads are done."""
    return (pol.prefetch != 0 and pol.admission == TOP_K and pol.prefetch_bytes == 0 and not pol.adaptive_budget
            and not pol.cancel_stale and not pol.backoff and not table.fusion.caps)


@njit(**STAGE)
def _top_k(i, li, inst, table, pol, pending, heat):
    """The top-K rule's list for layer ``li`` (the next one) while instance ``i`` runs, into
    ``pending.experts``: :func:`replay.model.prefetch.predict_next` for the oracle, coupled and
    pilot sources (the runtime's own lists; ``heat``: the session's selections, [L, E]; with
    ``pol.couple_experts``, the pair table's best after the pilot's, as colibrì's
    ``couple_prefetch`` queues them after ``pilot_prefetch``'s), the K most probable for the
    others. Returns its length."""
    src = table.source
    if pol.prefetch == ORACLE or pol.prefetch == COUPLED or pol.prefetch == PILOT:
        union, pairs = Selections(inst.sel_start, inst.sel_e, inst.sel_mult), PairTable(src.targets, src.counts)
        scratch, out = Scratch(pending.score, pending.touched), pending.experts
        router = RouterPilot(pol.pilot_precision, inst.forward[i], inst.positions[i], heat)
        n = predict_next(pol.prefetch, i, li - 1, union, pairs, pol.prefetch_experts, scratch, out, router)
        if pol.couple_experts > 0 and n < len(out):  # COUPLE's list, queued after the pilot's, less what it holds
            m = predict_next(COUPLED, i, li - 1, union, pairs, min(pol.couple_experts, len(out) - n), scratch, out[n:],
                             router)
            kept = n
            for q in range(n, n + m):
                if not _listed(out, n, out[q]):
                    out[kept] = out[q]
                    kept += 1
            n = kept
        return n
    if src.kind == FUSED:                        # several sources: their fused probability, each expert credited
        fused_probabilities(table.sources, src, table.fusion.coef, table.fusion.credit, i, li, inst)
    else:
        next_layer_probabilities(src, i, li, inst)
    return most_probable(src.p, pol.prefetch_experts, pending.experts)


@njit(**HELPER)
def _listed(experts, n, e):
    """Whether ``e`` is among ``experts[:n]``."""
    for q in range(n):
        if experts[q] == e:
            return True
    return False


@njit(**STAGE)
def queue_at_routing(i, li, x, work, n_jobs, out):
    """Queue the prefetch thread's loads for layer ``li`` (the next one) when instance ``i`` is
    routed, under :func:`runtime_rule`: the top-K list (:func:`_top_k`) less the experts in RAM
    (the runtime checks residency when it queues), each planned as one job (its weights and its
    scales, :func:`replay.model.readplan.plan_layer`, the scales through the page cache) after the
    demand jobs ``[0, n_jobs)``. The list stays in ``pending.experts``; ``pilot`` gets the jobs
    and, per load, where the page cache's undo log stood before it. ``x``:
    :class:`replay.model.state.Inputs`; ``work``: :class:`replay.model.state.Work`.

    Under a colibrì configuration (``pol.short_forwards``) nothing is queued for a forward of
    more than :data:`PILOT_MAX_POSITIONS` positions. Under ``pol.prefetch_hints`` a load is a
    page-cache hint: only its drive reads, none for an expert whose pages are cached, no copy
    (and, under ``pol.direct``, its scales only). Under ``pol.evict_guard`` a load that would
    evict a warm expert the guard protects is dropped before it starts
    (:func:`replay.model.runtime.guard_protects`; counted in ``rejected``): the loads take the
    layer's free slots first, then evict its least recently used experts in turn."""
    ram, pending, jobs, reads, pilot = x.ram, work.pending, work.jobs, work.reads, work.pilot
    pf_list = pending.experts
    pol, lru = x.pol, ram.lru
    n_reads = jobs.first_read[n_jobs]
    job = n_jobs
    n = 0
    if not pol.short_forwards or x.inst.positions[i] <= PILOT_MAX_POSITIONS:
        n = _top_k(i, li, x.inst, x.table, pol, pending, ram.heat.count)
    free = lru.capacity[li] - lru.size[li]
    victim = lru.oldest[li]
    for p in range(n):
        e = pf_list[p]
        if ram.pinned[li, e] or lru.cached[li, e]:
            continue
        if pol.prefetch_hints and (pol.direct or weights_cached(ram.pages, x.lay.wloc[li, e])) and \
                scales_settled(ram.pages, li, e):
            continue                             # a hint for cached pages reads nothing
        if pol.evict_guard and lru.capacity[li] > 0:
            if free > 0:
                free -= 1
            elif victim < 0 or guard_protects(ram.heat, li, victim, e):    # no slot left to take, or a protected one
                out.prefetch.rejected[i] += 1
                continue
            else:
                victim = lru.newer[li, victim]
        q = job - n_jobs
        pf_list[q] = e
        pilot.mark[q] = checkpoint(ram.pages)
        jobs.first_read[job] = n_reads
        n_plan, n_reads, jobs.tail[job], total = _plan_load(li, e, x, work, n_reads)
        n_reads = close_job(job, jobs.first_read, n_reads, reads)
        pilot.n_plan[q], pilot.nbytes[q] = n_plan, total
        job += 1
    jobs.first_read[job] = n_reads
    pilot.state[PILOT_END] = job


@njit(**STAGE)
def _plan_load(li, e, x, work, n_reads):
    """Plan one prefetch load of expert ``e`` of layer ``li`` (read alone, never coalesced: its
    weights and its scales, :func:`replay.model.readplan.plan_layer`) into ``reads`` from ``n_reads``
    on, its scale preads through the page cache ``pages`` as :func:`replay.model.demand.plan_reads` does. Returns
    the preads planned, the reads queued so far, the page-cache time after its drive reads (warm
    weights and scales, s) and its bytes. When the page cache tracks weights its weight reads go
    through it too (:func:`replay.model.demand.paged_weight_read`; a hint's as ``MADV_WILLNEED``,
    :func:`replay.model.pagecache.exact_read`), logged like its scale reads."""
    lay, pol, pages = x.lay, x.pol, x.ram.pages
    plan, single, reads = work.plan, work.single, work.reads
    dev = x.dev
    single.expert[0], single.top[0] = e, lay.top_resident[li, e]
    n_plan, _ = plan_layer(single.expert, 1, single.skip, single.top, layer_place(lay, li), Coalescing(False, 0, 1),
                           single.wlen, plan)
    bases = lay.bases
    tail, scale_tail, total = 0.0, 0.0, 0
    settled = scales_settled(pages, li, e)
    paged = pages.weights[0] > 0
    hint = pol.prefetch_hints
    for r in range(n_plan):
        f, nb, off = plan.file[r], plan.length[r], plan.offset[r]
        if plan.kind[r] == WEIGHT and hint and (pol.direct or paged and pages_cached(pages, f, off, nb)):
            continue                             # a hint: no copy; O_DIRECT weights not hinted
        if plan.kind[r] == WEIGHT and paged and hint:
            waited, page = exact_read(pages, f, off, nb)
            n_reads = queue_pages(f, page, waited, bases, n_reads, reads)
        elif plan.kind[r] == WEIGHT and paged:
            n_reads, tail = paged_weight_read(f, off, nb, pages, dev, bases, n_reads, tail, reads)
        elif plan.kind[r] == WEIGHT:
            n_reads, tail, nb = weight_read(f, off, nb, bases, pol, dev, n_reads, tail, reads)
        else:
            n_reads, queued = scale_read(f, off, nb, settled, pages, bases, n_reads, reads)
            if not queued:
                scale_tail += copy_seconds(nb, off, dev)
        total += nb
    return n_plan, n_reads, 0.0 if hint else tail + scale_tail, total


@njit(**STAGE)
def pilot_rest(deadline, jobs, reads, pilot, dev, drives, usage):
    """The prefetch threads' reads after the layer's last demand read, until ``deadline`` (the
    next layer is routed, s): a load no thread has started by then is dropped, one under way
    completes."""
    while True:
        v, _ = pilot_issuer(pilot, deadline)
        if v < 0:
            return
        pilot_read(jobs, reads, pilot, v, dev, drives, usage)


@njit(**STAGE)
def pilot_outcome(i, li, deadline, x, work, out):
    """What the loads queued at routing for layer ``li`` came to, once the next layer is routed at
    ``deadline`` (s): a started load completed (:func:`pilot_rest`): its ready time goes into
    ``pending`` in the next instance's clock and, when it completed before ``deadline``, it
    enters the LRU; a dropped one counts as cancelled and its scale reads are undone in the page
    cache (:func:`replay.model.pagecache.undo`). Keeps the
    loaded experts first in ``pending.experts``, in load order (:func:`_record_load`); returns how
    many."""
    lay, ram, pending, jobs, pilot = x.lay, x.ram, work.pending, work.jobs, work.pilot
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
        loaded = _record_load(i, li, Load(e, pilot.n_plan[q], pilot.nbytes[q], jobs.done[first + q]), deadline, x, work,
                              out, loaded)
    return loaded


@njit(**STAGE)
def _record_load(i, li, load, deadline, x, work, out, loaded):
    """A prefetch load (:class:`replay.model.state.Load`) of expert ``e`` of layer ``li`` for
    instance ``i``, ``n_plan`` preads of ``nbytes``, completed at ``done`` (s): count it, keep its ready time in the next instance's
    clock (that layer is routed at ``deadline``, s), list it ``loaded``-th in ``pending.experts``
    and, when it completed before ``deadline`` or the layer waits for it (``pol.layer_barrier``),
    put it in the LRU (its pages entered the page cache when it was planned). Returns the loads listed."""
    e, n_plan, nbytes, done = load.expert, load.n_plan, load.nbytes, load.done
    lay, lru, pending = x.lay, x.ram.lru, work.pending
    res, pf = out.instance, out.prefetch
    res.reads[i] += n_plan
    res.read_bytes[i] += nbytes
    if x.pol.prefetch_hints:                     # a hint: its pages are in the page cache now, nothing else
        pf.loads[i] += 1
        pf.issued[i] += nbytes
        return loaded
    pending.ready[e] = done - deadline
    pending.nbytes[e] = lay.ebytes[li, e]
    pf.loads[i] += 1
    pf.issued[i] += pending.nbytes[e]
    pending.experts[loaded] = e
    if done <= deadline or x.pol.layer_barrier:
        lru_add(lru, li, e)
    return loaded + 1


@njit(**STAGE)
def controlled_prefetch(i, li, start, deadline, x, work, out):
    """A controlled prefetcher's loads for layer ``li``, the next one, while instance ``i`` runs
    (the runtime's own rule queues its loads at routing instead: :func:`queue_at_routing`).

    Under ``top-k`` it takes the rule's list (:func:`_top_k`) and skips the experts already in
    RAM, keeping, with a byte budget, the adaptive budget or per-source caps, those
    that fit (:func:`replay.model.admission.admit_listed`); under the other policies it admits
    candidates under the budgets (:func:`replay.model.admission.choose`); under ``observe`` it only records the late-need
    probabilities q of layer ``li`` for scoring. With backoff, a backed-off layer loads nothing
    (:func:`replay.model.controller.backed_off`). It loads the list one at a time, in order, from
    ``start`` (this layer's demand loads and the prefetch load in flight at routing done, s)
    until ``deadline`` (the next layer is routed, s): a load not started by then is dropped, one
    in flight completes (with ``cancel_stale``, a load the next layer does not select issues no
    read after ``deadline``: it is cut, its bytes already read are wasted and its scale reads are
    undone in the page cache). A load reads the expert's weights and its scales (through the page
    cache); it enters the LRU when it
    completes before the deadline. Records each expert's ready time in the next instance's clock
    in ``pending`` and returns how many were loaded; dropped and cut loads count as cancelled.
    """
    inst, table, ram, lay, pol, dev = x.inst, x.table, x.ram, x.lay, x.pol, x.dev
    pending, reads, drives = work.pending, work.reads, work.drives
    pf_list = pending.experts
    src, ctl, fusion = table.source, table.control, table.fusion
    res, pf = out.instance, out.prefetch
    if backed_off(li, pol, ctl):
        return 0
    if pol.admission == TOP_K:
        n = _top_k(i, li, inst, table, pol, pending, ram.heat.count)
        if pol.prefetch_bytes > 0 or pol.adaptive_budget or fusion.caps:
            n = admit_listed(i, li, start, deadline, n, x, work, pf)
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
        n = choose(i, li, start, deadline, x, work, n_touched, pf)
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
        n_plan, n_reads, tail, total = _plan_load(li, e, x, work, 0)
        stale = pol.cancel_stale and not is_selected(e, inst.sel_e, a, b)
        issued, issued_bytes = n_reads, 0
        for r in range(n_reads):
            if stale and t >= deadline:
                issued = r
                break
            t = serve_read(reads.addr[r], reads.length[r], reads.warm[r], t, dev, drives, out.device)
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
        t = copy_done(t, tail, drives.copies)
        loaded = _record_load(i, li, Load(e, n_plan, total, t), deadline, x, work, out, loaded)
    return loaded


@njit(**HELPER)
def _late_need(nl, p, ram, ctl):
    """Record q, the late-need probability, of every expert of layer ``nl``: its
    probability times the layer's measured late share of demand misses, 0 when in RAM."""
    lam = ctl.late_frac[nl]
    for e in range(len(p)):
        ctl.q_pending[e] = 0.0 if ram.pinned[nl, e] or ram.lru.cached[nl, e] else p[e] * lam


@njit(**STAGE)
def feedback(i, li, k, x, work, out):
    """What instance ``i``'s demand misses cost, for the controller (:func:`replay.model.controller.record_demand`);
    under ``observe``, score the late-need probabilities recorded for it: a candidate's event is
    "a demand miss the compute thread waited for"."""
    lay, pol, dev, ctl, miss = x.lay, x.pol, x.dev, x.table.control, work.miss
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


@njit(**STAGE)
def prefetch_outcome(i, li, pf_n, x, work):
    """The measured stall-conversion of the prefetches made for instance ``i`` (for backoff,
    :func:`replay.model.controller.record_outcome`): the estimated stall the used ones removed (lambda x
    rho x the part of their load time done before routing) less the drive time the unused ones
    held after routing."""
    inst, lay, pol, dev, ctl, pending = x.inst, x.lay, x.pol, x.dev, x.table.control, work.pending
    saved, wasted = 0.0, 0.0
    a, b = inst.sel_start[i], inst.sel_start[i + 1]
    for p in range(pf_n):
        e = pending.experts[p]
        r = pending.ready[e]
        if is_selected(e, inst.sel_e, a, b):
            s = load_seconds(li, e, False, lay, pol, dev)
            saved += ctl.late_frac[li] * ctl.cost_ratio[li] * min(s, max(s - r, 0.0))
        else:
            wasted += max(r, 0.0)
    record_outcome(li, saved, wasted, ctl)

