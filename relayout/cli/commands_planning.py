"""The planning commands: ``synth container``, ``synth trace``, ``trace import``, ``trace stats``,
``export coli-pairs`` and ``plan``. Each reads its arguments, calls the library and prints what
it wrote; the work is in :mod:`containers.synth`, :mod:`relayout.traces.synth`,
:mod:`relayout.traces.importer`, :mod:`relayout.traces.stats`, :mod:`relayout.planning.coactivation` and
:mod:`relayout.planning.plan`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from containers.container import Container
from containers.errors import InputError
from containers.geometry import load_geometry
from containers.synth import synth_container

from relayout.render.containers import plan_summary

from relayout.render.traces import format_stats

from relayout.render.units import human_bytes
from .arguments import scaled_geometry
from .output import say


def cmd_synth_container(args) -> int:
    geometry = scaled_geometry(args)
    out = synth_container(args.out, geometry, seed=args.seed, sparse=args.sparse, stamp=args.stamp)
    container = Container.open(out)
    r = container.report()
    print(f"wrote {out}: {r['files']} files, {r['routed_experts']} experts, {human_bytes(r['total_bytes'])}, "
          f"{r['off_fast_path_experts']} experts straddle files")
    return 0


def cmd_trace_import(args) -> int:
    from replay.formats.trace import save_trace

    from ..traces.importer import import_traces

    n_experts, geometry, routed, mtp = None, "inferred", None, None
    if args.geometry:
        g = load_geometry(args.geometry)
        n_experts, geometry, routed, mtp = g.n_routed_experts, g.name, g.routed_layers, g.mtp_layer_ids
    split = args.split
    if split not in (None, "prefill"):
        if not split.isdigit() or int(split) < 1:
            raise InputError(None, f"--split {split!r}: give 'prefill' or a number of tokens (at least 1)")
        split = int(split)
    trace, warnings = import_traces([Path(p) for p in args.inputs], args.format, n_experts, geometry, routed, mtp,
                                    [Path(p) for p in args.runtime_output or ()], split)
    for w in warnings:
        print(f"relayout: warning: {w}", file=sys.stderr)
    save_trace(trace, args.output)
    what = "heat only" if trace.heat_only else f"{trace.n_selections:,} selections in {trace.n_forwards:,} forwards"
    print(f"wrote {args.output}: {len(trace.sessions)} session(s), {len(trace.layers)} layers, {what}")
    return 0


def cmd_trace_stats(args) -> int:
    from replay.formats.trace import load_trace

    from ..traces.stats import trace_stats

    stats = trace_stats(load_trace(args.trace))
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def cmd_synth_trace(args) -> int:
    from replay.formats.trace import save_trace

    from ..traces.synth import SynthParams, fit_atlas, load_atlas, synth_trace

    g = scaled_geometry(args)
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
    from replay.formats.trace import load_trace

    from relayout.planning.coactivation import write_coli_pairs

    n = write_coli_pairs(load_trace(args.trace), args.output)
    print(f"wrote {args.output}: {n} coupling lines")
    return 0


def cmd_plan(args) -> int:
    from replay.evaluation.evidence import MIN_SESSIONS
    from replay.execution import open_executor
    from replay.formats.planfile import save_plan
    from replay.formats.trace import load_trace

    from relayout.planning.packing import PackOptions
    from relayout.planning.plan import (
        SPLIT_NEEDS_ONE_TRACE,
        SplitOptions,
        make_plan,
        source_from_container,
        source_from_geometry,
    )
    from relayout.planning.training import held_out_advice, pooled_training, trace_paths

    if bool(args.container) == bool(args.geometry):
        raise InputError(None, "give exactly one of --container DIR or --geometry NAME")
    paths = trace_paths(args.trace)
    if args.split_ratio is not None and len(paths) > 1:
        raise InputError(None, SPLIT_NEEDS_ONE_TRACE)
    source = (source_from_container(args.container, args.manifest) if args.container
              else source_from_geometry(scaled_geometry(args, "source_shard_mb"), args.synth_seed))
    if len(paths) == 1:
        trace = load_trace(paths[0])
        say(held_out_advice(len(trace.sessions), args.train_fraction, MIN_SESSIONS))
    else:
        with open_executor(args.scheduler) as executor:
            trace = pooled_training(paths, source.geometry, args.train_fraction, executor)
    split = None
    if args.split_ratio is not None:
        if args.split_ram_gb is None:
            raise InputError(None, "--split-ratio needs --split-ram-gb (RAM for resident top segments)")
        split = SplitOptions(args.split_ratio, int(args.split_ram_gb * 1e9), args.split_rule, int((args.cache_gb or 0) * 1e9),
                             args.split_device, args.split_workers)
    pack = PackOptions(shard_bytes=int(args.shard_mb * 1e6), alignment=args.alignment, scales_with_weights=args.scales_with_weights)
    plan = make_plan(trace, source, args.method, args.train_fraction, args.seed, args.resolution, args.weight,
                     args.min_support, pack=pack, split=split)
    save_plan(plan, args.output)
    print(f"wrote {args.output} (plan {plan['plan_digest']})")
    for line in plan_summary(plan):
        print("  " + line)
    return 0
