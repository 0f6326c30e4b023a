"""Sparse files: hashed and rewritten without being filled in, with the digests a dense copy has.

The multi-file test takes a sparse GLM-5.2-structured container (full-size experts, int8 MTP
layer, several GB logical in a few MB of disk) through inspect, manifest, plan, rewrite and
verify, and checks that the rewrite's destination stays sparse and that a byte flipped in a data
region or in a hole is caught.
"""

import os
import shutil

import pytest
import xxhash
from conftest import cli, small_geometry
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers.container import MANIFEST_NAME, Container
from containers.geometry import load_geometry
from containers.hashing import Range, hash_file, hash_range
from containers.manifest import build_manifest, write_manifest
from containers.sparse import DataMap, data_map, is_zero
from containers.synth import STAMP_BYTES, synth_container
from relayout.workflows.apply import apply_plan, verify
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import load_plan, save_plan

BLOCK = 4096


def _write_pattern(path, pieces, sparse: bool) -> bytes:
    """Write ``pieces`` (a list of (is_data, blocks, seed)) to ``path``; holes are left unwritten when
    ``sparse``, written as zeros otherwise. Returns the file's bytes."""
    out = bytearray()
    with open(path, "wb") as fh:
        for is_data, blocks, seed in pieces:
            n = blocks * BLOCK - (seed % 3) * 7     # not always block-aligned
            chunk = xxhash.xxh3_128_digest(seed.to_bytes(8, "little")) * (n // 16 + 1)
            chunk = chunk[:n] if is_data else bytes(n)
            if is_data or not sparse:
                fh.seek(len(out))
                fh.write(chunk)
            out += chunk
        fh.truncate(len(out))
    return bytes(out)


patterns = st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 2**32)), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=patterns, cuts=st.lists(st.integers(0, 10**6), max_size=6), window_pages=st.integers(1, 9))
def test_sparse_and_dense_files_hash_alike(tmp_path, pieces, cuts, window_pages):
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    data = _write_pattern(sparse, pieces, sparse=True)
    assert _write_pattern(dense, pieces, sparse=False) == data
    size = len(data)
    bounds = sorted({c % (size + 1) for c in cuts} | {0, size})
    ranges = [Range(f"r{i}", a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if i % 2 == 0]
    window = window_pages * 4096 * 4
    got_sparse = hash_file(sparse, ranges, window_bytes=window)
    got_dense = hash_file(dense, ranges, window_bytes=window)
    assert got_sparse == got_dense
    for r in ranges:
        want = xxhash.xxh3_128_hexdigest(data[r.begin:r.end])
        assert got_sparse[1][r.name] == want
        assert hash_range(sparse, r.begin, r.end, window_bytes=window) == want
    fd = os.open(sparse, os.O_RDONLY)
    try:
        dmap = data_map(fd)
    finally:
        os.close(fd)
    # every byte outside the data extents is zero; the runs tile the file
    runs = list(dmap.runs(0, size))
    assert [a for a, _, _ in runs] == [0] + [b for _, b, _ in runs[:-1]] and (not runs or runs[-1][1] == size)
    for a, b, is_data in runs:
        assert is_data or is_zero(data[a:b])
    if any(not d and n >= 3 for d, n, _ in pieces):     # a hole of whole blocks: the file system keeps it
        assert dmap.sparse and dmap.data_bytes(0, size) < size


def test_dense_file_costs_no_probe(tmp_path, monkeypatch):
    path = tmp_path / "dense"
    path.write_bytes(os.urandom(3 * BLOCK + 5))

    def no_lseek(*a):
        raise AssertionError("a dense file was probed for holes")

    monkeypatch.setattr(os, "lseek", no_lseek)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert data_map(fd) == DataMap(0, 3 * BLOCK + 5, None)
    finally:
        os.close(fd)
    assert hash_file(path)[0] == hash_file(path, window_bytes=BLOCK)[0]


def test_data_map_runs_of_a_range():
    m = DataMap(0, 100, ((10, 20), (30, 40)))
    assert list(m.runs(15, 35)) == [(15, 20, True), (20, 30, False), (30, 35, True)]
    assert list(m.runs(0, 10)) == [(0, 10, False)]
    assert list(m.runs(40, 100)) == [(40, 100, False)]
    assert m.data_bytes(0, 100) == 20 and m.data_pieces(0, 100) == 2
    assert list(DataMap(0, 100, None).runs(5, 7)) == [(5, 7, True)]


def _allocated(root) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.iterdir() if p.is_file())


def _logical(root) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def sparse_pipeline(tmp_path_factory):
    """A sparse container with full-size GLM-5.2 g64 experts in many files, its manifest, a plan and a rewrite."""
    root = tmp_path_factory.mktemp("sparse")
    g = load_geometry("glm-5.2-int4-g64").scaled(moe_layers=4, experts=32, vocab=2048, shard_bytes=200_000_000)
    src = synth_container(root / "src", g, seed=5, progress=False, sparse=True)
    write_manifest(build_manifest(Container.open(src), progress=False), src / MANIFEST_NAME)
    c = Container.open(src)
    tr = synth_trace(g.moe_layers, g.n_routed_experts, g.num_experts_per_tok, 600, 6, seed=3)
    plan_path = root / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), method="heat", pack=PackOptions(shard_bytes=400_000_000),
                        progress=False), plan_path)
    dst = root / "dst"
    apply_plan(src, load_plan(plan_path), dst, None, force=True, progress=False)
    return dict(root=root, src=src, dst=dst, geometry=g, container=c)


