"""Replay model speed: modelled expert requests per second and a 10k-token GLM-5.2 replay.

Usage: python benchmarks/bench_replay.py [--tokens 10000]

Prints the wall time of replaying --tokens decode tokens of the
GLM-5.2 geometry (75 layers, top-8) through the stock layout on the Mac Pro profile (its drives in
order, then shared among concurrent reads), and on one shared drive as calibrated on this
project's VM (``records/v26-2026-12-03.device.json``), without and with a prefetch source (the
coupled table learned from the first two of four sessions), and the rate of modelled expert requests (expert loads simulated) per second on one core, after a
first tiny replay that loads (or, on a new machine, compiles) the model, and the peak RSS of a
replay as the gate runs it (in a fresh process). The temporary trace is removed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from common import child_peak_rss_mb

from containers.geometry import load_geometry
from relayout.planning.plan import source_from_geometry
from relayout.traces.synth import synth_trace
from replay.model.config import RuntimeConfig
from replay.model.coupling import coupling_table
from replay.model.device import load_device
from replay.model.engine import simulate
from replay.control.sources import learn_source
from replay.formats.trace import save_trace

RECORDS = Path(__file__).resolve().parent / "records"
TARGET_LOADS_PER_S = 2e6
STALL_VALUED_TARGET = 1.5e6
"""The stall-valued policy's target with a 64 GB cache: modelled requests (expert loads) per second."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="relayout-bench-replay-") as tmp:
        run(args, Path(tmp))


def run(args, work: Path) -> None:
    g = load_geometry("glm-5.2-int4-row")
    trace = synth_trace(g.moe_layers, 256, 8, args.tokens, 4, seed=1, geometry=g.name)
    save_trace(trace, work / "t.rt")
    src = source_from_geometry(g)
    dev = load_device("mac-pro-2019-applraid-4x")
    mask = np.ones(trace.n_forwards, dtype=bool)
    small = synth_trace(g.moe_layers, 256, 8, 20, 1, seed=2, geometry=g.name)
    t = time.perf_counter()
    simulate(small, np.ones(small.n_forwards, dtype=bool), src.stock, dev, RuntimeConfig())
    print(f"compiled model ready in {time.perf_counter() - t:.1f} s (numba compiles on the first run on a machine, "
          f"then loads from its on-disk cache)")
    train = trace.session_forward_mask([0, 1])
    t = time.perf_counter()
    coupling = coupling_table(trace, train, src.stock)
    print(f"coupled prefetch table from {int(train.sum())} training forwards in {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    learned = learn_source("coupled", trace, train, src.stock, coupling=coupling)
    print(f"coupled source's calibration learned on the same forwards in {time.perf_counter() - t:.1f} s")
    shared = replace(dev, drive=replace(dev.drive, service="shared"))     # drives sharing their channel: an event pool
    this_vm = load_device(str(RECORDS / "v26-2026-12-03.device.json"))     # one shared drive, as calibrated here
    configs = (("no cache, 8 workers", RuntimeConfig(), dev),
               ("64 GB LRU, 8 workers, coalesce", RuntimeConfig(ram_bytes=64 * 10**9, coalesce=True), dev),
               ("no cache, oracle prefetch K=6", RuntimeConfig(prefetch="oracle"), dev),
               ("64 GB LRU, coupled prefetch K=6", RuntimeConfig(ram_bytes=64 * 10**9, prefetch="coupled"), dev),
               ("64 GB LRU, coupled source, stall-valued admission Q=6",
                RuntimeConfig(ram_bytes=64 * 10**9, prefetch="coupled", admission="stall-value"), dev),
               ("no cache, 8 workers, shared drives", RuntimeConfig(), shared),
               ("64 GB LRU, coupled prefetch K=6, shared drives",
                RuntimeConfig(ram_bytes=64 * 10**9, prefetch="coupled"), shared),
               ("no cache, 8 workers, one shared drive (v26's calibrated profile)", RuntimeConfig(), this_vm))
    for label, cfg, device in configs:
        t, cpu = time.perf_counter(), time.process_time()
        inst, _ = simulate(trace, mask, src.stock, device, cfg, coupling=coupling if cfg.admission == "top-k" else learned)
        dt, cpu = time.perf_counter() - t, time.process_time() - cpu
        loads = int(inst.misses.sum()) + (int(inst.prefetch.loads.sum()) if inst.prefetch is not None else 0)
        lookups = int(inst.union_experts.sum())
        print(f"{label}: {args.tokens} tokens x 75 layers in {dt:.1f} s; {lookups:,} expert lookups, {loads:,} expert loads "
              f"({int(inst.reads.sum()):,} reads) = {loads / dt / 1e6:.2f} M modelled expert loads/s, "
              f"{lookups / dt / 1e6:.2f} M lookups/s, {inst.reads.sum() / dt / 1e6:.2f} M modelled preads/s; "
              f"{loads / dt / TARGET_LOADS_PER_S:.2f}x the target of 2 M loads/s"
              + (f" ({loads / dt / STALL_VALUED_TARGET:.2f}x the stall-valued target of 1.5 M/s; on CPU time, "
                 f"{cpu:.1f} s: {loads / cpu / 1e6:.2f} M/s, {loads / cpu / STALL_VALUED_TARGET:.2f}x)"
                 if cfg.admission == "stall-value" else ""))
    code = (f"import numpy as np; from replay.formats.trace import load_trace; from relayout.planning.plan import source_from_geometry; "
            f"from containers.geometry import load_geometry; from replay.model.device import load_device; "
            f"from replay.model.streaming import replay_steps; "
            f"from replay.model.config import RuntimeConfig; tr = load_trace({str(work / 't.rt')!r}); "
            f"replay_steps(tr, np.ones(tr.n_forwards, bool), source_from_geometry(load_geometry('glm-5.2-int4-row')).stock, "
            f"load_device('mac-pro-2019-applraid-4x'), RuntimeConfig())")
    print(f"peak RSS of one replay (load_trace + replay_steps, as the gate runs it) in a fresh process: "
          f"{child_peak_rss_mb(code):.0f} MB (benchmarks/bench_memory.py: against trace length)")


if __name__ == "__main__":
    main()
