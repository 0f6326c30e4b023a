"""ROUTE_TRACE import: expert selections per second and peak RSS, this tree against a baseline commit.

Usage: python benchmarks/bench_trace_import.py [--selections 10000000] [--large 100000000]
                                               [--baseline f117103] [--pairs 3] [--tree REV]

Writes a GLM-5.2-shaped ROUTE_TRACE text (75 layers, top-8 of 256, one decode row per call,
``<id>:<gate>`` with 4-digit gates) of --selections expert selections, then imports it
(``relayout.traces.importer.import_traces``: parse, checks, assembly, validation) in fresh
processes, alternating this tree with --baseline's (``git archive``), --pairs times, and prints each run's
selections/s and peak RSS (VmHWM of the child) and the medians side by side. With --large, this
tree's importer alone also imports a text of that many selections (the baseline would need about
30x the text's size in RAM). ``--tree REV`` measures that commit's tree instead of the working
checkout (edits made meanwhile in a shared checkout then do not reach the runs). Scratch files go
to a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, extract

TARGET_SELECTIONS_PER_S = 2e6


def write_route_trace(path: Path, selections: int, seed: int = 0) -> int:
    """A ROUTE_TRACE of ``selections`` selections (a multiple of 8) in one session; returns its bytes."""
    rng = np.random.default_rng(seed)
    rows = selections // 8
    block = 75 * 1000
    # one block of selection texts, reused with fresh call numbers (formatting 10^8 gates one by one is slow)
    ids = np.argsort(rng.random((block, 256)), axis=1)[:, :8]
    gates = rng.random((block, 8))
    sel = [" ".join(f"{e}:{g:.4f}" for e, g in zip(ids[i], gates[i])) for i in range(block)]
    with open(path, "w") as fh:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            fh.write("".join(f"{start + i} 0 {3 + (start + i) % 75} {sel[i]}\n" for i in range(n)))
    return path.stat().st_size


def run_import(tree: Path, path: Path) -> tuple[float, float, int]:
    """Import ``path`` in a fresh process with the importer of ``tree``; returns (seconds, peak RSS
    MB, selections)."""
    module = "relayout.traces.importer" if (tree / "relayout" / "traces").is_dir() else "relayout.trace_import"  # a baseline's
    code = (f"import sys, time, importlib; sys.path.insert(0, {str(tree)!r}); ti = importlib.import_module({module!r}); "
            f"from pathlib import Path; "
            f"t = time.perf_counter(); tr, _ = ti.import_traces([Path({str(path)!r})], 'route'); "
            f"dt = time.perf_counter() - t; n = tr.n_selections; "
            f"hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
            f"print(dt, int(hwm) / 1024, n)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tree).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--selections", type=int, default=10_000_000)
    ap.add_argument("--large", type=int, default=0)
    ap.add_argument("--baseline", default="f117103")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tree", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relayout-bench-import-"))
    try:
        old = extract(args.baseline, work / "baseline")
        tree = extract(args.tree, work / "tree") if args.tree else REPO
        text = work / "t.route"
        size = write_route_trace(text, args.selections)
        print(f"ROUTE_TRACE text: {args.selections:,} selections, {size / 1e6:.0f} MB; tree {args.tree or 'working checkout'}")
        rates = {"this tree": [], f"baseline {args.baseline}": []}
        peaks = {k: [] for k in rates}
        for pair in range(args.pairs):
            for label, where in (("this tree", tree), (f"baseline {args.baseline}", old)):
                dt, mb, n = run_import(where, text)
                assert n == args.selections
                rates[label].append(n / dt)
                peaks[label].append(mb)
                print(f"  pair {pair + 1}, {label}: {dt:.2f} s = {n / dt / 1e6:.2f} M selections/s, "
                      f"peak RSS {mb:.0f} MB ({mb * 1e6 / size:.1f}x the text)")
        for label in rates:
            r, m = statistics.median(rates[label]), statistics.median(peaks[label])
            print(f"median, {label}: {r / 1e6:.2f} M selections/s ({r / TARGET_SELECTIONS_PER_S:.2f}x the 2 M/s target), "
                  f"peak RSS {m:.0f} MB ({m * 1e6 / size:.1f}x the text)")
        mine, base = (statistics.median(rates[k]) for k in rates)
        print(f"speed ratio this tree / baseline: {mine / base:.2f}")
        text.unlink()
        if args.large:
            big = work / "big.route"
            size = write_route_trace(big, args.large, seed=1)
            dt, mb, n = run_import(tree, big)
            assert n == args.large
            print(f"this tree, {args.large:,} selections ({size / 1e9:.2f} GB of text): {dt:.1f} s = "
                  f"{n / dt / 1e6:.2f} M selections/s, peak RSS {mb:.0f} MB ({mb * 1e6 / size:.2f}x the text; "
                  f"the trace's own arrays are {n * 6 / 1e6 + n / 8 * 10 / 1e6:.0f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
