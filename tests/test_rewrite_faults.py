"""Faults injected into a running rewrite at fixed points: kills, Ctrl-C, a source that shrinks.

The rewrite runs in a subprocess whose ``os`` calls that create, write, sync, rename or remove
(and the ``renameat2`` of the final rename) are counted; just before call number K the run is
SIGKILLed (every K from the last journal save to the end: every step of finalisation), gets a
SIGINT, or has its source files truncated. A stopped state is then resumed by an ordinary
rewrite and must give exactly the uninterrupted rewrite's bytes. No timing is involved: where
each fault lands is fixed by the count.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import xxhash
from conftest import REPO, small_geometry, source_with_manifest

from containers.container import MANIFEST_NAME
from containers.errors import InputError
from relayout.workflows.apply import apply_plan
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import load_plan, save_plan

DRIVER = r"""
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import containers.destination as destination
from relayout.workflows.apply import apply_plan
from replay.formats.planfile import load_plan

kill_at, src, plan, dst, log = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
action = sys.argv[7]
sig = getattr(signal, action, None)
calls = []
counting = True

def shrink_sources():
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            path = os.path.join(src, name)
            os.truncate(path, os.stat(path).st_size // 2)

def counted(name, fn):
    def call(*a, **k):
        if counting:
            calls.append([name, str(a[0]) if a else ""])
            if len(calls) == kill_at:
                if sig is None:
                    shrink_sources()
                else:
                    os.kill(os.getpid(), sig)
        return fn(*a, **k)
    return call

for name in ("open", "write", "fsync", "replace", "rename", "unlink", "mkdir", "rmdir", "ftruncate"):
    setattr(os, name, counted(name, getattr(os, name)))
if destination._RENAMEAT2 is not None:
    destination._RENAMEAT2 = counted("renameat2", destination._RENAMEAT2)
if sig == signal.SIGKILL:
    apply_plan(src, load_plan(plan), dst, None, force=True, progress=False)
    status = 0
else:
    from relayout.cli import main
    status = main(["rewrite", src, "--layout", plan, "--out", dst, "--force"])
counting = False
with open(log, "w") as fh:
    json.dump(calls, fh)
sys.exit(status)
"""


def digests(root):
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes()) for p in sorted(root.iterdir())}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("final")
    g = small_geometry(moe_layers=2, experts=16, ffn=128)
    src = source_with_manifest(root / "src", g, seed=3)
    tr = synth_trace(g.moe_layers, 16, g.num_experts_per_tok, 300, 4, seed=1, geometry=g.name)
    plan = root / "plan.json"
    save_plan(make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=1_000_000), progress=False), plan)
    return root, src, plan


def _drive(root, src, plan, dst, kill_at, sig="SIGKILL"):
    """Run the driver; ``sig``: SIGKILL, SIGINT or TRUNCATE (halve every source shard) at call ``kill_at``."""
    log = root / f"calls-{sig}-{kill_at}.json"
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    res = subprocess.run([sys.executable, str(driver), str(REPO), str(kill_at), str(src), str(plan), str(dst), str(log), sig],
                         capture_output=True, text=True)
    return res, log


@pytest.mark.slow
def test_a_kill_before_every_step_of_finalisation_resumes_to_identical_bytes(planned, tmp_path):
    root, src, plan = planned
    ref = tmp_path / "ref"
    res, log = _drive(root, src, plan, ref, 0)
    assert res.returncode == 0, res.stderr
    calls = json.loads(log.read_text())
    want = digests(ref)
    # finalisation: from the last journal save (after the last file) to the end
    start = max(i for i, (name, arg) in enumerate(calls) if name == "open" and ".relayout.journal.json.tmp-" in arg)
    steps = list(range(start + 1, len(calls) + 1))     # kill before call number K (1-based)
    assert [c[0] for c in calls[start:]].count("unlink") >= 1 and any(c[0] in ("renameat2", "rename") for c in calls[start:])
    states = set()
    for k in steps:
        dst = tmp_path / f"dst-{k}"
        res, _ = _drive(root, src, plan, dst, k)
        assert res.returncode == -signal.SIGKILL, (k, calls[k - 1], res.stderr)
        partial = dst.with_name(dst.name + ".partial")
        if not dst.exists():
            names = set(os.listdir(partial))
            states.add(("journal" if "relayout.journal.json" in names else "") + ("+manifest" if MANIFEST_NAME in names else ""))
            said = []
            apply_plan(src, load_plan(plan), dst, None, force=True, progress=False, notify=said.append)
            assert said and "resuming" in said[0], (k, calls[k - 1])
        else:
            states.add("published")
        assert not partial.exists(), (k, calls[k - 1])
        assert digests(dst) == want, (k, calls[k - 1])
    # the kills landed in every state finalisation passes through, the journal-less one included
    assert {"journal", "journal+manifest", "+manifest", "published"} <= states, states


@pytest.mark.slow
def test_ctrl_c_at_any_call_of_a_rewrite_is_one_line_and_status_130(planned, tmp_path):
    """SIGINT at 12 calls spread over the whole rewrite and at each call of its finalisation: one
    line, status 130, no DST unless it is complete; the next run finishes to identical bytes."""
    root, src, plan = planned
    ref = tmp_path / "ref"
    res, log = _drive(root, src, plan, ref, 0, "SIGINT")
    assert res.returncode == 0, res.stderr
    calls = json.loads(log.read_text())
    want = digests(ref)
    start = max(i for i, (name, arg) in enumerate(calls) if name == "open" and ".relayout.journal.json.tmp-" in arg)
    points = sorted(set(range(1, len(calls), max(1, len(calls) // 12))) | set(range(start + 1, len(calls) + 1)))
    for k in points:
        dst = tmp_path / f"dst-{k}"
        res, _ = _drive(root, src, plan, dst, k, "SIGINT")
        if res.returncode == 0:          # the signal came after the last step that could be interrupted
            assert digests(dst) == want
            continue
        assert res.returncode == 130 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, (k, calls[k - 1], res.stderr)
        if not dst.exists():
            apply_plan(src, load_plan(plan), dst, None, force=True, progress=False)
        assert digests(dst) == want, (k, calls[k - 1])


def test_a_source_truncated_under_a_running_rewrite_is_one_line_naming_it(planned, tmp_path):
    root, src, plan = planned
    res, log = _drive(root, src, plan, tmp_path / "ref", 0, "SIGINT")
    assert res.returncode == 0, res.stderr
    calls = json.loads(log.read_text())
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    res, _ = _drive(root, copy, plan, tmp_path / "dst", len(calls) // 3, "TRUNCATE")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert ".safetensors" in res.stderr and str(copy) in res.stderr, res.stderr
    assert not (tmp_path / "dst").exists()


def test_a_journal_less_partial_is_finished_only_with_this_rewrites_manifest(planned, tmp_path):
    root, src, plan = planned
    ref = tmp_path / "ref"
    apply_plan(src, load_plan(plan), ref, None, force=True, progress=False)
    manifest = json.loads((ref / MANIFEST_NAME).read_text())
    for i, (edit, says) in enumerate([(lambda m: m["rewrite"].update(plan_digest="0" * 32), "another plan or source"),
                                      (lambda m: m.update(format="something else"), "not a manifest of a relayout rewrite"),
                                      (None, "unreadable")]):
        partial = tmp_path / f"d{i}.partial"
        shutil.copytree(ref, partial)
        if edit is None:
            (partial / MANIFEST_NAME).write_text("{")
        else:
            m = json.loads(json.dumps(manifest))
            edit(m)
            (partial / MANIFEST_NAME).write_text(json.dumps(m))
        with pytest.raises(InputError, match=says):
            apply_plan(src, load_plan(plan), tmp_path / f"d{i}", None, force=True, progress=False)
        assert not (tmp_path / f"d{i}").exists() and sorted(os.listdir(partial)) == sorted(os.listdir(ref))
