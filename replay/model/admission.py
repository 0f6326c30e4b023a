"""Prefetch admission under equal budgets (seed 5.3-5.4, E2) and the controller's feedback (5.8).

When layer L is routed, a prediction source (:mod:`replay.model.predictors`) gives each expert of layer
L+1 a probability ``p``. The *candidates* are the source's ``prefetch_candidates`` most probable
experts (ties: lower id first) not already in RAM (pinned or in the LRU) with
``p >= prefetch_min_probability``; every
policy chooses among the same candidates, under the same budgets: at most ``Q`` =
``prefetch_experts`` loads (the prefetch queue slots) and ``B`` = ``prefetch_bytes`` speculative
bytes per layer (0: only Q limits). Demand reads keep strict priority: a controlled prefetcher
starts once the layer's demand loads are done (:mod:`replay.model.instance`; the runtime's plain top-K
rule queues its loads at routing instead, as colibrì does). Policies, by what they rank on:

* ``probability``: ``p``, highest first; ``per-byte``: ``p / b`` (``b`` the expert's bytes);
* ``deadline``: the estimated need time, earliest first;
* ``stall-value``: ``V(a) = (G - C_queue - C_pollution) / b`` (seed 5.3) with
  ``G = q * P(ready <= need | queue) * dW``: ``q = p * lambda`` the late-need probability (5.2:
  needed, and not otherwise ready in time; ``lambda`` the measured share of the layer's demand
  misses whose load made the compute thread wait), ``dW = rho * s`` the stall the miss would
  cause (``s`` the expert's estimated demand-load time, cold or page-cache warm, with or without
  its scales; ``rho`` the layer's measured stall per late miss over its estimated load time),
  ``P = min(1, max(0, (need - start) / s))`` for a load starting at ``start`` after the loads
  admitted before it: 1 when it completes by its need time, else the share of it done by then
  (a load still in flight when needed removes that share of the wait, so the deterministic
  chance of finishing in time is refined to the share of the stall removed),
  ``C_queue = (1 - p) * (b / F) * max(0, ready - routed) / s`` (a wrong load's bytes still to
  transfer when the next layer's demand reads start, in the drives' channel time at the array's
  full bandwidth ``F``: the share of the channel it takes from them) and ``C_pollution = (1 - p) * p_v * lambda * rho * s`` (a
  wrong load evicting the LRU's oldest expert, of probability ``p_v``). Candidates are taken in
  order of V at the prefetcher's start, each re-valued at its own start; none of value <= 0;
* ``oracle``: the experts layer L+1 really needs, not in RAM, in need (issue) order: the
  non-deployable bound.

The estimated need time of a candidate is when the next layer is routed plus the expected
matmuls the compute thread runs before it: those of the layer's resident experts (it runs them
first; experts below the probability floor are left out) and of the candidates ahead of it in
issue order, each weighted by its probability.

Tail control (5.8): a load not started when the next layer is routed is dropped (its deadline
passed); with ``cancel_stale``, a load the next layer was routed without also stops issuing its
remaining reads (one already at the drives completes); with ``adaptive_budget`` the byte budget is
at most what the drives can deliver between the prefetcher's start (after their backlog) and the
next routing (a load is admitted while the bytes admitted before it fit in that window, so
it is expected to start in time); with ``backoff`` a layer whose measured stall-conversion (:func:`record_outcome`)
is not positive stops prefetching, probing once every :data:`BACKOFF_PROBE` forwards.

Under ``top-k`` the list is the source's K best (the runtime's rule); a byte budget B, the
adaptive budget and the per-source caps, when set, keep its loads that fit, in rank order (the
experts already in RAM are skipped and charge nothing), and backoff applies as above.

Several sources at once (``prefetch = "a+b"``, :mod:`replay.model.predictors`): every policy ranks on
the fused probability; each candidate is charged to the source credited with it (the one whose
own probability of it is highest, ties to the first listed). **Per-source caps** (``source_caps``
``c_s``, seed 5.8's lossless tail control: no one source may take more than its share): the loads
charged to source ``s`` in one layer are at most ``floor(c_s Q)`` and, with a byte budget, take
at most ``c_s B`` bytes. A candidate the policy would have admitted (it fits the budgets, and
under ``stall-value`` its value is positive) but whose source's cap it would exceed is skipped
and counted apart (``capped``); later candidates may still be admitted. With no caps (or every
share 1) a run is the same, to the bit, as without the machinery.

Per instance the replay counts the candidates a policy rejected (``rejected``: candidates it did
not admit, those skipped by a cap not included), those skipped by a cap (``capped``) and the loads
cancelled (``cancelled``: dropped or cut). Where all experts have the same bytes (GLM-5.2),
``per-byte`` ranks as ``probability`` does.

References
----------
Seed sections 5.2-5.4 and 5.8; experiments E2 and E5.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import ADMISSION_POLICIES, RuntimeConfig
from replay.model.jit import HELPER, STAGE
from replay.model.pagecache import scales_cached, scales_settled
from replay.model.predictors import (
    CALIBRATION_BINS,
    FusedModel,
    SourceModel,
    prediction_source,
    untouched_probability,
)

TOP_K, PROBABILITY, PER_BYTE, DEADLINE, STALL_VALUE, ORACLE_POLICY, OBSERVE = (
    ADMISSION_POLICIES.index(x) for x in ("top-k", "probability", "per-byte", "deadline", "stall-value", "oracle", "observe"))

MEMORY_BANDWIDTH = 10e9
"""Bytes/s of a page-cache read (as :data:`replay.model.instance.MEMORY_BANDWIDTH`)."""

WARM_BUCKETS = 10_000
"""As :data:`replay.model.instance.WARM_BUCKETS`: a weight read is warm when its page hash falls in the
first ``page_cache_fraction`` of these."""

FEEDBACK_WEIGHT = 0.1
"""Weight of a new instance in the controller's running (exponentially weighted) measurements."""

