"""The proposal's hypotheses as tables: verdicts a broken rule would get wrong."""

import numpy as np
import pytest

from containers.errors import InputError
from replay.evaluation.hypotheses import (
    INSUFFICIENT,
    MEDIAN_TOLERANCE,
    NOT_SUPPORTED,
    SUPPORTED,
    ArmSteps,
    admission_table,
    placement_table,
    quantile_difference,
    split_table,
    stall_interval,
    tail_table,
)


def steps(n_sessions=8, per=40, seed=0):
    rng = np.random.default_rng(seed)
    session = np.repeat(np.arange(n_sessions), per)
    base = rng.gamma(4.0, 0.05, size=n_sessions * per)        # s of stall per step
    return session, base


def arm(name, stall, session, spec=0.0, hit=None):
    return ArmSteps(name, np.asarray(stall, float), np.ones(len(stall)), session, spec, hit)


def test_h2_supported_when_stall_value_stalls_less_and_converts_bytes_better():
    session, s0 = steps()
    arms = {"none": arm("none", s0, session),
            "probability": arm("probability", s0 * 0.9, session, spec=1e9),
            "per-byte": arm("per-byte", s0 * 0.92, session, spec=1e9),
            "stall-value": arm("stall-value", s0 * 0.8, session, spec=0.8e9),
            "oracle": arm("oracle", s0 * 0.5, session, spec=0.5e9)}
    t = admission_table(arms, "test")
    assert t.verdict == SUPPORTED, t.reason
    assert {c.against for c in t.comparisons} == {"probability", "per-byte"}          # never against the oracle
    rows = {r.arm: r for r in t.rows}
    assert rows["stall-value"].eta_stall_s_per_byte > rows["probability"].eta_stall_s_per_byte > 0
    assert rows["none"].eta_stall_s_per_byte is None
    assert any("bound" in n for n in t.notes)


def test_h2_not_supported_when_probability_first_matches_it_and_the_falsifier_is_stated():
    session, s0 = steps()
    arms = {"none": arm("none", s0, session), "probability": arm("probability", s0 * 0.9, session, spec=1e9),
            "stall-value": arm("stall-value", s0 * 0.9, session, spec=1e9)}
    t = admission_table(arms, "test")
    assert t.verdict == NOT_SUPPORTED
    assert "Falsifier: If probability-only or deadline-only policies match" in t.reason


def test_h2_lower_stall_but_lower_eta_is_not_supported():
    session, s0 = steps()
    arms = {"none": arm("none", s0, session), "probability": arm("probability", s0 * 0.95, session, spec=0.1e9),
            "stall-value": arm("stall-value", s0 * 0.9, session, spec=10e9)}
    t = admission_table(arms, "test")
    assert t.verdict == NOT_SUPPORTED and "eta_stall" in t.reason


def test_too_few_sessions_is_insufficient_not_a_verdict():
    session, s0 = steps(n_sessions=3)
    arms = {"none": arm("none", s0, session), "probability": arm("probability", s0, session, spec=1e9),
            "stall-value": arm("stall-value", s0 * 0.5, session, spec=1e9)}
    t = admission_table(arms, "test")
    assert t.verdict == INSUFFICIENT and "3 held-out session" in t.reason


def test_h3a_reports_hit_rate_beside_s():
    session, s0 = steps()
    arms = {"frequency": arm("frequency", s0, session, hit=0.40), "stall-value": arm("stall-value", s0 * 0.85, session, hit=0.41)}
    t = placement_table(arms, "64 GB")
    assert t.verdict == SUPPORTED
    assert any("+1.0 points" in n for n in t.notes)


def test_h3b_needs_a_lower_split_somewhere_and_no_higher_anywhere():
    session, s0 = steps()
    w = arm("whole", s0, session)
    good = {8_000_000_000: (w, arm("split", s0 * 0.8, session)), 16_000_000_000: (w, arm("split", s0, session))}
    assert split_table(good, "t").verdict == SUPPORTED
    bad = {**good, 32_000_000_000: (w, arm("split", s0 * 1.3, session))}
    t = split_table(bad, "t")
    assert t.verdict == NOT_SUPPORTED and "stall MORE" in t.reason
    flat = {8_000_000_000: (w, arm("split", s0, session))}
    assert split_table(flat, "t").verdict == NOT_SUPPORTED


def test_h5_p99_down_median_flat_is_supported_median_up_is_not():
    session, s0 = steps(per=200)
    cut = np.minimum(s0, np.quantile(s0, 0.9))               # the tail is cut, the median untouched
    t = tail_table({"default": arm("default", s0, session), "tail-control": arm("tail-control", cut, session)}, "t")
    assert t.verdict == SUPPORTED, t.reason
    raised = np.maximum(cut, np.quantile(s0, 0.5) * (1 + 4 * MEDIAN_TOLERANCE))   # median pushed up 20%
    t = tail_table({"default": arm("default", s0, session), "tail-control": arm("tail-control", raised, session)}, "t")
    assert t.verdict == NOT_SUPPORTED and "beyond" in t.reason


def test_quantile_difference_of_identical_arms_is_zero_and_interval_covers_a_real_shift():
    session, s0 = steps()
    a = arm("a", s0, session)
    iv, reps = quantile_difference(a, a, 0.99)
    assert iv.estimate == iv.low == iv.high == 0 and not reps.any()
    iv, _ = quantile_difference(a, arm("b", s0 - 0.01, session), 0.5)
    assert iv.low <= 0.01 + 1e-12 and iv.high >= 0.01 - 1e-12


