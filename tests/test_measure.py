"""The measurement harness and calibration run for real on small files."""

import json
import os
import sys
import threading
import time

import numpy as np
import pytest
from conftest import cli, page_cache_evicts, small_geometry

from containers.container import Container
from containers.errors import InputError
from relayout.traces.synth import synth_trace
from replay.physical.request_limits import system_read_ahead_bytes
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.physical.measure import Arm, drop_cache, measure, measure_interleaved
from replay.physical.reader import IoTally, Reader
from replay.physical.residency import residency_visible
from replay.physical.stalltrace import read_stall_trace, report, run_metrics
from replay.formats.trace import save_trace


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


def _selection(trace, mask) -> dict:
    """{(forward, layer): set of experts} the trace routes for the forwards in ``mask``."""
    out = {}
    for f, layer, row in zip(trace.row_forward.tolist(), trace.row_layer.tolist(), trace.experts.tolist()):
        if mask[f]:
            out.setdefault((f, layer), set()).update(e for e in row if e >= 0)
    return out


def _run_prefetch(c, trace, mask, tmp_path, prefetch, dense_seconds):
    out = tmp_path / f"{prefetch}.jsonl"
    cfg = RuntimeConfig(workers=2, dense_seconds=dense_seconds, prefetch=prefetch, prefetch_experts=8)
    res = measure(c, trace, mask, cfg, out, run_id=prefetch, progress=False)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    return res, report([out])["runs"][0], [r for r in recs if r.get("record") != "step"]


def _check_prefetch_structure(res, m, recs, selection, prefetch):
    """What holds whatever the timing: one record per selected expert, what a prefetch may load, when."""
    required = {}
    for r in recs:
        if r["required"]:
            key = (r["step"], r["layer"], r["expert_id"])
            assert key not in required, f"two records for {key}"
            required[key] = r
    assert set(required) == {(f, layer, e) for (f, layer), es in selection.items() for e in es}
    assert m["records"] == len(recs) and m["total_stall_ns"] == res.stall_ns
    spec = [r for r in recs if r["priority"] == "speculative"]
    if prefetch == "none":
        assert not spec and m["speculative_bytes_per_token"] == 0
        return spec
    first_layer = {}
    for f, layer in selection:
        first_layer[f] = min(first_layer.get(f, layer), layer)
    layer_after = {}
    for f, layer in sorted(selection):
        layer_after.setdefault(f, [])
        layer_after[f].append(layer)
    assert all(r["required"] for r in spec), "the oracle loads only experts the next layer selects"
    assert all(r["tier_served"] in ("nvme", "os_cache") for r in spec)
    assert m["speculative_bytes_per_token"] * m["committed_tokens"] == pytest.approx(sum(r["bytes"] for r in spec))
    for r in spec:
        f, layer = r["step"], r["layer"]
        assert layer != first_layer[f], "nothing prefetches a step's first MoE layer"
        at = layer_after[f].index(layer)
        if at >= 2:                               # queued when the previous layer was routed: after the one before it
            before = layer_after[f][at - 2]
            done = max(q["ready_ns"] for q in recs if q["step"] == f and q["layer"] == before and q["required"])
            assert r["issue_ns"] >= done, "a prefetch starts only once the previous layer is routed"
        need = min(q["need_ns"] for q in recs if q["step"] == f and q["layer"] == layer and q["required"])
        assert r["issue_ns"] <= need, "a prefetch not started by the time its layer is routed is dropped"
    by_layer = {}
    for r in spec:
        by_layer.setdefault((r["step"], r["layer"]), []).append((r["issue_ns"], r["ready_ns"]))
    for loads in by_layer.values():               # one prefetch thread: its loads never overlap
        loads.sort()
        assert all(b[0] >= a[1] for a, b in zip(loads, loads[1:]))
    return spec


def test_measured_oracle_prefetch_loads_the_next_layer_ahead(small_container, trace_for, tmp_path):
    """The real harness with a prefetch thread: structure and order of its loads (not their speed)."""
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    selection = _selection(trace_for, mask)
    for pf in ("none", "oracle"):
        res, m, recs = _run_prefetch(c, trace_for, mask, tmp_path, pf, 5e-3)
        _check_prefetch_structure(res, m, recs, selection, pf)


HOLD_LIMIT = 20.0   # seconds: only a broken harness makes the controlled schedule wait this long


