"""colibrì's own files around the tensors: format stamps, the model index, shard names, runtime files.

Small synthetic containers built to show each case: a stamped source (up to the runtime's 4096
stamped names, which a rewrite spreads over more shards), an indexed source, malformed stamps,
the runtime's side files. With ``RELAYOUT_COLIBRI_DIR`` naming a colibrì checkout, its
``coli doctor --deep`` must give SRC and DST the same status.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from conftest import cli, fuzz_examples, small_geometry
from hypothesis import given, settings
from hypothesis import strategies as st

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import ExpertFormat
from containers.manifest import build_manifest, manifest_problem, write_manifest
from containers.model_index import INDEX_NAME, read_index
from containers.output_files import OutputFile, check_output_files, tensor_specs
from containers.rewrite import rewrite_container
from containers.runtime_files import CARRIED, DROPPED, LEFT, runtime_files, ssd_device
from containers.safetensors_io import TensorSpec, plan_shard, read_header, write_shard
from containers.shard_metadata import (
    MAX_STAMPS,
    STAMP_KEY,
    carried_metadata,
    container_stamps,
    place_stamps,
    shard_stamps,
    stamp_text,
)
from containers.sources import FileRange
from containers.synth import colibri_format_name, synth_container
from relayout.workflows.apply import apply_plan, output_files, verify
from relayout.planning.packing import PackOptions
from relayout.planning.plan import SplitOptions, make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import load_plan, save_plan

GEOMETRY = dict(moe_layers=2, experts=16)


def restamp(path: Path, metadata: dict) -> None:
    """Write the shard at ``path`` again with ``metadata`` as its ``__metadata__`` (same tensors, same order)."""
    h = read_header(path)
    old = path.with_name(path.name + ".old")
    os.replace(path, old)
    specs = [TensorSpec(t.name, t.dtype, t.shape, FileRange(old, t.begin, t.nbytes), 1) for t in h.by_offset()]
    write_shard(path, specs, alignment=8, metadata=metadata)
    old.unlink()


def patch_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the shard's header: offsets stay the same."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    at = data.find(old, 8, 8 + n)
    assert at > 0, old
    data[at:at + len(old)] = new
    path.write_bytes(bytes(data))


def shard_of(c: Container) -> dict:
    return {name: c.files[ref.file].name for name, ref in c.tensors.items()}


def planned(src: Path, tmp: Path, shard_bytes: int = 700_000):
    g = small_geometry(**GEOMETRY)
    tr = synth_trace(g.moe_layers, g.n_routed_experts, g.num_experts_per_tok, 300, 6, seed=4, geometry=g.name)
    save_plan(make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=shard_bytes), progress=False), tmp)
    return load_plan(tmp)


# ---------------------------------------------------------------- stamps: parsing as the runtime does


def test_stamp_maps_the_runtime_refuses_are_refused_naming_the_shard():
    ok = shard_stamps("a.safetensors", {STAMP_KEY: '{"w": "int8-row", "v": "int4-grouped"}'})
    assert ok == {"w": "int8-row", "v": "int4-grouped"}
    assert shard_stamps("a.safetensors", {"format": "pt"}) == {}
    assert shard_stamps("a.safetensors", {STAMP_KEY: '{"w": "int8-row", "w": "int8-row"}'}) == {"w": "int8-row"}
    bad = [
        ("not JSON", "{w: 1}"),
        ("not a JSON object", '["w"]'),
        ("entry 'w' is not a string", '{"w": 8}'),
        ('"] is not a string', 7),                     # a plan's metadata is untrusted
        ("twice", '{"w": "int8-row", "w": "int4-row"}'),
        ("nested too deeply", "[" * 100000),
    ]
    for why, text in bad:
        with pytest.raises(InputError, match=re.escape(why)) as e:
            shard_stamps("out-00003.safetensors", {STAMP_KEY: text})
        assert e.value.where == "out-00003.safetensors" and "runtime refuses" in str(e.value)


def test_conflicting_claims_and_more_than_4096_names_are_refused():
    paths = ["out-00000.safetensors", "out-00001.safetensors"]
    # agreeing repeats in two shards count once; a shard may stamp a tensor it does not hold
    assert container_stamps(paths, [{STAMP_KEY: '{"w": "int8-row"}'}, {STAMP_KEY: '{"w": "int8-row"}'}]) == {"w": "int8-row"}
    with pytest.raises(InputError, match="out-00000.safetensors stamps it 'int8-row'") as e:
        container_stamps(paths, [{STAMP_KEY: '{"w": "int8-row"}'}, {STAMP_KEY: '{"w": "fp8-e4m3-b128"}'}])
    assert e.value.where == paths[1]
    many = {f"t{i}": "int8-row" for i in range(MAX_STAMPS)}
    half = dict(list(many.items())[: MAX_STAMPS // 2])
    assert len(container_stamps(paths, [{STAMP_KEY: stamp_text(half)}, {STAMP_KEY: stamp_text(many)}])) == MAX_STAMPS
    with pytest.raises(InputError, match="more than 4096 tensor names") as e:
        container_stamps(paths, [{STAMP_KEY: stamp_text(many)}, {STAMP_KEY: '{"one more": "int8-row"}'}])
    assert e.value.where == paths[1]


def test_a_source_with_a_malformed_stamp_map_is_refused(tmp_path):
    src = tmp_path / "src"
    synth_container(src, small_geometry(**GEOMETRY), seed=1, progress=False)
    shard = sorted(src.glob("out-0*.safetensors"))[1]
    restamp(shard, {"format": "pt", STAMP_KEY: '{"model.norm.weight": 4}'})
    r = cli("inspect", src)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and shard.name in r.stderr and "is not a string" in r.stderr


@settings(max_examples=fuzz_examples(100), deadline=None)
@given(st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
                       st.sampled_from(["int8-row", "int4-row", "int4-grouped", "fp8-e4m3-b128", "f32"]), max_size=20))
def test_a_written_stamp_map_reads_back_from_the_shard_header(tmp_path_factory, stamps):
    path = tmp_path_factory.mktemp("stamp") / "out-00000.safetensors"
    write_shard(path, [TensorSpec("w", "U8", (3,), FileRange(Path(__file__), 0, 3))], metadata={STAMP_KEY: stamp_text(stamps)})
    assert shard_stamps(path, read_header(path).metadata) == stamps


@settings(max_examples=fuzz_examples(60), deadline=None)
@given(st.data())
def test_each_stamp_goes_to_the_shard_storing_its_tensor(data):
    names = [f"t{i}" for i in range(data.draw(st.integers(1, 30)))]
    n_files = data.draw(st.integers(1, 5))
    split = set(data.draw(st.lists(st.sampled_from(names), unique=True)))
    stored: list[list[str]] = [[] for _ in range(n_files)]
    original_of = {}
    for name in names:
        parts = [f"{name}.top", f"{name}.bottom"] if name in split else [name]
        for part in parts:
            stored[data.draw(st.integers(0, n_files - 1))].append(part)
            if part != name:
                original_of[part] = name
    stamped = data.draw(st.lists(st.sampled_from(names + ["ghost.a", "ghost.b"]), unique=True))
    stamps = {n: data.draw(st.sampled_from(["int8-row", "int4-grouped", "fp8-e4m3-b128"])) for n in stamped}
    per_file = place_stamps(stamps, stored, original_of)
    assert len(per_file) == n_files
    union = {}
    for i, m in enumerate(per_file):
        assert not union.keys() & m.keys()          # each stamp once
        union.update(m)
        for name in m:
            holders = [j for j, files in enumerate(stored) if name in files or f"{name}.top" in files or f"{name}.bottom" in files]
            assert i == (holders[0] if holders else 0)  # the (first) shard storing it, else the first shard
    assert union == stamps


def test_container_wide_keys_are_kept_and_per_shard_keys_dropped():
    metas = [{"format": "pt", "part": "1", STAMP_KEY: "{}", "relayout.layout": "x"},
             {"format": "pt", "part": "2", "relayout.layout": "x"}]
    assert carried_metadata(metas) == {"format": "pt"}
    assert carried_metadata([{"format": "pt"}, {}]) == {}


# ---------------------------------------------------------------- a stamped, indexed source with side files


@pytest.fixture(scope="module")
def stamped(tmp_path_factory):
    """SRC: 4096 stamped names in its first shard (its own resident tensors, every routed expert,
    and names it does not hold), a model index, the runtime's side files; DST: its rewrite."""
    root = tmp_path_factory.mktemp("stamped")
    src = root / "src"
    synth_container(src, small_geometry(**GEOMETRY), seed=5, progress=False, stamp=True)
    c = Container.open(src)
    stamps = dict(c.stamps)
    assert stamps and all(".experts." not in n for n in stamps)       # the repack tool's convention
    for e in c.experts.values():
        for ref in e.weights.values():
            stamps[ref.entry.name] = colibri_format_name(ExpertFormat.parse(e.format))
    fill = MAX_STAMPS - len(stamps)
    assert fill > 0
    stamps.update({f"model.not_here.{i}.weight": "int8-row" for i in range(fill)})
    first = c.files[0]
    restamp(first, {"format": "pt", STAMP_KEY: stamp_text(stamps)})
    c = Container.open(src)
    assert c.stamps == stamps and len(stamps) == MAX_STAMPS
    index = {"metadata": {"total_size": 1, "total_parameters": 123}, "weight_map": shard_of(c), "format_note": "kept"}
    (src / INDEX_NAME).write_text(json.dumps(index))
    (src / ".coli_usage").write_text("-1 4 16\n-2 1 3735928559\n1 3 7\n2 5 1\n")
    (src / "stats.txt").write_text("1 3 7\n")
    (src / ".coli_pairs").write_text("COLIPAIRS 1 1\n1 1 3 5:2\n")
    (src / ".coli_kv").write_bytes(b"COLIKV1\0" + bytes(32) + bytes(100))
    (src / ".coli_ssd").write_text(f"v2 2.5 {os.stat(root).st_dev + 1}\n")    # another volume's
    (src / ".DS_Store").write_bytes(b"\0")
    write_manifest(build_manifest(Container.open(src), progress=False), src / MANIFEST_NAME)
    plan = planned(src, root / "plan.json")
    dst = root / "dst"
    m = apply_plan(src, plan, dst, None, force=True, progress=False)
    return dict(root=root, src=src, dst=dst, plan=plan, manifest=m, stamps=stamps)


