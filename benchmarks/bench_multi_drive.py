"""Several drives without RAID: relayout's placement against colibrì's own choices (docs/MULTI_DRIVE.md).

Usage: python benchmarks/bench_multi_drive.py [--work /tmp/relayout-multidrive] [--tokens 4000] [--sessions 20]
       [--seed 1] [--workers 8] [--pin-gb 0]

A GLM-5.2-shaped synthetic trace (``relayout synth trace --geometry glm-5.2-int4-g64 --fit
glm-5.2``; the full-size g64 container of 142 shards, 427 GB, planned without its bytes), its
sessions alternately training and held out. Drives: the shipped ``single-nvme`` profile at full
speed ("fast") and at half speed ("slow"), and for four drives two of each. Predicted S is
:mod:`replay.model.drivetime`'s drive-level estimate on the held-out sessions; intervals are 95%
bootstrap intervals over held-out sessions, paired.

1. Mirror, two drives of unequal speed: the whole container on the fast drive, a mirror of 25% and
   of 50% of its bytes on the slow one (DIRECT=1, striping on). The engine planner's choice: its
   rule re-expressed here (not its code): rank the stock shards by the usage-weighted bytes of the
   experts they hold whose gate weight is in a chosen shard or in this one, per shard byte, and take
   the best that still fit, one at a time. Usage = the training sessions' expert counts (what
   ``.coli_usage`` records). relayout: :func:`relayout.planning.drive_plan.plan_drives` with the mirror.
   Reported: S with no mirror, S with each, and how many times relayout's removal is the engine's.
2. Split (``COLI_MODEL_DIRS``) over 2 drives (fast + slow) and 4 (2 fast + 2 slow): the converter's
   shards split evenly by name against relayout's packing and assignment; reported: S of each, the
   difference from S of the whole container on the fast drive alone, relayout's saving over the
   even split and the ratio of their S. (The even split puts whole runs of layers on one drive, so
   a layer's loads never run on two drives at once, and the layers on the slow drive read at its
   speed: it is slower than the fast drive alone.)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import REPO

from containers.geometry import load_geometry
from containers.layout import layout_from_geometry
from relayout.planning.drive_plan import even_split_by_name, plan_drives, training_routing
from replay.model.device import load_device
from replay.model.drivetime import expert_table, paired_interval, ratio_interval, session_stall, speedup_interval
from replay.model.storage import DirectorySpec, DriveSpec, Storage, StorageRecord
from replay.formats.trace import load_trace



def engine_mirror_choice(layout, p, budget):
    """colibrì's mirror planner's choice, its rule re-expressed over a layout: greedy by benefit
    per shard byte, benefit = usage x bytes of the shard's experts whose gate weight is in a chosen
    shard or in this one; ties by larger benefit, smaller size, name."""
    F = len(layout.files)
    L, E = len(layout.layers), layout.n_experts
    gate_file = layout.expert_loc[:, :, 0, 0]
    per_file = [dict() for _ in range(F)]                    # file -> {(l, e): bytes}
    for l in range(L):
        for e in range(E):
            for s in range(6):
                f, _, n = layout.expert_loc[l, e, s]
                per_file[f][(l, e)] = per_file[f].get((l, e), 0) + int(n)
    chosen, active, used = [], np.zeros((L, E), dtype=bool), 0
    left = set(range(F))
    while True:
        best = None
        for f in left:
            size = layout.file_sizes[f]
            if used + size > budget:
                continue
            benefit = sum(p[l, e] * n for (l, e), n in per_file[f].items() if active[l, e] or gate_file[l, e] == f)
            if benefit <= 0:
                continue
            k = (-benefit / size, -benefit, size, layout.files[f])
            if best is None or k < best[0]:
                best = (k, f)
        if best is None:
            return chosen
        f = best[1]
        chosen.append(layout.files[f])
        active |= gate_file == f
        left.remove(f)
        used += layout.file_sizes[f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/relayout-multidrive")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trace_path = work / f"glm-{args.tokens}-{args.sessions}-{args.seed}.rt"
    if not trace_path.exists():
        subprocess.run([sys.executable, "-m", "relayout", "synth", "trace", "--geometry", "glm-5.2-int4-g64", "--fit",
                        "glm-5.2", "--tokens", str(args.tokens), "--sessions", str(args.sessions), "--seed",
                        str(args.seed), str(trace_path)], check=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    trace = load_trace(trace_path)
    g = load_geometry("glm-5.2-int4-g64")
    stock, tensors = layout_from_geometry(g)
    S = len(trace.sessions)
    held = np.arange(1, S, 2)
    train_fwd = (trace.fwd_session % 2) == 0
    test_fwd = ~train_fwd
    routing = training_routing(trace, train_fwd, stock)
    nvme = load_device("single-nvme")
    profiles = {"fast": nvme, "slow": nvme.scaled(0.5), "fast2": nvme, "slow2": nvme.scaled(0.5)}
    drives = [DriveSpec("fast", "single-nvme"), DriveSpec("slow", "single-nvme", 0.5),
              DriveSpec("fast2", "single-nvme"), DriveSpec("slow2", "single-nvme", 0.5)]
    total = sum(stock.file_sizes)
    print(f"trace: {args.tokens} decode tokens, {S} sessions ({len(held)} held out: "
          f"{int(trace.fwd_committed[test_fwd].sum())} tokens); container {len(stock.files)} shards, {total / 1e9:.1f} GB; "
          f"drives: single-nvme (fast), single-nvme x0.5 (slow); {args.workers} workers, DIRECT=1")

    def stall(layout, rec):
        st = Storage(rec, profiles, layout)
        return session_stall(trace, test_fwd, layout, st, expert_table(st, layout), None, args.workers), st

    def ms(x):
        return f"{x * 1e3:.1f}"

    base, _ = stall(stock, StorageRecord([drives[0]], [DirectorySpec("fast", list(stock.files))]))
    print(f"\nS, whole container on the fast drive: {ms(base.per_token)} ms/token")

    print("\n1. mirror on the slow drive (primary: fast)")
    print(f"{'mirror':>7} {'side':<34} {'mirror GB':>9} {'S ms/tok':>9} {'removed ms/tok [95% CI]':>26} {'mirror share':>12}")
    for frac in (0.25, 0.5):
        budget = int(frac * total)
        chosen = engine_mirror_choice(stock, routing.p, budget)
        eng_rec = StorageRecord(drives[:2], [DirectorySpec("fast", list(stock.files))], [DirectorySpec("slow", chosen)],
                                None)
        eng, eng_st = stall(stock, eng_rec)
        plan = plan_drives(stock, tensors, routing, drives[:2], profiles, ["fast"], "slow", budget,
                           shard_bytes=g.shard_bytes, workers=args.workers)
        rel, rel_st = stall(plan.layout, plan.storage)
        for name, s, st, lay, rec in (("engine planner (stock shards)", eng, eng_st, stock, eng_rec),
                                      ("relayout (repacked)", rel, rel_st, plan.layout, plan.storage)):
            gb = sum(lay.file_sizes[lay.files.index(n)] for n in rec.mirrors[0].shards) / 1e9
            d, lo, hi = paired_interval(base, s, held)
            share = _mirror_share(trace, test_fwd, lay, st)
            print(f"{frac:>7.0%} {name:<34} {gb:>9.1f} {ms(s.per_token):>9} {ms(d):>8} [{ms(lo)}, {ms(hi)}]{'':>4} {share:>11.0%}")
        r, lo, hi = ratio_interval(base, rel, eng, held)
        print(f"{'':>7} relayout removes {r:.2f}x the engine planner's stall removal [95% CI {lo:.2f}, {hi:.2f}]; "
              f"COLI_DISK_WEIGHTS={','.join(f'{w:.3g}' for w in rel_st.weights)}")

    print("\n2. split over drives (COLI_MODEL_DIRS), no mirror")
    print(f"{'drives':<22} {'side':<34} {'S ms/tok':>9} {'vs fast alone ms/tok [95% CI]':>30}")
    for split in (["fast", "slow"], ["fast", "slow", "fast2", "slow2"]):
        ds = [d for d in drives if d.name in split]
        even, _ = stall(stock, even_split_by_name(stock, ds, split))
        plan = plan_drives(stock, tensors, routing, ds, profiles, split, None, 0, shard_bytes=g.shard_bytes, workers=args.workers)
        rel, _ = stall(plan.layout, plan.storage)
        label = " + ".join(split)
        for name, s in (("converter's shards, even by name", even), ("relayout (packed and assigned)", rel)):
            d, lo, hi = paired_interval(base, s, held)
            print(f"{label:<22} {name:<34} {ms(s.per_token):>9} {ms(d):>9} [{ms(lo)}, {ms(hi)}]")
        d, lo, hi = paired_interval(even, rel, held)
        r, rlo, rhi = speedup_interval(even, rel, held)
        print(f"{'':<22} relayout saves {ms(d)} ms/token over the even split [95% CI {ms(lo)}, {ms(hi)}]; "
              f"the even split's S is {r:.2f}x relayout's [95% CI {rlo:.2f}, {rhi:.2f}]")


def _mirror_share(trace, forwards, layout, storage):
    """Share of expert bytes the mirror serves on the held-out forwards (the MIRROR: line's last figure)."""
    table = expert_table(storage, layout)
    lmap = {l: i for i, l in enumerate(layout.layers)}
    rows = forwards[trace.row_forward]
    li = np.array([lmap[int(l)] for l in trace.row_layer[rows]])
    ex = trace.experts[rows]
    tot = np.zeros(len(storage.drives))
    for k in range(ex.shape[1]):
        ok = ex[:, k] >= 0
        tot += table.bytes[li[ok], ex[ok, k].astype(np.int64)].sum(axis=0)
    mirror_drive = storage.drives.index(storage.record.mirrors[0].drive)
    # bytes on the mirror's drive that the primary copies do not hold there (primary is the fast drive)
    return tot[mirror_drive] / tot.sum()


if __name__ == "__main__":
    main()
