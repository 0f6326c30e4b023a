"""The ``relayout`` command line: argument parsing and thin wrappers around the library.

Every user error surfaces as one line on stderr and exit status 2; see
:class:`containers.errors.InputError`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np

from containers.atomic import describe_os_error
from containers.container import MANIFEST_NAME, Container
from containers.errors import InputError
from containers.geometry import geometry_names, load_geometry
from containers.jsonfile import shipped_names
from containers.manifest import build_manifest, check_container, write_manifest
from containers.synth import synth_container
from replay.model.config import PREFETCH_SOURCES
from replay.formats.planfile import METHODS

from . import __version__, drives_command
from . import options as opt
from .coactivation import WEIGHTS
from .gate_text import format_gate, format_sweep
from .render import (
    format_calibration,
    format_compare,
    format_hypotheses,
    format_inspect,
    format_measure,
    format_placement,
    format_reliability,
    format_rewrite_files,
    format_report,
    format_split_curve,
    format_stats,
    format_verify,
    human_bytes,
    plan_summary,
)
from .split import RULES
from .traces.importer import TRACE_FORMATS
from .traces.synth import atlas_names


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


def cmd_synth_container(args) -> int:
    geometry = _scaled_geometry(args)
    out = synth_container(args.out, geometry, seed=args.seed, sparse=args.sparse, stamp=args.stamp)
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
    from replay.formats.trace import save_trace

    from .traces.importer import import_traces

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

    from .traces.stats import trace_stats

    stats = trace_stats(load_trace(args.trace))
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def cmd_synth_trace(args) -> int:
    from replay.formats.trace import save_trace

    from .traces.synth import SynthParams, fit_atlas, load_atlas, synth_trace

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
    from replay.formats.trace import load_trace

    from .coactivation import write_coli_pairs

    n = write_coli_pairs(load_trace(args.trace), args.output)
    print(f"wrote {args.output}: {n} coupling lines")
    return 0


def cmd_plan(args) -> int:
    from replay.execution import open_executor
    from replay.formats.planfile import save_plan
    from replay.formats.trace import load_trace

    from .packing import PackOptions
    from .plan import (
        SPLIT_NEEDS_ONE_TRACE,
        SplitOptions,
        make_plan,
        source_from_container,
        source_from_geometry,
    )
    from replay.evaluation.evidence import MIN_SESSIONS

    from .training import held_out_advice, pooled_training, trace_paths

    if bool(args.container) == bool(args.geometry):
        raise InputError(None, "give exactly one of --container DIR or --geometry NAME")
    paths = trace_paths(args.trace)
    if args.split_ratio is not None and len(paths) > 1:
        raise InputError(None, SPLIT_NEEDS_ONE_TRACE)
    source = source_from_container(args.container, args.manifest) if args.container else source_from_geometry(_scaled_geometry(args, "source_shard_mb"), args.synth_seed)
    if len(paths) == 1:
        trace = load_trace(paths[0])
        _say(held_out_advice(len(trace.sessions), args.train_fraction, MIN_SESSIONS))
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
                     args.min_support, pack, split)
    save_plan(plan, args.output)
    print(f"wrote {args.output} (plan {plan['plan_digest']})")
    for line in plan_summary(plan):
        print("  " + line)
    return 0


def _prefetch_setting(text: str) -> str:
    """``--prefetch`` of the replay model: one source, or several joined by '+'."""
    from replay.model.config import prefetch_sources

    prefetch_sources(text)
    return text


def _runtime_config(args, layout=None):
    """The model's configuration: relayout's own read path when --workers, --batched or --buffered
    choose it, else the colibrì run --runtime-env / --runtime-env-from describe (the engine's
    defaults when neither is given; ``layout`` sizes its LRU from CAP and RAM_GB)."""
    from replay.model.config import RuntimeConfig

    own = args.workers is not None or args.batched or args.buffered
    facts = None
    gbps = args.compute_gbps
    base = RuntimeConfig(
        ram_bytes=int(getattr(args, "ram_gb", 0.0) * 1e9), workers=args.workers or 8, batched=args.batched,
        coalesce=args.coalesce, coalesce_max_bytes=int(args.coalesce_max_mb * 1e6), direct=not args.buffered,
        pin_bytes=int(getattr(args, "pin_gb", 0.0) * 1e9), dense_seconds=args.dense_ms / 1e3,
        compute_bytes_per_second=(gbps or 50.0) * 1e9, other_seconds_per_token=getattr(args, "other_ms", 0.0) / 1e3,
        prefetch=getattr(args, "prefetch", "none"), prefetch_experts=getattr(args, "prefetch_experts", 6),
        prefetch_bytes=int(getattr(args, "prefetch_budget_mb", 0.0) * 1e6),
        source_caps=list(getattr(args, "source_caps", None) or ()),
        page_cache_bytes=int((getattr(args, "page_cache_gb", None) or 0.0) * 1e9),
    )
    if not hasattr(args, "runtime_env_from"):        # the emulating harness: relayout's own read path only
        return base
    env, env_from = args.runtime_env, args.runtime_env_from
    if own and (env is not None or env_from):
        raise InputError(None, "--workers/--batched/--buffered choose relayout's own read path; with --runtime-env "
                               "give colibrì's PIPE, PIPE_WORKERS, URING, DIRECT instead")
    if own:
        return base
    from replay.colibri.engine_config import config_from_run, memory_terms, model_config, parse_runtime_env

    cfg = None
    if env_from:
        cfg, facts = config_from_run(env_from)
    cfg = parse_runtime_env(env or "", base=cfg)
    if gbps is None and facts and facts.matmul_bytes_per_second:
        base = replace(base, compute_bytes_per_second=facts.matmul_bytes_per_second)
    lru, page = memory_terms(cfg, facts, layout, base.pin_bytes) if layout is not None else (-1, 0)
    if args.page_cache_gb is None:
        base = replace(base, page_cache_bytes=page)
    return model_config(cfg, base, lru, facts.omp_threads if facts else None, base.pin_bytes)


EXIT_FAIL = 3
"""``replay --strict`` (and ``replay --container --out``, which then rewrote nothing): the gate failed."""
EXIT_INSUFFICIENT = 4
"""``replay --strict`` (and ``replay --container --out``, which then rewrote nothing): too little evidence."""


def _verdict_status(verdict: str) -> int:
    return {"pass": 0, "fail": EXIT_FAIL, "insufficient": EXIT_INSUFFICIENT}[verdict]


def cmd_replay(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.execution import open_executor
    from replay.model.device import load_device
    from replay.evaluation.evidence import split_sessions_by_content
    from replay.model.storage import storage_profile
    from replay.evaluation.gate import compare, sweep
    from replay.physical.stalltrace import measured_tpot_parts
    from replay.formats.planfile import load_plan
    from replay.formats.trace import TraceFile, load_trace

    from .gate_text import bottom_line, held_out_notice

    if args.min_sessions < 1:
        raise InputError(None, f"--min-sessions must be at least 1, got {args.min_sessions}")
    plan = load_plan(args.layout)
    hypotheses = args.policy is not None or args.hypotheses is not None
    # the gate and the sweep read the rows block by block from the file (memory flat in trace length);
    # the hypothesis tables hold the trace in memory
    trace = load_trace(args.trace) if hypotheses else TraceFile(args.trace)
    device = storage_profile(args.storage) if args.storage else load_device(args.device)
    config = _runtime_config(args, None if args.sweep or hypotheses else plan.layout)
    _check_ram(config.ram_bytes, plan)
    baseline = None if args.baseline == "stock" else load_plan(args.baseline)
    if hypotheses:
        return _replay_hypotheses(args, plan, trace, device, config)
    if args.sweep:
        with open_executor(args.scheduler) as executor:
            cells = sweep(plan, trace, device, config, _sweep_ram_gb(args, plan), list(args.sweep_workers),
                          args.threshold, baseline, args.min_sessions, executor)
        if args.output:
            write_json_atomic(args.output, {"format": "relayout.sweep", "plan": plan.digest, "device": device.name, "cells": cells})
        print(json.dumps(cells, indent=1) if args.json else format_sweep(cells))
        return 0
    if bool(args.container) != bool(args.out):
        raise InputError(None, "--container and --out go together (rewrite after a passing gate)")
    checked = None
    if args.container:
        from .apply import preflight

        checked = preflight(args.container, plan, args.out, args.manifest)
    parts = measured_tpot_parts(args.tpot_from) if args.tpot_from else None
    if not args.json:
        print(held_out_notice(split_sessions_by_content(trace, [plan] + ([baseline] if baseline else [])), args.min_sessions),
              flush=True)
    gate = compare(plan, trace, device, config, baseline, args.threshold, min_sessions=args.min_sessions, tpot_parts=parts)
    if args.output:
        write_json_atomic(args.output, gate.to_json())
    print(json.dumps(gate.to_json(), indent=1) if args.json else format_gate(gate))
    if args.output and not args.json:
        print(f"\nwrote {args.output}")
    if not args.json:
        print("\n" + bottom_line(gate, args.layout, args.output, args.container, args.out, args.force))
    if not args.container:
        return _verdict_status(gate.verdict) if args.strict else 0
    if gate.verdict != "pass" and not args.force:
        what = "had too little evidence" if gate.verdict == "insufficient" else "failed"
        print(f"gate {what}: {args.container} is not rewritten (pass --force to rewrite anyway)")
        return _verdict_status(gate.verdict)
    from .apply import apply_plan

    m = apply_plan(args.container, plan, args.out, gate, args.force, args.manifest, notify=_say, checked=checked)
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors"
          + (" (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""))
    _print_rewrite_files(args.out, m)
    return _verify_and_report(args.container, args.out, False, False)


SWEEP_RAM_SHARES = (0.0, 0.125, 0.25, 0.5)
"""``--sweep``'s RAM budgets when none are given: these shares of the plan's routed expert bytes."""


def _routed_bytes(plan) -> int:
    return int(plan.layout.expert_bytes().sum())


def _check_ram(ram_bytes: int, plan) -> None:
    """A RAM budget beyond every routed expert's bytes is a mistake of units or of model: refuse it."""
    routed = _routed_bytes(plan)
    if ram_bytes > routed:
        raise InputError(None, f"--ram-gb {ram_bytes / 1e9:g} is more than all {routed / 1e9:.3g} GB of this model's routed "
                               "experts (every expert would stay in RAM); give the RAM the runtime has for experts")


