"""The compiled replay model's interface: outputs declared once, every one filled and handed over;
a case computed by hand."""

from dataclasses import fields

import numpy as np
import pytest

from containers.layout import Layout
from replay.model.config import RuntimeConfig
from replay.model.coupling import coupling_table
from replay.model.device import ArrayProfile, DriveProfile
from replay.model.engine import (
    DeviceOutputs,
    DeviceUsage,
    InstanceOutputs,
    InstanceResult,
    PrefetchOutputs,
    PrefetchResult,
    new_results,
    simulate,
)
from replay.control.sources import learn_source
from replay.model.predictors import RELIABILITY_BINS
from replay.model.routing import RoutingTrace

NO_COMPUTE = dict(dense_seconds=0.0, compute_bytes_per_second=1e30)
DECLARED = ((InstanceResult, InstanceOutputs, "instance"), (PrefetchResult, PrefetchOutputs, "prefetch"),
            (DeviceUsage, DeviceOutputs, "device"))


def one_drive(latency=1e-4, bw=1e9, host=1e12):
    return ArrayProfile("test-drive", DriveProfile("d", latency, bw, 32), 1, 0, "none", host,
                        read_ahead_bytes=0)


def layout(E=8, L=2, wbytes=(8192, 8192, 16384), sbytes=(4096, 4096, 4096)):
    """One file: per expert its three weights adjacent, then its three scales; 4 KiB aligned."""
    loc = np.zeros((L, E, 6, 3), dtype=np.int64)
    off = 4096
    for li in range(L):
        for e in range(E):
            for slot, n in enumerate(list(wbytes) + list(sbytes)):
                loc[li, e, slot] = (0, off, n)
                off += n
    return Layout(["f.safetensors"], [off], list(range(3, 3 + L)), E, loc, 4096)


def trace(forwards, L=2, E=8, sessions=None):
    """``forwards``: per forward, per layer, the experts of its one position."""
    rf, rl, ex = [], [], []
    for f, per_layer in enumerate(forwards):
        for li, sel in enumerate(per_layer):
            rf.append(f)
            rl.append(3 + li)
            ex.append(sel)
    F = len(forwards)
    sess = np.array(sessions or [0] * F, dtype=np.int32)
    return RoutingTrace(
        layers=np.arange(3, 3 + L, dtype=np.int16), n_experts=E, top_k=len(ex[0]), geometry="test",
        sessions=[f"s{i}" for i in range(int(sess.max()) + 1)],
        row_forward=np.array(rf, dtype=np.int32), row_layer=np.array(rl, dtype=np.int16),
        row_position=np.zeros(len(rf), dtype=np.int32), experts=np.array(ex, dtype=np.int16),
        gates=np.full((len(ex), len(ex[0])), np.nan, dtype=np.float32), fwd_session=sess,
        fwd_kind=np.zeros(F, dtype=np.int8), fwd_evaluated=np.ones(F, dtype=np.int32), fwd_committed=np.ones(F, dtype=np.int32),
    )


def test_the_compiled_outputs_are_the_result_fields_declared_as_outputs():
    for cls, kind, _ in DECLARED:
        declared = [f.name for f in fields(cls) if "shape" in f.metadata]
        assert list(kind._fields) == declared
        # every field of the public result is an output, except the instance's identity and the prefetch group
        assert set(f.name for f in fields(cls)) - set(declared) <= {"forward", "layer", "prefetch"}
    out = new_results(5, 2, 8, 3)
    sizes = {"I": 5, "L": 2, "E": 8, "M": 3, "R": RELIABILITY_BINS, "A": 1}
    for cls, _, group in DECLARED:
        for f in fields(cls):
            if "shape" in f.metadata:
                a = getattr(getattr(out, group), f.name)
                assert a.shape == tuple(sizes[x] for x in f.metadata["shape"]) and a.dtype == f.metadata["dtype"]
                assert not a.any()


