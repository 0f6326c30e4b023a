"""Trace import speed, full GLM-5.2 planning time and memory before vs after, and Louvain quality.

Usage:
    git worktree add /tmp/relayout-before <rev>     # the code to compare with (read-only use)
    python benchmarks/bench_planning.py --before /tmp/relayout-before [--tokens 20000] [--pairs 3]

Prints, measured in this run:
* ROUTE_TRACE import rate (expert selections/s) of a generated file;
* wall time and peak RSS of a full plan (counting, Louvain, ordering, packing) for the GLM-5.2
  geometry (75 x 256, top-8) from --tokens decode tokens, each in a fresh process, alternating
  the --before checkout and this one --pairs times (median and every pair's ratio);
* the quality of both plans: mean modularity over layers, training and held-out runs per token;
* the three Louvain implementations side by side on the same 75 weight matrices (this checkout's
  compiled one, networkx's ``louvain_communities``, python-louvain's ``best_partition`` when
  installed): time per layer and mean modularity (same function for all three);
* held-out runs per token of louvain vs greedy-modularity (and stock, random) on the same trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO

from containers.geometry import load_geometry
from relayout.planning.coactivation import LayerCounts, weight_matrix
from relayout.planning.louvain import louvain_partition, modularity
from relayout.planning.ordering import runs_per_token
from relayout.planning.plan import make_plan, source_from_geometry, split_sessions, training_rows
from relayout.traces.importer import import_traces
from relayout.traces.synth import fit_atlas, load_atlas, synth_trace
from replay.formats.trace import save_trace


def write_route_trace(path: Path, selections: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rows = selections // 8
    layers = np.tile(np.arange(3, 78), rows // 75 + 1)[:rows]
    ids = np.argsort(rng.random((rows, 256)), axis=1)[:, :8]
    gates = rng.random((rows, 8))
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(f"{i} 0 {layers[i]} " + " ".join(f"{e}:{g:.4f}" for e, g in zip(ids[i], gates[i])) + "\n")


def timed_plan(checkout: Path, trace: Path, out: Path) -> tuple[float, float]:
    """Plan ``trace`` for the GLM-5.2 geometry with the code in ``checkout``, in a fresh process:
    (seconds inside make_plan, peak RSS MB of the process)."""
    code = (f"import sys, time; sys.path.insert(0, {str(checkout)!r}); "
            "from replay.formats.trace import load_trace; from relayout.planning.plan import make_plan, source_from_geometry; "
            "from replay.formats.planfile import save_plan; from containers.geometry import load_geometry; "
            f"tr = load_trace({str(trace)!r}); src = source_from_geometry(load_geometry('glm-5.2-int4-row')); "
            "t = time.perf_counter(); p = make_plan(tr, src, 'louvain', progress=False); s = time.perf_counter() - t; "
            f"save_plan(p, {str(out)!r}); "
            "print('SECONDS', s); print('VmHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    text = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=checkout).stdout
    fields = dict(line.split(None, 1) for line in text.splitlines() if line.startswith(("SECONDS", "VmHWM")))
    return float(fields["SECONDS"]), int(fields["VmHWM"]) / 1024


def held_out_runs(plan: dict, trace, held_mask, layers) -> float:
    """Mean over layers of the held-out rows' runs per token in the plan's orders."""
    return float(np.mean([runs_per_token(trace.experts[trace.layer_rows(l, held_mask)].astype(np.int64),
                                         np.array(plan["orders"][str(l)])) for l in layers]))


def plan_quality(plan: dict, trace, held_mask, layers) -> dict:
    mods = [v["modularity"] for v in plan["layers"].values() if v["modularity"] is not None]
    train = [v["train_runs_per_token"] for v in plan["layers"].values() if v["train_runs_per_token"] is not None]
    return {"modularity": float(np.mean(mods)), "train_runs": float(np.mean(train)),
            "held_runs": held_out_runs(plan, trace, held_mask, layers)}


def louvain_side_by_side(trace, train_mask, layers) -> None:
    import networkx as nx

    try:
        import community as python_louvain
    except ImportError:
        python_louvain = None
    mats = []
    for layer in layers:
        W = weight_matrix(LayerCounts.of_rows(trace.experts[trace.layer_rows(layer, train_mask)].astype(np.int64), 256))
        keep = np.flatnonzero(W.sum(axis=1) > 0)
        mats.append(W[np.ix_(keep, keep)])
    louvain_partition(mats[0])  # load (or build) the compiled code outside the timing

    def ours(W):
        return louvain_partition(W, 1.0, 0)

    def labels(W, groups):
        out = np.zeros(len(W), dtype=np.int64)
        for c, g in enumerate(groups):
            out[list(g)] = c
        return out

    def networkx(W):
        G = nx.from_numpy_array(W)
        return labels(W, nx.community.louvain_communities(G, weight="weight", resolution=1.0, seed=0))

    def python(W):
        G = nx.from_numpy_array(W)
        part = python_louvain.best_partition(G, weight="weight", resolution=1.0, random_state=0)
        groups: dict[int, list[int]] = {}
        for node, c in part.items():
            groups.setdefault(c, []).append(node)
        return labels(W, groups.values())

    impls = {"relayout.planning.louvain (compiled, dense)": ours, "networkx louvain_communities": networkx}
    if python_louvain is not None:
        impls["python-louvain best_partition"] = python
    print(f"Louvain on the same {len(mats)} layer matrices (graph built from the matrix inside the timing for the graph libraries):")
    for name, fn in impls.items():
        t = time.perf_counter()
        parts = [fn(W) for W in mats]
        secs = time.perf_counter() - t
        q = np.mean([modularity(W, p) for W, p in zip(mats, parts)])
        print(f"  {name:38s} {secs / len(mats) * 1e3:8.1f} ms/layer, mean modularity {q:.5f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--import-selections", type=int, default=4_000_000)
    ap.add_argument("--before", type=Path, help="a checkout of the code to compare with (git worktree add DIR REV)")
    ap.add_argument("--pairs", type=int, default=3, help="alternating before/after plan runs")
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
    path.unlink()

    g = load_geometry("glm-5.2-int4-row")
    atlas = load_atlas("glm-5.2")
    params, report = fit_atlas(atlas, seed=0)
    trace = synth_trace(g.moe_layers, 256, 8, args.tokens, 10, seed=1, params=params, base_heat=atlas.heat, geometry=g.name)
    tpath = work / "glm.rt"
    save_trace(trace, tpath)
    print(f"GLM-5.2 trace: {args.tokens} tokens fitted to the atlas ({'; '.join(report.lines())})")
    train, held = split_sessions(len(trace.sessions), 0.7)
    train_mask, held_mask = training_rows(trace, train), training_rows(trace, held)

    checkouts = {"after": REPO}
    if args.before:
        checkouts = {"before": args.before.resolve(), "after": REPO}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in checkouts}
    for _ in range(args.pairs):
        for name, checkout in checkouts.items():
            runs[name].append(timed_plan(checkout, tpath, work / f"plan-{name}.json"))
    print(f"full plan, GLM-5.2 geometry (75 x 256, top-8), {int(train_mask.sum())} training tokens, "
          f"{args.pairs} alternating runs each (seconds inside make_plan; peak RSS of the process):")
    for name, r in runs.items():
        secs = [s for s, _ in r]
        print(f"  {name:6s} ({checkouts[name]}): median {statistics.median(secs):.1f} s (runs {', '.join(f'{s:.1f}' for s in secs)}), "
              f"peak RSS {max(m for _, m in r):.0f} MB")
    if "before" in runs:
        ratios = [b[0] / a[0] for b, a in zip(runs["before"], runs["after"])]
        print(f"  speedup before/after: median {statistics.median(ratios):.2f}x (pairs {', '.join(f'{x:.2f}' for x in ratios)}); target < 30 s")
    quality = {name: plan_quality(json.loads((work / f"plan-{name}.json").read_text()), trace, held_mask, g.moe_layers)
               for name in checkouts}
    for name, q in quality.items():
        print(f"  {name:6s} plan: mean modularity {q['modularity']:.5f}, training runs/token {q['train_runs']:.4f}, "
              f"held-out runs/token {q['held_runs']:.4f}")

    louvain_side_by_side(trace, train_mask, g.moe_layers)

    src = source_from_geometry(g)
    held_runs = {"louvain": quality["after"]["held_runs"]}
    for method in ("greedy-modularity", "stock", "random"):
        held_runs[method] = held_out_runs(make_plan(trace, src, method, progress=False), trace, held_mask, g.moe_layers)
    print("held-out runs per token (mean over 75 layers): " + ", ".join(f"{k} {v:.3f}" for k, v in held_runs.items()))
    print(f"ratio louvain / greedy-modularity = {held_runs['louvain'] / held_runs['greedy-modularity']:.3f} (lower is better)")


if __name__ == "__main__":
    main()
