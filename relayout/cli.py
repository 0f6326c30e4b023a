"""The ``relayout`` command line: argument parsing and thin wrappers around the library.

Every user error surfaces as one line on stderr and exit status 2; see
:class:`containers.errors.InputError`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from containers.atomic import describe_os_error
from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import geometry_names, load_geometry
from containers.manifest import build_manifest, check_container, write_manifest
from containers.synth import synth_container

from . import __version__
from .textfmt import human_bytes
from .trace_synth import atlas_names


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
    lines.append(f"fast path      {r['fast_path_experts']} experts in one read, {r['off_fast_path_experts']} need more than one")
    if r["off_fast_path_examples"]:
        lines.append(f"  off the fast path: {', '.join(r['off_fast_path_examples'])}" + (" ..." if r["off_fast_path_experts"] > 20 else ""))
    if r.get("needs_split_runtime"):
        lines.append(f"runtime        NEEDS A SPLIT-AWARE RUNTIME: {r['split_experts']} experts are stored as split segments "
                     "(docs/SPLIT_SEGMENTS.md); stock colibrì cannot load this container")
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
    geometry = _scaled_geometry(args)
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


def _scaled_geometry(args, shard_attr: str = "shard_mb"):
    shard_mb = getattr(args, shard_attr, None)
    return load_geometry(args.geometry).scaled(
        moe_layers=args.moe_layers,
        experts=args.experts,
        hidden=getattr(args, "hidden", None),
        ffn=getattr(args, "ffn", None),
        shard_bytes=None if shard_mb is None else int(shard_mb * 1_000_000),
        vocab=getattr(args, "vocab", None),
    )


def cmd_trace_import(args) -> int:
    from replay.trace import save_trace

    from .trace_import import import_traces

    n_experts, geometry, routed = None, "inferred", None
    if args.geometry:
        g = load_geometry(args.geometry)
        n_experts, geometry, routed = g.n_routed_experts, g.name, g.routed_layers
    trace, warnings = import_traces([Path(p) for p in args.inputs], args.format, n_experts, geometry, routed)
    for w in warnings:
        print(f"relayout: warning: {w}", file=sys.stderr)
    save_trace(trace, args.output)
    what = "heat only" if trace.heat_only else f"{trace.n_selections:,} selections in {trace.n_forwards:,} forwards"
    print(f"wrote {args.output}: {len(trace.sessions)} session(s), {len(trace.layers)} layers, {what}")
    return 0


def cmd_trace_stats(args) -> int:
    from replay.trace import load_trace

    from .trace_stats import format_stats, trace_stats

    stats = trace_stats(load_trace(args.trace))
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def cmd_synth_trace(args) -> int:
    from replay.trace import save_trace

    from .trace_synth import SynthParams, fit_atlas, load_atlas, synth_trace

    g = _scaled_geometry(args)
    params = SynthParams()
    base_heat = None
    if args.fit:
        atlas = load_atlas(args.fit)
        if atlas.n_experts != g.n_routed_experts or atlas.k != g.num_experts_per_tok:
            raise InputError(args.fit, f"atlas has {atlas.n_experts} experts top-{atlas.k}; geometry {g.name} has "
                                       f"{g.n_routed_experts} top-{g.num_experts_per_tok}")
        params, report = fit_atlas(atlas, seed=args.seed)
        for line in report.lines():
            print(line)
        by_layer = dict(zip(atlas.layers, atlas.heat))
        base_heat = np.vstack([by_layer.get(l, atlas.heat.mean(axis=0)) for l in g.moe_layers])
    trace = synth_trace(g.moe_layers, g.n_routed_experts, g.num_experts_per_tok, args.tokens, args.sessions,
                        args.seed, params, base_heat, geometry=g.name)
    save_trace(trace, args.out)
    print(f"wrote {args.out}: {args.tokens} decode tokens, {args.sessions} sessions, layers "
          f"{g.moe_layers[0]}-{g.moe_layers[-1]}, {g.n_routed_experts} experts, top-{g.num_experts_per_tok}")
    return 0


def cmd_export_coli_pairs(args) -> int:
    from replay.trace import load_trace

    from .coactivation import write_coli_pairs

    n = write_coli_pairs(load_trace(args.trace), args.output)
    print(f"wrote {args.output}: {n} coupling lines")
    return 0


def cmd_plan(args) -> int:
    from replay.planfile import save_plan
    from replay.trace import load_trace

    from .packing import PackOptions
    from .plan import (
        SplitOptions,
        make_plan,
        plan_summary,
        source_from_container,
        source_from_geometry,
    )

    if bool(args.container) == bool(args.geometry):
        raise InputError(None, "give exactly one of --container DIR or --geometry NAME")
    source = source_from_container(args.container, args.manifest) if args.container else source_from_geometry(_scaled_geometry(args, "source_shard_mb"), args.synth_seed)
    trace = load_trace(args.trace)
    split = None
    if args.split_ratio is not None:
        if args.split_ram_gb is None:
            raise InputError(None, "--split-ratio needs --split-ram-gb (RAM for resident top segments)")
        split = SplitOptions(args.split_ratio, int(args.split_ram_gb * 1e9), args.split_rule, int((args.cache_gb or 0) * 1e9),
                             args.split_device, args.split_workers)
    pack = PackOptions(shard_bytes=int(args.shard_mb * 1e6), alignment=args.alignment, scales_with_weights=args.scales_with_weights)
    plan = make_plan(trace, source, args.method, args.train_fraction, args.seed, args.resolution, args.weight,
                     args.min_support, pack, split)
    save_plan(plan, args.output)
    print(f"wrote {args.output} (plan {plan['plan_digest']})")
    for line in plan_summary(plan):
        print("  " + line)
    return 0


def _runtime_config(args):
    from replay.runtime import RuntimeConfig

    return RuntimeConfig(
        ram_bytes=int(args.ram_gb * 1e9), workers=args.workers, batched=args.batched, coalesce=args.coalesce,
        coalesce_max_bytes=int(args.coalesce_max_mb * 1e6), direct=not args.buffered,
        pin_bytes=int(getattr(args, "pin_gb", 0.0) * 1e9), dense_seconds=args.dense_ms / 1e3,
        compute_bytes_per_second=args.compute_gbps * 1e9, other_seconds_per_token=getattr(args, "other_ms", 0.0) / 1e3,
        prefetch=getattr(args, "prefetch", "none"), prefetch_experts=getattr(args, "prefetch_experts", 6),
    )


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise InputError(None, f"expected comma-separated numbers, got {text!r}") from None


def cmd_replay(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.device import load_device
    from replay.gate import compare, format_gate, format_sweep, sweep
    from replay.planfile import load_plan
    from replay.trace import load_trace

    plan = load_plan(args.layout)
    trace = load_trace(args.trace)
    device = load_device(args.device)
    config = _runtime_config(args)
    baseline = None if args.baseline == "stock" else load_plan(args.baseline)
    if args.sweep:
        cells = sweep(plan, trace, device, config, _floats(args.sweep_ram), [int(w) for w in _floats(args.sweep_workers)],
                      args.threshold, baseline)
        if args.output:
            write_json_atomic(args.output, {"format": "relayout.sweep", "plan": plan.digest, "device": device.name, "cells": cells})
        print(json.dumps(cells, indent=1) if args.json else format_sweep(cells))
        return 0
    if bool(args.container) != bool(args.out):
        raise InputError(None, "--container and --out go together (rewrite after a passing gate)")
    gate = compare(plan, trace, device, config, baseline, args.threshold)
    if args.output:
        write_json_atomic(args.output, gate)
    print(json.dumps(gate, indent=1) if args.json else format_gate(gate))
    if args.output and not args.json:
        print(f"\nwrote {args.output}")
    if not args.container:
        return 0
    if gate["verdict"] != "pass" and not args.force:
        print(f"gate failed: {args.container} is not rewritten (pass --force to rewrite anyway)")
        return 0
    from .apply import apply_plan

    m = apply_plan(args.container, plan, args.out, gate, args.force, args.manifest, notify=_say)
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors"
          + (" (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""))
    return _verify_and_report(args.container, args.out, False, False)


def _say(line: str) -> None:
    print(f"relayout: {line}", file=sys.stderr)


def cmd_rewrite(args) -> int:
    from replay.gate import load_gate
    from replay.planfile import load_plan

    from .apply import apply_plan

    plan = load_plan(args.layout)
    gate = load_gate(args.gate) if args.gate else None
    m = apply_plan(args.src, plan, args.out, gate, args.force, args.manifest, notify=_say)
    forced = " (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors, content fingerprint "
          f"{m['content_fingerprint']} (source {m['rewrite']['source_content_fingerprint']}){forced}")
    if args.verify:
        return _verify_and_report(args.src, args.out, False, False)
    return 0


def _verify_and_report(src, dst, full: bool, as_json: bool) -> int:
    from .apply import verify

    problems, summary = verify(src, dst, full)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        for p in problems:
            print(p)
        if not problems:
            how = "byte for byte and by xxh3-128" if full else "by xxh3-128"
            split = f", {summary['split_tensors']} split tensors reassembled exactly from their segments" if summary["split_tensors"] else ""
            print(f"verified {dst}: {summary['tensors']} tensors identical to {src} {how}{split}; runtime constraints hold")
            if summary.get("needs_split_runtime"):
                print(f"note: {summary['split_experts']} experts of {dst} are stored as split segments; only a split-aware "
                      "runtime can load it (docs/SPLIT_SEGMENTS.md), stock colibrì exits at its first expert load")
    if problems:
        print(f"relayout: error: {dst}: {len(problems)} problem(s) found by verify", file=sys.stderr)
        return 2
    return 0


def cmd_verify(args) -> int:
    return _verify_and_report(args.src, args.dst, args.full, args.json)


def cmd_calibrate(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.calibrate import calibrate, format_calibration

    profile = calibrate(args.path, args.size_mb, args.seconds, args.name)
    write_json_atomic(args.output, profile)
    print(format_calibration(profile))
    print(f"wrote {args.output} (use it as --device {args.output})")
    return 0


def cmd_measure(args) -> int:
    from containers.container import Container
    from replay.gate import evaluation_forwards, training_coupling
    from replay.measure import measure
    from replay.planfile import load_plan
    from replay.trace import load_trace

    trace = load_trace(args.trace)
    plan = load_plan(args.layout) if args.layout else None
    excluded = set(plan.training_sessions) if plan else set()
    mask, _ = evaluation_forwards(trace, excluded)
    if args.tokens:
        mask &= np.cumsum(mask) <= args.tokens
    config = _runtime_config(args)
    coupling = None
    if config.prefetch == "coupled":
        if plan is None:
            raise InputError(args.trace, "--prefetch coupled needs --layout PLAN.json (its training sessions teach the pair table)")
        coupling = training_coupling(trace, plan)
    container = Container.open(args.container)
    result = measure(container, trace, mask, config, args.output, run_id=args.run_id, cold=not args.warm,
                     record=not args.no_trace, coupling=coupling)
    s = result.stall_ns / max(result.committed, 1) / 1e6
    print(f"{result.steps} steps, {result.committed} committed tokens in {result.wall_seconds:.2f} s; "
          f"S = {s:.3f} ms/token; {result.cold}; weights read {'with O_DIRECT' if result.direct else 'buffered'}")
    if result.path:
        print(f"wrote {result.path}")
    return 0


def cmd_report(args) -> int:
    from replay.gate import load_gate
    from replay.stalltrace import format_report, public_report, report, write_plots

    r = report(args.runs)
    print(json.dumps(public_report(r), indent=1) if args.json else format_report(r))
    if args.plots:
        for path in write_plots(r, args.plots, load_gate(args.predicted) if args.predicted else None):
            print(f"wrote {path}")
    return 0


def cmd_compare(args) -> int:
    from replay.stalltrace import compare, format_compare

    c = compare(args.runs)
    print(json.dumps(c, indent=1) if args.json else format_compare(c))
    if c["correctness_failures"]:
        print(f"relayout: error: {len(c['correctness_failures'])} run(s) emitted different tokens (a correctness failure, not noise)", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.dir, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relayout",
        description="Co-activation layouts for MoE expert containers streamed from NVMe: plan, replay and gate, "
                    "rewrite, verify, measure.",
    )
    p.add_argument("--version", action="version", version=f"relayout {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", help="summarise a container: files, experts, formats, fast path, problems")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("synth", help="generate synthetic containers and routing traces")
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

    c = synth.add_parser("trace", help="write a synthetic routing trace with real structure")
    c.add_argument("out")
    c.add_argument("--geometry", required=True, help=f"one of {', '.join(geometry_names())} or a geometry JSON file")
    c.add_argument("--moe-layers", type=int, help="number of MoE layers (match a scaled container)")
    c.add_argument("--experts", type=int, help="routed experts per layer (match a scaled container)")
    c.add_argument("--tokens", type=int, default=2000, help="decode tokens in all")
    c.add_argument("--sessions", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--fit", metavar="ATLAS", help="fit heat and lift to a co-activation atlas and report the error: a shipped "
                                              f"atlas ({', '.join(atlas_names())}) or an atlas JSON file")
    c.set_defaults(func=cmd_synth_trace)

    s = sub.add_parser("trace", help="import routing traces and describe them")
    tsub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = tsub.add_parser("import", help="convert ROUTE_TRACE / STALL_TRACE / MBLT / .coli_usage into a relayout trace")
    c.add_argument("inputs", nargs="+", help="input files; each is one session, in the order given")
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--format", choices=["route", "stall", "mblt", "coli_usage"], help="default: sniffed")
    c.add_argument("--geometry", help="check expert ids against this geometry and record its name")
    c.set_defaults(func=cmd_trace_import)
    c = tsub.add_parser("stats", help="heat entropy, lift, cross-layer lift, reuse distance per layer")
    c.add_argument("trace")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_trace_stats)

    s = sub.add_parser("export", help="export tables for the runtime")
    esub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = esub.add_parser("coli-pairs", help="cross-layer coupling table in colibri's .coli_pairs format")
    c.add_argument("trace")
    c.add_argument("-o", "--output", required=True)
    c.set_defaults(func=cmd_export_coli_pairs)

    s = sub.add_parser("plan", help="cluster, order and pack: write plan.json")
    s.add_argument("--trace", required=True)
    s.add_argument("--container", help="the container the plan is for")
    s.add_argument("--manifest", help=f"its manifest (default DIR/{MANIFEST_NAME}; hashed now if absent)")
    s.add_argument("--geometry", help="plan for a geometry's converter layout instead of a container")
    s.add_argument("--moe-layers", type=int)
    s.add_argument("--experts", type=int)
    s.add_argument("--hidden", type=int)
    s.add_argument("--ffn", type=int)
    s.add_argument("--vocab", type=int)
    s.add_argument("--source-shard-mb", type=float, help="with --geometry: the source's shard size, MB (as given to synth)")
    s.add_argument("--synth-seed", type=int, default=0, help="seed of the synthetic container the geometry layout mirrors")
    s.add_argument("-o", "--output", required=True)
    s.add_argument("--method", default="louvain", choices=["louvain", "greedy-modularity", "heat", "stock", "random"])
    s.add_argument("--train-fraction", type=float, default=0.7, help="first fraction of sessions to learn from")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--resolution", type=float, default=1.0, help="Louvain resolution")
    s.add_argument("--weight", default="count", choices=["count", "lift", "pmi"], help="co-activation edge weight")
    s.add_argument("--min-support", type=int, default=1, help="minimum co-selections for an edge")
    s.add_argument("--shard-mb", type=float, default=4000, help="target size of new shards, MB")
    s.add_argument("--alignment", type=int, default=4096, help="block alignment in bytes (e.g. a RAID chunk size)")
    s.add_argument("--scales-with-weights", action="store_true", help="put each expert's scales right after its weights")
    s.add_argument("--split-ratio", type=float, help="vertical split: fraction of the FFN in the top segment")
    s.add_argument("--split-ram-gb", type=float, help="RAM for resident top segments, GB")
    s.add_argument("--split-rule", default="stall", choices=["heat", "stall", "replay"],
                   help="rank tops by heat per byte, closed-form stall per byte, or replayed wait per byte")
    s.add_argument("--cache-gb", type=float, help="LRU cache the split competes with, GB (stall and replay rules)")
    s.add_argument("--split-device", default="mac-pro-2019-applraid-4x", help="device profile for the replay rule")
    s.add_argument("--split-workers", type=int, default=8, help="reader workers for the replay rule")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("replay", help="replay held-out routing through baseline and plan layouts; gate the rewrite")
    s.add_argument("--layout", required=True, metavar="PLAN.json")
    s.add_argument("--trace", required=True)
    s.add_argument("--device", required=True, help="a shipped profile name or a profile JSON")
    s.add_argument("--ram-gb", type=float, default=0.0, help="RAM for the per-layer expert LRU, GB (0 = no cache)")
    s.add_argument("--workers", type=int, default=8, help="reader workers, 1-16")
    s.add_argument("--batched", action="store_true", help="batched queue (io_uring-style, 64 loads in flight) instead of workers")
    s.add_argument("--coalesce", action="store_true", help="one read for experts contiguous in one file")
    s.add_argument("--coalesce-max-mb", type=float, default=268.435456, help="largest coalesced read, MB")
    s.add_argument("--buffered", action="store_true", help="buffered weight reads instead of O_DIRECT")
    s.add_argument("--pin-gb", type=float, default=0.0, help="pin the hottest experts (training heat), GB")
    s.add_argument("--dense-ms", type=float, default=1.0, help="per-layer compute before routing, ms")
    s.add_argument("--compute-gbps", type=float, default=50.0, help="expert matmul speed, GB of weights per second")
    s.add_argument("--other-ms", type=float, default=0.0, help="other overhead per token (O in TPOT), ms")
    s.add_argument("--prefetch", choices=("none", "oracle", "coupled"), default="none",
                   help="prefetch source for the next layer: none (colibrì's default), oracle (its true experts, "
                        "a bound), coupled (cross-layer pair counts of the training sessions, like COUPLE)")
    s.add_argument("--prefetch-experts", type=int, default=6, help="experts the prefetcher loads per layer (K, 1-64)")
    s.add_argument("--baseline", default="stock", help="'stock' (the source layout) or another plan JSON")
    s.add_argument("--threshold", type=float, default=0.05, help="gate: fraction of baseline TPOT the CI low end must save")
    s.add_argument("-o", "--output", help="write gate.json (or the sweep table as JSON)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--sweep", action="store_true", help="regime map over RAM budgets x workers x coalesce")
    s.add_argument("--sweep-ram", default="0,64,128,192,208", help="RAM budgets for --sweep, GB")
    s.add_argument("--sweep-workers", default="1,2,8,16", help="worker counts for --sweep")
    s.add_argument("--container", metavar="SRC", help="on a pass, rewrite this container (needs --out)")
    s.add_argument("--out", metavar="DST", help="destination of the rewritten container")
    s.add_argument("--manifest", help=f"SRC's manifest (default SRC/{MANIFEST_NAME}; hashed now if absent)")
    s.add_argument("--force", action="store_true", help="rewrite even if the gate fails (recorded in DST's manifest)")
    s.set_defaults(func=cmd_replay)

    s = sub.add_parser("rewrite", help="stream-rewrite a container into the plan's layout (needs a passing gate)")
    s.add_argument("src")
    s.add_argument("--layout", required=True, metavar="PLAN.json")
    s.add_argument("--out", required=True, metavar="DST")
    s.add_argument("--gate", help="gate.json from relayout replay")
    s.add_argument("--manifest", help=f"SRC's manifest (default SRC/{MANIFEST_NAME}; hashed now if absent)")
    s.add_argument("--force", action="store_true", help="rewrite without a passing gate (recorded in DST's manifest)")
    s.add_argument("--verify", action="store_true", help="verify DST against SRC afterwards")
    s.set_defaults(func=cmd_rewrite)

    s = sub.add_parser("calibrate", help="measure the device holding PATH and fit a device profile")
    s.add_argument("path", help="a directory (a temporary test file is written there) or a large file")
    s.add_argument("-o", "--output", required=True, metavar="device.json")
    s.add_argument("--size-mb", type=int, default=1024, help="test file size when PATH is a directory")
    s.add_argument("--seconds", type=float, default=0.4, help="time per (request size, queue depth) cell")
    s.add_argument("--name", help="profile name")
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("measure", help="perform the runtime's demand path for real; write a STALL_TRACE")
    s.add_argument("--container", required=True)
    s.add_argument("--trace", required=True)
    s.add_argument("--layout", metavar="PLAN.json", help="evaluate only sessions this plan did not train on")
    s.add_argument("--tokens", type=int, help="stop after this many held-out steps")
    s.add_argument("--ram-gb", type=float, default=0.0)
    s.add_argument("--workers", type=int, default=8)
    s.add_argument("--batched", action="store_true")
    s.add_argument("--coalesce", action="store_true")
    s.add_argument("--coalesce-max-mb", type=float, default=268.435456)
    s.add_argument("--buffered", action="store_true", help="buffered weight reads instead of O_DIRECT")
    s.add_argument("--dense-ms", type=float, default=1.0, help="per-layer compute before routing, ms (slept)")
    s.add_argument("--compute-gbps", type=float, default=50.0, help="expert matmul speed, GB/s (slept)")
    s.add_argument("--prefetch", choices=("none", "oracle", "coupled"), default="none",
                   help="run a prefetch thread for the next layer (coupled needs --layout)")
    s.add_argument("--prefetch-experts", type=int, default=6, help="experts the prefetch thread loads per layer (K)")
    s.add_argument("--warm", action="store_true", help="do not drop the page cache first")
    s.add_argument("--no-trace", action="store_true", help="record nothing (to measure tracing overhead)")
    s.add_argument("--run-id", default="run")
    s.add_argument("-o", "--output", help="STALL_TRACE JSONL (.zst compresses)")
    s.set_defaults(func=cmd_measure)

    s = sub.add_parser("report", help="S and the seed 4.3 metrics from STALL_TRACE files")
    s.add_argument("runs", nargs="+")
    s.add_argument("--json", action="store_true")
    s.add_argument("--plots", metavar="DIR", help="write PNG figures (needs the 'plots' extra: matplotlib)")
    s.add_argument("--predicted", metavar="gate.json", help="with --plots: add predicted vs measured S")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("compare", help="paired comparison of STALL_TRACE files (first = control)")
    s.add_argument("runs", nargs="+")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("verify", help="prove DST equals SRC tensor by tensor and meets the runtime's constraints")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--full", action="store_true", help="also compare bytes, not only xxh3-128")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_verify)

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


DEBUG_VARIABLE = "RELAYOUT_DEBUG"


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 2 a problem with the input (one line on stderr),
    1 an internal error (one line asking for a bug report; the traceback with ``RELAYOUT_DEBUG=1``),
    130 interrupted."""
    command = "relayout"
    try:
        args = build_parser().parse_args(argv)
        command = f"relayout {args.command}" + (f" {args.what}" if getattr(args, "what", None) else "")
        return args.func(args)
    except InputError as exc:
        print(f"relayout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted (anything half-written is kept aside, never under its final name)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except OSError as exc:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"relayout: error: {where}{describe_os_error(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            raise
        print(f"{command}: internal error ({type(exc).__name__}: {str(exc)[:200]}); this is a bug, please report it "
              f"with the output of {DEBUG_VARIABLE}=1 {command} ...", file=sys.stderr)
        return 1
