"""Output identity across source trees: the same grid of configurations through each tree's own CLI.

Usage::

    python benchmarks/output_identity.py --repo /path/to/old --repo /path/to/new [--keep DIR] [--json OUT]

For each ``--repo`` root (default: this repository) the script makes a scratch directory and,
with ``PYTHONPATH=ROOT`` and the scratch directory as the working directory (so each tree's own
code runs, and every path the outputs record is relative and the same for every tree), runs
``python -m relayout``:

1. inputs: ``synth container`` (GLM-5.2 group-64 geometry scaled to 3 MoE layers x 16 experts,
   hidden 512, FFN 128, vocabulary 256, 1.5 MB shards, seed 7; the int8 MTP layer included),
   ``manifest``, ``synth trace`` (1,600 decode tokens in 16 sessions, seed 7);
2. four plans (``plan``, seed 7, 2 MB shards): ``whole`` (Louvain, whole experts), ``heat``
   (heat order, scales after weights, 64 KiB alignment), ``split`` (ratio 0.5, 2 MB of tops,
   stall rule), ``split-replay`` (ratio 0.25, 3 MB of tops, replayed-wait rule on single-nvme);
3. per configuration of :data:`GRID`: ``replay ... -o gate.json`` (the sweep configuration writes
   its sweep table, sweep.json, instead and rewrites nothing), then
   ``rewrite SRC --layout PLAN --gate gate.json --out DST`` (with ``--force`` only when the gate
   did not pass), and the same replay once more in a child Python
   that runs the CLI in-process with the replay model's ``replay_steps`` wrapped, keeping a digest
   of every array each call returns (the per-step table: stall, oracle stall, compute, committed,
   evaluated, union bytes, reads, read bytes, hits, lookups, forward, session; the per-expert
   wait; the device totals). ``replay_steps`` is looked up in ``replay.model.streaming``, then
   ``replay.streaming``, then any module of the ``replay`` package that defines it.

and prints, per configuration, a digest (SHA-256, first 16 hex digits) of each output: the
synthetic inputs, plan.json, gate.json, the rewritten container (every file, by relative name)
and the replay arrays, side by side for the trees, then ``identical`` or ``DIFFERS: <outputs>``
(with the differing files or arrays named). Exit status 1 when any output differs between trees,
2 when a tree's command fails.

Normalisation before hashing: the scratch directory's path (as given and resolved) is replaced
by ``<scratch>`` in every output's bytes, and :data:`VOLATILE_KEYS` are removed from JSON outputs.
Running one tree twice (``--repo A --repo A``) and diffing the kept outputs (``--keep``) found no
field that varies between runs of the same tree: the outputs record no timestamp, absolute path,
host name or elapsed time (paths are recorded as given, and every path given is relative to the
scratch directory), and ``tool_version`` is the same for the same tree. So :data:`VOLATILE_KEYS` is
empty and every output is hashed as written, apart from the scratch-path replacement (a guard that
changes nothing today). ``tool_version`` is deliberately not stripped: a restructure that changes
it changes plan.json, gate.json and the rewritten manifest, and this script says so; pass
``--ignore tool_version`` to compare everything else.

Time per tree on the 2-core VM at a load average of 8-10: about 3 minutes (40 s of CPU) once the
tree's compiled replay model is cached (~/.cache/relayout/src-<digest>, per source path); a tree
at a new path compiles it once, in the replay-rule split plan (7 minutes at that load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

VOLATILE_KEYS: frozenset[str] = frozenset()
"""JSON keys whose values differ between two runs of the same tree (none found; see the docstring)."""

SCRATCH = "<scratch>"

GEOMETRY = ["--geometry", "glm-5.2-int4-g64", "--moe-layers", "3", "--experts", "16"]
SYNTH_CONTAINER = ["synth", "container", *GEOMETRY, "--hidden", "512", "--ffn", "128", "--vocab", "256",
                   "--shard-mb", "1.5", "--seed", "7", "src"]
SYNTH_TRACE = ["synth", "trace", *GEOMETRY, "--tokens", "1600", "--sessions", "16", "--seed", "7", "trace.rt"]

PLAN_COMMON = ["--trace", "trace.rt", "--container", "src", "--seed", "7", "--scheduler", "none", "--shard-mb", "2"]
PLANS: dict[str, list[str]] = {
    "whole": [],
    "heat": ["--method", "heat", "--scales-with-weights", "--alignment", "65536"],
    "split": ["--split-ratio", "0.5", "--split-ram-gb", "0.002", "--cache-gb", "0.002"],
    "split-replay": ["--split-ratio", "0.25", "--split-ram-gb", "0.003", "--split-rule", "replay",
                     "--cache-gb", "0.002", "--split-device", "single-nvme", "--split-workers", "2"],
}
"""Plan name -> ``relayout plan`` options beyond :data:`PLAN_COMMON`."""


@dataclass(frozen=True)
class Config:
    """One configuration of the grid: a plan and the ``relayout replay`` options to judge it with."""

    name: str
    plan: str
    replay: tuple[str, ...]
    sweep: bool = False


GRID: tuple[Config, ...] = (
    Config("whole-raid-ram0-pipe0", "whole", ("--device", "linux-md-raid0-4x", "--ram-gb", "0")),
    Config("whole-raid-lru-pipe1", "whole", ("--device", "linux-md-raid0-4x", "--ram-gb", "0.004",
                                             "--runtime-env", "PIPE=1")),
    Config("whole-nvme-oracle-pipe0", "whole", ("--device", "single-nvme", "--ram-gb", "0.004",
                                                "--runtime-env", "PIPE=0", "--prefetch", "oracle")),
    Config("whole-mac-coupled-pipe1", "whole", ("--device", "mac-pro-2019-applraid-4x", "--ram-gb", "0.004",
                                                "--runtime-env", "PIPE=1 PIPE_WORKERS=4", "--prefetch", "coupled")),
    Config("whole-raid-uring-direct", "whole", ("--device", "linux-md-raid0-4x", "--ram-gb", "0.003",
                                                "--runtime-env", "URING=1 DIRECT=1", "--other-ms", "1")),
    Config("whole-own-1w-coalesce", "whole", ("--device", "linux-md-raid0-4x", "--workers", "1", "--coalesce",
                                              "--threshold", "0.01")),
    Config("heat-own-batched-pins", "heat", ("--device", "linux-md-raid0-4x", "--batched", "--buffered",
                                             "--pin-gb", "0.001", "--ram-gb", "0.004", "--prefetch", "coupled",
                                             "--prefetch-experts", "4")),
    Config("split-raid-pipe0", "split", ("--device", "linux-md-raid0-4x", "--ram-gb", "0.006")),
    Config("split-nvme-coupled-pipe1", "split", ("--device", "single-nvme", "--ram-gb", "0.006",
                                                 "--runtime-env", "PIPE=1", "--prefetch", "coupled")),
    Config("split-replay-mac-oracle", "split-replay", ("--device", "mac-pro-2019-applraid-4x", "--ram-gb", "0.005",
                                                       "--runtime-env", "PIPE=1", "--prefetch", "oracle")),
    Config("whole-sweep", "whole", ("--device", "linux-md-raid0-4x", "--sweep", "--sweep-ram", "0,0.004",
                                    "--sweep-workers", "1,8", "--scheduler", "none"), sweep=True),
)
"""The grid: devices (Linux md RAID-0, one NVMe, the Mac Pro's RAID), LRU budgets (0 to 6 MB of a
~10 MB model), prefetch (none, oracle, coupled), the engine's read paths (PIPE=0, PIPE=1,
PIPE_WORKERS, URING with DIRECT) and relayout's own (1 worker coalescing; batched buffered with
pins), whole-expert plans (Louvain, heat) and split plans (stall rule, replay rule), a sweep."""

OUTPUTS = ("plan.json", "gate.json", "sweep.json", "rewritten", "arrays")

ARRAYS_SNIPPET = r'''
import dataclasses, hashlib, importlib, json, pkgutil, runpy, sys
import numpy as np

def find():
    for name in ("replay.model.streaming", "replay.streaming"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "replay_steps"):
            return mod
    import replay
    for info in pkgutil.walk_packages(replay.__path__, "replay."):
        mod = importlib.import_module(info.name)
        fn = getattr(mod, "replay_steps", None)
        if fn is not None and getattr(fn, "__module__", None) == info.name:
            return mod
    raise SystemExit("replay_steps not found in the replay package")

def digests(value, prefix, out):
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        out[prefix] = h.hexdigest()
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            digests(getattr(value, f.name), f"{prefix}.{f.name}" if prefix else f.name, out)
    elif isinstance(value, (int, float, bool, str, type(None), np.generic)):
        out[prefix] = hashlib.sha256(repr(value).encode()).hexdigest()
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            digests(v, f"{prefix}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            digests(v, f"{prefix}[{k!r}]", out)
    else:
        out[prefix] = "unhashable:" + type(value).__name__

mod = find()
original = mod.replay_steps
calls = []

def replay_steps(*args, **kwargs):
    result = original(*args, **kwargs)
    found = {}
    digests(result, "", found)
    calls.append(found)
    return result

for m in list(sys.modules.values()):
    if getattr(m, "replay_steps", None) is original:
        m.replay_steps = replay_steps
out_path = sys.argv[1]
sys.argv = ["relayout", *sys.argv[2:]]
code = 0
try:
    runpy.run_module("relayout", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
with open(out_path, "w") as fh:
    json.dump({"module": mod.__name__, "exit": code, "calls": calls}, fh, indent=1)
'''
"""Run ``python -m relayout ARGS`` in-process with ``replay_steps`` wrapped; write the digest of
every array (dataclass fields walked) of every call's result, in call order, to argv[1]."""


