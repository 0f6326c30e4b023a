"""``relayout measure --engine``: run the real colibrì engine, cold, and keep what it printed.

Each run is one engine process in text mode (``PROMPT=<one line of the prompts file>``): the
container's safetensors files are evicted from the page cache just before it starts
(:func:`replay.physical.measure.drop_cache`; a split layout's and its mirrors' too, from the
directories ``COLI_MODEL_DIRS`` and ``COLI_MODEL_MIRROR`` name), the engine runs with the runtime
configuration given in its own terms (``--runtime-env "PIPE=1 DIRECT=1 CAP=4"``, and an arm's own
variables over them, ``--baseline-env`` / ``--container-env``) plus ``PROF=1`` (its profile lines),
``TOKENS=1`` (its output token ids), ``TEMP=0`` (greedy, so two containers' outputs must agree
token for token; a ``TEMP`` in ``--runtime-env`` wins), ``NGEN`` and ``ROUTE_TRACE`` (its routing,
for the replay model). Repetitions interleave the arms: per repetition and prompt the baseline and
the measured container run back to back, the order alternating between repetitions, so a drift
of the shared disk or machine load falls on both.

A run is written into ``OUT/<arm>/.pPP-rRR.partial/`` (stdout, stderr, the routing trace), its
record (:class:`replay.colibri.engine_output.RunIdentity`) last, then the directory is renamed to
``OUT/<arm>/pPP-rRR``: a directory under its final name is a complete run. Run again, the
command keeps complete runs and redoes the rest. The engine itself writes its expert-usage
history (``.coli_usage``) and a ``.coli_kv`` file into the container directory it runs; that is
the engine's doing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from containers.atomic import create_exclusive, fsync_dir, make_dirs, open_dir
from containers.errors import InputError
from replay.colibri.engine_output import ROUTE_FILE, RUN_FILE, STDERR_FILE, STDOUT_FILE, RunIdentity, write_run_identity
from relayout.workflows.memory_room import memory_room

FIXED_ENV = {"PROF": "1", "TOKENS": "1", "TEMP": "0"}
_OURS = (STDOUT_FILE, STDERR_FILE, ROUTE_FILE, RUN_FILE)


@dataclass(frozen=True)
class EngineArm:
    """A container measured: ``name`` is the arm's directory under the output (``baseline`` or
    ``container``); ``env``: the engine's variables for this arm only, over the runs' common ones
    (a split layout's ``COLI_MODEL_DIRS``, say)."""

    name: str
    container: Path
    env: dict = field(default_factory=dict)


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, one prompt each."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(path, "not UTF-8 text") from None
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(path, "no prompts (one per non-empty line)")
    return prompts


def container_files(container: Path) -> list[Path]:
    files = sorted(p for p in container.glob("*.safetensors") if p.is_file())
    if not files:
        raise InputError(container, "no .safetensors files: not a colibrì container directory")
    return files


def model_files(container: Path, env: dict) -> list[Path]:
    """The shards the engine may read: the container's, and those of the split and mirror
    directories ``env`` names (``COLI_MODEL_DIRS``, ``COLI_MODEL_MIRROR`` or ``SNAP_MIRROR``: lists
    separated by ``;`` or ``,``, entries trimmed, as the engine reads them)."""
    files = container_files(container)
    for var in ("COLI_MODEL_DIRS", "COLI_MODEL_MIRROR", "SNAP_MIRROR"):
        for entry in env.get(var, "").replace(",", ";").split(";"):
            d = Path(entry.strip())
            if entry.strip() and d.is_dir():
                files += sorted(p for p in d.glob("*.safetensors") if p.is_file())
    return files


def run_name(prompt: int, repetition: int) -> str:
    return f"p{prompt:02d}-r{repetition:02d}"


def schedule(arms: list[EngineArm], n_prompts: int, reps: int) -> list[tuple[EngineArm, int, int]]:
    """(arm, prompt, repetition) in the order run: repetition, then prompt, then the arms, their
    order reversed on odd repetitions."""
    out = []
    for rep in range(reps):
        order = arms if rep % 2 == 0 else arms[::-1]
        for prompt in range(n_prompts):
            out += [(arm, prompt, rep) for arm in order]
    return out


def _clear_partial(partial: Path) -> None:
    """Remove a partial run directory this command made: only the files it writes there, then the directory."""
    for name in _OURS:
        with contextlib.suppress(FileNotFoundError):
            (partial / name).unlink()
    try:
        partial.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        raise InputError(partial, "holds files relayout did not write there; move them away and run again") from None


def run_engine_once(engine: Path, arm: EngineArm, prompt_index: int, prompt: str, repetition: int, *,
                    runtime_env: dict, ngen: int, out_dir: Path, timeout_s: float | None,
                    also_cold: tuple[Path, ...] = ()) -> tuple[Path, RunIdentity]:
    """One cold run into ``out_dir/<arm>/pPP-rRR``; returns the directory and its record. Cold:
    the arm's shards (:func:`model_files`), and the files ``also_cold`` (the other arms'), are
    evicted from the page cache first: under a memory limit the pages of the arm run before would
    otherwise keep part of the page cache from this run."""
    arm_dir = make_dirs(out_dir / arm.name)
    final = arm_dir / run_name(prompt_index, repetition)
    partial = arm_dir / f".{final.name}.partial"
    if os.path.lexists(partial):
        if partial.is_symlink() or not partial.is_dir():
            raise InputError(partial, "is not a run directory relayout made (a link or a file); move it away and run again")
        _clear_partial(partial)
    partial.mkdir()
    dir_fd = open_dir(partial, partial)
    try:
        out_fd, err_fd = create_exclusive(dir_fd, STDOUT_FILE), create_exclusive(dir_fd, STDERR_FILE)
    finally:
        os.close(dir_fd)
    set_env = {**FIXED_ENV, **runtime_env, **arm.env, "SNAP": str(arm.container), "PROMPT": prompt, "NGEN": str(ngen),
               "ROUTE_TRACE": str(partial / ROUTE_FILE)}
    env = {**os.environ, **set_env}
    argv = [str(engine)]
    from replay.physical.measure import drop_cache        # the harness's module compiles the model: loaded only to run

    cold = drop_cache(model_files(arm.container, set_env) + list(also_cold))
    room = memory_room()
    load = os.getloadavg()[0]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    t0 = time.monotonic()
    blocks, timed_out = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock, False
    with os.fdopen(out_fd, "wb") as out, os.fdopen(err_fd, "wb") as err:
        try:
            proc = subprocess.run(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                  cwd=str(partial), timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code, timed_out = -9, True
        except OSError as exc:
            raise InputError(engine, f"cannot run the engine ({exc.strerror or exc})") from None
        for f in (out, err):
            f.flush()
            os.fsync(f.fileno())
    wall = time.monotonic() - t0
    drive = None if timed_out else (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - blocks) * 512
    from replay.colibri.openmp_team import INHERITED_TEAM_VARIABLES

    inherited = {k: os.environ[k] for k in INHERITED_TEAM_VARIABLES if k in os.environ and k not in set_env}
    recorded_env = {**inherited, **{k: v for k, v in set_env.items() if k != "ROUTE_TRACE"}}
    recorded_env["ROUTE_TRACE"] = ROUTE_FILE
    identity = RunIdentity(arm=arm.name, container=str(arm.container), prompt=prompt_index, repetition=repetition,
                           env=recorded_env, argv=argv, cold=cold, returncode=code, wall_s=wall, load_average=load,
                           started_utc=started, memory_room=room, drive_read_bytes=drive)
    write_run_identity(partial, identity)
    os.replace(partial, final)
    fsync_dir(arm_dir)
    return final, identity


def measure_engine(engine: str | Path, arms: list[EngineArm], prompts: list[str], reps: int, runtime_env: dict,
                   ngen: int, out_dir: str | Path, *, timeout_s: float | None = None, progress=print) -> list[Path]:
    """Run every (arm, prompt, repetition) of :func:`schedule` not yet complete under ``out_dir``.

    Parameters
    ----------
    engine : the colibrì binary.
    arms : containers measured, the control first.
    prompts : one prompt per run.
    reps : repetitions of every prompt on every arm.
    runtime_env : the engine's environment variables for the run configuration
        (:func:`replay.colibri.engine_config.env_words`, tolerant of variables it does not read).
    ngen : tokens to generate per run (``NGEN``).
    out_dir : where the runs go (created).
    timeout_s : a run still going after this many seconds is killed and recorded with return code -9.

    Returns
    -------
    The run directories, in schedule order.
    """
    engine = Path(os.path.abspath(engine))
    if not (engine.is_file() and os.access(engine, os.X_OK)):
        raise InputError(engine, "not an executable file (the colibrì engine binary)")
    if reps < 1 or ngen < 1:
        raise InputError(None, "--reps and --ngen must be at least 1")
    for arm in arms:
        if not arm.container.is_dir():
            raise InputError(arm.container, "not a directory (a colibrì container)")
        container_files(arm.container)
    out_dir = make_dirs(os.path.abspath(out_dir))    # the engine runs in the run's directory: paths given to it are absolute
    arms = [EngineArm(a.name, Path(os.path.abspath(a.container)), a.env) for a in arms]
    done = []
    plan = schedule(arms, len(prompts), reps)
    for i, (arm, p, rep) in enumerate(plan, 1):
        final = out_dir / arm.name / run_name(p, rep)
        if (final / RUN_FILE).is_file():
            progress(f"[{i}/{len(plan)}] {arm.name} {final.name}: kept (complete)")
            done.append(final)
            continue
        others = tuple(f for a in arms if a is not arm for f in model_files(a.container, {**runtime_env, **a.env}))
        path, ident = run_engine_once(engine, arm, p, prompts[p], rep, runtime_env=runtime_env, ngen=ngen, out_dir=out_dir,
                                      timeout_s=timeout_s, also_cold=others)
        status = "ok" if ident.returncode == 0 else f"engine exit status {ident.returncode}"
        progress(f"[{i}/{len(plan)}] {arm.name} {path.name}: {status}, {ident.wall_s:.1f} s, load {ident.load_average:.2f}")
        done.append(path)
    return done
