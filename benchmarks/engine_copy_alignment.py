"""The colibrì engine's wait on page-cache hits, stock against a rewrite whose experts start on 4 KiB.

Usage::

    python benchmarks/engine_copy_alignment.py ENGINE STOCK REWRITE [--reps 3] [--env "PIPE=0 OMP_NUM_THREADS=1"]
        [--prompt TEXT] [--ngen 24] [--cap 4]

Runs the engine (``PROF=1 TEMP=0 CAP=<cap> CAP_RAISE=0 AUTOPIN=0`` and ``--env``) on each
container once untimed, so that both are wholly in the page cache (a warm run: every expert load
is a page-cache hit), then ``--reps`` times each, interleaved. Per run it prints the decode
window's expert wait (the engine's ``PROFILE:`` line) per decode token and the per-thread copy
rates its ``[PROF] DISK-CLASS`` line gives, and at the end each container's median wait and the
ratio. A stock safetensors container's experts usually start inside a cache line; relayout's
rewrites start each on a 4 KiB boundary, and the kernel copies those faster (see
``benchmarks/copy_alignment.py`` for the same copies timed from Python).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay.colibri.engine_output import parse_engine_output  # noqa: E402

RATES = re.compile(r"DISK-CLASS.*?cold \d+ x [\d.]+ GB @ ([\d.]+) GB/s-thread.*?warm \d+ x [\d.]+ GB @ ([\d.]+) GB/s-thread")


def run(engine: str, snap: str, a) -> tuple[float, str]:
    env = dict(os.environ, PROF="1", TEMP="0", CAP=str(a.cap), CAP_RAISE="0", AUTOPIN="0", SNAP=snap,
               PROMPT=a.prompt, NGEN=str(a.ngen))
    env.update(w.split("=", 1) for w in a.env.split())
    p = subprocess.run([engine], env=env, capture_output=True, text=True, errors="replace", timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"{engine} on {snap}: exit status {p.returncode}: {p.stderr.strip()[-300:]}")
    text = p.stdout + p.stderr
    out = parse_engine_output(text, snap)
    if out.decode is None or not out.decode_tokens:
        raise SystemExit(f"{snap}: the engine printed no decode PROFILE line (PROF=1 needs a colibrì that prints it)")
    m = RATES.search(text)
    rates = f"copy {m.group(1)} / {m.group(2)} GB/s-thread (cold / warm class)" if m else "no DISK-CLASS line"
    return out.decode.wait_s / out.decode_tokens, rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine")
    ap.add_argument("stock")
    ap.add_argument("rewrite")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--env", default="PIPE=0 OMP_NUM_THREADS=1", help="engine variables, space-separated")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    ap.add_argument("--ngen", type=int, default=24)
    ap.add_argument("--cap", type=int, default=4)
    a = ap.parse_args()
    arms = {"stock": a.stock, "rewrite": a.rewrite}
    for snap in arms.values():
        run(a.engine, snap, a)                                  # untimed: the container into the page cache
    waits: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.reps):
        for name, snap in arms.items():
            w, rates = run(a.engine, snap, a)
            waits[name].append(w)
            print(f"rep {r + 1} {name:8} wait {w * 1e3:6.3f} ms/decode token  {rates}", flush=True)
    s, n = statistics.median(waits["stock"]), statistics.median(waits["rewrite"])
    print(f"warm, {a.env}: median wait stock {s * 1e3:.3f}, rewrite {n * 1e3:.3f} ms/decode token "
          f"(rewrite/stock {n / s:.2f}) over {a.reps} runs each")


if __name__ == "__main__":
    main()
