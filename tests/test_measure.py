"""The measurement harness and calibration run for real on small files."""

import json

import numpy as np
import pytest

from conftest import run_cli, small_geometry
from containers.container import Container
from relayout.trace import save_trace
from relayout.trace_synth import synth_trace
from replay.calibrate import calibrate
from replay.device import load_device
from replay.measure import measure
from replay.runtime import RuntimeConfig
from replay.stalltrace import report


@pytest.fixture(scope="module")
def trace_for(small_container):
    g = small_geometry()
    return synth_trace(g.moe_layers, g.n_routed_experts, 8, 60, 2, seed=3, geometry=g.name)


def test_measure_writes_a_valid_stall_trace(small_container, trace_for, tmp_path):
    out = tmp_path / "run.jsonl.zst"
    res = measure(Container.open(small_container), trace_for, np.ones(trace_for.n_forwards, bool),
                  RuntimeConfig(workers=2, dense_seconds=0.0), out, progress=False)
    assert res.steps == 60 and res.committed == 60 and out.exists()
    r = report([out])
    m = r["runs"][0]
    assert m["steps"] == 60 and m["committed_tokens"] == 60
    assert m["total_stall_ns"] == res.stall_ns  # the harness and the analysis agree on S
    # every selected expert appears once per (step, layer): 8 per layer, 3 MoE layers
    assert m["records"] == 60 * 3 * 8


def test_measured_oracle_prefetch_loads_the_next_layer_ahead(small_container, trace_for, tmp_path):
    """A prefetch thread with time to spare (5 ms of dense time) makes most next-layer loads timely."""
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    runs = {}
    for pf in ("none", "oracle"):
        out = tmp_path / f"{pf}.jsonl"
        cfg = RuntimeConfig(workers=2, dense_seconds=5e-3, prefetch=pf, prefetch_experts=8)
        res = measure(c, trace_for, mask, cfg, out, run_id=pf, progress=False)
        runs[pf] = (res, report([out])["runs"][0], [json.loads(x) for x in out.read_text().splitlines()])
    none, oracle = runs["none"][1], runs["oracle"][1]
    spec = [r for r in runs["oracle"][2] if r.get("priority") == "speculative"]
    assert spec and all(r["required"] for r in spec)            # the oracle loads only what is needed
    assert none["speculative_bytes_per_token"] == 0 and oracle["speculative_bytes_per_token"] > 0
    assert oracle["timely_required_byte_recall"] > 0.5 > (none["timely_required_byte_recall"] or 0)
    assert oracle["total_stall_ns"] == runs["oracle"][0].stall_ns
    assert oracle["total_stall_ns"] < none["total_stall_ns"]
    # every selected expert still has exactly one record per (step, layer)
    assert oracle["records"] == none["records"]


def test_everything_cached_and_compute_fixed_means_zero_stall(small_container, trace_for, tmp_path):
    """With RAM for every expert, only each session's first touches load; after them nothing waits."""
    big = RuntimeConfig(workers=2, ram_bytes=10**10, dense_seconds=0.0, compute_bytes_per_second=1e12)
    c = Container.open(small_container)
    mask = np.zeros(trace_for.n_forwards, bool)
    mask[trace_for.fwd_session == 0] = True
    out = tmp_path / "cached.jsonl"
    measure(c, trace_for, mask, big, out, progress=False)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    first_touch = {}
    late_steps = set()
    for r in recs:
        if r.get("record") == "step":
            continue
        key = (r["layer"], r["expert_id"])
        first_touch.setdefault(key, r["step"])
        if r["tier_served"] == "nvme":
            assert first_touch[key] == r["step"], "a cached expert was read again"
            late_steps.add(r["step"])
    steps = [r for r in recs if r.get("record") == "step"]
    quiet = [s for s in steps if s["step"] not in late_steps]
    assert quiet and all(s["stall_ns"] == 0 for s in quiet)


def test_tracing_can_be_switched_off(small_container, trace_for, tmp_path):
    res = measure(Container.open(small_container), trace_for, np.ones(trace_for.n_forwards, bool),
                  RuntimeConfig(workers=2, dense_seconds=0.0), tmp_path / "x.jsonl", record=False, progress=False)
    assert res.path is None and not (tmp_path / "x.jsonl").exists()


def test_calibration_fits_a_loadable_profile(tmp_path):
    profile = calibrate(tmp_path, size_mb=64, seconds=0.02, name="test-disk")
    path = tmp_path / "device.json"
    path.write_text(json.dumps(profile))
    dev = load_device(str(path))
    assert dev.name == "test-disk" and dev.drive.bandwidth > 0 and dev.drive.queue_slots >= 1
    assert len(profile["calibration"]["cells"]) == 20
    assert not list(tmp_path.glob(".relayout-calibrate-*")), "the test file is removed"


def test_measure_and_report_cli(small_container, trace_for, tmp_path):
    t = tmp_path / "t.rt"
    save_trace(trace_for, t)
    res = run_cli("measure", "--container", small_container, "--trace", t, "--tokens", 10, "--workers", 1,
                  "--dense-ms", 0, "-o", tmp_path / "m.jsonl")
    assert res.returncode == 0, res.stderr
    assert "S = " in res.stdout and "cold" in res.stdout
    res = run_cli("report", tmp_path / "m.jsonl")
    assert res.returncode == 0 and "pooled S" in res.stdout
    (tmp_path / "bad.jsonl").write_text('{"record": "step", "run_id": "r"}\n')
    res = run_cli("report", tmp_path / "bad.jsonl")
    assert res.returncode == 2 and "bad.jsonl:1" in res.stderr
