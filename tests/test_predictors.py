"""Prediction sources as probabilities (replay.model.predictors): calibration, Brier score, ECE."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.layout import Layout
from replay.control.sources import isotonic_bins, learn_source, plot_reliability, score_source
from replay.model.predictors import RELIABILITY_BINS
from replay.model.routing import RoutingTrace

SOURCES = ("heat", "persistence", "coupled", "session", "oracle")


def layout(E=16, layers=(3, 4, 5)):
    """One file, each expert's three weights adjacent, then its three scales (4 KiB aligned)."""
    loc = np.zeros((len(layers), E, 6, 3), dtype=np.int64)
    off = 4096
    for li in range(len(layers)):
        for e in range(E):
            for slot, n in enumerate((8192, 8192, 16384, 4096, 4096, 4096)):
                loc[li, e, slot] = (0, off, n)
                off += n
    return Layout(["f.safetensors"], [off], list(layers), E, loc, 4096)


def routing(forwards, sessions, layers=(3, 4, 5), E=16):
    """A trace from ``forwards[f][l]``: the positions of layer ``layers[l]``, each a list of k experts."""
    rf, rl, rp, ex = [], [], [], []
    for f, per_layer in enumerate(forwards):
        for layer, positions in zip(layers, per_layer):
            for p, sel in enumerate(positions):
                rf.append(f)
                rl.append(layer)
                rp.append(p)
                ex.append(sel)
    F = len(forwards)
    sess = np.asarray(sessions, dtype=np.int32)
    return RoutingTrace(
        layers=np.array(layers, dtype=np.int16), n_experts=E, top_k=len(ex[0]), geometry="test",
        sessions=[f"s{i}" for i in range(int(sess.max()) + 1)],
        row_forward=np.array(rf, dtype=np.int32), row_layer=np.array(rl, dtype=np.int16),
        row_position=np.array(rp, dtype=np.int32), experts=np.array(ex, dtype=np.int16),
        gates=np.full((len(ex), len(ex[0])), np.nan, dtype=np.float32), fwd_session=sess,
        fwd_kind=np.zeros(F, dtype=np.int8), fwd_evaluated=np.ones(F, dtype=np.int32),
        fwd_committed=np.ones(F, dtype=np.int32))


