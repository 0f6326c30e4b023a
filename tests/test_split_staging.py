"""A rewrite that writes each shard straight into its drive's directory (``COLI_MODEL_DIRS``):
every tensor once across the directories, verified as the engine reads them, resumable after a
kill at any call, refusing an existing or uncreatable directory before anything is written."""

import json
import os
import signal
import subprocess
import sys

import pytest
import xxhash
from conftest import REPO, cli, small_geometry, source_with_manifest, tree_state

from containers.container import MANIFEST_NAME
from containers.errors import InputError
from containers.multidir import check_split
from containers.split_destination import SPLIT_MARK
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from relayout.workflows.apply import apply_plan, verify
from replay.formats.planfile import load_plan, save_plan
from replay.model.storage import DirectorySpec, DriveSpec, StorageRecord


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A source, a plan of many small shards, and a split of them over three directories."""
    root = tmp_path_factory.mktemp("split")
    g = small_geometry(moe_layers=2, experts=16, ffn=128)
    src = source_with_manifest(root / "src", g, seed=5)
    tr = synth_trace(g.moe_layers, 16, g.num_experts_per_tok, 300, 4, seed=1, geometry=g.name)
    plan_path = root / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=1_000_000), progress=False), plan_path)
    files = load_plan(plan_path).layout.files
    assert len(files) >= 6
    per_dir = [files[0::3], files[1::3], files[2::3]]
    rec = StorageRecord([DriveSpec("fast", "single-nvme"), DriveSpec("mid", "single-nvme"), DriveSpec("slow", "single-nvme")],
                        [DirectorySpec(d, s) for d, s in zip(("fast", "mid", "slow"), per_dir)], [])
    (root / "storage.json").write_text(json.dumps(rec.to_json()))
    return dict(root=root, src=src, plan_path=plan_path, per_dir=per_dir)


def _split(tmp, per_dir, names=("b", "c")):
    return [(str(tmp / n), list(s)) for n, s in zip(names, per_dir[1:])]


def digests(root):
    """Every file's xxh3-128 but the manifest's and the mark's (they name the run's directories)."""
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes()) for p in sorted(root.iterdir())
            if p.name not in (MANIFEST_NAME, SPLIT_MARK)}


def test_a_split_rewrite_puts_each_shard_in_its_directory_and_verifies_as_the_engine_reads(staged, tmp_path):
    before = tree_state(staged["src"])
    plan = load_plan(staged["plan_path"])
    split = _split(tmp_path, staged["per_dir"])
    m = apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False, split=split)
    assert tree_state(staged["src"]) == before
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert sorted(p.name for p in a.glob("*.safetensors")) == sorted(staged["per_dir"][0])
    assert sorted(os.listdir(b)) == sorted(staged["per_dir"][1] + [SPLIT_MARK])
    assert sorted(os.listdir(c)) == sorted(staged["per_dir"][2] + [SPLIT_MARK])
    assert (a / "config.json").is_file() and (a / MANIFEST_NAME).is_file()
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    # every tensor exactly once across the directories, as the engine indexes them
    engine = check_split([a, b, c])
    assert engine.problems == [] and sorted(engine.shards) == sorted(plan.layout.files)
    assert m["rewrite"]["split_dirs"] == [{"path": d, "files": s} for d, s in split]
    # verify reads the split the manifest records, or the directories given; byte for byte too
    problems, summary = verify(staged["src"], a, full=True, progress=False)
    assert problems == [] and summary["split_dirs"] == [str(b), str(c)]
    assert verify(staged["src"], a, progress=False, dirs=[str(b), str(c)])[0] == []
    # given without its third directory, the split is missing tensors; a shard in two directories is refused
    missing, _ = verify(staged["src"], a, progress=False, dirs=[str(b)])
    assert any("missing" in p for p in missing)
    shard = staged["per_dir"][2][0]
    os.link(c / shard, b / shard)
    with pytest.raises(InputError, match="shadowed"):
        verify(staged["src"], a, progress=False)
    os.unlink(b / shard)
    # a flipped byte in a split directory's shard is named
    t = next(t for t in m["tensors"].values() if t["file"] == shard)
    with open(c / shard, "r+b") as fh:
        fh.seek(t["offset"])
        byte = fh.read(1)
        fh.seek(t["offset"])
        fh.write(bytes([byte[0] ^ 1]))
    problems, _ = verify(staged["src"], a, progress=False)
    assert any("bytes differ" in p and shard in p for p in problems)


def test_the_rewrite_command_stages_a_storage_description_and_verifies(staged, tmp_path):
    r = cli("rewrite", staged["src"], "--layout", staged["plan_path"], "--out", tmp_path / "a", "--force",
            "--storage", staged["root"] / "storage.json", "--dirs", tmp_path / "b", tmp_path / "c", "--verify")
    assert r.returncode == 0, r.stderr
    assert f"COLI_MODEL_DIRS={tmp_path / 'b'};{tmp_path / 'c'}" in r.stdout and "each tensor once" in r.stdout
    r = cli("verify", staged["src"], tmp_path / "a", "--dirs", tmp_path / "b", tmp_path / "c")
    assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
    # the wrong number of directories for the description: one line, nothing written
    r = cli("rewrite", staged["src"], "--layout", staged["plan_path"], "--out", tmp_path / "x", "--force",
            "--storage", staged["root"] / "storage.json", "--dirs", tmp_path / "y")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "give the 2" in r.stderr
    assert not (tmp_path / "x.partial").exists() and not (tmp_path / "y.partial").exists()


def test_an_existing_or_uncreatable_directory_is_refused_before_any_write(staged, tmp_path):
    plan = load_plan(staged["plan_path"])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.txt").write_text("the user's")
    with pytest.raises(InputError, match="already exists") as exc:
        apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False, split=_split(tmp_path, staged["per_dir"]))
    assert str(tmp_path / "c") in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["c"] and os.listdir(tmp_path / "c") == ["mine.txt"]
    # a directory under a regular file cannot be created: one error naming it; the partial
    # directories this run made are removed again
    (tmp_path / "file").write_text("x")
    split = [(str(tmp_path / "b"), staged["per_dir"][1]), (str(tmp_path / "file" / "d"), staged["per_dir"][2])]
    with pytest.raises(InputError) as exc:
        apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False, split=split)
    assert str(tmp_path / "file") in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["c", "file"]
    # the same through the command: one line, status 2
    rec = json.loads((staged["root"] / "storage.json").read_text())
    r = cli("rewrite", staged["src"], "--layout", staged["plan_path"], "--out", tmp_path / "a", "--force",
            "--storage", staged["root"] / "storage.json", "--dirs", tmp_path / "b", tmp_path / "file" / "d")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["c", "file"] and len(rec["dirs"]) == 3
    # directories nested in each other, or a shard placed twice, are refused before anything exists
    with pytest.raises(InputError, match="nested"):
        apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False,
                   split=[(str(tmp_path / "a" / "b"), staged["per_dir"][1])])
    with pytest.raises(InputError, match="also placed"):
        apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False,
                   split=[(str(tmp_path / "b"), staged["per_dir"][1]), (str(tmp_path / "d"), staged["per_dir"][1])])
    assert sorted(os.listdir(tmp_path)) == ["c", "file"]


def test_a_split_directory_without_room_is_refused_before_writing(staged, tmp_path):
    """The free space is checked per volume: a split directory on a 1 MB tmpfs is named, though
    the primary's volume has room, and nothing is renamed into place."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        split = [(str(tmp_path / "b"), staged["per_dir"][1]), (str(mnt / "c"), staged["per_dir"][2])]
        with pytest.raises(InputError, match="GB free") as exc:
            apply_plan(staged["src"], load_plan(staged["plan_path"]), tmp_path / "a", None, force=True, progress=False, split=split)
        assert str(mnt / "c.partial") in str(exc.value)
        assert not any((p / n).exists() for p, n in [(tmp_path, "a"), (tmp_path, "b"), (mnt, "c")])
        assert [p.name for p in mnt.iterdir()] == ["c.partial"] and os.listdir(mnt / "c.partial") == [SPLIT_MARK]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_split_directory_of_another_rewrite_is_not_taken(staged, tmp_path):
    plan = load_plan(staged["plan_path"])
    split = _split(tmp_path, staged["per_dir"])
    apply_plan(staged["src"], plan, tmp_path / "a", None, force=True, progress=False, split=split)
    # a primary's partial beside a published split directory of a rewrite to another primary
    (tmp_path / "z.partial").mkdir()
    before = tree_state(tmp_path / "b")
    with pytest.raises(InputError, match="another rewrite"):
        apply_plan(staged["src"], plan, tmp_path / "z", None, force=True, progress=False, split=split)
    assert tree_state(tmp_path / "b") == before and os.listdir(tmp_path / "z.partial") == []


