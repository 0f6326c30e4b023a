"""The measurement commands: ``calibrate``, ``measure`` (the Python emulation here; the engine's
runs in :mod:`relayout.workflows.engine_runs`), ``report`` and ``compare`` (STALL_TRACE files here; colibrì
runs' output in :mod:`relayout.render.engine`). Each reads its arguments, calls
:mod:`replay.physical` and prints the answer.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from containers.errors import InputError

from relayout.render.measurements import format_calibration, format_compare, format_measure, format_report

from relayout.render.studies import format_hypotheses
from .arguments import runtime_config


def cmd_calibrate(args) -> int:
    from containers.atomic import write_json_atomic
    from replay.physical.calibrate import calibrate

    profile = calibrate(args.path, args.size_mb, args.seconds, args.name, buffers=args.buffers)
    write_json_atomic(args.output, profile)
    print(format_calibration(profile))
    print(f"wrote {args.output} (use it as --device {args.output})")
    return 0


def cmd_measure(args) -> int:
    if args.engine:
        from .commands_engine import cmd_measure_engine

        return cmd_measure_engine(args)
    if not args.trace:
        raise InputError(None, "measure needs --trace (the Python emulation) or --engine (the real engine)")
    from containers.container import Container
    from replay.evaluation.gate import evaluation_forwards, training_coupling
    from replay.formats.planfile import load_plan
    from replay.formats.trace import load_trace
    from replay.physical.measure import default_run_id, measure

    from relayout.planning.replay_setup import container_split

    trace = load_trace(args.trace)
    plan = load_plan(args.layout) if args.layout else None
    mask, _ = evaluation_forwards(trace, [plan] if plan else [])
    if args.tokens:
        mask &= np.cumsum(mask) <= args.tokens
    config = runtime_config(args)
    coupling = None
    if config.prefetch == "coupled":
        if plan is None:
            raise InputError(args.trace, "--prefetch coupled needs --layout PLAN.json (its training sessions teach the pair table)")
        coupling = training_coupling(trace, plan)
    container = Container.open(args.container)
    split = container_split(container, plan, args.container)
    run_id = args.run_id or default_run_id(args.container, args.layout)
    result = measure(container, trace, mask, config, args.output, run_id=run_id, cold=not args.warm,
                     record=not args.no_trace, coupling=coupling, split=split)
    print("emulation: relayout's Python harness performing the modelled read path (not the colibrì engine; "
          "measure --engine runs the engine)")
    print(format_measure(result))
    if result.path:
        print(f"wrote {result.path}")
    return 0


def _arm_names(specs) -> dict[str, str]:
    """``--arm ARM=CONFIGURATION`` options as {configuration label: arm}."""
    names = {}
    for spec in specs or []:
        arm, sep, label = spec.partition("=")
        if not sep or not arm or not label:
            raise InputError(None, f"--arm takes ARM=CONFIGURATION, got {spec!r}")
        names[label] = arm
    return names


def cmd_report(args) -> int:
    from replay.colibri.engine_output import looks_like_engine_output

    if any(looks_like_engine_output(p) for p in args.runs):
        from .commands_engine import cmd_engine_report

        return cmd_engine_report(args)
    from replay.physical.stallplots import write_plots
    from replay.physical.stalltrace import report

    r = report(args.runs)
    if args.hypothesis:
        from replay.evaluation.hypotheses import measured_table

        table = measured_table(args.hypothesis, r.runs, _arm_names(args.arm), args.min_sessions)
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
        from .commands_engine import cmd_engine_compare

        return cmd_engine_compare(args)
    from replay.physical.stalltrace import compare

    c = compare(args.runs)
    print(json.dumps(c, indent=1) if args.json else format_compare(c))
    if c["correctness_failures"]:
        print(f"relayout: error: {len(c['correctness_failures'])} run(s) emitted different tokens (a correctness failure, not noise)", file=sys.stderr)
        return 2
    return 0
