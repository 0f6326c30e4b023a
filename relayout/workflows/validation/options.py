"""What ``relayout validate`` is asked to do: its options, their checks, and the size of the run.

:class:`ValidateOptions` holds the command's options (sizes in 10^9 bytes, the time budget in
minutes, RAM budgets as fractions of the routed bytes); :func:`check_options` refuses a bad one
in one line before anything is measured or written; :func:`choose_size` picks the repetitions and
held-out steps a ``--minutes`` budget affords; the constants fix the synthesised trace and the
run's defaults and bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from containers.errors import InputError
from replay.model.config import PREFETCH_SOURCES

from .plot import plotting
from .rules import VERDICT_REPS

LAYOUTS = ("stock", "louvain", "random")
"""Layouts a validation can measure; ``stock`` (the source itself) is the baseline of every saving."""
TRACE_SESSIONS = 17
TRAIN_FRACTION = 0.7
"""12 of 17 sessions train the plans, 5 are held out."""
HELD_OUT_SESSIONS = TRACE_SESSIONS - round(TRACE_SESSIONS * TRAIN_FRACTION)
SESSION_TOKENS = 60
DEFAULT_TOKENS = 40
DEFAULT_REPS = 4
"""Repetitions per cell unless ``--reps`` says otherwise: even, as :func:`.run.measurement_order`
counterbalances the run order over pairs of repetitions (``MIN_REPS`` and ``MAX_REPS`` are even too)."""
MIN_TOKENS = 4
MIN_REPS = 2
MAX_REPS = 10
PROBE_TOKENS = 10
PROBE_MARGIN = 1.3
"""A run is planned as this many times slower per step than the probe (the disk varies)."""


@dataclass(frozen=True)
class ValidateOptions:
    """What ``relayout validate`` was asked to do (``docs/VALIDATION.md``). ``gb``: 10^9 bytes;
    ``minutes``: wall-clock budget of the whole run; ``ram``: fractions of the routed bytes."""

    path: Path
    output: Path
    device: str | None = None
    container: Path | None = None
    gb: float = 1.0
    minutes: float | None = None
    tokens: int | None = None
    reps: int | None = None
    layouts: tuple[str, ...] = LAYOUTS
    ram: tuple[float, ...] = (0.0, 0.25)
    prefetch: tuple[str, ...] = ("none",)
    workers: int = 8
    coalesce: bool = False
    plots: Path | None = None
    keep: bool = False
    seed: int = 0


def parse_list(text: str, what: str, kind=str) -> tuple:
    """``"a,b"`` -> ``("a", "b")`` (or numbers with ``kind=float``); one-line error naming ``what``."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise InputError(None, f"{what} needs at least one value")
    try:
        out = tuple(kind(x) for x in items)
    except ValueError:
        raise InputError(None, f"{what} expects comma-separated numbers, got {text!r}") from None
    if len(set(out)) != len(out):
        raise InputError(None, f"{what} lists a value twice: {text!r}")
    return out


def check_options(o: ValidateOptions) -> None:
    """Every option checked before anything is measured or written; one :class:`InputError` each."""
    if not o.path.is_dir():
        raise InputError(o.path, "is not a directory (give a directory on the disk to validate)")
    bad = [x for x in o.layouts if x not in LAYOUTS]
    if bad:
        raise InputError(None, f"--layouts: unknown layout {bad[0]!r} (choose from {', '.join(LAYOUTS)})")
    if "stock" not in o.layouts:
        raise InputError(None, "--layouts must include stock (the baseline every saving is measured against)")
    bad = [x for x in o.prefetch if x not in PREFETCH_SOURCES]
    if bad:
        raise InputError(None, f"--prefetch: unknown source {bad[0]!r} (choose from {', '.join(PREFETCH_SOURCES)})")
    bad = [x for x in o.ram if not (math.isfinite(x) and 0 <= x <= 1)]
    if bad:
        raise InputError(None, f"--ram: budgets are fractions of the routed bytes, 0 to 1 (got {bad[0]:g})")
    if o.reps is not None and not MIN_REPS <= o.reps <= 1000:
        raise InputError(None, f"--reps must be {MIN_REPS} to 1000 (a measured interval needs repeated runs), got {o.reps}")
    if o.tokens is not None and o.tokens < MIN_TOKENS:
        raise InputError(None, f"--tokens must be at least {MIN_TOKENS}, got {o.tokens}")
    if o.minutes is not None:
        if not (math.isfinite(o.minutes) and o.minutes > 0):
            raise InputError(None, f"--minutes must be a positive number, got {o.minutes:g}")
        if o.tokens is not None and o.reps is not None:
            raise InputError(None, "--minutes chooses --reps and/or --tokens; with both given it has nothing to choose")
    if o.container is None and not (math.isfinite(o.gb) and 0 < o.gb <= 100_000):
        raise InputError(None, f"--gb must be a positive size in GB, got {o.gb:g}")
    if not 1 <= o.workers <= 16:
        raise InputError(None, f"--workers must be 1-16, got {o.workers}")
    parent = o.output.parent
    if not parent.is_dir():
        raise InputError(o.output, f"cannot be written: {parent} is not a directory")
    if o.plots is not None:
        plotting()


def choose_size(o: ValidateOptions, available: int, n_runs_per_rep: int, probe_seconds: float, probe_steps: int,
                 budget_s: float) -> tuple[int, int, str]:
    """``(tokens, reps, what was chosen and why)`` for a measurement budget of ``budget_s`` seconds."""
    per_step = PROBE_MARGIN * probe_seconds / max(probe_steps, 1)   # s per measured step, the slowest cell
    steps_fit = int(budget_s / max(per_step, 1e-9))           # measured steps that fit, over all runs
    if o.reps is not None:
        reps = o.reps
        tokens = min(available, steps_fit // (reps * n_runs_per_rep))
    elif o.tokens is not None:
        tokens = min(o.tokens, available)
        reps = min(MAX_REPS, steps_fit // (tokens * n_runs_per_rep) // 2 * 2)
    else:
        # DEFAULT_REPS (what a verdict needs, VERDICT_REPS) unless a run would get fewer than
        # MIN_TOKENS steps: the repetitions are the interval's units, and 2 of them give it one
        # degree of freedom, too few for a verdict
        reps = DEFAULT_REPS
        tokens = min(available, steps_fit // (reps * n_runs_per_rep))
        if tokens < min(MIN_TOKENS, available):
            reps = MIN_REPS
            tokens = min(available, steps_fit // (reps * n_runs_per_rep))
        if tokens >= available:                # an even count: the order is counterbalanced in pairs
            reps = min(MAX_REPS, max(MIN_REPS, steps_fit // (tokens * n_runs_per_rep) // 2 * 2))
    over = ""
    if tokens < MIN_TOKENS or reps < MIN_REPS:
        tokens, reps = max(tokens, MIN_TOKENS), max(reps, MIN_REPS)
        over = " (the smallest run allowed; it will take longer than --minutes)"
    est = per_step * tokens * reps * n_runs_per_rep
    why = (f"--minutes {o.minutes:g}: a probe measured {probe_steps} steps in {probe_seconds:.2f} s "
           f"(planned at {per_step * 1e3:.0f} ms/step, x{PROBE_MARGIN:g} for safety); chose {reps} repetitions x {tokens} steps x {n_runs_per_rep} runs, "
           f"about {est / 60:.1f} min of measurement{over}"
           + (f"; fewer repetitions than the {VERDICT_REPS} a verdict needs: its answer will be 'insufficient' unless a "
              "measurement rules the model out" if reps < VERDICT_REPS else ""))
    return tokens, reps, why
