"""Hardening: hostile headers, configs and manifests are one clean error, never a crash
or a hang; verify notices every manifest field and every non-tensor file; split containers say
they need a split-aware runtime."""

import json
import struct
import time

import pytest
from conftest import cli, fuzz_examples

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
    assert_one_line_exit_2(cli(*args), shard.name)


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
    assert_one_line_exit_2(cli("inspect", container_copy), "config.json")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000, "\xff\xfe{}", "{} x", ""],
                         ids=["deep-array", "deep-object", "not-utf8", "trailing", "empty"])
def test_unparsable_config_is_an_error_naming_config_json(container_copy, text):
    p = container_copy / "config.json"
    p.write_bytes(text.encode("latin-1"))
    with pytest.raises(InputError, match="config.json") as exc:
        Container.open(container_copy)
    assert "\n" not in str(exc.value)
    assert_one_line_exit_2(cli("inspect", container_copy), "config.json")


def test_config_far_from_the_tensors_is_problems_not_work(container_copy):
    # the largest plausible numbers: still linear in the tensors present, and reported as problems
    _set_config(container_copy, num_hidden_layers=4096, first_k_dense_replace=3, n_routed_experts=4096, num_experts_per_tok=8)
    t0 = time.perf_counter()
    c = Container.open(container_copy)
    c.report()
    assert time.perf_counter() - t0 < 5
    assert any("config.json says 4096" in p for p in c.problems)


# ------------------------------------------------------------------ 3-4. manifests and verify

import copy  # noqa: E402
import shutil  # noqa: E402

from conftest import REPO, small_geometry, source_with_manifest  # noqa: E402

from containers import verify as verify_module  # noqa: E402
from containers.container import MANIFEST_NAME  # noqa: E402
from containers.manifest import build_manifest, load_manifest  # noqa: E402
from containers.verify import verify_containers  # noqa: E402


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """A source with its manifest, a faithful rewrite of it and a split rewrite of it."""
    from relayout.workflows.apply import apply_plan
    from relayout.planning.plan import SplitOptions, make_plan, source_from_container
    from relayout.traces.synth import synth_trace
    from replay.formats.planfile import load_plan, save_plan

    root = tmp_path_factory.mktemp("hardening")
    g = small_geometry(moe_layers=2, experts=16, ffn=256)
    src = source_with_manifest(root / "src", g, seed=5)
    tr = synth_trace(g.moe_layers, 16, 8, 400, 4, seed=1, geometry=g.name)
    out = {"src": src}
    for name, split in (("dst", None), ("split", SplitOptions(0.25, 2_000_000))):
        save_plan(make_plan(tr, source_from_container(src), split=split, progress=False), root / f"{name}.json")
        out[name] = root / name
        apply_plan(src, load_plan(root / f"{name}.json"), out[name], None, force=True, progress=False)
    return out


def _copy(path, tmp_path, name="d"):
    dst = tmp_path / name
    shutil.copytree(path, dst)
    return dst


def _edit_manifest(root, mutate):
    p = root / MANIFEST_NAME
    m = json.loads(p.read_text())
    mutate(m)
    p.write_text(json.dumps(m))


def test_rewrites_verify_clean_and_say_whether_they_need_a_split_runtime(rewritten):
    problems, summary = verify_containers(rewritten["src"], rewritten["dst"], progress=False)
    assert problems == [] and summary["needs_split_runtime"] is False and summary["split_experts"] == 0
    r = Container.open(rewritten["dst"]).report()
    assert r["needs_split_runtime"] is False and r["split_experts"] == 0
    problems, summary = verify_containers(rewritten["src"], rewritten["split"], full=True, progress=False)
    c = Container.open(rewritten["split"])
    assert problems == [] and summary["needs_split_runtime"] is True and summary["split_experts"] == len(c.experts) == 3 * 16
    r = c.report()
    assert r["needs_split_runtime"] is True and r["split_experts"] == 3 * 16 and r["problems"] == []
    assert Container.open(rewritten["src"]).report()["needs_split_runtime"] is False
    # the fresh manifest of a split container names the real formats, as its recorded one does
    assert build_manifest(c, progress=False)["geometry"] == load_manifest(rewritten["split"] / MANIFEST_NAME)["geometry"]


