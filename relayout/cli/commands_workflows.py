"""The workflow commands: ``validate`` (measured against predicted S, cell by cell) and ``demo``
(the pipeline end to end on a small synthetic model). Each reads its arguments and runs
:mod:`relayout.workflows.validation` or :mod:`relayout.workflows.demo`.
"""

from __future__ import annotations

from pathlib import Path

from containers.errors import InputError
from relayout.workflows.validation.engine import DEFAULT_CAPS, DEFAULT_READ_PATHS

from .output import say


def cmd_validate(args) -> int:
    import time

    from relayout.render.validation import format_validation
    from ..workflows.validation.options import ValidateOptions, parse_list
    from ..workflows.validation.run import validate

    t0 = time.perf_counter()
    if args.engine:
        return _validate_engine(args)
    given = [f"--{n.replace('_', '-')}" for n in ENGINE_ONLY if getattr(args, n) not in (None, "")
             and getattr(args, n) != ENGINE_DEFAULTS.get(n)]
    if given:
        raise InputError(None, f"{', '.join(given)} belong to validate --engine (give --engine BINARY)")
    opts = ValidateOptions(
        path=Path(args.path), output=Path(args.output or "validation.json"), device=args.device,
        container=Path(args.container) if args.container else None, gb=args.gb, minutes=args.minutes,
        tokens=args.tokens, reps=args.reps, layouts=parse_list(args.layouts, "--layouts"),
        ram=parse_list(args.ram, "--ram", float), prefetch=parse_list(args.prefetch, "--prefetch"),
        workers=args.workers, coalesce=args.coalesce, plots=Path(args.plots) if args.plots else None, keep=args.keep,
        seed=args.seed,
    )
    record = validate(opts, notify=say)
    print(format_validation(record))
    print(f"\nwrote {opts.output}" + "".join(f", {p}" for p in record["plots"])
          + (f"; work directory kept: {record['work_dir']}" if record["work_dir"] else ""))
    print(f"total time {time.perf_counter() - t0:.1f} s")
    return 0


ENGINE_ONLY = ("prompts", "train_prompts", "read_paths", "caps", "ngen", "engine_env", "timeout")
ENGINE_DEFAULTS = {"read_paths": ";".join(DEFAULT_READ_PATHS), "caps": ",".join(map(str, DEFAULT_CAPS)), "ngen": 24}
EMULATION_ONLY = {"gb": 1.0, "minutes": None, "tokens": None, "ram": "0,0.25", "prefetch": "none", "workers": 8,
                  "coalesce": False, "plots": None, "keep": False}


def _validate_engine(args) -> int:
    """``validate --engine``: :func:`relayout.workflows.validation.engine.validate_engine`, then its table."""
    from relayout.render.engine import format_engine_validation
    from ..workflows.validation.engine import EngineValidateOptions, validate_engine
    from ..workflows.validation.options import parse_list

    given = [f"--{n}" for n, default in EMULATION_ONLY.items() if getattr(args, n) != default]
    if given:
        raise InputError(None, f"{', '.join(given)} belong to validate's emulation, not to validate --engine")
    for name in ("container", "prompts", "train_prompts"):
        if not getattr(args, name):
            raise InputError(None, f"validate --engine needs --{name.replace('_', '-')}")
    opts = EngineValidateOptions(
        path=Path(args.path), engine=Path(args.engine), container=Path(args.container), prompts=Path(args.prompts),
        train_prompts=Path(args.train_prompts), layouts=tuple(parse_list(args.layouts, "--layouts")),
        read_paths=tuple(w.strip() for w in args.read_paths.split(";") if w.strip()),
        caps=tuple(parse_list(args.caps, "--caps", int)), reps=args.reps or 3, ngen=args.ngen,
        engine_env=args.engine_env, device=args.device, output=Path(args.output) if args.output else None,
        seed=args.seed, timeout_s=args.timeout)
    record = validate_engine(opts, notify=say)
    print(format_engine_validation(record))
    print(f"\nwrote {opts.output or Path(args.path) / 'validation-engine.json'}")
    return 0 if record.verdict != "does not hold" else 1


def cmd_demo(args) -> int:
    from ..workflows.demo import run_demo

    return run_demo(args.dir, seed=args.seed)