def _sweep_ram_gb(args, plan) -> list[float]:
    """``--sweep-ram`` as given (each checked against the model), or shares of the model's routed
    bytes, with ``--ram-gb`` among them when it is set."""
    if args.sweep_ram:
        budgets = list(args.sweep_ram)
        for gb in budgets:
            _check_ram(int(gb * 1e9), plan)
        return budgets
    routed = _routed_bytes(plan)
    budgets = {float(f"{share * routed / 1e9:.3g}") for share in SWEEP_RAM_SHARES}
    if args.ram_gb:
        budgets.add(args.ram_gb)
    return sorted(budgets)


def _replay_hypotheses(args, plan, trace, device, config) -> int:
    """``replay --policy``: the hypothesis tables (H2 at one regime; with ``--sweep``, every
    hypothesis over RAM x speculative-byte budgets)."""
    from dataclasses import asdict

    from containers.atomic import write_json_atomic
    from replay.execution import open_executor
    from replay.model.config import SOURCE_SEPARATOR
    from replay.control.experiments import ADMISSION_ARMS, HYPOTHESIS_KEYS, hypothesis_tables, predictor_scores

    names = ADMISSION_ARMS if args.policy in (None, "all") else tuple(p for p in args.policy.split(",") if p)
    policies = tuple(dict.fromkeys([*names, "stall-value"]))          # the arm the claim is about is always run
    keys = tuple(k for k in (args.hypotheses or ("H2,H3a,H3b,H5" if args.sweep else "H2")).split(",") if k)
    unknown = [k for k in keys if k not in HYPOTHESIS_KEYS]
    if unknown:
        raise InputError(None, f"unknown hypothesis {unknown[0]!r} (choose {', '.join(HYPOTHESIS_KEYS)})")
    source = config.prefetch if config.prefetch != "none" else "coupled"
    expert = int(plan.layout.expert_bytes().max())
    if args.sweep:
        ram = [int(x * 1e9) for x in _sweep_ram_gb(args, plan)]
        budgets = ([int(x * 1e6) for x in args.sweep_budgets_mb] if args.sweep_budgets_mb else
                   sorted({max(1, config.prefetch_experts // 2) * expert, config.prefetch_experts * expert}))
    else:
        ram, budgets = [config.ram_bytes], [config.prefetch_bytes]
    with open_executor(args.scheduler if args.sweep else "none") as executor:
        tables = hypothesis_tables(plan, trace, device, replace(config, prefetch=source), ram, budgets, keys, policies,
                                   source, args.min_sessions, executor)
    scores = predictor_scores(plan, trace, source) if SOURCE_SEPARATOR in source else []
    from replay.model.config import RUNTIME_CHANGES

    label = f"NEEDS A RUNTIME CHANGE: {RUNTIME_CHANGES['admission']} (the tables' arms other than top-k)"
    record = {"format": "relayout.hypotheses", "plan": plan.digest, "device": device.name, "source": source,
              "runtime_changes": [RUNTIME_CHANGES["admission"]], "tables": [t.to_json() for t in tables]}
    if scores:
        record["predictors"] = [asdict(r) for r in scores]
    if args.output:
        write_json_atomic(args.output, record)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        if scores:
            print(f"prediction sources on the held-out sessions ({source}: each alone, then fused)\n"
                  + format_reliability(scores) + "\n")
        print(format_hypotheses(tables) + "\n" + label)
    if args.output and not args.json:
        print(f"\nwrote {args.output}")
    return 0


def cmd_placement(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.model.device import load_device
    from replay.formats.pinfile import pin_gb_for, write_pin_file
    from replay.control.placement import ARMS, placement_arms
    from replay.formats.planfile import load_plan, save_plan, with_pins
    from replay.formats.trace import load_trace

    arms = tuple(a for a in args.arms.split(",") if a) if args.arms else ARMS
    if args.pin_gb:
        raise InputError(None, "placement chooses the pins itself within --ram-gb; --pin-gb does not apply")
    if (args.pin_file or args.plan_out) and args.export not in arms:
        raise InputError(None, f"--export {args.export} is not among the arms run ({', '.join(arms)})")
    plan = load_plan(args.layout)
    trace = load_trace(args.trace)
    device = load_device(args.device)
    study = placement_arms(plan, trace, device, _runtime_config(args), int(args.ram_gb * 1e9), arms, args.pin_share,
                           args.half_life, min_sessions=args.min_sessions)
    if args.output:
        write_json_atomic(args.output, study.to_json())
    print(json.dumps(study.to_json(), indent=1) if args.json else format_placement(study))
    record = study.pin_record(args.export) if (args.pin_file or args.plan_out) else None
    if args.pin_file:
        mtp = set(plan.geometry["mtp_layers"])
        kept = [(layer, e) for layer, e in record.experts if layer not in mtp]
        write_pin_file(args.pin_file, kept)
        size = sum(int(plan.geometry["expert_bytes"][str(layer)]) for layer, _ in kept)
        print(f"wrote {args.pin_file}: {len(kept)} pins of the {args.export} arm ({human_bytes(size)}); run colibrì with "
              f"PIN={args.pin_file} PIN_GB={pin_gb_for(size):g}"
              + (f" ({len(record.experts) - len(kept)} pin(s) in MTP layers left out: colibrì's GLM engine pins only layers "
                 "below num_hidden_layers)" if len(kept) < len(record.experts) else ""))
    if args.plan_out:
        new = with_pins(plan.raw, record)
        save_plan(new, args.plan_out)
        print(f"wrote {args.plan_out} (plan {new['plan_digest']}: {plan.digest} with the {args.export} arm's pins)")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def cmd_split_curve(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.model.device import load_device
    from replay.formats.planfile import load_plan
    from replay.control.splitcurve import split_curve
    from replay.formats.trace import load_trace

    if args.pin_gb:
        raise InputError(None, "the split curve compares LRU and resident tops within --ram-gb; --pin-gb does not apply")
    plan = load_plan(args.layout)
    trace = load_trace(args.trace)
    curve = split_curve(plan, trace, load_device(args.device), _runtime_config(args), [int(x * 1e9) for x in args.ram_budgets_gb],
                        args.ratios, args.top_shares, min_sessions=args.min_sessions)
    if args.output:
        write_json_atomic(args.output, curve.to_json())
    print(json.dumps(curve.to_json(), indent=1) if args.json else format_split_curve(curve))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def cmd_gate(args) -> int:
    from replay.evaluation.gate import recheck
    from replay.formats.gatefile import load_gate

    gate = load_gate(args.recheck)
    problems = recheck(gate, args.recheck)
    if problems:
        for p in problems:
            print(p)
        print(f"relayout: error: {args.recheck}: the record does not match its own evidence ({len(problems)} difference(s))",
              file=sys.stderr)
        return 2
    ev = gate.evidence
    print(f"{args.recheck}: matches its evidence: verdict {gate.verdict}, interval recomputed from {len(ev.units.committed_tokens)} "
          f"{'sessions' if ev.method == 'session' else f'steps in blocks of {ev.block_steps}'} "
          f"with seed {ev.seed} and {ev.resamples} resamples")
    return 0


def _say(line: str) -> None:
    print(f"relayout: {line}", file=sys.stderr)


def cmd_rewrite(args) -> int:
    from replay.formats.gatefile import load_gate
    from replay.formats.planfile import load_plan

    from .apply import apply_plan

    plan = load_plan(args.layout)
    gate = load_gate(args.gate) if args.gate else None
    m = apply_plan(args.src, plan, args.out, gate, args.force, args.manifest, notify=_say, gate_path=args.gate)
    forced = " (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors, content fingerprint "
          f"{m['content_fingerprint']} (source {m['rewrite']['source_content_fingerprint']}){forced}")
    _print_rewrite_files(args.out, m)
    if args.verify:
        return _verify_and_report(args.src, args.out, False, False)
    return 0


def _print_rewrite_files(dst, manifest: dict) -> None:
    """The rewrite's summary of the files around the tensors, one indented line each."""
    from containers.model_index import INDEX_NAME

    c = Container.open(dst)
    for line in format_rewrite_files(manifest, len(c.stamps), (Path(dst) / INDEX_NAME).is_file()):
        print(f"  {line}")


def _verify_and_report(src, dst, full: bool, as_json: bool) -> int:
    from .apply import verify

    problems, summary = verify(src, dst, full)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_verify(src, dst, problems, summary, full))
    if problems:
        print(f"relayout: error: {dst}: {len(problems)} problem(s) found by verify", file=sys.stderr)
        return 2
    return 0


def cmd_verify(args) -> int:
    return _verify_and_report(args.src, args.dst, args.full, args.json)


def cmd_calibrate(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.physical.calibrate import calibrate

    profile = calibrate(args.path, args.size_mb, args.seconds, args.name)
    write_json_atomic(args.output, profile)
    print(format_calibration(profile))
    print(f"wrote {args.output} (use it as --device {args.output})")
    return 0


def cmd_validate(args) -> int:
    import time

    from .render import format_validation
    from .workflows.validation.options import ValidateOptions, parse_list
    from .workflows.validation.run import validate

    t0 = time.perf_counter()
    opts = ValidateOptions(
        path=Path(args.path), output=Path(args.output), device=args.device,
        container=Path(args.container) if args.container else None, gb=args.gb, minutes=args.minutes,
        tokens=args.tokens, reps=args.reps, layouts=parse_list(args.layouts, "--layouts"),
        ram=parse_list(args.ram, "--ram", float), prefetch=parse_list(args.prefetch, "--prefetch"),
        workers=args.workers, coalesce=args.coalesce, plots=Path(args.plots) if args.plots else None, keep=args.keep,
        seed=args.seed,
    )
    record = validate(opts, notify=_say)
    print(format_validation(record))
    print(f"\nwrote {args.output}" + "".join(f", {p}" for p in record["plots"])
          + (f"; work directory kept: {record['work_dir']}" if record["work_dir"] else ""))
    print(f"total time {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_measure(args) -> int:
    if args.engine:
        from .engine_runs import cmd_measure_engine

        return cmd_measure_engine(args)
    if not args.trace:
        raise InputError(None, "measure needs --trace (the Python emulation) or --engine (the real engine)")
    from containers.container import Container
    from replay.evaluation.gate import evaluation_forwards, training_coupling
    from replay.physical.measure import default_run_id, measure
    from replay.formats.planfile import load_plan
    from replay.formats.trace import load_trace

    trace = load_trace(args.trace)
    plan = load_plan(args.layout) if args.layout else None
    mask, _ = evaluation_forwards(trace, [plan] if plan else [])
    if args.tokens:
        mask &= np.cumsum(mask) <= args.tokens
    config = _runtime_config(args)
    coupling = None
    if config.prefetch == "coupled":
        if plan is None:
            raise InputError(args.trace, "--prefetch coupled needs --layout PLAN.json (its training sessions teach the pair table)")
        coupling = training_coupling(trace, plan)
    container = Container.open(args.container)
    split = None
    if any(e.segments for e in container.experts.values()):
        from replay.model.engine import split_state

        if plan is None or not plan.split or not plan.layout.segmented:
            raise InputError(args.container, "this container stores experts as split segments; give --layout PLAN.json, "
                                             "the split plan it was rewritten from")
        split = (plan.layout, split_state(plan.split, plan.layout, plan.geometry["moe_intermediate_size"]))
    run_id = args.run_id or default_run_id(args.container, args.layout)
    result = measure(container, trace, mask, config, args.output, run_id=run_id, cold=not args.warm,
                     record=not args.no_trace, coupling=coupling, split=split)
    print("emulation: relayout's Python harness performing the modelled read path (not the colibrì engine; "
          "measure --engine runs the engine)")
    print(format_measure(result))
    if result.path:
        print(f"wrote {result.path}")
    return 0


def cmd_report(args) -> int:
    from replay.colibri.engine_output import looks_like_engine_output

    if any(looks_like_engine_output(p) for p in args.runs):
        from .engine_render import cmd_engine_report

        return cmd_engine_report(args)
    from replay.physical.stallplots import write_plots
    from replay.physical.stalltrace import report

    r = report(args.runs)
    if args.hypothesis:
        from replay.evaluation.hypotheses import measured_table

        names = {}
        for spec in args.arm or []:
            arm, sep, label = spec.partition("=")
            if not sep or not arm or not label:
                raise InputError(None, f"--arm takes ARM=CONFIGURATION, got {spec!r}")
            names[label] = arm
        table = measured_table(args.hypothesis, r.runs, names, args.min_sessions)
        print(json.dumps(table.to_json(), indent=1) if args.json else format_hypotheses([table]))
        return 0
    print(json.dumps(r.to_json(), indent=1) if args.json else format_report(r.to_json()))
    if args.plots:
        predicted = None
        if args.predicted:
            from replay.formats.gatefile import load_gate

            predicted = load_gate(args.predicted).to_json()
        for path in write_plots(r, args.plots, predicted):
            print(f"wrote {path}")
    return 0


def cmd_compare(args) -> int:
    from replay.colibri.engine_output import looks_like_engine_output

    if any(looks_like_engine_output(p) for p in args.runs):
        from .engine_render import cmd_engine_compare

        return cmd_engine_compare(args)
    from replay.physical.stalltrace import compare

    c = compare(args.runs)
    print(json.dumps(c, indent=1) if args.json else format_compare(c))
    if c["correctness_failures"]:
        print(f"relayout: error: {len(c['correctness_failures'])} run(s) emitted different tokens (a correctness failure, not noise)", file=sys.stderr)
        return 2
    return 0


def cmd_demo(args) -> int:
    from .workflows.demo import run_demo

    return run_demo(args.dir, seed=args.seed)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help line shows its default, when it has one (not for flags or absent values)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _command(sub, name: str, help: str, func=None) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", formatter_class=_Help)
    if func is not None:
        c.set_defaults(func=func)
    return c


def _geometry_options(c: argparse.ArgumentParser, full: bool = True) -> None:
    """Pick a geometry and scale it down (the absolute numbering of layers is kept)."""
    g = c.add_argument_group("geometry (scaled-down models keep the real numbering of layers)")
    g.add_argument("--moe-layers", type=opt.integer(1, 4096), help="number of MoE layers (default: the geometry's)")
    g.add_argument("--experts", type=opt.integer(1, 32767), help="routed experts per layer (default: the geometry's)")
    if full:
        g.add_argument("--hidden", type=opt.integer(1, 1 << 20), help="hidden size (default: the geometry's)")
        g.add_argument("--ffn", type=opt.integer(1, 1 << 20), help="expert FFN (moe_intermediate) size (default: the geometry's)")
        g.add_argument("--vocab", type=opt.integer(1, 1 << 24), help="vocabulary size, embedding and lm_head rows (default: the geometry's)")


def _scheduler_option(c, what: str) -> None:
    c.add_argument("--scheduler", default="local", metavar="ADDRESS",
                   help=f"where {what} runs: 'local' (a Dask cluster of one worker process per core of this machine; "
                        "serial when dask is not installed), 'none' (serial, in this process) or the address of a "
                        "running Dask scheduler (tcp://host:8786); results are the same on each")


def _runtime_options(c: argparse.ArgumentParser, modelled: bool, ram: bool = True) -> None:
    """The runtime knobs ``replay`` models and ``measure`` performs (``modelled``: replay's extras;
    ``ram``: the LRU's budget, which a command sweeping budgets takes its own way)."""
    r = c.add_argument_group("runtime (colibrì's read path)")
    if ram:
        r.add_argument("--ram-gb", type=opt.gigabytes, default=0.0, help="RAM for the per-layer expert LRU, GB (0 = no cache)"
                       + ("; the gate sizes it by CAP and RAM_GB when a colibrì configuration gives them" if modelled else ""))
    if modelled:
        r.add_argument("--runtime-env", metavar="'VAR=VALUE ...'",
                       help="the colibrì run to model, in its own variables (PIPE, PIPE_WORKERS, URING, DIRECT, CAP, "
                            "CAP_RAISE, RAM_GB, PIN_GB, OMP_NUM_THREADS; docs/ENGINE_MODEL.md). Default, unless --workers, "
                            "--batched or --buffered choose relayout's own read path: the engine's Linux default (PIPE=0: "
                            "each layer's misses loaded by the OpenMP team while the compute thread waits; buffered reads)")
        r.add_argument("--runtime-env-from", metavar="RUN.txt",
                       help="model the configuration a colibrì run printed (a file of its stdout+stderr with PROF=1, or a "
                            "directory of stdout.txt and stderr.txt: the [PROF] "
                            "config line, its LRU cap, OpenMP team and, unless --compute-gbps, its matmul rate); "
                            "--runtime-env adds to it")
        r.add_argument("--page-cache-gb", type=opt.gigabytes,
                       help="memory the kernel keeps expert weights in under buffered reads (DIRECT=0), GB (default: "
                            "what a --runtime-env-from run left of its available memory, else 0: every buffered weight "
                            "read reaches the drive)")
    r.add_argument("--workers", type=opt.integer(1, 1024), help="relayout's read path: reader workers, 1-16 (default 8)")
    r.add_argument("--batched", action="store_true", help="relayout's read path: a batched queue (io_uring-style, 64 loads in flight)")
    r.add_argument("--coalesce", action="store_true", help="one read for experts contiguous in one file: NEEDS A RUNTIME "
                                                           "CHANGE (colibrì pull request 1398, not merged)")
    r.add_argument("--coalesce-max-mb", type=opt.positive_megabytes, default=268.435456, help="largest coalesced read, MB")
    r.add_argument("--buffered", action="store_true", help="relayout's read path: buffered weight reads instead of O_DIRECT")
    r.add_argument("--dense-ms", type=opt.milliseconds, default=1.0, help="per-layer compute before routing, ms"
                                                            + ("" if modelled else " (slept)"))
    r.add_argument("--compute-gbps", type=opt.rate_gbps, help="expert matmul rate, GB (1e9 bytes) of expert weights per second "
                   "per position (default 50, or the run's own with --runtime-env-from; measure it from colibrì's PROF=1 "
                   "P0-EXEC line, 'routed CPU <s>s / <GB/s>')" + ("" if modelled else " (slept)"))
    r.add_argument("--prefetch", type=_prefetch_setting if modelled else str, default="none",
                   choices=None if modelled else PREFETCH_SOURCES, metavar="SOURCE" if modelled else None,
                   help="prefetch source for the next layer: none (colibrì's default), oracle (its true experts, a bound), "
                        "coupled (cross-layer pair counts of the training sessions, like COUPLE"
                        + ("); replay only, NEEDING A RUNTIME CHANGE: heat, persistence, session (probability sources "
                           "learned on the training "
                           "sessions), or several of coupled, heat, persistence, session joined by '+' (e.g. "
                           "coupled+persistence: their probabilities fused by a log-odds regression learned on the "
                           "training sessions; needs --policy)" if modelled else "; needs --layout)"))
    r.add_argument("--prefetch-experts", type=opt.integer(1, 64), default=6, help="experts the prefetcher loads per layer (K, 1-64)")
    if modelled:
        r.add_argument("--pin-gb", type=opt.gigabytes, default=0.0, help="pin the hottest experts (training heat), GB")
        r.add_argument("--other-ms", type=opt.milliseconds, default=0.0, help="other overhead per token (O in TPOT), ms")


def _rewrite_options(c: argparse.ArgumentParser, src_flag: bool) -> None:
    w = c.add_argument_group("rewrite")
    if src_flag:
        w.add_argument("--container", metavar="SRC", help="on a pass, rewrite this container (needs --out)")
    w.add_argument("--out", metavar="DST", required=not src_flag, help="destination of the rewritten container")
    w.add_argument("--manifest", help=f"SRC's manifest (default SRC/{MANIFEST_NAME}; hashed now if absent)")
    w.add_argument("--force", action="store_true", help="rewrite even without a passing gate (recorded in DST's manifest)")


def build_parser() -> argparse.ArgumentParser:
    p = opt.OneLineParser(
        prog="relayout", formatter_class=_Help,
        description="Co-activation layouts for MoE expert containers streamed from NVMe: plan, replay and gate, "
                    "rewrite, verify, measure. Every bad input is one line on stderr and exit status 2.",
    )
    p.add_argument("--version", action="version", version=f"relayout {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    geometries = ", ".join(geometry_names())

    s = _command(sub, "inspect", "summarise a container: files, experts, formats, fast path, problems", cmd_inspect)
    s.add_argument("dir", help="the model directory (safetensors shards and config.json)")
    s.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "synth", "generate synthetic containers and routing traces")
    synth = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = _command(synth, "container", "write a synthetic container laid out like the colibrì converter's output", cmd_synth_container)
    c.add_argument("out", help="the new directory")
    c.add_argument("--geometry", required=True, help=f"one of {geometries} or a geometry JSON file")
    _geometry_options(c)
    c.add_argument("--shard-mb", type=opt.positive_megabytes, help="target shard size in MB, 10^6 bytes (default: the geometry's)")
    c.add_argument("--seed", type=opt.seed, default=0, help="seed of the tensor bytes and the shard cuts")
    c.add_argument("--sparse", action="store_true", help="sparse files: real headers, each tensor a 4 KiB seeded stamp "
                                                         "then holes (zeros); a full-size container in a few GB of disk")
    c.add_argument("--stamp", action="store_true", help="stamp the format of every quantised tensor that is not a routed "
                                                        "expert in its shard's __metadata__[\"colibri.fmt\"], as colibrì's "
                                                        "repack tool does")

    c = _command(synth, "trace", "write a synthetic routing trace with real structure", cmd_synth_trace)
    c.add_argument("out", help="the trace file to write (.rt)")
    c.add_argument("--geometry", required=True, help=f"one of {geometries} or a geometry JSON file")
    _geometry_options(c, full=False)
    c.add_argument("--tokens", type=opt.positive_count, default=2000, help="decode tokens in all")
    c.add_argument("--sessions", type=opt.positive_count, default=8, help="sessions the tokens are split into")
    c.add_argument("--seed", type=opt.seed, default=0, help="seed of the routing")
    c.add_argument("--fit", metavar="ATLAS", help="fit heat and lift to a co-activation atlas and report the error: a shipped "
                                              f"atlas ({', '.join(atlas_names())}) or an atlas JSON file")

    s = _command(sub, "trace", "import routing traces and describe them")
    tsub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = _command(tsub, "import", "convert ROUTE_TRACE / STALL_TRACE / MBLT / .coli_usage into a relayout trace", cmd_trace_import)
    c.add_argument("inputs", nargs="+", help="input files; each is one session, in the order given")
    c.add_argument("-o", "--output", required=True, help="the trace file to write (.rt)")
    c.add_argument("--format", choices=TRACE_FORMATS, help="input format (default: sniffed from the first bytes)")
    c.add_argument("--geometry", help=f"check expert ids and layers against this geometry ({geometries} or a JSON file) "
                                      "and record its name")
    c.add_argument("--runtime-output", action="append", metavar="FILE",
                   help="colibrì's saved output (stdout, or stdout and stderr) of an input's run, one per input in the same "
                        "order: its decode forwards and tokens (a serve process's: each turn's) are checked against the "
                        "ROUTE_TRACE and its tokens become the committed tokens (without it, n-gram verify steps are "
                        "assumed to commit 1)")
    c.add_argument("--split", metavar="prefill|N",
                   help="cut each ROUTE_TRACE into sessions: 'prefill' at each new prompt (a forward wider than a decode "
                        "step; an n-gram drafting run needs --runtime-output for its draft depth), or N: every N committed "
                        "tokens (default: one session per file)")
    c = _command(tsub, "stats", "heat entropy, lift, cross-layer lift, reuse distance per layer", cmd_trace_stats)
    c.add_argument("trace", help="a relayout trace (.rt)")
    c.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "export", "export tables for the runtime")
    esub = s.add_subparsers(dest="what", required=True, metavar="WHAT")
    c = _command(esub, "coli-pairs", "cross-layer coupling table in colibrì's .coli_pairs format", cmd_export_coli_pairs)
    c.add_argument("trace", help="a relayout trace (.rt)")
    c.add_argument("-o", "--output", required=True, help="the .coli_pairs file to write")

    s = _command(sub, "plan", "cluster, order and pack: write plan.json", cmd_plan)
    s.add_argument("--trace", required=True, action="append",
                   help="a relayout trace (.rt); the first --train-fraction of its sessions train. Repeat it, or give a "
                        "directory (its *.rt files) or a quoted glob, to pool many traces: each file is split by "
                        "--train-fraction on its own and counted as one task (see --scheduler)")
    s.add_argument("-o", "--output", required=True, help="plan.json to write")
    src = s.add_argument_group("what the plan is for (exactly one)")
    src.add_argument("--container", help="the container the plan is for")
    src.add_argument("--manifest", help=f"its manifest (default DIR/{MANIFEST_NAME}; hashed now if absent)")
    src.add_argument("--geometry", help=f"plan for a geometry's converter layout instead ({geometries} or a JSON file)")
    src.add_argument("--source-shard-mb", type=opt.positive_megabytes, help="with --geometry: the source's shard size, MB (as given to synth)")
    src.add_argument("--synth-seed", type=opt.seed, default=0, help="with --geometry: seed of the synthetic container it mirrors")
    _geometry_options(s)
    m = s.add_argument_group("ordering")
    m.add_argument("--method", default="louvain", choices=METHODS, help="how each layer's experts are ordered")
    m.add_argument("--train-fraction", type=opt.number(0.0, 1.0, lo_open=True), default=0.7, help="first fraction of sessions to learn from")
    m.add_argument("--seed", type=opt.seed, default=0, help="seed of Louvain and the random baseline")
    m.add_argument("--resolution", type=opt.number(0.0, 1e6, lo_open=True), default=1.0, help="Louvain resolution")
    m.add_argument("--weight", default="count", choices=WEIGHTS, help="co-activation edge weight")
    m.add_argument("--min-support", type=opt.positive_count, default=1, help="minimum co-selections for an edge")
    _scheduler_option(m, "pooled counting (one task per trace file; a single trace is counted in this process)")
    k = s.add_argument_group("packing")
    k.add_argument("--shard-mb", type=opt.positive_megabytes, default=4000, help="target size of new shards, MB")
    k.add_argument("--alignment", type=opt.integer(1, 1 << 30), default=4096, help="block alignment in bytes (e.g. a RAID chunk size)")
    k.add_argument("--scales-with-weights", action="store_true", help="put each expert's scales right after its weights")
    v = s.add_argument_group("vertical split")
    v.add_argument("--split-ratio", type=opt.number(0.0, 1.0, lo_open=True), help="fraction of the FFN in the top segment (default: no split)")
    v.add_argument("--split-ram-gb", type=opt.gigabytes, help="RAM for resident top segments, GB (needed with --split-ratio)")
    v.add_argument("--split-rule", default="stall", choices=RULES,
                   help="rank tops by heat per byte, closed-form stall per byte, or replayed wait per byte")
    v.add_argument("--cache-gb", type=opt.gigabytes, help="LRU cache the split competes with, GB (stall and replay rules; default 0)")
    v.add_argument("--split-device", default="mac-pro-2019-applraid-4x", help="device profile for the replay rule")
    v.add_argument("--split-workers", type=opt.integer(1, 1024), default=8, help="reader workers for the replay rule")

    s = _command(sub, "replay", "replay held-out routing through baseline and plan layouts; gate the rewrite", cmd_replay)
    s.add_argument("--layout", required=True, metavar="PLAN.json",
                   help="the plan to evaluate; the pin set it carries (relayout placement --plan-out), if any, is pinned "
                        "in both layouts, and --pin-gb is then refused")
    s.add_argument("--trace", required=True,
                   help="a relayout trace file (relayout trace import); sessions the plan trained on are excluded. The gate "
                        "and --sweep stream its rows from the file (memory flat in trace length); --policy and "
                        "--hypotheses load it into memory")
    d = s.add_mutually_exclusive_group(required=True)
    d.add_argument("--device", help=f"a shipped profile ({', '.join(shipped_names('devices'))}) or a profile JSON")
    d.add_argument("--storage", metavar="STORAGE.json", help="several independent drives (relayout drives --out writes one; "
                                                            "docs/MULTI_DRIVE.md); a layout it does not list is split "
                                                            "evenly by name over its split drives")
    _runtime_options(s, modelled=True)
    g = s.add_argument_group("gate")
    g.add_argument("--baseline", default="stock", help="'stock' (the source layout) or another plan JSON")
    g.add_argument("--threshold", type=opt.fraction, default=0.05, help="fraction of baseline TPOT the interval's low end must save")
    g.add_argument("--tpot-from", metavar="RUN.jsonl",
                   help="take TPOT's compute and other time per token from a measured STALL_TRACE (relayout measure), "
                        "so the threshold is relative to a TPOT you recognise (default: the compute model and --other-ms)")
    g.add_argument("--min-sessions", type=opt.positive_count, default=5,
                   help="held-out sessions a verdict needs; with fewer the verdict is 'insufficient' (steps are then "
                        "resampled in blocks)")
    g.add_argument("--strict", action="store_true",
                   help=f"exit {EXIT_FAIL} when the gate fails and {EXIT_INSUFFICIENT} when the evidence is insufficient "
                        "(default: exit 0 whatever the verdict)")
    g.add_argument("-o", "--output", help="write gate.json (or the sweep table as JSON)")
    g.add_argument("--json", action="store_true", help="print JSON")
    w = s.add_argument_group("sweep")
    w.add_argument("--sweep", action="store_true", help="regime map over RAM budgets x workers x coalesce")
    w.add_argument("--sweep-ram", type=opt.numbers(0.0, opt.GB_MAX),
                   help="RAM budgets for --sweep, GB, comma-separated (default: 0, 1/8, 1/4 and 1/2 of the model's routed "
                        "expert bytes, and --ram-gb when given)")
    w.add_argument("--sweep-workers", type=opt.numbers(1, 1024, whole=True), default="1,2,8,16", help="worker counts for --sweep")
    _scheduler_option(w, "the sweep's cells (one task per cell)")
    h = s.add_argument_group("stall-valued control (hypothesis tables instead of the gate: H2 admission, H3a placement, "
                             "H3b whole vs split experts, H5 prefetch budgets; NEEDS A RUNTIME "
                             "CHANGE: colibrì has no admission control or prefetch budgets)")
    h.add_argument("--policy", metavar="NAME[,NAME...]",
                   help="admission policies to compare with stall-value at equal budgets (probability, per-byte, deadline, "
                        "stall-value, oracle, or 'all'); over --prefetch's source (coupled when none); prints H2's table, "
                        "with --sweep every hypothesis over --sweep-ram x --sweep-budgets-mb")
    h.add_argument("--hypotheses", metavar="H[,H...]", help="which tables: H2, H3a, H3b, H5 (default: H2; with --sweep all four)")
    h.add_argument("--prefetch-budget-mb", type=opt.megabytes, default=0.0,
                   help="speculative bytes admitted per layer (B), MB; 0 = only the queue-slot budget --prefetch-experts limits")
    h.add_argument("--sweep-budgets-mb", type=opt.numbers(0.0, opt.MB_MAX), help="speculative-byte budgets for --sweep --policy, MB per layer "
                                              "(default: half and all of --prefetch-experts experts' worth)")
    h.add_argument("--source-caps", type=opt.numbers(0.0, 1.0), metavar="SHARE[,SHARE...]",
                   help="per-source caps for --prefetch a+b: the most of B and of --prefetch-experts each source's "
                        "candidates take per layer, one share (0-1) per source in --prefetch's order (default: no caps; "
                        "H5's source-caps arm: equal shares)")
    _rewrite_options(s, src_flag=True)

    s = _command(sub, "placement", "placement arms at equal RAM (LRU, frequency pins, hybrid, probability per byte, "
                                   "stall value per byte): S and hit rate on held-out sessions; export the pin set", cmd_placement)
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="the plan whose layout and training sessions are used")
    s.add_argument("--trace", required=True, help="a relayout trace: the plan's training sessions choose pins, the rest evaluate")
    s.add_argument("--device", required=True, help=f"a shipped profile ({', '.join(shipped_names('devices'))}) or a profile JSON")
    _runtime_options(s, modelled=True)
    a = s.add_argument_group("arms")
    a.add_argument("--arms", help="comma-separated arms (default: lru,frequency,hybrid,probability-per-byte,stall-value)")
    a.add_argument("--pin-share", type=opt.fraction, default=0.5,
                   help="share of --ram-gb the frequency, hybrid and probability arms pin (colibrì's default: half); "
                        "the stall-value arm searches it")
    a.add_argument("--half-life", type=opt.number(0.0, 1e12, lo_open=True), help="hybrid arm: half-life of a selection's weight, training steps "
                                                   "(default: a quarter of the training steps)")
    a.add_argument("--min-sessions", type=opt.positive_count, default=5, help="held-out sessions a comparison needs")
    o = s.add_argument_group("output")
    o.add_argument("--export", default="stall-value", help="the arm whose pins --pin-file and --plan-out write")
    o.add_argument("--pin-file", metavar="PIN.txt", help="write that arm's pins as colibrì's PIN file (layer expert rank lines)")
    o.add_argument("--plan-out", metavar="PLAN.json", help="write a copy of the plan recording that arm's pins (a new plan digest)")
    o.add_argument("-o", "--output", help="write the arms' table as JSON")
    o.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "split-curve", "S versus RAM for whole experts and for split experts (ratio and per-layer top budget "
                                     "chosen by replayed stall), on held-out sessions", cmd_split_curve)
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="a plan without a split: its layout and training sessions")
    s.add_argument("--trace", required=True, help="a relayout trace: the plan's training sessions search, the rest evaluate")
    s.add_argument("--device", required=True, help=f"a shipped profile ({', '.join(shipped_names('devices'))}) or a profile JSON")
    _runtime_options(s, modelled=True, ram=False)
    c = s.add_argument_group("curve")
    c.add_argument("--ram-gb", dest="ram_budgets_gb", type=opt.numbers(0.0, opt.GB_MAX), required=True, help="RAM budgets, GB, comma-separated (the curve's x axis)")
    c.add_argument("--ratios", type=opt.numbers(0.0, 1.0), default="0.125,0.25,0.375,0.5", help="split ratios searched (FFN share of the top; 0 = no split "
                                                                   "is always searched)")
    c.add_argument("--top-shares", type=opt.numbers(0.0, 1.0), default="0.25,0.5,0.75,1", help="shares of each budget for resident tops searched "
                                                                  "(the LRU holds whole experts in the rest)")
    c.add_argument("--min-sessions", type=opt.positive_count, default=5, help="held-out sessions a comparison needs")
    c.add_argument("-o", "--output", help="write both curves as JSON")
    c.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "drives", drives_command.HELP, drives_command.cmd_drives)
    drives_command.add_arguments(s)
    s = _command(sub, "mirror", drives_command.MIRROR_HELP, drives_command.cmd_mirror)
    drives_command.add_mirror_arguments(s)

    s = _command(sub, "gate", "recompute a gate record's interval and verdict from the evidence it stores", cmd_gate)
    s.add_argument("--recheck", required=True, metavar="gate.json", help="the gate record to recheck")

    s = _command(sub, "rewrite", "stream-rewrite a container into the plan's layout (needs a passing gate)", cmd_rewrite)
    s.add_argument("src", help="the source container (opened read-only)")
    s.add_argument("--layout", required=True, metavar="PLAN.json", help="the plan to write")
    s.add_argument("--gate", help="gate.json from relayout replay")
    s.add_argument("--verify", action="store_true", help="verify DST against SRC afterwards")
    _rewrite_options(s, src_flag=False)

    s = _command(sub, "calibrate", "measure the device holding PATH and fit a device profile", cmd_calibrate)
    s.add_argument("path", help="a directory (a temporary test file is written there) or a large file")
    s.add_argument("-o", "--output", required=True, metavar="device.json", help="the profile to write")
    s.add_argument("--size-mb", type=opt.integer(64, 1 << 30), default=1024, help="test file size when PATH is a directory, MiB (>= 64)")
    s.add_argument("--seconds", type=opt.number(0.05, 60.0), default=0.4, help="time per (request size, queue depth) cell (0.05-60)")
    s.add_argument("--name", help="profile name (default: from PATH)")

    s = _command(sub, "validate", "measure S for real on the disk holding PATH and compare it with the replay model's "
                                  "prediction, cell by cell: the model holds, does not hold, or the measurement is "
                                  "inconclusive (insufficient below 4 repetitions per cell)", cmd_validate)
    s.add_argument("path", help="a directory on the disk to validate (calibration file and work directory go there)")
    s.add_argument("--device", metavar="PROFILE.json",
                   help=f"use this profile ({', '.join(shipped_names('devices'))} or a JSON) instead of calibrating PATH")
    s.add_argument("--container", metavar="DIR", help="measure this container (on the disk under test; only read) instead "
                                                      "of a synthetic one; each non-stock layout is a full copy under PATH")
    s.add_argument("--gb", type=opt.positive_gigabytes, default=1.0, help="size of the synthetic container (GLM-5.2 int4-row, 18.9 MB experts), GB")
    s.add_argument("--minutes", type=opt.number(0.0, 1e5, lo_open=True), help="fit the whole run in about this many minutes: a probe measurement "
                                                 "chooses --reps (>= 2) and/or --tokens")
    s.add_argument("--tokens", type=opt.count, help="held-out steps measured and replayed per run (default 40)")
    s.add_argument("--reps", type=opt.count, help="measured repetitions per cell, >= 2 (default 4; an even count "
                                            "counterbalances the run order)")
    s.add_argument("--layouts", default="stock,louvain,random", help="layouts to measure; stock is the baseline")
    s.add_argument("--ram", default="0,0.25", help="RAM budgets for the expert LRU, fractions of the routed bytes")
    s.add_argument("--prefetch", default="none", help=f"prefetch sources ({', '.join(PREFETCH_SOURCES)}); with none among "
                                                      "them each source's saving against none is judged too")
    s.add_argument("--workers", type=opt.count, default=8, help="reader workers, 1-16")
    s.add_argument("--coalesce", action="store_true", help="coalesce adjacent experts' reads (colibrì's COALESCE), "
                                                         "measured and modelled alike: where the order of experts matters")
    s.add_argument("--seed", type=opt.seed, default=0, help="seed of the synthetic container, trace and plans")
    s.add_argument("-o", "--output", default="validation.json", help="the record to write (a calibrated profile is saved "
                                                                     "next to it as NAME.device.json)")
    s.add_argument("--plots", metavar="DIR", help="write a predicted vs measured S scatter (needs the 'plots' extra: matplotlib)")
    s.add_argument("--keep", action="store_true", help="keep the work directory (PATH/relayout-validate: containers, "
                                                      "plans, STALL_TRACEs)")

    s = _command(sub, "measure", "run the colibrì engine cold and keep its output (--engine), or emulate the runtime's "
                                 "read path in Python and write a STALL_TRACE (--trace)", cmd_measure)
    s.add_argument("--container", required=True, help="the container to read")
    s.add_argument("--trace", help="emulation: a relayout trace whose routing is replayed for real")
    from .engine_runs import engine_options

    engine_options(s)
    s.add_argument("--layout", metavar="PLAN.json", help="evaluate only sessions this plan did not train on")
    s.add_argument("--tokens", type=opt.positive_count, help="stop after this many held-out steps (default: all)")
    _runtime_options(s, modelled=False)
    s.add_argument("--warm", action="store_true", help="do not drop the page cache first")
    s.add_argument("--no-trace", action="store_true", help="record nothing (to measure tracing overhead)")
    s.add_argument("--run-id", help="run id written in every record (default: unique, from the container and "
                                    "layout names and the start time)")
    s.add_argument("-o", "--output", help="STALL_TRACE JSONL to write (.zst compresses); with --engine, the directory "
                                          "the runs are kept in")

    s = _command(sub, "report", "stall per committed token (S) and what makes it up (hit rate, reads per token, step stall "
                                     "percentiles, queue depth), from STALL_TRACE files or colibrì runs' output", cmd_report)
    s.add_argument("runs", nargs="+", help="STALL_TRACE files (.jsonl or .jsonl.zst), or colibrì runs: output files, "
                                           "measured run directories, or directories of them (one arm each)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--plots", metavar="DIR", help="write PNG figures (needs the 'plots' extra: matplotlib)")
    s.add_argument("--predicted", metavar="gate.json", help="with --plots: add predicted vs measured S")
    h = s.add_argument_group("hypotheses (the tables of replay --policy, from measured runs)")
    h.add_argument("--hypothesis", choices=("H2", "H3a", "H3b", "H5"),
                   help="judge a hypothesis (H2 admission, H3a placement, H3b whole vs split experts, H5 prefetch budgets) on the runs: each run's configuration (or run id) is an arm; H2 needs "
                        "none and stall-value, H3a stall-value and frequency, H3b whole@GB and split@GB at each RAM "
                        "budget (GB), H5 default and tail-control")
    h.add_argument("--arm", action="append", metavar="ARM=CONFIGURATION",
                   help="name the arm a configuration label stands for (repeatable)")
    h.add_argument("--min-sessions", type=opt.positive_count, default=5, help="units (repetition x request) a verdict needs")

    s = _command(sub, "compare", "paired comparison of STALL_TRACE files or of colibrì runs (first = control)", cmd_compare)
    s.add_argument("runs", nargs="+", help="STALL_TRACE files, or colibrì arms (a directory of one container's runs, "
                                           "or output files); the first is the control")
    s.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "verify", "prove DST equals SRC tensor by tensor and meets the runtime's constraints", cmd_verify)
    s.add_argument("src", help="the source container")
    s.add_argument("dst", help="the rewritten container")
    s.add_argument("--full", action="store_true", help="also compare bytes, not only xxh3-128")
    s.add_argument("--json", action="store_true", help="print JSON")

    s = _command(sub, "manifest", "write or check the xxh3-128 checksum manifest of a container", cmd_manifest)
    s.add_argument("dir", help="the container")
    s.add_argument("-o", "--output", help=f"manifest path (default DIR/{MANIFEST_NAME})")
    s.add_argument("--check", action="store_true", help="re-hash and name every mismatch")

    s = _command(sub, "demo", "run the pipeline end to end on a small synthetic model", cmd_demo)
    s.add_argument("--dir", help="where the demo keeps its files: a new or empty directory, or a previous demo's "
                                        "(default: a new folder relayout-demo[-N] under the current directory)")
    s.add_argument("--seed", type=opt.seed, default=0, help="seed of the model, trace and plan")
    return p


