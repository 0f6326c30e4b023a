"""``relayout measure``: perform the runtime's demand path for real and record a STALL_TRACE.

Per held-out forward and MoE layer, exactly as the replay model assumes: the batch union of
experts; pinned and LRU-resident experts served from RAM; the missing experts, in the layer's
physical order, become jobs for a pool of ``workers`` threads, planned by the same compiled
function the model calls, :func:`replay.model.readplan.plan_layer` (weights: one ``pread`` when
byte-adjacent, three when not, O_DIRECT where the file system allows, widened to 4 KiB file
offsets; then three buffered scale preads; with coalescing, one read for a run of contiguous
experts, never over ``coalesce_max_bytes``, and the scale reads as separate jobs). The calling thread
plays the compute thread: it sleeps for each layer's dense time, for the resident experts'
matmuls, then for each missing expert in issue order waits for its bytes and sleeps for its
matmul. Every wait is timed with the monotonic clock (ns). Nothing the runtime does not do is
timed: the reader threads are started, their buffers allocated and the compiled planner loaded
before the first step, and the records are encoded after each step, not between its waits. What
the thread still does of its own (routing, planning and submitting reads, waking after a wait,
about 1 ms per layer in Python) is taken off the emulated compute (:class:`_ComputeClock`):
between its waits the thread takes the compute model's time, not that plus its own. Python's
garbage collector is kept to what the measurement allocates (:func:`measure_interleaved`).

With a prefetch source (``config.prefetch``), a prefetch thread does what the runtime and the
replay model do: when a layer is routed, before its demand loads are submitted, the next layer's
predicted experts (not in the LRU) are queued on it (colibrì's ``couple_prefetch`` right after
the router), and it loads them one at a time beside the layer's demand loads, until the next
layer is routed; loads not started by then are dropped, one in flight completes and the next
layer waits for it if it needs the expert. The next layer's demand reads are issued only once
that load has completed, all of its reads, and so are the model's: colibrì's ``moe()`` waits
for the pilot's load in flight on a layer at its start (the ``PILOT_REAL`` barrier on
``g_pilot_inflight``). Where colibrì differs: that wait holds its whole layer, resident experts'
matmuls included, where here only the demand reads wait. Its loads are recorded as
``speculative`` records of the layer they were loaded for.

A container stored as vertical split segments is measured with its split plan (layout and
resident tops): a miss reads its bottom segments when its top is resident and its whole block
otherwise, from the container's own segment tensors (:class:`SplitReads`); resident tops are
loaded before the run, as the runtime loads them at start-up. Coalescing and prefetch are not
implemented for split containers (an error says so).

Output: seed Appendix A expert records plus step records, the format a patched runtime emits,
readable by :mod:`replay.physical.stalltrace`. Every expert record carries its step's
``evaluated_positions`` and ``committed_tokens`` (Appendix A), its ``foreground_stall_ns`` (the
compute thread's wait for it) and how its bytes were read: ``drive_requests``/``drive_bytes``
(O_DIRECT reads, and buffered reads the page cache could not serve), ``page_cache_requests``/
``page_cache_bytes`` (buffered reads, the scales and any weights read without O_DIRECT, served
from the page cache: before each buffered read, ``mincore`` says whether the cache holds all its
pages, read (:mod:`replay.physical.residency`; a page an earlier readahead is still reading is not held,
as the read then waits for the drive), and the read is issued either way; where Linux will not
say, for a file this process neither owns nor may write, each is first tried with
``RWF_NOWAIT``, which succeeds only from the cache but races with a fast drive) and
``unclassified_*`` where neither is available. The run's
``configuration`` names the test (``page_cache_test``). ``tier_served`` is
``nvme`` when any of its bytes came from the drive, ``os_cache`` when all came from the page
cache, ``ram`` for LRU hits. A coalesced weight read shared by a run of experts is counted on
the first of them. Step records carry ``committed_assumed`` when the routing trace does not
know that forward's acceptance (``committed_assumed`` in the trace meta: speculative verify
forwards of a ROUTE_TRACE or MBLT import), and the run's ``configuration``. Bytes read are discarded; buffers are reused, so memory is
bounded by ``workers`` x the largest read (reads longer than 64 MiB are issued in 64 MiB pieces).
"""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard
from containers.progress import progress_bar

from containers.atomic import atomic_output
from containers.container import Container
from containers.errors import InputError
from containers.layout import WEIGHT_SLOTS, Layout, layout_from_container

from replay.physical.buffers import read_buffer
from replay.model.config import PREFETCH_SOURCES, RuntimeConfig, lru_capacities
from replay.model.engine import SplitState, layout_arrays
from replay.model.prefetch import PairTable, Scratch, Selections, predict_next
from replay.model.readplan import SCALE, WEIGHT, Coalescing, LayerPlace, new_plan, plan_layer
from replay.physical.residency import open_residency
from replay.physical.stalltrace import IO_FIELDS
from replay.formats.trace import RoutingTrace

MAX_READ = 64 * 1024 * 1024
ALIGN = 4096
IO_ZERO = (0, 0, 0, 0, 0, 0)
"""(drive requests, drive bytes, page-cache requests, page-cache bytes, unclassified requests, bytes)."""


