"""Where colibrì's threads run and how long its idle OpenMP team spins: the two facts behind
``RuntimeConfig.team_held_cores`` (docs/ENGINE_MODEL.md, "Who copies, on which cores").

Usage::

    python benchmarks/engine_team.py [--engine PATH --model DIR] [--gaps 200]

1. **The spin.** Compiles a small OpenMP program with ``cc -fopenmp`` (in a temporary
   directory): ``--gaps`` times, a parallel region, then the main thread sleeps 30 ms. The CPU
   the other threads use per gap (ms) is how long libgomp's idle threads spin before they sleep,
   printed for libgomp's default, colibrì's ``OMP_WAIT_POLICY=active GOMP_SPINCOUNT=200000``,
   ``PASSIVE`` and ``ACTIVE`` (spins through the whole gap).
2. **The threads** (with ``--engine`` and ``--model``, or ``RELAYOUT_COLIBRI_ENGINE`` and
   ``RELAYOUT_COLIBRI_FIXTURE``): runs the engine (``PIPE=1``, then ``URING=1``; ``CAP=4
   CAP_RAISE=0 AUTOPIN=0``, 24 tokens, the model's pages dropped first) under its default and
   under ``COLI_NO_OMP_TUNE=1``, sampling ``/proc/PID/task`` every 2 ms, and prints each thread's
   name, the CPUs it may run on and its CPU seconds, and the run's PROFILE wait.

Nothing is written outside the temporary directory; the model is only read.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPIN_PROGRAM = r"""
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/resource.h>
static double cpu(int who) {
    struct rusage r; getrusage(who, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}
int main(int argc, char **argv) {
    int gaps = atoi(argv[1]);
    volatile double sink = 0;
    for (int i = 0; i < gaps; i++) {
        #pragma omp parallel
        { for (int k = 0; k < 1000; k++) sink += k; }
        usleep(30000);
    }
    printf("%d %.4f\n", omp_get_max_threads(), (cpu(RUSAGE_SELF) - cpu(RUSAGE_THREAD)) / gaps * 1e3);
    return 0;
}
"""

POLICIES = [("libgomp default (COLI_NO_OMP_TUNE=1)", {}),
            ("colibrì's tuning: active, GOMP_SPINCOUNT=200000", {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "200000"}),
            ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}),
            ("OMP_WAIT_POLICY=ACTIVE (no count)", {"OMP_WAIT_POLICY": "ACTIVE"})]


def spin(gaps: int) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("spin: no C compiler (cc) on this machine: skipped")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "spin.c", Path(tmp) / "spin"
        src.write_text(SPIN_PROGRAM)
        subprocess.run([cc, "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
        print(f"libgomp's idle threads: CPU they use per 30 ms gap after a region ({gaps} gaps)")
        for name, env in POLICIES:
            out = subprocess.run([str(exe), str(gaps)], env={**base, **env}, capture_output=True, text=True,
                                 check=True).stdout.split()
            print(f"  {name:50s} team {out[0]}: {float(out[1]):7.3f} ms")


def _drop(model: Path) -> None:
    for f in model.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def threads(engine: Path, model: Path) -> None:
    tck = os.sysconf("SC_CLK_TCK")
    print("\nthe engine's threads: name, the CPUs each may run on, its CPU seconds (user+system)")
    for mode in ("PIPE=1", "URING=1"):
        for tune in ("", "COLI_NO_OMP_TUNE=1"):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "COLI_"))}
            env.update(PROF="1", TEMP="0", CAP="4", CAP_RAISE="0", AUTOPIN="0", SNAP=str(model), NGEN="24",
                       PROMPT="What is the best way to roast vegetables so they come out crispy and golden?")
            env.update(dict(w.split("=") for w in f"{mode} {tune}".split()))
            _drop(model)
            proc = subprocess.Popen([str(engine)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            seen: dict[str, tuple[str, str, float]] = {}
            while proc.poll() is None:
                for task in glob.glob(f"/proc/{proc.pid}/task/*"):
                    try:
                        status = Path(task, "status").read_text()
                        stat = Path(task, "stat").read_text()
                    except OSError:
                        continue
                    cpus = next(x.split()[-1] for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
                    f = stat[stat.rindex(")") + 2:].split()
                    seen[task] = (Path(task, "comm").read_text().strip() if os.path.exists(task) else "?", cpus,
                                  (int(f[11]) + int(f[12])) / tck)
                time.sleep(0.002)
            out = proc.stdout.read().decode(errors="replace")
            waits = [x for x in out.splitlines() if x.startswith("PROFILE:")]
            print(f"  {mode} {tune or '(the engine default)'}: decode {waits[-1] if waits else 'no PROFILE line'}")
            for task, (name, cpus, secs) in sorted(seen.items(), key=lambda kv: int(kv[0].rsplit('/', 1)[1])):
                print(f"    {name:18s} cpus {cpus:6s} {secs:5.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default=os.environ.get("RELAYOUT_COLIBRI_ENGINE"))
    ap.add_argument("--model", default=os.environ.get("RELAYOUT_COLIBRI_FIXTURE"))
    ap.add_argument("--gaps", type=int, default=200)
    a = ap.parse_args()
    spin(a.gaps)
    if a.engine and a.model:
        threads(Path(a.engine), Path(a.model))
    else:
        print("\nthe engine's threads: give --engine and --model (or RELAYOUT_COLIBRI_ENGINE and _FIXTURE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
