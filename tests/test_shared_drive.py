"""Shared drives: a drive whose channel is shared among the requests in it, so reads
released together complete together and a later read slows those in flight; the calibration
chooses the discipline from how concurrent reads completed and fits its equation."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.layout import Layout
from replay.physical.calibrate import DEPTHS, SIZES, drive_service, fit_queue_model
from replay.model.config import RuntimeConfig
from replay.model.device import ArrayProfile, DriveProfile, load_device, queue_throughput
from replay.model.engine import simulate
from tests.test_drive_queue import MIB, NO_COMPUTE, one_forward

A, B = 1e-4, 1e9          # request cost (s) and channel rate (bytes/s) of the hand cases
UNIT = MIB / B            # s to move 1 MiB through the channel


def drive(service, *, a=A, b1=B, bw=B, slots=32, members=1, chunk=0, rule="none", host=1e15, max_request=None):
    return ArrayProfile("q", DriveProfile("d", a, bw, slots, b1, max_request, service), members, chunk, rule, host,
                        read_ahead_bytes=0)


def sized_layout(mib):
    """One file; expert e's three adjacent weight tensors hold ``mib[e]`` MiB in all (one read), no scales."""
    E = len(mib)
    loc = np.zeros((1, E, 6, 3), dtype=np.int64)
    off = 4096
    for e, m in enumerate(mib):
        n = int(m * MIB)
        for slot, part in enumerate((n // 4, n // 4, n - 2 * (n // 4), 0, 0, 0)):
            loc[0, e, slot] = (0, off, part)
            off += part
    return Layout(["f.safetensors"], [off], [3], E, loc, 4096)


def waits(device, mib, workers, **config):
    """Per expert (issue order), s the compute thread waited right before it, and the stall."""
    E = len(mib)
    cfg = {**NO_COMPUTE, **config}
    inst, _ = simulate(one_forward(list(range(E)), E), np.ones(1, bool), sized_layout(mib), device,
                       RuntimeConfig(workers=workers, **cfg))
    return inst.expert_wait[0], float(inst.stall[0])


def test_reads_released_together_complete_together_on_a_shared_drive():
    """8 experts of 1 MiB, 8 workers, compute as fast as the drive: in order the compute thread works
    on each expert while the next arrives (it waits for the first only, about one read); shared,
    all eight complete at a + 8 MiB / B and it waits for all of them."""
    fast_compute = dict(compute_bytes_per_second=B)
    w_shared, s_shared = waits(drive("shared"), [1] * 8, 8, **fast_compute)
    _, s_order = waits(drive("in-order"), [1] * 8, 8, **fast_compute)
    assert s_shared == pytest.approx(A + 8 * UNIT, rel=1e-9)
    assert w_shared[1:] == pytest.approx(0, abs=1e-12)
    assert s_order == pytest.approx(A + UNIT, rel=1e-9)                # the first read, then overlapped


def test_a_shared_channel_completes_requests_by_virtual_time():
    """1 and 3 MiB released together: both progress at B / 2 until the small one is done, at
    a + 2 MiB / B; the large one then runs alone and completes at a + 4 MiB / B."""
    w, _ = waits(drive("shared"), [1, 3], 2)
    assert w == pytest.approx([A + 2 * UNIT, 2 * UNIT], rel=1e-9)
    w, _ = waits(drive("in-order"), [1, 3], 2)
    assert w == pytest.approx([A + UNIT, 3 * UNIT], rel=1e-9)


def test_a_later_read_slows_the_reads_already_in_flight():
    """Two workers on 1, 4 and 1 MiB: the second 1 MiB read is issued when the first completes
    (a + 2 MiB / B) and enters the channel a later; the 4 MiB read, already in flight, shares the
    channel with it and completes at a + 6 MiB / B, not at the a + 5 MiB / B it would have had the
    later read not slowed it; the later read completes first, at 2a + 4 MiB / B."""
    w, stall = waits(drive("shared"), [1, 4, 1], 2)
    assert w == pytest.approx([A + 2 * UNIT, 4 * UNIT, 0.0], rel=1e-9, abs=1e-12)
    assert stall == pytest.approx(A + 6 * UNIT, rel=1e-9)
    w, _ = waits(drive("in-order"), [1, 4, 1], 2)                   # in order: one after another
    assert w == pytest.approx([A + UNIT, 4 * UNIT, UNIT], rel=1e-9)


def test_the_channel_is_shared_among_reads_not_their_requests():
    """1 MiB (one request) and 4 MiB (four requests of at most 1 MiB) released together: each read
    gets half the channel, whatever its request count, so the small one completes at a + 2 MiB / B
    (shared among requests it would get a fifth: a + 5 MiB / B), the large one at a + 5 MiB / B."""
    w, _ = waits(drive("shared", max_request=MIB), [1, 4], 2)
    assert w == pytest.approx([A + 2 * UNIT, 3 * UNIT], rel=1e-9)


def test_a_read_takes_one_command_however_many_requests_it_was_split_into():
    """Two 4 MiB reads of four requests each, one queue slot: the first read's command ends at a,
    the second's at 2a (a command per request would hold the second back until 5a). The first is
    alone in the channel for a, then both share it: it completes at 8 MiB / B, the second at
    a + 8 MiB / B (with a command per request: 8 MiB / B - 3a and a + 8 MiB / B)."""
    w, _ = waits(drive("shared", slots=1, max_request=MIB), [4, 4], 2)
    assert w == pytest.approx([8 * UNIT, A], rel=1e-9)


def test_a_read_below_its_fair_share_leaves_the_rest_to_the_others():
    """Water filling: one request streams at b_1 = B / 4. A 1 MiB read (one request) passes at B / 4,
    below its half of the channel; the 4 MiB read beside it (four requests, own rate B) takes the
    other 3 B / 4, so the channel stays full: 1 MiB done at a + 4 MiB / B, 4 MiB at a + 5 MiB / B
    (without the spare share passed on, a + 6)."""
    w, _ = waits(drive("shared", b1=B / 4, max_request=MIB), [1, 4], 2)
    assert w == pytest.approx([A + 4 * UNIT, UNIT], rel=1e-9)


@pytest.mark.parametrize("profile", [dict(), dict(members=4, chunk=512 * 1024, rule="md"),
                                     dict(members=4, chunk=512 * 1024, rule="apple")])
def test_one_read_at_a_time_is_the_same_on_both_disciplines(profile):
    """A lone issuer has nothing to share with: with one request streaming at the drive's rate,
    one worker's stall is the same in order and shared, on a drive and on both RAID rules."""
    rng = np.random.default_rng(3)
    mib = list(rng.uniform(0.3, 6.0, size=12))
    for compute in (1e30, 2e9):
        _, shared = waits(drive("shared", **profile), mib, 1, compute_bytes_per_second=compute)
        _, in_order = waits(drive("in-order", **profile), mib, 1, compute_bytes_per_second=compute)
        assert shared == pytest.approx(in_order, rel=1e-9)


def test_the_shared_event_model_matches_its_steady_state_equation():
    """Closed loop of W workers: large reads saturate the channel, small ones the command slots
    (Q requests per a), few the reads' own rate; each within the start-up of the last round."""
    E = 64
    for mib, W, Q, b1 in ((1, 8, 32, 0.4e9), (1, 2, 32, 0.2e9), (1 / 64, 16, 4, 2e9), (1 / 64, 2, 32, 2e9)):
        bw = 1e12 if mib < 1 else B
        _, stall = waits(drive("shared", b1=b1, bw=bw, slots=Q), [mib] * E, W)
        want = float(queue_throughput(A, b1, bw, Q, mib * MIB, W, shared=True))
        assert E * mib * MIB / stall == pytest.approx(want, rel=0.06), (mib, W, Q)


def test_the_shared_equation_differs_from_the_in_order_one_where_slots_bind():
    """A slot held for a read's command only: 8 outstanding 1 MiB reads on 2 slots reach the
    channel's rate shared, 2 / l(s) of it in order."""
    a, b1, bw, Q, s = 1e-4, 0.25e9, 1e9, 2, MIB
    assert float(queue_throughput(a, b1, bw, Q, s, 8, shared=True)) == pytest.approx(bw)
    assert float(queue_throughput(a, b1, bw, Q, s, 8)) == pytest.approx(Q * s / (a + s / b1))


@pytest.mark.slow
def test_the_calibration_chooses_the_discipline_it_measured_and_fits_its_equation():
    assert drive_service({"first_over_last": 0.99, "in_order": 0.125}) == "shared"
    assert drive_service({"first_over_last": 0.13, "in_order": 0.125}) == "in-order"
    sizes = np.array([s for s in SIZES for _ in DEPTHS])
    depths = np.array([d for _ in SIZES for d in DEPTHS])
    a, b1, bw, Q, m = 60e-6, 2.5e9, 3.0e9, 3, 4 << 20
    x = queue_throughput(a, b1, bw, Q, sizes, depths, m, shared=True)
    fit = fit_queue_model(sizes, depths, x, m, shared=True)
    assert (fit["request_seconds"], fit["stream_bandwidth"], fit["bandwidth"]) == pytest.approx((a, b1, bw), rel=1e-4)
    assert fit["queue_slots"] == Q and fit["service"] == "shared" and fit["max_abs_log_error"] < 1e-6
    assert fit_queue_model(sizes, depths, x, m)["max_abs_log_error"] > 0.05     # the in-order equation does not fit it


def test_a_profile_carries_its_service_and_refuses_an_unknown_one(tmp_path):
    p = tmp_path / "p.json"
    base = {"name": "p", "members": 1, "chunk_bytes": 0, "split_rule": "none", "host_bandwidth": 3e9,
            "drive": {"name": "d", "request_seconds": 1e-4, "bandwidth": 2e9}}
    p.write_text(json.dumps(base))
    assert load_device(str(p)).drive.service == "in-order"           # a profile from before it was measured
    p.write_text(json.dumps({**base, "drive": {**base["drive"], "service": "shared"}}))
    d = load_device(str(p))
    assert d.drive.service == "shared" and d.scaled(2.0).drive.service == "shared"
    assert d.to_json()["drive"]["service"] == "shared"
    p.write_text(json.dumps({**base, "drive": {**base["drive"], "service": "fair"}}))
    with pytest.raises(InputError, match="unknown drive service 'fair'"):
        load_device(str(p))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 96), min_size=1, max_size=8), st.sampled_from([None, 256 * 1024, MIB]))
