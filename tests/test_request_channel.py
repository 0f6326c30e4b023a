"""Request channel time ``c``: each request a drive serves holds its data channel ``c``
seconds beyond its bytes. It bounds small-read IOPS at ``1 / c`` at depth, makes a read the
system splits cost ``c`` per request, and so makes merging two reads into one that the system
splits as often save only the command ``a``; the calibration fits it, and profiles without it
behave and hash as before."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from containers.errors import InputError
from replay.physical.calibrate import DEPTHS, SIZES, fit_queue_model
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, DriveProfile, load_device, queue_throughput
from replay.model.engine import simulate
from tests.test_drive_queue import MIB, NO_COMPUTE, layout, one_forward
from tests.test_shared_drive import sized_layout

A, B, C = 50e-6, 2e9, 20e-6      # command latency (s), channel rate (bytes/s), channel time per request (s)


def drive(service, c=C, a=A, b1=B, slots=32, max_request=None):
    return ArrayProfile("q", DriveProfile("d", a, B, slots, b1, max_request, service, c), 1, 0, "none", 1e15,
                        read_ahead_bytes=0)


def stall_of(device, mib, workers=1, experts=None):
    """Stall (s) of one forward reading experts of ``mib`` MiB each (default all, in order), no compute."""
    E = len(mib)
    experts = list(range(E)) if experts is None else experts
    inst, _ = simulate(one_forward(experts, E), np.ones(1, bool), sized_layout(mib), device,
                       RuntimeConfig(workers=workers, **NO_COMPUTE))
    return float(inst.stall[0])


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_a_read_alone_pays_the_channel_time_of_each_of_its_requests(service):
    """One 3 MiB read, m = 1 MiB (3 requests), b_1 = B: a + 3 c + s / B; unsplit: a + c + s / B."""
    s = 3 * MIB
    assert stall_of(drive(service, max_request=MIB), [3]) == pytest.approx(A + 3 * C + s / B, rel=1e-9)
    assert stall_of(drive(service), [3]) == pytest.approx(A + C + s / B, rel=1e-9)
    # c = 0 is the model as it was: a + s / B whatever the split
    assert stall_of(drive(service, c=0.0, max_request=MIB), [3]) == pytest.approx(A + s / B, rel=1e-9)


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_a_read_held_below_the_channel_by_its_own_rate_hides_the_channel_time(service):
    """b_1 = B / 4, one unsplit 1 MiB read: its own stream (s / b_1) outlasts c + s / B, so it takes
    a + s / b_1 exactly, as without c."""
    b1 = B / 4
    assert stall_of(drive(service, b1=b1), [1]) == pytest.approx(A + MIB / b1, rel=1e-9)


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_small_reads_at_depth_are_bounded_by_one_request_per_c(service):
    """64 experts of 12 KiB, 16 workers, no command cost to speak of, an unbounded queue: the rate
    is one request per c + s / B, the steady-state equation's channel term."""
    wbytes = (4096, 4096, 4096)
    s = sum(wbytes)
    dev = drive(service, a=1e-7)
    inst, _ = simulate(one_forward(list(range(64)), 64), np.ones(1, bool), layout(64, wbytes), dev,
                       RuntimeConfig(workers=16, **NO_COMPUTE))
    rate = 64 * s / float(inst.stall[0])
    want = s / (C + s / B)
    assert rate == pytest.approx(want, rel=0.02)
    d = dev.drive
    assert float(queue_throughput(d.request_seconds, d.request_bandwidth, d.bandwidth, d.queue_slots, s, 16, 0,
                                  shared=service == "shared", request_channel_seconds=C)) == pytest.approx(want, rel=1e-9)
    # without c the same reads are bounded by the commands alone, far faster
    assert 64 * s / stall_of(drive(service, c=0.0, a=1e-7), [s / MIB] * 64, 16) > 4 * want


