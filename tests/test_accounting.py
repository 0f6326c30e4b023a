"""Exact token accounting and figures that do not hide runs: each test fails on the
accounting before it (per-record counts ignored, control tokens used for both sides of a compare,
calls ignored by the ROUTE_TRACE importer, prefill committing nothing, runs named alike)."""

import json

import numpy as np
import pytest
from conftest import cli, small_geometry

from containers.container import Container
from containers.errors import InputError
from relayout.render.measurements import format_compare, format_report
from relayout.traces.importer import import_traces
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.physical.arm_run import assumed_committed_mask
from replay.physical.measure import default_run_id, measure
from replay.physical.stalltrace import compare, report


def expert_rec(step, layer, e, ready, need, committed, evaluated=None, *, run="r1", request=0, **kw):
    """An expert record with every field a runtime may write (ns, bytes)."""
    rec = {"run_id": run, "request_id": request, "step": step, "layer": layer,
           "evaluated_positions": evaluated or committed, "committed_tokens": committed,
           "expert_id": e, "segment_id": 0, "required": True, "router_probability": 0.1,
           "prediction_source": "demand", "prediction_score": 0.0, "calibrated_late_need_probability": 0.0,
           "tier_at_prediction": "nvme", "tier_served": "nvme", "bytes": 1000,
           "issue_ns": 0, "ready_ns": ready, "need_ns": need, "queue_depth": 1, "worker_occupancy": 1,
           "priority": "demand", "used_before_eviction": True, "cancelled": False}
    rec.update(kw)
    return rec


def step_rec(step, committed, evaluated=None, run="r1", **kw):
    return {"record": "step", "run_id": run, "request_id": 0, "step": step, "committed_tokens": committed,
            "evaluated_positions": evaluated or committed, **kw}


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


# ------------------------------------------------------------------ 1: STALL_TRACE counts


def test_per_record_counts_are_the_denominator_without_step_records(tmp_path):
    """Two steps committing 1 and 2 tokens, no step records: S is over 3 tokens, not 2."""
    recs = [expert_rec(0, 3, 1, 900, 0, committed=1),
            expert_rec(1, 3, 2, 600, 0, committed=2, evaluated=3),
            expert_rec(1, 4, 5, 300, 0, committed=2, evaluated=3)]
    r = report([write(tmp_path / "a.jsonl", recs)])
    m = r["runs"][0]
    assert m["committed_tokens"] == 3 and m["evaluated_positions"] == 4
    assert m["stall_per_committed_token_ns"] == pytest.approx(1800 / 3)
    assert m["committed_tokens_assumed"] == 0
    # tails divide each step by its own tokens: 900/1 and (600 + 300)/2
    assert m["step_stall_ns"]["max"] == pytest.approx(900) and m["step_stall_ns"]["p50"] == pytest.approx((900 + 450) / 2)


def test_records_without_counts_are_assumed_and_said_to_be(tmp_path):
    recs = [expert_rec(0, 3, 1, 900, 0, committed=1), expert_rec(1, 3, 1, 900, 0, committed=1)]
    for r in recs:
        del r["committed_tokens"], r["evaluated_positions"]
    rep = report([write(tmp_path / "a.jsonl", recs)])
    assert rep["runs"][0]["committed_tokens_assumed"] == 2
    assert any("assumed" in w for w in rep["warnings"])
    assert "2 of 2 committed tokens assumed" in format_report(rep.to_json())


@pytest.mark.parametrize("records, line, words", [
    # an expert record disagreeing with its step record (either order)
    ([step_rec(0, 2, 3), expert_rec(0, 3, 1, 5, 0, committed=1, evaluated=3)], 2, "committed_tokens 1 disagrees with 2"),
    ([expert_rec(0, 3, 1, 5, 0, committed=1, evaluated=3), step_rec(0, 2, 3)], 2, "committed_tokens 2 disagrees with 1"),
    # two expert records of one step disagreeing
    ([expert_rec(0, 3, 1, 5, 0, committed=2, evaluated=3), expert_rec(0, 4, 1, 5, 0, committed=2, evaluated=2)],
     2, "evaluated_positions 2 disagrees with 3"),
    # nothing commits zero tokens, in a step record or an expert record
    ([step_rec(0, 1), step_rec(1, 0, 1)], 2, "'committed_tokens' must be an integer of 1 to"),
    ([expert_rec(0, 3, 1, 5, 0, committed=1), expert_rec(1, 3, 1, 5, 0, committed=0, evaluated=1)], 2, "'committed_tokens' must be an integer of 1 to"),
])
def test_count_problems_name_the_line(tmp_path, records, line, words):
    p = write(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError) as exc:
        report([p])
    assert str(exc.value).startswith(f"{p}:{line}:") and words in str(exc.value)
    res = cli("report", p)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and f"bad.jsonl:{line}:" in res.stderr