def test_every_stamp_is_carried_to_the_shard_now_holding_its_tensor(stamped):
    dst = Container.open(stamped["dst"])
    assert dst.stamps == stamped["stamps"]
    holder = shard_of(dst)
    first = dst.files[0].name
    per_file = {p.name: shard_stamps(p, h.metadata) for p, h in zip(dst.files, dst.headers)}
    assert sum(bool(m) for m in per_file.values()) > 2          # one source shard's map spread over many
    for file, m in per_file.items():
        assert len(m) <= MAX_STAMPS
        for name in m:
            assert holder.get(name, first) == file
    for h in dst.headers:                                        # the container-wide key kept in every shard
        assert h.metadata["format"] == "pt"
    problems, summary = verify(stamped["src"], stamped["dst"], progress=False)
    assert problems == [] and summary["format_stamps"] == MAX_STAMPS


def test_verify_names_a_tensor_whose_stamp_is_missing_or_different(stamped, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(stamped["dst"], dst)
    c = Container.open(dst)
    holder = shard_of(c)
    changed = next(n for n, f in sorted(stamped["stamps"].items()) if f == "int8-row" and n in holder)
    lost = next(n for n, f in sorted(stamped["stamps"].items()) if f == "int4-grouped" and n in holder)
    patch_header(dst / holder[changed], json.dumps(changed)[1:-1].encode() + b'\\":\\"int8-row',
                 json.dumps(changed)[1:-1].encode() + b'\\":\\"int4-row')
    renamed = lost[:-1] + ("X" if lost[-1] != "X" else "Y")
    patch_header(dst / holder[lost], b'\\"' + lost.encode() + b'\\"', b'\\"' + renamed.encode() + b'\\"')
    problems, _ = verify(stamped["src"], dst, progress=False)
    assert f"tensor {changed}: DST stamps format 'int4-row', SRC 'int8-row'" in problems
    assert f"tensor {lost}: format stamp 'int4-grouped' of SRC is missing from DST" in problems
    assert f"tensor {renamed}: DST stamps format 'int4-grouped', SRC has no stamp for it" in problems


def test_a_plan_that_would_drop_the_stamps_is_refused_before_anything_is_written(stamped, tmp_path):
    src = Container.open(stamped["src"])
    stripped = []
    for of in output_files(stamped["plan"]):
        meta = {k: v for k, v in of.metadata.items() if k != STAMP_KEY}
        specs = tensor_specs(src, of)
        lay = plan_shard(specs, of.alignment, meta)
        stripped.append(OutputFile(of.name, meta, [(s.name, b) for s, b in lay.placements], lay.file_size, of.alignment, of.derived))
    problems = check_output_files(src, stripped)
    assert problems and all(STAMP_KEY in p and "plan again" in p for p in problems)
    with pytest.raises(InputError, match="lacks the stamp of"):
        rewrite_container(src, stripped, tmp_path / "dst", json.loads((stamped["src"] / MANIFEST_NAME).read_text()), {},
                          progress=False)
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_a_split_tensor_keeps_its_stamp_under_its_own_name_beside_its_first_segment(tmp_path):
    src = tmp_path / "src"
    g = small_geometry(moe_layers=2, experts=16, ffn=256)
    synth_container(src, g, seed=3, progress=False, stamp=True)
    c = Container.open(src)
    stamps = {**c.stamps, **{ref.entry.name: colibri_format_name(ExpertFormat.parse(e.format))
                             for e in c.experts.values() for ref in e.weights.values()}}
    restamp(c.files[-1], {"format": "pt", STAMP_KEY: stamp_text(stamps)})    # all in the last shard (an MTP one)
    tr = synth_trace(g.moe_layers, 16, 8, 300, 4, seed=1, geometry=g.name)
    plan_path = tmp_path / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), split=SplitOptions(0.25, 900_000), progress=False), plan_path)
    m = apply_plan(src, load_plan(plan_path), tmp_path / "dst", None, force=True, progress=False)
    assert m["segments"]
    dst = Container.open(tmp_path / "dst")
    assert dst.stamps == stamps and not any(n.endswith((".top", ".bottom")) for n in dst.stamps)
    holder = shard_of(dst)
    for orig, seg in m["segments"].items():
        if orig in stamps:
            [file] = [p.name for p, h in zip(dst.files, dst.headers) if orig in shard_stamps(p, h.metadata)]
            assert file == holder[seg["top"]]
    assert verify(src, tmp_path / "dst", progress=False)[0] == []


