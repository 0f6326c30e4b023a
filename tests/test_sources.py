"""Several prediction sources at once: the fused probability (replay.model.predictors) and per-source
caps on the admission budgets (replay.model.admission)."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_admission import PER_EXPERT, drive, free_compute, stall
from test_predictors import layout, random_trace, routing

from containers.errors import InputError
from replay.model.config import RuntimeConfig
from replay.model.engine import Replay
from replay.model.metrics import step_table
from replay.control.sources import (
    fit_fusion,
    fused_probability,
    learn_fused,
    learn_source,
    reliability_of_cells,
    score_source,
)
from replay.model.predictors import CALIBRATION_BINS, FusedModel, SourceModel
from replay.model.unions import chunk_instances, whole_forward_blocks

EXPERT = 45056
"""Bytes of one expert of :func:`test_predictors.layout` (32 KiB of weights, three 4 KiB scales)."""


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_the_fusion_recovers_a_known_logistic_combination_and_is_calibrated():
    """Truth: an expert is needed with probability sigmoid(-0.5 + 0.8 logit p1 + 1.3 logit p2)."""
    rng = np.random.default_rng(3)
    grid = np.linspace(0.03, 0.97, 15)
    p = np.array([(a, b) for a in grid for b in grid])
    truth = np.array([-0.5, 0.8, 1.3])
    f = _sigmoid(truth[0] + np.log(p / (1 - p)) @ truth[1:])
    n = np.full(len(p), 4000.0)
    coef = fit_fusion(p, n, rng.binomial(4000, f).astype(float))
    assert coef == pytest.approx(truth, abs=0.05)
    held_out = rng.binomial(4000, f).astype(float)
    fused = reliability_of_cells("fused", fused_probability(coef, p), n, held_out)
    assert fused.ece < 0.005
    # either source alone, taken at its word, is badly calibrated against the same truth
    for s in (0, 1):
        assert reliability_of_cells("one", p[:, s], n, held_out).ece > 0.05


def test_the_fit_converges_on_imbalanced_cells_where_plain_newton_steps_diverge():
    """Many rare-event candidates at one near-constant probability of the second source (as a
    replay's bin 0 is): undamped Newton steps from the base rate run off to |w| ~ 1e6 here."""
    rng = np.random.default_rng(0)
    p1 = np.concatenate([np.full(50, 1e-4), np.linspace(0.01, 0.9, 50)])
    p = np.column_stack([p1, np.concatenate([np.full(50, 0.03), np.full(50, 0.031)])])
    n = np.concatenate([np.full(50, 5e7), np.full(50, 1e6)])
    y = rng.binomial(n.astype(np.int64), 0.9 * p1 + 0.001).astype(float)
    coef = fit_fusion(p, n, y)
    assert np.all(np.abs(coef) < 100)
    f = fused_probability(coef, p)
    assert reliability_of_cells("fused", f, n, y).ece < 0.01
    base = y.sum() / n.sum()
    assert np.sum(y * np.log(f) + (n - y) * np.log(1 - f)) > np.sum(y * np.log(base) + (n - y) * np.log(1 - base))


def test_fusion_fits_the_training_sessions_at_least_as_well_as_each_source():
    """The fit maximises the likelihood over weights that include each source alone (w_s = 1,
    the others 0), so on the candidates it was fitted to no source has a lower log-loss."""
    tr = random_trace(11, forwards=60, sessions=2, k=3)
    lay = layout()
    train = tr.session_forward_mask([0])
    fused = learn_fused(("heat", "coupled"), tr, train, lay)
    assert fused.name == "heat+coupled" and fused.names == ("heat", "coupled")

    def log_loss(coef):
        from replay.control.sources import _cell_probabilities, _fused_cells

        n, y = _fused_cells(fused.sources, tr, train, lay)
        q = np.clip(fused_probability(coef, _cell_probabilities(fused.sources, n.shape[1])), 1e-12, 1 - 1e-12)
        return -float(np.sum(y * np.log(q) + (n - y) * np.log(1 - q)))

    best = log_loss(fused.coef)
    assert best <= log_loss(np.array([0.0, 1.0, 0.0])) + 1e-6
    assert best <= log_loss(np.array([0.0, 0.0, 1.0])) + 1e-6
    # held out: scored on the same candidates as each source alone
    test = tr.session_forward_mask([1])
    alone = [score_source(m, tr, test, lay) for m in fused.sources]
    both = score_source(fused, tr, test, lay)
    assert both.source == "heat+coupled"
    assert {r.candidates for r in alone} == {both.candidates} and both.candidates == 30 * 2 * 16
    assert both.base_rate == alone[0].base_rate and 0.0 <= both.brier <= 1.0


def _hand_models(L=2, E=16):
    """Two sources for layer 4 of :func:`_hand_trace`, built by hand.

    heat: raw scores W1 = 0.9 (bin 19), W2 = 0.8 (bin 17), R = Z = 0.1 (bin 3), others 0; its
    calibration maps bin b to b / 20: p = 0.95, 0.85, 0.15, 0.
    coupled: layer 3's experts 0 and 1 (10 training selections each) are each followed 8 times by
    R and by Z: raw 16 / 20 = 0.8 (bin 17); its calibration maps bin b to max(b / 20, 0.5): R and
    Z get 0.85, every expert it does not list 0.5.
    Fused with weights (0, 1, 1): W1 0.95, W2 0.85, R = Z = sigmoid(logit 0.15 + logit 0.85) = 0.5,
    the others 1e-4 (below the probability floor). Credits: W1, W2 to heat, R, Z to coupled.
    """
    W1, W2, R, Z = 0, 3, 2, 5
    heat = np.zeros((L, E))
    heat[1, [W1, W2, R, Z]] = [0.9, 0.8, 0.1, 0.1]
    ident = np.tile(np.linspace(0.0, 1.0, CALIBRATION_BINS), (L, 1))
    heat_model = SourceModel("heat", np.full((L, E, 1), -1, np.int32), np.zeros((L, E, 1), np.int32), np.zeros((L, E)),
                             heat, ident)
    targets, counts = np.full((L, E, 2), -1, np.int32), np.zeros((L, E, 2), np.int32)
    sel = np.zeros((L, E))
    for a in (0, 1):
        targets[0, a], counts[0, a], sel[0, a] = [R, Z], [8, 8], 10
    coupled = SourceModel("coupled", targets, counts, sel, np.zeros((L, E)), np.maximum(ident, 0.5))
    return FusedModel([heat_model, coupled], np.array([0.0, 1.0, 1.0])), (W1, W2, R, Z)


def _hand_trace(R, Z):
    # one held-out forward: layer 3 routes {0, 1}, layer 4 {R, Z}
    return routing([[[[0, 1]], [[R, Z]]]], [0], layers=(3, 4))


def test_a_cap_lets_the_other_sources_right_candidate_in():
    """Computed by hand (:func:`_hand_models`). B = two experts' bytes, Q = 2. Without caps the
    fused order is W1, W2, R, Z: heat's two wrong candidates take all of B, layer 4 reads R and
    Z on demand on one worker: its compute thread waits 2 x PER_EXPERT. With caps (0.5, 0.5)
    each source may take one load (floor(0.5 x 2)) and one expert's bytes: W1 (heat), W2 capped,
    R (coupled), and Q is full before Z; R is ready in time and layer 4 waits for Z alone,
    1 x PER_EXPERT."""
    fused, (W1, W2, R, Z) = _hand_models()
    tr = _hand_trace(R, Z)
    lay = layout(layers=(3, 4))
    mask = np.ones(1, bool)
    cfg = free_compute(dense_seconds=0.01, prefetch="heat+coupled", admission="probability", prefetch_experts=2,
                       prefetch_bytes=2 * EXPERT)
    free, _ = stall(tr, mask, cfg, fused, lay=lay)
    capped, _ = stall(tr, mask, replace(cfg, source_caps=(0.5, 0.5)), fused, lay=lay)
    assert free.prefetch.unused[1] == 2 * EXPERT and free.prefetch.timely[1] == 0       # it loaded W1, W2
    assert free.stall[1] == pytest.approx(2 * PER_EXPERT, rel=1e-9)
    assert free.prefetch.rejected[0] == 2 and free.prefetch.capped[0] == 0              # R, Z: over B
    assert capped.prefetch.unused[1] == EXPERT and capped.prefetch.timely[1] == EXPERT  # W1 and R
    assert capped.stall[1] == pytest.approx(PER_EXPERT, rel=1e-9)
    assert capped.prefetch.capped[0] == 1 and capped.prefetch.rejected[0] == 1          # W2 over heat's cap; Z: Q full
    assert capped.stall[0] == free.stall[0]                                            # layer 3 is not predicted
    # the same under the runtime's top-K rule over the fused probability (K = 2, its two best: W1, W2)
    topk = replace(cfg, admission="top-k")
    t_free, _ = stall(tr, mask, topk, fused, lay=lay)
    t_capped, _ = stall(tr, mask, replace(topk, source_caps=(0.5, 0.5)), fused, lay=lay)
    assert t_free.stall[1] == pytest.approx(2 * PER_EXPERT, rel=1e-9)
    assert t_capped.prefetch.loads[0] == 1 and t_capped.prefetch.capped[0] == 1          # W1 kept, W2 capped
    assert t_capped.stall[1] == pytest.approx(2 * PER_EXPERT, rel=1e-9)                   # K = 2 never listed R


def test_the_replay_credits_each_candidate_to_the_source_most_sure_of_it():
    fused, _ = _hand_models()
    lay = layout(layers=(3, 4))
    tr = _hand_trace(2, 5)
    cfg = free_compute(dense_seconds=0.01, prefetch="heat+coupled", admission="probability", prefetch_experts=2,
                       prefetch_bytes=2 * EXPERT, source_caps=(0.5, 0.5))
    replay = Replay(lay, drive(), cfg, coupling=fused)
    for inst in chunk_instances(whole_forward_blocks(tr, 16), np.ones(1, bool), tr.fwd_session, lay):
        replay.run(inst)
    assert replay.table.fusion.tally.tolist() == [[2, 2], [1, 1], [1, 0]]     # credited, admitted, capped


@pytest.mark.parametrize("policy", ["top-k", "probability", "stall-value"])
def test_caps_of_one_leave_a_run_bit_identical(policy):
    """Default (no caps) and the cap machinery with every share 1 give the same step tables, for
    one source and for two."""
    tr = random_trace(8, forwards=40, sessions=2, k=3)
    lay = layout()
    train, test = tr.session_forward_mask([0]), tr.session_forward_mask([1])
    heat = learn_source("heat", tr, train, lay)
    both = learn_fused(("heat", "persistence"), tr, train, lay)
    for source, model, caps in (("heat", heat, (1.0,)), ("heat+persistence", both, (1.0, 1.0))):
        cfg = RuntimeConfig(workers=2, dense_seconds=2e-4, prefetch=source, admission=policy, prefetch_experts=4,
                            prefetch_bytes=3 * EXPERT, ram_bytes=3 * 4 * EXPERT)
        plain, _ = stall(tr, test, cfg, model, lay=lay)
        machinery, _ = stall(tr, test, replace(cfg, source_caps=caps), model, lay=lay)
        a, b = step_table(tr, test, plain), step_table(tr, test, machinery)
        assert a.stall.tolist() == b.stall.tolist() and a.stall.sum() > 0
        assert {k: v.tolist() for k, v in a.prefetch.items()} == {k: v.tolist() for k, v in b.prefetch.items()}
        assert a.prefetch["loads"].sum() > 0 and b.prefetch["capped"].sum() == 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
       st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
       st.floats(0.0, 2e-3), st.integers(1, 6), st.integers(1, 6),
       st.tuples(st.sampled_from((0.0, 0.25, 0.5, 1.0)), st.sampled_from((0.0, 0.25, 0.5, 1.0))),
       st.sampled_from(("top-k", "probability", "deadline", "stall-value")))
