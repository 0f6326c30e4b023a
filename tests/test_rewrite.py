"""The rewrite: gated, resumable after SIGKILL, clean on full disks, verified byte for byte."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, cli, small_geometry, source_with_manifest, tree_state

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.manifest import build_manifest
from containers.synth import synth_container
from relayout.workflows.apply import apply_plan, verify
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import SynthParams, synth_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import compare
from replay.formats.planfile import load_plan, save_plan
from replay.formats.trace import save_trace


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A source container with its manifest, a trace, a plan cut into many small files, and gates."""
    root = tmp_path_factory.mktemp("rw")
    g = small_geometry(moe_layers=3, experts=32, ffn=256)
    src = source_with_manifest(root / "src", g, seed=11)
    tr = synth_trace(g.moe_layers, 32, 8, 1700, 17, seed=2, params=SynthParams(clique_strength=0.9), geometry=g.name)  # 5 held out
    save_trace(tr, root / "t.rt")
    plan_path = root / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=1_500_000), progress=False), plan_path)
    plan = load_plan(plan_path)
    passing = compare(plan, tr, load_device("linux-md-raid0-4x"), RuntimeConfig(workers=1, coalesce=True))
    failing = compare(plan, tr, load_device("linux-md-raid0-4x"), RuntimeConfig(workers=1, coalesce=True), threshold=0.9)
    assert passing.verdict == "pass" and failing.verdict == "fail"
    (root / "gate.json").write_text(json.dumps(passing.to_json()))
    return dict(root=root, src=src, plan=plan, plan_path=plan_path, trace=root / "t.rt", passing=passing, failing=failing)


def test_rewrite_is_identical_verified_and_leaves_the_source_untouched(setup, tmp_path):
    before = tree_state(setup["src"])
    dst = tmp_path / "dst"
    m = apply_plan(setup["src"], setup["plan"], dst, setup["passing"], progress=False)
    assert tree_state(setup["src"]) == before
    src_m = json.loads((setup["src"] / MANIFEST_NAME).read_text())
    assert m["content_fingerprint"] == src_m["content_fingerprint"]
    assert m["fingerprint"] != src_m["fingerprint"]
    assert m["rewrite"]["forced"] is False and m["rewrite"]["plan_digest"] == setup["plan"].digest
    assert len(m["files"]) > 5
    problems, _ = verify(setup["src"], dst, full=True, progress=False)
    assert problems == []
    c = Container.open(dst)
    assert all(e.fast_path for e in c.experts.values()) and c.problems == []
    for h in c.headers:  # blocks aligned as the plan says; metadata str -> str
        assert h.metadata["relayout.layout"] and all(isinstance(v, str) for v in h.metadata.values())
    assert not (tmp_path / "dst.partial").exists()
    # the new manifest is what a fresh hash of DST gives
    fresh = build_manifest(c, progress=False)
    assert fresh["fingerprint"] == m["fingerprint"] and fresh["tensors"] == m["tensors"]


