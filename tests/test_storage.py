"""Storage over several drives: the engine's routing and striping against hand-computed cases, and
the storage description's strictness."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.errors import InputError
from containers.layout import Layout
from replay.model.storage import (
    DirectorySpec,
    DriveSpec,
    Storage,
    StorageRecord,
    load_storage,
    replica_cuts,
    route_hash,
    route_replica,
    stripe_chunks,
    widen_direct,
)

MiB = 1 << 20


# Hash values and replicas computed outside Python with the engine's 32-bit expression
# (a throwaway C program), for weights 3:1 (cuts 192, 256) and 2:1:1 (cuts 128, 192, 256).
@pytest.mark.parametrize("layer, expert, h, r31, r211", [
    (3, 0, 241, 1, 2), (3, 5, 243, 1, 2), (10, 200, 212, 1, 2), (77, 255, 88, 0, 0), (78, 17, 64, 0, 0),
    (3, 3, 146, 0, 1),
])
def test_routing_matches_hand_computed_replicas(layer, expert, h, r31, r211):
    assert route_hash(layer, expert) == h
    assert route_replica(layer, expert, replica_cuts([3, 1])) == r31
    assert route_replica(layer, expert, replica_cuts([2, 1, 1])) == r211


def test_cuts_round_half_up_and_keep_the_engine_quirk():
    assert replica_cuts([3, 1]) == [192, 256]
    assert replica_cuts([1, 1, 1]) == [85, 171, 256]          # 85.33 -> 85, 170.67 -> 171
    assert replica_cuts([9, 3, 0.01]) == [192, 256, 256]      # the tiny replica gets no slice, as in the engine
    assert replica_cuts([0.001, 1]) == [1, 256]               # a first replica rounding to 0 keeps one value
    assert route_replica(3, 0, [256]) == 0                    # no mirror: the primary


def test_routing_share_follows_weights():
    cuts = replica_cuts([3, 1])
    share = np.mean([route_replica(l, e, cuts) for l in range(3, 78) for e in range(256)])
    assert share == pytest.approx(4878 / 19200)               # counted by the same C program
    assert 0.2 < share < 0.3


def test_ten_mib_read_stripes_in_equal_aligned_chunks():
    # over 2 replicas, routed to replica 1: 5 MiB each, chunk 0 on replica 1
    assert stripe_chunks(10 * MiB, [0, 1], 1) == [(1, 0, 5 * MiB), (0, 5 * MiB, 5 * MiB)]
    # over 3: ceil(10 MiB / 3) = 3495254 rounded up to 4 KiB = 3497984; the last chunk is the rest
    assert stripe_chunks(10 * MiB, [0, 1, 2], 1) == [(1, 0, 3497984), (2, 3497984, 3497984), (0, 6995968, 3489792)]
    # partial mirror: replica 2 routed, the list [0, 2] is indexed by the replica number 2 -> entry 0
    assert stripe_chunks(10 * MiB, [0, 2], 2) == [(0, 0, 5 * MiB), (2, 5 * MiB, 5 * MiB)]
    assert stripe_chunks(4 * MiB - 4096, [0, 1], 0) == []      # under 4 MiB: one read
    assert stripe_chunks(10 * MiB, [0], 0) == []              # one holder: one read


def test_last_chunk_takes_the_rest():
    # 4 MiB + 4 KiB over 4 replicas: chunks of 257 pages, the last 256
    ch = stripe_chunks(4 * MiB + 4096, [0, 1, 2, 3], 0)
    assert [n // 4096 for _, _, n in ch] == [257, 257, 257, 254]
    ch = stripe_chunks(4 * MiB + 3 * 4096, [0, 1, 2, 3, 4], 0)     # 1027 pages over 5: chunks of 206 pages, the last 203
    assert [n // 4096 for _, _, n in ch] == [206, 206, 206, 206, 203]


@settings(max_examples=60, deadline=None)
@given(st.integers(4 * MiB, 64 * MiB).map(lambda n: n // 4096 * 4096), st.integers(2, 5), st.integers(0, 4))
def test_stripes_cover_the_read_once(length, n, routed):
    holders = list(range(n))
    ch = stripe_chunks(length, holders, routed % n)
    assert ch and ch[0][0] == routed % n
    assert [o for _, o, _ in ch] == [sum(c[2] for c in ch[:i]) for i in range(len(ch))]
    assert sum(c[2] for c in ch) == length
    assert len({c[2] for c in ch[:-1]}) <= 1 and all(c[2] % 4096 == 0 for c in ch)


def test_widen_direct():
    assert widen_direct(4096 + 100, 10) == (4096, 4096)
    assert widen_direct(8191, 2) == (4096, 8192)


def _layout(n_files=3, adjacent=True):
    """Two experts of layer 3 in file 0 and 1, scales in file 2; each weight tensor 2 MiB."""
    loc = np.zeros((1, 2, 6, 3), dtype=np.int64)
    for e in range(2):
        for s in range(3):
            off = 4196 + s * 2 * MiB if adjacent else 4196 + s * 3 * MiB
            loc[0, e, s] = (e, off, 2 * MiB)
            loc[0, e, 3 + s] = (2, 4096 + (e * 3 + s) * 65536, 65536)
    names = [f"out-{i + 1:05d}.safetensors" for i in range(n_files)]
    return Layout(names, [64 * MiB] * n_files, [3], 2, loc)


def _record(mirror_shards, weights=(3.0, 1.0), direct=True, stripe=True):
    lay = _layout()
    return lay, StorageRecord(
        [DriveSpec("fast", "single-nvme"), DriveSpec("slow", "single-nvme", speed=0.5)],
        [DirectorySpec("fast", lay.files[:2]), DirectorySpec("slow", lay.files[2:])],
        [DirectorySpec("slow", mirror_shards)] if mirror_shards else [],
        list(weights) if mirror_shards else None, direct, stripe)


def _storage(rec, lay):
    from replay.model.device import load_device
    prof = load_device("single-nvme")
    return Storage(rec, {"fast": prof, "slow": prof.scaled(0.5)}, lay)


def test_expert_reads_split_mirror_and_fallback():
    lay, rec = _record(None)
    s = _storage(rec, lay)
    # no mirror: expert 0's 6 MiB weights on drive 0 (file 0), scales on drive 1 (file 2)
    assert s.expert_reads(3, 0, lay.expert_loc[0, 0]) == [(0, 6 * MiB + 4096)] + [(1, 65536)] * 3
    lay, rec = _record([lay.files[0]])
    s = _storage(rec, lay)
    # (3, 0) routes to replica 1 (hash 241 >= 192): file 0 is mirrored, widened to 6 MiB + 4 KiB, striped
    reads = s.expert_reads(3, 0, lay.expert_loc[0, 0])
    assert reads[:2] == [(1, 3 * MiB + 4096), (0, 3 * MiB)]       # chunks rounded up to 4 KiB, the rest last
    assert reads[2:] == [(1, 65536)] * 3                      # scales: file 2 is on drive 1 anyway
    # (3, 0)'s weights moved to file 1, which the mirror lacks: the whole read from the primary
    loc = lay.expert_loc[0, 0].copy()
    loc[:3, 0] = 1
    assert s.expert_reads(3, 0, loc)[0] == (0, 6 * MiB + 4096)
    # its scales stay routed to replica 1: file 2 is not mirrored, so drive 1 (its primary) serves them
    assert s.expert_reads(3, 0, loc)[1:] == [(1, 65536)] * 3


def test_buffered_reads_are_not_striped():
    lay, rec = _record([_layout().files[0]], direct=False)
    s = _storage(rec, lay)
    assert s.expert_reads(3, 0, lay.expert_loc[0, 0])[0] == (1, 6 * MiB)   # routed to the mirror, whole
    lay, rec = _record([_layout().files[0]], stripe=False)
    s = _storage(rec, lay)
    assert s.expert_reads(3, 0, lay.expert_loc[0, 0])[0] == (1, 6 * MiB + 4096)


def test_record_round_trips_and_rejects_bad_input(tmp_path):
    lay, rec = _record([_layout().files[0]])
    p = tmp_path / "storage.json"
    p.write_text(json.dumps(rec.to_json()))
    back, profiles = load_storage(p)
    assert back == rec and profiles["slow"].drive.bandwidth == pytest.approx(profiles["fast"].drive.bandwidth / 2)
    bad = rec.to_json()
    bad["dirs"][1]["shards"].append(lay.files[0])
    with pytest.raises(InputError, match="in split directories 0 and 1"):
        StorageRecord.from_json(bad, "s.json")
    bad = rec.to_json()
    bad["weights"] = [1.0]
    with pytest.raises(InputError, match="2 positive numbers"):
        StorageRecord.from_json(bad, "s.json")
    bad = rec.to_json()
    bad["mirrors"][0]["drive"] = "nvme9"
    with pytest.raises(InputError, match="unknown drive"):
        StorageRecord.from_json(bad, "s.json")
    bad = rec.to_json()
    bad["direct"] = 1
    with pytest.raises(InputError, match="not true or false"):
        StorageRecord.from_json(bad, "s.json")
    rec2 = StorageRecord(rec.drives, [DirectorySpec("fast", lay.files[:1])])
    with pytest.raises(InputError, match="in no split directory"):
        _storage(rec2, lay)


def test_capacity_is_checked():
    lay, rec = _record(None)
    small = StorageRecord([DriveSpec("fast", "single-nvme", capacity_bytes=100 * MiB), rec.drives[1]], rec.dirs)
    with pytest.raises(InputError, match="more than its capacity"):
        _storage(small, lay)


def test_engine_variables():
    lay, rec = _record([_layout().files[0]])
    env = _storage(rec, lay).engine_variables({"dir:0": "/a", "dir:1": "/b", "mirror:0": "/m"})
    assert env == {"SNAP": "/a", "COLI_MODEL_DIRS": "/b", "COLI_MODEL_MIRROR": "/m", "COLI_DISK_WEIGHTS": "3,1",
                   "DIRECT": "1"}


# ------------------------------------------------------------------ the compiled model on several drives

def _two_file_layout(E=8):
    """Layer 3's experts alternate between two files; each expert's weights adjacent, then its scales."""
    loc = np.zeros((1, E, 6, 3), dtype=np.int64)
    off = [4096, 4096]
    for e in range(E):
        f = e % 2
        for slot, n in enumerate((2 * MiB, 2 * MiB, 2 * MiB, 65536, 65536, 65536)):
            loc[0, e, slot] = (f, off[f], n)
            off[f] += n
    return Layout(["out-00001.safetensors", "out-00002.safetensors"], off, [3], E, loc, 4096)


def _storage_file(tmp_path, rec):
    p = tmp_path / "storage.json"
    p.write_text(json.dumps(rec.to_json()))
    from replay.model.storage import storage_profile
    return storage_profile(p)


def test_compiled_model_on_independent_drives(tmp_path):
    from conftest import make_trace
    from replay.model.config import RuntimeConfig
    from replay.model.device import load_device
    from replay.model.engine import simulate

    lay = _two_file_layout()
    tr = make_trace([[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[0, 3, 4, 7]]], E=8)
    cfg = RuntimeConfig(workers=4, dense_seconds=0.0, compute_bytes_per_second=1e30)
    fwd = np.ones(3, bool)
    plain, plain_use = simulate(tr, fwd, lay, load_device("single-nvme"), cfg)
    one = _storage_file(tmp_path, StorageRecord([DriveSpec("a", "single-nvme")], [DirectorySpec("a", lay.files)]))
    same, _ = simulate(tr, fwd, lay, one, cfg)
    assert same.stall == pytest.approx(plain.stall, rel=1e-12)              # one drive holding all: today's model
    two = _storage_file(tmp_path, StorageRecord([DriveSpec("a", "single-nvme"), DriveSpec("b", "single-nvme")],
                                                [DirectorySpec("a", lay.files[:1]), DirectorySpec("b", lay.files[1:])]))
    split, use = simulate(tr, fwd, lay, two, cfg)
    assert (split.stall < 0.75 * plain.stall).all()                         # each layer's loads on two drives
    assert use.transfer_seconds[0] == pytest.approx(use.transfer_seconds[1], rel=0.01)
    slow = _storage_file(tmp_path, StorageRecord([DriveSpec("a", "single-nvme"), DriveSpec("b", "single-nvme", 0.5)],
                                                 [DirectorySpec("a", lay.files[:1]), DirectorySpec("b", lay.files[1:])]))
    slower, slow_use = simulate(tr, fwd, lay, slow, cfg)
    assert (slower.stall > 1.5 * split.stall).all()                         # the layer waits for the slow drive
    assert slow_use.transfer_seconds[1] == pytest.approx(2 * slow_use.transfer_seconds[0], rel=0.01)   # its own rate
    # a layout the description does not list: split evenly by name over the same drives
    other = Layout(["x-1.safetensors", "x-2.safetensors"], lay.file_sizes, lay.layers, 8, lay.expert_loc, 4096)
    evenly, _ = simulate(tr, fwd, other, two, cfg)
    assert evenly.stall == pytest.approx(split.stall, rel=1e-12)


# ------------------------------------------------------------------ a split and mirrored layout on disk

def test_check_split_and_mirrors(small_container, tmp_path):
    import shutil

    from containers.multidir import check_split

    files = sorted(p.name for p in small_container.glob("*.safetensors"))
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    for d in (a, b, m):
        d.mkdir()
    half = len(files) // 2
    for n in files[:half]:
        shutil.copy(small_container / n, a / n)
    for n in files[half:]:
        shutil.copy(small_container / n, b / n)
    shutil.copy(small_container / files[0], m / files[0])
    ok = check_split([a, b], [m])
    assert ok.problems == [] and sorted(ok.shards) == files and ok.mirrored == [[files[0]]]
    # a mirror file whose bytes differ under the same header: found by content, not by the engine's check
    data = bytearray((m / files[0]).read_bytes())
    data[-1] ^= 1
    (m / files[0]).write_bytes(bytes(data))
    assert check_split([a, b], [m], content=False).problems == []
    bad = check_split([a, b], [m])
    assert len(bad.problems) == 2 and "bytes differ" in bad.problems[0] and "no usable mirror file" in bad.problems[1]
    # a shard in two directories: the second copy is shadowed, its tensors counted once
    shutil.copy(small_container / files[-1], a / files[-1])
    shadow = check_split([a, b], [])
    assert len(shadow.problems) == 1 and "shadowed" in shadow.problems[0] and shadow.shards[files[-1]] == a / files[-1]
    (a / files[-1]).unlink()
    # a shard missing from every directory is not an error here, but its tensors are absent: a renamed
    # copy of a shard puts every tensor twice
    shutil.copy(small_container / files[0], b / "extra.safetensors")
    twice = check_split([a, b], [])
    assert twice.problems and all("is in both" in p for p in twice.problems)


def test_stage_mirror_copies_checks_and_resumes(small_container, tmp_path):
    import shutil

    from containers.multidir import RECEIPT, check_split, mirror_receipt_problems, stage_mirror

    files = sorted(p.name for p in small_container.glob("*.safetensors"))
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    a.mkdir(), b.mkdir()
    for i, n in enumerate(files):
        shutil.copy(small_container / n, (a if i % 2 == 0 else b) / n)
    chosen = files[:2]
    receipt = stage_mirror([a, b], chosen, m)
    assert [f["name"] for f in receipt["files"]] == chosen and (m / RECEIPT).is_file()
    assert check_split([a, b], [m]).problems == [] and check_split([a, b], [m]).mirrored == [chosen]
    assert mirror_receipt_problems(m) == []
    # a stale partial file from a killed run is replaced; a complete file is kept as it is
    (m / chosen[0]).unlink()
    (m / f".{chosen[0]}.relayout-partial").write_bytes(b"half")
    kept = (m / chosen[1]).stat().st_mtime_ns
    stage_mirror([a, b], chosen, m)
    assert (m / chosen[0]).read_bytes() == (small_container / chosen[0]).read_bytes()
    assert (m / chosen[1]).stat().st_mtime_ns == kept and not (m / f".{chosen[0]}.relayout-partial").exists()
    # a present file that differs is never replaced
    (m / chosen[1]).write_bytes(b"not a shard")
    with pytest.raises(InputError, match="exists and differs"):
        stage_mirror([a, b], chosen, m)
    assert (m / chosen[1]).read_bytes() == b"not a shard"
    assert len(mirror_receipt_problems(m)) == 1
    with pytest.raises(InputError, match="in none of the split directories"):
        stage_mirror([a, b], ["nope.safetensors"], m)


def test_mirror_command(small_container, tmp_path):
    import shutil

    from conftest import cli

    files = sorted(p.name for p in small_container.glob("*.safetensors"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i, n in enumerate(files):
        shutil.copy(small_container / n, (a if i % 2 == 0 else b) / n)
    rec = StorageRecord([DriveSpec("x", "single-nvme"), DriveSpec("y", "single-nvme")],
                        [DirectorySpec("x", files[0::2]), DirectorySpec("y", files[1::2])], [DirectorySpec("y", files[:1])])
    (tmp_path / "s.json").write_text(json.dumps(rec.to_json()))
    r = cli("mirror", "stage", a, b, "--storage", tmp_path / "s.json", "--to", tmp_path / "m")
    assert r.returncode == 0 and "staged 1 shard(s)" in r.stdout, r.stderr
    r = cli("mirror", "check", a, b, "--mirror", tmp_path / "m")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK")
    (tmp_path / "m" / files[0]).write_bytes(b"x")
    r = cli("mirror", "check", a, b, "--mirror", tmp_path / "m")
    assert r.returncode == 1 and "bytes, the shard" in r.stdout
    r = cli("mirror", "stage", a, b, "--storage", tmp_path / "s.json", "--to", tmp_path / "m")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists and differs" in r.stderr


def test_stage_mirror_on_a_full_disk_leaves_nothing_half_written(small_container, tmp_path, monkeypatch):
    import errno
    import os
    import shutil

    from containers import multidir

    files = sorted(p.name for p in small_container.glob("*.safetensors"))
    a = tmp_path / "a"
    a.mkdir()
    for n in files:
        shutil.copy(small_container / n, a / n)
    real = os.copy_file_range
    calls = []

    def full(fin, fout, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if len(calls) > 1:                     # the disk fills after the first piece
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fin, fout, min(count, 4096), offset_src, offset_dst)

    monkeypatch.setattr(multidir.os, "copy_file_range", full)
    with pytest.raises(OSError):
        multidir.stage_mirror([a], files[:1], tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == []   # no partial file, no receipt, no shard
    monkeypatch.setattr(multidir.os, "copy_file_range", real)
    multidir.stage_mirror([a], files[:1], tmp_path / "m")              # room again: the stage completes
    assert multidir.mirror_receipt_problems(tmp_path / "m") == []