def test_recorded_foreground_stall_is_cross_checked(tmp_path):
    us = 1000
    ok = [expert_rec(0, 3, 1, 1000 * us, 100 * us, committed=1, foreground_stall_ns=905 * us),  # within 1% of 900 us
          expert_rec(0, 3, 2, 800 * us, 300 * us, committed=1, foreground_stall_ns=0)]         # inside the first wait
    r = report([write(tmp_path / "ok.jsonl", ok)])
    check = r["runs"][0]["stall_checks"]["foreground_stall_ns"]
    assert check["checked"] == 1 and check["disagreeing"] == 0 and not r["warnings"]
    bad = [expert_rec(0, 3, 1, 1000 * us, 100 * us, committed=1, foreground_stall_ns=900 * us),
           expert_rec(0, 3, 2, 800 * us, 300 * us, committed=1, foreground_stall_ns=500 * us)]   # summed: 1400 vs 900 us
    r = report([write(tmp_path / "bad.jsonl", bad)])
    check = r["runs"][0]["stall_checks"]["foreground_stall_ns"]
    assert check["disagreeing"] == 1
    assert check["worst"] == {"at": "0:0:3", "recorded_ns": 1400 * us, "interval_union_ns": 900 * us}
    assert r["runs"][0]["total_stall_ns"] == 900 * us     # S stays the interval union
    text = format_report(r.to_json())
    assert "warning: run r1: 1 of 1 (step, layer)s' foreground_stall_ns disagree" in text
    # within the absolute tolerance (1 us) small figures agree
    r = report([write(tmp_path / "small.jsonl", [expert_rec(0, 3, 1, 900, 0, committed=1, foreground_stall_ns=1500)])])
    assert r["runs"][0]["stall_checks"]["foreground_stall_ns"]["disagreeing"] == 0
    # a step record's stall_ns is checked the same way
    r = report([write(tmp_path / "s.jsonl", [step_rec(0, 1, stall_ns=5000), expert_rec(0, 3, 1, 900, 0, committed=1)])])
    assert r["runs"][0]["stall_checks"]["step_stall_ns"]["disagreeing"] == 1


def test_barrier_fields_give_the_barrier_estimate(tmp_path):
    recs = [expert_rec(0, 3, 1, 900, 0, committed=2, evaluated=2, barrier_enter_ns=100, barrier_exit_ns=900),
            expert_rec(0, 3, 2, 500, 0, committed=2, evaluated=2, barrier_enter_ns=100, barrier_exit_ns=900),
            expert_rec(0, 4, 3, 0, 0, committed=2, evaluated=2)]
    m = report([write(tmp_path / "b.jsonl", recs)])["runs"][0]
    assert m["barrier_stall_per_committed_token_ns"] == pytest.approx(800 / 2)
    assert m["stall_per_committed_token_ns"] == pytest.approx(900 / 2)
    assert m["queue_depth"]["max"] == 1 and m["tiers"]["nvme"]["records"] == 3