def default_run_id(container: str | os.PathLike, layout: str | os.PathLike | None = None) -> str:
    """A run id unique by default: container (and layout) name, start time to the microsecond."""
    name = Path(container).resolve().name or "container"
    if layout:
        name += "+" + Path(layout).stem
    now = time.time_ns()
    return f"{name}@{time.strftime('%Y%m%dT%H%M%S', time.localtime(now // 10**9))}.{now // 1000 % 10**6:06d}"


def assumed_committed_mask(trace: RoutingTrace) -> np.ndarray:
    """Forwards whose committed count the trace assumed rather than recorded, or that commit
    nothing (a trace imported before prefill counted its token). Trace meta ``committed_assumed``
    names forward kinds (``kinds``) or, per session name, forward indices within the session
    (``session_forwards``), so it stays true of a subset of the sessions."""
    from replay.formats.trace import FORWARD_KINDS

    info = trace.meta.get("committed_assumed") or {}
    kinds = [FORWARD_KINDS.index(k) for k in info.get("kinds", []) if k in FORWARD_KINDS]
    mask = np.isin(trace.fwd_kind, kinds) if kinds else np.zeros(trace.n_forwards, bool)
    per_session = info.get("session_forwards") or {}
    for si, name in enumerate(trace.sessions):
        local = per_session.get(name)
        if local:
            fw = np.flatnonzero(trace.fwd_session == si)
            local = np.array([i for i in local if isinstance(i, int) and 0 <= i < len(fw)], dtype=np.int64)
            mask[fw[local]] = True
    return mask | (trace.fwd_committed < 1)


@dataclass
class MeasureResult:
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


