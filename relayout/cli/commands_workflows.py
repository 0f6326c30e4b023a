"""The workflow commands: ``validate`` (measured against predicted S, cell by cell) and ``demo``
(the pipeline end to end on a small synthetic model). Each reads its arguments and runs
:mod:`relayout.workflows.validation` or :mod:`relayout.workflows.demo`.
"""

from __future__ import annotations

from pathlib import Path

from .output import say


def cmd_validate(args) -> int:
    import time

    from relayout.render.validation import format_validation
    from ..workflows.validation.options import ValidateOptions, parse_list
    from ..workflows.validation.run import validate

    t0 = time.perf_counter()
    opts = ValidateOptions(
        path=Path(args.path), output=Path(args.output), device=args.device,
        container=Path(args.container) if args.container else None, gb=args.gb, minutes=args.minutes,
        tokens=args.tokens, reps=args.reps, layouts=parse_list(args.layouts, "--layouts"),
        ram=parse_list(args.ram, "--ram", float), prefetch=parse_list(args.prefetch, "--prefetch"),
        workers=args.workers, coalesce=args.coalesce, plots=Path(args.plots) if args.plots else None, keep=args.keep,
        seed=args.seed,
    )
    record = validate(opts, notify=say)
    print(format_validation(record))
    print(f"\nwrote {args.output}" + "".join(f", {p}" for p in record["plots"])
          + (f"; work directory kept: {record['work_dir']}" if record["work_dir"] else ""))
    print(f"total time {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_demo(args) -> int:
    from ..workflows.demo import run_demo

    return run_demo(args.dir, seed=args.seed)
