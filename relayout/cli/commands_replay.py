"""The replay commands: ``replay`` (the gate, its sweep, the hypothesis tables, and the rewrite a
passing gate allows), ``placement``, ``split-curve`` and ``gate --recheck``. Each reads its
arguments, asks :mod:`relayout.planning.replay_setup` what the run is, calls the library and prints the
answer; the judging is in :mod:`replay.evaluation` and :mod:`replay.control`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

from containers.errors import InputError

from relayout.render.gate import format_gate, format_sweep
from relayout.render.studies import format_hypotheses, format_placement, format_reliability, format_split_curve
from relayout.render.units import human_bytes
from relayout.planning.replay_setup import (
    check_ram,
    hypothesis_regimes,
    hypothesis_selection,
    hypothesis_source,
    routed_bytes,
    runtime_pins,
    sweep_ram_gb,
)
from .arguments import engine_device, handoff_note, runtime_config
from .output import print_rewrite_files, say, verify_and_report

EXIT_FAIL = 3
"""``replay --strict`` (and ``replay --container --out``, which then rewrote nothing): the gate failed."""
EXIT_INSUFFICIENT = 4
"""``replay --strict`` (and ``replay --container --out``, which then rewrote nothing): too little evidence."""


def _verdict_status(verdict: str) -> int:
    return {"pass": 0, "fail": EXIT_FAIL, "insufficient": EXIT_INSUFFICIENT}[verdict]


def cmd_replay(args) -> int:
    from replay.formats.planfile import load_plan
    from replay.formats.trace import TraceFile, load_trace
    from replay.model.device import load_device
    from replay.model.storage import storage_profile

    if args.min_sessions < 1:
        raise InputError(None, f"--min-sessions must be at least 1, got {args.min_sessions}")
    plan = load_plan(args.layout)
    hypotheses = args.policy is not None or args.hypotheses is not None
    # the gate and the sweep read the rows block by block from the file (memory flat in trace length);
    # the hypothesis tables hold the trace in memory
    trace = load_trace(args.trace) if hypotheses else TraceFile(args.trace)
    device = storage_profile(args.storage) if args.storage else load_device(args.device)
    config = runtime_config(args, None if args.sweep or hypotheses else plan.layout)
    check_ram(config.ram_bytes, routed_bytes(plan))
    baseline = None if args.baseline == "stock" else load_plan(args.baseline)
    device = engine_device(args, device, baseline.layout if baseline is not None else plan.stock)
    handoff_note(config, device)
    if hypotheses:
        return _replay_hypotheses(args, plan, trace, device, config)
    if args.sweep:
        return _replay_sweep(args, plan, trace, device, config, baseline)
    if bool(args.container) != bool(args.out):
        raise InputError(None, "--container and --out go together (rewrite after a passing gate)")
    return _replay_gate(args, plan, trace, device, config, baseline)


def _replay_sweep(args, plan, trace, device, config, baseline) -> int:
    """``replay --sweep``: the gate's regime map over RAM budgets x workers."""
    from containers.atomic import write_json_atomic
    from replay.evaluation.gate import sweep
    from replay.formats.sweepfile import SWEEP_FORMAT, SweepTable
    from replay.execution import open_executor

    with open_executor(args.scheduler) as executor:
        cells = sweep(plan, trace, device, config, sweep_ram_gb(routed_bytes(plan), args.sweep_ram, args.ram_gb),
                      list(args.sweep_workers), args.threshold, baseline, min_sessions=args.min_sessions,
                      executor=executor)
    if args.output:
        write_json_atomic(args.output, SweepTable(SWEEP_FORMAT, plan.digest, device.name, cells).to_json())
    print(json.dumps([c.to_json() for c in cells], indent=1) if args.json else format_sweep(cells))
    return 0


