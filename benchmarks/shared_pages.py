"""Arms sharing a container's pages: one layout measured alone and beside another RAM budget.

Usage: python benchmarks/shared_pages.py VALIDATION_JSON [--layout stock] [--ram 0] [--beside 0.25]

``relayout validate`` measures the RAM budgets of a layout in lockstep on one container
(:func:`replay.physical.measure.measure_interleaved`), so each arm finds in the page cache the scale
pages the other read; the replay model runs each arm alone. On the kept run's container,
held-out steps and runtime configuration (:func:`validate_layers.kept_run`), this measures the
layout at ``--ram`` alone, then in lockstep with the same layout at ``--beside``, cold (the
page cache dropped at each session, as validate does), and prints each arm's demand preads that
reached the drive per step (``drive_requests`` of its records) beside the model's
(``drive_reads`` of :func:`replay.model.engine.simulate`). The container's files must be yours or
writable by you (the harness asks ``mincore``, :mod:`replay.physical.residency`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from validate_layers import kept_run

from containers.container import Container
from replay.model.engine import simulate
from replay.physical.measure import Arm, measure_interleaved


def drive_reads_per_step(path: Path, steps: int) -> float:
    """Demand drive requests per step in a STALL_TRACE."""
    total = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("record") != "step" and r["priority"] == "demand":
                total += r["drive_requests"]
    return total / steps


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--layout", default="stock")
    ap.add_argument("--ram", type=float, default=0.0)
    ap.add_argument("--beside", type=float, default=0.25)
    a = ap.parse_args(argv)
    run = kept_run(a.record)
    root = run.record["container"]["path"] if a.layout == "stock" else str(run.work / f"layout-{a.layout}")
    container = Container.open(root)
    steps = int(run.mask.sum())
    layout = run.layout(a.layout)
    print(f"{a.layout} ({root}), {steps} held-out steps; demand preads to the drive per step, measured / model")
    with tempfile.TemporaryDirectory() as tmp:
        for label, rams in (("alone", [a.ram]), ("in lockstep", [a.ram, a.beside])):
            arms = [Arm(container, run.config(r), Path(tmp) / f"{label}-{r:g}.jsonl") for r in rams]
            measure_interleaved(arms, run.trace, run.mask, cold=True, progress=False)
            cells = []
            for r, arm in zip(rams, arms):
                inst, _ = simulate(run.trace, run.mask, layout, run.device, run.config(r))
                cells.append(f"RAM {r:g}: {drive_reads_per_step(arm.out, steps):.1f} / {inst.drive_reads.sum() / steps:.1f}")
            print(f"  {label:12} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