# ---------------------------------------------------------------- the model index


def test_an_indexed_source_gives_a_regenerated_consistent_index(stamped):
    dst = Container.open(stamped["dst"])
    doc = read_index(stamped["dst"] / INDEX_NAME)
    assert doc["weight_map"] == shard_of(dst)
    assert doc["metadata"] == {"total_size": sum(r.nbytes for r in dst.tensors.values()), "total_parameters": 123}
    assert doc["format_note"] == "kept"
    assert doc["weight_map"] != read_index(stamped["src"] / INDEX_NAME)["weight_map"]   # tensors did move


def test_verify_checks_the_index(stamped, tmp_path):
    dst = tmp_path / "dst"
    shutil.copytree(stamped["dst"], dst)
    doc = read_index(dst / INDEX_NAME)
    moved = sorted(doc["weight_map"])[5]
    doc["weight_map"][moved] = "out-mtp-00000.safetensors" if not doc["weight_map"][moved].startswith("out-mtp") else "out-00000.safetensors"
    doc["metadata"]["total_size"] += 1
    (dst / INDEX_NAME).write_text(json.dumps(doc))
    problems, _ = verify(stamped["src"], dst, progress=False)
    assert any("wrong shard for 1 tensor(s)" in p and moved in p for p in problems)
    assert any("metadata.total_size" in p for p in problems)
    (dst / INDEX_NAME).unlink()
    problems, _ = verify(stamped["src"], dst, progress=False)
    assert f"file {INDEX_NAME}: in SRC but missing from DST" in problems


