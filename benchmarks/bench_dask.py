"""Sweeps and pooled counting on a local Dask cluster vs the serial path, side by side.

Usage: python benchmarks/bench_dask.py [--workers 2] [--pairs 3] [--files 24] [--tokens 4000]

Prints, measured in this run:
* the local cluster's start-up time (``replay.execution.open_executor('local')``);
* the regime sweep (``replay.evaluation.gate.sweep``, 16 cells: 2 RAM budgets x 4 worker counts x coalesce)
  of a GLM-5.2-shaped plan (75 layers x 256 experts, top-8, --tokens decode tokens), serial in
  this process and on the cluster, alternating --pairs times: seconds, speedup, and whether the
  two tables are identical (they must be);
* pooled counting of --files trace files (``relayout.planning.training.pooled_training``), serial and on
  the cluster, alternating: seconds, speedup, identical counts.

Both paths load the replay model's compiled code before timing (this process, and every worker
through ``Client.run``). Run it from a checkout nobody edits while it runs (``git worktree add``):
numba's cache is keyed by the source files, so an edit makes fresh worker processes compile
again. The machine's cores are shared with whatever else runs on it: compare the ratios,
measured side by side, not the seconds across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO  # noqa: F401  (puts this checkout first on sys.path)

from containers.geometry import load_geometry
from relayout.planning.plan import make_plan, source_from_geometry
from relayout.traces.synth import fit_atlas, load_atlas, synth_trace
from relayout.planning.training import pooled_training
from replay.execution import SerialExecutor, open_executor
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import sweep
from replay.formats.planfile import load_plan, save_plan
from replay.formats.trace import save_trace

RAM_GB = [0.0, 64.0]
WORKERS = [1, 2, 8, 16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2, help="Dask worker processes (default 2: this machine's cores)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relayout-bench-dask-"))

    g = load_geometry("glm-5.2-int4-row")
    atlas = load_atlas("glm-5.2")
    params, _ = fit_atlas(atlas, seed=0)
    trace = synth_trace(g.moe_layers, 256, 8, args.tokens, 12, seed=1, params=params, base_heat=atlas.heat, geometry=g.name)
    save_plan(make_plan(trace, source_from_geometry(g), progress=False), work / "plan.json")
    plan = load_plan(work / "plan.json")
    device = load_device("mac-pro-2019-applraid-4x")
    sweep_args = (plan, trace, device, RuntimeConfig(), RAM_GB, WORKERS)
    cells = len(RAM_GB) * len(WORKERS) * 2
    sweep(plan, trace, device, RuntimeConfig(), [0.0], [1])  # load the compiled model in this process

    paths = []
    for i in range(args.files):
        t = synth_trace(g.moe_layers, 256, 8, 1000, 4, seed=100 + i, params=params, base_heat=atlas.heat, geometry=g.name)
        paths.append(str(work / f"pool-{i:03d}.rt"))
        save_trace(t, paths[-1])
    geometry = plan.geometry

    t = time.perf_counter()
    with open_executor("local", workers=args.workers) as cluster:
        startup = time.perf_counter() - t
        print(f"{cluster.name}: started in {startup:.1f} s")
        cluster.client.run(sweep, plan, trace, device, RuntimeConfig(), [0.0], [1])  # every worker loads the compiled model
        times = {"serial sweep": [], "dask sweep": [], "serial count": [], "dask count": []}
        identical_sweep = identical_count = True
        for _ in range(args.pairs):
            t = time.perf_counter()
            a = sweep(*sweep_args)
            times["serial sweep"].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = sweep(*sweep_args, executor=cluster)
            times["dask sweep"].append(time.perf_counter() - t)
            identical_sweep &= json.dumps([c.to_json() for c in a]) == json.dumps([c.to_json() for c in b])
            t = time.perf_counter()
            ca = pooled_training(paths, geometry, 0.7, SerialExecutor())
            times["serial count"].append(time.perf_counter() - t)
            t = time.perf_counter()
            cb = pooled_training(paths, geometry, 0.7, cluster)
            times["dask count"].append(time.perf_counter() - t)
            identical_count &= (np.array_equal(ca.counts.keys, cb.counts.keys) and np.array_equal(ca.counts.counts, cb.counts.counts)
                                and ca.sessions == cb.sessions)
    for what, n, same in (("sweep", f"{cells} cells, {args.tokens} tokens, 75 x 256", identical_sweep),
                          ("count", f"{args.files} trace files x 1000 tokens, 75 x 256", identical_count)):
        s, d = times[f"serial {what}"], times[f"dask {what}"]
        ratios = [x / y for x, y in zip(s, d)]
        print(f"{what} ({n}): serial median {statistics.median(s):.1f} s, Dask ({args.workers} workers) median "
              f"{statistics.median(d):.1f} s; speedup median {statistics.median(ratios):.2f}x "
              f"(pairs {', '.join(f'{r:.2f}' for r in ratios)}); results identical: {same}")
    print(f"(the cluster's start-up, {startup:.1f} s, is paid once per command and is not in the Dask times)")


if __name__ == "__main__":
    main()