@pytest.mark.parametrize("service", ["in-order", "shared"])
def test_merging_two_reads_saves_the_command_and_only_the_requests_it_removes(service):
    """Two adjacent 1.5 MiB experts, one worker, coalescing: with m = 1 MiB each is 2 requests and the
    merged 3 MiB read is 3, so merging saves a and one request's c; with m = 4 MiB (1, 1 -> 1 request)
    it saves a + c; with m = 512 KiB (3, 3 -> 6 requests) it saves a alone."""
    for m, removed in ((MIB, 1), (4 * MIB, 1), (MIB // 2, 0)):
        dev = drive(service, max_request=m)
        apart = stall_of(dev, [1.5, 1.5], experts=[0, 1])
        inst, _ = simulate(one_forward([0, 1], 2), np.ones(1, bool), sized_layout([1.5, 1.5]), dev,
                           RuntimeConfig(workers=1, coalesce=True, **NO_COMPUTE))
        merged = float(inst.stall[0])
        assert apart - merged == pytest.approx(A + removed * C, rel=1e-6), m


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
def test_the_fit_recovers_c_from_a_grid_the_model_generated(shared):
    sizes = np.array([s for s in SIZES for _ in DEPTHS])
    depths = np.array([d for _ in SIZES for d in DEPTHS])
    m = 4 * MIB
    for a, b1, bw, Q, c in ((45e-6, 3.5e9, 3.5e9, 2, 16e-6), (70e-6, 1.5e9, 3.5e9, 64, 2e-6)):
        x = queue_throughput(a, b1, bw, Q, sizes, depths, m, shared=shared, request_channel_seconds=c)
        fit = fit_queue_model(sizes, depths, x, m, shared=shared)
        assert fit["max_abs_log_error"] < 1e-4
        assert fit["request_channel_seconds"] == pytest.approx(c, rel=0.02)
        assert fit["request_seconds"] == pytest.approx(a, rel=0.02)
        assert fit["bandwidth"] == pytest.approx(bw, rel=1e-3)
    # a grid made without c is fitted with a c too small to matter
    x = queue_throughput(60e-6, 3e9, 3e9, 8, sizes, depths, m, shared=shared)
    fit = fit_queue_model(sizes, depths, x, m, shared=shared)
    assert fit["request_channel_seconds"] < 0.5e-6 and fit["max_abs_log_error"] < 1e-3


def test_a_profile_without_c_keeps_its_json_and_digest_and_a_profile_with_it_round_trips(tmp_path):
    old = load_device("single-nvme")
    assert old.drive.request_channel_seconds == 0.0
    assert "request_channel_seconds" not in old.to_json()["drive"]
    with_c = replace(old, drive=replace(old.drive, request_channel_seconds=15e-6))
    assert with_c.digest() != old.digest()
    p = tmp_path / "c.json"
    p.write_text(json.dumps(with_c.to_json()))
    back = load_device(str(p))
    assert back == with_c and back.digest() == with_c.digest()
    # a disk twice as fast has half the channel time per request
    assert with_c.scaled(2.0).drive.request_channel_seconds == pytest.approx(7.5e-6)


@pytest.mark.parametrize("bad", [-1e-6, float("nan"), True, "15us"])
def test_a_profile_with_a_bad_c_is_refused(tmp_path, bad):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"name": "bad", "members": 1, "chunk_bytes": 0, "split_rule": "none", "host_bandwidth": 3e9,
                             "drive": {"name": "d", "request_seconds": 1e-4, "bandwidth": 2e9,
                                       "request_channel_seconds": bad}}))
    with pytest.raises(InputError, match="request_channel_seconds"):
        load_device(str(p))


def test_merging_is_measured_on_a_real_file_and_refused_on_one_too_small(tmp_path):
    from replay.physical.calibrate import merge_saving

    f = tmp_path / "data.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 8 * MIB, dtype=np.uint8).tobytes())
    m = merge_saving(f, MIB + 100, pairs=20)
    assert m["size"] == MIB and m["pairs"] == 20                  # aligned down to 4 KiB
    assert m["pair_seconds"] > 0 and m["merged_seconds"] > 0
    assert m["saving_low_seconds"] <= m["saving_seconds"] <= m["saving_high_seconds"]
    with pytest.raises(InputError, match="data.bin.*too small"):
        merge_saving(f, 4 * MIB)
    from replay.physical.calibrate import merge_timings

    # the benchmark's kinds: lone reads and pairs with a gap (not counted), each once per repetition
    t = merge_timings(f, MIB, pairs=5, lone=True, gaps_us=(200,))
    assert set(t) == {"size", "pair", "merged", "one", ("gap", 200)}
    assert all(len(t[k]) == 5 and (t[k] > 0).all() for k in t if k != "size")


