"""Rewrite and verify throughput against plain copies and reads, side by side, plus peak memory.

Usage: python benchmarks/bench_rewrite.py [--gb 2] [--work /tmp/relayout-bench] [--reps 5]

For a GLM-5.2 int4-row container with full-size experts (``--gb`` routed GB), in one run with
interleaved repetitions:
* ``cp -r SRC COPY`` (with and without the ``sync`` that makes it durable) vs
  ``relayout rewrite SRC --out DST`` (hashing on, fsynced), same disk;
* a plain sequential read of SRC and DST vs ``relayout verify SRC DST`` (which hashes both);
* a plain sequential read of SRC vs ``relayout manifest SRC`` (to another path);
* peak RSS of the rewrite, for this container and one a quarter its size.
The source is evicted from the page cache (posix_fadvise) before each timed pass. Every
relayout figure is a whole command in a fresh process (its start-up included); the targets:
each ratio >= 0.95, as the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, big_container, child_peak_rss_mb, drop_file_cache, plain_read

from containers.container import MANIFEST_NAME, Container
from containers.manifest import build_manifest, write_manifest
from relayout.planning.packing import PackOptions
from relayout.planning.plan import make_plan, source_from_container
from relayout.traces.synth import synth_trace
from replay.formats.planfile import save_plan


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file())


def prepare(work: Path, gb: float) -> tuple[Path, Path]:
    src = big_container(work, gb)
    if not (src / MANIFEST_NAME).exists():
        write_manifest(build_manifest(Container.open(src)), src / MANIFEST_NAME)
    plan = src.with_name(src.name + ".plan.json")
    if not plan.exists():
        c = Container.open(src)
        layers = [l for l in c.routed_layers if l < c.config.num_hidden_layers]
        tr = synth_trace(layers, c.config.n_routed_experts, 8, 2000, 6, seed=1)
        save_plan(make_plan(tr, source_from_container(src), pack=PackOptions(shard_bytes=1_000_000_000), progress=False), plan)
    return src, plan


def settle(*roots: Path) -> None:
    """Flush earlier writes, let writeback finish, evict the inputs: every timed pass starts alike."""
    os.sync()
    time.sleep(2)
    for root in roots:
        drop_file_cache(files_of(root))


def run(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/relayout-bench")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src, plan = prepare(work, args.gb)
    size = sum(p.stat().st_size for p in files_of(src))
    print(f"container {src}: {size / 1e9:.2f} GB")
    rel = [sys.executable, "-m", "relayout"]
    cp_t, cps_t, rw_t, rd_t, vf_t, rs_t, mf_t = [], [], [], [], [], [], []
    for _ in range(args.reps):
        # each timed pass writes into the same free space: the previous output is deleted and the
        # deletion's writeback settled first
        shutil.rmtree(work / "dst", ignore_errors=True)
        settle(src)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(work / "copy")], check=True)
        cp_t.append(time.perf_counter() - t)
        os.sync()  # cp leaves its bytes in the page cache; the rewrite's fsyncs make them durable
        cps_t.append(time.perf_counter() - t)
        shutil.rmtree(work / "copy")
        settle(src)
        rw_t.append(run(rel + ["rewrite", str(src), "--layout", str(plan), "--out", str(work / "dst"), "--force"]))
        both = files_of(src) + files_of(work / "dst")
        settle(src, work / "dst")
        t = time.perf_counter()
        plain_read(both)
        rd_t.append(time.perf_counter() - t)
        settle(src, work / "dst")
        vf_t.append(run(rel + ["verify", str(src), str(work / "dst")]))
        settle(src)
        t = time.perf_counter()
        plain_read(files_of(src))
        rs_t.append(time.perf_counter() - t)
        settle(src)
        mf_t.append(run(rel + ["manifest", str(src), "-o", str(work / "manifest.json")]))
    def pairs(a, b):
        return statistics.median(x / y for x, y in zip(a, b)), " ".join(f"{x / y:.2f}" for x, y in zip(a, b))

    cp, cps, rw, rd, vf, rs, mf = (statistics.median(x) for x in (cp_t, cps_t, rw_t, rd_t, vf_t, rs_t, mf_t))
    print(f"cp -r: {size / cp / 1e9:.2f} GB/s (to the page cache), cp -r + sync: {size / cps / 1e9:.2f} GB/s (durable); "
          f"relayout rewrite (hashing on, fsynced): {size / rw / 1e9:.2f} GB/s (medians)")
    for label, a, b in (("rewrite vs cp -r + sync", cps_t, rw_t), ("rewrite vs cp -r (not durable)", cp_t, rw_t),
                        ("verify vs plain read of SRC+DST", rd_t, vf_t), ("manifest vs plain read of SRC", rs_t, mf_t)):
        med, each = pairs(a, b)
        print(f"{label}: speed ratio median {med:.2f} (per pair: {each}); target >= 0.95")
    print(f"plain read of SRC+DST: {2 * size / rd / 1e9:.2f} GB/s; relayout verify: {2 * size / vf / 1e9:.2f} GB/s; "
          f"plain read of SRC: {size / rs / 1e9:.2f} GB/s; relayout manifest: {size / mf / 1e9:.2f} GB/s (medians)")
    small_src, small_plan = prepare(work, args.gb / 4)
    for label, s, p in (("small", small_src, small_plan), ("large", src, plan)):
        d = work / f"mem-{label}"
        shutil.rmtree(d, ignore_errors=True)
        mb = child_peak_rss_mb(
            f"from relayout.workflows.apply import apply_plan; from replay.formats.planfile import load_plan; "
            f"apply_plan({str(s)!r}, load_plan({str(p)!r}), {str(d)!r}, None, force=True, progress=False)")
        shutil.rmtree(d, ignore_errors=True)
        print(f"peak RSS of a rewrite, {label} container ({sum(x.stat().st_size for x in files_of(s)) / 1e9:.2f} GB): {mb:.0f} MB")
    for d in (work / "copy", work / "dst"):
        shutil.rmtree(d, ignore_errors=True)
    (work / "manifest.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
