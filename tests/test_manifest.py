"""Manifests record every file and tensor, follow their schema, and name every mismatch."""

import json

import jsonschema
import xxhash
from conftest import REPO, cli, tree_state

from containers.container import MANIFEST_NAME, Container
from containers.hashing import Range, file_digest, hash_file
from containers.manifest import build_manifest, check_container, write_manifest


def test_manifest_matches_schema_and_real_hashes(small_container, tmp_path):
    m = build_manifest(Container.open(small_container), progress=False)
    schema = json.loads((REPO / "manifests/schemas/manifest.schema.json").read_text())
    jsonschema.validate(m, schema)
    for f in m["files"]:
        blob = (small_container / f["name"]).read_bytes()
        if f["kind"] == "other":
            assert f["xxh3_128"] == file_digest(len(blob), [xxhash.xxh3_128_digest(blob)])
    some = sorted(m["tensors"])[::97]
    for name in some:
        t = m["tensors"][name]
        blob = (small_container / t["file"]).read_bytes()[t["offset"]:t["offset"] + t["nbytes"]]
        assert t["xxh3_128"] == xxhash.xxh3_128_hexdigest(blob)
    assert {f["name"] for f in m["files"]} >= {"config.json", "tokenizer.json"}


def test_hash_file_handles_ranges_across_chunk_boundaries(tmp_path):
    p = tmp_path / "f.bin"
    data = bytes(range(256)) * 1001
    p.write_bytes(data)
    ranges = [Range("a", 0, 1), Range("b", 1, 4095), Range("c", 4095, 100_000), Range("d", 200_000, 256_000)]
    whole, parts = hash_file(p, ranges, window_bytes=4096)
    gaps = [data[100_000:200_000], data[256_000:]]
    segs = [data[r.begin:r.end] for r in ranges[:3]] + [gaps[0], data[200_000:256_000], gaps[1]]
    assert whole == file_digest(len(data), [xxhash.xxh3_128_digest(s) for s in segs])
    assert hash_file(p, ranges, window_bytes=1 << 20) == (whole, parts)
    for r in ranges:
        assert parts[r.name] == xxhash.xxh3_128_hexdigest(data[r.begin:r.end])


def test_fingerprints_are_stable(small_container):
    a = build_manifest(Container.open(small_container), progress=False)
    b = build_manifest(Container.open(small_container), progress=False)
    assert a["fingerprint"] == b["fingerprint"] and a["content_fingerprint"] == b["content_fingerprint"]


def test_check_names_the_flipped_tensor(container_copy):
    m = build_manifest(Container.open(container_copy), progress=False)
    write_manifest(m, container_copy / MANIFEST_NAME)
    assert check_container(container_copy, progress=False) == []
    name = "model.layers.4.mlp.experts.9.down_proj.weight"
    t = m["tensors"][name]
    path = container_copy / t["file"]
    blob = bytearray(path.read_bytes())
    blob[t["offset"] + t["nbytes"] // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    problems = check_container(container_copy, progress=False)
    assert any(p.startswith(f"tensor {name} ") for p in problems)
    assert any(p.startswith(f"file {t['file']}") for p in problems)
    assert len([p for p in problems if p.startswith("tensor")]) == 1
    res = cli("manifest", "--check", container_copy)
    assert res.returncode == 2 and name in res.stdout


def test_manifest_cli_writes_into_dir_and_touches_nothing_else(container_copy):
    before = tree_state(container_copy)
    res = cli("manifest", container_copy)
    assert res.returncode == 0, res.stderr
    after = tree_state(container_copy)
    assert set(after) - set(before) == {MANIFEST_NAME}
    assert all(after[k] == v for k, v in before.items())
    assert cli("manifest", "--check", container_copy).returncode == 0
