"""Crash safety under SIGKILL: kill a rewrite at random points while it writes, resume, compare.

Usage: python benchmarks/kill_resume.py [--kills 100] [--mb 40] [--seed 0] [--work DIR] [--json]

Builds a small multi-file container (about ``--mb`` MB, many output files; format stamps, a model
index and a ``.coli_usage`` history beside the shards), rewrites it once
uninterrupted as the reference, then repeatedly starts ``relayout rewrite`` and SIGKILLs it at a
random moment of its writing phase (after ``DST.partial`` appears). After every kill it checks
that ``DST`` either does not exist or is complete (verified against the source); each next run
resumes. When a run finishes, its ``DST`` must be byte-identical to the reference; it is then
removed and the killing goes on until ``--kills`` kills have landed. Prints the counts and exits
non-zero on any failure. The test suite runs it with 8 kills; docs/BENCHMARKS.md records 100.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import xxhash  # noqa: E402

from containers.container import MANIFEST_NAME, Container  # noqa: E402
from containers.geometry import load_geometry  # noqa: E402
from containers.manifest import build_manifest, write_manifest  # noqa: E402
from containers.model_index import INDEX_NAME, index_bytes  # noqa: E402
from containers.synth import synth_container  # noqa: E402
from relayout.workflows.apply import verify  # noqa: E402
from relayout.planning.packing import PackOptions  # noqa: E402
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace  # noqa: E402
from replay.formats.planfile import save_plan  # noqa: E402


def digests(root: Path) -> dict[str, str]:
    return {p.name: xxhash.xxh3_128_hexdigest(p.read_bytes()) for p in sorted(root.iterdir())}


def prepare(work: Path, mb: float, seed: int) -> tuple[Path, Path]:
    experts = 32
    g = load_geometry("glm-5.2-int4-g64").scaled(moe_layers=3, experts=experts, hidden=1024, ffn=256, vocab=512,
                                                 shard_bytes=2_000_000)
    layers = max(1, round(mb * 1e6 / (experts * g.expert_bytes(g.moe_layers[0]))))
    g = g.scaled(moe_layers=layers, experts=experts, hidden=1024, ffn=256, vocab=512, shard_bytes=2_000_000)
    src = work / "src"
    synth_container(src, g, seed=seed, progress=False, stamp=True)
    c = Container.open(src)     # colibrì's files around the tensors too: an index and the usage history
    (src / INDEX_NAME).write_bytes(index_bytes({"metadata": {"total_size": 0},
                                                "weight_map": {n: c.files[r.file].name for n, r in c.tensors.items()}}))
    (src / ".coli_usage").write_text("".join(f"{layer} {e} {layer + e + 1}\n" for layer, e in sorted(c.experts)))
    write_manifest(build_manifest(Container.open(src), progress=False), src / MANIFEST_NAME)
    trace = synth_trace(g.moe_layers, experts, g.num_experts_per_tok, 400, 4, seed=seed, geometry=g.name)
    plan = work / "plan.json"
    save_plan(make_plan(trace, source_from_container(src), pack=PackOptions(shard_bytes=1_000_000), progress=False), plan)
    return src, plan


def run(kills: int, mb: float, seed: int, work: Path) -> dict:
    src, plan = prepare(work, mb, seed)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def cmd(dst: Path) -> list[str]:
        return [sys.executable, "-m", "relayout", "rewrite", str(src), "--layout", str(plan), "--out", str(dst), "--force"]

    ref = work / "ref"
    proc = subprocess.Popen(cmd(ref), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not ref.with_name("ref.partial").exists() and proc.poll() is None:
        time.sleep(0.001)
    t_partial = time.perf_counter()
    if proc.wait() != 0:
        raise SystemExit(f"reference rewrite failed: {proc.stderr.read().decode()}")
    writing = time.perf_counter() - t_partial
    want = digests(ref)
    rng = random.Random(seed)
    dst = work / "dst"
    partial = dst.with_name("dst.partial")
    stats = dict(kills=0, kills_mid_write=0, kills_after_publish=0, completed_runs=0, attempts=0,
                 complete_looking_incomplete=0, mismatched_results=0, writing_seconds=round(writing, 3))
    t0 = time.perf_counter()
    while stats["kills"] < kills and stats["attempts"] < 5 * kills:
        stats["attempts"] += 1
        resuming = partial.exists()
        proc = subprocess.Popen(cmd(dst), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if resuming:      # its writing starts once it has re-checked what is done and said so
            said = proc.stderr.readline()
            if said and "resuming" not in said:
                raise SystemExit(f"a resumed rewrite failed: {said}{proc.stderr.read()}")
        while not (partial.exists() or dst.exists()) and proc.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 1.2) * writing)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            stats["kills"] += 1
            if dst.exists():
                stats["kills_after_publish"] += 1
            else:
                stats["kills_mid_write"] += 1
        elif proc.returncode != 0:
            raise SystemExit(f"a resumed rewrite failed: {proc.stderr.read()}")
        if dst.exists():      # DST only ever appears complete
            if verify(src, dst, full=True, progress=False)[0]:
                stats["complete_looking_incomplete"] += 1
            if digests(dst) != want:
                stats["mismatched_results"] += 1
            stats["completed_runs"] += 1
            shutil.rmtree(dst)
    res = subprocess.run(cmd(dst), env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"the final resume failed: {res.stderr}")
    stats["completed_runs"] += 1
    stats["final_identical"] = digests(dst) == want
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    stats["ok"] = (stats["kills"] >= kills and stats["final_identical"] and not stats["complete_looking_incomplete"]
                   and not stats["mismatched_results"])
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--mb", type=float, default=40.0, help="approximate container size, MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="work directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="relayout-kill-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        stats = run(args.kills, args.mb, args.seed, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"{stats['kills']} SIGKILLs ({stats['kills_mid_write']} while writing, {stats['kills_after_publish']} after "
              f"the final rename) in {stats['attempts']} runs, {stats['completed_runs']} completed; "
              f"incomplete DST that looked complete: {stats['complete_looking_incomplete']}; results differing from the "
              f"uninterrupted rewrite: {stats['mismatched_results']}; final resume identical: {stats['final_identical']} "
              f"({stats['seconds']} s; writing phase {stats['writing_seconds']} s)")
    return 0 if stats["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
