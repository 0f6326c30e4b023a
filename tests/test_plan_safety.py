"""A plan is a file users share: a crafted one can never write outside the destination, touch the
source, or crash the rewrite; the destination is ours alone; resume trusts nothing by size."""

import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO, cli, small_geometry, source_with_manifest, tree_state

from containers.container import Container
from containers.errors import InputError
from containers.output_files import check_output_files, output_name_problem
from relayout.workflows.apply import apply_plan, output_files, verify
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import load_plan, plan_digest, save_plan


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A source container with its manifest and a plan cut into several small files."""
    root = tmp_path_factory.mktemp("safety")
    g = small_geometry(moe_layers=2, experts=16, ffn=128)
    src = source_with_manifest(root / "src", g, seed=3)
    tr = synth_trace(g.moe_layers, 16, 8, 300, 4, seed=1, geometry=g.name)
    plan = make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=600_000), progress=False)
    save_plan(plan, root / "plan.json")
    return dict(root=root, src=src, plan=plan, plan_path=root / "plan.json")


def _tampered(base, tmp_path, edit) -> str:
    """A copy of the plan with ``edit(plan)`` applied and its digest recomputed (it is unkeyed)."""
    plan = json.loads(json.dumps(base["plan"]))
    edit(plan)
    plan["plan_digest"] = plan_digest(plan)
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(plan))
    return str(path)


ESCAPE_TARGETS = ["/tmp/relayout-abs-escape.safetensors", "/tmp/relayout-x.safetensors"]


def _listing(tmp_path) -> set:
    """Every path below ``tmp_path``, the entries beside it, and the absolute escape targets."""
    out = {str(p) for p in tmp_path.parent.iterdir()} | {p for p in ESCAPE_TARGETS if os.path.lexists(p)}
    for dirpath, dirs, files in os.walk(tmp_path):
        out |= {os.path.join(dirpath, n) for n in dirs + files}
    return out


def _rename_first_file(name):
    def edit(plan):
        plan["layout"]["files"][0]["name"] = name
    return edit


BAD_NAMES = [
    "/" + "../" * 30 + "tmp/relayout-abs-escape.safetensors",
    "./../../evil.safetensors",
    "../x.safetensors",
    "/tmp/relayout-x.safetensors",
    "sub/x.safetensors",
    "relayout.manifest.json",
    "weights.bin",
    ".x.tmp-1",
    "a\nb.safetensors",
    "config.json",
    "nul\x00.safetensors",
    "\ud800.safetensors",
    7,
    None,
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_crafted_output_name_is_refused_before_anything_is_created(base, tmp_path, name):
    before_src = tree_state(base["src"])
    before = _listing(tmp_path)
    path = _tampered(base, tmp_path, _rename_first_file(name))
    with pytest.raises(InputError, match="file name"):
        load_plan(path)
    assert _listing(tmp_path) - before == {path}
    assert tree_state(base["src"]) == before_src


def test_the_cli_refuses_an_escaping_name_in_one_line_and_writes_nothing(base, tmp_path):
    path = _tampered(base, tmp_path, _rename_first_file("/" + "../" * 30 + "tmp/relayout-abs-escape.safetensors"))
    before = _listing(tmp_path)
    res = cli("rewrite", base["src"], "--layout", path, "--out", tmp_path / "dst", "--force")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert "is a path, not a plain file name" in res.stderr
    assert _listing(tmp_path) == before and not any(os.path.lexists(p) for p in ESCAPE_TARGETS)


def test_the_rewriter_checks_the_file_list_itself(base):
    """Defence in depth: names and placement are checked again on the rewriter's input."""
    src = Container.open(base["src"])
    plan = load_plan(base["plan_path"])
    files = output_files(plan)
    assert check_output_files(src, files) == []
    bad = [replace(files[0], name="../escape.safetensors"), replace(files[1], name=files[2].name.upper()), *files[2:]]
    bad[-1] = replace(bad[-1], tensors=bad[-1].tensors[1:])          # one tensor no longer placed
    problems = check_output_files(src, bad)
    assert any("not a plain file name" in p for p in problems)
    assert any("used twice" in p for p in problems)
    assert any("is not placed" in p for p in problems)
    twice = [*files[:-1], replace(files[-1], tensors=files[-1].tensors + [files[0].tensors[0]])]
    assert any("placed twice" in p for p in check_output_files(src, twice))