def _fix_prefetch_timing(monkeypatch, schedule: str) -> list:
    """Let the test, not the machine, decide when the prefetch thread's loads run.

    ``early``: every emulated compute first waits for the loads the prefetch thread has queued, so
    a prefetch always has time to spare. ``late``: once a prefetch has been queued, compute waits
    until its first load has begun; that load's reads are held until the next layer has been
    routed, so exactly one load is in flight at each route. Returns the prefetchers made.
    """
    import replay.physical.arm_run as run_module
    from replay.physical.compute_clock import ComputeClock
    from replay.physical.prefetcher import Prefetcher

    prefetchers = []

    class Controlled(Prefetcher):
        def __init__(self, config, coupling, n_experts, read):
            self.routes = 0                          # layers routed so far
            self.released = threading.Condition()
            self.local = threading.local()

            def held_read(*args):                    # a load's reads wait for the route after it started
                with self.released:
                    assert self.released.wait_for(lambda: self.routes > self.local.started_at, HOLD_LIMIT), \
                        "a held prefetch load was never released"
                return read(*args)

            super().__init__(config, coupling, n_experts, held_read if schedule == "late" else read)
            prefetchers.append(self)

        def _load(self, reads, started, batch):      # on the prefetch thread
            self.local.started_at = self.routes
            return super()._load(reads, started, batch)

        def route(self, li):
            out = super().route(li)
            with self.released:
                self.routes += 1
                self.released.notify_all()
            return out

    class Clock(ComputeClock):
        def __call__(self, seconds):
            for p in prefetchers:
                loads = list(p.loads.values())       # queued for the next layer, which is not routed yet
                if schedule == "early":
                    for fut, _ in loads:
                        fut.result()
                elif loads:
                    deadline = time.monotonic() + HOLD_LIMIT
                    while not loads[0][1][0]:        # the first queued load is the first the thread takes
                        assert time.monotonic() < deadline, "the prefetch thread never took its first load"
                        time.sleep(0)
            self.mark, self.lag = time.perf_counter_ns(), 0   # the hold is the test's: the thread is not behind after it
            super().__call__(seconds)

    monkeypatch.setattr(run_module, "Prefetcher", Controlled)
    monkeypatch.setattr(run_module, "ComputeClock", Clock)
    return prefetchers


def _first_layers(selection) -> dict:
    first = {}
    for f, layer in selection:
        first[f] = min(first.get(f, layer), layer)
    return first


def test_oracle_prefetch_with_time_to_spare_serves_every_later_layer(small_container, trace_for, tmp_path, monkeypatch):
    """Every MoE layer after a step's first is served entirely by the prefetch, ready before need."""
    prefetchers = _fix_prefetch_timing(monkeypatch, "early")
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    selection = _selection(trace_for, mask)
    first_layer = _first_layers(selection)
    res, m, recs = _run_prefetch(c, trace_for, mask, tmp_path, "oracle", 0.0)
    assert len(prefetchers) == 1
    spec = _check_prefetch_structure(res, m, recs, selection, "oracle")
    later = {(f, layer, e) for (f, layer), es in selection.items() if layer != first_layer[f] for e in es}
    assert {(r["step"], r["layer"], r["expert_id"]) for r in spec} == later
    assert all(r["ready_ns"] <= r["need_ns"] for r in spec)
    demand = [r for r in recs if r["priority"] == "demand"]
    assert demand and all(r["layer"] == first_layer[r["step"]] for r in demand)
    # the analysis sees it: no stall after a step's first layer, recall at least the prefetched share
    layer_stall = run_metrics(read_stall_trace(tmp_path / "oracle.jsonl")["oracle"]).layer_stall
    assert set(layer_stall) == {layer for _, layer in selection}
    assert all(ns == 0 for layer, ns in layer_stall.items() if layer not in set(first_layer.values()))
    share = sum(r["bytes"] for r in spec) / sum(r["bytes"] for r in recs if r["required"])
    assert share > 0.5 and m["timely_required_byte_recall"] >= share - 1e-12
    # without a prefetch source the same clock changes nothing: every load is a demand load
    res, m, recs = _run_prefetch(c, trace_for, mask, tmp_path, "none", 0.0)
    _check_prefetch_structure(res, m, recs, selection, "none")
    assert all(r["priority"] == "demand" for r in recs)


