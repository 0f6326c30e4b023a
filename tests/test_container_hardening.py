"""Hardening (issue #10): hostile headers, configs and manifests are one clean error, never a crash
or a hang; verify notices every manifest field and every non-tensor file; split containers say
they need a split-aware runtime."""

import json
import struct
import time

import pytest

from conftest import run_cli
from containers.container import Container
from containers.errors import InputError
from containers.safetensors_io import read_header


def write_raw_header(path, header_text: str, data: bytes = b""):
    raw = header_text.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def replace_header(path, mutate):
    """Rewrite a shard's header through ``mutate(dict)``; offsets are relative, so the data stays valid."""
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    hdr = json.loads(blob[8:8 + n])
    hdr = mutate(hdr) or hdr
    raw = json.dumps(hdr, separators=(",", ":")).encode()  # ensure_ascii: lone surrogates stay \\udXXX escapes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def first_shard(root):
    return sorted(root.glob("*.safetensors"))[0]


def assert_one_line_exit_2(res, *words):
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("relayout: error: ")
    for w in words:
        assert w in res.stderr, res.stderr


# ------------------------------------------------------------------ 1. headers


@pytest.mark.parametrize("header", [
    '{"t\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    '{"\\udfff": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    '{"__metadata__": {"k\\ud800": "v"}, "t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    '{"__metadata__": {"k": "\\udbff"}, "t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
])
def test_lone_surrogate_escapes_are_refused(tmp_path, header):
    p = write_raw_header(tmp_path / "s.safetensors", header, b"\x00")
    with pytest.raises(InputError, match="UTF-8") as exc:
        read_header(p)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


def test_a_surrogate_pair_escape_is_a_valid_character(tmp_path):
    p = write_raw_header(tmp_path / "s.safetensors", '{"t\\ud83d\\ude00": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\x00")
    assert list(read_header(p).tensors) == ["t\U0001F600"]


@pytest.mark.parametrize("shape", [[0, 2**63], [2**63, 0], [0, 2**64 + 5], [0, 2**62, 4], [3, 0, 2**40, 2**40], [0, 10**30]])
def test_zero_size_tensors_with_huge_dimensions_are_refused(tmp_path, shape):
    hdr = {"z": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    p = write_raw_header(tmp_path / "z.safetensors", json.dumps(hdr))
    with pytest.raises(InputError, match="2\\*\\*63|overflows") as exc:
        read_header(p)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400


def test_zero_size_tensors_with_sane_dimensions_are_fine(tmp_path):
    hdr = {"z": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]},
           "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
           "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    p = write_raw_header(tmp_path / "z.safetensors", json.dumps(hdr), b"\x00" * 4)
    assert set(read_header(p).tensors) == {"z", "e", "t"}


def test_empty_tensor_inside_another_is_refused(tmp_path):
    hdr = {"t": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "e": {"dtype": "U8", "shape": [0], "data_offsets": [3, 3]}}
    p = write_raw_header(tmp_path / "e.safetensors", json.dumps(hdr), b"\x00" * 8)
    with pytest.raises(InputError, match="overlap"):
        read_header(p)


@pytest.mark.parametrize("mutate", [
    lambda h: h.__setitem__("model.layers.3.mlp.experts.0.gate_proj.weight\ud800", {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
    lambda h: h.__setitem__("__metadata__", {**h.get("__metadata__", {}), "\udc80": "x"}),
    lambda h: h.__setitem__("zero", {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}),
    lambda h: h.__setitem__("zero", {"dtype": "BF16", "shape": [2**64, 0, 3], "data_offsets": [0, 0]}),
])
@pytest.mark.parametrize("command", ["inspect", "manifest", "verify"])
def test_bad_headers_fail_inspect_manifest_and_verify_in_one_line(small_container, container_copy, mutate, command):
    shard = first_shard(container_copy)
    replace_header(shard, mutate)
    args = {"inspect": ["inspect", container_copy], "manifest": ["manifest", container_copy],
            "verify": ["verify", small_container, container_copy]}[command]
    assert_one_line_exit_2(run_cli(*args), shard.name)


def test_leading_zero_or_non_ascii_layer_numbers_are_not_experts(container_copy):
    # "layers.03" or an Arabic-Indic digit is another name to the runtime, not layer 3
    c = Container.open(container_copy)
    name = "model.layers.3.mlp.experts.0.gate_proj.weight"
    shard = c.files[c.tensors[name].file]
    for alias in (name.replace("layers.3.", "layers.03."), name.replace("layers.3.", "layers.\u0663."), name + "\n"):
        replace_header(shard, lambda h: h.__setitem__(alias, h.pop(name)))
        d = Container.open(container_copy)
        assert any("3.0 is missing" in p for p in d.problems), alias
        assert len(d.experts) == len(c.experts) - 1
        replace_header(shard, lambda h: h.__setitem__(name, h.pop(alias)))


# ------------------------------------------------------------------ 2. config.json


def _set_config(root, **changes):
    p = root / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=10**12), ["num_hidden_layers", "expected"]),
    (dict(num_hidden_layers=300_000_000), ["num_hidden_layers", "expected"]),
    (dict(num_hidden_layers=1e12), ["num_hidden_layers", "integer"]),
    (dict(num_hidden_layers=7.0), ["num_hidden_layers", "integer"]),
    (dict(num_hidden_layers=True), ["num_hidden_layers", "boolean"]),
    (dict(num_hidden_layers="7"), ["num_hidden_layers", "string"]),
    (dict(num_hidden_layers=None), ["num_hidden_layers", "null"]),
    (dict(n_routed_experts=10**6), ["n_routed_experts"]),
    (dict(n_routed_experts=0), ["n_routed_experts"]),
    (dict(hidden_size=10**9), ["hidden_size"]),
    (dict(moe_intermediate_size=-1), ["moe_intermediate_size"]),
    (dict(num_experts_per_tok=10**4), ["num_experts_per_tok"]),
    (dict(num_experts_per_tok=17), ["num_experts_per_tok", "exceeds"]),
    (dict(first_k_dense_replace=10**15), ["first_k_dense_replace"]),
    (dict(first_k_dense_replace=4000), ["first_k_dense_replace", "exceeds"]),
    (dict(num_nextn_predict_layers=10**8), ["num_nextn_predict_layers"]),
    (dict(hidden_size=10**5000), ["not valid JSON"]),
])
def test_implausible_config_numbers_are_one_line_errors_fast(container_copy, changes, words):
    if changes.get("hidden_size") == 10**5000:
        (container_copy / "config.json").write_text('{"hidden_size": 1' + "0" * 5000 + "}")
    else:
        _set_config(container_copy, **changes)
    t0 = time.perf_counter()
    with pytest.raises(InputError) as exc:
        Container.open(container_copy)
    assert time.perf_counter() - t0 < 2
    msg = str(exc.value)
    assert "config.json" in msg and "\n" not in msg and len(msg) < 300, msg
    for w in words:
        assert w in msg, msg
    assert_one_line_exit_2(run_cli("inspect", container_copy), "config.json")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "\xff\xfe{}", "{} x", ""],
                         ids=["deep-array", "deep-object", "not-utf8", "trailing", "empty"])
def test_unparsable_config_is_an_error_naming_config_json(container_copy, text):
    p = container_copy / "config.json"
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(InputError, match="config.json") as exc:
        Container.open(container_copy)
    assert "\n" not in str(exc.value)
    assert_one_line_exit_2(run_cli("inspect", container_copy), "config.json")


def test_config_far_from_the_tensors_is_problems_not_work(container_copy):
    # the largest plausible numbers: still linear in the tensors present, and reported as problems
    _set_config(container_copy, num_hidden_layers=4096, first_k_dense_replace=3, n_routed_experts=4096, num_experts_per_tok=8)
    t0 = time.perf_counter()
    c = Container.open(container_copy)
    c.report()
    assert time.perf_counter() - t0 < 5
    assert any("config.json says 4096" in p for p in c.problems)
