"""Per-layer stall of a kept ``relayout validate`` run against the model on the same steps.

Usage: python benchmarks/validate_layers.py VALIDATION_JSON [--layout stock] [--ram 0]

Reads the run's records (``runs/*.jsonl`` in its work directory, kept with ``--keep``) and, per
prefetch source, prints the measured foreground stall per step of each MoE layer (ms), the
model's for the same held-out steps on the run's calibrated profile (``validation.device.json``
beside the record), and the model at the rate the disk read the no-prefetch arm's demand reads
(drive bytes from a layer's first issue to its last completion) over measurement. This is how docs/BENCHMARKS.md ("A shared drive: the service discipline
as a calibrated property") located the model's remaining error layer by layer.

The trace is synthesised again as ``validate`` synthesises it; a run made with a ``--seed`` or
``--tokens`` other than the defaults is refused (the trace's fingerprint would differ).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from containers.container import Container
from relayout.validate import validation_trace
from replay.config import RuntimeConfig
from replay.device import load_device
from replay.engine import simulate
from replay.gate import evaluation_forwards, training_coupling
from replay.planfile import load_plan


def measured_layers(runs: Path, arm: str) -> tuple[dict, float]:
    """Per layer, ms of stall per step over every repetition of ``arm``; and the rate (bytes/s)
    the disk read demand reads at in the layers with demand reads only (their drive bytes over
    the time from the first one's issue to the last one's completion)."""
    stall, steps, nbytes, seconds = collections.defaultdict(float), 0, 0, 0.0
    for path in sorted(runs.glob(f"{arm}-rep*.jsonl")):
        layers = collections.defaultdict(list)
        for line in path.open():
            r = json.loads(line)
            if r.get("record") == "step":
                steps += 1
                continue
            stall[r["layer"]] += r["foreground_stall_ns"] / 1e6
            layers[(r["step"], r["layer"])].append(r)
        for rs in layers.values():
            demand = [r for r in rs if r["priority"] == "demand"]
            if demand and len(demand) == len(rs):
                seconds += (max(r["ready_ns"] for r in demand) - min(r["issue_ns"] for r in demand)) / 1e9
                nbytes += sum(r["drive_bytes"] for r in demand)
    if not steps:
        sys.exit(f"validate_layers: no records of {arm} in {runs} (was the run kept with --keep?)")
    return {layer: s / steps for layer, s in sorted(stall.items())}, nbytes / seconds if seconds else np.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--layout", default="stock")
    ap.add_argument("--ram", type=float, default=0.0)
    args = ap.parse_args()
    record = json.loads(args.record.read_text())
    work = Path(record["work_dir"])
    device = load_device(str(args.record.with_name(args.record.stem + ".device.json")))
    trace = validation_trace(Container.open(record["container"]["path"]))
    if trace.fingerprint() != record["trace"]["fingerprint"]:
        sys.exit("validate_layers: the run's trace is not the default one (made with --seed or --tokens)")
    plans = {m: load_plan(work / f"plan-{m}.json") for m in record["config"]["layouts"]}
    mask_all, _ = evaluation_forwards(trace, list(plans.values()))
    mask = mask_all & (np.cumsum(mask_all) <= record["trace"]["steps"])
    stock = plans["stock"]
    layout = stock.stock if args.layout == "stock" else plans[args.layout].layout
    routed = record["container"]["routed_bytes"]
    coupling = training_coupling(trace, stock)
    runtime = dict(record["config"].get("runtime") or {"workers": record["config"]["workers"]})
    runtime["source_caps"] = tuple(tuple(c) for c in runtime.get("source_caps", ()))
    base = replace(RuntimeConfig(**runtime), ram_bytes=int(routed * args.ram))   # the run's configuration: coalescing too
    runs = work / "runs"
    _, rate = measured_layers(runs, f"{args.layout}-ram{args.ram:g}-none")
    speed = device.drive.bandwidth / rate
    print(f"{args.layout}, RAM {args.ram:g}: the runs' disk read demand reads at {rate / 1e9:.3f} GB/s, the profile at "
          f"{device.drive.bandwidth / 1e9:.3f}; ms of stall per step per layer: measured / model / model at the runs' "
          f"speed over measured")
    for pf in ("none", "oracle", "coupled"):
        arm = f"{args.layout}-ram{args.ram:g}-{pf}"
        if not any(runs.glob(f"{arm}-rep*.jsonl")):
            continue
        measured, _ = measured_layers(runs, arm)
        inst, _ = simulate(trace, mask, layout, device, replace(base, prefetch=pf), coupling=coupling)
        model = [inst.stall[inst.layer == li].sum() / mask.sum() * 1e3 for li in np.unique(inst.layer)]
        print(f"  {pf:8}" + "".join(f"  layer {layer}: {m:6.2f} / {p:6.2f} / {p * speed / m:.3f}"
                                    for (layer, m), p in zip(measured.items(), model)))


if __name__ == "__main__":
    main()