@pytest.mark.parametrize("edit, words", [
    (lambda p: p["layout"].__setitem__("alignment", 0), "alignment"),
    (lambda p: p["layout"].__setitem__("alignment", True), "alignment"),
    (lambda p: p["layout"]["files"][0].__setitem__("metadata", ["x"]), "metadata"),
    (lambda p: p["layout"]["files"][0].__setitem__("metadata", {"k": 3}), "metadata"),
    (lambda p: p.__setitem__("source", None), "source"),
    (lambda p: p["source"].__setitem__("kind", "elsewhere"), "source kind"),
    (lambda p: p["geometry"].__setitem__("n_experts", 1e12), "n_experts"),
    (lambda p: p["layout"]["files"][0].__setitem__("size", -5), "size"),
    (lambda p: p["layout"]["files"][0].__setitem__("size", 1.5), "size"),
    (lambda p: p["layout"]["other_tensors"][0].__setitem__(1, 10_000), "file"),
    (lambda p: p["training"].__setitem__("sessions", [1, 2]), "sessions"),
    (lambda p: p["orders"][next(iter(p["orders"]))].__setitem__(1, True), "permutation"),
], ids=range(12))
def test_a_crafted_plan_field_is_one_clean_error(base, tmp_path, edit, words):
    path = _tampered(base, tmp_path, edit)
    res = cli("rewrite", base["src"], "--layout", path, "--out", tmp_path / "dst", "--force")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert words in res.stderr and "tampered.json" in res.stderr
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_a_wrong_size_or_missing_tensor_is_refused_before_any_file_is_written(base, tmp_path):
    def grow(plan):
        plan["layout"]["files"][-1]["size"] += 4096

    with pytest.raises(InputError, match="nothing was written.*the plan says"):
        apply_plan(base["src"], load_plan(_tampered(base, tmp_path, grow)), tmp_path / "dst", force=True, progress=False)

    def drop(plan):
        plan["layout"]["other_tensors"] = plan["layout"]["other_tensors"][1:]

    with pytest.raises(InputError, match="is not placed"):
        apply_plan(base["src"], load_plan(_tampered(base, tmp_path, drop)), tmp_path / "dst", force=True, progress=False)
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_output_names_are_plain_unique_safetensors_names():
    assert output_name_problem("out-00001.safetensors") is None
    for bad in BAD_NAMES + [".safetensors", "a" * 300 + ".safetensors", "x.safetensors\r"]:
        assert output_name_problem(bad) is not None, bad
    assert output_name_problem("Tokenizer.JSON.safetensors", {"tokenizer.json.safetensors"}) is not None


def _rewrite(base, dst, **kw):
    return apply_plan(base["src"], load_plan(base["plan_path"]), dst, force=True, progress=False, **kw)


def test_a_symlinked_partial_directory_never_leads_into_the_source(base, tmp_path):
    before = tree_state(base["src"])
    os.symlink(base["src"], tmp_path / "dst.partial")
    with pytest.raises(InputError, match="not a directory relayout created"):
        _rewrite(base, tmp_path / "dst")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    os.unlink(tmp_path / "dst.partial")
    os.symlink(other, tmp_path / "dst.partial")
    with pytest.raises(InputError, match="not a directory relayout created"):
        _rewrite(base, tmp_path / "dst")
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]
    assert tree_state(base["src"]) == before and not (tmp_path / "dst").exists()


def test_destination_odd_states_are_refused(base, tmp_path):
    (tmp_path / "a.partial").write_text("a file")
    with pytest.raises(InputError, match="not a directory relayout created"):
        _rewrite(base, tmp_path / "a")
    os.symlink(tmp_path / "nowhere", tmp_path / "b.partial")
    with pytest.raises(InputError, match="not a directory relayout created"):
        _rewrite(base, tmp_path / "b")
    os.symlink(tmp_path / "nowhere", tmp_path / "c")          # a dangling symlink at DST
    with pytest.raises(InputError, match="already exists"):
        _rewrite(base, tmp_path / "c")
    (tmp_path / "d.partial").mkdir()
    (tmp_path / "d.partial" / "notes.txt").write_text("user data")
    with pytest.raises(InputError, match="not a partial rewrite"):
        _rewrite(base, tmp_path / "d")
    assert (tmp_path / "d.partial" / "notes.txt").read_text() == "user data"
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="cannot be created"):
        _rewrite(base, tmp_path / "file" / "dst")
    before = tree_state(base["src"])
    for inside in (base["src"] / "new", base["src"], base["src"].parent):
        with pytest.raises(InputError, match="same or nested|already exists"):
            _rewrite(base, inside)
    assert tree_state(base["src"]) == before


