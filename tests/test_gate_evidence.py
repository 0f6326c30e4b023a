"""The evidence behind a verdict: held out by content, enough units or 'insufficient', a record
that can be rechecked from itself, the saving split into repacking and ordering."""

import json
from dataclasses import replace

import numpy as np
import pytest
from conftest import cli

from containers.errors import InputError
from containers.geometry import load_geometry
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.evidence import MIN_BLOCKS, block_evidence, holm, judge, session_evidence
from replay.evaluation.gate import compare
from replay.evaluation.evidence import recheck
from replay.formats.gatefile import GateRecord
from replay.formats.planfile import load_plan, save_plan
from replay.formats.trace import save_trace

CONFIG = RuntimeConfig(workers=1, coalesce=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """1.2 MB experts with planted cliques: 12 of 17 sessions train, 5 are held out."""
    root = tmp_path_factory.mktemp("evidence")
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=4, ffn=384)
    tr = synth_trace(g.moe_layers, 128, 8, 1700, 17, seed=1, params=SynthParams(clique_strength=0.9))
    plans = {}
    for method in ("louvain", "stock"):
        save_plan(make_plan(tr, source_from_geometry(g), method=method, progress=False), root / f"{method}.json")
        plans[method] = load_plan(root / f"{method}.json")
    return dict(root=root, g=g, trace=tr, plan=plans["louvain"], stock_plan=plans["stock"])


def _renamed(trace, names):
    return replace(trace, sessions=list(names))


def test_a_renamed_copy_of_the_training_sessions_is_refused(case):
    plan, tr = case["plan"], case["trace"]
    train = tr.subset(list(range(len(plan.training_sessions))))
    disguised = _renamed(train, [f"fresh-{i}" for i in range(len(train.sessions))])
    with pytest.raises(InputError, match="routing of a session the plan was trained on"):
        compare(plan, disguised, load_device("mac-pro-2019-applraid-4x"), CONFIG)


def test_held_out_sessions_are_chosen_by_content_not_by_name(case):
    plan, tr = case["plan"], case["trace"]
    # every session renamed: the training ones are still recognised, the held-out ones still evaluated
    renamed = _renamed(tr, [f"s{i:02d}" for i in range(len(tr.sessions))][::-1])
    g = compare(plan, renamed, load_device("mac-pro-2019-applraid-4x"), CONFIG)
    assert len(g.trace.sessions_evaluated) == 5 and g.trace.held_out_by == "content"
    assert all("same routing as training session" in why for why in g.trace.exclusions.values())
    # a different trace whose names collide with the training sessions is evaluated in full
    other = synth_trace(case["g"].moe_layers, 128, 8, 700, 7, seed=9, params=SynthParams(clique_strength=0.9))
    other = _renamed(other, plan.training_sessions[:7])
    g = compare(plan, other, load_device("mac-pro-2019-applraid-4x"), CONFIG)
    assert len(g.trace.sessions_evaluated) == 7 and g.trace.sessions_excluded_as_training == []


def test_two_held_out_sessions_give_insufficient_not_pass(case):
    plan, tr = case["plan"], case["trace"]
    n = len(plan.training_sessions)
    two = tr.subset(list(range(n)) + [n, n + 1])
    g = compare(plan, two, load_device("mac-pro-2019-applraid-4x"), CONFIG)
    assert g.verdict == "insufficient" and g.reason.startswith("INSUFFICIENT")
    ev = g.evidence
    assert ev.method == "moving-block" and ev.block_steps >= 1 and not ev.sufficient
    assert len(ev.units.committed_tokens) == g.baseline_metrics.steps
    # the same evidence with the user's explicit lower bar: a real verdict from blocks of steps
    g1 = compare(plan, two, load_device("mac-pro-2019-applraid-4x"), CONFIG, min_sessions=1)
    assert g1.verdict == "pass" and g1.evidence.sufficient and g1.evidence.min_sessions == 1
    assert g1.saving_per_token_s.low < g1.saving_per_token_s.estimate < g1.saving_per_token_s.high