def test_reads_released_together_keep_the_shared_channel_full_and_finish_smallest_first(sixteenths, max_request):
    """A worker per expert, so every read is issued at once; one request streams at B, so no read is
    held below its share. The channel is never idle: the last read completes at a + (sum of bytes) / B.
    Fair sharing finishes reads in order of size: each completes at a + (its own bytes x the reads
    still in the channel, plus the bytes of those done before it) / B (sizes in 64 KiB steps, so
    O_DIRECT widens none)."""
    mib = [n / 16 for n in sixteenths]
    dev = drive("shared", max_request=max_request, slots=256)     # a slot for every request: all enter at a
    E = len(mib)
    inst, _ = simulate(one_forward(list(range(E)), E), np.ones(1, bool), sized_layout(mib), dev,
                       RuntimeConfig(workers=E, **NO_COMPUTE))
    sizes = np.array(mib) * MIB
    assert float(inst.stall[0]) == pytest.approx(A + sizes.sum() / B, rel=1e-9)
    # fair sharing: a read of s bytes is done once every read has passed min(its size, s) bytes
    ready = A + np.array([np.minimum(sizes, s).sum() for s in sizes]) / B
    # the compute thread takes the experts in issue (offset) order: its waits add up to the latest ready so far
    assert np.cumsum(inst.expert_wait[0]) == pytest.approx(np.maximum.accumulate(ready), rel=1e-9)