def test_rewrite_refusals(setup, tmp_path):
    plan = setup["plan"]
    with pytest.raises(InputError, match="no gate.json"):
        apply_plan(setup["src"], plan, tmp_path / "a", None, progress=False)
    with pytest.raises(InputError, match="the gate failed"):
        apply_plan(setup["src"], plan, tmp_path / "b", setup["failing"], progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    m = apply_plan(setup["src"], plan, tmp_path / "c", setup["failing"], force=True, progress=False)
    assert m["rewrite"]["forced"] is True and "gate failed" in m["rewrite"]["override_reason"]
    with pytest.raises(InputError, match="already exists"):
        apply_plan(setup["src"], plan, tmp_path / "c", setup["passing"], progress=False)
    other = tmp_path / "other"
    synth_container(other, small_geometry(moe_layers=3, experts=32, ffn=256), seed=12, progress=False)
    with pytest.raises(InputError, match="not the container the plan was made for"):
        apply_plan(other, plan, tmp_path / "d", setup["passing"], progress=False)


def test_flipped_byte_in_dst_is_named_by_verify(setup, tmp_path):
    dst = tmp_path / "dst"
    m = apply_plan(setup["src"], setup["plan"], dst, setup["passing"], progress=False)
    name = "model.layers.4.mlp.experts.7.gate_proj.weight"
    t = m["tensors"][name]
    path = dst / t["file"]
    with open(path, "r+b") as fh:
        fh.seek(t["offset"] + 5)
        b = fh.read(1)
        fh.seek(t["offset"] + 5)
        fh.write(bytes([b[0] ^ 0x80]))
    problems, _ = verify(setup["src"], dst, progress=False)
    assert any(p.startswith(f"tensor {name} ") for p in problems)
    res = cli("verify", setup["src"], dst)
    assert res.returncode == 2 and name in res.stdout


def _rewrite_cmd(setup, dst):
    return [sys.executable, "-m", "relayout", "rewrite", str(setup["src"]), "--layout", str(setup["plan_path"]),
            "--out", str(dst), "--gate", str(setup["root"] / "gate.json")]


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_gives_identical_bytes(tmp_path):
    """benchmarks/kill_resume.py SIGKILLs rewrites at random moments of their writing (8 kills here;
    docs/BENCHMARKS.md records 100): every kill leaves no DST or a complete one, every resume
    finishes to the uninterrupted rewrite's bytes, and at least one kill lands mid-write, so a
    resume from a journal is exercised."""
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kill_resume.py"), "--kills", "8", "--mb", "12",
                          "--seed", "5", "--work", str(tmp_path), "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    stats = json.loads(res.stdout)
    assert stats["kills"] >= 8   # where each kill lands depends on timing; every one must resume exactly
    assert stats["kills_mid_write"] >= 1
    assert stats["complete_looking_incomplete"] == 0 and stats["mismatched_results"] == 0 and stats["final_identical"]


def test_write_failure_is_clean_and_resumable(setup, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 300 kB: a real write failure, mid-rewrite."""
    dst = tmp_path / "dst"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = ("import resource, signal, sys, runpy; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1_200_000, 1_200_000)); "
            f"sys.argv = {['relayout'] + _rewrite_cmd(setup, dst)[3:]!r}; runpy.run_module('relayout', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1 and "resume" in res.stderr
    assert not dst.exists() and (tmp_path / "dst.partial").exists()
    res = cli(*_rewrite_cmd(setup, dst)[3:])
    assert res.returncode == 0, res.stderr
    assert verify(setup["src"], dst, progress=False)[0] == []


def test_tiny_filesystem_is_refused_before_writing(setup, tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(InputError, match="GB free"):
            apply_plan(setup["src"], setup["plan"], mnt / "dst", setup["passing"], progress=False)
        assert not (mnt / "dst").exists()
    finally:
        subprocess.run(["umount", str(mnt)])


def test_truncated_source_is_a_clean_error(setup, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(setup["src"], src)
    shard = sorted(src.glob("out-0*.safetensors"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    res = cli(*_rewrite_cmd({**setup, "src": src}, tmp_path / "dst")[3:])
    assert res.returncode == 2 and shard.name in res.stderr and "Traceback" not in res.stderr


def test_headline_replay_command_rewrites_on_pass(setup, tmp_path):
    res = cli("replay", "--layout", setup["plan_path"], "--trace", setup["trace"], "--device", "linux-md-raid0-4x",
              "--workers", 1, "--coalesce", "--container", setup["src"], "--out", tmp_path / "dst", "-o", tmp_path / "gate.json")
    assert res.returncode == 0, res.stderr
    assert "verdict: PASS" in res.stdout and "verified" in res.stdout
    res = cli("replay", "--layout", setup["plan_path"], "--trace", setup["trace"], "--device", "linux-md-raid0-4x",
              "--workers", 1, "--coalesce", "--threshold", 0.9, "--container", setup["src"], "--out", tmp_path / "dst2")
    assert res.returncode == 3 and "not rewritten" in res.stdout and not (tmp_path / "dst2").exists()   # 3: failed, not rewritten


def test_replay_with_a_prefetch_source_reports_its_metrics(setup):
    res = cli("replay", "--layout", setup["plan_path"], "--trace", setup["trace"], "--device", "linux-md-raid0-4x",
              "--prefetch", "coupled", "--prefetch-experts", 4, "--json")
    assert res.returncode == 0, res.stderr
    g = json.loads(res.stdout)
    assert g["runtime"]["prefetch"] == "coupled" and g["runtime"]["prefetch_experts"] == 4
    m = g["baseline_metrics"]["prefetch"]
    assert m["prefetched_bytes_per_token"] > 0 and 0 <= m["timely_required_byte_recall"] <= 1
    res = cli("replay", "--layout", setup["plan_path"], "--trace", setup["trace"], "--device", "linux-md-raid0-4x",
              "--prefetch-experts", 0)
    assert res.returncode != 0 and "--prefetch-experts" in res.stderr and "from 1 to 64" in res.stderr and "Traceback" not in res.stderr


def test_rewrite_verify_and_manifest_import_no_heavy_libraries(setup, tmp_path):
    """The byte-moving commands start fast: numba, networkx and dask (planning, replay, sweeps) stay unimported."""
    dst = tmp_path / "dst"
    commands = [["rewrite", str(setup["src"]), "--layout", str(setup["plan_path"]), "--force", "--out", str(dst)],
                ["verify", str(setup["src"]), str(dst)],
                ["manifest", str(dst), "-o", str(tmp_path / "m.json")]]
    for argv in commands:
        code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from relayout.cli import main; rc = main({argv!r}); "
                "print(sorted(m for m in ('numba', 'networkx', 'dask', 'distributed', 'scipy') if m in sys.modules)); "
                "sys.exit(rc)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == "[]", (argv[0], out.stdout.splitlines()[-1])


def test_a_forged_gate_is_refused_before_a_byte_is_written(setup, tmp_path):
    """The failing gate with its verdict edited to "pass": the recheck catches it, with or without --force."""
    forged = setup["failing"].to_json()
    forged["verdict"] = "pass"
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(forged))
    dst = tmp_path / "dst"
    for extra in ([], ["--force"]):
        res = cli("rewrite", setup["src"], "--layout", setup["plan_path"], "--out", dst, "--gate", path, *extra)
        assert res.returncode == 2, res.stderr
        assert "verdict" in res.stderr and str(path) in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert not dst.exists() and not (tmp_path / "dst.partial").exists()
    honest = tmp_path / "failing.json"
    honest.write_text(json.dumps(setup["failing"].to_json()))
    res = cli("rewrite", setup["src"], "--layout", setup["plan_path"], "--out", dst, "--gate", honest, "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads((dst / MANIFEST_NAME).read_text())["rewrite"]["forced"] is True
    bottom = res.stdout.strip().splitlines()[-1]                # the answer in words: where, how checked, what next
    assert bottom.startswith(f"Bottom line: {dst} is the relaid container (the gate overridden with --force)")
    assert f"SNAP={dst} " in bottom and f"--baseline {setup['src']} --container {dst}" in bottom
    assert f"relayout verify {setup['src']} {dst} --full" in bottom