def test_sparse_synth_is_the_true_geometry_with_holes(sparse_pipeline):
    src, g, c = sparse_pipeline["src"], sparse_pipeline["geometry"], sparse_pipeline["container"]
    r = c.report()
    assert r["problems"] == [] and r["files"] >= 10
    assert r["bytes_per_expert"] == {"int4-g64": {str(g.expert_bytes(3)): 4 * 32}, "int8-row": {str(g.expert_bytes(7)): 32}}
    assert _logical(src) > 4e9 and _allocated(src) < _logical(src) / 100
    # every tensor starts with its stamp and is zeros after it
    name = "model.layers.4.mlp.experts.7.up_proj.weight"
    ref = c.tensors[name]
    with open(c.files[ref.file], "rb") as fh:
        fh.seek(ref.entry.begin)
        head = fh.read(STAMP_BYTES + 8192)
    assert not is_zero(head[:STAMP_BYTES]) and is_zero(head[STAMP_BYTES:])


def test_sparse_rewrite_stays_sparse_and_verifies(sparse_pipeline):
    src, dst = sparse_pipeline["src"], sparse_pipeline["dst"]
    assert len(Container.open(dst).files) >= 10
    assert _logical(dst) > 4e9
    assert _allocated(dst) < _logical(dst) / 100, "the rewrite filled in the source's holes"
    problems, summary = verify(src, dst, progress=False)
    assert problems == [] and summary["src_content_fingerprint"] == summary["dst_content_fingerprint"]
    # the rewrite's digests are the ones a fresh hash of DST gives (holes hashed as zeros)
    assert cli("manifest", str(dst), "--check").returncode == 0
    assert cli("inspect", str(dst)).returncode == 0


def test_verify_catches_a_flip_in_data_and_in_a_hole(sparse_pipeline, tmp_path):
    src, dst0 = sparse_pipeline["src"], sparse_pipeline["dst"]
    dst = tmp_path / "dst"
    shutil.copytree(dst0, dst, copy_function=_sparse_copy)
    c = Container.open(dst)
    name = "model.layers.5.mlp.experts.3.gate_proj.weight"
    ref = c.tensors[name]
    path = c.files[ref.file]
    for offset, label in ((ref.entry.begin + 100, "data"), (ref.entry.begin + ref.nbytes // 2, "hole")):
        with open(path, "r+b") as fh:
            fh.seek(offset)
            old = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([old[0] ^ 0x40]))
        problems, _ = verify(src, dst, full=True, progress=False)
        assert any(name in p and "bytes differ" in p for p in problems), (label, problems)
        assert f"tensor {name}: byte comparison differs" in problems, (label, problems)
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(old)
    assert verify(src, dst, full=True, progress=False)[0] == []


def test_full_byte_compare_of_sparse_and_dense_copies(tmp_path):
    """A dense copy of a sparse container: same digests, and verify --full finds it equal (holes vs written zeros)."""
    g = small_geometry(moe_layers=2, experts=16, hidden=1024, ffn=512)
    src = synth_container(tmp_path / "src", g, seed=9, progress=False, sparse=True)
    dst = tmp_path / "dense"
    dst.mkdir()
    for p in src.iterdir():
        with open(p, "rb") as a, open(dst / p.name, "wb") as b:
            shutil.copyfileobj(a, b, 16 << 20)   # every zero written: no holes
    assert _allocated(src) < _logical(src) / 2 and _allocated(dst) >= _logical(dst) * 0.99
    ms, md = build_manifest(Container.open(src), progress=False), build_manifest(Container.open(dst), progress=False)
    assert ms["fingerprint"] == md["fingerprint"] and ms["tensors"] == md["tensors"]
    write_manifest(md, dst / MANIFEST_NAME)
    problems = verify(src, dst, full=True, progress=False)[0]
    assert not [p for p in problems if "differ" in p], problems


def _sparse_copy(a, b):
    """Copy a file keeping its holes (data runs only)."""
    fd = os.open(a, os.O_RDONLY)
    try:
        dmap = data_map(fd)
        with open(b, "wb") as out:
            for x, y, is_data in dmap.runs(0, dmap.end):
                if is_data:
                    out.seek(x)
                    out.write(os.pread(fd, y - x, x))
            out.truncate(dmap.end)
    finally:
        os.close(fd)


def test_offsets_beyond_4_gib_are_hashed_recorded_and_checked(tmp_path):
    """A sparse shard over 2**32 bytes: offsets past 4 GiB in the header, the manifest and the check."""
    g = load_geometry("glm-5.2-int4-g64").scaled(moe_layers=1, experts=256, vocab=2048, shard_bytes=8_000_000_000)
    src = synth_container(tmp_path / "big", g, seed=2, progress=False, sparse=True)
    c = Container.open(src)
    far = max(c.tensors.values(), key=lambda t: t.entry.end)
    assert far.entry.begin > 2**32 and _allocated(src) < _logical(src) / 100
    m = build_manifest(c, progress=False)
    write_manifest(m, src / MANIFEST_NAME)
    assert m["tensors"][far.entry.name]["offset"] == far.entry.begin
    assert cli("manifest", "--check", str(src)).returncode == 0
    path = c.files[far.file]
    with open(path, "r+b") as fh:               # one byte in the far tensor's hole
        fh.seek(far.entry.begin + far.nbytes - 3)
        fh.write(b"\x01")
    res = cli("manifest", "--check", str(src))
    assert res.returncode == 2 and f"tensor {far.entry.name} ({path.name}): hash differs" in res.stdout
