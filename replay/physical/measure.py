"""``relayout measure``: perform the runtime's demand path for real and record a STALL_TRACE.

The public entry points: :func:`measure` (one run) and :func:`measure_interleaved` (several
runs, :class:`Arm`, step by step in lockstep), each a :class:`MeasureResult`; :func:`drop_cache`
(evict files from the page cache) and :func:`default_run_id`. A run performs, per held-out
forward and MoE layer, the reads and waits the replay model assumes
(:mod:`replay.physical.arm_run`): its reads planned by the model's own compiled planner
(:mod:`replay.physical.read_jobs`) and issued on reader threads (:mod:`replay.physical.reader`),
its compute emulated by the calling thread (:mod:`replay.physical.compute_clock`), a prefetch
thread where the configuration has a source (:mod:`replay.physical.prefetcher`), a container
stored as split segments read with its split plan (its resident tops loaded before the run, as
the runtime loads them at start-up; coalescing and prefetch are not implemented for it), and its
records written with each step (:mod:`replay.physical.stall_writer`), readable by
:mod:`replay.physical.stalltrace`. Step records carry ``committed_assumed`` when the routing
trace does not know that forward's acceptance (``committed_assumed`` in the trace meta), and the
run's ``configuration`` (which names its ``page_cache_test``). Memory is bounded by ``workers``
plus one read buffers of the largest read per arm (reads longer than 64 MiB are issued in 64 MiB
pieces). Python's garbage collector is kept to what the measurement allocates
(:func:`collector_out_of_the_way`). Times in nanoseconds unless a name says seconds.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from containers.progress import progress_bar

from containers.container import Container
from containers.layout import Layout

from replay.model.routing import RoutingTrace
from replay.model.config import RuntimeConfig
from replay.model.engine import SplitState
from replay.physical.arm_run import ArmRun


def default_run_id(container: str | os.PathLike, layout: str | os.PathLike | None = None) -> str:
    """A run id unique by default: container (and layout) name, start time to the microsecond."""
    name = Path(container).resolve().name or "container"
    if layout:
        name += "+" + Path(layout).stem
    now = time.time_ns()
    return f"{name}@{time.strftime('%Y%m%dT%H%M%S', time.localtime(now // 10**9))}.{now // 1000 % 10**6:06d}"


@dataclass
class MeasureResult:
    """One arm's measured run: the STALL_TRACE written (None for none), how the page cache was
    controlled (:func:`drop_cache`), whether weights were read with O_DIRECT, the wall time of
    its own steps (s), its steps, committed tokens and foreground stall (ns)."""

    path: Path | None
    cold: str
    direct: bool
    wall_seconds: float
    steps: int
    committed: int
    stall_ns: int


def drop_cache(paths: list[Path]) -> str:
    """Evict files from the page cache; returns how the cache was controlled. A file written
    moments ago may still have dirty pages, which no drop evicts: each file is written back
    first (``fsync``, which leaves its bytes as they are)."""
    ok = True
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):     # a read-only file system has nothing to write back
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            ok = False
        finally:
            os.close(fd)
    return "cold (page cache dropped with posix_fadvise DONTNEED)" if ok else "warm (could not drop the page cache)"


@dataclass(frozen=True)
class Arm:
    """One run of a measurement: a container read under one runtime configuration.

    ``out``: the STALL_TRACE to write (None for none); ``run_id`` defaults to
    :func:`default_run_id` of the container; ``coupling``: the coupled prefetch source's table
    (:func:`replay.model.coupling.coupling_table`), needed when ``config.prefetch == "coupled"``;
    ``split``: for a container stored as split segments, the split plan's layout and its
    :class:`replay.model.engine.SplitState` (:class:`replay.physical.read_jobs.SplitReads` says what is read).
    """

    container: Container
    config: RuntimeConfig
    out: str | os.PathLike | None
    run_id: str | None = None
    coupling: tuple[np.ndarray, np.ndarray] | None = None
    split: tuple[Layout, SplitState] | None = None


def measure(
    container: Container,
    trace: RoutingTrace,
    forwards: np.ndarray,
    config: RuntimeConfig,
    out: str | os.PathLike | None,
    run_id: str | None = None,
    *,
    cold: bool = True,
    record: bool = True,
    progress: bool = True,
    coupling: tuple[np.ndarray, np.ndarray] | None = None,
    split: tuple[Layout, SplitState] | None = None,
) -> MeasureResult:
    """Run the demand path on ``container`` for the forwards in mask ``forwards`` (one
    :class:`Arm` of :func:`measure_interleaved`).

    Parameters
    ----------
    container, config, out, run_id, coupling, split
        The arm's fields (:class:`Arm`).
    trace : RoutingTrace
        The routing trace whose forwards are performed.
    forwards : numpy.ndarray
        Boolean mask over the trace's forwards: the steps measured, in trace order.
    cold, record, progress
        As :func:`measure_interleaved`.

    Returns
    -------
    MeasureResult
        The run's STALL_TRACE path, totals and how the page cache was controlled.
    """
    arm = Arm(container=container, config=config, out=out, run_id=run_id, coupling=coupling, split=split)
    return measure_interleaved([arm], trace, forwards, cold=cold, record=record, progress=progress)[0]


def measure_interleaved(arms: list[Arm], trace: RoutingTrace, forwards: np.ndarray, cold: bool = True,
                        record: bool = True, progress: bool = True,
                        on_step: Callable[[], None] | None = None) -> list[MeasureResult]:
    """Measure several runs in lockstep: step ``j`` of every arm before step ``j + 1`` of any.

    Each arm is a run of its own (its reader threads, prefetch thread, LRU and STALL_TRACE, the
    records :func:`measure` writes), and arms never overlap: a step's demand reads complete
    within it, and a prefetch load still in flight at its end (loaded for a layer that then
    missed nothing) completes, untimed, before the next arm's step begins (alone, it would
    overlap the start of the arm's next step). The arms' order rotates by one each step, so
    over every ``len(arms)`` steps each arm takes each place once. Two runs measured one after
    the other minutes apart see a disk whose speed may have moved between them (a virtual disk here moved 30-56% within a
    validation); interleaved, every arm sees the disk of the same seconds, and a saving between
    two arms is measured at equal disk speed whatever the drift. ``cold`` drops the page cache
    of every arm's files before the first step and again, untimed, before the first step of
    each later session, once for all arms: each session then starts with its scales unread, as
    its LRU starts empty, which is how the replay model starts every session (a session is an
    independent sample of the held-out data; the model's page cache starts each session empty,
    :mod:`replay.model.pagecache`). Arms that read the same files share the
    page cache within a session: the buffered scale reads an arm finds cached because another
    arm read them are counted as page-cache requests in its records (with rotation, no arm is
    favoured).

    Memory: each arm holds ``workers + 1`` read buffers of its largest read (bytes), its own.
    When an arm fails, no arm's record is left unfinished.

    Parameters
    ----------
    arms : list of Arm
        The runs, each a container under one configuration.
    trace : RoutingTrace
        The routing trace whose forwards are performed.
    forwards : numpy.ndarray
        Boolean mask over the trace's forwards: the steps measured, in trace order.
    cold : bool
        Drop the page cache of the arms' files before the first step and at each new session.
    record : bool
        Write each arm's STALL_TRACE (``Arm.out``).
    progress : bool
        Show a progress bar.
    on_step : callable, optional
        Called after each arm's step (for a caller's progress bar).

    Returns
    -------
    list of MeasureResult
        One per arm, in ``arms`` order; ``wall_seconds`` is the time spent in its own steps (s).
    """
    runs: list[ArmRun] = []
    try:
        for arm in arms:
            run_id = arm.run_id if arm.run_id is not None else default_run_id(arm.container.root)
            runs.append(ArmRun(arm, run_id, trace, record))
        files = sorted({p for arm in arms for p in arm.container.files})
        how = drop_cache(files) if cold else "warm (page cache left as found)"
        for run in runs:
            run.start(how)
        fw = np.flatnonzero(forwards)
        with collector_out_of_the_way():
            for j, f in enumerate(progress_bar(fw, desc="measure", enabled=progress)):
                if cold and j > 0 and trace.fwd_session[f] != trace.fwd_session[fw[j - 1]]:
                    for run in runs:           # no prefetch load may land in the cache after the drop
                        run.settle()
                    drop_cache(files)          # a session starts cold, scales unread, as the model's do
                for i in range(len(runs)):
                    run = runs[(j + i) % len(runs)]
                    run.step(int(f))
                    if len(runs) > 1:
                        run.settle()
                    if on_step is not None:
                        on_step()
            return [_result(run, run.finish()) for run in runs]
    except BaseException as exc:
        for run in runs:
            run.abort(exc)
        raise
    finally:
        for run in runs:
            run.close()


@contextlib.contextmanager
def collector_out_of_the_way():
    """While inside, Python's garbage collector walks only the objects allocated inside.

    A full collection walks every container object the process holds, on whichever thread
    happens to allocate: in a process holding millions (``relayout validate`` keeps the trace,
    the layouts and the predictions), tens of milliseconds in which the compute thread or a
    reader thread stands still, stall the runtime, in C, never has. So everything alive on
    entry is collected once and then frozen (``gc.freeze``: moved where no collection looks),
    and unfrozen on exit (which also unfreezes what a caller had frozen before: nothing in
    relayout does). A safeguard: Python 3.11 runs a full collection only once the objects
    surviving since the last one reach a quarter of those it holds, and side by side on this
    machine (``benchmarks/harness_waits.py``, 3 M objects allocated first) the freeze made no
    measurable difference (``docs/BENCHMARKS.md``, "The harness's own waits").
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _result(run: ArmRun, path: Path | None) -> MeasureResult:
    t = run.totals
    return MeasureResult(path=path, cold=run.how, direct=run.direct, wall_seconds=t.wall_ns / 1e9, steps=t.steps,
                         committed=t.committed, stall_ns=t.stall_ns)