@pytest.mark.parametrize("mutate, words", [
    (lambda m: m["tensors"][sorted(m["tensors"])[0]].__setitem__("nbytes_", m["tensors"][sorted(m["tensors"])[0]].pop("nbytes")), ["lacks 'nbytes'"]),
    (lambda m: m["tensors"][sorted(m["tensors"])[3]].__setitem__("offset", "12"), ["offset must be a non-negative integer"]),
    (lambda m: m["files"][0].pop("xxh3_128"), ["files[0] lacks 'xxh3_128'"]),
    (lambda m: m["files"][1].__setitem__("size", -1), ["files[1].size"]),
    (lambda m: m["geometry"].pop("hidden_size"), ["geometry lacks 'hidden_size'"]),
    (lambda m: m.__setitem__("tensors", []), ["tensors must be an object"]),
    (lambda m: m.__setitem__("fingerprint", "xyz"), ["fingerprint"]),
    (lambda m: m["files"].append(dict(m["files"][0])), ["listed twice"]),
    (lambda m: m["tensors"][sorted(m["tensors"])[0]].__setitem__("file", "nope.safetensors"), ["not a safetensors file"]),
    (lambda m: m.__setitem__("rewrite", {"forced": "no"}), ["rewrite.forced"]),
    (lambda m: m.__setitem__("x", "[" * 100_000), []),
], ids=["renamed-nbytes", "string-offset", "no-file-hash", "negative-size", "no-hidden", "tensors-list", "bad-fingerprint",
        "file-twice", "unknown-file", "forced-string", "harmless-extra-key"])
def test_malformed_dst_manifest_is_one_line_naming_the_key(rewritten, tmp_path, mutate, words):
    dst = _copy(rewritten["dst"], tmp_path)
    _edit_manifest(dst, mutate)
    res = cli("verify", rewritten["src"], dst)
    if not words:
        assert res.returncode == 0, res.stderr
        return
    assert_one_line_exit_2(res, MANIFEST_NAME, *words)
    with pytest.raises(InputError):
        load_manifest(dst / MANIFEST_NAME)


