"""The model's RAM tiers against colibrì's own counts: each engine run's routing replayed under its configuration.

Usage: python benchmarks/engine_lru_agreement.py RUNS CONTAINER

RUNS holds one directory per configuration, each with ``container/<run>/`` directories of a
colibrì run (``stdout.txt`` and ``stderr.txt`` of a PROF=1 run, ``route-trace.txt`` from
ROUTE_TRACE), as ``relayout measure --engine`` writes them; CONTAINER is the model directory the
runs read. For every run: the engine's decode LRU hits and loads (its ``[PROF] expert I/O`` line)
and the model's over the same forwards (every forward but the first, the prefill), replayed from
the run's recorded routing with the configuration the run printed (``--runtime-env-from``): in
colibrì's routing order, and in relayout's physical order for comparison. No timing is compared:
the counts depend on the routing and the LRU alone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

from containers.container import Container
from containers.layout import layout_from_container
from relayout.traces.importer import import_traces
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.colibri.engine_config import config_from_run, model_config

IO_LINE = re.compile(r"hit [0-9.]+% \((\d+) pin \+ (\d+) lru / (\d+) load\)")


def main(runs: Path, container: Path) -> None:
    layout = layout_from_container(Container.open(container))
    device = load_device("single-nvme")            # counts only: the device does not change them
    print(f"{'configuration':24} {'run':8} {'engine hits/loads':>18} {'routing order':>14} {'physical order':>15}")
    for conf in sorted(p for p in runs.iterdir() if p.is_dir()):
        for run in sorted((conf / "container").iterdir()):
            text = "".join((run / n).read_text(errors="replace") for n in ("stdout.txt", "stderr.txt"))
            m = IO_LINE.search(text)
            if not m or not (run / "route-trace.txt").is_file():
                continue
            trace, _ = import_traces([run / "route-trace.txt"])
            cfg, facts = config_from_run(run)
            cells = []
            for routed in (True, False):
                mc = model_config(cfg, RuntimeConfig(), facts.cap, facts.omp_threads, cores=facts.cores)
                if not routed:
                    mc = RuntimeConfig(**{**mc.to_json(), "routing_order": False, "runtime_changes": []})
                inst, _ = simulate(trace, np.ones(trace.n_forwards, bool), layout, device, mc)
                decode = inst.forward != inst.forward.min()
                cells.append(f"{inst.hits[decode].sum()}/{inst.misses[decode].sum()}")
            print(f"{conf.name:24} {run.name:8} {m.group(2) + '/' + m.group(3):>18} {cells[0]:>14} {cells[1]:>15}",
                  flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    main(Path(sys.argv[1]), Path(sys.argv[2]))