def test_the_record_rechecks_from_itself_and_an_edit_is_caught(case, tmp_path):
    record = compare(case["plan"], case["trace"], load_device("mac-pro-2019-applraid-4x"), CONFIG)
    assert record.verdict == "pass" and record.evidence.method == "session" and len(record.evidence.units.plan_stall_s) == 5
    assert recheck(record, "gate.json") == []
    g = record.to_json()
    path = tmp_path / "gate.json"
    path.write_text(json.dumps(g))
    res = cli("gate", "--recheck", path)
    assert res.returncode == 0 and "matches its evidence" in res.stdout, res.stdout + res.stderr
    edited = json.loads(json.dumps(g))
    edited["evidence"]["units"]["plan_stall_s"][0] *= 3          # one session's stall made worse
    path.write_text(json.dumps(edited))
    res = cli("gate", "--recheck", path)
    assert res.returncode == 2 and "does not match its own evidence" in res.stderr and "interval recomputed" in res.stdout
    edited = json.loads(json.dumps(g))
    edited["threshold"]["seconds_per_token"] = 1.0               # a bar no layout passes, verdict left as pass
    assert any("verdict recomputed is 'fail'" in p for p in recheck(GateRecord.from_json(edited, "x"), "x"))


def test_the_saving_splits_into_repacking_and_ordering(case):
    dev = load_device("mac-pro-2019-applraid-4x")
    stock_method = compare(case["stock_plan"], case["trace"], dev, CONFIG).to_json()["decomposition"]
    # a stock-order plan is only a repacking: its ordering share is exactly zero
    assert stock_method["ordering"] == {"estimate": 0.0, "low": 0.0, "high": 0.0}
    g = compare(case["plan"], case["trace"], dev, CONFIG).to_json()
    d = g["decomposition"]
    assert d["repacking"]["estimate"] == pytest.approx(stock_method["repacking"]["estimate"], rel=1e-9)
    assert d["repacking"]["estimate"] + d["ordering"]["estimate"] == pytest.approx(g["saving_per_token_s"]["estimate"], rel=1e-9)
    assert d["ordering"]["low"] > 0


def test_block_bootstrap_never_crosses_sessions_and_needs_enough_blocks():
    # session 0 saves 1 s per token on every step, session 1 saves nothing: a block is one or the other
    session = np.repeat([0, 1], 30)
    base = np.where(session == 0, 2.0, 1.0)
    ev = block_evidence(base, np.ones(60), np.ones(60), session, seed=3)
    assert ev.block_steps == 4 and ev.n_blocks == 15 and ev.n_sessions == 2
    blocks = ev._block_sums(np.random.default_rng(0))
    saved = blocks[0] - blocks[1]
    # each resample is 15 blocks of 4 steps, each block saving 4 or 0: the sum is a multiple of 4
    assert np.all(saved % 4 == 0)
    assert judge(ev, 0.0, min_sessions=1).verdict in ("pass", "fail")
    short = block_evidence(base[:20], np.ones(20), np.ones(20), np.repeat([0, 1], 10))
    assert short.n_blocks < MIN_BLOCKS and judge(short, 0.0, min_sessions=1).verdict == "insufficient"


def test_session_bootstrap_interval_is_the_seed_fixed_percentile_interval():
    ev = session_evidence([5.0, 6, 7, 8, 9], [4.0, 5, 6, 7, 8], [1.0] * 5, seed=1)
    est, low, high = ev.interval()
    assert est == 1.0 and low == 1.0 and high == 1.0      # every session saves exactly 1 s/token
    assert ev.p_below(1.0) == 0.0 and ev.p_below(1.5) == 1.0


