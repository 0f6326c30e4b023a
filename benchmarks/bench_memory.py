"""Replay peak memory against trace length: GLM-5.2 decode traces of 5k to 1M tokens.

Usage: python benchmarks/bench_memory.py [--tokens 5000 20000 100000 1000000]
                                         [--baseline f117103] [--baseline-max 100000] [--tree REV]
                                         [--modes streamed "in memory" baseline stats "baseline stats" "cli gate"]

For each length, writes a synthetic GLM-5.2 trace file (75 layers, top-8 of 256; sessions of
10,000 tokens, generated 100,000 tokens at a time so the generator stays small), then replays
every forward through the stock layout on the Mac Pro profile (no cache, 8 workers, no prefetch)
in fresh processes and prints each one's wall time, peak RSS (the child's VmHWM) and the stall
per committed token S it computed:

* ``streamed``: :class:`replay.formats.trace.TraceFile` + :func:`replay.model.streaming.replay_steps` over its
  row blocks (the rows never all in memory);
* ``in memory``: :func:`replay.formats.trace.load_trace` (gates left in the file) + ``replay_steps``;
* ``baseline``: the --baseline commit's tree (``git archive``) doing what its ``run_layout`` did,
  ``load_trace`` + ``simulate`` + ``step_table``, up to --baseline-max tokens (it needs about
  23 MB per 1,000 tokens);
* ``stats`` and ``baseline stats``: ``relayout trace stats``' work (``load_trace`` + ``trace_stats``)
  in each tree;
* ``cli gate``: the command a user runs, ``python -m relayout replay --layout plan.json --trace
  T.rt --device mac-pro-2019-applraid-4x -o gate.json`` (the whole gate: held-out sessions by
  content, the stock baseline and the plan replayed, the bootstrap, gate.json), the CLI's
  defaults otherwise. The plan is made once, ``relayout plan --method heat --train-fraction 0.3``
  from the first 100,000 tokens, which every longer trace begins with (the generator's first
  piece), so its 3 training sessions are excluded by content and the rest are held out.

``--tree REV`` measures that commit's tree (``git archive``) instead of the working checkout, so
that edits made meanwhile in a shared checkout do not reach the runs. The first replay in each tree compiles the model once (numba caches it); a 50-token replay warms
each tree first so no figure includes that. Scratch files go to a temporary directory (about 1.6
GB per million tokens), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, extract

GENERATE = """
import sys, numpy as np
from containers.geometry import load_geometry
from relayout.traces.synth import synth_trace
from replay.formats.trace import save_trace
from replay.model.routing import RoutingTrace
tokens, path = int(sys.argv[1]), sys.argv[2]
g = load_geometry("glm-5.2-int4-row")
layers, L, k = list(g.moe_layers), len(g.moe_layers), 8
piece, per_session = 100_000, 10_000
R = tokens * L
arrays = dict(row_forward=np.empty(R, np.int32), row_layer=np.empty(R, np.int16), row_position=np.zeros(R, np.int32),
              experts=np.empty((R, k), np.int16), gates=np.empty((R, k), np.float32),
              fwd_session=np.empty(tokens, np.int32), fwd_kind=np.empty(tokens, np.int8),
              fwd_evaluated=np.empty(tokens, np.int32), fwd_committed=np.empty(tokens, np.int32))
sessions = []
for i, f0 in enumerate(range(0, tokens, piece)):
    n = min(piece, tokens - f0)
    t = synth_trace(layers, 256, k, n, max(1, n // per_session), seed=i, geometry=g.name)
    r0 = f0 * L
    arrays["row_forward"][r0:r0 + n * L] = t.row_forward + f0
    for name in ("row_layer", "experts", "gates"):
        arrays[name][r0:r0 + n * L] = getattr(t, name)
    arrays["fwd_session"][f0:f0 + n] = t.fwd_session + len(sessions)
    for name in ("fwd_kind", "fwd_evaluated", "fwd_committed"):
        arrays[name][f0:f0 + n] = getattr(t, name)
    sessions += t.sessions
    del t
save_trace(RoutingTrace(layers=np.asarray(layers, np.int16), n_experts=256, top_k=k, geometry=g.name, sessions=sessions,
                        source="bench_memory", **arrays), path)
"""

REPLAY = """
import json, sys, time, numpy as np
t0 = time.perf_counter()
from containers.geometry import load_geometry
from relayout.planning.plan import source_from_geometry
from replay.model.config import RuntimeConfig
from replay.model.device import load_device
mode, path = sys.argv[1], sys.argv[2]
layout = source_from_geometry(load_geometry("glm-5.2-int4-row")).stock
dev, cfg = load_device("mac-pro-2019-applraid-4x"), RuntimeConfig()
if mode == "streamed":
    from replay.model.streaming import replay_steps
    from replay.formats.trace import TraceFile
    tf = TraceFile(path)
    steps = replay_steps(tf, np.ones(tf.n_forwards, bool), layout, dev, cfg, blocks=tf.row_blocks()).steps
elif mode == "in memory":
    from replay.model.streaming import replay_steps
    from replay.formats.trace import load_trace
    tr = load_trace(path)
    steps = replay_steps(tr, np.ones(tr.n_forwards, bool), layout, dev, cfg).steps
elif mode.endswith("stats"):
    from relayout.traces.stats import trace_stats
    from replay.formats.trace import load_trace
    tr = load_trace(path)
    t = trace_stats(tr)
    hwm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]) / 1024
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": hwm, "S": float("nan"), "steps": t["forwards"]}))
    sys.exit(0)