def random_trace(seed, forwards=40, sessions=2, k=2, positions=1, E=16):
    rng = np.random.default_rng(seed)
    rows = [[[sorted(rng.choice(E, k, replace=False).tolist()) for _ in range(positions)] for _ in range(3)]
            for _ in range(forwards)]
    return routing(rows, np.repeat(np.arange(sessions), -(-forwards // sessions))[:forwards], E=E)


def test_a_source_that_predicts_the_truth_has_brier_0_and_ece_0():
    tr = random_trace(0)
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    r = score_source(learn_source("oracle", tr, train, layout()), tr, test, layout())
    # every expert of layers 4 and 5 in each held-out forward is one candidate
    assert r.candidates == 20 * 2 * 16 and r.brier == 0.0 and r.ece == 0.0
    assert r.base_rate == pytest.approx(2 / 16)


def test_a_constant_probability_source_at_the_base_rate_has_ece_0_and_brier_p_times_1_minus_p():
    # forward f's unions are the four experts 4(f % 4)..4(f % 4)+3: each expert is in exactly a
    # quarter of the forwards, so the heat source gives every candidate p = 1/4
    rows = [[[[4 * (f % 4) + j for j in range(4)]]] * 3 for f in range(32)]
    tr = routing(rows, [0] * 16 + [1] * 16)
    model = learn_source("heat", tr, tr.session_forward_mask([0]), layout())
    assert np.allclose(model.heat, 0.25)
    r = score_source(model, tr, tr.session_forward_mask([1]), layout())
    assert r.base_rate == 0.25
    assert r.ece == pytest.approx(0.0, abs=1e-12)
    assert r.brier == pytest.approx(0.25 * 0.75, abs=1e-12)
    assert r.bin_count[2] == r.candidates and r.bin_probability[2] == pytest.approx(0.25)


def test_persistence_learns_that_the_previous_tokens_experts_come_back():
    # each session repeats one union for a while: the previous token's experts are needed again
    rng = np.random.default_rng(3)
    rows = []
    for f in range(60):
        if f % 6 == 0:
            sticky = [sorted(rng.choice(16, 2, replace=False).tolist()) for _ in range(3)]
        rows.append([[u] for u in sticky])
    tr = routing(rows, [0] * 30 + [1] * 30)
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    persist = score_source(learn_source("persistence", tr, train, layout()), tr, test, layout())
    heat = score_source(learn_source("heat", tr, train, layout()), tr, test, layout())
    assert persist.brier < 0.5 * heat.brier
    assert persist.ece < 0.05


def test_the_coupled_source_learns_which_experts_follow():
    # layer L+1 always picks the experts two above layer L's: the pair table predicts them
    rng = np.random.default_rng(1)
    rows = []
    for f in range(40):
        a = sorted(rng.choice(12, 2, replace=False).tolist())
        rows.append([[a], [[e + 2 for e in a]], [[e + 4 for e in a]]])
    tr = routing(rows, [0] * 20 + [1] * 20)
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    coupled = score_source(learn_source("coupled", tr, train, layout()), tr, test, layout())
    heat = score_source(learn_source("heat", tr, train, layout()), tr, test, layout())
    assert coupled.brier < 0.5 * heat.brier


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(SOURCES), st.integers(1, 3), st.integers(1, 3))
def test_probabilities_are_in_0_1_and_calibrations_never_decrease(seed, name, k, positions):
    tr = random_trace(seed, forwards=24, sessions=3, k=k, positions=positions)
    train = tr.session_forward_mask([0, 1])
    model = learn_source(name, tr, train, layout())
    assert ((model.calib >= 0) & (model.calib <= 1)).all()
    assert (np.diff(model.calib, axis=1) >= -1e-12).all()
    r = score_source(model, tr, tr.session_forward_mask([2]), layout())
    assert 0 <= r.brier <= 1 and 0 <= r.ece <= 1
    for b, (n, p, y) in enumerate(zip(r.bin_count, r.bin_probability, r.bin_frequency)):
        if n:
            assert b / RELIABILITY_BINS - 1e-12 <= p <= (b + 1) / RELIABILITY_BINS + 1e-12 and 0 <= y <= 1
    assert sum(r.bin_count) == r.candidates


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_isotonic_bins_are_monotone_and_keep_the_event_total(cells):
    n = np.array([a + b for a, b in cells], dtype=float)
    y = np.array([b for _, b in cells], dtype=float)
    fit = isotonic_bins(n, y)
    assert (np.diff(fit) >= -1e-12).all() and ((fit >= 0) & (fit <= 1)).all()
    assert (fit * n).sum() == pytest.approx(y.sum())     # pooling keeps each block's events
    full = n > 0
    if full.any() and (np.diff((y[full] / n[full])) >= 0).all():
        assert fit[full] == pytest.approx(y[full] / n[full])   # already monotone: unchanged


def test_a_source_without_training_forwards_is_refused():
    from containers.errors import InputError

    tr = random_trace(0)
    with pytest.raises(InputError, match="needs training forwards"):
        learn_source("heat", tr, np.zeros(tr.n_forwards, bool), layout())


def test_the_reliability_plot_is_written(tmp_path):
    tr = random_trace(2)
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    scores = [score_source(learn_source(n, tr, train, layout()), tr, test, layout()) for n in ("heat", "oracle")]
    plot_reliability(scores, tmp_path / "reliability.png")
    assert (tmp_path / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]), min_size=1, max_size=20), st.integers(1, 8))
def test_top_k_of_a_probability_source_is_the_k_most_probable_ties_by_id(p, k):
    from replay.model.predictors import most_probable

    p = np.array(p)
    out = np.empty(len(p), dtype=np.int64)
    n = most_probable(p, k, out)
    want = sorted((e for e in range(len(p)) if p[e] > 0), key=lambda e: (-p[e], e))[:k]
    assert out[:n].tolist() == want
