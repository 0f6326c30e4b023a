"""The full-size dry run: every step of relayout on a true-size GLM-5.2 container, on a small disk.

Usage: python benchmarks/full_size.py [--dir /tmp/relayout-full] [--geometry glm-5.2-int4-g64]
                                      [--tokens 20000] [--sessions 40] [--keep]

Writes a sparse synthetic container of the true geometry (``relayout synth container --sparse``:
real headers, 142 files, 427 GB logical for int4-g64 + int8 MTP, about 1 GB allocated) and runs
synth, inspect, manifest, a synthetic 20k-token trace, plan, replay (the gate), rewrite and verify,
each as a child process (``python -m relayout ...``), recording its wall time and peak RSS (the
child's own ``VmHWM``, read just before it exits). It then asserts:

* 64-bit offsets: tensors end beyond byte 2**31 of their file and the container beyond 2**32;
  the manifest and the rewritten headers record those offsets exactly, and verify passes;
* the file limit: SRC and DST each have at most ``MAX_FILES`` (512) safetensors files, the
  runtime's glob limit;
* flat memory: the same steps on a container with the same layers, experts and tensors but
  6144/1024 x 2048/256 smaller experts (about 1/50 of the bytes); the peak RSS of manifest,
  rewrite and verify must not grow with the bytes (at most 10% + 32 MB more at full size; what
  memory they use grows with the number of tensors, their records), and stays under 1 GB;
* sparse handling: DST's allocated blocks stay under 1% of its logical size.

Everything is removed afterwards unless ``--keep``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from containers.container import MANIFEST_NAME, MAX_FILES, Container  # noqa: E402
from containers.geometry import load_geometry  # noqa: E402

_PROBE = ("import sys; sys.path.insert(0, {repo!r}); from relayout.cli import main; rc = main({argv!r}); "
          "print('VmHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0], "
          "file=sys.stderr); sys.exit(rc)")


def run_step(argv: list[str], log: Path) -> tuple[float, float]:
    """Run ``relayout ARGV`` in a fresh process; returns (wall seconds, peak RSS MB)."""
    t = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-c", _PROBE.format(repo=str(REPO), argv=argv)],
                              stdout=out, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    err = proc.stderr.splitlines()
    if proc.returncode != 0:
        raise SystemExit(f"relayout {' '.join(argv)} failed ({proc.returncode}): {' | '.join(err[-3:])}")
    kb = [line.split()[1] for line in err if line.startswith("VmHWM")][-1]
    return wall, int(kb) / 1024


def allocated(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.iterdir() if p.is_file())


def logical(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


def pipeline(work: Path, geometry: str, scale: list[str], tokens: int, sessions: int) -> dict:
    """Run every step on one container; returns per-step (seconds, MB) and the container facts."""
    work.mkdir(parents=True, exist_ok=True)
    src, dst = work / "src", work / "dst"
    trace, plan, gate = work / "trace.rt", work / "plan.json", work / "gate.json"
    steps = [
        ("synth container --sparse", ["synth", "container", str(src), "--geometry", geometry, "--sparse", *scale]),
        ("inspect", ["inspect", str(src)]),
        ("manifest", ["manifest", str(src)]),
        ("synth trace", ["synth", "trace", str(trace), "--geometry", geometry, "--tokens", str(tokens),
                         "--sessions", str(sessions)]),
        ("plan", ["plan", "--container", str(src), "--trace", str(trace), "-o", str(plan)]),
        ("replay (gate)", ["replay", "--layout", str(plan), "--trace", str(trace), "--device", "linux-md-raid0-4x",
                           "-o", str(gate)]),
        ("rewrite", ["rewrite", str(src), "--layout", str(plan), "--gate", str(gate), "--force", "--out", str(dst)]),
        ("verify", ["verify", str(src), str(dst)]),
    ]
    out: dict = {"steps": {}}
    for label, argv in steps:
        secs, mb = run_step(argv, work / f"{label.split()[0]}.log")
        out["steps"][label] = (secs, mb)
        print(f"  {label}: {secs:.1f} s, peak RSS {mb:.0f} MB", flush=True)
    s, d = Container.open(src), Container.open(dst)
    m = json.loads((src / MANIFEST_NAME).read_text())
    dm = json.loads((dst / MANIFEST_NAME).read_text())
    out.update(
        src_files=len(s.files), dst_files=len(d.files), tensors=len(s.tensors),
        src_logical=logical(src), src_allocated=allocated(src), dst_logical=logical(dst), dst_allocated=allocated(dst),
        max_src_end=max(t.entry.end for t in s.tensors.values()), max_dst_end=max(t.entry.end for t in d.tensors.values()),
        manifest_offsets_exact=all(m["tensors"][n]["offset"] == t.entry.begin for n, t in s.tensors.items())
        and all(dm["tensors"][n]["offset"] == t.entry.begin for n, t in d.tensors.items()),
        forced=dm["rewrite"]["forced"], gate=json.loads(gate.read_text()).get("verdict"),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/relayout-full", help="work directory (needs a few GB free)")
    ap.add_argument("--geometry", default="glm-5.2-int4-g64")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=40)
    ap.add_argument("--keep", action="store_true", help="keep the containers, trace and plan")
    args = ap.parse_args()
    work = Path(args.dir)
    if work.exists():
        raise SystemExit(f"{work} exists; choose a new --dir")
    g = load_geometry(args.geometry)
    small_scale = ["--hidden", "1024", "--ffn", "256", "--vocab", "4096", "--shard-mb", "64"]
    reduced = "hidden 1024, FFN 256, vocab 4096, 64 MB shards"
    try:
        print(f"full size ({args.geometry}, {len(g.moe_layers)} MoE layers x {g.n_routed_experts} experts):", flush=True)
        full = pipeline(work / "full", args.geometry, [], args.tokens, args.sessions)
        print(f"reduced ({reduced}: the same tensors, ~1/50 of the bytes) for the memory comparison:", flush=True)
        small = pipeline(work / "small", args.geometry, small_scale, args.tokens, args.sessions)
    finally:
        if not args.keep:
            t = time.perf_counter()
            shutil.rmtree(work, ignore_errors=True)
            print(f"removing the work directory took {time.perf_counter() - t:.0f} s", flush=True)

    print()
    print(f"| step | full size: wall s | peak RSS MB | {reduced}: wall s | peak RSS MB |")
    print("|---|---:|---:|---:|---:|")
    for label, (secs, mb) in full["steps"].items():
        s_secs, s_mb = small["steps"][label]
        print(f"| {label} | {secs:.1f} | {mb:.0f} | {s_secs:.1f} | {s_mb:.0f} |")
    print()
    for name, r in (("full", full), ("reduced", small)):
        print(f"{name}: SRC {r['src_files']} files, {r['tensors']} tensors, {r['src_logical'] / 1e9:.1f} GB logical, "
              f"{r['src_allocated'] / 1e9:.2f} GB allocated; DST {r['dst_files']} files, {r['dst_logical'] / 1e9:.1f} GB "
              f"logical, {r['dst_allocated'] / 1e9:.2f} GB allocated; last tensor byte at {r['max_src_end']:,} (SRC), "
              f"{r['max_dst_end']:,} (DST); gate {r['gate']}{', rewrite forced' if r['forced'] else ''}")

    checks = {
        "64-bit offsets: a tensor ends beyond 2**31 in SRC and DST": full["max_src_end"] > 2**31 and full["max_dst_end"] > 2**31,
        "the container is beyond 2**32 bytes": full["src_logical"] > 2**32,
        "manifest offsets equal the headers' (SRC and DST)": full["manifest_offsets_exact"],
        f"SRC and DST within the {MAX_FILES}-file limit": full["src_files"] <= MAX_FILES and full["dst_files"] <= MAX_FILES,
        "DST stays sparse (allocated < 1% of logical)": full["dst_allocated"] < full["dst_logical"] / 100,
    }
    checks["the reduced container has the same tensors"] = full["tensors"] == small["tensors"]
    grew = full["src_logical"] / small["src_logical"]
    for step in ("manifest", "rewrite", "verify"):
        f_mb, s_mb = full["steps"][step][1], small["steps"][step][1]
        checks[f"flat memory, {step}: {f_mb:.0f} MB at full size, {s_mb:.0f} MB with {grew:.0f}x fewer bytes "
               f"(<= 1.1x + 32 MB), and < 1 GB"] = f_mb <= 1.1 * s_mb + 32 and f_mb < 1024
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