def test_deeply_nested_manifest_is_an_input_error(tmp_path):
    p = tmp_path / MANIFEST_NAME
    p.write_text('{"format": "relayout.manifest", "version": 1, "files": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(InputError, match="manifest") as exc:
        load_manifest(p)
    assert MANIFEST_NAME in str(exc.value) and "\n" not in str(exc.value)


def test_verify_compares_every_non_tensor_file_with_src(rewritten, tmp_path):
    dst = _copy(rewritten["dst"], tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_experts_per_tok"] == 8
    cfg["num_experts_per_tok"] = 4
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "tokenizer.json").unlink()
    (dst / "notes.txt").write_text("extra")
    assert cli("manifest", dst).returncode == 0
    problems, _ = verify_containers(rewritten["src"], dst, progress=False)
    assert "file config.json: content differs from SRC's (xxh3-128)" in problems
    assert "file tokenizer.json: in SRC but missing from DST" in problems
    assert "file notes.txt: in DST but not in SRC" in problems
    res = cli("verify", rewritten["src"], dst)
    assert res.returncode == 2 and "config.json" in res.stdout and "tokenizer.json" in res.stdout


def _leaves(obj, path=()):
    """Every (path, value) leaf of a JSON value; dict keys are leaves too (path ends with ("key",))."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + ((k, "key"),), k
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj and not all(isinstance(x, int) for x in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path, obj


def _flipped(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        if len(value) == 32 and all(c in "0123456789abcdef" for c in value):
            return ("1" if value[0] != "1" else "2") + value[1:]
        if value == "safetensors":
            return "other"
        if value == "other":
            return "safetensors"
        if value in ("rows", "columns", "shared"):
            return {"rows": "columns", "columns": "rows", "shared": "rows"}[value]
        if value in ("U8", "I8", "F32", "BF16"):
            return {"U8": "I8", "I8": "U8", "F32": "I32", "BF16": "F16"}[value]
        if value.startswith("int4-") or value.startswith("int8-"):
            return value.replace("int4", "int9").replace("int8", "int4").replace("int9", "int8")
        return value + "x"
    if value is None:
        return 0
    if isinstance(value, list):
        return value + [1] if value else [1]
    raise AssertionError(value)


def _apply_flip(m, path):
    *parents, last = path
    node = m
    for p in parents:
        node = node[p]
    if isinstance(last, tuple):  # rename a key
        key = last[0]
        node[_flipped(key) if not key.endswith(".top") else key[:-4] + ".bottom"] = node.pop(key)
    else:
        node[last] = _flipped(node[last])


# Fields of a manifest that verify deliberately does not check, and why: they record how DST was
# made (tool, plan, gate, override) and which file layout it was made from; verify proves that DST
# holds SRC's tensors and files and can be loaded, which none of them affects.
PROVENANCE_ONLY = {"tool_version", "plan_digest", "plan_method", "gate_digest", "gate_verdict", "forced",
                   "override_reason", "source_fingerprint"}


def _sample_paths(m):
    """Every field of the manifest, with the tensor, file and segment entries thinned to a few of each kind."""
    tensors = sorted(m["tensors"])
    keep_t = set(tensors[:2] + tensors[-2:] + [t for t in tensors if ".experts.5." in t][:3] + [t for t in tensors if t.endswith(".qs.bottom")][:1])
    segs = sorted(m.get("segments", {}))
    keep_s = {s for s in segs if s.endswith("down_proj.weight.qs")}
    keep_s = set(sorted(keep_s)[:1] + segs[:1] + [s for s in segs if s.endswith("down_proj.weight")][:1])
    keep_f = {0, 1, len(m["files"]) - 1}
    for path, _ in _leaves(m):
        head = path[0]
        if head == "tensors" and len(path) > 1 and (path[1][0] if isinstance(path[1], tuple) else path[1]) not in keep_t:
            continue
        if head == "segments" and len(path) > 1 and (path[1][0] if isinstance(path[1], tuple) else path[1]) not in keep_s:
            continue
        if head == "files" and len(path) > 1 and path[1] not in keep_f:
            continue
        if isinstance(path[-1], tuple) and path[-1][0] in m and len(path) == 1:
            continue  # renaming a top-level key is the "missing key" case, tested above
        if isinstance(path[-1], tuple) and len(path) >= 2 and path[-2] in ("geometry", "rewrite") or (
                isinstance(path[-1], tuple) and len(path) == 3 and path[0] in ("files", "tensors", "segments")):
            continue  # a renamed field: the schema check (test above)
        yield path


@pytest.fixture
def cached_fresh_manifests(monkeypatch):
    """The containers do not change while only DST's recorded manifest is flipped: hash each once."""
    cache = {}
    real = verify_module.build_manifest

    def build(container, progress=True):
        key = str(container.root)
        if key not in cache:
            cache[key] = real(container, progress=progress)
        return copy.deepcopy(cache[key])

    monkeypatch.setattr(verify_module, "build_manifest", build)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dst", "split"])
def test_manifest_flips_every_field_is_noticed_by_verify(rewritten, tmp_path, cached_fresh_manifests, which):
    """Flip each field of DST's recorded manifest, one at a time: verify must report it (a problem
    or a one-line InputError), unless the field is provenance only (PROVENANCE_ONLY)."""
    dst = _copy(rewritten[which], tmp_path)
    good = json.loads((dst / MANIFEST_NAME).read_text())
    assert verify_containers(rewritten["src"], dst, progress=False)[0] == []
    missed, checked = [], 0
    for path in _sample_paths(good):
        m = copy.deepcopy(good)
        _apply_flip(m, path)
        (dst / MANIFEST_NAME).write_text(json.dumps(m))
        try:
            problems, _ = verify_containers(rewritten["src"], dst, progress=False)
        except InputError as exc:
            assert "\n" not in str(exc)
            problems = [str(exc)]
        checked += 1
        field = path[-1][0] if isinstance(path[-1], tuple) else path[-1]
        if path[0] == "rewrite" and field in PROVENANCE_ONLY:
            assert problems == [], (path, problems)
        elif not problems:
            missed.append(path)
    assert checked > 60 and missed == [], missed


# ------------------------------------------------------------------ 5. property tests: fuzzed headers, configs, manifests

import jsonschema  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from containers.manifest import compare_manifests, manifest_problem  # noqa: E402
from containers.synth import synth_container  # noqa: E402

FUZZ = settings(max_examples=fuzz_examples(150), deadline=None, suppress_health_check=list(HealthCheck))

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.one_of(st.characters(), surrogates), max_size=12) | st.sampled_from(
    ["", "__metadata__", "dtype", "shape", "data_offsets", "model.layers.3.mlp.experts.0.gate_proj.weight",
     "model.layers.3.mlp.experts.0.up_proj.weight.qs.top", "model.layers.03.mlp.experts.1.down_proj.weight"])