def test_s_interval_contains_the_estimate():
    session, s0 = steps()
    iv = stall_interval(arm("a", s0, session))
    assert iv.low < iv.estimate < iv.high and iv.estimate == pytest.approx(s0.mean())


def test_arms_on_different_steps_are_refused():
    session, s0 = steps()
    with pytest.raises(InputError, match="not the same steps"):
        placement_table({"frequency": arm("frequency", s0, session), "stall-value": arm("stall-value", s0[:-1], session[:-1])}, "t")


def test_a_significant_saving_under_one_percent_of_tpot_is_not_an_improvement():
    session, s0 = steps()
    compute = np.full(len(s0), 100.0)                         # 100 s of compute per step: stall is a sliver
    base = ArmSteps("frequency", s0, np.ones(len(s0)), session, compute=compute)
    t = placement_table({"frequency": base, "stall-value": ArmSteps("stall-value", s0 * 0.8, np.ones(len(s0)), session,
                                                                    compute=compute)}, "t")
    assert t.verdict == NOT_SUPPORTED and "by only" in t.reason
    assert t.comparisons[0].p_value < 0.001                   # significant, just not material


def _measured(path, run, configuration, late_ns, requests=6, steps_per=6):
    """A STALL_TRACE run: per (request, step) one required expert late by ``late_ns[request][step]``."""
    import json

    recs = []
    for q in range(requests):
        for s in range(steps_per):
            recs.append({"record": "step", "run_id": run, "request_id": q, "step": s, "committed_tokens": 1,
                         "evaluated_positions": 1, "configuration": configuration})
            recs.append({"run_id": run, "request_id": q, "step": s, "layer": 3, "expert_id": 1, "required": True,
                         "bytes": 1000, "issue_ns": 0, "ready_ns": int(late_ns[q][s]), "need_ns": 0})
    with open(path, "a") as f:
        f.write("\n".join(json.dumps(r) for r in recs) + "\n")


def test_report_judges_h5_from_measured_runs_like_a_replay(tmp_path):
    from conftest import cli

    rng = np.random.default_rng(3)
    late = rng.integers(1_000_000, 3_000_000, size=(6, 6))
    late[:, 0] = 40_000_000                                 # each request's first step is the tail
    cut = late.copy()
    cut[:, 0] = 3_000_000                                   # tail control removes it, the median unchanged
    path = tmp_path / "runs.jsonl"
    _measured(path, "a", "stock-prefetch", late)
    _measured(path, "b", "budgeted", cut)
    from replay.evaluation.hypotheses import measured_table
    from replay.physical.stalltrace import report

    t = measured_table("H5", report([path]).runs, {"stock-prefetch": "default", "budgeted": "tail-control"})
    assert t.verdict == SUPPORTED, t.reason
    assert t.comparisons[0].difference.estimate == pytest.approx(0.040 - 0.003, rel=1e-6)   # p99: the 40 ms tail, cut to 3 ms
    r = cli("report", path, "--hypothesis", "H5", "--arm", "default=stock-prefetch", "--arm", "tail-control=budgeted")
    assert r.returncode == 0 and "H5 at measured runs" in r.stdout and "SUPPORTED" in r.stdout
    r = cli("report", path, "--hypothesis", "H5")
    assert r.returncode != 0 and "needs the 'default' arm" in r.stderr and "Traceback" not in r.stderr


def test_report_judges_h3b_from_measured_whole_and_split_runs(tmp_path):
    from conftest import cli

    rng = np.random.default_rng(5)
    whole_8 = rng.integers(4_000_000, 6_000_000, size=(6, 6))
    whole_16 = rng.integers(1_000_000, 2_000_000, size=(6, 6))
    path = tmp_path / "runs.jsonl"
    _measured(path, "w8", "whole-8", whole_8)
    _measured(path, "s8", "split-8", whole_8 - 2_000_000)          # split removes 2 ms of every step at 8 GB
    _measured(path, "w16", "whole-16", whole_16)
    _measured(path, "s16", "split-16", whole_16)                  # and nothing at 16 GB
    arms = ["--arm", "whole@8=whole-8", "--arm", "split@8=split-8", "--arm", "whole@16=whole-16", "--arm", "split@16=split-16"]
    r = cli("report", path, "--hypothesis", "H3b", *arms, "--json")
    assert r.returncode == 0, r.stderr
    import json

    t = json.loads(r.stdout)
    assert t["verdict"] == SUPPORTED, t["reason"]
    by = {c["test"]: c for c in t["comparisons"]}
    assert by["split @ 8 GB"]["difference"]["estimate"] == pytest.approx(0.002, rel=1e-9)
    assert by["split @ 16 GB"]["difference"]["estimate"] == 0 and not by["split @ 16 GB"]["holds"]
    r = cli("report", path, "--hypothesis", "H3b", *arms[:6])        # split@16 left unnamed: arm 'split-16'
    assert r.returncode != 0 and "is not whole@GB or split@GB" in r.stderr and "Traceback" not in r.stderr
    _measured(path, "w32", "whole-32", whole_16)
    r = cli("report", path, "--hypothesis", "H3b", *arms, "--arm", "whole@32=whole-32")
    assert r.returncode != 0 and "at 32 GB has no split@ run" in r.stderr
