"""Placement arms at equal RAM and splits as a curve: replayed and measured.

Usage: python benchmarks/bench_placement_split.py [--work /tmp/relayout-bench-d] [--tokens 2400] [--reps 5] [--skip-measure]

Part 1 (replayed): a GLM-5.2 int4-row geometry with full-size 18.9 MB experts (12 MoE layers of
256 experts), a synthetic trace of 17 sessions (12 train, 5 held out), the shipped
mac-pro-2019-applraid-4x profile and colibrì's default runtime (8 workers, O_DIRECT): every
placement arm and the whole/split curves at 5, 15 and 30% of the routed bytes.

Part 2 (measured): a small container of 1.19 MB experts (Qwen3-30B-A3B geometry, 4 MoE layers
of 64) on this disk, calibrated; the split curve picks a split at a budget below one whole
expert per layer, the plan is made with that ratio and top budget (replay rule), the container
rewritten, and S measured cold on the held-out steps for the whole container (LRU at the budget)
and the split one (tops + LRU in the rest), alternating repetitions (--reps), beside the
model's prediction on the calibrated profile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import REPO  # noqa: F401  (puts the repository on sys.path)

from containers.container import MANIFEST_NAME, Container
from containers.geometry import load_geometry
from containers.manifest import build_manifest, write_manifest
from containers.synth import synth_container
from relayout.workflows.apply import apply_plan
from relayout.planning.plan import (
    SplitOptions,
    make_plan,
    source_from_container,
    source_from_geometry,
)
from relayout.render.studies import format_placement, format_split_curve
from relayout.traces.synth import SynthParams, synth_trace
from replay.physical.calibrate import calibrate
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.evaluation.gate import evaluation_forwards, run_layout
from replay.physical.measure import measure
from replay.control.placement import placement_arms
from replay.formats.planfile import load_plan, save_plan
from replay.control.splitcurve import split_curve
from replay.physical.stalltrace import report


def replayed(work: Path, tokens: int) -> None:
    g = load_geometry("glm-5.2-int4-row").scaled(moe_layers=12)
    tr = synth_trace(g.moe_layers, g.n_routed_experts, g.num_experts_per_tok, tokens, 17, seed=2,
                     params=SynthParams(clique_strength=0.9))
    save_plan(make_plan(tr, source_from_geometry(g), progress=False), work / "glm-plan.json")
    plan = load_plan(work / "glm-plan.json")
    dev = load_device("mac-pro-2019-applraid-4x")
    routed = int(plan.layout.expert_bytes().sum())
    print(f"GLM-5.2 int4-row, {g.moe_layers} MoE layers x {g.n_routed_experts} experts of "
          f"{plan.layout.expert_bytes()[0, 0] / 1e6:.1f} MB, {tokens} tokens, routed bytes {routed / 1e9:.1f} GB\n")
    for share in (0.05, 0.15, 0.30):
        t0 = time.perf_counter()
        st = placement_arms(plan, tr, dev, RuntimeConfig(), int(share * routed))
        print(format_placement(st))
        print(f"({time.perf_counter() - t0:.1f} s)\n")
    t0 = time.perf_counter()
    curve = split_curve(plan, tr, dev, RuntimeConfig(), [int(s * routed) for s in (0.02, 0.05, 0.15, 0.30)])
    print(format_split_curve(curve))
    print(f"({time.perf_counter() - t0:.1f} s)\n")


def measured(work: Path, reps: int) -> None:
    g = load_geometry("qwen3-30b-a3b").scaled(moe_layers=4, experts=64, ffn=384)
    src = work / "qwen-src"
    if not src.exists():
        synth_container(src, g, seed=1, progress=False)
        write_manifest(build_manifest(Container.open(src), progress=False), src / MANIFEST_NAME)
    profile_path = work / "this-disk.json"
    if not profile_path.exists():
        profile_path.write_text(json.dumps(calibrate(work, size_mb=256, seconds=0.1, name="this-disk")))
    dev = load_device(str(profile_path))
    tr = synth_trace(g.moe_layers, 64, 8, 1200, 17, seed=3, params=SynthParams(clique_strength=0.9))
    source = source_from_container(src)
    save_plan(make_plan(tr, source, method="stock", progress=False), work / "whole.json")
    whole = load_plan(work / "whole.json")
    eb = whole.layout.expert_bytes()[:, 0]
    budget = int(0.75 * eb.sum())                   # three quarters of one whole expert per layer
    cfg = RuntimeConfig(workers=2)
    curve = split_curve(whole, tr, dev, cfg, [budget])
    print(format_split_curve(curve))
    point = curve.split[0]
    if point.ratio == 0:
        print("\nno split beat whole experts on the training sessions at this budget: nothing to measure")
        return
    split = SplitOptions(point.ratio, budget - point.lru_bytes, "replay", point.lru_bytes, str(profile_path), cfg.workers)
    save_plan(make_plan(tr, source, method="stock", split=split, progress=False), work / "split.json")
    plan = load_plan(work / "split.json")
    dst = work / "qwen-split"
    if dst.exists():
        shutil.rmtree(dst)
    apply_plan(src, plan, dst, None, force=True, progress=False)
    mask, _ = evaluation_forwards(tr, [plan])
    mask &= np.cumsum(mask) <= 120
    state = plan.split_state()
    no_pins = np.zeros((len(eb), 64), dtype=bool)
    cfg_whole, cfg_split = replace(cfg, ram_bytes=budget), replace(cfg, ram_bytes=point.lru_bytes)
    pred_whole = run_layout("whole", tr, mask, whole.layout, dev, cfg_whole, no_pins).summary.stall_per_token_s
    pred_split = run_layout("split", tr, mask, plan.layout, dev, cfg_split, no_pins, state).summary.stall_per_token_s
    runs = {"whole": [], "split": []}
    for rep in range(reps):
        for name in ("whole", "split"):
            out = work / f"{name}-{rep}.jsonl"
            if name == "whole":
                measure(Container.open(src), tr, mask, cfg_whole, out, run_id=out.stem, progress=False)
            else:
                measure(Container.open(dst), tr, mask, cfg_split, out, run_id=out.stem, progress=False,
                        split=(plan.layout, state))
            runs[name].append(report([out])["runs"][0]["stall_per_committed_token_ns"] / 1e9)
    print(f"\nmeasured on this disk ({int(mask.sum())} held-out steps, cold, {reps} alternating repetitions; "
          f"budget {budget / 1e6:.2f} MB: split ratio {point.ratio:g}, tops {plan.split.resident_bytes / 1e6:.2f} MB, "
          f"LRU {point.lru_bytes / 1e6:.2f} MB)")
    for name, pred in (("whole", pred_whole), ("split", pred_split)):
        m = runs[name]
        print(f"  {name:<6} predicted S {pred * 1e3:7.3f} ms/token  measured {np.median(m) * 1e3:7.3f} "
              f"(each {', '.join(f'{x * 1e3:.3f}' for x in m)})  predicted/measured {pred / np.median(m):.2f}")
    shutil.rmtree(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/relayout-bench-d")
    ap.add_argument("--tokens", type=int, default=2400)
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions per layout (alternating)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    replayed(work, args.tokens)
    if not args.skip_measure:
        measured(work, args.reps)


if __name__ == "__main__":
    main()
