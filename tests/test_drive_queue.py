"""Drives as queues: queue depth turns into bandwidth, queue slots serialise, the
calibration fit recovers the model's own parameters."""

import json

import numpy as np
import pytest

from containers.layout import Layout
from replay.physical.calibrate import DEPTHS, SIZES, fit_queue_model
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, DriveProfile, load_device, queue_throughput
from replay.model.engine import simulate
from replay.model.routing import RoutingTrace

NO_COMPUTE = dict(dense_seconds=0.0, compute_bytes_per_second=1e30)
MIB = 1 << 20


def drive(a, b1, bw, slots, host=1e15):
    return ArrayProfile("q", DriveProfile("d", a, bw, slots, b1), 1, 0, "none", host, read_ahead_bytes=0)


def layout(E, wbytes=(MIB // 4, MIB // 4, MIB // 2)):
    """One file, per expert three adjacent weights (one read of their sum) and empty scales."""
    loc = np.zeros((1, E, 6, 3), dtype=np.int64)
    off = 4096
    for e in range(E):
        for slot, n in enumerate(list(wbytes) + [0, 0, 0]):
            loc[0, e, slot] = (0, off, n)
            off += n
    return Layout(["f.safetensors"], [off], [3], E, loc, 4096)


def one_forward(experts, E):
    """One forward, one position selecting ``experts`` (all of them misses with no cache)."""
    k = len(experts)
    return RoutingTrace(
        layers=np.array([3], dtype=np.int16), n_experts=E, top_k=k, geometry="test", sessions=["s0"],
        row_forward=np.zeros(1, np.int32), row_layer=np.full(1, 3, np.int16), row_position=np.zeros(1, np.int32),
        experts=np.array([experts], dtype=np.int16), gates=np.full((1, k), np.nan, dtype=np.float32),
        fwd_session=np.zeros(1, np.int32), fwd_kind=np.zeros(1, np.int8), fwd_evaluated=np.ones(1, np.int32),
        fwd_committed=np.ones(1, np.int32))


def stall(device, E, experts, workers):
    inst, _ = simulate(one_forward(experts, E), np.ones(1, bool), layout(E), device,
                       RuntimeConfig(workers=workers, **NO_COMPUTE))
    return float(inst.stall[0])


def test_more_outstanding_requests_give_more_throughput_up_to_the_drive_limit():
    """Zero request cost, one request streams at a quarter of the drive's rate: 1, 2, 4 workers
    scale the rate, 8 get no more than the drive's limit."""
    B, b1, E = 1e9, 0.25e9, 32
    dev = drive(0.0, b1, B, 32)
    total = E * MIB
    s = {w: stall(dev, E, list(range(E)), w) for w in (1, 2, 4, 8)}
    assert s[1] == pytest.approx(total / b1, rel=1e-9)         # one at a time, each at b1
    assert s[2] == pytest.approx(total / (2 * b1), rel=1e-9)
    assert s[4] == pytest.approx(total / B, rel=1e-9)          # 4 x b1 = B: the limit
    assert s[8] == pytest.approx(total / B, rel=1e-9)          # no more than the limit
    assert s[1] > s[2] > s[4]
    # one request at the full rate is the case b_1 = B: depth buys nothing
    old = drive(0.0, None, B, 32)
    assert stall(old, E, list(range(E)), 1) == pytest.approx(stall(old, E, list(range(E)), 8), rel=1e-9)


def test_one_queue_slot_serialises_requests():
    """Two parallel misses of 1 MiB on a drive with headroom (2 b_1 <= B): with two slots both are
    served at once, l = a + s / b_1; with one the second waits for the first, 2 l."""
    a, b1, B = 1e-4, 0.25e9, 1e9
    lat = a + MIB / b1
    assert stall(drive(a, b1, B, 2), 4, [0, 1], 2) == pytest.approx(lat, rel=1e-6)
    assert stall(drive(a, b1, B, 32), 4, [0, 1], 2) == pytest.approx(lat, rel=1e-6)
    assert stall(drive(a, b1, B, 1), 4, [0, 1], 2) == pytest.approx(2 * lat, rel=1e-6)


def test_queue_slots_bound_the_rate_of_small_requests():
    """Many workers, small requests, a data channel that never binds: the rate is exactly Q requests
    per l(s), the steady-state equation."""
    a, b1, B, E, W = 1e-4, 2e9, 1e12, 64, 16
    wbytes = (4096, 4096, 8192)
    s = sum(wbytes)
    for Q in (1, 4, 8):
        dev = drive(a, b1, B, Q)
        inst, _ = simulate(one_forward(list(range(E)), E), np.ones(1, bool), layout(E, wbytes), dev,
                           RuntimeConfig(workers=W, **NO_COMPUTE))
        rate = E * s / float(inst.stall[0])
        assert rate == pytest.approx(float(queue_throughput(a, b1, B, Q, s, W)), rel=1e-6)


def test_event_model_matches_the_steady_state_equation():
    """Closed loop of W workers on 1 MiB reads: the simulated rate is X(s, W) of replay.model.device,
    within the start-up of the last round."""
    a, b1, B, E = 1e-4, 0.5e9, 1.6e9, 64
    for W, Q in ((1, 32), (2, 32), (3, 32), (8, 32), (8, 2)):
        got = E * MIB / stall(drive(a, b1, B, Q), E, list(range(E)), W)
        want = float(queue_throughput(a, b1, B, Q, MIB, W))
        assert got == pytest.approx(want, rel=0.05), (W, Q)


def test_fit_recovers_the_parameters_of_a_grid_the_model_generated():
    sizes = np.array([s for s in SIZES for _ in DEPTHS])
    depths = np.array([d for _ in SIZES for d in DEPTHS])
    for a, b1, B, Q in ((67e-6, 2.0e9, 3.5e9, 32), (1e-4, 1.2e9, 3.0e9, 12), (2e-4, 0.8e9, 2.0e9, 3)):
        x = queue_throughput(a, b1, B, Q, sizes, depths)
        fit = fit_queue_model(sizes, depths, x)
        assert fit["queue_slots"] == Q
        assert fit["request_seconds"] == pytest.approx(a, rel=1e-4)
        assert fit["stream_bandwidth"] == pytest.approx(b1, rel=1e-4)
        assert fit["bandwidth"] == pytest.approx(B, rel=1e-4)
        assert fit["max_abs_log_error"] < 1e-6
        assert len(fit["cells"]) == len(SIZES) * len(DEPTHS)
        # with 3% noise per cell the parameters stay within 10% and each cell's error is reported
        rng = np.random.default_rng(1)
        noisy = x * np.exp(rng.normal(0, 0.03, len(x)))
        fit = fit_queue_model(sizes, depths, noisy)
        assert fit["request_seconds"] == pytest.approx(a, rel=0.1)
        assert fit["bandwidth"] == pytest.approx(B, rel=0.1)
        assert fit["stream_bandwidth"] == pytest.approx(b1, rel=0.1)
        errs = np.array([c["error"] for c in fit["cells"]])
        assert np.allclose(errs, np.array([c["fitted_Bps"] for c in fit["cells"]]) / noisy - 1)


def test_a_profile_without_the_queue_fields_loads_with_the_documented_default(tmp_path):
    p = tmp_path / "old.json"
    p.write_text(json.dumps({"name": "old", "members": 1, "chunk_bytes": 0, "split_rule": "none",
                             "host_bandwidth": 3e9, "drive": {"name": "d", "request_seconds": 1e-4, "bandwidth": 2e9}}))
    dev = load_device(str(p))
    assert dev.drive.stream_bandwidth is None and dev.drive.request_bandwidth == 2e9 and dev.drive.queue_slots == 32


def test_shipped_profiles_model_a_queue_depth_dependent_drive():
    """The reference drive's published figures: 4 KiB at QD1 about 67-80 us, 370-500 K IOPS at depth, 3.5 GB/s large reads at depth,
    3-4 outstanding 128 KiB reads saturate a drive."""
    for name in ("single-nvme", "linux-md-raid0-4x", "mac-pro-2019-applraid-4x"):
        d = load_device(name).drive
        x = lambda s, q: float(queue_throughput(d.request_seconds, d.request_bandwidth, d.bandwidth, d.queue_slots, s, q,
                                                d.max_request))
        assert 60e-6 <= 4096 / x(4096, 1) <= 110e-6
        assert 370e3 <= x(4096, 32) / 4096 <= 500e3
        assert x(32 * MIB, 32) == pytest.approx(3.5e9)
        assert x(d.max_request, 1) < 0.8 * d.bandwidth          # one request does not saturate the drive...
        assert x(32 * MIB, 1) == pytest.approx(3.5e9)           # ...one large read, split by the system, does
        assert x(128 * 1024, 4) == pytest.approx(3.5e9)
        assert x(128 * 1024, 2) < 3.5e9


def test_the_system_splits_a_large_read_into_requests_it_issues_together():
    """m = max_request_bytes: a 19 MB read on one drive is ceil(19 MB / m) requests; md's chunk pieces
    under m stay as they are, AppleRAID's one request per member is split; no limit = one request."""
    from replay.model.device import member_split

    one = ArrayProfile("one", DriveProfile("d", 1e-4, 3.5e9, 32, 2e9, 1280 * 1024), 1, 0, "none", 4e9)
    pieces, nbytes = member_split(one, np.array([0]), np.array([18_915_328]))
    assert pieces[0, 0] == -(-18_915_328 // (1280 * 1024)) == 15 and nbytes[0, 0] == 18_915_328
    unsplit = ArrayProfile("one", DriveProfile("d", 1e-4, 3.5e9, 32, 2e9), 1, 0, "none", 4e9)
    assert member_split(unsplit, np.array([0]), np.array([18_915_328]))[0][0, 0] == 1
    md = load_device("linux-md-raid0-4x")
    pieces, nbytes = member_split(md, np.array([0]), np.array([8 * 524288]))
    assert pieces.tolist() == [[2, 2, 2, 2]]
    apple = load_device("mac-pro-2019-applraid-4x")
    pieces, nbytes = member_split(apple, np.array([0]), np.array([18_915_328]))
    assert nbytes.sum() == 18_915_328
    assert pieces.tolist() == [[-(-int(n) // apple.drive.max_request) for n in nbytes[0]]] and pieces.min() == 5


def test_one_large_read_split_by_the_system_streams_at_the_drive_rate():
    """One worker, one 8 MiB expert, b_1 = B / 4, m = 1 MiB, no request cost: unsplit it streams at b_1;
    split into 8 requests issued together it reaches B (4 requests already saturate)."""
    B, b1 = 1e9, 0.25e9
    for m, want in ((None, 8 * MIB / b1), (MIB, 8 * MIB / B)):
        dev = ArrayProfile("q", DriveProfile("d", 0.0, B, 32, b1, m), 1, 0, "none", 1e15)
        inst, _ = simulate(one_forward([0], 1), np.ones(1, bool), layout(1, (2 * MIB, 2 * MIB, 4 * MIB)), dev,
                           RuntimeConfig(workers=1, **NO_COMPUTE))
        assert float(inst.stall[0]) == pytest.approx(want, rel=1e-9), m


def test_fit_recovers_the_parameters_when_the_system_splits_reads():
    sizes = np.array([s for s in SIZES for _ in DEPTHS])
    depths = np.array([d for _ in SIZES for d in DEPTHS])
    a, b1, B, Q, m = 80e-6, 1.5e9, 3.5e9, 48, 1280 * 1024
    x = queue_throughput(a, b1, B, Q, sizes, depths, m)
    fit = fit_queue_model(sizes, depths, x, m)
    assert (fit["request_seconds"], fit["stream_bandwidth"], fit["bandwidth"]) == pytest.approx((a, b1, B), rel=1e-4)
    assert fit["max_request_bytes"] == m and fit["max_abs_log_error"] < 1e-6
    # the same cells fitted as if reads were unsplit fit worse: one request cannot be both slow alone and fast when large
    assert fit_queue_model(sizes, depths, x)["max_abs_log_error"] > 0.05


@pytest.mark.parametrize("bad", [0, 100, -4096, 1.5e6, True, "1M", 1 << 40])
def test_a_profile_with_a_bad_request_limit_is_refused(tmp_path, bad):
    from containers.errors import InputError

    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"name": "bad", "members": 1, "chunk_bytes": 0, "split_rule": "none", "host_bandwidth": 3e9,
                             "drive": {"name": "d", "request_seconds": 1e-4, "bandwidth": 2e9, "max_request_bytes": bad}}))
    with pytest.raises(InputError, match="max_request_bytes"):
        load_device(str(p))


def test_the_calibration_table_shows_each_cells_fit_error():
    from relayout.render.measurements import format_calibration

    sizes = [s for s in SIZES for _ in DEPTHS]
    depths = [d for _ in SIZES for d in DEPTHS]
    x = [float(queue_throughput(60e-6, 1.5e9, 3e9, 8, s, q)) * (1.1 if (s, q) == (4096, 1) else 1.0) for s, q in zip(sizes, depths)]
    fit = fit_queue_model(sizes, depths, x)
    cells = [{"size": c["size"], "depth": c["depth"], "mean_latency_s": 1e-4, "throughput_Bps": c["measured_Bps"], "iops": 1.0,
              "fitted_Bps": c["fitted_Bps"], "error": c["error"]} for c in fit["cells"]]
    profile = {"drive": {"request_seconds": fit["request_seconds"], "bandwidth": fit["bandwidth"],
                         "stream_bandwidth": fit["stream_bandwidth"], "queue_slots": fit["queue_slots"]},
               "calibration": {"cache_control": "test", "cells": cells, "fit": {k: v for k, v in fit.items() if k != "cells"}}}
    text = format_calibration(profile)
    assert "fit error" in text and "fitted MB/s" in text and "one request reads at" in text
    assert len(text.splitlines()) == len(SIZES) * len(DEPTHS) + 3
    small = {"max_segments": 254, "page_bytes": 4096, "bytes": 254 * 4096, "transparent_hugepage": "madvise"}
    with_limit = {"drive": {**profile["drive"], "max_request_bytes": 4 << 20},
                  "calibration": {**profile["calibration"], "small_page_request_limit": small}}
    text = format_calibration(with_limit)
    assert "a request here is at most 1016 KiB (254 segments), not 4096 KiB" in text and "here: madvise" in text
    as_large = {**with_limit, "drive": {**with_limit["drive"], "max_request_bytes": 254 * 4096}}
    assert "segments" not in format_calibration(as_large)          # pages do not bind: no sentence


def test_the_calibration_says_whether_concurrent_reads_completed_in_order():
    from relayout.render.measurements import completion_sentence

    spread = {"depth": 8, "size": 16 << 20, "rounds": 5, "first_over_last": 0.99, "in_order": 0.125}
    shared = {"drive": {"service": "shared"}, "calibration": {"completion_spread": spread}}
    text, sharing = completion_sentence(shared)
    assert sharing and "8 concurrent 16 MiB reads" in text and "after 0.99 of" in text and "shares itself" in text
    assert "the profile's drive does the same" in text
    text, sharing = completion_sentence({**shared, "drive": {"service": "in-order"}})   # a hand-edited profile
    assert sharing and "which this profile's in-order drive does not do" in text
    in_order = {"drive": {}, "calibration": {"completion_spread": {**spread, "first_over_last": 0.2}}}
    text, sharing = completion_sentence(in_order)
    assert not sharing and "in order, as the profile's drive serves them" in text
    text, _ = completion_sentence({**in_order, "drive": {"service": "shared"}})
    assert "but this profile's drive is shared" in text
    assert completion_sentence({"calibration": {}}) is None          # a profile calibrated before it was measured


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_a_split_read_streams_in_the_time_of_its_largest_request(service):
    """One 4.5 MiB read, m = 4 MiB, b_1 = B / 4: the system sends 4 MiB and 0.5 MiB (not two of
    2.25 MiB), side by side, so the read takes 4 MiB / b_1, what read_alone_seconds says too."""
    from replay.model.device import largest_request, read_alone_seconds

    B, b1, m = 1e9, 0.25e9, 4 * MIB
    dev = ArrayProfile("q", DriveProfile("d", 0.0, B, 32, b1, m, service), 1, 0, "none", 1e15)
    inst, _ = simulate(one_forward([0], 1), np.ones(1, bool), layout(1, (MIB, MIB, 5 * MIB // 2)), dev,
                       RuntimeConfig(workers=1, **NO_COMPUTE))
    assert float(inst.stall[0]) == pytest.approx(4 * MIB / b1, rel=1e-9)
    assert read_alone_seconds(dev.drive, 9 * MIB // 2) == pytest.approx(4 * MIB / b1, rel=1e-12)
    # md: a member's share is chunk pieces; AppleRAID gives a member one request before the system's split
    assert largest_request(2 * MIB, 4, 512 * 1024, 1, m) == 512 * 1024
    assert largest_request(6 * MIB, 4, 512 * 1024, 2, m) == m
    assert largest_request(3 * MIB, 1, 0, 0, 0) == 3 * MIB