class TreeFailed(Exception):
    """A tree's command exited non-zero (or otherwise than the grid expects)."""


@dataclass
class Output:
    """One output's digest, and its parts' digests (files of a container, arrays of the replays)."""

    digest: str
    parts: dict[str, str] = field(default_factory=dict)


def short(digest: str) -> str:
    return digest[:16]


def strip_volatile(value, ignore: frozenset[str]):
    if isinstance(value, dict):
        return {k: strip_volatile(v, ignore) for k, v in value.items() if k not in ignore}
    if isinstance(value, list):
        return [strip_volatile(v, ignore) for v in value]
    return value


def normalised(data: bytes, scratch: Path, ignore: frozenset[str], is_json: bool) -> bytes:
    """``data`` with the scratch directory's path replaced by ``<scratch>`` and, for JSON with keys
    to ignore, those keys removed (then re-serialised in its own key order)."""
    for p in sorted({str(scratch), os.path.realpath(scratch)}, key=len, reverse=True):
        data = data.replace(p.encode(), SCRATCH.encode())
    if is_json and ignore:
        data = json.dumps(strip_volatile(json.loads(data), ignore), indent=1).encode()
    return data


def file_digest(path: Path, scratch: Path, ignore: frozenset[str]) -> str:
    return hashlib.sha256(normalised(path.read_bytes(), scratch, ignore, path.suffix == ".json")).hexdigest()


