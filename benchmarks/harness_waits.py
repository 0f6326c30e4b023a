"""The measuring harness's own waits, side by side: the garbage collector, and handing a job to a reader.

Usage: python benchmarks/harness_waits.py WORK_DIR SOURCE [--steps N] [--objects N] [--jobs N]

WORK_DIR is the work directory `relayout validate PATH --container SOURCE --coalesce --workers 1
--keep` left (``PATH/relayout-validate``: its plans, and the rewritten louvain container in
``layout-louvain``); stock is read from SOURCE, as validate reads it. Two parts:

1. Stock and louvain measured in lockstep (one worker, coalescing, RAM 0, cold, the validation's
   first ``--steps`` held-out steps), three ways in one run: as `validate` measures; after
   allocating ``--objects`` small objects (the heap of a validation) with the collector frozen
   during the steps, as `replay.physical.measure.collector_out_of_the_way` does; and with that heap and
   the collector left free (the harness before it). Printed per way and layout: S, and the waits
   for experts whose own reads the page cache served (:func:`replay.physical.stalltrace.page_cache_wait`),
   ms/token.
2. A scale job (three buffered 3 KiB preads of cached pages) submitted to a one-thread pool
   while the main thread blocks on it, spins 47 us in Python (``time.sleep(0)`` in a loop, the
   harness's spin) or spins 47 us in compiled code with the interpreter lock released (numba,
   ``clock_gettime`` through ctypes; Linux): the median time from submission to the job's end
   (us). This is why the harness keeps its Python spin: the lock-free one hands a job over no
   sooner.

docs/BENCHMARKS.md ("The harness's own waits") records a run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import replay.physical.measure as measure
from containers.container import Container
from relayout.workflows.validation.prepare import validation_trace
from replay.model.config import RuntimeConfig
from replay.evaluation.gate import evaluation_forwards
from replay.formats.planfile import load_plan
from numba import njit
from replay.physical.stalltrace import report

SCALE_READ = 3072
COMPUTE_NS = 47_000
CLOCK_MONOTONIC = 1

_clock_gettime = ctypes.CDLL(None).clock_gettime
_clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]
_clock_gettime.restype = ctypes.c_int


@njit(nogil=True)
def _spin(deadline_ns, ts):
    while True:
        _clock_gettime(CLOCK_MONOTONIC, ts.ctypes)
        if ts[0] * 1_000_000_000 + ts[1] >= deadline_ns:
            return


def spin_until(deadline_ns: int) -> None:
    """Spin until ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux) reaches ``deadline_ns``, lock released."""
    _spin(deadline_ns, np.zeros(2, dtype=np.int64))


def measure_ways(work: Path, source: Path, steps: int, objects: int) -> None:
    plans = {m: load_plan(work / f"plan-{m}.json") for m in ("stock", "louvain")}
    trace = validation_trace(Container.open(source), 0, None)
    mask, _ = evaluation_forwards(trace, list(plans.values()))
    mask &= np.cumsum(mask) <= steps
    cfg = RuntimeConfig(workers=1, coalesce=True, ram_bytes=0)
    dirs = {"stock": source, "louvain": work / "layout-louvain"}
    free_collector = measure.collector_out_of_the_way
    with tempfile.TemporaryDirectory() as tmp:
        for way, heap, freeze in (("as validate measures", 0, True), (f"{objects} objects, collector frozen", objects, True),
                                  (f"{objects} objects, collector free", objects, False)):
            ballast = [{"i": i, "x": [i]} for i in range(heap)]
            measure.collector_out_of_the_way = free_collector if freeze else contextlib.nullcontext
            try:
                arms = [measure.Arm(Container.open(d), cfg, Path(tmp) / f"{m}.jsonl", run_id=m) for m, d in dirs.items()]
                measure.measure_interleaved(arms, trace, mask, progress=False)
            finally:
                measure.collector_out_of_the_way = free_collector
            del ballast
            gc.collect()
            runs = {m: report([Path(tmp) / f"{m}.jsonl"])["runs"][0] for m in dirs}
            print(f"  {way:40s} " + "; ".join(
                f"{m}: S {r['stall_per_committed_token_ns'] / 1e6:6.2f}, page-cache waits "
                f"{r['page_cache_wait_per_committed_token_ns'] / 1e6:5.3f}" for m, r in runs.items()) + " (ms/token)")


def handoff(file: Path, jobs: int) -> None:
    fd = os.open(file, os.O_RDONLY)
    buf = bytearray(SCALE_READ)
    for off in (0, 4096, 8192):
        os.preadv(fd, [buf], off)                         # cached from here on

    def job() -> int:
        for off in (0, 4096, 8192):
            os.preadv(fd, [buf], off)
        return time.perf_counter_ns()

    def python_spin() -> None:
        end = time.perf_counter_ns() + COMPUTE_NS
        while time.perf_counter_ns() < end:
            time.sleep(0)

    spin_until(0)                                         # compile before timing
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: None).result()
            for label, wait in (("main thread blocked on the job", None), ("main thread spins in Python", python_spin),
                                ("main thread spins without the lock",
                                 lambda: spin_until(time.perf_counter_ns() + COMPUTE_NS))):
                took = []
                for _ in range(jobs):
                    t0 = time.perf_counter_ns()
                    fut = pool.submit(job)
                    if wait:
                        wait()
                    took.append((fut.result() - t0) / 1e3)
                print(f"  {label:40s} job done {np.median(took):5.1f} us after submission (median of {jobs})")
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work_dir")
    ap.add_argument("source")
    ap.add_argument("--steps", type=int, default=137)
    ap.add_argument("--objects", type=int, default=3_000_000)
    ap.add_argument("--jobs", type=int, default=2000)
    a = ap.parse_args(argv)
    work = Path(a.work_dir)
    if not (work / "plan-louvain.json").is_file() or not (work / "layout-louvain").is_dir():
        print(f"{work}: not a kept `relayout validate --coalesce --keep` work directory with a louvain container",
              file=sys.stderr)
        return 2
    print("1. the garbage collector (stock and louvain in lockstep, 1 worker, coalescing, RAM 0, cold)")
    measure_ways(work, Path(a.source), a.steps, a.objects)
    print("2. handing a scale job to a reader thread while the main thread emulates 47 us of compute")
    handoff(next((work / "layout-louvain").glob("*.safetensors")), a.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