BACKOFF_PROBE = 16
"""With backoff, a layer that stopped prefetching still prefetches once every this many forwards,
so its measured stall-conversion can recover."""

MAX_CANDIDATES = 64

VALUE_MARGIN = 1e-9
"""Relative slack :func:`_never_gains` keeps: it decides only where rounding (about 1e-15
relative per operation of :func:`_value`) cannot change the sign of V(a)."""

NORMAL_MIN, NORMAL_MAX = 1e-100, 1e100
"""Range :func:`_never_gains` needs ``lambda rho`` and the queue term's factor ``b / F (s - d) /
s`` in: far from underflow and overflow, where rounding would no longer be relative."""

RANKED_POOL = 64
"""Up to this many candidates, the C most probable are found by counting, for each, the
candidates ahead of it (branch-free, vectorised); beyond it, by insertion into a ranked list."""

Control = namedtuple("Control", "late_frac cost_ratio gain probes cand key need svc order q_pending q_for waited "
                                "pool pool_p svc_min svc_max bytes_min")
"""The controller's state (:func:`new_control`). Per layer [L]: ``late_frac`` (lambda, the running
share of demand misses that made the compute thread wait), ``cost_ratio`` (rho, running stall per
late miss over its estimated load time), ``gain`` (running stall-conversion, s per instance, for
backoff), ``probes`` (instances skipped by backoff); ``svc_min``, ``svc_max`` (s) and
``bytes_min``: the shortest and longest estimated load time of one of the layer's experts, its
scales read or not (:func:`load_seconds`), and the fewest bytes of one, NaN until the layer's
first stall-valued admission (:func:`_load_range`). Scratch [64] over the candidates: ``cand``,
``key``, ``need`` (estimated need time, s), ``svc`` (estimated load time, s), ``order``. For scoring q (policy
``observe``): ``q_pending`` [E] (q of the layer being predicted), ``q_for`` [1] (its instance, -1
none), ``waited`` [E] (scratch: the miss made the compute thread wait). Scratch [E] over the
experts a policy considers: ``pool`` and their probabilities ``pool_p``."""