def combined(parts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}\0{parts[name]}\n".encode())
    return h.hexdigest()


def tree_digest(root: Path, scratch: Path, ignore: frozenset[str]) -> Output:
    parts = {str(p.relative_to(root)): file_digest(p, scratch, ignore) for p in sorted(root.rglob("*")) if p.is_file()}
    return Output(combined(parts), parts)


class Tree:
    """One source tree's run of the grid in its own scratch directory."""

    def __init__(self, root: Path, scratch: Path, ignore: frozenset[str], log):
        self.root, self.scratch, self.ignore, self.log = root, scratch, ignore, log
        self.env = dict(os.environ, PYTHONPATH=str(root))
        self.seconds: dict[str, float] = {}

    def run(self, argv: list[str], ok=(0,), what: str = "") -> subprocess.CompletedProcess:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, *argv], cwd=self.scratch, env=self.env, capture_output=True, text=True)
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t
        if p.returncode not in ok:
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            raise TreeFailed(f"{self.root}: `{' '.join(argv)}` exited {p.returncode}: {' | '.join(tail)}")
        return p

    def relayout(self, *args: str, ok=(0,), what: str = "") -> subprocess.CompletedProcess:
        return self.run(["-m", "relayout", *args], ok, what or args[0])

    def digest(self, name: str) -> Output:
        return Output(file_digest(self.scratch / name, self.scratch, self.ignore))

    def inputs(self) -> dict[str, Output]:
        self.relayout(*SYNTH_CONTAINER, what="inputs")
        self.relayout("manifest", "src", what="inputs")
        self.relayout(*SYNTH_TRACE, what="inputs")
        src = tree_digest(self.scratch / "src", self.scratch, self.ignore)
        trace = self.digest("trace.rt")
        parts = {f"src/{k}": v for k, v in src.parts.items()} | {"trace.rt": trace.digest}
        return {"inputs": Output(combined(parts), parts)}

    def plans(self) -> dict[str, Output]:
        out = {}
        for name, extra in PLANS.items():
            self.relayout("plan", *PLAN_COMMON, *extra, "-o", f"plan-{name}.json", what="plan")
            out[name] = self.digest(f"plan-{name}.json")
        return out

    def config(self, c: Config) -> dict[str, Output]:
        replay = ["replay", "--layout", f"plan-{c.plan}.json", "--trace", "trace.rt", *c.replay]
        gate = f"{'sweep' if c.sweep else 'gate'}-{c.name}.json"
        self.relayout(*replay, "-o", gate, what="replay")
        out = {"sweep.json" if c.sweep else "gate.json": self.digest(gate)}
        arrays = f"arrays-{c.name}.json"
        self.run(["-c", ARRAYS_SNIPPET, arrays, *replay], what="arrays")
        record = json.loads((self.scratch / arrays).read_text())
        if record["exit"] not in (0, None):
            raise TreeFailed(f"{self.root}: the arrays run of {c.name} exited {record['exit']}")
        parts = {f"call{i}.{name}": d for i, call in enumerate(record["calls"]) for name, d in call.items()}
        out["arrays"] = Output(combined(parts), parts)
        if not c.sweep:
            passed = json.loads((self.scratch / gate).read_text())["verdict"] == "pass"
            dst = self.scratch / f"dst-{c.name}"
            self.relayout("rewrite", "src", "--layout", f"plan-{c.plan}.json", "--gate", gate,
                          "--out", dst.name, *(() if passed else ("--force",)), what="rewrite")
            out["rewritten"] = tree_digest(dst, self.scratch, self.ignore)
            out["gate.json"].parts["verdict"] = "pass" if passed else "not pass (rewritten with --force)"
        return out


