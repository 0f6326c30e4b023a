"""Two measures of how fast colibrì's threads copy page-cache hits, per cell of a ``relayout
validate --engine`` directory, side by side.

Usage::

    python benchmarks/engine_copy_rates.py VDIR [--device PROFILE.json]

For each cell, over its stock runs (medians):

- the decode loads' rate: the container's mean expert over one decode load's thread time (the
  decode ``PROFILE`` line's ``service`` over the ``[PROF] expert I/O`` line's loads and the router
  pilot's), what the model copies at (``replay.colibri.engine_config.engine_copy_rate``);
- the ``[PROF] DISK-CLASS`` warm class's rate (the whole run's recently read experts), what it
  copied at before;

each also as microseconds per mean expert. Then, for the cell's first stock run, the model's
decode loads and how many of them read the drives (the rest the page cache serves), on the
device profile ``--device`` (default: the one VDIR's record names, when it is a file). Only reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from containers.container import Container  # noqa: E402
from containers.layout import layout_from_container  # noqa: E402
from relayout.planning.replay_setup import RuntimeRequest, runtime_config  # noqa: E402
from relayout.traces.importer import import_traces  # noqa: E402
from replay.colibri.engine_config import config_from_run, engine_copy_rate  # noqa: E402
from replay.colibri.engine_output import ROUTE_FILE, read_runs  # noqa: E402
from replay.model.config import RuntimeConfig  # noqa: E402
from replay.model.device import load_device  # noqa: E402
from replay.formats.colipairs import configured_pair_table  # noqa: E402
from replay.model.engine import simulate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vdir", type=Path)
    ap.add_argument("--device")
    a = ap.parse_args()
    record = json.loads((a.vdir / "validation-engine.json").read_text())
    layout = layout_from_container(Container.open(record["layouts"]["stock"]))
    mean = float(layout.expert_bytes().astype(float).mean())
    device_path = a.device or record["device_source"].split("given: ", 1)[-1]
    device = load_device(device_path) if Path(device_path).is_file() else None
    print(f"{'cell':28} {'decode loads GB/s (us)':>24} {'DISK-CLASS warm GB/s (us)':>27}  model decode loads: drive")
    for cell in sorted(p for p in (a.vdir / "cells").iterdir() if p.is_dir()):
        runs = [r for r in read_runs(cell / "stock") if r.identity is not None and r.identity.returncode == 0]
        decode, warm = [], []
        for run in runs:
            cfg, facts = config_from_run(Path(run.source))
            if facts.decode_load_seconds and not cfg.DIRECT:
                decode.append(engine_copy_rate(cfg, facts, layout))
            if facts.warm_read_bytes_per_second:
                warm.append(facts.warm_read_bytes_per_second)
        cols = [f"{np.median(r) / 1e9:6.2f} ({mean / np.median(r) * 1e6:4.0f})" if r else "     -" for r in (decode, warm)]
        drive = ""
        if device is not None and runs:
            src = Path(runs[0].source)
            trace, _ = import_traces([src / ROUTE_FILE])
            pilot = next((c.get("pilot_precision") for c in record["cells"] if c["name"] == cell.name), None)
            config = runtime_config(RuntimeRequest(coalesce_max_mb=RuntimeConfig().coalesce_max_bytes / 1e6, dense_ms=0.0,
                                                   colibri_run=True, runtime_env_from=str(src),
                                                   pilot_precision=pilot or None), layout)
            inst, _ = simulate(trace, np.ones(trace.n_forwards, bool), layout, device, config,
                               coupling=configured_pair_table(config, layout))
            d = inst.forward != inst.forward.min()
            drive = f"{int(inst.drive_reads[d].sum())} drive reads over {int(inst.misses[d].sum())} loads ({src.name})"
        print(f"{cell.name:28} {cols[0]:>24} {cols[1]:>27}  {drive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
