"""``relayout drives``: plan a packing over several drives (split and mirror), predict its stall
beside the converter's shards split evenly by name, write it, print the engine's variables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from containers.atomic import make_dirs, write_json_atomic
from containers.errors import InputError

MIN_HELD_OUT = 5
"""Held-out sessions below which the predicted saving is reported as insufficient."""
HELP = "plan shards over several drives without RAID (COLI_MODEL_DIRS, COLI_MODEL_MIRROR): packing, assignment, mirror"


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("trace", help="routing trace (.rt); without --plan even-numbered sessions train, odd-numbered ones are held out")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--geometry", help="plan for a geometry's converter layout (a shipped name or JSON)")
    src.add_argument("--container", metavar="SRC", help="plan for this container's tensors")
    c.add_argument("--drive", action="append", required=True, metavar="NAME=PROFILE[,speed=X][,capacity-gb=Y]",
                   help="a drive: its name, a device profile (shipped name or calibrated JSON), a speed factor on "
                        "the profile and its capacity in GB (repeat per drive)")
    c.add_argument("--split", metavar="NAME,NAME", help="drives the shards are split over, the primary (SNAP) first "
                                                         "(default: every drive but the mirror's)")
    c.add_argument("--mirror", metavar="NAME", help="the drive holding a partial mirror")
    c.add_argument("--mirror-gb", type=float, default=0.0, help="the mirror's budget, GB")
    c.add_argument("--path", action="append", default=[], metavar="NAME=DIR",
                   help="the directory of a drive's shards, for the printed variables (default <NAME>); a mirror on a "
                        "drive that also holds split shards is DIR-mirror")
    c.add_argument("--shard-gb", type=float, default=3.01, help="shard size, GB")
    c.add_argument("--workers", type=int, default=8, help="reader workers (PIPE_WORKERS), 1-16")
    c.add_argument("--plan", metavar="PLAN.json", help="repack this plan (relayout plan): its training sessions train, "
                                                       "the others are held out; with --out, DIR/plan.json is the "
                                                       "repacked plan, for relayout replay --storage DIR/storage.json")
    c.add_argument("--out", metavar="DIR", help="write DIR/layout.json (or DIR/plan.json with --plan) and DIR/storage.json")
    c.add_argument("--json", action="store_true", help="print JSON")


def parse_drive(text: str):
    """``NAME=PROFILE[,speed=X][,capacity-gb=Y]`` as a :class:`replay.model.storage.DriveSpec`."""
    from replay.model.storage import DriveSpec

    name, eq, rest = text.partition("=")
    parts = rest.split(",")
    if not eq or not name or not parts[0]:
        raise InputError(None, f"--drive {text!r}: want NAME=PROFILE[,speed=X][,capacity-gb=Y]")
    speed, cap = 1.0, 0
    for part in parts[1:]:
        key, _, value = part.partition("=")
        try:
            if key == "speed":
                speed = float(value)
            elif key == "capacity-gb":
                cap = int(float(value) * 1e9)
            else:
                raise ValueError
        except ValueError:
            raise InputError(None, f"--drive {text!r}: {part!r} is not speed=X or capacity-gb=Y") from None
    if not (speed > 0 and np.isfinite(speed)) or cap < 0:
        raise InputError(None, f"--drive {text!r}: speed must be positive, capacity >= 0")
    return DriveSpec(name, parts[0], speed, cap)


def cmd_drives(args) -> int:
    from containers.container import Container
    from containers.geometry import load_geometry
    from containers.layout import layout_from_container, layout_from_geometry, tensors_of_container
    from replay.model.device import load_device
    from replay.model.drivetime import expert_table, paired_interval, session_stall
    from replay.model.storage import DirectorySpec, Storage, StorageRecord
    from replay.formats.trace import load_trace

    from relayout.planning.drive_plan import even_split_by_name, plan_drives, training_routing

    drives = [parse_drive(t) for t in args.drive]
    names = [d.name for d in drives]
    if len(set(names)) != len(names):
        raise InputError(None, "--drive names must be unique")
    profiles = {}
    for d in drives:
        p = load_device(d.profile)
        profiles[d.name] = p.scaled(d.speed) if d.speed != 1.0 else p
    split = args.split.split(",") if args.split else [n for n in names if n != args.mirror]
    if args.mirror and not args.mirror_gb > 0:
        raise InputError(None, "--mirror needs --mirror-gb")
    if not 1 <= args.workers <= 16:
        raise InputError(None, f"--workers must be 1-16 (got {args.workers})")
    if args.geometry:
        stock, tensors = layout_from_geometry(load_geometry(args.geometry))
    else:
        c = Container.open(args.container)
        stock, tensors = layout_from_container(c), tensors_of_container(c)
    trace = load_trace(args.trace)
    if not set(int(x) for x in trace.layers) <= set(stock.layers):
        raise InputError(args.trace, "the trace's layers are not the model's routed layers")
    plan_in = None
    if args.plan:
        from replay.formats.planfile import load_plan

        plan_in = load_plan(args.plan)
        if plan_in.split is not None:
            raise InputError(args.plan, "a plan with split experts cannot be repacked over drives; plan without --split")
        if plan_in.stock.files != stock.files or plan_in.stock.file_sizes != stock.file_sizes:
            raise InputError(args.plan, "the plan is for another source than --geometry/--container")
        trained = set(plan_in.training_sessions)
        in_training = np.array([s in trained for s in trace.sessions], dtype=bool)
    else:
        in_training = np.arange(len(trace.sessions)) % 2 == 0
    train = in_training[trace.fwd_session]
    held = np.flatnonzero(~in_training)
    if not train.any() or len(held) == 0:
        raise InputError(args.trace, "needs training and held-out sessions (without --plan: even ones train, odd ones are held out)")
    routing = training_routing(trace, train, stock)
    plan = plan_drives(stock, tensors, routing, drives, profiles, split, args.mirror,
                       int(args.mirror_gb * 1e9), shard_bytes=int(args.shard_gb * 1e9), workers=args.workers)
    storage = Storage(plan.storage, profiles, plan.layout, "the plan")

    def stall(layout, st):
        return session_stall(trace, ~train, layout, st, expert_table(st, layout), None, args.workers)

    planned = stall(plan.layout, storage)
    even_rec = even_split_by_name(stock, drives, split)
    even = stall(stock, Storage(even_rec, profiles, stock, "the even split"))
    diff = paired_interval(even, planned, held)
    paths = dict(p.split("=", 1) for p in args.path if "=" in p)
    where = {f"dir:{i}": paths.get(d.drive, f"<{d.drive}>") for i, d in enumerate(plan.storage.dirs)}
    where.update({f"mirror:{i}": paths.get(m.drive, f"<{m.drive}>") + "-mirror" if m.drive in split else paths.get(m.drive, f"<{m.drive}>")
                  for i, m in enumerate(plan.storage.mirrors)})
    env = storage.engine_variables(where)
    if args.out:
        out = make_dirs(args.out)
        if plan_in is not None:
            from replay.formats.planfile import plan_digest, save_plan

            raw = {k: v for k, v in plan_in.raw.items() if k not in ("plan_digest", "repack_layout")}
            raw["layout"] = plan.layout.to_json()
            raw["plan_digest"] = plan_digest(raw)
            save_plan(raw, Path(out) / "plan.json")
        else:
            write_json_atomic(Path(out) / "layout.json", plan.layout.to_json())
        write_json_atomic(Path(out) / "storage.json", plan.storage.to_json())
    sizes = dict(zip(plan.layout.files, plan.layout.file_sizes))
    report = {
        "held_out_sessions": len(held),
        "sufficient": len(held) >= MIN_HELD_OUT,
        "held_out_tokens": int(trace.fwd_committed[~train].sum()),
        "dirs": [{"drive": d.drive, "shards": len(d.shards), "bytes": sum(sizes[s] for s in d.shards)} for d in plan.storage.dirs],
        "mirrors": [{"drive": m.drive, "shards": len(m.shards), "bytes": sum(sizes[s] for s in m.shards)} for m in plan.storage.mirrors],
        "stall_ms_per_token": {"planned": planned.per_token * 1e3, "even_split_by_name": even.per_token * 1e3},
        "saving_ms_per_token": {"point": diff[0] * 1e3, "low": diff[1] * 1e3, "high": diff[2] * 1e3},
        "environment": env,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for d in report["dirs"]:
        print(f"split  {d['drive']:<12} {d['shards']:>4} shards {d['bytes'] / 1e9:8.1f} GB")
    for m in report["mirrors"]:
        print(f"mirror {m['drive']:<12} {m['shards']:>4} shards {m['bytes'] / 1e9:8.1f} GB")
    print(f"predicted stall (drive-level estimate, {len(held)} held-out sessions, {report['held_out_tokens']} tokens): "
          f"planned {planned.per_token * 1e3:.1f} ms/token, the converter's shards split evenly by name "
          f"{even.per_token * 1e3:.1f} ms/token; saving {diff[0] * 1e3:.1f} ms/token "
          f"[95% CI {diff[1] * 1e3:.1f}, {diff[2] * 1e3:.1f}]")
    if len(held) < MIN_HELD_OUT:
        print(f"insufficient: {len(held)} held-out session(s), fewer than {MIN_HELD_OUT}; the interval above is not "
              "to be relied on (record more sessions)")
    if args.out:
        print(f"wrote {args.out}/{'plan' if plan_in else 'layout'}.json and {args.out}/storage.json")
        if plan_in is not None:
            dirs = [where[f"dir:{i}"] for i in range(len(plan.storage.dirs))]
            print(f"gate and stage it (each shard written into its drive's directory): relayout replay --layout "
                  f"{args.out}/plan.json --storage {args.out}/storage.json --trace TRACE -o gate.json, then relayout rewrite "
                  f"SRC --layout {args.out}/plan.json --gate gate.json --storage {args.out}/storage.json --out {dirs[0]}"
                  + (f" --dirs {' '.join(dirs[1:])}" if dirs[1:] else "")
                  + (f"; then relayout mirror stage {' '.join(dirs)} --storage {args.out}/storage.json --to <mirror dir>"
                     if plan.storage.mirrors else ""))
    print("engine variables: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return 0


MIRROR_HELP = "stage a mirror of chosen shards (checksummed, resumable, with a receipt) or check a split and mirrored model on disk"


def add_mirror_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("what", choices=("stage", "check"), help="stage: copy the storage description's mirror shards into "
                                                            "--to; check: the split as the engine indexes it and each "
                                                            "mirror against its shards (and its receipt)")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="the split directories, the primary (SNAP) first")
    c.add_argument("--storage", metavar="STORAGE.json", help="stage: the description naming the mirror's shards")
    c.add_argument("--index", type=int, default=0, help="stage: which of its mirrors (0 = the first)")
    c.add_argument("--to", metavar="DIR", help="stage: the mirror directory")
    c.add_argument("--mirror", action="append", default=[], metavar="DIR", help="check: a mirror directory (repeat)")
    c.add_argument("--json", action="store_true", help="print JSON")


def cmd_mirror(args) -> int:
    from containers.multidir import RECEIPT, check_split, mirror_receipt_problems, stage_mirror
    from replay.model.storage import load_storage

    if args.what == "stage":
        if not args.storage or not args.to:
            raise InputError(None, "mirror stage needs --storage and --to")
        rec, _ = load_storage(args.storage)
        if not 0 <= args.index < len(rec.mirrors):
            raise InputError(args.storage, f"has {len(rec.mirrors)} mirror(s); --index {args.index} is not one")
        receipt = stage_mirror(args.dirs, rec.mirrors[args.index].shards, args.to)
        total = sum(f["bytes"] for f in receipt["files"])
        print(json.dumps(receipt, indent=1) if args.json else
              f"staged {len(receipt['files'])} shard(s), {total / 1e9:.2f} GB, in {args.to} (receipt {RECEIPT})")
        return 0
    result = check_split(args.dirs, args.mirror)
    problems = list(result.problems)
    for m in args.mirror:
        if (Path(m) / RECEIPT).exists():
            problems += mirror_receipt_problems(m)
    if args.json:
        print(json.dumps({"shards": len(result.shards), "mirrored": result.mirrored, "problems": problems}, indent=1))
    else:
        print(f"{len(result.shards)} shard(s) indexed; " + "; ".join(f"mirror {m}: {len(n)} shard(s)" for m, n in zip(args.mirror, result.mirrored)))
        for p in problems[:20]:
            print(p)
        if len(problems) > 20:
            print(f"and {len(problems) - 20} more problem(s)")
        print("OK" if not problems else f"{len(problems)} problem(s)")
    return 0 if not problems else 1
