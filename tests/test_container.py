"""The container model indexes experts, infers formats, finds straddlers, and refuses bad containers."""

import json
import struct

import pytest
from conftest import cli, small_geometry, tree_state

from containers.container import Container, expert_tensor_name, infer_format
from containers.errors import InputError
from containers.geometry import ExpertFormat, load_geometry
from containers.safetensors_io import read_header
from containers.synth import synth_container


@pytest.mark.parametrize(
    "name, layer, nbytes",
    [
        ("glm-5.2-int4-row", 3, 18_915_328),
        ("glm-5.2-int4-g64", 3, 21_233_664),
        ("glm-5.2-int4-g64", 78, 37_789_696),
        ("qwen3-30b-a3b", 0, 2_373_632),
    ],
)
def test_full_size_expert_bytes_match_the_runtime(name, layer, nbytes):
    assert load_geometry(name).expert_bytes(layer) == nbytes


def test_routed_totals_match_facts():
    row = load_geometry("glm-5.2-int4-row")
    assert round(sum(row.expert_bytes(l) * 256 for l in row.moe_layers) / 1e9, 1) == 363.2
    assert row.moe_layers == list(range(3, 78)) and row.mtp_layer_ids == [78]


@pytest.mark.parametrize("fmt", ["int4-row", "int4-g64", "int4-g32", "int8-row", "int8-g128"])
def test_format_inference_inverts_the_size_rules(fmt):
    f = ExpertFormat.parse(fmt)
    H, F = 6144, 2048
    w = {"gate": f.weight_bytes(F, H), "up": f.weight_bytes(F, H), "down": f.weight_bytes(H, F)}
    s = {"gate": 4 * f.scale_count(F, H), "up": 4 * f.scale_count(F, H), "down": 4 * f.scale_count(H, F)}
    assert infer_format(w, s, H, F) == fmt
    w["down"] += 1
    assert infer_format(w, s, H, F) is None


def test_small_container_report(small_container):
    g = small_geometry()
    c = Container.open(small_container)
    r = c.report()
    assert r["problems"] == []
    assert r["moe_layers"] == [3, 4, 5] and r["mtp_layers"] == [6]
    assert r["experts_per_layer"] == {str(l): 16 for l in (3, 4, 5, 6)}
    assert r["routed_experts"] == 64
    assert r["bytes_per_expert"]["int4-g64"] == {str(g.expert_bytes(3)): 48}
    assert r["bytes_per_expert"]["int8-row"] == {str(g.expert_bytes(6)): 16}
    assert r["routed_bytes"] == 48 * g.expert_bytes(3) + 16 * g.expert_bytes(6)
    # the converter layout: straddlers exist, and each one really has weights in two files
    assert 0 < r["off_fast_path_experts"] < 64
    for e in c.experts.values():
        files = {ref.file for ref in e.weights.values()}
        assert e.fast_path == (len(files) == 1)
        assert all(ref.entry.dtype == "F32" for ref in e.scales.values())
    # scales live in the F32 region, before the U8 weights of their shard
    e = c.experts[(3, 0)]
    if e.scales["gate"].file == e.weights["gate"].file:
        assert e.scales["gate"].entry.begin < e.weights["gate"].entry.begin


def test_synth_is_deterministic_by_seed(tmp_path):
    g = small_geometry(moe_layers=1)
    synth_container(tmp_path / "a", g, seed=3, progress=False)
    synth_container(tmp_path / "b", g, seed=3, progress=False)
    synth_container(tmp_path / "c", g, seed=4, progress=False)
    a = {k: v[2] for k, v in tree_state(tmp_path / "a").items()}
    b = {k: v[2] for k, v in tree_state(tmp_path / "b").items()}
    c = {k: v[2] for k, v in tree_state(tmp_path / "c").items()}
    assert a == b and a != c


def test_qwen_geometry_has_no_dense_layers(tmp_path):
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=2, experts=8, hidden=256, ffn=64, vocab=64, shard_bytes=10**6)
    synth_container(tmp_path / "q", g, progress=False)
    r = Container.open(tmp_path / "q").report()
    assert r["moe_layers"] == [0, 1] and r["mtp_layers"] == [] and r["problems"] == []


def _rewrite_header(path, mutate):
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    hdr = json.loads(blob[8:8 + n])
    mutate(hdr)
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(raw) <= n, "test helper keeps the header length"
    raw += b" " * (n - len(raw))
    path.write_bytes(blob[:8] + raw + blob[8 + n:])


def test_duplicate_tensor_across_files_is_an_error(container_copy):
    shards = sorted(container_copy.glob("out-0*.safetensors"))
    name = min(read_header(shards[0]).tensors, key=len)
    victim = max(read_header(shards[1]).tensors, key=len)
    _rewrite_header(shards[1], lambda h: h.__setitem__(name, h.pop(victim)))
    with pytest.raises(InputError, match="appears in both") as exc:
        Container.open(container_copy)
    assert shards[0].name in str(exc.value) and shards[1].name in str(exc.value)


def test_missing_config_is_an_error(container_copy):
    (container_copy / "config.json").unlink()
    with pytest.raises(InputError, match="config.json"):
        Container.open(container_copy)


def test_too_many_files_is_an_error(container_copy):
    n = len(list(container_copy.glob("*.safetensors")))
    for i in range(513 - n):
        (container_copy / f"zz-{i:04d}.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match="at most 512"):
        Container.open(container_copy)


def test_expert_missing_a_tensor_is_a_problem_and_inspect_exits_2(container_copy):
    victim = expert_tensor_name(4, 5, "up")
    for shard in container_copy.glob("*.safetensors"):
        if victim in read_header(shard).tensors:
            _rewrite_header(shard, lambda h: h.pop(victim))
    c = Container.open(container_copy)
    assert any("4.5 is missing" in p and victim in p for p in c.problems)
    with pytest.raises(InputError, match="missing"):
        c.require_clean()
    res = cli("inspect", container_copy)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_unknown_dtype_gives_one_line_exit_2_and_leaves_files_untouched(container_copy):
    shard = sorted(container_copy.glob("out-0*.safetensors"))[0]
    name = next(iter(read_header(shard).tensors))
    _rewrite_header(shard, lambda h: h[name].__setitem__("dtype", "Q8"))
    before = tree_state(container_copy)
    res = cli("inspect", container_copy)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "unknown dtype" in res.stderr and shard.name in res.stderr
    assert "Traceback" not in res.stderr
    assert tree_state(container_copy) == before


def test_truncated_shard_is_named(container_copy):
    shard = sorted(container_copy.glob("out-0*.safetensors"))[1]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 10)
    res = cli("inspect", container_copy)
    assert res.returncode == 2 and shard.name in res.stderr and "truncated" in res.stderr
