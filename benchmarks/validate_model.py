"""Model validation: replay-predicted S against S measured on real reads, per cell.

Usage: python benchmarks/validate_model.py [--gb 2] [--work /tmp/relayout-bench] [--tokens 40]

Builds (or reuses) a GLM-5.2 int4-row container with full-size 18.9 MB experts, calibrates the
disk holding it, rewrites it into two more layouts (Louvain and random orders), then for each
layout x RAM budget (no cache, and a quarter of the routed bytes) measures S cold with
``relayout measure`` semantics and predicts it with the replay model on the calibrated profile,
for the same held-out steps. Also measures tracing overhead (trace on vs off, paired).
``--prefetch oracle,coupled`` adds cells with a prefetch thread (measured) and source (modelled),
and prints the timely required-byte recall of both.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from common import big_container

from containers.container import MANIFEST_NAME, Container
from containers.manifest import build_manifest, write_manifest
from relayout.workflows.apply import apply_plan
from relayout.planning.plan import make_plan, source_from_container
from relayout.render.measurements import format_calibration
from relayout.traces.synth import SynthParams, synth_trace
from replay.physical.calibrate import calibrate
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.evaluation.gate import evaluation_forwards, training_coupling
from replay.physical.measure import measure
from replay.model.metrics import step_table, summarize
from replay.formats.planfile import load_plan, save_plan
from replay.physical.stalltrace import report


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--work", default="/tmp/relayout-bench")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="measured repetitions per cell (interleaved)")
    ap.add_argument("--prefetch", default="none", help="comma-separated prefetch sources to validate (none, oracle, coupled)")
    ap.add_argument("--ram", default="0,0.25", help="comma-separated RAM budgets, as fractions of the routed bytes")
    ap.add_argument("--layouts", default="stock,louvain,random")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = big_container(work, args.gb)
    if not (src / MANIFEST_NAME).exists():
        write_manifest(build_manifest(Container.open(src)), src / MANIFEST_NAME)
    c = Container.open(src)
    layers = [l for l in c.routed_layers if l < c.config.num_hidden_layers]
    trace = synth_trace(layers, c.config.n_routed_experts, 8, 8 * 60, 8, seed=5, params=SynthParams(clique_strength=0.8))
    profile_path = work / "calibrated.json"
    profile = calibrate(src.parent, size_mb=1024, seconds=0.3, name="this-disk")
    profile_path.write_text(json.dumps(profile))
    print(format_calibration(profile))
    device = load_device(str(profile_path))

    layouts = {}
    methods = args.layouts.split(",")
    for method in (["stock"] + [m for m in methods if m != "stock"]):
        plan_path = work / f"validate-{method}.plan.json"
        save_plan(make_plan(trace, source_from_container(src), method, train_fraction=0.75, progress=False), plan_path)
        plan = load_plan(plan_path)
        if method == "stock":
            layouts[method] = (src, plan.stock, plan)
            continue
        dst = work / f"validate-{method}"
        if dst.exists():
            shutil.rmtree(dst)
        apply_plan(src, plan, dst, None, force=True, progress=False)
        layouts[method] = (dst, plan.layout, plan)

    mask, _ = evaluation_forwards(trace, [layouts["stock"][2]])
    mask &= np.cumsum(mask) <= args.tokens
    routed = sum(e.nbytes for e in c.experts.values() if e.layer in set(layers))
    coupling = training_coupling(trace, layouts["stock"][2])
    print(f"\n{'layout':<9}{'RAM GB':>8}{'prefetch':>9}{'measured S ms (each rep)':>30}{'predicted S ms':>16}{'ratio':>8}"
          f"{'recall meas/pred':>18}")
    for prefetch in args.prefetch.split(","):
        for frac in _floats(args.ram):
            ram = int(routed * frac)
            cfg = RuntimeConfig(ram_bytes=ram, workers=args.workers, prefetch=prefetch)
            measured = {m: [] for m in layouts}
            recall = {m: [] for m in layouts}
            for rep in range(args.reps):
                for method, (path, _, _) in layouts.items():
                    out = work / f"validate-{method}-{rep}.jsonl" if prefetch != "none" else None
                    res = measure(Container.open(path), trace, mask, cfg, out, record=out is not None, progress=False,
                                  coupling=coupling)
                    measured[method].append(res.stall_ns / res.committed / 1e6)
                    if out is not None:
                        recall[method].append(report([out])["runs"][0]["timely_required_byte_recall"] or 0.0)
                        out.unlink()
            for method, (_, layout, _) in layouts.items():
                inst, usage = simulate(trace, mask, layout, device, cfg, coupling=coupling)
                summary = summarize(step_table(trace, mask, inst), usage, 0.0)
                predicted = summary.stall_per_token_s * 1e3
                mean = float(np.mean(measured[method]))
                each = " ".join(f"{x:.1f}" for x in measured[method])
                rec = ""
                if summary.prefetch is not None:
                    rec = f"{np.mean(recall[method]):>9.2f}/{summary.prefetch.timely_required_byte_recall or 0.0:.2f}"
                print(f"{method:<9}{ram / 1e9:>8.2f}{prefetch:>9}{mean:>10.2f} ({each}){'':>4}{predicted:>12.2f}"
                      f"{predicted / mean:>8.2f}{rec:>18}")
    cfg = RuntimeConfig(workers=args.workers)
    on, off = [], []
    for _ in range(2):
        on.append(measure(c, trace, mask, cfg, work / "overhead.jsonl", progress=False).wall_seconds)
        off.append(measure(c, trace, mask, cfg, None, record=False, progress=False).wall_seconds)
    print(f"\ntracing overhead: wall {np.mean(on):.2f} s traced vs {np.mean(off):.2f} s untraced "
          f"({(np.mean(on) / np.mean(off) - 1):+.1%}, 2 interleaved pairs)")
    for method in ("louvain", "random"):
        shutil.rmtree(work / f"validate-{method}", ignore_errors=True)


if __name__ == "__main__":
    main()
