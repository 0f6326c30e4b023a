"""The loader pool's handoff, from the engine's own output and from the host probe, side by side.

Usage::

    python benchmarks/engine_handoff.py VDIR [VDIR ...]

For each PIPE=1 cell of each ``relayout validate --engine`` directory whose loaders share the
compute thread's core (colibrì's bound team), over its stock runs: the engine's decode wait less
its decode load service (its ``PROFILE`` line), over the decode's blocks of demand loads (the
layers of decode forwards with a miss, counted by replaying the run's routing through the LRU,
whose loads equal the engine's). Under a bound team the compute thread waits each block's
dispatch through its loads (they preempt it on its core), so this is what a block costs beyond
its loads. Cells run under a memory limit are left out: there loads wait for the drive side by
side, and the service they sum is not their time on the core. Beside it, the handoff
:func:`replay.physical.loader_handoff.loader_handoff` measures on this host now for the cell's
pool size, and their ratio. Only reads; runs the probe once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from containers.container import Container  # noqa: E402
from containers.jsonfile import parse_json  # noqa: E402
from containers.layout import layout_from_container  # noqa: E402
from relayout.planning.replay_setup import RuntimeRequest, runtime_config  # noqa: E402
from relayout.traces.importer import import_traces  # noqa: E402
from replay.colibri.engine_config import PIPE_POOL_MAX, config_from_run  # noqa: E402
from replay.colibri.engine_output import ROUTE_FILE, read_runs  # noqa: E402
from replay.colibri.openmp_team import loaders_on_compute_core  # noqa: E402
from replay.model.config import RuntimeConfig  # noqa: E402
from replay.model.device import LoaderHandoff, load_device  # noqa: E402
from replay.model.engine import simulate  # noqa: E402
from replay.physical.loader_handoff import loader_handoff  # noqa: E402


def blocks(run_dir: Path, layout, device) -> tuple[int, int]:
    """The decode's blocks of demand loads and its loads, replaying the run's routing (s of no interest)."""
    trace, _ = import_traces([run_dir / ROUTE_FILE])
    config = runtime_config(RuntimeRequest(coalesce_max_mb=RuntimeConfig().coalesce_max_bytes / 1e6, dense_ms=0.0,
                                           colibri_run=True, runtime_env_from=str(run_dir)), layout)
    inst, _ = simulate(trace, np.ones(trace.n_forwards, bool), layout, device, config)
    d = inst.forward != inst.forward.min()
    return int((inst.misses[d] > 0).sum()), int(inst.misses[d].sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vdirs", type=Path, nargs="+")
    a = ap.parse_args()
    probe = loader_handoff()
    if not probe or not probe["seconds"]:
        print(f"the host probe gave no handoff: {probe and probe.get('error')}")
        return 1
    host = LoaderHandoff(tuple(probe["workers"]), tuple(probe["seconds"]))
    print("host probe now: " + ", ".join(f"{n} loaders {s * 1e6:.1f} us" for n, s in zip(host.workers, host.seconds)))
    print(f"{'validation / cell':52} {'runs':>4} {'blocks':>7} {'loads':>6} {'engine us/block':>16} "
          f"{'probe us':>9} {'ratio':>6}")
    for vdir in a.vdirs:
        record = parse_json((vdir / "validation-engine.json").read_bytes())
        layout = layout_from_container(Container.open(record["layouts"]["stock"]))
        device = load_device(record["device_source"].split("given: ", 1)[-1] if "given: " in record["device_source"]
                             else str(vdir / "device.json"))
        for cell in sorted(p for p in (vdir / "cells").iterdir() if p.is_dir()):
            runs = [r for r in read_runs(cell / "stock") if r.identity is not None and r.identity.returncode == 0
                    and r.output.decode is not None]
            if not runs:
                continue
            cfg, _ = config_from_run(Path(runs[0].source))
            if not loaders_on_compute_core(cfg) or cfg.PILOT_REAL or cfg.PILOT or cfg.COUPLE:
                continue                         # the pilot's loads are timed as service too, off the pool
            if any(r.identity.memory_room is not None for r in runs):
                print(f"{vdir.name + ' / ' + cell.name:52} (under a memory limit: loads that wait for the drive "
                      "overlap, so service is not their time on the core; left out)")
                continue
            excess, n_blocks, n_loads = 0.0, 0, 0
            for run in runs:
                b, n = blocks(Path(run.source), layout, device)
                excess += run.output.decode.wait_s - run.output.decode.service_s
                n_blocks += b
                n_loads += n
            engine = excess / n_blocks
            mine = host.for_pool(max(1, min(cfg.PIPE_WORKERS, PIPE_POOL_MAX)))
            print(f"{vdir.name + ' / ' + cell.name:52} {len(runs):4d} {n_blocks:7d} {n_loads:6d} {engine * 1e6:16.1f} "
                  f"{mine * 1e6:9.1f} {mine / engine:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
