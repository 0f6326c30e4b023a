"""The workflow commands: ``validate`` (measured against predicted S, cell by cell) and ``demo``
(the pipeline end to end on a small synthetic model). Each reads its arguments and runs
:mod:`relayout.workflows.validation` or :mod:`relayout.workflows.demo`.
"""

from __future__ import annotations

from pathlib import Path

from containers.errors import InputError

from .output import say


def cmd_validate(args) -> int:
    import time

    from relayout.render.validation import format_validation, validation_bottom_line
    from ..workflows.validation.options import ValidateOptions, parse_list
    from ..workflows.validation.run import validate

    t0 = time.perf_counter()
    if args.engine:
        return _validate_engine(args)
    _refuse(args, ENGINE_ONLY, "belong to validate --engine (give --engine BINARY)")
    given = _given(args, {"gb": None, "minutes": None, "tokens": None, "reps": None, "workers": None,
                          "ram": lambda x: parse_list(x, "--ram", float), "prefetch": lambda x: parse_list(x, "--prefetch")})
    opts = ValidateOptions(
        path=Path(args.path), output=Path(args.output or "validation.json"), device=args.device,
        container=Path(args.container) if args.container else None, layouts=parse_list(args.layouts, "--layouts"),
        coalesce=args.coalesce, plots=Path(args.plots) if args.plots else None, keep=args.keep, seed=args.seed, **given)
    record = validate(opts, notify=say)
    print(format_validation(record))
    print(f"\nwrote {opts.output}" + "".join(f", {p}" for p in record["plots"])
          + (f"; work directory kept: {record['work_dir']}" if record["work_dir"] else ""))
    print(f"total time {time.perf_counter() - t0:.1f} s")
    print("\n" + validation_bottom_line(record, str(opts.output)))
    return 0


ENGINE_ONLY = ("prompts", "train_prompts", "read_paths", "caps", "ngen", "engine_env", "timeout")
"""``validate``'s options for the real engine (``None`` when not given)."""
EMULATION_ONLY = ("gb", "minutes", "tokens", "ram", "prefetch", "workers", "coalesce", "plots", "keep")
"""``validate``'s options for its emulation (``None`` or False when not given)."""


def _refuse(args, names: tuple[str, ...], why: str) -> None:
    """One error naming the options of ``names`` that were given (not None or False)."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]
    if given:
        raise InputError(None, f"{', '.join(given)} {why}")


def _given(args, parsers: dict) -> dict:
    """The options of ``parsers`` that were given, each through its parser (None: as given); the
    options records supply the defaults of the others."""
    return {n: (f(getattr(args, n)) if f else getattr(args, n)) for n, f in parsers.items() if getattr(args, n) is not None}


def _validate_engine(args) -> int:
    """``validate --engine``: :func:`relayout.workflows.validation.engine.validate_engine`, then its table."""
    from relayout.render.engine import engine_validation_bottom_line, format_engine_validation
    from ..workflows.validation.engine import EngineValidateOptions, validate_engine
    from ..workflows.validation.options import parse_list

    _refuse(args, EMULATION_ONLY, "belong to validate's emulation, not to validate --engine")
    for name in ("container", "prompts", "train_prompts"):
        if not getattr(args, name):
            raise InputError(None, f"validate --engine needs --{name.replace('_', '-')}")
    given = _given(args, {"reps": None, "ngen": None, "engine_env": None,
                          "read_paths": lambda x: tuple(w.strip() for w in x.split(";") if w.strip()),
                          "caps": lambda x: parse_list(x, "--caps", int)})
    opts = EngineValidateOptions(
        path=Path(args.path), engine=Path(args.engine), container=Path(args.container), prompts=Path(args.prompts),
        train_prompts=Path(args.train_prompts), layouts=tuple(parse_list(args.layouts, "--layouts")), device=args.device,
        output=Path(args.output) if args.output else None, seed=args.seed, timeout_s=args.timeout, **given)
    record = validate_engine(opts, notify=say)
    where = opts.output or Path(args.path) / "validation-engine.json"
    print(format_engine_validation(record))
    print(f"\nwrote {where}")
    print("\n" + engine_validation_bottom_line(record, str(where)))
    return 0 if record.verdict != "does not hold" else 1


def cmd_demo(args) -> int:
    from ..workflows.demo import run_demo

    return run_demo(args.dir, seed=args.seed)