def test_no_index_gives_none_and_a_malformed_index_is_refused(tmp_path):
    src = tmp_path / "src"
    synth_container(src, small_geometry(**GEOMETRY), seed=2, progress=False)
    plan = planned(src, tmp_path / "plan.json")
    apply_plan(src, plan, tmp_path / "dst", None, force=True, progress=False)
    assert not (tmp_path / "dst" / INDEX_NAME).exists()
    (src / INDEX_NAME).write_text('{"weight_map": {"a": 1}}')
    plan = planned(src, tmp_path / "plan2.json")
    with pytest.raises(InputError, match="weight_map is not an object mapping") as e:
        apply_plan(src, plan, tmp_path / "dst2", None, force=True, progress=False)
    assert e.value.where == str(src / INDEX_NAME)
    assert not (tmp_path / "dst2").exists() and not (tmp_path / "dst2.partial").exists()


# ---------------------------------------------------------------- shard names


def test_shard_names_follow_the_converter(stamped):
    for d in (stamped["src"], stamped["dst"]):
        names = [p.name for p in Container.open(d).files]
        for series in ("out", "out-mtp"):
            numbers = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(re.escape(series) + r"-(\d{5})\.safetensors", n)))
            assert numbers == list(range(len(numbers))) and numbers, (series, names)


