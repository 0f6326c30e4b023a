"""Reading a colibrì run and replaying its routing, against the time the run took.

Usage::

    python benchmarks/engine_replay_speed.py VDIR [--device PROFILE.json]

VDIR is a ``relayout validate --engine`` directory (its ``cells/<cell>/<layout>/pPP-rRR`` runs, as
``relayout measure --engine`` keeps them, and its ``device.json``). For every run, side by side:
the engine's wall time (its ``engine-run.json``), and relayout's time to read the run's output
(``replay.colibri.engine_output.read_run``), import its ROUTE_TRACE and replay it through the
model with the configuration it printed (the router pilot at the cell's precision, from the
record) (:func:`relayout.workflows.validation.engine.predict_run`), in this process after one untimed
replay that loads the compiled model. Prints the totals, the ratio, and the slowest run's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from containers.container import Container  # noqa: E402
from containers.jsonfile import parse_json  # noqa: E402
from containers.layout import layout_from_container  # noqa: E402
from relayout.workflows.validation.engine import predict_run  # noqa: E402
from replay.colibri.engine_output import read_run  # noqa: E402
from replay.model.device import load_device  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vdir")
    ap.add_argument("--device", help="device profile (default: VDIR/device.json)")
    args = ap.parse_args(argv)
    vdir = Path(args.vdir)
    device = load_device(args.device or str(vdir / "device.json"))
    setup = parse_json((vdir / "validation-engine.json").read_bytes())
    layouts = {arm: layout_from_container(Container.open(d)) for arm, d in setup["layouts"].items()}
    runs = sorted(p.parent for p in vdir.glob("cells/*/*/p*-r*/engine-run.json"))
    if not runs:
        print(f"{vdir}: no engine runs under cells/", file=sys.stderr)
        return 2
    precision = {c["name"]: c.get("pilot_precision") or None for c in setup["cells"]}   # the router pilot's, per cell
    predict_run(runs[0], layouts[runs[0].parent.name], device, precision.get(runs[0].parent.parent.name))  # compiles
    engine_s, ours_s, worst = 0.0, 0.0, (0.0, None)
    for run_dir in runs:
        t = time.perf_counter()
        run = read_run(run_dir)
        predict_run(run_dir, layouts[run_dir.parent.name], device, precision.get(run_dir.parent.parent.name))
        took = time.perf_counter() - t
        wall = run.identity.wall_s
        engine_s, ours_s = engine_s + wall, ours_s + took
        worst = max(worst, (took / wall, run_dir))
    print(f"{len(runs)} runs: the engine ran {engine_s:.1f} s; reading their output and replaying their routing took "
          f"{ours_s:.2f} s ({ours_s / engine_s:.3f} of the runs' time); slowest relative to its run: "
          f"{worst[0]:.3f} ({worst[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