class _Reader:
    """Per-file descriptors (O_DIRECT twin when possible) and per-thread aligned buffers."""

    def __init__(self, files: list[Path], direct: bool):
        self.buffered = [os.open(p, os.O_RDONLY) for p in files]
        self.direct = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files]
                probe = mmap.mmap(-1, ALIGN)
                os.preadv(fds[0], [probe], 0)
                self.direct = fds
            except OSError:
                self.direct = None
        self.local = threading.local()
        self.residency = open_residency(self.buffered, files)
        self.nowait = self.residency is None and hasattr(os, "RWF_NOWAIT")

    @property
    def page_cache_test(self) -> str:
        """How buffered reads are told apart: ``mincore`` (asked before each read),
        ``RWF_NOWAIT`` (tried first; races with a fast drive, counting too few drive reads) or
        ``none`` (unclassified)."""
        return "mincore" if self.residency is not None else "RWF_NOWAIT" if self.nowait else "none"

    def _buffer(self, n: int) -> memoryview:
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < n:
            buf = read_buffer(n)
            self.local.buf = buf
        return buf

    def prepare(self, n: int) -> None:
        """Give the calling thread its buffer for reads of up to ``n`` bytes
        (:func:`replay.physical.buffers.read_buffer`: huge pages, touched, so its first timed read does
        not fault them in)."""
        self._buffer(min(n, MAX_READ))

    def read(self, f: int, off: int, n: int, direct: bool) -> tuple:
        """Read the range; returns how (:data:`IO_ZERO`'s fields): one request, counted where its
        first piece was served, and the bytes of every piece where each was."""
        direct = direct and self.direct is not None
        if direct:
            a = off // ALIGN * ALIGN
            e = -(-(off + n) // ALIGN) * ALIGN
            fd, off, n = self.direct[f], a, e - a
        else:
            fd = self.buffered[f]
        io = [0] * 6
        counted = False
        while n > 0:
            step = min(n, MAX_READ)
            view = memoryview(self._buffer(min(step, MAX_READ)))[:step]
            slot, done = 0, False
            if not direct:
                slot = 4
                if self.residency is not None:     # asked first; the read itself is always issued, as the kernel's
                    slot = 2 if self.residency[f].cached(off, step) else 0    # readahead follows the reads it sees
                elif self.nowait:
                    slot = 0
                    try:
                        if os.preadv(fd, [view], off, os.RWF_NOWAIT) == step:
                            slot, done = 2, True       # served by the page cache
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.nowait, slot = False, 4   # not supported here: unclassified from now on
            if not done:
                got = os.preadv(fd, [view], off)
                if got < step:
                    if direct and got >= 0:
                        io[0] += 0 if counted else 1
                        io[1] += got
                        return tuple(io)  # an O_DIRECT window may reach past the end of the file
                    raise InputError(None, f"short read at byte {off}")
            if not counted:               # one request per read, as the runtime issues it, whatever the pieces
                io[slot] += 1
                counted = True
            io[slot + 1] += step
            off += step
            n -= step
        return tuple(io)

    def close(self) -> None:
        for r in self.residency or []:
            r.close()
        for fd in self.buffered + (self.direct or []):
            os.close(fd)


@dataclass(frozen=True)
class Arm:
    """One run of a measurement: a container read under one runtime configuration.

    ``out``: the STALL_TRACE to write (None for none); ``run_id`` defaults to
    :func:`default_run_id` of the container; ``coupling``: the coupled prefetch source's table
    (:func:`replay.model.coupling.coupling_table`), needed when ``config.prefetch == "coupled"``;
    ``split``: for a container stored as split segments, the split plan's layout and its
    :class:`replay.model.engine.SplitState` (:class:`SplitReads` says what is read).
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
    cold: bool = True,
    record: bool = True,
    progress: bool = True,
    coupling: tuple[np.ndarray, np.ndarray] | None = None,
    split: tuple[Layout, SplitState] | None = None,
) -> MeasureResult:
    """Run the demand path on ``container`` for the forwards in mask ``forwards`` (one
    :class:`Arm` of :func:`measure_interleaved`; the arguments are the arm's fields)."""
    arm = Arm(container, config, out, run_id, coupling, split)
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
    over every ``len(arms)`` steps each arm takes each place once. Two runs measured one after the other minutes apart see a disk
    whose speed may have moved between them (a virtual disk here moved 30-56% within a
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

    ``on_step`` is called after each arm's step (for a caller's progress bar).
    Memory: each arm holds ``workers + 1`` read buffers of its largest read (bytes), its own.
    Returns one :class:`MeasureResult` per arm; its ``wall_seconds`` is the time spent in its
    own steps (s). When an arm fails, no arm's record is left unfinished.
    """
    runs: list[_Run] = []
    try:
        for arm in arms:
            runs.append(_Run(arm, trace, record))
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
            return [run.finish() for run in runs]
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


class _Run:
    """One arm's state through a measurement: ``start``, then ``step`` per forward, then
    ``finish`` (or ``abort``), and always ``close``."""

    def __init__(self, arm: Arm, trace: RoutingTrace, record: bool):
        container, config = arm.container, arm.config
        self.run_id = arm.run_id if arm.run_id is not None else default_run_id(container.root)
        self.seg = None
        if any(e.segments for e in container.experts.values()):
            if arm.split is None:
                raise InputError(container.root, "this container stores experts as split segments; measure it with --layout "
                                                 "PLAN.json, the split plan it was rewritten from")
            if config.coalesce or config.prefetch != "none":
                raise InputError(container.root, "measuring a split container with --coalesce or a prefetch source is not "
                                                 "implemented (demand reads only)")
            layout, state = arm.split
            self.seg = SplitReads(container, layout, state)
        elif arm.split is not None:
            raise InputError(container.root, "the plan splits experts but this container stores them whole")
        else:
            layout = layout_from_container(container)
        L, E = len(layout.layers), layout.n_experts
        self.layer_index = {layer: i for i, layer in enumerate(layout.layers)}
        missing = sorted(set(trace.layers.tolist()) - set(self.layer_index))
        if missing or trace.n_experts > E:
            raise InputError(trace.source or None, f"trace does not fit the container (layers {missing[:3]}, {trace.n_experts} experts)")
        if config.prefetch == "coupled" and arm.coupling is None:
            raise InputError(None, "the coupled prefetch source needs a coupling table learned from training sessions")
        replay_only = [what for what, on in (
            (f"prefetch source {config.prefetch!r}", config.prefetch not in PREFETCH_SOURCES),
            (f"admission policy {config.admission!r}", config.admission != "top-k"),
            ("a speculative-byte budget", config.prefetch_bytes > 0), ("stale cancellation", config.cancel_stale),
            ("the adaptive budget", config.adaptive_budget), ("backoff", config.backoff)) if on]
        if replay_only:
            raise InputError(None, f"the harness performs the runtime's own prefetch (sources {', '.join(PREFETCH_SOURCES)}, "
                                   f"top-K); {replay_only[0]} exists in the replay model only")
        self.config, self.trace = config, trace
        self.lay = layout_arrays(layout, config, None)
        self.ebytes = layout.expert_bytes() if self.seg is None else self.seg.need_bytes
        self.capacity = lru_capacities(config.ram_bytes, self.ebytes[:, 0], config.lru_experts)
        self.comp = self.lay.seconds
        self.sink = _Sink(arm.out, record)
        try:
            self.reader = _Reader(container.files, config.direct)
        except BaseException as exc:
            self.sink.abort(exc)
            raise
        self.pool = ThreadPoolExecutor(max_workers=config.in_flight, thread_name_prefix="relayout-io")
        self.prefetcher = _Prefetcher(config, arm.coupling, E, self.reader.read) if config.prefetch != "none" else None
        self.row_start = np.searchsorted(trace.row_forward, np.arange(trace.n_forwards + 1))
        self.lrus = [OrderedDict() for _ in range(L)]
        self.load_reads: dict[tuple, list] = {}
        self.session = -1
        self.total_stall = self.wall_ns = self.steps = self.committed = 0
        self.assumed = assumed_committed_mask(trace)
        self.configuration = (f"{Path(container.root).name} workers={config.in_flight} ram={config.ram_bytes} "
                              f"coalesce={int(config.coalesce)} direct={int(config.direct)} prefetch={config.prefetch} "
                              f"page_cache_test={self.reader.page_cache_test}")
        self.sleep = _ComputeClock()
        self.how = ""

    def start(self, how: str) -> None:
        """Start the threads and load the compiled code, before anything is timed; ``how``: how
        the page cache was controlled (:func:`drop_cache`)."""
        self.how = how
        largest = int(self.ebytes.max()) + 2 * ALIGN if self.ebytes.size else ALIGN
        _start_threads(self.pool, self.config.in_flight, self.reader, largest)
        if self.prefetcher:
            _start_threads(self.prefetcher.thread, 1, self.reader, largest)
        _warm_compiled(self.lay, self.config, self.prefetcher)

    def _job(self, reads, after=()):
        for fut in after:                      # a prefetch load in flight at routing completes first
            fut.result()
        t0 = time.perf_counter_ns()
        io = IO_ZERO
        for f, off, n, direct in reads:
            io = _add_io(io, self.reader.read(f, off, n, direct))
        return t0, time.perf_counter_ns(), io

    def _reads_of(self, li: int, e: int) -> list:
        """One prefetch load's reads (alone, never coalesced), planned once per expert: the
        prefetch is queued between routing and the demand jobs, where planning would delay them."""
        if (li, e) not in self.load_reads:
            planned = layer_reads(self.lay, li, [e], [False], self.config, coalesce=False)
            self.load_reads[li, e] = [(f, off, n, self.config.direct and kind == WEIGHT)
                                      for f, off, n, _, _, kind, _ in planned]
        return self.load_reads[li, e]

    def step(self, f: int) -> None:
        """Perform forward ``f``: every MoE layer's routing, loads, waits and emulated compute,
        then its records."""
        trace, config, lay, comp, seg = self.trace, self.config, self.lay, self.comp, self.seg
        capacity, ebytes, lrus, layer_index = self.capacity, self.ebytes, self.lrus, self.layer_index
        prefetcher, sink, run_id, _sleep = self.prefetcher, self.sink, self.run_id, self.sleep
        if trace.fwd_session[f] != self.session:
            self.session = int(trace.fwd_session[f])
            for lru in lrus:
                lru.clear()
        request = trace.sessions[self.session]
        counts = (max(int(trace.fwd_committed[f]), 1), int(trace.fwd_evaluated[f]))
        step_t0 = time.perf_counter_ns()
        compute_ns = stall_ns = 0
        rows = slice(self.row_start[f], self.row_start[f + 1])
        r_layer = trace.row_layer[rows]
        r_ex = trace.experts[rows]
        layers = np.unique(r_layer).tolist()
        unions = {}
        for layer in layers:
            sel = r_ex[r_layer == layer]
            unions[layer] = np.unique(sel[sel >= 0], return_counts=True)
        _sleep.begin()                             # the runtime's step starts here: the routing above is ours
        for n_layer, layer in enumerate(layers):
            li = layer_index[layer]
            union, mult = unions[layer]
            c0 = time.perf_counter_ns()
            _sleep(config.dense_seconds)
            lru = lrus[li]
            t_route = time.perf_counter_ns()
            loaded = prefetcher.route(li) if prefetcher else {}     # what the prefetcher started for this layer
            ready_now = {e for e, fut in loaded.items() if fut.done()}
            for e in ready_now:                                     # completed loads enter the LRU first
                if capacity[li] > 0:
                    _lru_insert(lru, e, capacity[li])
            hits, misses, inflight = [], [], {}
            for e, m in zip(union.tolist(), mult.tolist()):
                if capacity[li] > 0 and e in lru:
                    lru.move_to_end(e)
                    hits.append((e, m))
                elif capacity[li] <= 0 and e in ready_now:         # no cache: held for this layer
                    hits.append((e, m))
                else:
                    misses.append((e, m))
                    if e in loaded and e not in ready_now:
                        inflight[e] = loaded[e]
            misses.sort(key=lambda em: lay.rank[li, em[0]])                # issue order: physical order
            planned = (layer_reads(lay, li, [e for e, _ in misses], [e in inflight for e, _ in misses], config)
                       if seg is None else seg.layer_reads(li, [e for e, _ in misses]))
            in_flight = [fut for e, fut in loaded.items() if e not in ready_now]
            nxt = layers[n_layer + 1] if n_layer + 1 < len(layers) else None
            if prefetcher is not None and nxt is not None and layer_index[nxt] == li + 1:
                prefetcher.start(li, union, mult, *unions[nxt], lrus[li + 1], self._reads_of)   # queued at routing
            futures = _submit(self.pool, self._job, planned, len(misses), config, in_flight)
            t_issued = time.perf_counter_ns()
            _sleep.begin()        # the layer's reads are issued: its compute and waits are timed from here
            futures = [((inflight[e], True),) if e in inflight else fut for (e, _), fut in zip(misses, futures)]
            _sleep(sum(comp[li, e] * m for e, m in hits)
                   + (0.0 if seg is None else sum(seg.top_seconds(li, e, comp[li, e]) * m for e, m in misses)))
            layer_stall = 0
            for (e, m), fut in zip(misses, futures):
                reached = time.perf_counter_ns()
                issue, ready, io = _wait(fut)
                need, waited = _sleep.waited(reached, ready)
                layer_stall += waited
                kind = "speculative" if e in inflight else "demand"
                sink.expert(run_id, request, f, layer, e, True, int(ebytes[li, e]), issue, ready, need, _tier(io), kind,
                            counts=counts, stall=waited, io=io)
                _sleep((comp[li, e] if seg is None else seg.rest_seconds(li, e, comp[li, e])) * m)
            for e, m in hits:
                if e in ready_now:
                    issue, ready, io = loaded[e].result()
                    sink.expert(run_id, request, f, layer, e, True, int(ebytes[li, e]), issue, ready, t_route, _tier(io),
                                "speculative", counts=counts, io=io)
                else:
                    sink.expert(run_id, request, f, layer, e, True, int(ebytes[li, e]), t_route, t_route, t_route, "ram",
                                counts=counts, io=IO_ZERO)
            for e, _ in misses:
                if capacity[li] > 0:
                    _lru_insert(lru, e, capacity[li])
            selected = set(union.tolist())
            for e, fut in loaded.items():                           # loaded for this layer, not selected
                if e not in selected:
                    prefetcher.unused(run_id, request, f, layer, e, int(ebytes[li, e]), fut, counts)
                    if capacity[li] > 0 and e not in ready_now:
                        _lru_insert(lru, e, capacity[li])
            stall_ns += layer_stall
            compute_ns += time.perf_counter_ns() - c0 - layer_stall - (t_issued - t_route)   # routing is other time
        if prefetcher:
            prefetcher.flush(sink, wait=False)
        wall = time.perf_counter_ns() - step_t0
        self.total_stall += stall_ns
        self.wall_ns += wall
        self.steps += 1
        self.committed += counts[0]
        sink.step(run_id, request, f, *counts, compute_ns, wall, stall_ns, bool(self.assumed[f]), self.configuration)

    def settle(self) -> None:
        """Wait, untimed, until no prefetch load of this run is in flight."""
        if self.prefetcher:
            self.prefetcher.idle()

    def finish(self) -> MeasureResult:
        """Wait for the prefetch loads still recorded as pending, close the record; the result."""
        t0 = time.perf_counter_ns()
        if self.prefetcher:
            self.prefetcher.flush(self.sink, wait=True)
        self.wall_ns += time.perf_counter_ns() - t0
        path = self.sink.close()
        return MeasureResult(path, self.how, self.reader.direct is not None, self.wall_ns / 1e9, self.steps,
                             self.committed, self.total_stall)

    def abort(self, exc: BaseException) -> None:
        """Discard the record: nothing half-written is left looking complete."""
        self.sink.abort(exc)

    def close(self) -> None:
        """Stop the threads, close the files."""
        self.pool.shutdown(wait=True)
        if self.prefetcher:
            self.prefetcher.close()
        self.reader.close()


def _start_threads(pool: ThreadPoolExecutor, n: int, reader: _Reader, largest: int) -> None:
    """Start all ``n`` threads of ``pool`` and give each its read buffer (``largest`` bytes)
    before anything is timed: the runtime's reader threads exist before it decodes, while a
    pool started on demand creates its threads during the first layer's submissions, and with
    the GIL contended each start took milliseconds (the first step measured about 120 ms of
    compute against the usual 11)."""
    barrier = threading.Barrier(n)

    def ready():
        reader.prepare(largest)
        barrier.wait()

    for fut in [pool.submit(ready) for _ in range(n)]:
        fut.result()


def _warm_compiled(lay, config: RuntimeConfig, prefetcher: "_Prefetcher | None") -> None:
    """Call the compiled read planner (and predictor) once before anything is timed: a compiled
    function loads from numba's cache on its first call in a process, about half a second that
    the first measured step counted as compute (hiding the stall of the reads under way)."""
    layer_reads(lay, 0, [0], [False], config)
    if prefetcher:
        one = np.zeros(1, dtype=np.int64)
        prefetcher.warm(one, one + 1)


def _add_io(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def _tier(io: tuple) -> str:
    """Where a loaded expert's bytes came from: the drive if any did, else the page cache."""
    if io[0] or io[4] or not io[2]:
        return "nvme"
    return "os_cache"


def _lru_insert(lru: OrderedDict, e: int, capacity: int) -> None:
    lru[e] = None
    while len(lru) > capacity:
        lru.popitem(last=False)


class _Prefetcher:
    """The prefetch thread: loads predicted experts of the next layer one at a time.

    ``start`` queues the loads (best prediction first) when a layer is routed, before its demand
    loads are submitted (colibrì's ``couple_prefetch`` right after the router), so they share the
    drive with them;
    ``route`` is called when the next layer is routed: loads not started by then are dropped, and
    it returns the started ones (done or in flight) by expert. The caller issues that layer's
    demand reads once the ones in flight have completed (:func:`measure`).
    """

    def __init__(self, config: RuntimeConfig, coupling, n_experts: int, read):
        self.source = PREFETCH_SOURCES.index(config.prefetch)
        self.k = config.prefetch_experts
        self.targets, self.counts = coupling if coupling is not None else (np.full((1, 1, 1), -1, np.int32), np.zeros((1, 1, 1), np.int32))
        self.read = read
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-prefetch")
        self.lock = threading.Lock()
        self.batch = 0                       # the loads of the current batch may start; route() and close() end it
        self.for_layer = -1
        self.loads: dict[int, tuple] = {}
        self.pending: list[tuple] = []       # unused loads whose record is written once they complete
        self.score = np.zeros(n_experts, np.int64)
        self.touched = np.empty(n_experts, np.int64)
        self.out = np.empty(64, np.int64)

    def start(self, li, union, mult, next_union, next_mult, next_lru, reads_of) -> None:
        n = self._predict(li, union, mult, next_union, next_mult)
        with self.lock:
            self.batch += 1
        self.for_layer = li + 1
        self.loads = {}
        for e in self.out[:n].tolist():
            if e in next_lru:
                continue
            started = [False]
            self.loads[e] = (self.thread.submit(self._load, reads_of(li + 1, e), started, self.batch), started)

    def warm(self, union, mult) -> None:
        """Predict once, untimed: the compiled predictor loads on its first call (about half a second)."""
        self._predict(0, union, mult, union, mult)

    def _predict(self, li, union, mult, next_union, next_mult) -> int:
        sel_e = np.concatenate([union, next_union]).astype(np.int64)
        sel_mult = np.concatenate([mult, next_mult]).astype(np.int64)
        sel_start = np.array([0, len(union), len(sel_e)], dtype=np.int64)
        return predict_next(self.source, 0, li, Selections(sel_start=sel_start, sel_e=sel_e, sel_mult=sel_mult),
                            PairTable(targets=self.targets, counts=self.counts), self.k,
                            Scratch(score=self.score, touched=self.touched), self.out)

    def _load(self, reads, started, batch):
        with self.lock:
            if batch != self.batch:                # dropped: its layer was routed before it started
                return None
            started[0] = True
        t0 = time.perf_counter_ns()
        io = IO_ZERO
        for r in reads:
            io = _add_io(io, self.read(*r) or IO_ZERO)
        return t0, time.perf_counter_ns(), io

    def idle(self) -> None:
        """Return once every load queued so far has completed or been dropped (the thread runs
        them in order)."""
        self.thread.submit(lambda: None).result()

    def route(self, li: int) -> dict:
        with self.lock:
            self.batch += 1
            loads = self.loads if self.for_layer == li else {}
            started = {e: fut for e, (fut, flag) in loads.items() if flag[0]}
        self.loads, self.for_layer = {}, -1
        return started

    def unused(self, run, request, step, layer, e, nbytes, fut, counts) -> None:
        self.pending.append((run, request, step, layer, e, nbytes, fut, counts))

    def flush(self, sink, wait: bool) -> None:
        keep = []
        for entry in self.pending:
            run, request, step, layer, e, nbytes, fut, counts = entry
            if wait or fut.done():
                issue, ready, io = fut.result()
                sink.expert(run, request, step, layer, e, False, nbytes, issue, ready, ready, _tier(io), "speculative",
                            counts=counts, io=io)
            else:
                keep.append(entry)
        self.pending = keep

    def close(self) -> None:
        with self.lock:
            self.batch += 1
        self.thread.shutdown(wait=True)


class SplitReads:
    """What the harness reads from a container stored as split segments (``docs/SPLIT_SEGMENTS.md``).

    Positions come from the container's own headers (its ``.top``/``.bottom`` tensors), checked
    against the split plan's layout (same files, every expert's block where the plan put it).
    A missing expert whose top is resident (``state.resident``) reads its bottom weight segments,
    byte-adjacent at the end of its weight block, in one pread, then one buffered pread per bottom
    scale segment (three); any other missing expert reads its whole weight block (six segments) in
    one pread, then one pread per scale segment (six). Resident tops count as loaded at start-up,
    as the runtime loads them before decoding: they are not read during the run. The compute
    thread runs a resident top's share of the matmul before waiting for the bottom (as the replay
    model does). Reads are not coalesced across experts. ``need_bytes`` [L, E]: bytes a miss of the
    expert reads (bottom segments when its top is resident, all segments otherwise).

    Where the replay model (:func:`replay.model.readplan.plan_layer`) plans these reads differently:
    it reads a bottom at the block's start rather than its end (same length, so the same timing
    up to alignment), plans three scale reads where a whole split expert has six, and scales a
    per-row format's down scales by the bottom's share where the segment format stores a full
    copy in each half (so for int4-row/int8-row experts it counts a few kB less per miss).
    Weight bytes agree exactly.
    """

    def __init__(self, container: Container, layout: Layout, state: SplitState):
        if [p.name for p in container.files] != list(layout.files) or layout.layers != container.routed_layers:
            raise InputError(container.root, "the split plan's layout does not match this container's files and layers")
        self.state = state
        L, E = len(layout.layers), layout.n_experts
        self.need_bytes = np.zeros((L, E), dtype=np.int64)
        self.whole: dict[tuple[int, int], list] = {}
        self.bottom: dict[tuple[int, int], list] = {}
        for li, layer in enumerate(layout.layers):
            for e in range(E):
                ex = container.experts.get((layer, e))
                if ex is None or not ex.segments:
                    raise InputError(container.root, f"expert {layer}.{e} is not stored as split segments")
                weights = sorted(((t.file, t.entry.begin, t.entry.nbytes, part) for (_, scale, part), t in ex.segments.items()
                                  if not scale), key=lambda x: x[:2])
                scales = [(t.file, t.entry.begin, t.entry.nbytes, part) for (_, scale, part), t in ex.segments.items() if scale]
                f0, start = weights[0][0], weights[0][1]
                loc = layout.expert_loc[li, e, list(WEIGHT_SLOTS)]
                if (f0, start) != (int(loc[0, 0]), int(loc[:, 1].min())):
                    raise InputError(container.root, f"expert {layer}.{e} is not where the split plan's layout puts it")
                bottoms = [w for w in weights if w[3] == "bottom"]
                if [w[3] for w in weights] != ["top"] * 3 + ["bottom"] * 3:
                    raise InputError(container.root, f"expert {layer}.{e}: weight segments are not tops then bottoms")
                end = weights[-1][1] + weights[-1][2]
                whole = [(f0, start, end - start, WEIGHT)] + [(f, off, n, SCALE) for f, off, n, _ in sorted(scales, key=lambda x: x[:2])]
                bottom = [(f0, bottoms[0][1], end - bottoms[0][1], WEIGHT)] + [
                    (f, off, n, SCALE) for f, off, n, part in sorted(scales, key=lambda x: x[:2]) if part == "bottom"]
                self.whole[li, e], self.bottom[li, e] = whole, bottom
                self.need_bytes[li, e] = sum(r[2] for r in (bottom if state.resident[li, e] else whole))

    def reads(self, li: int, e: int) -> list:
        """(file, offset, length, kind) of one miss, in order: its weight read, then its scale reads."""
        return self.bottom[li, e] if self.state.resident[li, e] else self.whole[li, e]

    def layer_reads(self, li: int, experts: list) -> list:
        """The misses' reads in :func:`layer_reads`' form, one job per miss (issue order)."""
        return [(f, off, n, p, p, kind, p) for p, e in enumerate(experts) for f, off, n, kind in self.reads(li, e)]

    def top_seconds(self, li: int, e: int, seconds: float) -> float:
        """The share of a missing expert's matmul that runs before its bytes arrive (its resident top)."""
        return seconds * self.state.top_fraction[li] if self.state.resident[li, e] else 0.0

    def rest_seconds(self, li: int, e: int, seconds: float) -> float:
        """The share of a missing expert's matmul that runs after its bytes arrive."""
        return seconds - self.top_seconds(li, e, seconds)


def layer_reads(lay, li: int, experts: list, skip: list, config: RuntimeConfig, coalesce: bool | None = None) -> list:
    """The reads of layout layer ``li``'s missing ``experts`` (issue order; ``skip``: a prefetch
    in flight, nothing to read) as :func:`replay.model.readplan.plan_layer` plans them for the model
    too: ``(file, offset, length, first, last, kind, job)`` per read, in issue order. ``lay`` is
    :func:`replay.model.engine.layout_arrays` of the layout; ``coalesce`` overrides ``config.coalesce``."""
    k = len(experts)
    plan = new_plan(k)
    place = LayerPlace(keep=1.0, adjacent=lay.adjacent[li], pos_file=lay.pos_file[li], pos_off=lay.pos_off[li],
                       wbytes=lay.wbytes[li], wloc=lay.wloc[li], sloc=lay.sloc[li])
    policy = Coalescing(coalesce=bool(config.coalesce if coalesce is None else coalesce),
                        gap_bytes=int(config.coalesce_gap_bytes), max_bytes=int(config.coalesce_max_bytes))
    n, _ = plan_layer(np.asarray(experts, dtype=np.int64), k, np.asarray(skip, dtype=np.bool_), np.zeros(k, dtype=np.bool_),
                      place, policy, np.empty(max(k, 1), dtype=np.int64), plan)
    return list(zip(*(a[:n].tolist() for a in plan)))


def _submit(pool, job, reads: list, k: int, config: RuntimeConfig, after: list = ()) -> list:
    """Submit a layer's planned jobs (:func:`layer_reads`) in issue order; returns per miss its
    (future, counts its reads) pairs (None for a miss with nothing to read). O_DIRECT is for
    weight reads; a coalesced weight read shared by a run counts on its first expert. Every job
    issues its first read only once the futures ``after`` (the prefetch loads in flight when the
    layer was routed) have completed."""
    jobs: dict[int, list] = {}
    for f, off, n, first, last, kind, j in reads:
        jobs.setdefault(j, []).append((f, off, n, config.direct and kind == WEIGHT))
    futs = {j: pool.submit(job, rs, list(after)) for j, rs in jobs.items()}     # dicts keep the issue order
    wjob, sjob, lead = [None] * k, [None] * k, [None] * k
    for f, off, n, first, last, kind, j in reads:
        if kind == WEIGHT:
            for m in range(first, last + 1):
                wjob[m], lead[m] = j, first
        else:
            sjob[first] = j
    out = []
    for m in range(k):
        if sjob[m] is None:
            out.append(None)
        elif wjob[m] == sjob[m]:
            out.append(((futs[sjob[m]], True),))
        else:
            out.append(((futs[wjob[m]], lead[m] == m), (futs[sjob[m]], True)))
    return out


def _wait(futs) -> tuple[int, int, tuple]:
    """(issue, ready, reads) of an expert's (future, counts its reads) pairs."""
    done = [(f.result(), counted) for f, counted in futs]
    io = IO_ZERO
    for t, counted in done:
        if counted:
            io = _add_io(io, t[2])
    return min(t[0] for t, _ in done), max(t[1] for t, _ in done), io


SPIN_SECONDS = 300e-6


class _ComputeClock:
    """Emulated compute: the compute thread's time between waits adds up to the compute model's.

    The thread does work of its own the runtime does not (routing, planning and submitting reads,
    building records, waking after a wait: about 1 ms per layer in Python). That work, and a
    sleep's lateness (tens of microseconds), are carried as a lag (ns) and taken off the next
    sleeps, so the thread reaches the next wait, and the next layer's routing, when the compute
    model says, as long as its own work fits in the compute; otherwise it would lengthen every
    window in which reads run without the thread waiting for them (a prefetch load's before the
    next layer is routed above all). Where it does not fit (experts of tens of microseconds of
    compute), a wait is timed from where the compute model would have reached it
    (:meth:`waited`), so the lag is counted as the stall it is, not as compute. A wait ends the
    lag: the thread resumes where the bytes arrived, as the runtime does. Work that delays a
    layer's reads (routing, planning them) cannot be undone: those reads are issued that much
    later than the model issues them, so the layer's clock starts when they are issued
    (:meth:`begin`), and that work lengthens the step's wall time instead. The last stretch of a
    sleep yields the GIL in a loop instead of blocking, so reader threads are never starved (a
    spin in compiled code with the lock released handed jobs to a reader thread no sooner:
    ``benchmarks/harness_waits.py``).
    """

    def __init__(self):
        self.lag = 0                             # ns the thread is behind the compute model
        self.mark = time.perf_counter_ns()       # the thread's time since then is not yet in the lag

    def begin(self) -> None:
        """The compute model's time starts over: what the thread did before is not lag. At a
        step's start (other runs' steps between), and when a layer's reads are issued: the work
        before (routing, planning the reads) delayed the reads and the compute alike, so the
        waits after it are timed from there, as the runtime's are from its routing."""
        self.lag, self.mark = 0, time.perf_counter_ns()

    def __call__(self, seconds: float) -> None:
        """Emulate ``seconds`` of compute, less the lag."""
        now = time.perf_counter_ns()
        want = round(seconds * 1e9) - self.lag - (now - self.mark)
        if want <= 0:
            self.lag, self.mark = -want, now
            return
        deadline = now + want
        if want > SPIN_SECONDS * 1e9:
            time.sleep(want / 1e9 - SPIN_SECONDS)
        while time.perf_counter_ns() < deadline:
            time.sleep(0)
        self.mark = time.perf_counter_ns()
        self.lag = self.mark - deadline

    def waited(self, reached_ns: int, ready_ns: int) -> tuple[int, int]:
        """The thread reached its wait for an expert at ``reached_ns`` whose bytes were ready at
        ``ready_ns`` (``time.perf_counter_ns``). Returns when the compute model needed them
        (``mark - lag``: the thread's own work since ``mark`` takes no time there) and how long
        it waited for them (ns), in the compute model's time: the runtime's stall, which the
        thread's own work, where it overran the emulated compute, would otherwise hide as
        compute. Then the model is at ``max(ready, need)``: when the thread really waited it
        goes on from ``ready_ns`` with no lag; when the bytes came while it was behind, it is
        behind by what is left."""
        need = self.mark - self.lag
        if ready_ns > reached_ns:
            self.lag, self.mark = 0, ready_ns
        elif ready_ns > need:
            self.lag, self.mark = reached_ns - ready_ns, reached_ns
        return need, max(0, ready_ns - need)


class _Sink:
    """Streams records to a (zstd) JSONL temp file, renamed into place on success only.

    A step's expert records are held until its step record and encoded with it, once its last
    layer is done: encoding them between the compute thread's waits would add time the compute
    model does not have (and lengthen the window a prefetch load has before the next layer is
    routed).
    """

    def __init__(self, out, record: bool):
        self.out = Path(out) if out is not None and record else None
        self.stack = contextlib.ExitStack()
        self.held: list[dict] = []
        self.fh = self.z = None
        if self.out is not None:
            self.fh = self.stack.enter_context(atomic_output(self.out, "wb"))
            if self.out.suffix == ".zst":
                self.z = zstandard.ZstdCompressor(level=3).stream_writer(self.fh, closefd=False)

    def _write(self, rec: dict) -> None:
        if self.out is not None:
            (self.z or self.fh).write((json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def expert(self, run, request, step, layer, e, required, nbytes, issue, ready, need, tier, priority="demand", *,
               counts=(1, 1), stall=0, io=IO_ZERO):
        if self.out is None:
            return
        rec = {"run_id": run, "request_id": request, "step": step, "layer": layer, "expert_id": e, "segment_id": 0,
               "evaluated_positions": counts[1], "committed_tokens": counts[0],
               "required": required, "bytes": nbytes, "issue_ns": issue, "ready_ns": ready, "need_ns": need,
               "foreground_stall_ns": stall,
               "tier_served": tier, "tier_at_prediction": "ram" if tier == "ram" else "os_cache_unknown", "priority": priority,
               "prediction_source": "demand" if priority == "demand" else "prefetch",
               "used_before_eviction": required, "cancelled": False}
        rec.update(zip(IO_FIELDS, io))
        self.held.append(rec)

    def _write_held(self) -> None:
        for rec in self.held:
            self._write(rec)
        self.held = []

    def step(self, run, request, step, committed, evaluated, compute_ns, wall_ns, stall_ns, assumed=False, configuration=None):
        self._write_held()
        self._write({"record": "step", "run_id": run, "request_id": request, "step": step, "committed_tokens": committed,
                     "evaluated_positions": evaluated, "committed_assumed": assumed, "compute_ns": compute_ns, "stall_ns": stall_ns,
                     "other_ns": max(0, wall_ns - compute_ns - stall_ns), "wall_ns": wall_ns, "token_hashes": None,
                     "configuration": configuration})

    def close(self) -> Path | None:
        self._write_held()
        if self.z is not None:
            self.z.flush(zstandard.FLUSH_FRAME)
        self.stack.close()
        return self.out

    def abort(self, exc: BaseException) -> None:
        self.stack.__exit__(type(exc), exc, exc.__traceback__)