def test_a_prefetch_in_flight_at_routing_is_waited_for_not_read_again(small_container, trace_for, tmp_path, monkeypatch):
    """One prefetch load in flight when the next layer is routed: that expert is recorded once, as the
    speculative load it is (issued before it was needed), and the layer's other experts are demand loads."""
    _fix_prefetch_timing(monkeypatch, "late")
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    selection = _selection(trace_for, mask)
    first_layer = _first_layers(selection)
    res, m, recs = _run_prefetch(c, trace_for, mask, tmp_path, "oracle", 0.0)
    spec = _check_prefetch_structure(res, m, recs, selection, "oracle")
    later = [(f, layer) for f, layer in selection if layer != first_layer[f]]
    by_layer = {}
    for r in spec:
        by_layer.setdefault((r["step"], r["layer"]), []).append(r)
    assert sorted(by_layer) == sorted(later) and all(len(v) == 1 for v in by_layer.values())
    assert all(r["issue_ns"] < r["need_ns"] for r in spec)
    demand = [r for r in recs if r["priority"] == "demand"]
    assert len(demand) + len(spec) == len(recs) == sum(len(es) for es in selection.values())


def test_the_prefetch_is_queued_when_the_previous_layer_is_routed(small_container, trace_for, tmp_path, monkeypatch):
    """colibrì queues layer L+1's predictions right after routing L (couple_prefetch), before L's
    demand loads: a prefetch load for L+1 can start before L's compute first waits for a miss.
    Here the clock lets the prefetch thread take its first load before L's compute runs, so every
    first load starts before L's first wait; queued once L's demand loads were done (as the
    harness did before), none could."""
    _fix_prefetch_timing(monkeypatch, "late")
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    selection = _selection(trace_for, mask)
    _, _, recs = _run_prefetch(c, trace_for, mask, tmp_path, "oracle", 0.0)
    layers = {}
    for f, layer in sorted(selection):
        layers.setdefault(f, []).append(layer)
    checked = 0
    for r in (r for r in recs if r["priority"] == "speculative"):
        f = r["step"]
        prev = layers[f][layers[f].index(r["layer"]) - 1]
        needs = [q["need_ns"] for q in recs if q["step"] == f and q["layer"] == prev and q["priority"] == "demand"]
        if needs:
            assert r["issue_ns"] < min(needs), "a prefetch load waited for the previous layer's demand loads"
            checked += 1
    assert checked


def test_demand_reads_wait_for_the_prefetch_load_in_flight_at_routing(small_container, trace_for, tmp_path, monkeypatch):
    """The load in flight when a layer is routed completes, every read of it, before that layer's
    demand reads are issued: colibrì's moe() waits for it before routing (the PILOT_REAL barrier),
    and the model queues the demand reads behind it. Without the barrier the held load's reads went
    to the drive after the demand reads issued at routing."""
    _fix_prefetch_timing(monkeypatch, "late")
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    mask[20:] = False
    _, _, recs = _run_prefetch(c, trace_for, mask, tmp_path, "oracle", 0.0)
    spec = {(r["step"], r["layer"]): r for r in recs if r["priority"] == "speculative"}
    demand = [r for r in recs if r["priority"] == "demand" and (r["step"], r["layer"]) in spec]
    assert spec and demand
    late = [r for r in demand if r["issue_ns"] < spec[r["step"], r["layer"]]["ready_ns"]]
    assert not late, f"{len(late)} of {len(demand)} demand loads were issued while the layer's prefetch load was in flight"


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