Prefetcher = namedtuple("Prefetcher", "source control sources fusion charge")
"""What the compiled prefetcher reads and keeps: ``source``, the
:data:`replay.model.predictors.PredictionSource` the policy reads its probabilities from (with several
sources, the holder of their fused probability); the :data:`Control`; ``sources``, the tuple of
the sources that run (one source: ``(source,)``); the :data:`Fusion`; ``charge``: the same
:data:`Fusion` when loads are charged to sources (caps, or several sources), else None (the
admission then compiles without the charging code)."""

Fusion = namedtuple("Fusion", "coef credit caps limits tally")
"""Several sources and their caps (module doc). ``coef`` [S + 1]: the fusion's weights
(:class:`replay.model.predictors.FusedModel`); ``credit`` [E]: the source each expert of the layer
being predicted is charged to (0 with one source); ``caps`` (bool: the caps apply);
``limits`` [4, S] per source: the most loads (floor(c_s Q)) and bytes (c_s B; inf without a
byte budget) it may take per layer, then what the layer being predicted charged it so far
(rows :data:`CAP_SLOTS`, :data:`CAP_BYTES`, :data:`USED_SLOTS`, :data:`USED_BYTES`);
``tally`` [3, S] int64, totals over the replay per source while loads are charged to
sources (caps, or several sources; ``Prefetcher.charge``): candidates a policy chose among
credited to it, loads admitted, candidates skipped by its cap (rows :data:`CREDITED`,
:data:`ADMITTED`, :data:`CAPPED`)."""

CAP_SLOTS, CAP_BYTES, USED_SLOTS, USED_BYTES = range(4)
CREDITED, ADMITTED, CAPPED = range(3)


def prefetcher_inputs(config: RuntimeConfig, layout: Layout, learned) -> Prefetcher:
    """The :data:`Prefetcher` of a replay under ``config``: ``learned`` is the source learned on
    training sessions (a :class:`replay.model.predictors.SourceModel`; for several sources, their
    :class:`replay.model.predictors.FusedModel`), or, for ``coupled`` under ``top-k``, its
    ``(targets, counts)`` pair table, or None for ``none`` and ``oracle``."""
    L, E = len(layout.layers), layout.n_experts
    kind = config.prefetch
    names = config.sources
    if len(names) > 1:
        if not isinstance(learned, FusedModel):
            raise InputError(None, f"the prefetch sources {kind!r} need their fused probability learned from training "
                                   f"sessions (replay.model.predictors.learn_fused)")
        if learned.names != names:
            raise InputError(None, f"the learned sources are {learned.name!r}, the configuration asks for {kind!r}")
        sources = tuple(prediction_source(m, layout) for m in learned.sources)
        holder = prediction_source(None, layout, "fused")
        fusion = new_fusion(config, E, learned.coef)
        return Prefetcher(holder, new_control(L, E), sources, fusion, fusion)
    if kind in ("none", "oracle"):                # they learn nothing: whatever was learned is not theirs
        model = None
    elif isinstance(learned, SourceModel):
        if learned.name != kind:
            raise InputError(None, f"the learned source is {learned.name!r}, the configuration asks for {kind!r}")
        model = learned
    elif kind == "coupled" and learned is not None and config.admission == "top-k":
        targets, counts = learned
        model = SourceModel("coupled", np.asarray(targets), np.asarray(counts), np.zeros((L, E)), np.zeros((L, E)),
                            np.zeros((L, CALIBRATION_BINS)))
    elif kind == "coupled" and learned is None:
        raise InputError(None, "the coupled prefetch source needs a coupling table learned from training sessions")
    else:
        raise InputError(None, f"the {kind} prefetch source under admission {config.admission!r} needs its probabilities "
                               f"learned from training sessions (replay.model.predictors.learn_source)")
    source = prediction_source(model, layout, kind)
    fusion = new_fusion(config, E, np.array([0.0, 1.0]))
    return Prefetcher(source, new_control(L, E), (source,), fusion, fusion if config.source_caps else None)


