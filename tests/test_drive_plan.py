"""Placement over several drives: capacities respected, every tensor once, the mirror within its
budget and holding only mirrored experts, loads spread by drive speed; the command's front door."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.layout import layout_from_geometry, slot_name
from relayout.planning.drive_plan import choose_mirrored, even_split_by_name, plan_drives, training_routing
from relayout.traces.synth import synth_trace
from replay.model.device import load_device
from replay.model.drivetime import expert_table, session_stall
from replay.model.storage import DriveSpec, Storage
from replay.formats.trace import save_trace

from conftest import cli, small_geometry


@pytest.fixture(scope="module")
def model():
    g = small_geometry(moe_layers=3, experts=16, ffn=1024, hidden=1024, shard_bytes=8_000_000)
    stock, tensors = layout_from_geometry(g)
    trace = synth_trace(g.moe_layers, 16, 4, tokens=400, sessions=4, seed=3)
    routing = training_routing(trace, trace.fwd_session % 2 == 0, stock)
    return g, stock, tensors, trace, routing


def _profiles(speeds):
    nvme = load_device("single-nvme")
    return {n: nvme.scaled(s) for n, s in speeds.items()}


def _check_layout(stock, tensors, plan):
    lay = plan.layout
    names = []
    extents = {}
    for li, layer in enumerate(lay.layers):
        for e in range(lay.n_experts):
            for s in range(6):
                f, off, n = lay.expert_loc[li, e, s]
                names.append(slot_name(layer, e, s))
                extents.setdefault(int(f), []).append((int(off), int(n)))
    for name, f, off, n in lay.other_tensors:
        names.append(name)
        extents.setdefault(int(f), []).append((int(off), int(n)))
    assert sorted(names) == sorted(t.name for t in tensors)                 # every tensor exactly once
    for f, ex in extents.items():                                            # no overlap, inside the file
        ex.sort()
        assert all(a[0] + a[1] <= b[0] for a, b in zip(ex, ex[1:]))
        assert ex[-1][0] + ex[-1][1] <= lay.file_sizes[f]
    held = [s for d in plan.storage.dirs for s in d.shards]
    assert sorted(held) == sorted(lay.files)                                 # every shard in one split directory


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(2, 4), st.floats(0.05, 0.6), st.floats(0.25, 1.0), st.integers(0, 2))
def test_plan_invariants(model, n_drives, mirror_share, slow, tight):
    g, stock, tensors, trace, routing = model
    total = sum(stock.file_sizes)
    names = [f"d{i}" for i in range(n_drives)]
    speeds = {n: (1.0 if i % 2 == 0 else slow) for i, n in enumerate(names)}
    speeds["m"] = slow
    # capacities: just enough for an even share plus slack, one drive tighter when asked
    cap = int(total / n_drives * 1.6)
    drives = [DriveSpec(n, "single-nvme", speeds[n], cap if i != 0 or not tight else int(cap * 0.8)) for i, n in enumerate(names)]
    budget = int(mirror_share * total)
    drives.append(DriveSpec("m", "single-nvme", slow, budget + 1))
    profiles = _profiles(speeds)
    plan = plan_drives(stock, tensors, routing, drives, profiles, names, "m", budget, shard_bytes=g.shard_bytes)
    _check_layout(stock, tensors, plan)
    storage = Storage(plan.storage, profiles, plan.layout)                   # raises when a capacity is exceeded
    sizes = dict(zip(plan.layout.files, plan.layout.file_sizes))
    for d in drives:
        held = sum(sizes[s] for dd in plan.storage.dirs + plan.storage.mirrors if dd.drive == d.name for s in dd.shards)
        assert held <= d.capacity_bytes
    if plan.storage.mirrors:
        mshards = set(plan.storage.mirrors[0].shards)
        assert sum(sizes[s] for s in mshards) <= budget
        idx = {n: i for i, n in enumerate(plan.layout.files)}
        for li in range(len(plan.layout.layers)):
            for e in range(16):
                in_mirror = plan.layout.files[int(plan.layout.expert_loc[li, e, 0, 0])] in mshards
                assert in_mirror == bool(plan.mirrored[li, e])                # mirrored experts, and only they
                assert len({int(f) for f in plan.layout.expert_loc[li, e, :, 0]}) == 1   # an expert in one shard
        assert all(idx[s] >= 0 for s in mshards)
    assert storage.n_replicas == 1 + len(plan.storage.mirrors)


def test_loads_follow_drive_speed(model):
    g, stock, tensors, trace, routing = model
    drives = [DriveSpec("fast", "single-nvme"), DriveSpec("slow", "single-nvme", 0.25)]
    profiles = _profiles({"fast": 1.0, "slow": 0.25})
    plan = plan_drives(stock, tensors, routing, drives, profiles, ["fast", "slow"], None, 0, shard_bytes=g.shard_bytes)
    st_ = Storage(plan.storage, profiles, plan.layout)
    table = expert_table(st_, plan.layout)
    for li in range(3):
        load = (routing.p[li][:, None] * table.bytes[li]).sum(axis=0)
        assert 0.7 < load[0] / load.sum() < 0.9                              # about 4:1, the drives' rates
    # and the predicted stall on the held-out sessions beats the even split by name
    held = trace.fwd_session % 2 == 1
    planned = session_stall(trace, held, plan.layout, st_, table)
    even_st = Storage(even_split_by_name(stock, drives, ["fast", "slow"]), profiles, stock)
    even = session_stall(trace, held, stock, even_st, expert_table(even_st, stock))
    assert planned.per_token < even.per_token


def test_coactivated_experts_are_spread(model):
    g, stock, tensors, trace, routing = model
    drives = [DriveSpec("a", "single-nvme"), DriveSpec("b", "single-nvme")]
    plan = plan_drives(stock, tensors, routing, drives, _profiles({"a": 1, "b": 1}), ["a", "b"], None, 0, shard_bytes=g.shard_bytes)
    drive_of = {}
    for d, spec in enumerate(plan.storage.dirs):
        for s in spec.shards:
            drive_of[plan.layout.files.index(s)] = d
    for li in range(3):
        pairs = routing.pairs[li]
        i, j = np.unravel_index(np.argmax(pairs), pairs.shape)            # the layer's most co-activated pair
        di, dj = (drive_of[int(plan.layout.expert_loc[li, x, 0, 0])] for x in (i, j))
        assert di != dj


def test_capacity_too_small_is_refused(model):
    g, stock, tensors, trace, routing = model
    total = sum(stock.file_sizes)
    drives = [DriveSpec("a", "single-nvme", 1.0, total // 3), DriveSpec("b", "single-nvme", 1.0, total // 3)]
    with pytest.raises(InputError, match="capacities do not hold"):
        plan_drives(stock, tensors, routing, drives, _profiles({"a": 1, "b": 1}), ["a", "b"], None, 0, shard_bytes=g.shard_bytes)


def test_mirror_choice_stops_at_balance():
    p = np.array([[0.5, 0.3, 0.1, 0.1]])
    b = np.ones((1, 4))
    # an equal-speed mirror: halving loads helps until the two copies are balanced
    chosen = choose_mirrored(p, b, 10, 1.0, 1.0)
    assert chosen[0].tolist() == [True, True, True, True]
    # a mirror at a quarter of the speed: mirroring the 0.5 expert would make the mirror the
    # bottleneck (time 1.0, no gain); 0.3 then one 0.1 balance it at 0.8 (hand-computed)
    chosen = choose_mirrored(p, b, 10, 1.0, 0.25)
    assert chosen[0].tolist() == [False, True, True, False]
    assert not choose_mirrored(p, b, 0.5, 1.0, 1.0).any()                    # nothing fits


def test_command(tmp_path, model):
    g, stock, tensors, trace, routing = model
    gpath = tmp_path / "g.json"
    gpath.write_text(json.dumps(g.to_json()))
    save_trace(trace, tmp_path / "t.rt")
    bad = cli("drives", tmp_path / "t.rt", "--geometry", gpath, "--drive", "a")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "NAME=PROFILE" in bad.stderr
    ok = cli("drives", tmp_path / "t.rt", "--geometry", gpath, "--drive", "a=single-nvme", "--drive",
             "b=single-nvme,speed=0.5", "--out", tmp_path / "plan", "--path", "a=/mnt/a", "--path", "b=/mnt/b")
    assert ok.returncode == 0, ok.stderr
    assert "COLI_MODEL_DIRS=/mnt/b" in ok.stdout and "SNAP=/mnt/a" in ok.stdout
    assert "insufficient: 2 held-out session(s)" in ok.stdout                # 4 sessions: 2 held out
    rec = json.loads((tmp_path / "plan" / "storage.json").read_text())
    assert [d["drive"] for d in rec["dirs"]] == ["a", "b"]


def test_drive_seconds_closed_form():
    from replay.model.device import read_alone_seconds
    from replay.model.drivetime import drive_seconds

    nvme = load_device("single-nvme")
    s = 1 << 20                                                              # under the 1.25 MiB request limit
    t = drive_seconds(nvme, np.array([s, 0]), np.array([1, 0]), 8)
    assert t[0] == pytest.approx(read_alone_seconds(nvme.drive, s)) and t[1] == 0.0
    eight = drive_seconds(nvme, np.array([8 * 19 << 20]), np.array([8]), 8)[0]
    assert eight >= 8 * (19 << 20) / nvme.drive.bandwidth                 # at depth the drive's bandwidth bounds it
    assert drive_seconds(nvme.scaled(0.5), np.array([8 * 19 << 20]), np.array([8]), 8)[0] == pytest.approx(2 * eight)
