"""One read path: the model and the harness issue the reads one compiled planner plans (issue #12)."""

import threading

import numpy as np
import pytest
from conftest import small_geometry

import replay.physical.arm_run as run_module
from replay.physical.measure import measure
from replay.physical.reader import Reader
from containers.container import Container
from containers.layout import layout_from_container
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import layout_arrays, simulate
from replay.model.readplan import SCALE, WEIGHT, Coalescing, LayerPlace, new_plan, plan_layer


def _plan(pos_off, nbytes, cap, gap=0, skip=None):
    E = len(pos_off)
    sloc = np.zeros((E, 3, 3), np.int64)
    sloc[:, :, 0], sloc[:, :, 1], sloc[:, :, 2] = 1, np.arange(E)[:, None] * 12 + np.arange(3) * 4, 4
    plan = new_plan(E)
    place = LayerPlace(keep=1.0, adjacent=np.ones(E, bool), pos_file=np.zeros(E, np.int64),
                       pos_off=np.asarray(pos_off, np.int64), wbytes=np.asarray(nbytes, np.int64),
                       wloc=np.zeros((E, 3, 3), np.int64), sloc=sloc)
    n, jobs = plan_layer(np.arange(E, dtype=np.int64), E, np.zeros(E, bool) if skip is None else np.asarray(skip),
                         np.zeros(E, bool), place, Coalescing(coalesce=True, gap_bytes=gap, max_bytes=cap),
                         np.empty(E, np.int64), plan)
    return [r for r in zip(*(a[:n].tolist() for a in plan))], jobs


def test_a_coalesced_read_never_exceeds_the_cap():
    # four contiguous 60-byte experts, cap 100: no two fit, so four reads (never one read of 120 bytes)
    reads, jobs = _plan([0, 60, 120, 180], [60] * 4, cap=100)
    weights = [r for r in reads if r[5] == WEIGHT]
    assert [(off, n, a, b) for _, off, n, a, b, _, _ in weights] == [(0, 60, 0, 0), (60, 60, 1, 1), (120, 60, 2, 2),
                                                                     (180, 60, 3, 3)]
    assert len([r for r in reads if r[5] == SCALE]) == 12 and jobs == 8
    reads, _ = _plan([0, 60, 120, 180], [60] * 4, cap=120)
    assert [(r[1], r[2], r[3], r[4]) for r in reads if r[5] == WEIGHT] == [(0, 120, 0, 1), (120, 120, 2, 3)]
    # the cap counts the gaps; a lone expert over the cap is still read whole
    reads, _ = _plan([0, 70, 140], [60, 60, 200], cap=130, gap=10)
    assert [(r[1], r[2]) for r in reads if r[5] == WEIGHT] == [(0, 130), (140, 200)]
    # a miss whose prefetch is in flight reads nothing and ends a run
    reads, _ = _plan([0, 60, 120, 180], [60] * 4, cap=1000, skip=[False, True, False, False])
    assert [(r[1], r[2], r[3], r[4]) for r in reads if r[5] == WEIGHT] == [(0, 60, 0, 0), (120, 120, 2, 3)]


@pytest.mark.parametrize("cfg", [{}, {"coalesce": True}, {"coalesce": True, "coalesce_max_bytes": 250_000},
                                 {"coalesce": True, "coalesce_max_bytes": 1}])
def test_model_and_harness_issue_identical_read_lists(small_container, tmp_path, monkeypatch, cfg):
    """Same container layout, trace and configuration (no RAM tiers, no prefetch, buffered reads, so
    neither side widens): per (forward, layer) the harness performs exactly the planned reads, and
    the model counts the same reads and bytes."""
    g = small_geometry()
    trace = synth_trace(g.moe_layers, g.n_routed_experts, 8, 12, 1, seed=5, geometry=g.name)
    config = RuntimeConfig(workers=3, dense_seconds=0.0, direct=False, compute_bytes_per_second=1e15, **cfg)
    c = Container.open(small_container)
    layout = layout_from_container(c)
    lay = layout_arrays(layout, config, None)
    lock = threading.Lock()
    done, planned = [], []                 # per layer: reads the harness performed / the plan it was given
    real_read, real_submit = Reader.read, run_module.submit_layer

    def read(self, f, off, n, direct):
        with lock:
            done[-1].append((f, off, n, direct))
        return real_read(self, f, off, n, direct)

    def submit(pool, job, reads, k, config, after=()):
        done.append([])
        planned.append(reads)
        return real_submit(pool, job, reads, k, config, after)

    monkeypatch.setattr(Reader, "read", read)
    monkeypatch.setattr(run_module, "submit_layer", submit)
    mask = np.ones(trace.n_forwards, bool)
    measure(c, trace, mask, config, None, record=False, cold=False, progress=False)
    inst, _ = simulate(trace, mask, layout, load_device("mac-pro-2019-applraid-4x"), config)
    assert len(planned) == len(inst.forward)
    cap_ok = 0
    for i, (f, li) in enumerate(zip(inst.forward.tolist(), inst.layer.tolist())):
        # the union the model read, in issue order, planned afresh, is the plan the harness was given
        rows = (trace.row_forward == f) & (trace.row_layer == layout.layers[li])
        union = np.unique(trace.experts[rows][trace.experts[rows] >= 0])
        experts = union[np.argsort(lay.rank[li, union])]
        plan = new_plan(len(experts))
        place = LayerPlace(keep=1.0, adjacent=lay.adjacent[li], pos_file=lay.pos_file[li], pos_off=lay.pos_off[li],
                           wbytes=lay.wbytes[li], wloc=lay.wloc[li], sloc=lay.sloc[li])
        policy = Coalescing(coalesce=config.coalesce, gap_bytes=config.coalesce_gap_bytes,
                            max_bytes=config.coalesce_max_bytes)
        n, _ = plan_layer(experts.astype(np.int64), len(experts), np.zeros(len(experts), bool), np.zeros(len(experts), bool),
                          place, policy, np.empty(len(experts), np.int64), plan)
        expect = list(zip(*(a[:n].tolist() for a in plan)))
        assert planned[i] == expect
        # the harness performed exactly those reads (threads reorder them), buffered
        assert sorted(done[i]) == sorted((r[0], r[1], r[2], False) for r in expect)
        # the model issued the same number of reads and bytes for this instance
        assert inst.reads[i] == len(done[i])
        assert inst.read_bytes[i] == sum(r[2] for r in done[i])
        for r in expect:
            if r[5] == WEIGHT and r[4] > r[3]:
                assert r[2] <= config.coalesce_max_bytes
                cap_ok += 1
    if cfg.get("coalesce") and cfg.get("coalesce_max_bytes", 1 << 30) > 1:
        assert cap_ok > 0, "the layout should give coalesced reads"
    if cfg.get("coalesce_max_bytes") == 1:
        assert cap_ok == 0