def run_tree(root: Path, keep: Path | None, index: int, ignore: frozenset[str], log) -> tuple[dict, dict, float]:
    """Run the grid in ``root``'s own scratch directory; returns (results, seconds by step, total s).
    results: "inputs" -> outputs, and configuration name -> output name -> :class:`Output`."""
    if keep is not None:
        scratch = keep / f"tree{index}"
        if scratch.exists():
            raise SystemExit(f"output_identity: {scratch} exists; give --keep a new or empty directory")
        scratch.mkdir(parents=True)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="output-identity-"))
    t0 = time.perf_counter()
    tree = Tree(root, scratch, ignore, log)
    try:
        results: dict[str, dict[str, Output]] = {"inputs": tree.inputs()}
        log(f"  inputs made ({time.perf_counter() - t0:.1f} s)")
        plans = tree.plans()
        log(f"  {len(plans)} plans made ({time.perf_counter() - t0:.1f} s)")
        for c in GRID:
            t = time.perf_counter()
            results[c.name] = {"plan.json": plans[c.plan], **tree.config(c)}
            if keep is None and not c.sweep:
                shutil.rmtree(scratch / f"dst-{c.name}")
            log(f"  {c.name}: {time.perf_counter() - t:.1f} s")
    finally:
        if keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return results, tree.seconds, time.perf_counter() - t0


def differing_parts(outputs: list[Output]) -> list[str]:
    names = sorted(set().union(*(o.parts for o in outputs)))
    return [n for n in names if len({o.parts.get(n) for o in outputs}) > 1]


def _output_order(name: str) -> tuple:
    return (OUTPUTS.index(name) if name in OUTPUTS else len(OUTPUTS), name)