def test_caps_never_delay_a_demand_read(first, second, dense, slots, budget, caps, policy):
    # one held-out forward, two layers; training makes layer 4's likely experts ones it does not select
    k = min(len(first), len(second))
    wrong = [e for e in range(16) if e not in second[:k]][:k]
    train = [[[sorted(first[:k])], [wrong]]] * 3
    tr = routing(train + [[[sorted(first[:k])], [sorted(second[:k])]]], [0, 0, 0, 1], layers=(3, 4))
    lay = layout(layers=(3, 4))
    model = learn_fused(("heat", "coupled"), tr, tr.session_forward_mask([0]), lay)
    test = tr.session_forward_mask([1])
    cfg = free_compute(dense_seconds=dense, prefetch="heat+coupled", prefetch_experts=slots, admission=policy,
                       prefetch_bytes=budget * EXPERT)
    free, _ = stall(tr, test, cfg, model, lay=lay)
    capped, _ = stall(tr, test, replace(cfg, source_caps=caps), model, lay=lay)
    # a cap that keeps out a right prefetch (top-k lists improbable experts too) adds a demand
    # read rather than delaying one: the claim is about the demand reads both runs make
    assume(free.prefetch.unused[1] == free.prefetch.issued[0])      # every uncapped load was wrong
    assert capped.prefetch.demand_done[1] <= free.prefetch.demand_done[1] + 1e-15
    assert capped.stall[1] <= free.stall[1] + 1e-15
    assert capped.prefetch.loads[0] <= free.prefetch.loads[0]