def _merge_profile(predicted_us, measured_us):
    return {"calibration": {"merge": {"size": 2 * MIB, "pairs": 300, "saving_seconds": measured_us * 1e-6,
                                      "saving_low_seconds": (measured_us - 5) * 1e-6,
                                      "saving_high_seconds": (measured_us + 5) * 1e-6,
                                      "predicted_saving_seconds": predicted_us * 1e-6}}}


def test_the_merge_check_says_how_far_the_model_is_from_what_merging_saved():
    from relayout.render.measurements import merge_sentence

    text, ratio = merge_sentence(_merge_profile(60, 40))
    assert ratio == pytest.approx(1.5) and "at 1.50 times what this disk saved" in text and "saved 40 us [35, 45]" in text
    assert "small reads" in text                                     # the likely reason, when it over-predicts
    text, ratio = merge_sentence(_merge_profile(20, 40))
    assert ratio == pytest.approx(0.5) and "at 0.50 times" in text and "small reads" not in text
    text, ratio = merge_sentence(_merge_profile(44, 40))              # inside the interval [35, 45]
    assert ratio == pytest.approx(1.1) and "agrees" in text
    text, ratio = merge_sentence(_merge_profile(60, 3))               # interval [-2, 8] reaches zero
    assert "not measurably cheaper" in text
    text, ratio = merge_sentence(_merge_profile(44, -20))           # nothing saved: no ratio, said in words
    assert ratio is None and "no cheaper than the two it replaces" in text
    assert merge_sentence({"calibration": {}}) is None


def test_a_validation_record_says_what_merging_saved_under_per_read_cost():
    from relayout.render.measurements import merge_sentence
    from relayout.workflows.validation.record import judge_record

    with open(Path(__file__).resolve().parent.parent / "benchmarks" / "records" / "v53-2026-12-04.validation.json") as f:
        record = json.load(f)
    record["calibration_merge"] = None                               # a run on a given profile
    plain = judge_record(record)
    assert "per-read cost" not in plain["summary"]["text"]
    assert plain["summary"]["merge_saving_predicted_over_measured"] is None
    sentence, ratio = merge_sentence(_merge_profile(60, 40))
    record["calibration_merge"] = {"sentence": sentence, "predicted_over_measured": ratio}
    judged = judge_record(record)
    assert "per-read cost: in the calibration, " + sentence in judged["summary"]["text"]
    assert judged["summary"]["merge_saving_predicted_over_measured"] == pytest.approx(1.5)
    assert judged["summary"]["verdict"] == plain["summary"]["verdict"]      # a diagnosis: the verdict stands


def test_validate_adds_what_merging_saved_after_the_measurement():
    from relayout.render.measurements import merge_sentence
    from relayout.workflows.validation.run import merge_after_sentence

    merge = merge_sentence(_merge_profile(60, 40))
    after = {"saving_seconds": -12e-6, "saving_low_seconds": -20e-6, "saving_high_seconds": -3e-6}
    text, ratio = merge_after_sentence(merge, after)
    assert text == merge[0] + "; after the measurement it saved -12 us [-20, -3]" and ratio == merge[1]


@pytest.mark.parametrize("service", ["in-order", "shared"])
@pytest.mark.parametrize("slots", [1, 2, 32])
def test_a_read_alone_in_the_engine_is_what_read_alone_seconds_says(service, slots):
    """b_1 below B, a read the system splits into four unequal requests (3.5 MiB at m = 1 MiB),
    fewer slots than requests or more: the compiled model and the closed form agree."""
    from replay.model.device import read_alone_seconds

    dev = drive(service, b1=B / 2, slots=slots, max_request=MIB)
    assert stall_of(dev, [3.5]) == pytest.approx(read_alone_seconds(dev.drive, int(3.5 * MIB)), rel=1e-9)