else:
    from replay.model.engine import simulate
    from replay.model.metrics import step_table
    from replay.formats.trace import load_trace
    tr = load_trace(path)
    mask = np.ones(tr.n_forwards, bool)
    inst, _ = simulate(tr, mask, layout, dev, cfg)
    steps = step_table(tr, mask, inst)
hwm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]) / 1024
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": hwm, "S": steps.stall.sum() / steps.committed.sum(),
                  "steps": len(steps.stall)}))
"""

CLI = """
import json, runpy, sys, time
t0 = time.perf_counter()
sys.argv = ["relayout", *sys.argv[1:]]
try:
    runpy.run_module("relayout", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
hwm = int([l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0]) / 1024
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": hwm}))
"""
"""``python -m relayout ARGS`` in this process, then its wall time and peak RSS as the last line."""

PLAN_TOKENS = 100_000


MODES = ("streamed", "in memory", "baseline", "stats", "baseline stats", "cli gate")


def child(tree: Path, script: str, *args: str) -> str:
    code = f"import sys; sys.path.insert(0, {str(tree)!r})\n" + script
    return subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, cwd=tree).stdout


def cli_gate(tree: Path, plan: Path, trace: Path, out: Path) -> dict:
    """``relayout replay`` (the gate) on ``trace`` in a fresh process: its time, peak RSS and what it found."""
    r = json.loads(child(tree, CLI, "replay", "--layout", str(plan), "--trace", str(trace), "--device",
                         "mac-pro-2019-applraid-4x", "-o", str(out)).splitlines()[-1])
    g = json.loads(out.read_text())
    b, p = g["baseline_metrics"], g["plan_metrics"]
    r["what"] = (f"{b['steps']:,} held-out steps of {len(g['trace']['sessions_evaluated'])} sessions "
                 f"({len(g['trace']['sessions_excluded_as_training'])} excluded as training), S = "
                 f"{b['stall_per_token_s'] * 1e3:.6f} ms/token stock, {p['stall_per_token_s'] * 1e3:.6f} plan, "
                 f"verdict {g['verdict']}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[5000, 20000, 100_000, 1_000_000])
    ap.add_argument("--baseline", default="f117103")
    ap.add_argument("--baseline-max", type=int, default=100_000)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relayout-bench-memory-"))
    try:
        old = extract(args.baseline, work / "baseline")
        tree = extract(args.tree, work / "tree") if args.tree else REPO
        warm = work / "warm.rt"
        child(tree, GENERATE, "50", str(warm))
        for where, mode in ((tree, "streamed"), (tree, "in memory"), (old, "baseline")):
            child(where, REPLAY, mode, str(warm))
        plan = work / "plan.json"
        if "cli gate" in args.modes:
            child(tree, GENERATE, str(PLAN_TOKENS), str(work / "plan.rt"))
            child(tree, CLI, "plan", "--trace", str(work / "plan.rt"), "--geometry", "glm-5.2-int4-row", "--method", "heat",
                  "--train-fraction", "0.3", "-o", str(plan))
            (work / "plan.rt").unlink()
            cli_gate(tree, plan, warm, work / "gate.json")
        print(f"GLM-5.2 decode replay, stock layout, Mac Pro profile, RuntimeConfig() defaults; "
              f"tree {args.tree or 'working checkout'}, baseline {args.baseline}")
        for tokens in args.tokens:
            path = work / f"t{tokens}.rt"
            t = time.perf_counter()
            child(tree, GENERATE, str(tokens), str(path))
            print(f"{tokens:,} tokens: trace file {path.stat().st_size / 1e6:.0f} MB, written in {time.perf_counter() - t:.0f} s",
                  flush=True)
            runs = [(old if mode.startswith("baseline") else tree, mode) for mode in MODES
                    if mode in args.modes and (not mode.startswith("baseline") or tokens <= args.baseline_max)]
            for where, mode in runs:
                if mode == "cli gate":
                    r = cli_gate(tree, plan, path, work / "gate.json")
                    print(f"  {mode:>14}: peak RSS {r['peak_mb']:7.0f} MB, {r['seconds']:7.1f} s, {r['what']}", flush=True)
                    continue
                r = json.loads(child(where, REPLAY, mode, str(path)).splitlines()[-1])
                what = (f"{r['steps']:,} steps, S = {r['S'] * 1e3:.6f} ms/token" if "stats" not in mode else
                        "relayout trace stats (load_trace + trace_stats)")
                print(f"  {mode:>14}: peak RSS {r['peak_mb']:7.0f} MB, {r['seconds']:7.1f} s, {what}", flush=True)
            path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