def compare(results: list[dict], labels: list[str]) -> tuple[list[str], bool]:
    """The side-by-side table's lines and whether every output is identical across trees."""
    lines, all_same = [], True
    rows = ["inputs", *(c.name for c in GRID)]
    width = max(len(r) for r in rows) + 2
    head = f"{'configuration':{width}}{'output':12}" + "".join(f"{lab:18}" for lab in labels)
    lines += [head, "-" * len(head)]
    verdicts = []
    for row in rows:
        names = sorted(set().union(*(r.get(row, {}) for r in results)), key=_output_order)
        differs = []
        for n in names:
            outs = [r.get(row, {}).get(n) for r in results]
            cells = [short(o.digest) if o else "-" for o in outs]
            same = len(set(cells)) == 1
            lines.append(f"{row if n == names[0] else '':{width}}{n:12}" + "".join(f"{c:18}" for c in cells)
                         + ("" if same else "  <-"))
            if not same:
                present = [o for o in outs if o]
                detail = differing_parts(present) if len(present) == len(outs) else ["missing in a tree"]
                differs.append(n + (f" ({', '.join(detail[:6])}{', ...' if len(detail) > 6 else ''})" if detail else ""))
        all_same &= not differs
        verdicts.append(f"{row:{width}}" + ("identical" if not differs else "DIFFERS: " + "; ".join(differs)))
    return lines + ["", *verdicts], all_same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", type=Path, help="a source tree's root (repeatable; default: this repository)")
    ap.add_argument("--keep", type=Path, help="keep each tree's outputs in DIR/treeN (a new or empty directory)")
    ap.add_argument("--json", type=Path, help="write every digest (and each file's and array's) as JSON")
    ap.add_argument("--ignore", action="append", default=[], metavar="KEY",
                    help="also drop this JSON key before hashing (repeatable; e.g. tool_version)")
    ap.add_argument("--compare-with", type=Path, metavar="JSON",
                    help="an earlier run's --json file: its trees' digests join the comparison as the first "
                         "columns (run the baseline tree once); its stripped keys must be these")
    args = ap.parse_args(argv)
    roots = [r.resolve() for r in (args.repo or ([] if args.compare_with else [REPO]))]
    for r in roots:
        if not (r / "relayout" / "__main__.py").is_file():
            print(f"output_identity: {r}: not a relayout source tree (no relayout/__main__.py)", file=sys.stderr)
            return 2
    ignore = VOLATILE_KEYS | frozenset(args.ignore)
    results, timings, names = [], [], []
    if args.compare_with:
        earlier = json.loads(args.compare_with.read_text())
        if sorted(ignore) != earlier["ignored_keys"]:
            print(f"output_identity: {args.compare_with} stripped {earlier['ignored_keys']}, this run strips "
                  f"{sorted(ignore)}: digests would not compare", file=sys.stderr)
            return 2
        for tree, res, sec in zip(earlier["trees"], earlier["results"], earlier["seconds"]):
            names.append(Path(tree))
            results.append({row: {n: Output(o["digest"], o["parts"]) for n, o in outs.items()} for row, outs in res.items()})
            timings.append((sec["total"], {k: v for k, v in sec.items() if k != "total"}))
    first = len(results)
    for i, root in enumerate(roots, start=first):
        print(f"tree{i}: {root}", flush=True)
        try:
            res, seconds, total = run_tree(root, args.keep, i, ignore, lambda s: print(s, flush=True))
        except TreeFailed as exc:
            print(f"output_identity: {exc}", file=sys.stderr)
            return 2
        results.append(res)
        timings.append((total, seconds))
        names.append(root)
        print(f"  tree{i} took {total:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()) + ")", flush=True)
    labels = [f"tree{i} ({r.name})"[:17] for i, r in enumerate(names)]
    lines, same = compare(results, labels)
    print("\nSHA-256 (first 16 hex digits) of each output after normalisation; stripped JSON keys: "
          + (", ".join(sorted(ignore)) or "none") + f"; scratch path -> {SCRATCH}\n")
    print("\n".join(lines))
    if args.json:
        doc = {"trees": [str(r) for r in names], "ignored_keys": sorted(ignore),
               "seconds": [{"total": t, **s} for t, s in timings],
               "results": [{row: {n: {"digest": o.digest, "parts": o.parts} for n, o in outs.items()}
                            for row, outs in r.items()} for r in results]}
        args.json.write_text(json.dumps(doc, indent=1))
    print("\n" + ("every output identical across the trees" if same else "outputs DIFFER between the trees"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