@pytest.mark.slow
def test_calibration_fits_a_loadable_profile(calibrations, tmp_path):
    profile, _, target = calibrations["huge-pages"]      # calibrate's default buffers
    path = tmp_path / "device.json"
    path.write_text(json.dumps(profile))
    dev = load_device(str(path))
    assert dev.name == "t-huge-pages" and dev.drive.bandwidth > 0 and dev.drive.queue_slots >= 1
    assert len(profile["calibration"]["cells"]) == 20
    assert not list(target.glob(".relayout-calibrate-*")), "the test file is removed"
    from replay.physical.request_limits import system_max_request_bytes

    # read while the test file existed: the system's request limit of the disk calibrated
    assert profile["drive"]["max_request_bytes"] == system_max_request_bytes(target)
    from replay.physical.request_limits import system_read_ahead_bytes

    # and its readahead maximum, which the page cache model uses (Linux's default where unknown)
    assert dev.read_ahead_bytes == (system_read_ahead_bytes(target) if system_read_ahead_bytes(target) is not None
                                    else 128 * 1024)
    from replay.physical.request_limits import small_page_request_limit

    spread = profile["calibration"]["completion_spread"]          # 8 reads of 8 MiB fit the 64 MiB file
    assert spread["depth"] == 8 and spread["size"] == 8 << 20 and 0 < spread["first_over_last"] <= 1
    assert spread["in_order"] == 1 / 8
    from replay.physical.calibrate import drive_service

    # the discipline the spread shows is the profile's, and the fit is of that discipline's equation
    assert dev.drive.service == drive_service(spread) == profile["calibration"]["fit"]["service"]
    limit = small_page_request_limit(target)
    assert profile["calibration"]["small_page_request_limit"] == limit
    if limit is not None:                                 # one segment per page of the reading buffer
        assert limit["bytes"] == limit["max_segments"] * limit["page_bytes"] > 0
    from replay.physical.calibrate import MERGE_BYTES
    from replay.model.device import read_alone_seconds

    # merging two reads was measured at half the request limit (at most 2 MiB: one merged request),
    # and the predicted saving is the fitted model's, 2 l(s) - l(2 s)
    merge = profile["calibration"]["merge"]
    m = profile["drive"]["max_request_bytes"]
    assert merge["size"] == min(m or MERGE_BYTES, MERGE_BYTES) // 2 // 4096 * 4096
    assert merge["predicted_saving_seconds"] == pytest.approx(
        2 * read_alone_seconds(dev.drive, merge["size"]) - read_alone_seconds(dev.drive, 2 * merge["size"]))
    assert merge["saving_low_seconds"] <= merge["saving_seconds"] <= merge["saving_high_seconds"]
    assert merge["pair_seconds"] > 0 and merge["merged_seconds"] > 0 and merge["pairs"] > 0
    assert dev.drive.request_channel_seconds == profile["calibration"]["fit"]["request_channel_seconds"] >= 0


def test_measure_and_report_cli(small_container, trace_for, tmp_path):
    t = tmp_path / "t.rt"
    save_trace(trace_for, t)
    res = cli("measure", "--container", small_container, "--trace", t, "--tokens", 10, "--workers", 1,
              "--dense-ms", 0, "-o", tmp_path / "m.jsonl")
    assert res.returncode == 0, res.stderr
    assert "S = " in res.stdout and "cold" in res.stdout
    assert res.stdout.startswith("emulation: ") and "not the colibrì engine" in res.stdout
    res = cli("report", tmp_path / "m.jsonl")
    assert res.returncode == 0 and "pooled S" in res.stdout
    (tmp_path / "bad.jsonl").write_text('{"record": "step", "run_id": "r"}\n')
    res = cli("report", tmp_path / "bad.jsonl")
    assert res.returncode == 2 and "bad.jsonl:1" in res.stderr


@pytest.mark.parametrize("knob", [dict(prefetch="heat"), dict(prefetch="coupled", admission="stall-value"),
                                  dict(prefetch="oracle", prefetch_bytes=10**6), dict(prefetch="oracle", cancel_stale=True),
                                  dict(prefetch="oracle", adaptive_budget=True), dict(prefetch="oracle", backoff=True),
                                  dict(prefetch="coupled", source_caps=[0.5])])
def test_the_harness_refuses_what_only_the_replay_model_has(small_container, trace_for, tmp_path, knob):
    """A policy the runtime does not have must not be measured silently as the runtime's top-K."""
    from containers.errors import InputError
    from replay.model.config import REPLAY_ONLY_FIELDS, replay_only_settings

    assert [name for name, _ in replay_only_settings(RuntimeConfig(**knob))] == [
        name for name in REPLAY_ONLY_FIELDS if name in knob and (name != "prefetch" or knob[name] == "heat")]

    trace = trace_for
    with pytest.raises(InputError, match="replay model only"):
        measure(Container.open(small_container), trace, np.ones(trace.n_forwards, bool), RuntimeConfig(workers=2, **knob),
                tmp_path / "run.jsonl", progress=False, coupling=(np.full((1, 1, 1), -1), np.zeros((1, 1, 1))))
    assert not (tmp_path / "run.jsonl").exists()