def new_fusion(config: RuntimeConfig, E: int, coef: np.ndarray) -> Fusion:
    """A fresh :data:`Fusion` for ``config``'s sources (weights ``coef``) and caps."""
    S = max(len(config.sources), 1)
    shares = np.asarray(config.source_caps or (1.0,) * S, dtype=np.float64)
    slots = np.floor(shares * config.prefetch_experts + 1e-9).astype(np.int64)
    nbytes = shares * config.prefetch_bytes if config.prefetch_bytes > 0 else np.full(S, np.inf)
    return Fusion(np.ascontiguousarray(coef, dtype=np.float64), np.zeros(E, dtype=np.int64), bool(config.source_caps),
                  np.stack([slots.astype(np.float64), nbytes, np.zeros(S), np.zeros(S)]), np.zeros((3, S), dtype=np.int64))


def new_control(L: int, E: int) -> Control:
    """A fresh controller for ``L`` layers of ``E`` experts: lambda = rho = 1 (every miss is
    assumed late and to cost its load time until measured), gain slightly positive."""
    return Control(np.ones(L), np.ones(L), np.full(L, 1e-9), np.zeros(L, dtype=np.int64),
                   np.empty(MAX_CANDIDATES, dtype=np.int64), np.empty(MAX_CANDIDATES), np.empty(MAX_CANDIDATES),
                   np.empty(MAX_CANDIDATES), np.empty(MAX_CANDIDATES, dtype=np.int64), np.zeros(E),
                   np.full(1, -1, dtype=np.int64), np.zeros(E, dtype=np.bool_), np.empty(E, dtype=np.int64),
                   np.empty(E), np.full(L, np.nan), np.full(L, np.nan), np.full(L, np.nan))


@njit(**HELPER)
def _scales_in_cache(pc, nl, e, lay):
    return scales_settled(pc, nl, e) or scales_cached(pc, lay.sloc[nl, e])