def test_holm_rejects_step_down():
    # m = 4 at alpha 0.05: thresholds 0.0125, 0.0167, 0.025, 0.05 for the sorted p-values
    assert holm([0.01, 0.04, 0.015, 0.2], 0.05) == [True, False, True, False]
    assert holm([0.02, 0.001], 0.05) == [True, True]
    assert holm([0.03, 0.03], 0.05) == [False, False]


def test_rewrite_refuses_an_insufficient_gate_and_replay_says_so_in_its_status(case, tmp_path):
    plan, tr = case["plan"], case["trace"]
    n = len(plan.training_sessions)
    save_trace(tr.subset(list(range(n)) + [n, n + 1]), tmp_path / "two.rt")
    res = cli("replay", "--layout", case["root"] / "louvain.json", "--trace", tmp_path / "two.rt",
              "--device", "mac-pro-2019-applraid-4x", "--workers", 1, "--coalesce", "--strict")
    assert res.returncode == 4 and "verdict: INSUFFICIENT" in res.stdout, res.stdout + res.stderr
    save_trace(tr, tmp_path / "all.rt")
    res = cli("replay", "--layout", case["root"] / "louvain.json", "--trace", tmp_path / "all.rt",
              "--device", "mac-pro-2019-applraid-4x", "--workers", 1, "--coalesce", "--threshold", 0.9, "--strict")
    assert res.returncode == 3 and "verdict: FAIL" in res.stdout
    res = cli("replay", "--layout", case["root"] / "louvain.json", "--trace", tmp_path / "all.rt",
              "--device", "mac-pro-2019-applraid-4x", "--workers", 1, "--coalesce")
    assert res.returncode == 0 and "verdict: PASS" in res.stdout


def test_check_gate_refuses_insufficient_evidence(case):
    from relayout.workflows.apply import check_gate

    plan, tr = case["plan"], case["trace"]
    n = len(plan.training_sessions)
    g = compare(plan, tr.subset(list(range(n)) + [n]), load_device("mac-pro-2019-applraid-4x"), CONFIG)
    assert g.verdict == "insufficient"
    with pytest.raises(InputError, match="too little held-out evidence"):
        check_gate(g, plan, plan.source_fingerprint, force=False)
    assert check_gate(g, plan, plan.source_fingerprint, force=True)["forced"] is True


def test_tpot_parts_from_a_measured_run_set_the_threshold(case, tmp_path):
    from replay.physical.stalltrace import measured_tpot_parts

    recs = []
    for s in range(4):   # 2 ms compute and 3 ms other per token, measured
        recs.append({"run_id": "m", "request_id": 0, "step": s, "layer": 3, "expert_id": 1, "required": True, "bytes": 10,
                     "issue_ns": 0, "ready_ns": 100, "need_ns": 100, "committed_tokens": 1, "evaluated_positions": 1})
        recs.append({"record": "step", "run_id": "m", "request_id": 0, "step": s, "committed_tokens": 1,
                     "evaluated_positions": 1, "compute_ns": 2_000_000, "other_ns": 3_000_000, "wall_ns": 5_000_000})
    run = tmp_path / "run.jsonl"
    run.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    parts = measured_tpot_parts(run)
    assert parts.compute_s == pytest.approx(2e-3) and parts.other_s == pytest.approx(3e-3)
    g = compare(case["plan"], case["trace"], load_device("mac-pro-2019-applraid-4x"), CONFIG, tpot_parts=parts)
    S = g.baseline_metrics.stall_per_token_s
    assert g.threshold.tpot_s == pytest.approx(2e-3 + S + 3e-3)
    assert g.threshold.seconds_per_token == pytest.approx(0.05 * (5e-3 + S))
    assert "measured run" in g.threshold.tpot_source and "O = 0" not in g.reason
    no_steps = tmp_path / "bare.jsonl"
    no_steps.write_text("\n".join(json.dumps(r) for r in recs if r.get("record") != "step") + "\n")
    with pytest.raises(InputError, match="no step records with compute_ns"):
        measured_tpot_parts(no_steps)