DEBUG_VARIABLE = "RELAYOUT_DEBUG"


def _interrupted(signum, frame):
    """SIGTERM ends a command the way Ctrl-C does (one line, exit 130)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit status: 0 done, 2 a problem with the input (one line on stderr),
    1 an internal error (one line asking for a bug report; the traceback with ``RELAYOUT_DEBUG=1``),
    130 interrupted (Ctrl-C or SIGTERM). Python warnings raised while a command runs are printed
    as one ``relayout: warning:`` line each when it succeeds, and not beside its error line when
    it fails."""
    import signal
    import warnings

    from . import AS_COMMAND, quiet_interrupts

    command = "relayout"
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, _interrupted)
        except ValueError:                  # not the main thread: signals stay as they are
            previous = None
    try:
        if AS_COMMAND and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C from here on: KeyboardInterrupt, cleaned up
        with warnings.catch_warnings(record=True) as caught:
            args = build_parser().parse_args(argv)
            command = f"relayout {args.command}" + (f" {args.what}" if getattr(args, "what", None) else "")
            status = args.func(args)
        for line in dict.fromkeys(str(w.message).splitlines()[0] for w in caught if str(w.message)):
            print(f"relayout: warning: {line[:300]}", file=sys.stderr)
        return status
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
    finally:
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
        if AS_COMMAND and threading.current_thread() is threading.main_thread():
            quiet_interrupts()          # a Ctrl-C while the interpreter exits: one line, no traceback