def test_report_json_is_the_published_record_only(tmp_path):
    recs = [step_rec(0, 1, compute_ns=3000, other_ns=1000, wall_ns=4900), expert_rec(0, 3, 1, 900, 0, committed=1)]
    p = write(tmp_path / "t.jsonl", recs)
    r = report([p])
    out = r.to_json()
    json.dumps(out)                                       # no arrays, no dataclasses
    assert not any(k.startswith("_") for m in out["runs"] for k in m)
    m = r.runs[0]
    assert m.step_stall.tolist() == [900] and m.layer_stall == {3: 900}
    assert out["runs"][0]["compute_per_committed_token_ns"] == 3000 and out["runs"][0]["other_per_committed_token_ns"] == 1000
    assert out["runs"][0]["tpot_ns"] == 4900
    res = cli("report", p, "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == json.loads(json.dumps(out))
    assert "n/a (no prefetch)" in format_report(out)


# ------------------------------------------------------------------ 2: compare and pooling


def _repeated_run(path, name, steps, late, runs=3, spec_bytes=0):
    recs = []
    for i in range(runs):
        run = f"{name}{i}"
        for s in range(steps):                            # identical steps: S does not depend on the length
            recs.append(step_rec(s, 1, run=run))
            recs.append(expert_rec(s, 3, 1, late + 10 * i, 0, committed=1, run=run))
            if spec_bytes:
                recs.append(expert_rec(s, 4, 2, 0, 0, committed=1, run=run, priority="speculative", bytes=spec_bytes))
    return write(path, recs)


def test_compare_divides_each_run_by_its_own_tokens(tmp_path):
    long_ctl = _repeated_run(tmp_path / "ctl400.jsonl", "c", 400, 1000)
    short_tr = _repeated_run(tmp_path / "tr100.jsonl", "t", 100, 400, spec_bytes=500)
    short_ctl = _repeated_run(tmp_path / "ctl100.jsonl", "c", 100, 1000)
    a = compare([long_ctl, short_tr])["comparisons"][0]
    b = compare([short_ctl, short_tr])["comparisons"][0]
    assert a["saving_ns"]["estimate"] == pytest.approx(b["saving_ns"]["estimate"]) == pytest.approx(600)
    assert a["treatment_stall_per_committed_token_ns"] == pytest.approx(b["treatment_stall_per_committed_token_ns"])
    assert a["saving_ns"]["low"] == pytest.approx(b["saving_ns"]["low"])
    assert a["control_committed_tokens"] == [400] * 3 and a["treatment_committed_tokens"] == [100] * 3
    assert a["per_pair_ns"] == pytest.approx(b["per_pair_ns"])
    # speculative bytes per committed token of the treatment (500 per step), not a mean of run figures
    assert a["speculative_bytes_per_token"] == pytest.approx(500)
    assert a["stall_conversion_efficiency_ns_per_byte"] == pytest.approx(600 / 500)
    assert "400 committed tokens" not in format_compare(compare([long_ctl, short_tr]))
    assert "1200 vs 300 committed tokens" in format_compare(compare([long_ctl, short_tr]))


def test_pooled_s_never_mixes_control_and_treatment(tmp_path):
    ctl = _repeated_run(tmp_path / "ctl.jsonl", "c", 10, 1000, runs=2)
    tr = _repeated_run(tmp_path / "tr.jsonl", "t", 10, 400, runs=2)
    r = report([ctl, tr]).to_json()
    assert [(g["source"], g["runs"]) for g in r["pooled"]] == [(str(ctl), ["c0", "c1"]), (str(tr), ["t0", "t1"])]
    assert r["pooled"][0]["stall_per_committed_token_ns"] == pytest.approx(1005)
    assert r["pooled"][1]["stall_per_committed_token_ns"] == pytest.approx(405)
    assert "stall_per_committed_token_ns" not in r          # no figure pooled over both configurations
    text = format_report(r)
    assert f"pooled S ({ctl}: 2 runs) = 1.005" in text.replace("0.001005", "1.005") or "pooled S (" in text
    assert text.count("pooled S (") == 2


# ------------------------------------------------------------------ 3: ROUTE_TRACE calls and counts


def test_route_trace_one_moe_layer_splits_forwards_by_call(tmp_path):
    """One MoE layer, a two-row prefill call then 19 decode calls: 20 forwards, 20 generated tokens."""
    lines = ["0 0 3 1:0.5 2:0.5", "0 1 3 3:0.5 4:0.5"] + [f"{c} 0 3 {c % 8}:0.5 {c % 8 + 8}:0.5" for c in range(1, 20)]
    p = tmp_path / "one.route"
    p.write_text("\n".join(lines) + "\n")
    tr, _ = import_traces([p])
    assert tr.n_forwards == 20
    assert int(tr.fwd_committed.sum()) == 20 and tr.fwd_committed[0] == 1 and tr.fwd_evaluated[0] == 2
    assert "committed_assumed" not in tr.meta and "committed_known" not in tr.meta


def test_route_trace_calls_must_be_consistent(tmp_path):
    p = tmp_path / "back.route"
    p.write_text("0 0 3 1:0.5 2:0.5\n1 0 4 1:0.5 2:0.5\n0 0 5 1:0.5 2:0.5\n")
    with pytest.raises(InputError, match=r"back.route:3: call 0 follows call 1"):
        import_traces([p])
    p = tmp_path / "down.route"
    p.write_text("0 0 4 1:0.5 2:0.5\n0 0 3 1:0.5 2:0.5\n")
    with pytest.raises(InputError, match=r"down.route:2: layer 3 follows layer 4 inside call 0"):
        import_traces([p])
    # an engine counting one call per forward (layer-major lines) imports the same forwards
    per_layer = "0 0 3 1:0.5 2:0.5\n1 0 4 3:0.5 4:0.5\n2 0 3 5:0.5 6:0.5\n3 0 4 7:0.5 0:0.5\n"
    per_forward = "0 0 3 1:0.5 2:0.5\n0 0 4 3:0.5 4:0.5\n1 0 3 5:0.5 6:0.5\n1 0 4 7:0.5 0:0.5\n"
    (tmp_path / "a.route").write_text(per_layer)
    (tmp_path / "b.route").write_text(per_forward)
    a, _ = import_traces([tmp_path / "a.route"])
    b, _ = import_traces([tmp_path / "b.route"])
    assert a.n_forwards == b.n_forwards == 2 and a.row_forward.tolist() == b.row_forward.tolist()


def test_verify_forwards_are_marked_assumed(tmp_path):
    # prefill (2 rows), a decode step, then a verify step of 2 positions
    text = ("0 0 3 1:0.5 2:0.5\n0 1 3 3:0.5 4:0.5\n1 0 4 1:0.5 2:0.5\n1 1 4 5:0.5 6:0.5\n"
            "2 0 3 1:0.5 2:0.5\n3 0 4 1:0.5 2:0.5\n"
            "4 0 3 1:0.5 2:0.5\n4 1 3 7:0.5 2:0.5\n5 0 4 1:0.5 2:0.5\n5 1 4 3:0.5 2:0.5\n")
    p = tmp_path / "v.route"
    p.write_text(text)
    tr, _ = import_traces([p])
    assert tr.fwd_committed.tolist() == [1, 1, 1]
    info = tr.meta["committed_assumed"]
    assert info["kinds"] == ["verify"] and info["forwards"] == 1 and info["tokens"] == 1
    assert assumed_committed_mask(tr).tolist() == [False, False, True]
    # a STALL_TRACE speculative step without counts: assumed, by session and forward
    recs = [{"run_id": "r", "request_id": 0, "step": 0, "layer": 3, "expert_id": 1, "required": True, "position": p}
            for p in (0, 1)]
    recs.append({"record": "step", "run_id": "r", "request_id": 0, "step": 0, "evaluated_positions": 2})
    recs += [{"run_id": "r", "request_id": 0, "step": 1, "layer": 3, "expert_id": 2, "required": True,
              "evaluated_positions": 2, "committed_tokens": 2, "position": p} for p in (0, 1)]
    st, _ = import_traces([write(tmp_path / "s.jsonl", recs)])
    assert st.meta["committed_assumed"]["session_forwards"] == {st.sessions[0]: [0]}
    assert assumed_committed_mask(st).tolist() == [True, False]
    assert assumed_committed_mask(st.subset([0])).tolist() == [True, False]


# ------------------------------------------------------------------ 3/4: measure's records


@pytest.fixture(scope="module")
def small_trace():
    g = small_geometry()
    return synth_trace(g.moe_layers, g.n_routed_experts, 8, 12, 1, seed=5, geometry=g.name)


def test_measure_names_runs_uniquely_and_marks_assumed_counts(small_container, small_trace, tmp_path):
    c = Container.open(small_container)
    mask = np.ones(small_trace.n_forwards, bool)
    cfg = RuntimeConfig(workers=2, dense_seconds=0.0)
    measure(c, small_trace, mask, cfg, tmp_path / "a.jsonl", progress=False)
    measure(c, small_trace, mask, cfg, tmp_path / "b.jsonl", progress=False)
    r = report([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    ids = [m.run_id for m in r.runs]
    assert ids[0] != ids[1] and all(i.startswith(f"{small_container.name}@") for i in ids)
    assert default_run_id(small_container, "plans/p1.json").startswith(f"{small_container.name}+p1@")
    # every expert record carries its step's counts and its foreground stall, which agree with the union
    recs = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    experts = [x for x in recs if x.get("record") != "step"]
    assert all(x["committed_tokens"] == 1 and x["evaluated_positions"] == 1 for x in experts)
    m = r["runs"][0]
    assert m["stall_checks"]["foreground_stall_ns"]["disagreeing"] == 0
    assert m["stall_checks"]["step_stall_ns"]["disagreeing"] == 0
    parts = m["compute_per_committed_token_ns"] + m["stall_per_committed_token_ns"] + m["other_per_committed_token_ns"]
    assert parts == pytest.approx(m["tpot_ns"], rel=0.02)
    assert m["committed_tokens_assumed"] == 0 and m["prefetch"] is False and m["timely_required_byte_recall"] is None
    # a trace whose decode counts are assumed: every step record says so, and the report counts them
    tr = small_trace.subset([0])
    tr.meta = {**tr.meta, "committed_assumed": {"kinds": ["decode"], "forwards": tr.n_forwards, "tokens": tr.n_forwards}}
    measure(c, tr, mask, cfg, tmp_path / "c.jsonl", run_id="assumed", progress=False)
    steps = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines() if '"record":"step"' in x]
    assert steps and all(s["committed_assumed"] is True for s in steps)
    assert report([tmp_path / "c.jsonl"])["runs"][0]["committed_tokens_assumed"] == len(steps)


def test_measure_tells_drive_requests_from_page_cache_hits(small_container, small_trace, tmp_path):
    c = Container.open(small_container)
    mask = np.zeros(small_trace.n_forwards, bool)
    mask[:4] = True
    buffered = RuntimeConfig(workers=1, dense_seconds=0.0, direct=False)
    measure(c, small_trace, mask, buffered, None, record=False, progress=False)          # warms the page cache
    measure(c, small_trace, mask, buffered, tmp_path / "warm.jsonl", run_id="warm", cold=False, progress=False)
    m = report([tmp_path / "warm.jsonl"])["runs"][0]
    d = m["reads"]["demand"]
    assert d["page_cache_requests"] > 0 and d["drive_requests"] == 0 and d["unclassified_requests"] == 0
    assert set(m["tiers"]) == {"os_cache"}
    text = format_report(report([tmp_path / "warm.jsonl"]).to_json())
    assert "0 drive requests" in text and f"{d['page_cache_requests']} page-cache hits" in text
    # O_DIRECT weights are drive requests whatever the cache holds; their buffered scales may be hits
    measure(c, small_trace, mask, RuntimeConfig(workers=1, dense_seconds=0.0), tmp_path / "direct.jsonl", run_id="d",
            cold=False, progress=False)
    recs = [json.loads(x) for x in (tmp_path / "direct.jsonl").read_text().splitlines()]
    loads = [x for x in recs if x.get("tier_served") not in (None, "ram")]
    assert loads and all(x["drive_requests"] + x["page_cache_requests"] + x["unclassified_requests"] >= 1 for x in loads)


# ------------------------------------------------------------------ 4: figures


def test_plots_draw_every_run_with_its_own_legend_entry(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import replay.physical.stallplots as st

    figs = []
    monkeypatch.setattr(st, "_save", lambda fig, path: (figs.append(fig), path)[1])
    recs = []
    for run in ("run", "other"):
        for s in range(3):
            recs.append(step_rec(s, 1, run=run))
            for layer in range(3, 81):                  # 78 MoE layers, as GLM-5.2 has
                recs.append(expert_rec(s, layer, 1, 100 + layer, 0, committed=1, run=run))
    a = write(tmp_path / "a.jsonl", recs[: len(recs) // 2])
    b = write(tmp_path / "b.jsonl", [dict(r, run_id="run") for r in recs[len(recs) // 2:]])  # same id, other file
    r = report([a, b])
    gate = {"baseline_metrics": {"stall_per_token_s": 0.001}, "plan_metrics": {"stall_per_token_s": 0.0005}}
    st.write_plots(r, tmp_path / "plots", gate)
    cdf, per_layer, pvm = (f.axes[0] for f in figs)
    labels = ["a.jsonl:run", "b.jsonl:run"]
    assert [t.get_text() for t in cdf.get_legend().get_texts()] == labels
    assert len(per_layer.containers) == 2 and [t.get_text() for t in per_layer.get_legend().get_texts()] == labels
    lefts = [bar.get_x() for cont in per_layer.containers for bar in cont]
    assert len(set(np.round(lefts, 6))) == len(lefts)     # side by side, never over each other
    ticks = per_layer.get_xticklabels()
    assert len(ticks) <= st.MAX_LAYER_TICKS and all(t.get_fontsize() >= 8 for t in ticks)
    xs = [bar.get_x() for cont in pvm.containers for bar in cont]
    assert len(xs) == 4 and len(set(xs)) == 4
    assert [t.get_text() for t in pvm.get_legend().get_texts()] == ["predicted (gate.json)"] + [f"measured {x}" for x in labels]