# ---------------------------------------------------------------- runtime side files


def test_runtime_files_are_carried_or_dropped_and_recorded(stamped):
    src, dst = stamped["src"], stamped["dst"]
    record = {r["name"]: r for r in stamped["manifest"]["runtime_files"]}
    assert {n: r["action"] for n, r in record.items()} == {
        ".coli_usage": CARRIED, "stats.txt": CARRIED, ".coli_pairs": CARRIED, ".coli_kv": CARRIED,
        ".coli_ssd": DROPPED, ".DS_Store": LEFT}
    for name in (".coli_usage", "stats.txt", ".coli_pairs", ".coli_kv"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert not (dst / ".coli_ssd").exists() and not (dst / ".DS_Store").exists()
    assert "DST is on device" in record[".coli_ssd"]["reason"]
    # DST's own manifest does not list them: the runtime rewrites them as it runs
    assert ".coli_usage" not in {f["name"] for f in stamped["manifest"]["files"]}


def test_the_runtime_files_record_follows_the_manifest_schema(stamped):
    schema = json.loads((Path(__file__).resolve().parent.parent / "manifests/schemas/manifest.schema.json").read_text())
    m = json.loads((stamped["dst"] / MANIFEST_NAME).read_text())
    jsonschema.validate(m, schema)
    assert manifest_problem(m) is None
    for bad in ({"name": ".coli_kv", "action": "kept", "reason": "x"}, {"name": ".coli_kv", "reason": "x"},
                {"name": ".coli_kv", "action": "carried", "reason": "x", "xxh3_128": "nothex"},
                {"name": ".coli_kv", "action": "carried", "reason": "x", "extra": 1}):
        broken = {**m, "runtime_files": [bad]}
        assert manifest_problem(broken) is not None
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_verify_checks_carried_copies_and_notes_changes_in_src(stamped, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(stamped["src"], src)
    shutil.copytree(stamped["dst"], dst)
    with open(src / ".coli_usage", "a") as f:
        f.write("2 6 1\n")                                        # the runtime appended to SRC's history
    problems, summary = verify(src, dst, progress=False)
    assert problems == [] and any(".coli_usage: SRC's has changed" in n for n in summary["runtime_file_notes"])
    (dst / ".coli_pairs").write_text("COLIPAIRS 1 0\n\n")
    (dst / ".coli_kv").unlink()
    problems, _ = verify(src, dst, progress=False)
    assert "file .coli_pairs: DST's copy is not the bytes the rewrite carried (xxh3-128)" in problems
    assert "file .coli_kv: carried by the rewrite but missing from DST" in problems


def test_a_failed_write_of_a_side_file_resumes_with_the_index_and_stamps_intact(stamped, tmp_path):
    """RLIMIT_FSIZE refuses the 2 MB conversation file after every shard and the index are written."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(stamped["src"], src)
    (src / ".coli_kv").write_bytes(b"COLIKV1\0" + os.urandom(2_000_000))
    cmd = ["rewrite", str(src), "--layout", str(stamped["plan"].path), "--out", str(dst), "--force"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    code = ("import resource, signal, sys, runpy; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1_200_000, 1_200_000)); "
            f"sys.argv = {['relayout'] + cmd!r}; runpy.run_module('relayout', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and ".coli_kv" in res.stderr, res.stderr
    partial = tmp_path / "dst.partial"
    assert not dst.exists() and (partial / INDEX_NAME).is_file() and not (partial / ".coli_kv").exists()
    res = cli(*cmd)
    assert res.returncode == 0, res.stderr
    assert "already written and re-hashed intact" in res.stderr + res.stdout
    assert (dst / ".coli_kv").read_bytes() == (src / ".coli_kv").read_bytes()
    assert verify(src, dst, progress=False)[0] == []
    assert Container.open(dst).stamps == stamped["stamps"]


def test_ssd_measurement_is_carried_only_onto_its_volume(tmp_path):
    here = os.stat(tmp_path).st_dev
    (tmp_path / ".coli_ssd").write_text(f"v2 3.1 {here}\n")
    (tmp_path / ".coli_kv.2").write_bytes(b"COLIKV1\0")
    (tmp_path / ".coli_kv.02").write_bytes(b"x")                     # not a slot number the runtime writes
    os.symlink("/etc/hostname", tmp_path / ".coli_usage")
    (tmp_path / ".cache").mkdir()
    got = {r.name: r.action for r in runtime_files(tmp_path, here, set())}
    assert got == {".coli_ssd": CARRIED, ".coli_kv.2": CARRIED, ".coli_kv.02": LEFT, ".coli_usage": LEFT}
    assert {r.name: r.action for r in runtime_files(tmp_path, here + 1, set())}[".coli_ssd"] == DROPPED


@pytest.mark.parametrize("text, device", [
    (b"v2 3.5 2049", 2049), (b"v2 3.5 2049\n", 2049), (b"v2 999.9 1", 1), (b"v2 0.01 18446744073709551615", 2**64 - 1),
    (b"v2 3.5 2049\n\n", None), (b"3.5", None), (b"v2 0 1", None), (b"v2 1000 1", None), (b"v2 1e3 1", None),
    (b"v2 5. 1", None), (b"v2  3.5 1", None), (b"v2 3.5 18446744073709551616", None), (b"v2 3.5 1\r\n", None),
    (b"v2 3.5 " + b"1" * 21, None), (b"v2 1." + b"0" * 60 + b" 1", None),
])
def test_ssd_cache_grammar(text, device):
    assert ssd_device(text) == device


# ---------------------------------------------------------------- the rewrite's summary and colibrì's doctor


def test_rewrite_summary_says_what_was_done_per_file(stamped, tmp_path):
    r = cli("rewrite", stamped["src"], "--layout", stamped["plan"].path, "--out", tmp_path / "dst", "--force")
    assert r.returncode == 0, r.stderr
    assert f"format stamps (colibri.fmt): {MAX_STAMPS} carried" in r.stdout
    assert "model.safetensors.index.json: regenerated" in r.stdout
    for line in (".coli_usage: carried", ".coli_kv: carried", ".coli_ssd: dropped", ".DS_Store: left behind", "stats.txt: carried"):
        assert line in r.stdout


COLIBRI = os.environ.get("RELAYOUT_COLIBRI_DIR")


def doctor(colibri: Path, model: Path) -> dict:
    r = subprocess.run([sys.executable, str(colibri / "c" / "coli"), "doctor", "--deep", "--json", "--model", str(model)],
                       capture_output=True, text=True, timeout=600)
    return json.loads(r.stdout)


@pytest.mark.skipif(not COLIBRI, reason="RELAYOUT_COLIBRI_DIR does not name a colibrì checkout")
def test_colibri_doctor_gives_src_and_dst_the_same_status(stamped):
    a, b = doctor(Path(COLIBRI), stamped["src"]), doctor(Path(COLIBRI), stamped["dst"])
    checks = lambda r: {c["id"]: c["status"] for c in r["checks"] if c["id"].startswith("model.")}
    assert a["status"] == b["status"] and checks(a) == checks(b)
    assert checks(b)["model.shard_sequence"] == "pass" and checks(b)["model.index"] == "pass"