def test_expert_records_are_written_with_their_step_not_between_the_waits(tmp_path):
    """Encoding a record between the compute thread's waits is time the compute model does not
    have: the sink holds a step's expert records and writes them with its step record."""
    from replay.physical.stall_writer import StallTraceWriter, StepId

    out = tmp_path / "held.jsonl"
    sink = StallTraceWriter(out, record=True)
    sid = StepId(run_id="r", request_id="q", step=7, committed_tokens=1, evaluated_positions=1)
    sink.expert(sid, 3, 11, required=True, nbytes=100, issue=1, ready=2, need=2, tier="nvme", stall=1)
    sink.fh.flush()
    assert [f.stat().st_size for f in tmp_path.iterdir()] == [0]     # the temp file, nothing in it yet
    sink.step(sid, compute_ns=10, wall_ns=20, stall_ns=1)
    sink.close()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("record", "expert") for r in recs] == ["expert", "step"]
    assert recs[0]["expert_id"] == 11 and recs[0]["foreground_stall_ns"] == 1


def test_reader_threads_exist_with_their_buffers_before_anything_is_timed(small_container):
    """The pool's threads are started (each with its read buffer) before the first step: a pool
    that starts them on demand does it inside the first layer's timed submissions."""
    from concurrent.futures import ThreadPoolExecutor

    from replay.physical.arm_run import start_threads

    c = Container.open(small_container)
    reader = Reader(c.files, direct=False)
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relayout-test-io")
    try:
        start_threads(pool, 4, reader, 3 * 4096)
        names = [t.name for t in threading.enumerate() if t.name.startswith("relayout-test-io")]
        assert len(names) == 4
        sizes = {pool.submit(lambda: len(reader.local.buf)).result() for _ in range(16)}
        assert sizes == {3 * 4096}
    finally:
        pool.shutdown(wait=True)
        reader.close()


def _expert_records(path) -> list[dict]:
    return [r for r in (json.loads(x) for x in path.read_text().splitlines()) if r.get("record") != "step"]


def test_interleaved_arms_read_what_each_reads_alone_in_lockstep_rotating(small_container, trace_for, tmp_path):
    """Interleaving changes when an arm's steps run, never what they read: each arm's records name
    the same experts, requirements and bytes read as the arm measured alone (the page cache the
    arms share may serve an arm's scale reads); step j of every arm
    ends before step j + 1 of any begins, and the arm that goes first rotates."""
    c = Container.open(small_container)
    mask = np.zeros(trace_for.n_forwards, bool)
    mask[:9] = True
    configs = [RuntimeConfig(workers=2, dense_seconds=0.0),
               RuntimeConfig(workers=1, dense_seconds=0.0, ram_bytes=10**9),
               RuntimeConfig(workers=2, dense_seconds=0.0, coalesce=True)]
    prefetching = RuntimeConfig(workers=2, dense_seconds=0.0, prefetch="oracle", prefetch_experts=8, ram_bytes=10**6)
    arms = [Arm(c, cfg, tmp_path / f"i{k}.jsonl", run_id=f"arm{k}") for k, cfg in enumerate(configs + [prefetching])]
    results = measure_interleaved(arms, trace_for, mask, progress=False)
    assert [r.steps for r in results] == [9, 9, 9, 9]

    def what(recs):
        return sorted((r["step"], r["layer"], r["expert_id"], r["required"], r["tier_served"] == "ram",
                       r["drive_bytes"] + r["page_cache_bytes"] + r["unclassified_bytes"]) for r in recs)

    spans = {}
    for k, cfg in enumerate(configs):
        alone = tmp_path / f"a{k}.jsonl"
        measure(c, trace_for, mask, cfg, alone, run_id=f"alone{k}", progress=False)
        assert what(_expert_records(tmp_path / f"i{k}.jsonl")) == what(_expert_records(alone))
    for k in range(len(arms)):                 # every read, a prefetch load's included, within its step
        for r in _expert_records(tmp_path / f"i{k}.jsonl"):
            if r["tier_served"] != "ram":
                lo, hi = spans.get((r["step"], k), (r["issue_ns"], r["ready_ns"]))
                spans[r["step"], k] = (min(lo, r["issue_ns"]), max(hi, r["ready_ns"]))
    n = len(arms)
    steps = sorted({s for s, _ in spans})
    assert len(steps) == 9 and any(k == 3 for _, k in spans)
    for j, s in enumerate(steps):
        arms_here = [k for k in range(n) if (s, k) in spans]
        assert min(arms_here, key=lambda k: spans[s, k][0]) == j % n or (s, j % n) not in spans
        if j + 1 < len(steps):
            nxt = steps[j + 1]
            assert max(spans[s, k][1] for k in arms_here) < min(spans[nxt, k][0] for k in range(n) if (nxt, k) in spans)