def test_settings_of_several_sources_are_checked():
    assert RuntimeConfig(prefetch="coupled+persistence").sources == ("coupled", "persistence")
    assert RuntimeConfig().sources == () and RuntimeConfig(prefetch="heat").sources == ("heat",)
    for bad, words in (("coupled+coupled", "distinct"), ("oracle+heat", "not none, oracle or pilot"),
                       ("heat+session+coupled+persistence", "combine 2-3"), ("heat+", "unknown prefetch source"),
                       ("warm", "unknown prefetch source")):
        with pytest.raises(InputError, match=words):
            RuntimeConfig(prefetch=bad)
    with pytest.raises(InputError, match="one per source"):
        RuntimeConfig(prefetch="heat+coupled", admission="probability", source_caps=(0.5,))
    with pytest.raises(InputError, match=r"in \[0, 1\]"):
        RuntimeConfig(prefetch="heat+coupled", admission="probability", source_caps=(0.5, 1.5))
    with pytest.raises(InputError, match="observe"):
        RuntimeConfig(prefetch="heat+coupled", admission="observe", source_caps=(0.5, 0.5))
    from replay.model.controller import prefetcher_inputs

    with pytest.raises(InputError, match="fused probability learned"):
        prefetcher_inputs(RuntimeConfig(prefetch="heat+coupled", admission="probability"), layout(), None)
    fused, _ = _hand_models(L=3)
    with pytest.raises(InputError, match="learned sources are 'heat\\+coupled'"):
        prefetcher_inputs(RuntimeConfig(prefetch="coupled+heat", admission="probability"), layout(), fused)


def test_a_configuration_with_caps_reads_back_from_its_json():
    """gate.json records the runtime configuration and reads it back strictly (containers.records)."""
    import json

    from containers import records

    cfg = RuntimeConfig(prefetch="coupled+persistence", admission="stall-value", source_caps=(0.75, 0.25))
    back = records.from_json(RuntimeConfig, json.loads(json.dumps(cfg.to_json())), None)
    assert back == cfg and back.source_caps == [0.75, 0.25]
    assert records.from_json(RuntimeConfig, json.loads(json.dumps(RuntimeConfig().to_json())), None) == RuntimeConfig()
