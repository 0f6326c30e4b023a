"""The ``relayout`` command line: argument parsing and thin wrappers around the library.

Every user error surfaces as one line on stderr and exit status 2; see
:class:`containers.errors.InputError`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import geometry_names, load_geometry
from containers.manifest import build_manifest, check_container, write_manifest
from containers.synth import synth_container

from . import __version__
from .textfmt import human_bytes, table


def cmd_inspect(args) -> int:
    container = Container.open(args.dir)
    report = container.report()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_inspect(report))
    if report["problems"]:
        print(f"relayout: error: {args.dir}: {len(report['problems'])} problem(s) found", file=sys.stderr)
        return 2
    return 0


def format_inspect(r: dict) -> str:
    lines = [
        f"container      {r['root']}",
        f"files          {r['files']} safetensors + {len(r['other_files'])} other ({', '.join(r['other_files'])})",
        f"tensors        {r['tensors']}",
        f"total size     {human_bytes(r['total_bytes'])}",
        f"MoE layers     {_ranges(r['moe_layers'])}" + (f"   MTP layers {_ranges(r['mtp_layers'])}" if r["mtp_layers"] else ""),
        f"experts/layer  {_per_layer(r['experts_per_layer'])}",
        f"routed         {r['routed_experts']} experts, {human_bytes(r['routed_bytes'])}",
    ]
    for fmt, sizes in r["bytes_per_expert"].items():
        for size, n in sizes.items():
            lines.append(f"  {fmt:<12} {n} experts x {int(size):,} B")
    lines.append(f"fast path      {r['fast_path_experts']} experts in one read, {r['off_fast_path_experts']} straddle files or are split")
    if r["off_fast_path_examples"]:
        lines.append(f"  off the fast path: {', '.join(r['off_fast_path_examples'])}" + (" ..." if r["off_fast_path_experts"] > 20 else ""))
    lines.append(f"problems       {len(r['problems']) or 'none'}")
    lines += [f"  - {p}" for p in r["problems"]]
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _per_layer(d: dict) -> str:
    counts = sorted(set(d.values()))
    return str(counts[0]) if len(counts) == 1 else ", ".join(f"L{k}:{v}" for k, v in d.items())


def cmd_synth_container(args) -> int:
    geometry = load_geometry(args.geometry).scaled(
        moe_layers=args.moe_layers,
        experts=args.experts,
        hidden=args.hidden,
        ffn=args.ffn,
        shard_bytes=None if args.shard_mb is None else int(args.shard_mb * 1_000_000),
        vocab=args.vocab,
    )
    out = synth_container(args.out, geometry, seed=args.seed)
    container = Container.open(out)
    r = container.report()
    print(f"wrote {out}: {r['files']} files, {r['routed_experts']} experts, {human_bytes(r['total_bytes'])}, "
          f"{r['off_fast_path_experts']} experts straddle files")
    return 0


def cmd_manifest(args) -> int:
    root = Path(args.dir)
    if args.check:
        problems = check_container(root, args.output)
        if problems:
            for p in problems:
                print(p)
            print(f"relayout: error: {root}: {len(problems)} mismatch(es) against the manifest", file=sys.stderr)
            return 2
        print(f"{root}: every file and tensor matches the manifest")
        return 0
    container = Container.open(root)
    container.require_clean()
    manifest = build_manifest(container)
    out = Path(args.output) if args.output else root / MANIFEST_NAME
    write_manifest(manifest, out)
    print(f"wrote {out}: {len(manifest['files'])} files, {len(manifest['tensors'])} tensors, "
          f"fingerprint {manifest['fingerprint']}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.dir, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayout", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"relayout {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="summarise a container: files, experts, formats, fast path, problems")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("synth", help="generate synthetic containers")
    synth = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = synth.add_parser("container", help="write a synthetic container")
    c.add_argument("out")
    c.add_argument("--geometry", required=True, help=f"one of {', '.join(geometry_names())} or a geometry JSON file")
    c.add_argument("--moe-layers", type=int, help="number of MoE layers (absolute numbering kept)")
    c.add_argument("--experts", type=int, help="routed experts per layer")
    c.add_argument("--hidden", type=int, help="hidden size")
    c.add_argument("--ffn", type=int, help="expert FFN (moe_intermediate) size")
    c.add_argument("--vocab", type=int, help="vocabulary size (embedding and lm_head rows)")
    c.add_argument("--shard-mb", type=float, help="target shard size in MB (10^6 bytes)")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_synth_container)

    s = sub.add_parser("manifest", help="write or check the xxh3-128 checksum manifest of a container")
    s.add_argument("dir")
    s.add_argument("-o", "--output", help=f"manifest path (default DIR/{MANIFEST_NAME})")
    s.add_argument("--check", action="store_true", help="re-hash and name every mismatch")
    s.set_defaults(func=cmd_manifest)

    s = sub.add_parser("demo", help="run the pipeline end to end on a small synthetic model")
    s.add_argument("--dir", help="work directory (default: a temporary one, removed afterwards)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InputError as exc:
        print(f"relayout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("relayout: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