DRIVER = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import containers.destination as destination
from relayout.workflows.apply import apply_plan
from replay.formats.planfile import load_plan

kill_at, src, plan, dst, log, split = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], json.loads(sys.argv[7])
calls = []
counting = True

def counted(name, fn):
    def call(*a, **k):
        if counting:
            calls.append([name, str(a[0]) if a else ""])
            if len(calls) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return call

for name in ("open", "write", "fsync", "replace", "rename", "unlink", "mkdir", "rmdir", "ftruncate"):
    setattr(os, name, counted(name, getattr(os, name)))
if destination._RENAMEAT2 is not None:
    destination._RENAMEAT2 = counted("renameat2", destination._RENAMEAT2)
apply_plan(src, load_plan(plan), dst, None, force=True, progress=False, split=[tuple(s) for s in split])
counting = False
with open(log, "w") as fh:
    json.dump(calls, fh)
"""


@pytest.mark.slow
def test_a_kill_at_any_step_leaves_nothing_looking_complete_and_resumes_to_identical_bytes(staged, tmp_path):
    """SIGKILL before call K (counted os calls; no timing) for K spread over the whole rewrite and
    every K of its finalisation: no directory appears before every file of every directory is
    done, and the same command finishes to the uninterrupted rewrite's bytes in each directory."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)

    def drive(run, k):
        split = _split(tmp_path / run, staged["per_dir"])
        return subprocess.run([sys.executable, str(driver), str(REPO), str(k), str(staged["src"]), str(staged["plan_path"]),
                               str(tmp_path / run / "a"), str(tmp_path / f"{run}.log"), json.dumps(split)],
                              capture_output=True, text=True), split

    res, split = drive("ref", 0)
    assert res.returncode == 0, res.stderr
    calls = json.loads((tmp_path / "ref.log").read_text())
    want = {n: digests(tmp_path / "ref" / n) for n in "abc"}
    start = max(i for i, (name, arg) in enumerate(calls) if name == "open" and ".relayout.journal.json.tmp-" in arg)
    points = sorted(set(range(1, start, max(1, start // 10))) | set(range(start + 1, len(calls) + 1)))
    published_some = False
    for k in points:
        run = f"k{k}"
        res, split = drive(run, k)
        assert res.returncode == -signal.SIGKILL, (k, calls[k - 1], res.stderr)
        here = tmp_path / run
        if (here / "a").exists():
            assert all((here / n).exists() for n in "bc"), (k, calls[k - 1])
            continue
        for n in "bc":                          # a split directory renamed before the primary is already complete
            if (here / n).exists():
                published_some = True
                assert digests(here / n) == want[n], (k, calls[k - 1])
        said = []
        journal = here / "a.partial" / "relayout.journal.json"
        journaled = (here / "a.partial" / MANIFEST_NAME).exists() or (journal.exists() and json.loads(journal.read_text())["files"])
        apply_plan(staged["src"], load_plan(staged["plan_path"]), here / "a", None, force=True, progress=False,
                   notify=said.append, split=split)
        assert not journaled or (said and "resuming" in said[0]), (k, calls[k - 1])
        assert {n: digests(here / n) for n in "abc"} == want, (k, calls[k - 1])
        assert not any(p.name.endswith(".partial") for p in here.iterdir())
    assert published_some            # a kill landed between the renames and was finished