@njit(**HELPER)
def load_seconds(nl, e, first, lay, pol, dev):
    """Estimated time (s) to load expert ``e`` of layer ``nl`` alone: its weight bytes (the bottom
    segment when its top is resident) from the drives, or from the page cache when its first
    weight page is warm, plus its scales (three requests when the page cache does not hold all
    of them, ``first``: :func:`replay.model.pagecache.scales_cached`; page-cache time otherwise). Each request costs its command and its channel
    time, ``a + c``, beside its bytes at the array's rate."""
    wb = lay.wbytes[nl, e] * (1.0 - lay.top_fraction[nl] if lay.top_resident[nl, e] else 1.0)
    sb = lay.ebytes[nl, e] - lay.wbytes[nl, e]
    rate = min(dev.full_bandwidth, dev.members * dev.stream_bandwidth)
    a = dev.request_seconds + dev.request_channel
    warm = False
    if pol.warm_fraction > 0:
        f, off = lay.pos_file[nl, e], lay.pos_off[nl, e]
        if pol.direct:
            off = (lay.bases[f] + off) // pol.alignment * pol.alignment - lay.bases[f]
        warm = (f * 1_000_003 + off // 4096) % WARM_BUCKETS < pol.warm_fraction * WARM_BUCKETS
    s = wb / MEMORY_BANDWIDTH if warm else a + wb / rate
    if first:
        s += 3 * a + sb / rate
    else:
        s += sb / MEMORY_BANDWIDTH
    return s


@njit(**STAGE)
def choose(i, nl, start, routed, inst, src, n_touched, ram, lay, pol, dev, drives, ctl, charge, out_list, pf):
    """Admit prefetches for layer ``nl`` (instance ``i + 1``) under policy ``pol.admission``.

    ``src.p`` [E]: the source's probabilities (``n_touched``: see
    :func:`replay.model.predictors.next_layer_probabilities`; when the experts it does not list fall
    below the probability floor, only the listed ones are scanned); ``start``: when the prefetcher may start (s, instance
    ``i``'s clock); ``routed``: when layer ``nl`` is routed; ``charge``: the credits and the
    per-source caps (:data:`Fusion`), or None when loads are not charged to sources. Fills ``out_list`` with the admitted experts in load order
    and returns how many; counts the rejected and the capped candidates in ``pf``. Under
    ``stall-value`` it returns before ranking the candidates when no expert of the pool may
    gain (:func:`_none_may_gain`; most calls on the benchmark's trace).
    """
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
    if policy == STALL_VALUE and _none_may_gain(nl, pool_p, considered, t0, routed, lam, rho, p_victim, lay, pol, dev,
                                                ctl):
        _start_unranked(pool, pool_p, considered, C, p, cand, charge)
        _count(i, considered, 0, 0, pf.rejected, pf.capped)
        return 0
    nc = _most_probable(pool, pool_p, considered, C, oracle, p, cand)
    _start_layer(cand, nc, charge)
    if policy == STALL_VALUE and not _may_gain(nl, cand, nc, p, t0, routed, lam, rho, p_victim, svc, ram, lay,
                                               pol, dev):
        _count(i, considered, 0, 0, pf.rejected, pf.capped)
        return 0
    # need times: resident work first, then the candidates ahead in issue order (by probability)
    _sort(cand, nc, lay.rank[nl])                # issue order
    t_need = routed + resident_compute
    for c in range(nc):
        e = cand[c]
        need[c] = t_need
        t_need += p[e] * seconds[e]
        svc[c] = load_seconds(nl, e, not _scales_in_cache(ram.pages, nl, e, lay), lay, pol, dev)
    for c in range(nc):                          # the policy's order key (ascending is taken first)
        e = cand[c]
        if policy == PROBABILITY:
            key[c] = -p[e]
        elif policy == PER_BYTE:
            key[c] = -p[e] / lay.ebytes[nl, e]
        elif policy == STALL_VALUE:
            key[c] = -_value(p[e], need[c], svc[c], t0, routed, lam, rho, p_victim, lay.ebytes[nl, e], dev.full_bandwidth)
        elif policy == DEADLINE:
            key[c] = need[c]
        else:                                    # oracle: need order, as listed
            key[c] = c
    order = ctl.order
    for c in range(nc):
        order[c] = c
    _sort(order, nc, key)
    n_out, n_capped = _admit(order, nc, cand, need, svc, p, lay.ebytes[nl], t0, routed, window, budget,
                             pol.prefetch_experts, policy == STALL_VALUE, lam, rho, p_victim, dev.full_bandwidth,
                             charge, out_list)
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
def _may_gain(nl, cand, nc, p, t0, routed, lam, rho, p_victim, svc, ram, lay, pol, dev):
    """Some candidate of ``cand[:nc]`` may have a positive V(a) when loaded from ``t0`` (s), the
    prefetcher's start: its V were it needed no sooner than its load completes (need time inf) is
    positive. No need time values it higher (V does not decrease with the need time, rounding
    included), and until a load is admitted every candidate is valued at ``t0``: when none may,
    ``stall-value`` admits none, in whatever order it takes them. ``svc`` is scratch."""
    for c in range(nc):
        e = cand[c]
        svc[c] = load_seconds(nl, e, not _scales_in_cache(ram.pages, nl, e, lay), lay, pol, dev)
        if not _value(p[e], np.inf, svc[c], t0, routed, lam, rho, p_victim, lay.ebytes[nl, e],
                      dev.full_bandwidth) <= 0.0:
            return True
    return False


@njit(**HELPER)
def _none_may_gain(nl, pool_p, n, t0, routed, lam, rho, p_victim, lay, pol, dev, ctl):
    """No expert of layer ``nl``'s pool (probabilities ``pool_p[:n]``) may have a positive V(a)
    loaded from ``t0`` (s), shown before ranking them (:func:`_never_gains` over the layer's
    range of load times and bytes, :func:`_load_range`): then :func:`_may_gain` is False for the
    candidates (a subset of the pool), so ``stall-value`` admits none. False: undecided."""
    if t0 >= routed:
        return True                              # every V is 0 (_value): nothing can start in time
    if np.isnan(ctl.svc_min[nl]):
        _load_range(nl, lay, pol, dev, ctl)
    return _never_gains(pool_p, n, t0, routed, lam * rho, p_victim, ctl.svc_min[nl], ctl.svc_max[nl],
                        ctl.bytes_min[nl], dev.full_bandwidth)


@njit(**HELPER)
def _never_gains(pool_p, n, t0, routed, k, p_victim, s_lo, s_hi, b_lo, full_bandwidth):
    """Whether every load of probability in ``pool_p[:n]``, load time (s) in [``s_lo``, ``s_hi``]
    and at least ``b_lo`` bytes, started at ``t0 < routed`` (s) with ``k`` = lambda rho, has V(a)
    <= 0 at need time inf as :func:`_value` computes it. True only where that holds in exact
    arithmetic with a relative slack of :data:`VALUE_MARGIN`, so rounding cannot flip it; False
    (undecided) otherwise.

    At need time inf, ``V b = k s p - (1 - p) (b / F) max(0, s - d) / s - (1 - p) p_victim k s``
    with ``d = routed - t0`` and ``F`` the full bandwidth (bytes/s). When ``s > d``, ``V <= 0``
    exactly when ``p / (1 - p) <= p_victim + (b / (F k)) (s - d) / s^2``. The right side grows
    with ``b``; in ``s`` it rises up to ``s = 2d`` and falls after, so over the range it is least
    at one end. ``d`` is taken larger by the slack, which covers the rounding of ``t0 + s -
    routed`` in :func:`_value`."""
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
    shortest and longest :func:`load_seconds` of its experts, scales read or not, and the
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
    sources (``fusion`` not None)."""
    if fusion is None:
        return
    _start_layer(cand, _most_probable(pool, pool_p, n, C, False, p, cand), fusion)


@njit(**HELPER)
def _admit(order, nc, cand, need, svc, p, ebytes, t0, routed, window, budget, slots, valued, lam, rho, p_victim,
           full_bandwidth, charge, out_list):
    """Take candidates ``cand[order[:nc]]`` in that order into ``out_list`` while they fit: at
    most ``slots`` loads, ``budget`` bytes (of ``ebytes`` [E]) and, from the first one that would
    start at ``t0`` + the admitted loads' times (``svc``, s) with ``window`` bytes admitted, none;
    with ``valued``, only those of positive V(a) at their start; with a ``charge``
    (:data:`Fusion`, the layer started with :func:`_start_layer`), each charged to its source
    (:func:`_charge`). Returns (loads admitted, candidates capped)."""
    n_out, used, t, n_capped = 0, 0.0, t0, 0
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
        if valued and _value(p[e], need[c], svc[c], t, routed, lam, rho, p_victim, nbytes, full_bandwidth) <= 0.0:
            continue
        if charge is not None:
            if not _charge(charge.credit[e], nbytes, charge):
                n_capped += 1
                continue
        out_list[n_out] = e
        n_out += 1
        used += nbytes
        t += svc[c]
    return n_out, n_capped


@njit(**HELPER)
def admit_listed(i, nl, start, routed, n, out_list, ram, lay, pol, dev, drives, ctl, charge, pf):
    """Under ``top-k``: keep the loads of ``out_list[:n]`` (the rule's list, rank order) that fit
    the byte budget, the adaptive budget and the per-source caps (module doc), in order; the
    experts in RAM are skipped without charge. Returns how many are kept; counts the rejected
    and the capped ones in ``pf``."""
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
    n_out, n_capped = _admit(order, nc, cand, svc, svc, svc, lay.ebytes[nl], t0, routed, window, budget, n,
                             False, 0.0, 0.0, 0.0, 1.0, charge, out_list)     # (need, p: not read unless valued)
    _count(i, nc, n_out, n_capped, pf.rejected, pf.capped)
    return n_out


@njit(**HELPER)
def _start_layer(cand, n, fusion):
    """A layer's prefetch begins: nothing charged to any source yet; count its candidates
    ``cand[:n]`` by credited source (nothing when loads are not charged to sources: ``fusion`` None)."""
    if fusion is None:
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
def _value(p, need, svc, t, routed, lam, rho, p_victim, nbytes, full_bandwidth):
    """V(a) of seed 5.3 for a load starting at ``t`` (s); see the module docstring."""
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


@njit(**HELPER)
def backed_off(nl, pol, ctl):
    """With backoff, layer ``nl`` skips this prefetch (its stall-conversion is not positive and
    this is not a probe)."""
    if not pol.backoff or ctl.gain[nl] > 0:
        return False
    ctl.probes[nl] += 1
    return ctl.probes[nl] % BACKOFF_PROBE != 0


@njit(**HELPER)
def record_demand(li, late, misses, wait, load_time, ctl):
    """Instance of layer ``li`` had ``misses`` demand misses, ``late`` of them made the compute
    thread wait, ``wait`` s in all, over ``load_time`` s of their estimated load times: update
    lambda and rho."""
    if misses > 0:
        ctl.late_frac[li] += FEEDBACK_WEIGHT * (late / misses - ctl.late_frac[li])
    if late > 0 and load_time > 0:
        ctl.cost_ratio[li] += FEEDBACK_WEIGHT * (wait / load_time - ctl.cost_ratio[li])


@njit(**HELPER)
def record_outcome(li, saved, wasted, ctl):
    """The prefetches made for an instance of layer ``li``: ``saved`` (s, the estimated stall the
    timely used ones removed: rho x their load times) and ``wasted`` (s, drive time unused loads
    still held when the layer was routed). Their difference is the instance's measured
    stall-conversion, whose running mean decides backoff."""
    ctl.gain[li] += FEEDBACK_WEIGHT * ((saved - wasted) - ctl.gain[li])


@dataclass(frozen=True)
class AdmissionCounts:
    """What a policy did, per committed token (:func:`admission_counts`): ``loads`` (prefetch
    loads completed or in flight at routing), ``rejected`` (candidates not admitted, those a
    per-source cap skipped apart), ``capped`` (candidates skipped by a per-source cap),
    ``cancelled`` (admitted loads dropped or cut), ``speculative_bytes`` (bytes the prefetcher
    read, cut loads' reads included) and ``unused_bytes`` (of those loaded, bytes the layer did
    not select); ``cancellation_rate``: cancelled over admitted (loads + cancelled), None when
    nothing was admitted."""

    loads: float
    rejected: float
    capped: float
    cancelled: float
    speculative_bytes: float
    unused_bytes: float
    cancellation_rate: float | None


def admission_counts(steps) -> AdmissionCounts | None:
    """The :class:`AdmissionCounts` of a replay's step table (:class:`replay.model.metrics.StepTable`);
    None when no source ran."""
    p = steps.prefetch
    if p is None:
        return None
    tokens = max(float(steps.committed.sum()), 1e-12)
    loads, cancelled = float(p["loads"].sum()), float(p["cancelled"].sum())
    return AdmissionCounts(loads / tokens, float(p["rejected"].sum()) / tokens, float(p["capped"].sum()) / tokens,
                           cancelled / tokens,
                           float(p["issued"].sum()) / tokens, float(p["unused"].sum()) / tokens,
                           cancelled / (loads + cancelled) if loads + cancelled else None)
