"""The page cache a memory-limited colibrì run had, against the model at several page-cache budgets.

Usage::

    python benchmarks/engine_page_cache.py CELL --container STOCK --device PROFILE.json \
        [--gb 0,0.1,0.15,0.2,0.25] [--runs 6] [--pilot-precision P]

CELL is one cell of a ``relayout validate --engine`` directory (``cells/<cell>``) whose runs were
measured by relayout (``engine-run.json`` with ``drive_read_bytes``). For its first ``--runs``
stock runs, side by side: the engine's bytes read from storage per run (its block input, dense
weights included) and S (decode wait per committed token), then, per budget, the model's bytes
read from the drives per run and S when its page cache for experts (weights and scales) holds
that many GB (the rest of each run's configuration as it printed it; a router-pilot cell needs
``--pilot-precision``, its training runs' LOOKA share, and a COUPLE cell's table is read as the
run names it). Where the model's bytes meet the engine's, the budget is the page cache the run
had in effect for experts; where S then differs, the loads took longer than the profile says.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from containers.container import Container  # noqa: E402
from containers.layout import layout_from_container  # noqa: E402
from relayout.workflows.validation.engine import predict_run  # noqa: E402
from replay.colibri.engine_metrics import run_metrics  # noqa: E402
from replay.colibri.engine_output import read_runs  # noqa: E402
from replay.model.device import load_device  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cell")
    ap.add_argument("--container", required=True, help="the stock container the cell's stock runs read")
    ap.add_argument("--device", required=True, help="the device profile the validation used")
    ap.add_argument("--gb", default="0,0.1,0.15,0.2,0.25", help="page-cache budgets for experts (weights and scales), GB, comma-separated")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--pilot-precision", type=float, help="a router-pilot cell's precision (its training runs' LOOKA share)")
    args = ap.parse_args(argv)
    layout = layout_from_container(Container.open(args.container))
    device = load_device(args.device)
    runs = [r for r in read_runs(Path(args.cell) / "stock") if r.identity and r.identity.drive_read_bytes is not None]
    runs = runs[:args.runs]
    if not runs:
        print(f"{args.cell}: no stock run with its storage reads counted (measure with relayout measure --engine)")
        return 1
    metrics = [run_metrics(r, "stock", "") for r in runs]
    tokens = sum(m.committed_tokens for m in metrics)
    engine_mb = np.mean([r.identity.drive_read_bytes for r in runs]) / 1e6
    print(f"{Path(args.cell).name}, {len(runs)} stock runs: engine {engine_mb:.0f} MB read from storage per run, "
          f"S {sum(m.wait_s for m in metrics) / tokens * 1e3:.2f} ms/token")
    for gb in (float(x) for x in args.gb.split(",")):
        predicted = [predict_run(Path(r.source), layout, device, args.pilot_precision, page_cache_gb=gb) for r in runs]
        drive = sum(p[4] for p in predicted)
        wait = sum(p[0] for p in predicted)
        print(f"  model, page cache for experts {gb:.3f} GB: {drive / len(runs) / 1e6:.0f} MB from the drives per run, "
              f"S {wait / tokens * 1e3:.2f} ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
