"""Per-layer stall of a kept ``relayout validate`` run against the model on the same steps.

Usage: python benchmarks/validate_layers.py VALIDATION_JSON [--layout stock] [--ram 0]

Reads the run's records (``runs/*.jsonl`` in its work directory, kept with ``--keep``) and, per
prefetch source, prints the measured foreground stall per step of each MoE layer (ms), the
model's for the same held-out steps on the run's calibrated profile (``validation.device.json``
beside the record), and the model at the rate the disk read the no-prefetch arm's demand reads
(drive bytes from a layer's first issue to its last completion) over measurement, and that rate
layer by layer. This is how docs/BENCHMARKS.md ("A shared drive: the service discipline
as a calibrated property") located the model's remaining error layer by layer.

The trace is synthesised again as ``validate`` synthesises it; a run made with a ``--seed`` or
``--tokens`` other than the defaults is refused (the trace's fingerprint would differ).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from containers.container import Container
from relayout.workflows.validation.prepare import validation_trace
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.evaluation.gate import evaluation_forwards, training_coupling
from replay.formats.planfile import load_plan


def measured_layers(runs: Path, arm: str) -> tuple[dict, float, dict]:
    """Per layer, ms of stall per step over every repetition of ``arm``; the rate (bytes/s)
    the disk read demand reads at in the layers with demand reads only (their drive bytes over
    the time from the first one's issue to the last one's completion); and that rate per layer."""
    stall, steps = collections.defaultdict(float), 0
    nbytes, seconds = collections.defaultdict(int), collections.defaultdict(float)
    for path in sorted(runs.glob(f"{arm}-rep*.jsonl")):
        layers = collections.defaultdict(list)
        for line in path.open():
            r = json.loads(line)
            if r.get("record") == "step":
                steps += 1
                continue
            stall[r["layer"]] += r["foreground_stall_ns"] / 1e6
            layers[(r["step"], r["layer"])].append(r)
        for (_, layer), rs in layers.items():
            demand = [r for r in rs if r["priority"] == "demand"]
            if demand and len(demand) == len(rs):
                seconds[layer] += (max(r["ready_ns"] for r in demand) - min(r["issue_ns"] for r in demand)) / 1e9
                nbytes[layer] += sum(r["drive_bytes"] for r in demand)
    if not steps:
        sys.exit(f"validate_layers: no records of {arm} in {runs} (was the run kept with --keep?)")
    total_s = sum(seconds.values())
    rate = sum(nbytes.values()) / total_s if total_s else np.nan
    by_layer = {layer: nbytes[layer] / t for layer, t in sorted(seconds.items()) if t > 0}
    return {layer: s / steps for layer, s in sorted(stall.items())}, rate, by_layer


@dataclass(frozen=True)
class KeptRun:
    """A kept ``relayout validate`` run, as the model replays it: the trace synthesised again,
    its held-out steps, plans, profile and runtime configuration (RAM 0)."""

    record: dict
    work: Path
    device: object
    trace: object
    mask: np.ndarray
    plans: dict
    runtime: RuntimeConfig

    def layout(self, name: str):
        """The layout a layout name of the run measured."""
        return self.plans["stock"].stock if name == "stock" else self.plans[name].layout

    def config(self, ram: float) -> RuntimeConfig:
        """The run's configuration at a RAM budget given as a fraction of the routed bytes."""
        return replace(self.runtime, ram_bytes=int(self.record["container"]["routed_bytes"] * ram))


def kept_run(path: Path) -> KeptRun:
    """Load a kept run from its ``validation.json`` (the profile beside it, the work directory
    it names); exits with a message when its trace is not validate's default one."""
    record = json.loads(path.read_text())
    work = Path(record["work_dir"])
    device = load_device(str(path.with_name(path.stem + ".device.json")))
    trace = validation_trace(Container.open(record["container"]["path"]))
    if trace.fingerprint() != record["trace"]["fingerprint"]:
        sys.exit(f"{path}: the run's trace is not the default one (made with --seed or --tokens)")
    plans = {m: load_plan(work / f"plan-{m}.json") for m in record["config"]["layouts"]}
    mask_all, _ = evaluation_forwards(trace, list(plans.values()))
    mask = mask_all & (np.cumsum(mask_all) <= record["trace"]["steps"])
    runtime = dict(record["config"].get("runtime") or {"workers": record["config"]["workers"]})
    runtime["source_caps"] = tuple(tuple(c) for c in runtime.get("source_caps", ()))
    return KeptRun(record, work, device, trace, mask, plans, RuntimeConfig(**runtime))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--layout", default="stock")
    ap.add_argument("--ram", type=float, default=0.0)
    args = ap.parse_args()
    run = kept_run(args.record)
    work, device, trace, mask = run.work, run.device, run.trace, run.mask
    layout = run.layout(args.layout)
    coupling = training_coupling(trace, run.plans["stock"])
    base = run.config(args.ram)                   # the run's configuration: coalescing too
    runs = work / "runs"
    _, rate, by_layer = measured_layers(runs, f"{args.layout}-ram{args.ram:g}-none")
    speed = device.drive.bandwidth / rate
    print(f"{args.layout}, RAM {args.ram:g}: the runs' disk read demand reads at {rate / 1e9:.3f} GB/s, the profile at "
          f"{device.drive.bandwidth / 1e9:.3f}; per layer (GB/s): "
          + ", ".join(f"{layer}: {r / 1e9:.3f}" for layer, r in by_layer.items())
          + "; ms of stall per step per layer: measured / model / model at the runs' speed over measured")
    for pf in ("none", "oracle", "coupled"):
        arm = f"{args.layout}-ram{args.ram:g}-{pf}"
        if not any(runs.glob(f"{arm}-rep*.jsonl")):
            continue
        measured, _, _ = measured_layers(runs, arm)
        inst, _ = simulate(trace, mask, layout, device, replace(base, prefetch=pf), coupling=coupling)
        model = [inst.stall[inst.layer == li].sum() / mask.sum() * 1e3 for li in np.unique(inst.layer)]
        print(f"  {pf:8}" + "".join(f"  layer {layer}: {m:6.2f} / {p:6.2f} / {p * speed / m:.3f}"
                                    for (layer, m), p in zip(measured.items(), model)))


if __name__ == "__main__":
    main()
