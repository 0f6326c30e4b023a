"""The commands that run or read the real colibrì engine: ``measure --engine``, and ``report`` and
``compare`` of its kept runs. The work is in :mod:`relayout.workflows.engine_runs` and
:mod:`replay.colibri.engine_metrics`; the text in :mod:`relayout.render.engine`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from containers.errors import InputError
from replay.colibri.engine_config import env_words
from replay.colibri.engine_metrics import engine_compare, engine_report

from ..render.engine import format_engine_compare, format_engine_report
from ..workflows.engine_runs import EngineArm, measure_engine, read_prompts


def cmd_measure_engine(args) -> int:
    """Run the engine per :func:`measure_engine`, then print the runs' report (and the comparison
    when there is a baseline)."""
    if not args.prompts:
        raise InputError(None, "measure --engine needs --prompts FILE")
    if not args.output:
        raise InputError(None, "measure --engine needs -o DIR (where the runs are kept)")
    if args.baseline_env and not args.baseline:
        raise InputError(None, "--baseline-env needs --baseline")
    arms = ([EngineArm("baseline", Path(args.baseline), env_words(args.baseline_env, "--baseline-env", strict=False))]
            if args.baseline else []) + [
        EngineArm("container", Path(args.container), env_words(args.container_env, "--container-env", strict=False))]
    measure_engine(args.engine, arms, read_prompts(args.prompts), args.reps, env_words(args.runtime_env, strict=False),
                   args.ngen, args.output, timeout_s=args.timeout)
    dirs = [Path(args.output) / a.name for a in arms]
    print(format_engine_report(engine_report(dirs)))
    if args.baseline:
        c = engine_compare(dirs)
        print(format_engine_compare(c))
        if c["correctness_failures"]:
            print(f"relayout: error: {len(c['correctness_failures'])} run(s) emitted different tokens (a correctness "
                  "failure, not noise)", file=sys.stderr)
            return 2
    return 0


def cmd_engine_report(args) -> int:
    """Print the runs' report (``report --engine``), or its JSON."""
    if getattr(args, "hypothesis", None) or getattr(args, "plots", None):
        raise InputError(None, "--hypothesis and --plots read STALL_TRACE files, not colibrì runs")
    r = engine_report(args.runs)
    print(json.dumps(r, indent=1) if args.json else format_engine_report(r))
    return 0


def cmd_engine_compare(args) -> int:
    """Print the arms' comparison (``compare --engine``), or its JSON; exit 2 on a correctness failure."""
    c = engine_compare(args.runs)
    print(json.dumps(c, indent=1) if args.json else format_engine_compare(c))
    if c["correctness_failures"]:
        print(f"relayout: error: {len(c['correctness_failures'])} run(s) emitted different tokens (a correctness failure, "
              "not noise)", file=sys.stderr)
        return 2
    return 0
