"""Prefetch admission in the compiled model: which candidates a policy loads, under equal budgets.

When layer L is routed, a prediction source (:mod:`replay.model.predictors`) gives each expert of
layer L+1 a probability; :func:`choose` picks the candidates (the most probable experts not in
RAM, above the probability floor) and admits them under the policy (``probability``,
``per-byte``, ``deadline``, ``stall-value``'s V(a), ``oracle``) within the queue-slot, byte,
adaptive and per-source budgets; :func:`admit_listed` applies those budgets to the top-K rule's
list. The controller's state and feedback are :mod:`replay.model.controller`; docs/MODEL.md
states the policies, V(a) and the tail controls in full. Units: bytes, seconds, bytes/s.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.controller import (
    ADMITTED,
    CAP_BYTES,
    CAP_SLOTS,
    CAPPED,
    CREDITED,
    DEADLINE,
    ORACLE_POLICY,
    PER_BYTE,
    PROBABILITY,
    STALL_VALUE,
    USED_BYTES,
    USED_SLOTS,
    LoadCosts,
    load_seconds,
    scales_in_cache,
)
from replay.model.jit import HELPER, STAGE
from replay.model.predictors import untouched_probability

VALUE_MARGIN = 1e-9
"""Relative slack :func:`_never_gains` keeps: it decides only where rounding (about 1e-15
relative per operation of :func:`_value`) cannot change the sign of V(a)."""

NORMAL_MIN, NORMAL_MAX = 1e-100, 1e100
"""Range :func:`_never_gains` needs ``lambda rho`` and the queue term's factor ``b / F (s - d) /
s`` in: far from underflow and overflow, where rounding would no longer be relative."""

RANKED_POOL = 64
"""Up to this many candidates, the C most probable are found by counting, for each, the
candidates ahead of it (branch-free, vectorised); beyond it, by insertion into a ranked list."""

Valuation = namedtuple("Valuation", "routed lam rho p_victim full_bandwidth")
"""The terms of V(a) a layer's candidates share (:func:`_value`): when the next layer is routed
(``routed``, s), lambda and rho (the layer's late share and cost ratio, :data:`replay.model.controller.Control`), the
probability ``p_victim`` of the expert a wrong load would evict from the LRU, and the array's
full bandwidth (bytes/s)."""

Limits = namedtuple("Limits", "t0 window budget slots valued")
"""What :func:`_admit` admits under: the first load's start ``t0`` (s), the ``window`` of bytes
that can start before the next routing (inf: no adaptive budget), the byte ``budget``, the most
loads ``slots``, and ``valued`` (only loads of positive V(a))."""

Ranked = namedtuple("Ranked", "order cand need svc")
"""The candidates :func:`_admit` takes, [64] each: ``cand[order[:n]]`` in that order, each one's
estimated need time ``need`` and load time ``svc`` (s)."""


@njit(**STAGE)
def choose(i, nl, start, routed, x, work, n_touched, pf):
    """Admit prefetches for layer ``nl`` (instance ``i + 1``) under policy ``pol.admission``.

    ``x``: the loop's :class:`replay.model.state.Inputs`; ``work``: its
    :class:`replay.model.state.Work` (the drives' state; the admitted experts go into
    ``work.pending.experts``, in load order). ``x.table.source.p`` [E]: the source's
    probabilities (``n_touched``: see
    :func:`replay.model.predictors.next_layer_probabilities`; when the experts it does not list fall
    below the probability floor, only the listed ones are scanned); ``start``: when the prefetcher may start (s, instance
    ``i``'s clock); ``routed``: when layer ``nl`` is routed; ``x.table.charge``: the credits and
    the per-source caps (:data:`replay.model.controller.Fusion`; ``charged`` False when loads are not
    charged to sources). Returns how many were admitted; counts the rejected and the capped
    candidates in ``pf`` (the prefetch outputs). Under
    ``stall-value`` it returns before ranking the candidates when no expert of the pool may
    gain (:func:`_none_may_gain`; most calls on the benchmark's trace).
    """
    inst, ram, lay, pol, dev = x.inst, x.ram, x.lay, x.pol, x.dev
    src, ctl, charge = x.table.source, x.table.control, x.table.charge
    drives, out_list = work.drives, work.pending.experts
    p = src.p
    E = len(p)
    lru = ram.lru
    cand, key, need, svc = ctl.cand, ctl.key, ctl.need, ctl.svc
    C = pol.candidates
    seconds = lay.seconds[nl]
    policy = pol.admission
    # the candidates: the C most probable experts not in RAM (the oracle's: the ones really needed)
    pool, pool_p = ctl.pool, ctl.pool_p
    considered, resident_compute = 0, 0.0
    a, b = inst.sel_start[i + 1], inst.sel_start[i + 2]
    oracle = policy == ORACLE_POLICY
    floor = max(pol.min_probability, 1e-300)
    mode, n_scan = 0, E                          # 0: every expert, 1: the source's list, 2: the true union
    if oracle:
        mode, n_scan = 2, b - a
    elif n_touched >= 0 and untouched_probability(src, nl) < floor:
        mode, n_scan = 1, n_touched
    for x in range(n_scan):                      # branch-free: which way an expert goes is data, not a jump
        e = x if mode == 0 else (src.touched[x] if mode == 1 else inst.sel_e[a + x])
        pe = p[e]
        above = oracle | (not pe < floor)
        resident = ram.pinned[nl, e] | lru.cached[nl, e]
        resident_compute += pe * seconds[e] if above & resident else 0.0    # (+0.0 leaves the sum's bits)
        pool[considered], pool_p[considered] = e, pe                        # kept only when counted
        considered += above & (not resident)
    if considered == 0:
        return 0
    # budgets: Q slots, B bytes (adaptive: what the drives can deliver before the next routing)
    t0, window = _window(start, routed, pol.adaptive_budget, drives.free,
                         min(dev.full_bandwidth, dev.members * dev.stream_bandwidth))
    budget = float(pol.prefetch_bytes) if pol.prefetch_bytes > 0 else np.inf
    lam, rho = ctl.late_frac[nl], ctl.cost_ratio[nl]
    p_victim = 0.0
    if lru.capacity[nl] > 0 and lru.size[nl] >= lru.capacity[nl] and lru.oldest[nl] >= 0:
        p_victim = p[lru.oldest[nl]]
    v = Valuation(routed, lam, rho, p_victim, dev.full_bandwidth)
    costs = LoadCosts(ram.pages, lay, pol, dev)
    if policy == STALL_VALUE and _none_may_gain(nl, pool_p, considered, t0, v, costs, ctl):
        _start_unranked(pool, pool_p, considered, C, p, cand, charge)
        _count(i, considered, 0, 0, pf.rejected, pf.capped)
        return 0
    nc = _most_probable(pool, pool_p, considered, C, oracle, p, cand)
    _start_layer(cand, nc, charge)
    if policy == STALL_VALUE and not _may_gain(nl, cand, nc, p, t0, v, svc, costs):
        _count(i, considered, 0, 0, pf.rejected, pf.capped)
        return 0
    # need times: resident work first, then the candidates ahead in issue order (by probability)
    _sort(cand, nc, lay.rank[nl])                # issue order
    t_need = routed + resident_compute
    for c in range(nc):
        e = cand[c]
        need[c] = t_need
        t_need += p[e] * seconds[e]
        svc[c] = load_seconds(nl, e, not scales_in_cache(ram.pages, nl, e, lay), lay, pol, dev)
    for c in range(nc):                          # the policy's order key (ascending is taken first)
        e = cand[c]
        if policy == PROBABILITY:
            key[c] = -p[e]
        elif policy == PER_BYTE:
            key[c] = -p[e] / lay.ebytes[nl, e]
        elif policy == STALL_VALUE:
            key[c] = -_value(p[e], need[c], svc[c], t0, lay.ebytes[nl, e], v)
        elif policy == DEADLINE:
            key[c] = need[c]
        else:                                    # oracle: need order, as listed
            key[c] = c
    order = ctl.order
    for c in range(nc):
        order[c] = c
    _sort(order, nc, key)
    n_out, n_capped = _admit(nc, Ranked(order, cand, need, svc), p, lay.ebytes[nl],
                             Limits(t0, window, budget, pol.prefetch_experts, policy == STALL_VALUE), v, charge, out_list)
    _count(i, considered, n_out, n_capped, pf.rejected, pf.capped)
    return n_out


@njit(**HELPER)
def _most_probable(pool, pool_p, n, C, in_order, p, cand):
    """Fill ``cand`` with the (up to) ``C`` experts of ``pool[:n]`` (probabilities ``pool_p``
    [n], as ``p`` [E] gives them) that rank first by probability (:func:`_ahead`), or with
    ``in_order`` the first ``C``; returns how many. The set is exact; its order is not
    (:func:`choose` puts the candidates in issue order, by their distinct ranks, before any
    order matters)."""
    if in_order or n <= C:
        nc = min(n, C)
        for c in range(nc):
            cand[c] = pool[c]
        return nc
    if n > RANKED_POOL:
        nc = 0
        for x in range(n):
            e = pool[x]
            if nc == C and not _ahead(e, cand[C - 1], p):
                continue
            q = min(nc, C - 1)
            while q > 0 and _ahead(e, cand[q - 1], p):
                cand[q] = cand[q - 1]
                q -= 1
            cand[q] = e
            nc = min(nc + 1, C)
        return nc
    nc = 0
    for x in range(n):
        px, ex = pool_p[x], pool[x]
        ahead = 0
        for y in range(n):
            ahead += (pool_p[y] > px) | ((pool_p[y] == px) & (pool[y] < ex))
        if ahead < C:
            cand[nc] = ex
            nc += 1
    return nc


@njit(**HELPER)
def _may_gain(nl, cand, nc, p, t0, v, svc, costs):
    """Some candidate of ``cand[:nc]`` may have a positive V(a) when loaded from ``t0`` (s), the
    prefetcher's start: its V were it needed no sooner than its load completes (need time inf) is
    positive. No need time values it higher (V does not decrease with the need time, rounding
    included), and until a load is admitted every candidate is valued at ``t0``: when none may,
    ``stall-value`` admits none, in whatever order it takes them. ``v``: :data:`Valuation`;
    ``costs``: :data:`replay.model.controller.LoadCosts`; ``svc`` is scratch."""
    pages, lay, pol, dev = costs.pages, costs.lay, costs.pol, costs.dev
    for c in range(nc):
        e = cand[c]
        svc[c] = load_seconds(nl, e, not scales_in_cache(pages, nl, e, lay), lay, pol, dev)
        if not _value(p[e], np.inf, svc[c], t0, lay.ebytes[nl, e], v) <= 0.0:
            return True
    return False


@njit(**HELPER)
def _none_may_gain(nl, pool_p, n, t0, v, costs, ctl):
    """No expert of layer ``nl``'s pool (probabilities ``pool_p[:n]``) may have a positive V(a)
    loaded from ``t0`` (s), shown before ranking them (:func:`_never_gains` over the layer's
    range of load times and bytes, :func:`_load_range`): then :func:`_may_gain` is False for the
    candidates (a subset of the pool), so ``stall-value`` admits none. False: undecided."""
    if t0 >= v.routed:
        return True                              # every V is 0 (_value): nothing can start in time
    if np.isnan(ctl.svc_min[nl]):
        _load_range(nl, costs.lay, costs.pol, costs.dev, ctl)
    return _never_gains(pool_p, n, t0, v, ctl.svc_min[nl], ctl.svc_max[nl], ctl.bytes_min[nl])


@njit(**HELPER)
def _never_gains(pool_p, n, t0, v, s_lo, s_hi, b_lo):
    """Whether every load of probability in ``pool_p[:n]``, load time (s) in [``s_lo``, ``s_hi``]
    and at least ``b_lo`` bytes, started at ``t0 < routed`` (s) under the :data:`Valuation` ``v``
    (``k`` = lambda rho), has V(a)
    <= 0 at need time inf as :func:`_value` computes it. True only where that holds in exact
    arithmetic with a relative slack of :data:`VALUE_MARGIN`, so rounding cannot flip it; False
    (undecided) otherwise.

    At need time inf, ``V b = k s p - (1 - p) (b / F) max(0, s - d) / s - (1 - p) p_victim k s``
    with ``d = routed - t0`` and ``F`` the full bandwidth (bytes/s). When ``s > d``, ``V <= 0``
    exactly when ``p / (1 - p) <= p_victim + (b / (F k)) (s - d) / s^2``. The right side grows
    with ``b``; in ``s`` it rises up to ``s = 2d`` and falls after, so over the range it is least
    at one end. ``d`` is taken larger by the slack, which covers the rounding of ``t0 + s -
    routed`` in :func:`_value`."""
    routed, k, p_victim, full_bandwidth = v.routed, v.lam * v.rho, v.p_victim, v.full_bandwidth
    d = routed - t0 + VALUE_MARGIN * (abs(t0) + abs(routed) + s_hi)
    if not (s_lo > d and NORMAL_MIN <= k <= NORMAL_MAX
            and NORMAL_MIN <= b_lo / full_bandwidth * ((s_lo - d) / s_lo) <= NORMAL_MAX):
        return False
    odds = p_victim + b_lo / (full_bandwidth * k) * min((s_lo - d) / (s_lo * s_lo), (s_hi - d) / (s_hi * s_hi))
    odds_max = odds * (1.0 - VALUE_MARGIN)
    below = 0
    for x in range(n):                           # branch-free: a NaN probability is never below
        below += pool_p[x] * (1.0 + VALUE_MARGIN) <= (1.0 - pool_p[x]) * odds_max
    return below == n


@njit(**HELPER)
def _load_range(nl, lay, pol, dev, ctl):
    """Fill ``ctl.svc_min``, ``ctl.svc_max`` (s) and ``ctl.bytes_min`` of layer ``nl``: the
    shortest and longest :func:`replay.model.controller.load_seconds` of its experts, scales read or not, and the
    fewest bytes of one (they depend only on the layout, the read policy and the device)."""
    lo, hi, nbytes = np.inf, -np.inf, np.inf
    for e in range(lay.ebytes.shape[1]):
        for first in (False, True):
            s = load_seconds(nl, e, first, lay, pol, dev)
            lo, hi = min(lo, s), max(hi, s)
        nbytes = min(nbytes, float(lay.ebytes[nl, e]))
    ctl.svc_min[nl], ctl.svc_max[nl], ctl.bytes_min[nl] = lo, hi, nbytes


@njit(**HELPER)
def _start_unranked(pool, pool_p, n, C, p, cand, fusion):
    """:func:`_start_layer` for the ``C`` most probable experts of ``pool[:n]`` (probabilities
    ``pool_p``), ranked (:func:`_most_probable`, into ``cand``) only when loads are charged to
    sources (``fusion.charged``)."""
    if not fusion.charged:
        return
    _start_layer(cand, _most_probable(pool, pool_p, n, C, False, p, cand), fusion)


@njit(**HELPER)
def _admit(nc, ranked, p, ebytes, limits, v, charge, out_list):
    """Take candidates ``cand[order[:nc]]`` (``ranked``: :data:`Ranked`) in that order into
    ``out_list`` while they fit the :data:`Limits` ``limits``: at most ``slots`` loads,
    ``budget`` bytes (of ``ebytes`` [E]) and, from the first one that would start at ``t0`` +
    the admitted loads' times (``svc``, s) with ``window`` bytes admitted, none; with ``valued``,
    only those of positive V(a) at their start (:data:`Valuation` ``v``); when loads are charged to
    sources (``charge.charged``, a :data:`replay.model.controller.Fusion`, the layer started with
    :func:`_start_layer`), each charged to its source (:func:`_charge`). Returns (loads admitted,
    candidates capped)."""
    order, cand, need, svc = ranked.order, ranked.cand, ranked.need, ranked.svc
    window, budget, slots, valued = limits.window, limits.budget, limits.slots, limits.valued
    n_out, used, t, n_capped = 0, 0.0, limits.t0, 0
    for r in range(nc):
        if n_out >= slots:
            break
        c = order[r]
        e = cand[c]
        nbytes = ebytes[e]
        if used >= window:
            break                                # it would start after the next layer is routed
        if used + nbytes > budget:
            continue
        if valued and _value(p[e], need[c], svc[c], t, nbytes, v) <= 0.0:
            continue
        if charge.charged:
            if not _charge(charge.credit[e], nbytes, charge):
                n_capped += 1
                continue
        out_list[n_out] = e
        n_out += 1
        used += nbytes
        t += svc[c]
    return n_out, n_capped


@njit(**STAGE)
def admit_listed(i, nl, start, routed, n, x, work, pf):
    """Under ``top-k``: keep the loads of ``work.pending.experts[:n]`` (the rule's list, rank order) that fit
    the byte budget, the adaptive budget and the per-source caps (module doc), in order; the
    experts in RAM are skipped without charge. Returns how many are kept; counts the rejected
    and the capped ones in ``pf``. ``x``, ``work``: as :func:`choose`."""
    ram, lay, pol, dev = x.ram, x.lay, x.pol, x.dev
    ctl, charge = x.table.control, x.table.charge
    drives, out_list = work.drives, work.pending.experts
    t0, window = _window(start, routed, pol.adaptive_budget, drives.free,
                         min(dev.full_bandwidth, dev.members * dev.stream_bandwidth))
    budget = float(pol.prefetch_bytes) if pol.prefetch_bytes > 0 else np.inf
    cand, order, svc = ctl.cand, ctl.order, ctl.svc
    nc = 0
    for r in range(n):
        e = out_list[r]
        if not (ram.pinned[nl, e] or ram.lru.cached[nl, e]):
            cand[nc], order[nc], svc[nc] = e, nc, 0.0
            nc += 1
    _start_layer(cand, nc, charge)
    n_out, n_capped = _admit(nc, Ranked(order, cand, svc, svc), svc, lay.ebytes[nl], Limits(t0, window, budget, n, False),
                             Valuation(routed, 0.0, 0.0, 0.0, 1.0), charge, out_list)     # (need, p: not read unless valued)
    _count(i, nc, n_out, n_capped, pf.rejected, pf.capped)
    return n_out


@njit(**HELPER)
def _start_layer(cand, n, fusion):
    """A layer's prefetch begins: nothing charged to any source yet; count its candidates
    ``cand[:n]`` by credited source (nothing when loads are not charged to sources: not ``fusion.charged``)."""
    if not fusion.charged:
        return
    for s in range(fusion.limits.shape[1]):
        fusion.limits[USED_SLOTS, s] = 0.0
        fusion.limits[USED_BYTES, s] = 0.0
    for c in range(n):
        fusion.tally[CREDITED, fusion.credit[cand[c]]] += 1


@njit(**HELPER)
def _count(i, considered, n_out, n_capped, rejected, capped):
    """Instance ``i``'s candidates not admitted: ``rejected`` [I] (a cap's apart) and ``capped`` [I]."""
    rejected[i] += considered - n_out - n_capped
    capped[i] += n_capped


@njit(**HELPER)
def _window(start, routed, adaptive, free, rate):
    """When the prefetcher's first load can start (s: after the drives' backlog, their channels'
    free times ``free`` [M]) and, with the ``adaptive`` budget, the bytes the drives deliver at
    ``rate`` (bytes/s) from then until ``routed`` (inf without)."""
    backlog = 0.0
    for m in range(len(free)):
        backlog = max(backlog, free[m] - start)
    t0 = start + backlog
    return t0, (max(routed - t0, 0.0) * rate if adaptive else np.inf)


@njit(**HELPER)
def _charge(s, nbytes, fusion):
    """Charge one load of ``nbytes`` to source ``s`` (returns True) unless the caps apply and
    its cap would be exceeded (counted capped; returns False)."""
    lim = fusion.limits
    if fusion.caps and (lim[USED_SLOTS, s] + 1 > lim[CAP_SLOTS, s] or lim[USED_BYTES, s] + nbytes > lim[CAP_BYTES, s]):
        fusion.tally[CAPPED, s] += 1
        return False
    lim[USED_SLOTS, s] += 1
    lim[USED_BYTES, s] += nbytes
    fusion.tally[ADMITTED, s] += 1
    return True


@njit(**HELPER)
def _value(p, need, svc, t, nbytes, v):
    """V(a) of a load of ``nbytes`` and probability ``p``, needed at ``need`` (s), taking ``svc``
    (s), starting at ``t`` (s), under the :data:`Valuation` ``v`` (docs/MODEL.md states it)."""
    routed, lam, rho, p_victim, full_bandwidth = v.routed, v.lam, v.rho, v.p_victim, v.full_bandwidth
    if t >= routed:
        return 0.0                               # would be dropped: it cannot start in time
    on_time = min(max((need - t) / svc, 0.0), 1.0) if svc > 0 else 1.0
    q = p * lam
    gain = q * on_time * rho * svc
    queue = (1.0 - p) * nbytes / full_bandwidth * min(max(t + svc - routed, 0.0) / svc, 1.0) if svc > 0 else 0.0
    pollution = (1.0 - p) * p_victim * lam * rho * svc
    return (gain - queue - pollution) / nbytes


@njit(**HELPER)
def _ahead(e, f, p):
    """Expert ``e`` ranks before ``f`` by probability: higher, or equal and a lower id."""
    return p[e] > p[f] or (p[e] == p[f] and e < f)


@njit(**HELPER)
def _sort(items, n, by):
    """Sort ``items[:n]`` ascending by ``by[item]`` (insertion sort, stable; n <= 64)."""
    for x in range(1, n):
        v = items[x]
        y = x
        while y > 0 and by[items[y - 1]] > by[v]:
            items[y] = items[y - 1]
            y -= 1
        items[y] = v