def test_a_second_rewrite_to_the_same_destination_fails_at_once(base, tmp_path):
    partial = tmp_path / "dst.partial"
    partial.mkdir()
    fd = os.open(partial, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(InputError, match="another relayout rewrite"):
            _rewrite(base, tmp_path / "dst")
    finally:
        os.close(fd)
    _rewrite(base, tmp_path / "dst")      # the lock released: the empty partial directory is adopted
    assert verify(base["src"], tmp_path / "dst", progress=False)[0] == []


def test_resume_rehashes_journaled_files_and_says_so(base, tmp_path):
    """Interrupt a rewrite with a real write failure, flip a byte in a finished file, resume."""
    dst = tmp_path / "dst"
    code = ("import resource, signal, sys, runpy; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, 500_000)); "
            f"sys.argv = ['relayout', 'rewrite', {str(base['src'])!r}, '--layout', {str(base['plan_path'])!r}, "
            f"'--out', {str(dst)!r}, '--force']; runpy.run_module('relayout', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True)
    assert res.returncode == 2 and "resume" in res.stderr, res.stderr
    journal = json.loads((tmp_path / "dst.partial" / "relayout.journal.json").read_text())
    done = sorted(journal["files"])
    assert len(done) >= 2, "the write limit should let some files finish"
    victim = tmp_path / "dst.partial" / done[0]
    with open(victim, "r+b") as fh:           # same size, one byte different
        fh.seek(victim.stat().st_size - 1)
        b = fh.read(1)
        fh.seek(victim.stat().st_size - 1)
        fh.write(bytes([b[0] ^ 1]))
    said = []
    _rewrite(base, dst, notify=said.append)
    assert len(said) == 1 and f"{len(done) - 1} file(s) already written and re-hashed intact" in said[0]
    assert verify(base["src"], dst, full=True, progress=False)[0] == []


def test_interrupted_rewrite_never_leaves_a_complete_looking_destination(base, tmp_path):
    """SIGINT mid-run: exit 130 with one line; DST absent; a rerun resumes to identical bytes."""
    dst = tmp_path / "dst"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "relayout", "rewrite", str(base["src"]), "--layout", str(base["plan_path"]),
           "--out", str(dst), "--force"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2))
    while not (tmp_path / "dst.partial").exists() and proc.poll() is None:
        pass
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate()
    if proc.returncode == 0:
        pytest.skip("the rewrite finished before the interrupt landed")
    assert proc.returncode == 130 and err.count("\n") == 1 and "interrupted" in err, err
    assert not dst.exists()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert verify(base["src"], dst, full=True, progress=False)[0] == []


def test_a_crafted_gate_or_device_profile_is_one_clean_error(base, tmp_path):
    from replay.model.device import load_device

    gate = tmp_path / "gate.json"
    gate.write_text(json.dumps({"format": "relayout.gate", "version": 1, "verdict": "pass", "plan": None, "reason": 3,
                                "evidence": {}}))
    res = cli("rewrite", base["src"], "--layout", base["plan_path"], "--out", tmp_path / "dst", "--gate", gate)
    assert res.returncode == 2 and "malformed gate record: gate record.reason is 3, not a string" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and not (tmp_path / "dst").exists()
    shipped = load_device("single-nvme").to_json()
    for edit in ({"members": 1.5}, {"host_bandwidth": float("nan")}, {"drive": {**shipped["drive"], "bandwidth": "fast"}},
                 {"chunk_bytes": True}):
        prof = tmp_path / "dev.json"
        prof.write_text(json.dumps({**shipped, **edit}))
        with pytest.raises(InputError, match="not a finite|not a valid device profile"):
            load_device(str(prof))