def _replay_gate(args, plan, trace, device, config, baseline) -> int:
    """``replay``: the gate, and with ``--container --out`` the rewrite a pass allows."""
    from containers.atomic import write_json_atomic
    from replay.evaluation.evidence import split_sessions_by_content
    from replay.evaluation.gate import compare
    from replay.physical.stalltrace import measured_tpot_parts

    from relayout.render.gate import bottom_line, held_out_notice

    checked = None
    if args.container:
        from relayout.workflows.apply import preflight

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
    from relayout.workflows.apply import apply_plan

    m = apply_plan(args.container, plan, args.out, gate, args.force, args.manifest, notify=say, checked=checked)
    print(f"wrote {args.out}: {len(m['files'])} files, {len(m['tensors'])} tensors"
          + (" (gate overridden with --force; recorded in the manifest)" if m["rewrite"]["forced"] else ""))
    print_rewrite_files(args.out, m)
    return verify_and_report(args.container, args.out, False, False)


def _replay_hypotheses(args, plan, trace, device, config) -> int:
    """``replay --policy``: the hypothesis tables (H2 at one regime; with ``--sweep``, every
    hypothesis over RAM x speculative-byte budgets)."""
    from dataclasses import asdict

    from containers.atomic import write_json_atomic
    from replay.control.experiments import hypothesis_tables, predictor_scores
    from replay.execution import open_executor
    from replay.model.config import RUNTIME_CHANGES, SOURCE_SEPARATOR

    policies, keys = hypothesis_selection(args.policy, args.hypotheses, args.sweep)
    source = hypothesis_source(config.prefetch)
    ram, budgets = hypothesis_regimes(plan, config,
                                      sweep_ram_gb(routed_bytes(plan), args.sweep_ram, args.ram_gb) if args.sweep else None,
                                      args.sweep_budgets_mb)
    with open_executor(args.scheduler if args.sweep else "none") as executor:
        tables = hypothesis_tables(plan, trace, device, replace(config, prefetch=source), ram, budgets, keys, policies,
                                   source=source, min_sessions=args.min_sessions, executor=executor)
    scores = predictor_scores(plan, trace, source) if SOURCE_SEPARATOR in source else []
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
    from replay.control.placement import ARMS, placement_arms
    from replay.formats.pinfile import pin_gb_for, write_pin_file
    from replay.formats.planfile import load_plan, save_plan, with_pins
    from replay.formats.trace import load_trace
    from replay.model.device import load_device

    arms = tuple(a for a in args.arms.split(",") if a) if args.arms else ARMS
    if args.pin_gb:
        raise InputError(None, "placement chooses the pins itself within --ram-gb; --pin-gb does not apply")
    if (args.pin_file or args.plan_out) and args.export not in arms:
        raise InputError(None, f"--export {args.export} is not among the arms run ({', '.join(arms)})")
    plan = load_plan(args.layout)
    trace = load_trace(args.trace)
    device = load_device(args.device)
    study = placement_arms(plan, trace, device, runtime_config(args), int(args.ram_gb * 1e9), arms, args.pin_share,
                           args.half_life, min_sessions=args.min_sessions)
    if args.output:
        write_json_atomic(args.output, study.to_json())
    print(json.dumps(study.to_json(), indent=1) if args.json else format_placement(study))
    record = study.pin_record(args.export) if (args.pin_file or args.plan_out) else None
    if args.pin_file:
        kept, size = runtime_pins(plan, record.experts)
        write_pin_file(args.pin_file, kept)
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
    from replay.control.splitcurve import split_curve
    from replay.formats.planfile import load_plan
    from replay.formats.trace import load_trace
    from replay.model.device import load_device

    if args.pin_gb:
        raise InputError(None, "the split curve compares LRU and resident tops within --ram-gb; --pin-gb does not apply")
    plan = load_plan(args.layout)
    trace = load_trace(args.trace)
    curve = split_curve(plan, trace, load_device(args.device), runtime_config(args), [int(x * 1e9) for x in args.ram_budgets_gb],
                        args.ratios, args.top_shares, min_sessions=args.min_sessions)
    if args.output:
        write_json_atomic(args.output, curve.to_json())
    print(json.dumps(curve.to_json(), indent=1) if args.json else format_split_curve(curve))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def cmd_gate(args) -> int:
    from replay.evaluation.evidence import recheck
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