def test_an_arm_that_cannot_run_leaves_no_record_of_any_arm(small_container, trace_for, tmp_path):
    c = Container.open(small_container)
    mask = np.ones(trace_for.n_forwards, bool)
    good = Arm(c, RuntimeConfig(workers=1, dense_seconds=0.0), tmp_path / "good.jsonl")
    bad = Arm(c, RuntimeConfig(workers=1, dense_seconds=0.0, prefetch="coupled"), tmp_path / "bad.jsonl")
    with pytest.raises(InputError, match="coupling table"):
        measure_interleaved([good, bad], trace_for, mask, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_read_buffers_are_private_page_aligned_memory_that_may_take_huge_pages():
    """Shared anonymous memory (Python's default mmap) never gets transparent huge pages under
    the common ``shmem_enabled=never``; the read buffers must be private, aligned and whole."""
    import ctypes
    from pathlib import Path

    from replay.physical.buffers import HUGE_PAGE, PAGE, read_buffer

    buf = read_buffer(3 * 1024 * 1024 + 5)
    assert len(buf) == 3 * 1024 * 1024 + PAGE and buf[:8] == bytes(8)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert addr % HUGE_PAGE == 0                       # a huge page backs only whole, aligned stretches
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                assert line.split()[1] == "rw-p"
                break
        else:
            pytest.fail("the buffer is not mapped")


def test_a_settled_prefetcher_has_no_load_in_flight():
    """Between two arms' steps (measure_interleaved) a run's prefetch loads must have completed:
    ``idle`` returns only after every load queued before it."""
    from replay.physical.prefetcher import Prefetcher

    def slow_read(f, off, n, direct):
        time.sleep(0.05)
        return IoTally()

    p = Prefetcher(RuntimeConfig(prefetch="oracle"), None, 16, slow_read)
    try:
        futures = [p.thread.submit(p._load, [(0, 0, 4096, False)], [False], p.batch) for _ in range(3)]
        p.idle()
        assert all(f.done() for f in futures) and all(f.result() is not None for f in futures)
    finally:
        p.close()


def test_a_wait_is_timed_from_where_the_compute_model_reached_it():
    from replay.physical.compute_clock import ComputeClock

    ms = 1_000_000
    clock = ComputeClock()
    clock.begin()
    clock.lag, clock.mark = 8 * ms, 100 * ms              # 8 ms behind the model at t = 100 ms: the model is at 92
    assert clock.waited(105 * ms, 95 * ms) == (92 * ms, 3 * ms)   # bytes at 95: the model waits 3, the thread not
    assert (clock.lag, clock.mark) == (10 * ms, 105 * ms)         # the model at 95 when the thread is at 105
    assert clock.waited(106 * ms, 90 * ms) == (95 * ms, 0)        # bytes before the model needed them: no stall
    assert (clock.lag, clock.mark) == (10 * ms, 105 * ms)
    assert clock.waited(107 * ms, 120 * ms) == (95 * ms, 25 * ms)  # the thread waits too: both go on from 120
    assert (clock.lag, clock.mark) == (0, 120 * ms)


def test_the_compute_threads_own_work_is_taken_off_its_emulated_compute():
    """Between waits the thread takes the compute model's time, its own work included; a wait ends
    the lag. A clock that added the work to the compute would take 80, 70 and 90 ms below."""
    from replay.physical.compute_clock import ComputeClock

    ms = 1_000_000
    clock = ComputeClock()
    clock.begin()
    t0 = time.perf_counter_ns()
    time.sleep(0.030)                                     # the thread's own work: 30 ms
    clock(0.050)                                          # 50 ms of compute, 30 of them done
    assert 48 * ms <= time.perf_counter_ns() - t0 < 65 * ms
    done = clock.mark - clock.lag                         # where the compute model finished those 50 ms
    time.sleep(0.030)                                     # work, then a wait: bytes ready 10 ms in, woken at 20
    need = time.perf_counter_ns()
    time.sleep(0.020)
    model_need, stall = clock.waited(need, need + 10 * ms)
    assert model_need == done                             # the 30 ms of the thread's own work take no model time:
    assert stall == need + 10 * ms - done                 # the runtime would have waited 40 ms, not 10
    clock(0.050)                                          # from the bytes' arrival: 50 ms, the late wake-up in it
    assert 58 * ms <= time.perf_counter_ns() - need < 68 * ms
    clock.begin()
    t0 = time.perf_counter_ns()
    time.sleep(0.030)
    clock(0.010)                                          # 30 ms of work cover this compute and 20 ms of the next
    assert time.perf_counter_ns() - t0 < 40 * ms
    clock(0.050)
    assert 58 * ms <= time.perf_counter_ns() - t0 < 75 * ms


def _page_cache_drops(path) -> bool:
    """Whether dropping ``path``'s pages (posix_fadvise DONTNEED) really evicts them here (not on
    tmpfs). A file written moments ago has dirty pages, which no drop evicts: they are written
    back first (``fsync``, which leaves the bytes as they are)."""
    if not page_cache_evicts(path) or not residency_visible(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return True
    finally:
        os.close(fd)


def test_a_cold_measurement_starts_each_session_with_its_scales_unread(small_container, trace_for, tmp_path):
    """As the model starts each session with its LRU empty and its scales unread, a cold
    measurement drops the page cache before each session's first step: an expert read in
    session 0 reads its scales from the drive again on its first access in session 1, and from
    the page cache on its later ones."""
    c = Container.open(small_container)
    if not all(_page_cache_drops(f) for f in c.files):
        pytest.skip("this file system does not evict pages on request")
    s1 = np.flatnonzero(trace_for.fwd_session == 1)
    mask = (trace_for.fwd_session == 0) | np.isin(np.arange(trace_for.n_forwards), s1[:3])
    out = tmp_path / "two-sessions.jsonl"
    measure(c, trace_for, mask, RuntimeConfig(workers=1, dense_seconds=0.0), out, progress=False)
    recs = [r for r in _expert_records(out) if r["tier_served"] != "ram"]
    read_before = {(r["layer"], r["expert_id"]) for r in recs if r["step"] < s1[0]}
    first, later = {}, []
    for r in sorted((r for r in recs if r["step"] >= s1[0]), key=lambda r: r["step"]):
        key = (r["layer"], r["expert_id"])
        if key not in read_before:
            continue
        if key in first and first[key][0]["step"] != r["step"]:
            later.append(r)
        else:
            first.setdefault(key, []).append(r)
    assert first and later
    scale_reads = 3
    # first accesses in session 1 read scale bytes from the drive again (a weight read is one request;
    # an expert whose scales share a page with one read before it in the step may find them cached)
    assert any(sum(x["drive_requests"] for x in rs) > 1 for rs in first.values())
    assert any(x["page_cache_requests"] == scale_reads for x in later)
    steps = [json.loads(x) for x in out.read_text().splitlines() if '"step"' in x]
    steps = [r for r in steps if r.get("record") == "step"]
    assert steps and all(r["configuration"].endswith("page_cache_test=mincore") for r in steps)   # our own files, Linux


def test_measurement_runs_with_the_processs_objects_out_of_the_collectors_way(small_container, trace_for, tmp_path):
    """During the measured steps every object alive before them is frozen (a full collection
    would walk them, tens of ms in a large process, on whichever thread allocates); afterwards
    they are unfrozen."""
    import gc

    frozen = []
    mask = np.zeros(trace_for.n_forwards, bool)
    mask[:3] = True
    arm = Arm(Container.open(small_container), RuntimeConfig(workers=1, dense_seconds=0.0), tmp_path / "gc.jsonl")
    measure_interleaved([arm], trace_for, mask, progress=False, on_step=lambda: frozen.append(gc.get_freeze_count()))
    assert len(frozen) == 3 and min(frozen) > 1000
    assert gc.get_freeze_count() == 0


def _file_of_pages(path, n_pages: int) -> bytes:
    data = os.urandom(n_pages * 4096)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def test_a_buffered_read_the_page_cache_serves_is_still_issued(tmp_path):
    """Asking the page cache first (mincore) must not replace the read: the runtime's pread is
    issued whatever the cache holds, copies the bytes, and moves the kernel's readahead on."""
    path = tmp_path / "f.bin"
    data = _file_of_pages(path, 8)
    reader = Reader([path], direct=False)
    try:
        reader.prepare(4096)
        reader.read(0, 0, 4096, False)
        reader.read(0, 2 * 4096, 4096, False)
        io = reader.read(0, 100, 3000, False)            # page 0 again: cached
        if reader.page_cache_test != "none":
            assert (io.page_cache_requests, io.page_cache_bytes) == (1, 3000)   # counted as served by the page cache
        assert bytes(reader.local.buf[:3000]) == data[100:3100]   # and its bytes were read
    finally:
        reader.close()


def test_the_harness_reads_move_the_kernels_readahead_on(tmp_path):
    """Reading on through cached pages reaches the page the kernel marked for readahead and
    starts its next window, so a harness that skipped cached reads would see fewer pages read
    ahead than a runtime (Linux; skipped where the file system keeps pages when dropped, or
    reads little ahead)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux's readahead")
    path = tmp_path / "f.bin"
    _file_of_pages(path, 1024)
    ra = system_read_ahead_bytes(path)
    if not ra or ra < 128 * 1024:
        pytest.skip("readahead smaller than 128 KiB or unknown here")
    drop_cache([path])
    reader = Reader([path], direct=False)

    def settled_run() -> int:
        """Bytes cached from the start once the readahead under way has completed (s: 2 at most)."""
        last, deadline = -1, time.monotonic() + 2.0
        while time.monotonic() < deadline:
            run = reader.residency[0].cached_run(0, 1024 * 4096)
            if run == last:
                return run
            last = run
            time.sleep(0.05)
        return last

    try:
        if reader.residency is None or not page_cache_evicts(path):
            pytest.skip("page cache residency unknown here, or pages kept when dropped (tmpfs)")
        assert not reader.residency[0].cached(0, 4096)
        reader.read(0, 0, 4096, False)
        first = settled_run()
        assert 0 < first < 1024 * 4096
        for off in range(4096, first, 4096):           # on through the cached window, page by page
            assert reader.read(0, off, 4096, False).page_cache_requests == 1
        assert settled_run() > first
    finally:
        reader.close()


def test_a_read_in_pieces_is_one_request_counted_where_its_first_piece_was_served(tmp_path, monkeypatch):
    """Reads longer than MAX_READ go in pieces: one request (the runtime issues one pread), where
    the first piece was served; each piece's bytes where they were."""
    import replay.physical.reader as reader_module

    path = tmp_path / "f.bin"
    _file_of_pages(path, 8)
    if not page_cache_evicts(path) or not residency_visible(path):
        pytest.skip("page cache residency unknown here, or pages kept when dropped (tmpfs)")
    monkeypatch.setattr(reader_module, "MAX_READ", 4096)
    drop_cache([path])
    reader = Reader([path], direct=False)
    try:
        os.posix_fadvise(reader.buffered[0], 0, 0, os.POSIX_FADV_RANDOM)   # no readahead: the pages read, only
        reader.read(0, 4096, 4096, False)                                   # page 1 cached
        assert reader.read(0, 0, 3 * 4096, False) == IoTally(drive_requests=1, drive_bytes=8192, page_cache_bytes=4096)
        assert reader.read(0, 4096, 2 * 4096, False) == IoTally(page_cache_requests=1, page_cache_bytes=8192)
    finally:
        reader.close()


def test_the_read_tally_writes_the_stall_trace_read_fields_in_their_order():
    """An expert record's read accounting is the tally's fields, named and ordered as the
    STALL_TRACE reader expects (a reordered or renamed field would change every record)."""
    from replay.physical.stalltrace import IO_FIELDS

    io = IoTally(drive_requests=1, drive_bytes=2, page_cache_requests=3, page_cache_bytes=4,
                 unclassified_requests=5, unclassified_bytes=6)
    assert tuple(io.to_json()) == IO_FIELDS and list(io.to_json().values()) == [1, 2, 3, 4, 5, 6]
    assert io + io == IoTally(drive_requests=2, drive_bytes=4, page_cache_requests=6, page_cache_bytes=8,
                              unclassified_requests=10, unclassified_bytes=12)
    assert IoTally(page_cache_requests=1).tier == "os_cache" and IoTally(unclassified_requests=1).tier == "nvme"
