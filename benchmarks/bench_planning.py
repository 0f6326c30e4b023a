"""Trace import speed, full GLM-5.2 planning time and memory, and Louvain vs greedy-modularity.

Usage: python benchmarks/bench_planning.py [--tokens 20000] [--import-selections 4000000]

Prints, measured in this run:
* ROUTE_TRACE import rate (expert selections/s) of a generated file;
* wall time and peak RSS of a full plan (graphs, Louvain, ordering, packing) for the GLM-5.2
  geometry (75 x 256, top-8) from --tokens decode tokens, in a fresh process;
* held-out runs per token of louvain vs greedy-modularity (and stock, random) on the same trace.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from common import child_peak_rss_mb

from containers.geometry import load_geometry
from relayout.ordering import runs_per_token
from relayout.plan import make_plan, source_from_geometry, split_sessions, training_rows
from relayout.trace_import import import_traces
from relayout.trace_synth import fit_atlas, load_atlas, synth_trace
from replay.trace import save_trace


def write_route_trace(path: Path, selections: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rows = selections // 8
    layers = np.tile(np.arange(3, 78), rows // 75 + 1)[:rows]
    ids = np.argsort(rng.random((rows, 256)), axis=1)[:, :8]
    gates = rng.random((rows, 8))
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(f"{i} 0 {layers[i]} " + " ".join(f"{e}:{g:.4f}" for e, g in zip(ids[i], gates[i])) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--import-selections", type=int, default=4_000_000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relayout-bench-plan-"))

    path = work / "route.txt"
    write_route_trace(path, args.import_selections)
    import_traces([path])  # warm the page cache and numpy
    times = []
    for _ in range(3):
        t = time.perf_counter()
        tr, _ = import_traces([path])
        times.append(time.perf_counter() - t)
    rate = tr.n_selections / min(times)
    print(f"ROUTE_TRACE import: {tr.n_selections:,} selections ({path.stat().st_size / 1e6:.0f} MB) in {min(times):.2f} s "
          f"= {rate / 1e6:.2f} M selections/s (best of 3; target >= 2 M/s)")

    g = load_geometry("glm-5.2-int4-row")
    atlas = load_atlas("glm-5.2")
    params, report = fit_atlas(atlas, seed=0)
    trace = synth_trace(g.moe_layers, 256, 8, args.tokens, 10, seed=1, params=params, base_heat=atlas.heat, geometry=g.name)
    tpath = work / "glm.rt"
    save_trace(trace, tpath)
    print(f"GLM-5.2 trace: {args.tokens} tokens fitted to the atlas ({'; '.join(report.lines())})")
    code = (f"import time; from replay.trace import load_trace; from relayout.plan import make_plan, source_from_geometry; from replay.planfile import save_plan; "
            f"from containers.geometry import load_geometry; tr = load_trace({str(tpath)!r}); t = time.perf_counter(); "
            f"p = make_plan(tr, source_from_geometry(load_geometry('glm-5.2-int4-row')), 'louvain', progress=False); "
            f"save_plan(p, {str(work / 'plan.json')!r}); open({str(work / 'time')!r}, 'w').write(str(time.perf_counter() - t))")
    rss = child_peak_rss_mb(code)
    secs = float((work / "time").read_text())
    print(f"full plan, GLM-5.2 geometry (75 x 256, top-8), {int(args.tokens * 0.7)} training tokens: "
          f"{secs:.1f} s, peak RSS {rss:.0f} MB (targets < 60 s, < 2 GB)")

    src = source_from_geometry(g)
    _, held = split_sessions(len(trace.sessions), 0.7)
    fm = training_rows(trace, held)
    runs = {}
    for method in ("louvain", "greedy-modularity", "stock", "random"):
        if method == "louvain":
            plan = json.loads((work / "plan.json").read_text())
        else:
            plan = make_plan(trace, src, method, progress=False)
        r = [runs_per_token(trace.experts[trace.layer_rows(l, fm)].astype(np.int64), np.array(plan["orders"][str(l)])) for l in g.moe_layers]
        runs[method] = float(np.mean(r))
    print("held-out runs per token (mean over 75 layers): " + ", ".join(f"{k} {v:.3f}" for k, v in runs.items()))
    print(f"ratio louvain / greedy-modularity = {runs['louvain'] / runs['greedy-modularity']:.3f} (lower is better)")


if __name__ == "__main__":
    main()
