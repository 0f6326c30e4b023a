"""Prefetch admission under equal budgets and tail control (replay.model.admission in the compiled loop)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_predictors import layout, routing

from replay.model.admission import Valuation, _most_probable, _never_gains, _value
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, DriveProfile
from replay.model.engine import simulate
from replay.model.metrics import step_table, summarize
from replay.control.sources import learn_source
from replay.model.controller import prefetcher_inputs

POLICIES = ("probability", "per-byte", "deadline", "stall-value")
LAT, BW = 1e-4, 1e9
PER_EXPERT = (LAT + 32768 / BW) + 3 * (LAT + 4096 / BW)
"""One cold expert of :func:`test_predictors.layout` on :func:`drive`: a 32 KiB weight read and
three 4 KiB scale reads, one after another."""


def drive(page_cache_fraction=0.0):
    return ArrayProfile("test-drive", DriveProfile("d", LAT, BW, 32), 1, 0, "none", 1e12,
                        page_cache_fraction=page_cache_fraction, read_ahead_bytes=0)


def free_compute(**kw):
    return RuntimeConfig(workers=1, compute_bytes_per_second=1e30, **kw)


def stall(tr, mask, cfg, model=None, dev=None, lay=None):
    inst, usage = simulate(tr, mask, lay or layout(layers=(3, 4)), dev or drive(), cfg, coupling=model)
    return inst, summarize(step_table(tr, mask, inst), usage, 0.0)


def test_with_an_oracle_source_and_ample_time_stall_value_admission_equals_the_oracle_bound():
    rng = np.random.default_rng(5)
    rows = [[[sorted(rng.choice(16, 3, replace=False).tolist())] for _ in range(3)] for _ in range(12)]
    tr = routing(rows, [0] * 12)
    mask = np.ones(12, bool)
    lay = layout()
    for ram in (0, 3 * 4 * 45056):
        cfg = free_compute(dense_seconds=0.05, prefetch="oracle", prefetch_experts=8, ram_bytes=ram)
        bound, b = stall(tr, mask, replace(cfg, admission="oracle"), lay=lay)
        valued, v = stall(tr, mask, replace(cfg, admission="stall-value"), lay=lay)
        assert valued.stall.tolist() == bound.stall.tolist()
        assert v.stall_per_token_s == b.stall_per_token_s > 0          # the first layer is never predicted
        if ram == 0:      # (with an LRU, a load may evict a needed expert that was resident: both policies alike)
            assert valued.stall[valued.layer > 0].sum() == 0.0          # every later layer is ready in time
        assert valued.prefetch.unused.sum() == 0.0 and valued.prefetch.rejected.sum() == 0


def test_with_one_queue_slot_and_a_wrong_likely_candidate_stall_value_beats_probability_first():
    """Computed by hand.

    Training (session 0, 10 forwards): layer 4's union holds expert W = 0 in 7, R = 2 in 6, X = 3
    in 4 and Y = 4 in 3, so the heat source gives them p = 0.7, 0.6, 0.4, 0.3. The page cache
    holds W's weights (page-cache fraction 178/10,000: the first 178 buckets; W's first page is
    bucket 177, R's 199), so a miss of W costs its scales only. Held out (session 1): layer 3
    routes {0, 1}, layer 4 {R, Z = 5}; W is wrong. One queue slot, 10 ms before layer 4 is routed.

    Probability first loads W (unused); layer 4 then reads R and Z on one worker: its compute
    thread waits for R (one cold expert) and then for Z (a second one), 2 x PER_EXPERT.
    Stall-valued (lambda = rho = 1 before any layer-4 miss is measured, no cache, time to spare):
    V(W) = 0.7 x (32 KiB / 10 GB/s + 3 x 100 us + 12 KiB / 1 GB/s) / b = 0.221 ms / b and
    V(R) = 0.6 x PER_EXPERT / b = 0.267 ms / b: it loads R, and layer 4 waits for Z alone,
    1 x PER_EXPERT.
    """
    W, R, X, Y, Z = 0, 2, 3, 4, 5
    train = [[[[0, 1]], [[W, R]]]] * 6 + [[[[0, 1]], [[W, X]]]] + [[[[0, 1]], [[X, Y]]]] * 3
    tr = routing(train + [[[[0, 1]], [[R, Z]]]], [0] * 10 + [1], layers=(3, 4))
    lay = layout(layers=(3, 4))
    model = learn_source("heat", tr, tr.session_forward_mask([0]), lay)
    assert model.calib[1][[15, 13, 9, 7]] == pytest.approx([0.7, 0.6, 0.4, 0.3])   # bins of 0.7, 0.6, 0.4, 0.3
    test = tr.session_forward_mask([1])
    dev = drive(page_cache_fraction=178 / 10_000)
    cfg = free_compute(dense_seconds=0.01, prefetch="heat", prefetch_experts=1)
    prob, _ = stall(tr, test, replace(cfg, admission="probability"), model, dev, lay)
    valued, _ = stall(tr, test, replace(cfg, admission="stall-value"), model, dev, lay)
    assert prob.prefetch.loads[0] == 1 and prob.prefetch.unused[1] == 45056          # it loaded W
    assert prob.stall[1] == pytest.approx(2 * PER_EXPERT, rel=1e-9)
    assert valued.prefetch.unused[1] == 0 and valued.prefetch.timely[1] == 45056     # it loaded R
    assert valued.stall[1] == pytest.approx(PER_EXPERT, rel=1e-9)
    assert prob.prefetch.rejected[0] == valued.prefetch.rejected[0] == 3            # four candidates, one slot


def test_when_the_host_is_compute_bound_no_policy_saves_anything():
    rng = np.random.default_rng(7)
    rows = [[[sorted(rng.choice(16, 2, replace=False).tolist())] for _ in range(3)] for _ in range(40)]
    tr = routing(rows, [0] * 20 + [1] * 20)
    lay = layout()
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    model = learn_source("coupled", tr, train, lay)
    slow = RuntimeConfig(workers=2, compute_bytes_per_second=1e6, ram_bytes=2 * 3 * 45056)   # 33 ms per matmul
    _, base = stall(tr, test, slow, lay=lay)
    tpot = base.tpot_s
    assert base.stall_per_token_s < 0.01 * tpot
    for policy in POLICIES + ("oracle",):
        source = "oracle" if policy == "oracle" else "coupled"
        _, m = stall(tr, test, replace(slow, prefetch=source, admission=policy), None if source == "oracle" else model,
                     lay=lay)
        assert abs(base.stall_per_token_s - m.stall_per_token_s) < 0.01 * tpot, policy


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
       st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
       st.floats(0.0, 2e-3), st.integers(1, 6), st.sampled_from(("probability", "per-byte", "deadline")))
def test_cancellation_never_delays_a_demand_read(first, second, dense, slots, policy):
    # one forward, two layers; training makes layer 4's likely experts ones it may not select
    k = min(len(first), len(second))
    train = [[[sorted(first[:k])], [sorted((e + 7) % 16 for e in second[:k])]]] * 3
    tr = routing(train + [[[sorted(first[:k])], [sorted(second[:k])]]], [0, 0, 0, 1], layers=(3, 4))
    lay = layout(layers=(3, 4))
    model = learn_source("heat", tr, tr.session_forward_mask([0]), lay)
    test = tr.session_forward_mask([1])
    cfg = free_compute(dense_seconds=dense, prefetch="heat", prefetch_experts=slots, admission=policy)
    kept, _ = stall(tr, test, cfg, model, lay=lay)
    cut, _ = stall(tr, test, replace(cfg, cancel_stale=True), model, lay=lay)
    assert cut.prefetch.demand_done[1] <= kept.prefetch.demand_done[1] + 1e-15
    assert cut.stall[1] <= kept.stall[1] + 1e-15
    assert cut.prefetch.cancelled[0] >= kept.prefetch.cancelled[0]


def test_a_wrong_load_in_flight_at_routing_is_cut_and_the_demand_read_goes_first():
    # layer 4 is routed 150 us after the prefetcher starts: its wrong load (four reads of ~100 us)
    # is on its second read; cancelled, it issues no more and layer 4's demand read starts at once
    train = [[[[0, 1]], [[9, 10]]]] * 3
    tr = routing(train + [[[[0, 1]], [[2, 3]]]], [0, 0, 0, 1], layers=(3, 4))
    lay = layout(layers=(3, 4))
    model = learn_source("heat", tr, tr.session_forward_mask([0]), lay)
    test = tr.session_forward_mask([1])
    cfg = free_compute(dense_seconds=150e-6, prefetch="heat", prefetch_experts=1, admission="probability")
    kept, _ = stall(tr, test, cfg, model, lay=lay)
    cut, _ = stall(tr, test, replace(cfg, cancel_stale=True), model, lay=lay)
    assert kept.prefetch.cancelled[0] == 0 and cut.prefetch.cancelled[0] == 1
    assert cut.prefetch.loads[0] == 0 and cut.prefetch.issued[0] == 32768 + 4096    # two reads went out
    # the read in flight at routing ends within the demand read's 100 us latency: no delay at all;
    # kept, the wrong load completes PER_EXPERT - 150 us after routing, and the demand reads start
    # only then (the runtime waits for a load in flight on the layer it routes)
    assert cut.stall[1] == pytest.approx(2 * PER_EXPERT, rel=1e-9)
    assert kept.stall[1] == pytest.approx(2 * PER_EXPERT + (PER_EXPERT - 150e-6), rel=1e-9)


def test_every_policy_gets_the_same_byte_budget():
    rng = np.random.default_rng(2)
    rows = [[[sorted(rng.choice(16, 4, replace=False).tolist())] for _ in range(3)] for _ in range(30)]
    tr = routing(rows, [0] * 15 + [1] * 15)
    lay = layout()
    model = learn_source("coupled", tr, tr.session_forward_mask([0]), lay)
    test = tr.session_forward_mask([1])
    for policy in POLICIES + ("top-k",):
        cfg = free_compute(dense_seconds=0.05, prefetch="coupled", admission=policy, prefetch_experts=8,
                           prefetch_bytes=2 * 45056, prefetch_min_probability=0.0)
        inst, _ = stall(tr, test, cfg, model, lay=lay)
        assert inst.prefetch.issued.max() <= 2 * 45056, policy
        assert inst.prefetch.loads.sum() > 0, policy
    # the runtime's top-K rule (K = 8) without a byte budget loads more than two experts' worth
    unbounded, _ = stall(tr, test, replace(cfg, prefetch_bytes=0), model, lay=lay)
    assert unbounded.prefetch.issued.max() > 2 * 45056
    assert inst.prefetch.rejected.sum() > 0 == unbounded.prefetch.rejected.sum()


def test_observe_scores_the_late_need_probability_without_loading():
    rng = np.random.default_rng(4)
    rows = [[[sorted(rng.choice(16, 3, replace=False).tolist())] for _ in range(3)] for _ in range(30)]
    tr = routing(rows, [0] * 15 + [1] * 15)
    lay = layout()
    model = learn_source("coupled", tr, tr.session_forward_mask([0]), lay)
    test = tr.session_forward_mask([1])
    base, _ = stall(tr, test, free_compute(), lay=lay)
    seen, _ = stall(tr, test, free_compute(prefetch="coupled", admission="observe"), model, lay=lay)
    assert seen.stall.tolist() == base.stall.tolist() and seen.prefetch.issued.sum() == 0
    p = seen.prefetch
    # every expert of layers 4 and 5 of each held-out forward is scored; with no cache and free
    # compute every needed expert is a demand miss that waits, so the events are the unions
    assert p.late_n.sum() == 15 * 2 * 16 and p.late_y.sum() == 15 * 2 * 3
    assert ((p.late_p >= 0) & (p.late_p <= p.late_n)).all() and p.late_sq.sum() <= p.late_n.sum()


def test_a_probability_source_needs_its_learned_model():
    from containers.errors import InputError

    with pytest.raises(InputError, match="needs its probabilities learned"):
        prefetcher_inputs(RuntimeConfig(prefetch="heat", admission="stall-value"), layout(), None)
    with pytest.raises(InputError, match="unknown admission policy"):
        RuntimeConfig(admission="best")


@settings(max_examples=300, deadline=None)
@given(p=st.floats(0, 1), need=st.floats(-1e-2, 1e-2), svc=st.floats(1e-6, 1e-2), t=st.floats(0, 1e-2),
       routed=st.floats(0, 1e-2), lam=st.floats(0, 1), rho=st.floats(0, 4), p_victim=st.floats(0, 1),
       nbytes=st.integers(1, 10**8))
def test_no_need_time_values_a_load_above_one_needed_no_sooner_than_it_completes(*, p, need, svc, t, routed,
                                                                                 lam, rho, p_victim, nbytes):
    """V(a) does not decrease with the need time, to the last bit (replay.model.admission._may_gain
    skips ordering the candidates when none is positive at need time inf)."""
    v = Valuation(routed=routed, lam=lam, rho=rho, p_victim=p_victim, full_bandwidth=2e9)
    bound = _value(p, np.inf, svc, t, nbytes, v)
    assert _value(p, need, svc, t, nbytes, v) <= bound
    assert _value(p, need, svc, t, nbytes, v) <= _value(p, need + abs(need) * 1e-9 + 1e-12, svc, t, nbytes, v)


@settings(max_examples=500, deadline=None)
@given(t0=st.floats(0, 1e-2), d=st.floats(1e-6, 1e-2), lo=st.floats(1e-3, 10), spread=st.floats(0, 4),
       where=st.floats(0, 1), p_victim=st.floats(0, 1), lam=st.floats(0.05, 1), rho=st.floats(1e-9, 4),
       more=st.floats(0, 1), nbytes=st.integers(10**5, 10**8), dp=st.floats(0, 1),
       offset=st.sampled_from([0.0, 1e-15, 1e-12, 1e-9, 1e-6, 1e-3]), above=st.booleans())
def test_stall_value_skips_ranking_only_when_no_load_of_the_pool_can_gain(*, t0, d, lo, spread, where,
                                                                          p_victim, lam, rho, more, nbytes,
                                                                          dp, offset, above):
    """replay.model.admission._never_gains (the stall-valued policy's exit before ranking candidates)
    against _value itself at need time inf, for loads at the very edge of gaining: a probability
    just above or below where V(a) = 0 for a load time anywhere in the layer's range (the
    bound is least at its ends, not its middle) and any bytes above the least. An exit that
    took V for any load time of the range, ignored the bytes or had no slack for rounding
    fails; one that decides nothing fails the second assertion."""
    F, routed = 2e9, t0 + d
    s_lo = d * (1 + lo)
    s_hi = s_lo * (1 + spread)
    k = lam * rho

    def threshold(s, b):                         # the p where V(a) = 0 for load time s and b bytes
        a = b / F * (s - d) / s + p_victim * k * s
        return a / (k * s + a)

    s = s_lo + where * (s_hi - s_lo)
    b = nbytes * (1 + more)
    p_edge = threshold(s, b) * (1 + offset if above else 1 - offset)
    pool_p = np.array([p_edge, dp * p_edge])
    v = Valuation(routed=routed, lam=lam, rho=rho, p_victim=p_victim, full_bandwidth=F)
    if _never_gains(pool_p, 2, t0, v, s_lo, s_hi, float(nbytes)):
        for p in pool_p:
            assert _value(p, np.inf, s, t0, b, v) <= 0.0
    least = min(threshold(s_lo, nbytes), threshold(s_hi, nbytes))
    if p_edge <= least * (1 - 1e-5) and s_lo - d > 1e-3 * (t0 + routed + s_hi):
        assert _never_gains(pool_p, 2, t0, v, s_lo, s_hi, float(nbytes))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 256), st.integers(1, 64), st.integers(1, 6), st.booleans(), st.integers(0, 2**32 - 1))
def test_the_candidates_are_exactly_the_most_probable_whichever_way_they_are_found(n, C, levels, in_order, seed):
    """replay.model.admission._most_probable: counting (up to RANKED_POOL considered experts) and
    insertion (beyond) find the same set as a sort by probability then id; few probability
    levels make ties."""
    rng = np.random.default_rng(seed)
    p = rng.integers(1, levels + 1, 256) / levels
    pool = rng.permutation(256)[:n].astype(np.int64)
    pool_p = np.empty(256)
    pool_p[:n] = p[pool]
    cand = np.full(64, -1, dtype=np.int64)
    nc = _most_probable(pool.copy(), pool_p, n, C, in_order, p, cand)
    expect = pool[:C] if in_order else sorted(pool.tolist(), key=lambda e: (-p[e], e))[:C]
    assert nc == min(n, C) and sorted(cand[:nc].tolist()) == sorted(int(e) for e in expect)