ints = st.one_of(st.integers(-3, 70_000), st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True), texts,
                    st.sampled_from(["U8", "I8", "F32", "BF16", "F8_E4M3", "Q8"]))
json_values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(texts, ch, max_size=4), max_leaves=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A complete container of ~350 KB in 14 shards: fast enough to open hundreds of times."""
    root = tmp_path_factory.mktemp("tiny") / "c"
    synth_container(root, small_geometry(moe_layers=1, experts=8, hidden=64, ffn=64, vocab=16, shard_bytes=30_000), seed=1, progress=False)
    assert Container.open(root).problems == []
    return root


def open_report_manifest(root):
    """Container.open, report and build_manifest either succeed (JSON-ready output whose manifest
    passes our own schema check) or raise one-line InputError; never another exception, never slow."""
    t0 = time.perf_counter()
    try:
        c = Container.open(root)
        for h in c.headers:  # what the safetensors library would also accept
            for t in h.tensors.values():
                t.name.encode("utf-8")
                assert all(d < 2**63 for d in t.shape) and t.begin <= t.end <= h.file_size
            for k, v in h.metadata.items():
                k.encode("utf-8"), v.encode("utf-8")
        assert c.config.num_hidden_layers <= 4096 and c.config.n_routed_experts <= 4096
        r = c.report()
        json.dumps(r)
        m = build_manifest(c, progress=False)
        json.loads(json.dumps(m))
        assert manifest_problem(m) is None, manifest_problem(m)
    except InputError as exc:
        assert "\n" not in str(exc) and str(exc)
    assert time.perf_counter() - t0 < 5


def _paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, path + (i,))


def _mutate_json(obj, draw):
    """One random structural edit of a JSON value: replace a node, delete or add a key, rename a key."""
    paths = list(_paths(obj))
    path = paths[draw(st.integers(0, len(paths) - 1))]
    op = draw(st.sampled_from(["set", "delete", "add", "rename"]))
    if not path:
        return draw(json_values) if op == "set" else obj
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "set":
        parent[last] = draw(json_values)
    elif op == "delete":
        parent.pop(last)
    elif op == "add" and isinstance(parent, dict):
        parent[draw(texts)] = draw(json_values)
    elif op == "add":
        parent.insert(last, draw(json_values))
    elif op == "rename" and isinstance(parent, dict):
        parent[draw(texts)] = parent.pop(last)
    return obj


def _shards(root):
    return sorted(root.glob("*.safetensors"))


class _Restore:
    """Mutate one file for one example and put its exact bytes back afterwards."""

    def __init__(self, path):
        self.path, self.blob = path, path.read_bytes()

    def __enter__(self):
        return self.blob

    def __exit__(self, *exc):
        self.path.write_bytes(self.blob)


@FUZZ
@given(data=st.data())
def test_fuzzed_header_bytes_are_clean_errors_or_valid(tiny, data):
    shard = data.draw(st.sampled_from(_shards(tiny)))
    with _Restore(shard) as blob:
        n = struct.unpack("<Q", blob[:8])[0]
        buf = bytearray(blob)
        mode = data.draw(st.sampled_from(["bytes", "length", "cut", "insert"]))
        if mode == "bytes":
            for _ in range(data.draw(st.integers(1, 4))):
                buf[data.draw(st.integers(0, 8 + n - 1))] = data.draw(st.integers(0, 255))
        elif mode == "length":
            buf[:8] = struct.pack("<Q", data.draw(st.one_of(st.integers(0, len(blob) + 16), st.integers(0, 2**64 - 1))))
        elif mode == "cut":
            del buf[data.draw(st.integers(0, len(blob))):]
        else:
            at = data.draw(st.integers(8, 8 + n))
            ins = data.draw(st.sampled_from([b"\\ud800", b"\\udfff\\ud800", b"[", b"{", b"0", b",", b'"', b"\xed\xa0\x80", b"\xff"]))
            buf[at:at] = ins
            buf[:8] = struct.pack("<Q", n + len(ins))
        shard.write_bytes(bytes(buf))
        open_report_manifest(tiny)


def _header_of(blob):
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


@FUZZ
@given(data=st.data())
def test_fuzzed_header_json_is_clean_errors_or_valid(tiny, data):
    shard = data.draw(st.sampled_from(_shards(tiny)))
    with _Restore(shard) as blob:
        n, hdr = _header_of(blob)
        names = sorted(k for k in hdr if k != "__metadata__")
        for _ in range(data.draw(st.integers(1, 3))):
            kind = data.draw(st.sampled_from(["random", "shape", "offsets", "name", "metadata"]))
            name = data.draw(st.sampled_from(names))
            if kind == "random" or not isinstance(hdr, dict):
                hdr = _mutate_json(hdr, data.draw)
            elif kind == "shape" and isinstance(hdr.get(name), dict):
                hdr[name]["shape"] = data.draw(st.lists(ints, max_size=5))
            elif kind == "offsets" and isinstance(hdr.get(name), dict):
                hdr[name]["data_offsets"] = data.draw(st.lists(ints, min_size=2, max_size=2))
            elif kind == "name" and name in hdr:
                hdr[data.draw(texts)] = hdr.pop(name)
            elif kind == "metadata":
                hdr["__metadata__"] = data.draw(st.dictionaries(texts, st.one_of(texts, json_values), max_size=3))
        raw = json.dumps(hdr, allow_nan=True).encode()  # ensure_ascii: surrogates stay \udXXX escapes
        shard.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
        open_report_manifest(tiny)


CONFIG_KEYS = ["hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts", "num_local_experts",
               "num_experts_per_tok", "num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers"]


@FUZZ
@given(data=st.data())
def test_fuzzed_config_is_clean_errors_or_valid(tiny, data):
    path = tiny / "config.json"
    with _Restore(path) as blob:
        cfg = json.loads(blob)
        mode = data.draw(st.sampled_from(["keys", "keys", "random", "document", "nesting"]))
        if mode == "keys":
            for key in data.draw(st.lists(st.sampled_from(CONFIG_KEYS), min_size=1, max_size=4)):
                if data.draw(st.booleans()):
                    cfg[key] = data.draw(st.one_of(ints, st.integers(0, 5000), json_values))
                else:
                    cfg.pop(key, None)
            text = json.dumps(cfg, allow_nan=True)
        elif mode == "random":
            text = json.dumps(_mutate_json(cfg, data.draw), allow_nan=True)
        elif mode == "document":
            text = json.dumps(data.draw(json_values), allow_nan=True)
        else:
            depth = data.draw(st.integers(1, 200_000))
            key = data.draw(st.sampled_from(CONFIG_KEYS))
            text = json.dumps({**cfg, key: None}).replace("null", "[" * depth + "]" * depth)
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        open_report_manifest(tiny)


MANIFEST_SCHEMA = json.loads((REPO / "manifests/schemas/manifest.schema.json").read_text())


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_is_an_input_error_or_schema_valid_and_comparable(tiny, tmp_path_factory, data):
    good = build_manifest(Container.open(tiny), progress=False)
    m = copy.deepcopy(good)
    for _ in range(data.draw(st.integers(1, 3))):
        m = _mutate_json(m, data.draw)
    p = tmp_path_factory.getbasetemp() / "fuzzed.manifest.json"
    p.write_text(json.dumps(m, allow_nan=True))
    try:
        loaded = load_manifest(p)
    except InputError as exc:
        assert "\n" not in str(exc) and str(p) in str(exc)
        return
    jsonschema.validate(loaded, MANIFEST_SCHEMA)  # the loader is never more lenient than the published schema
    compare_manifests(loaded, good)


def test_manifest_loader_and_schema_agree_on_what_we_write(rewritten):
    for root in (rewritten["src"], rewritten["dst"], rewritten["split"]):
        m = load_manifest(root / MANIFEST_NAME)
        jsonschema.validate(m, MANIFEST_SCHEMA)
        jsonschema.validate(build_manifest(Container.open(root), progress=False), MANIFEST_SCHEMA)


def test_header_must_start_with_a_brace(tmp_path):
    p = write_raw_header(tmp_path / "w.safetensors", ' {"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\x00")
    with pytest.raises(InputError, match="start with"):
        read_header(p)


def test_config_aliases_that_disagree_are_refused(container_copy):
    _set_config(container_copy, num_experts=17)
    with pytest.raises(InputError, match="n_routed_experts and num_experts disagree"):
        Container.open(container_copy)
    _set_config(container_copy, num_experts=16)
    assert Container.open(container_copy).problems == []


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_manifest_entry_edits_are_noticed_by_verify(rewritten, tmp_path_factory, cached_fresh_manifests, data):
    """Any other value in any field of any tensor or file entry of DST's manifest is reported."""
    dst = tmp_path_factory.getbasetemp() / "random-flips"
    if not dst.exists():
        shutil.copytree(rewritten["dst"], dst)
    good = json.loads((rewritten["dst"] / MANIFEST_NAME).read_text())
    m = copy.deepcopy(good)
    shards = [f["name"] for f in m["files"] if f["kind"] == "safetensors"]
    if data.draw(st.booleans()):
        entry = m["tensors"][data.draw(st.sampled_from(sorted(m["tensors"])))]
        field = data.draw(st.sampled_from(sorted(entry)))
        new = {"file": st.sampled_from(shards), "dtype": st.sampled_from(["U8", "I8", "F32", "F16", "I32"]),
               "shape": st.lists(st.integers(0, 5000), max_size=3), "offset": st.integers(0, 2**40),
               "nbytes": st.integers(0, 2**40), "xxh3_128": st.text("0123456789abcdef", min_size=32, max_size=32)}[field]
    else:
        entry = data.draw(st.sampled_from(m["files"]))
        field = data.draw(st.sampled_from(sorted(entry)))
        new = {"name": st.sampled_from([f["name"] for f in m["files"]] + ["x.json"]), "kind": st.sampled_from(["safetensors", "other"]),
               "size": st.integers(0, 2**40), "xxh3_128": st.text("0123456789abcdef", min_size=32, max_size=32)}[field]
    value = data.draw(new.filter(lambda v: v != entry[field]))
    entry[field] = value
    (dst / MANIFEST_NAME).write_text(json.dumps(m))
    try:
        problems, _ = verify_containers(rewritten["src"], dst, progress=False)
    except InputError as exc:
        problems = [str(exc)]
    assert problems, (field, value)


def test_a_remade_manifest_of_a_split_container_keeps_its_segment_map(rewritten, tmp_path):
    recorded = load_manifest(rewritten["split"] / MANIFEST_NAME)
    assert build_manifest(Container.open(rewritten["split"]), progress=False)["segments"] == recorded["segments"]
    assert "segments" not in build_manifest(Container.open(rewritten["dst"]), progress=False)
    dst = _copy(rewritten["split"], tmp_path)
    assert cli("manifest", dst).returncode == 0
    assert "rewrite" not in load_manifest(dst / MANIFEST_NAME)
    problems, summary = verify_containers(rewritten["src"], dst, progress=False)
    assert problems == [] and summary["split_tensors"] == len(recorded["segments"]) and summary["needs_split_runtime"]
