"""Manifest hashing throughput vs a plain sequential read of the same files, side by side.

Usage: python benchmarks/bench_manifest.py [--gb 2] [--work /tmp/relayout-bench] [--reps 3]

Prints warm-cache and cold-cache (posix_fadvise DONTNEED) figures and the ratio, and the peak
RSS of a manifest run in a fresh process for two container sizes (memory must be flat).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import big_container, child_peak_rss_mb, drop_file_cache, plain_read, timed

from containers.container import Container
from containers.manifest import build_manifest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/relayout-bench")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    root = big_container(work, args.gb)
    c = Container.open(root)
    paths = list(c.files) + list(c.other_files)
    size = sum(p.stat().st_size for p in paths)
    print(f"container {root}: {size / 1e9:.2f} GB in {len(paths)} files")
    plain_read(paths)
    for label, cold in (("warm", False), ("cold", True)):
        reads, hashes = [], []
        for _ in range(args.reps):  # interleaved pairs: read, hash, read, hash, ...
            if cold:
                drop_file_cache(paths)
            reads.append(size / timed(plain_read, paths)[0] / 1e9)
            if cold:
                drop_file_cache(paths)
            hashes.append(size / timed(build_manifest, c, False)[0] / 1e9)
        r, h = statistics.median(reads), statistics.median(hashes)
        pairs = " ".join(f"{b / a:.2f}" for a, b in zip(reads, hashes))
        print(f"{label}: plain read {r:.2f} GB/s, manifest {h:.2f} GB/s, ratio of medians {h / r:.2f}; "
              f"per-pair ratios {pairs}")
    small = big_container(work, args.gb / 4)
    for label, path in (("small", small), ("large", root)):
        mb = child_peak_rss_mb(
            f"from containers.container import Container; from containers.manifest import build_manifest; "
            f"build_manifest(Container.open({str(path)!r}), progress=False)"
        )
        print(f"peak RSS manifest {label} container: {mb:.0f} MB")


if __name__ == "__main__":
    main()