def test_every_declared_output_is_filled_and_handed_over_with_its_shape():
    rng = np.random.default_rng(1)
    forwards = [[sorted(rng.choice(8, 3, replace=False).tolist()) for _ in range(2)] for _ in range(40)]
    tr = trace(forwards, sessions=[0] * 20 + [1] * 20)
    lay = layout()
    train = tr.session_forward_mask([0])
    table = coupling_table(tr, train, lay, max_targets=4)  # (with E < 16 the default fails in top_targets)
    learned = learn_source("coupled", tr, train, lay, coupling=table)
    nonzero = set()
    for cfg in (RuntimeConfig(workers=2), RuntimeConfig(prefetch="oracle", prefetch_experts=4),
                RuntimeConfig(prefetch="coupled", prefetch_experts=5, ram_bytes=4 * 2 * 45056),
                RuntimeConfig(prefetch="coupled", admission="probability", prefetch_experts=2, dense_seconds=1e-4),
                RuntimeConfig(prefetch="coupled", admission="probability", prefetch_experts=2, source_caps=[0.5]),
                RuntimeConfig(prefetch="coupled", admission="observe"),
                RuntimeConfig(prefetch="pilot", pilot_precision=0.5, prefetch_experts=3, ram_bytes=4 * 2 * 45056,
                              dense_seconds=1e-6, layer_barrier=True, evict_guard=True)):
        inst, usage = simulate(tr, ~train, lay, one_drive(), cfg,
                               coupling=learned if cfg.admission != "top-k" else table)
        I = len(inst.forward)
        assert I == 40
        groups = [(InstanceResult, inst), (DeviceUsage, usage)] + ([(PrefetchResult, inst.prefetch)] if cfg.prefetch != "none" else [])
        assert (inst.prefetch is None) == (cfg.prefetch == "none")
        for cls, res in groups:
            for f in fields(cls):
                if "shape" not in f.metadata:
                    continue
                a = getattr(res, f.name)
                assert a.shape == tuple({"I": I, "L": 2, "E": 8, "M": 1, "R": RELIABILITY_BINS, "A": 1}[x]
                                        for x in f.metadata["shape"]), f.name
                assert a.dtype == f.metadata["dtype"], f.name
                if a.any():
                    nonzero.add(f"{cls.__name__}.{f.name}")
    declared = {f"{cls.__name__}.{f.name}" for cls, _, _ in DECLARED for f in fields(cls) if "shape" in f.metadata}
    assert declared - nonzero == set()


def test_two_misses_on_one_drive_by_hand():
    """Two experts of one layer, one worker, no compute, a drive of 100 us per request and 1 GB/s.

    Each expert is one 32 KiB weight read (adjacent tensors, 4 KiB aligned, so O_DIRECT widens
    nothing) and three 4 KiB scale reads (first access in the session), one after another:
    4 x 100 us + 45,056 B / 1 GB/s each, and the compute thread waits for both in turn.
    """
    tr = trace([[[1, 4]]], L=1)
    inst, usage = simulate(tr, np.ones(1, bool), layout(L=1), one_drive(), RuntimeConfig(workers=1, **NO_COMPUTE))
    per_expert = 4 * 1e-4 + 45056 / 1e9
    assert inst.forward.tolist() == [0] and inst.layer.tolist() == [0]
    assert inst.stall == pytest.approx([2 * per_expert], rel=1e-12)
    assert inst.oracle_stall == pytest.approx([2 * 45056 / 1e9], rel=1e-12)   # streaming at 1 GB/s, no request cost
    assert inst.compute == pytest.approx([0.0], abs=1e-20)
    assert inst.union_experts.tolist() == [2] and inst.misses.tolist() == [2] and inst.hits.tolist() == [0]
    assert inst.union_bytes.tolist() == [2 * 45056] and inst.read_bytes.tolist() == [2 * 45056]
    assert inst.reads.tolist() == [8]
    wait = np.zeros((1, 8))
    wait[0, 1] = wait[0, 4] = per_expert
    np.testing.assert_allclose(inst.expert_wait, wait, rtol=1e-12)
    assert usage.requests.tolist() == [8]
    assert usage.transfer_seconds == pytest.approx([2 * 45056 / 1e9], rel=1e-12)
    assert usage.residence_seconds == pytest.approx([2 * per_expert], rel=1e-12)
    assert usage.busy_seconds == pytest.approx([2 * per_expert], rel=1e-12)    # one read at a time: all of it
    assert inst.prefetch is None


def test_busy_time_counts_overlapping_reads_once():
    """Two workers keep the drive busy from routing until the last read completes, their reads
    overlapping: the array's busy time is that span (the stall, with no compute), less than the
    reads' summed residence, and not less than the bytes' transfer time."""
    tr = trace([[[1, 4]]], L=1)
    inst, usage = simulate(tr, np.ones(1, bool), layout(L=1), one_drive(), RuntimeConfig(workers=2, **NO_COMPUTE))
    assert usage.busy_seconds == pytest.approx(inst.stall, rel=1e-12)
    assert usage.busy_seconds[0] < usage.residence_seconds[0]
    assert usage.busy_seconds[0] >= usage.transfer_seconds[0]
