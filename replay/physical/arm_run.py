"""One arm's run through a measurement: the demand path of each forward, layer by layer, performed for real.

Per forward and MoE layer, as the replay model assumes: the batch union of experts; pinned and
LRU-resident experts served from RAM; the missing experts, in the layer's physical order, become
jobs for the reader pool (:mod:`replay.physical.read_jobs`). The calling thread plays the compute
thread (:class:`replay.physical.compute_clock.ComputeClock`): it sleeps for each layer's dense
time, for the resident experts' matmuls, then for each missing expert in issue order waits for its
bytes and sleeps for its matmul; every wait is timed with the monotonic clock. With a prefetch
source a prefetch thread loads the next layer's predicted experts beside the demand loads
(:mod:`replay.physical.prefetcher`). Nothing the runtime does not do is timed: threads, buffers
and the compiled planner are ready before the first step, and the records are encoded after each
step (:mod:`replay.physical.stall_writer`). :class:`ArmRun` holds the parts: what the arm reads
(:class:`ReadGeometry`), its threads (:class:`ReadThreads`), its LRUs (:class:`LayerLrus`) and its
totals (:class:`RunTotals`). Times in ``time.perf_counter_ns`` nanoseconds, compute in seconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.container import Container
from containers.errors import InputError
from containers.layout import Layout, layout_from_container

from replay.model.routing import RoutingTrace
from replay.model.config import PREFETCH_SOURCES, RuntimeConfig, lru_capacities, replay_only_settings
from replay.model.engine import SplitState, layout_arrays
from replay.model.readplan import WEIGHT
from replay.physical.compute_clock import ComputeClock
from replay.physical.prefetcher import Prefetcher
from replay.physical.read_jobs import SplitReads, layer_reads, submit_layer, wait_expert
from replay.physical.reader import ALIGN, IO_ZERO, Reader
from replay.physical.stall_writer import StallTraceWriter, StepId


def assumed_committed_mask(trace: RoutingTrace) -> np.ndarray:
    """Forwards whose committed count the trace assumed rather than recorded, or that commit
    nothing (a trace imported before prefill counted its token). Trace meta ``committed_assumed``
    names forward kinds (``kinds``) or, per session name, forward indices within the session
    (``session_forwards``), so it stays true of a subset of the sessions."""
    from replay.model.routing import FORWARD_KINDS

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


def check_harness_config(config: RuntimeConfig, coupling) -> None:
    """Refuse a configuration the harness cannot perform: a replay-only setting
    (:func:`replay.model.config.replay_only_settings`), the pilot source, or the coupled source without its table."""
    if config.prefetch == "pilot":
        raise InputError(None, "the pilot prefetch source is colibrì's router pilot, whose predictions no routing trace "
                               "records: the replay model draws them at a measured precision, the harness does not run it")
    if config.prefetch == "coupled" and coupling is None:
        raise InputError(None, "the coupled prefetch source needs a coupling table learned from training sessions")
    replay_only = replay_only_settings(config)
    if replay_only:
        raise InputError(None, f"the harness performs the runtime's own prefetch (sources {', '.join(PREFETCH_SOURCES)}, "
                               f"top-K); {replay_only[0][1]} exists in the replay model only")


def arm_layout(container: Container, split: tuple[Layout, SplitState] | None, config: RuntimeConfig,
               trace: RoutingTrace) -> tuple[Layout, SplitReads | None]:
    """The layout an arm reads ``container`` by, and for a container stored as split segments
    what is read from it (:class:`replay.physical.read_jobs.SplitReads`, from the split plan's
    layout and state ``split``); refuses a split plan for whole experts or the reverse, coalescing
    or prefetch on a split container, and a trace that does not fit the container."""
    reads = None
    if any(e.segments for e in container.experts.values()):
        if split is None:
            raise InputError(container.root, "this container stores experts as split segments; measure it with --layout "
                                             "PLAN.json, the split plan it was rewritten from")
        if config.coalesce or config.prefetch != "none":
            raise InputError(container.root, "measuring a split container with --coalesce or a prefetch source is not "
                                             "implemented (demand reads only)")
        layout, state = split
        reads = SplitReads(container, layout, state)
    elif split is not None:
        raise InputError(container.root, "the plan splits experts but this container stores them whole")
    else:
        layout = layout_from_container(container)
    missing = sorted(set(trace.layers.tolist()) - set(layout.layers))
    if missing or trace.n_experts > layout.n_experts:
        raise InputError(trace.source or None, f"trace does not fit the container (layers {missing[:3]}, {trace.n_experts} experts)")
    return layout, reads


class ReadGeometry:
    """The container as one arm reads it: its layout's arrays, a split container's segment reads,
    the bytes a miss of each expert reads, each layer's LRU capacity and each expert's compute.

    Attributes: ``lay`` (:func:`replay.model.engine.layout_arrays`), ``split``
    (:class:`replay.physical.read_jobs.SplitReads` or None), ``layer_index`` (model layer ->
    layout layer), ``n_experts``, ``expert_bytes`` [L, E] (bytes a miss reads), ``capacity`` [L]
    (experts each LRU holds), ``compute`` [L, E] (seconds of matmul per position).
    """

    def __init__(self, layout: Layout, split: SplitReads | None, config: RuntimeConfig):
        self.split, self.config = split, config
        self.n_experts = layout.n_experts
        self.layer_index = {layer: i for i, layer in enumerate(layout.layers)}
        self.lay = layout_arrays(layout, config, None)
        self.expert_bytes = layout.expert_bytes() if split is None else split.need_bytes
        self.capacity = lru_capacities(config.ram_bytes, self.expert_bytes[:, 0], config.lru_experts)
        self.compute = self.lay.seconds
        self._load_reads: dict[tuple, list] = {}

    def largest_read(self) -> int:
        """Bytes of the largest read a thread may issue (an expert's, widened for O_DIRECT)."""
        return int(self.expert_bytes.max()) + 2 * ALIGN if self.expert_bytes.size else ALIGN

    def plan(self, li: int, experts: list, skip: list) -> list:
        """The reads of layout layer ``li``'s missing ``experts`` (issue order; ``skip``: a
        prefetch load in flight, nothing to read), in :func:`replay.physical.read_jobs.layer_reads`' form."""
        if self.split is None:
            return layer_reads(self.lay, li, experts, skip, self.config)
        return self.split.layer_reads(li, experts)

    def load_reads(self, li: int, e: int) -> list:
        """One prefetch load's reads (alone, never coalesced), planned once per expert: the
        prefetch is queued between routing and the demand jobs, where planning would delay them."""
        if (li, e) not in self._load_reads:
            planned = layer_reads(self.lay, li, [e], [False], self.config, coalesce=False)
            self._load_reads[li, e] = [(f, off, n, self.config.direct and kind == WEIGHT)
                                       for f, off, n, _, _, kind, _ in planned]
        return self._load_reads[li, e]

    def before_bytes(self, li: int, e: int) -> float:
        """Seconds of a missing expert's matmul (per position) that run before its bytes arrive
        (its resident top's share, in a split container)."""
        return 0.0 if self.split is None else self.split.top_seconds(li, e, self.compute[li, e])

    def after_bytes(self, li: int, e: int) -> float:
        """Seconds of a missing expert's matmul (per position) that run after its bytes arrive."""
        c = self.compute[li, e]
        return c if self.split is None else self.split.rest_seconds(li, e, c)


class ReadThreads:
    """An arm's reader (descriptors, buffers), its pool of ``in_flight`` reader threads and its
    prefetch thread (None without a prefetch source)."""

    def __init__(self, container: Container, config: RuntimeConfig, coupling, n_experts: int):
        self.reader = Reader(container.files, config.direct)
        self.pool = ThreadPoolExecutor(max_workers=config.in_flight, thread_name_prefix="relayout-io")
        self.prefetcher = (Prefetcher(config, coupling, n_experts, self.reader.read)
                           if config.prefetch != "none" else None)
        self.in_flight = config.in_flight

    def start(self, largest: int) -> None:
        """Start every thread with its read buffer (``largest`` bytes), before anything is timed."""
        start_threads(self.pool, self.in_flight, self.reader, largest)
        if self.prefetcher:
            start_threads(self.prefetcher.thread, 1, self.reader, largest)

    def job(self, reads, after=()):
        """A reader thread's job: once the futures ``after`` have completed, perform ``reads``
        ((file, offset, length, direct) each); returns (first issued, all done, how served)."""
        for fut in after:                      # a prefetch load in flight at routing completes first
            fut.result()
        t0 = time.perf_counter_ns()
        io = IO_ZERO
        for f, off, n, direct in reads:
            io = io + self.reader.read(f, off, n, direct)
        return t0, time.perf_counter_ns(), io

    def close(self) -> None:
        """Stop the threads, close the files."""
        self.pool.shutdown(wait=True)
        if self.prefetcher:
            self.prefetcher.close()
        self.reader.close()


class LayerLrus:
    """Each layer's LRU of whole experts (``capacity`` [L] experts; 0: no cache), emptied when a
    new session starts, as the replay model starts each session."""

    def __init__(self, capacity: np.ndarray):
        self.capacity = capacity
        self.lrus = [OrderedDict() for _ in range(len(capacity))]
        self.session = -1

    def enter(self, session: int) -> None:
        """A step of ``session``: the LRUs start empty when it is not the previous step's."""
        if session != self.session:
            self.session = session
            for lru in self.lrus:
                lru.clear()

    def insert(self, li: int, e: int) -> None:
        """Expert ``e`` enters layer ``li``'s LRU (most recent), the least recent leaving when full."""
        cap = self.capacity[li]
        if cap > 0:
            lru = self.lrus[li]
            lru[e] = None
            while len(lru) > cap:
                lru.popitem(last=False)


@dataclass
class RunTotals:
    """What an arm's steps add up to: foreground stall and wall time (ns), steps, committed tokens."""

    stall_ns: int = 0
    wall_ns: int = 0
    steps: int = 0
    committed: int = 0


class ArmRun:
    """One arm's state through a measurement: ``start``, then ``step`` per forward, then
    ``finish`` (or ``abort``), and always ``close``.

    Parameters
    ----------
    arm : replay.physical.measure.Arm
        The container, configuration, output, coupling table and split plan.
    run_id : str
        The run's id in its records.
    trace : RoutingTrace
        The routing trace measured.
    record : bool
        Whether to write the STALL_TRACE.
    """

    def __init__(self, arm, run_id: str, trace: RoutingTrace, record: bool):
        container, config = arm.container, arm.config
        self.run_id = run_id
        layout, split = arm_layout(container, arm.split, config, trace)
        check_harness_config(config, arm.coupling)
        self.config, self.trace = config, trace
        self.geometry = ReadGeometry(layout, split, config)
        self.sink = StallTraceWriter(arm.out, record)
        try:
            self.threads = ReadThreads(container, config, arm.coupling, self.geometry.n_experts)
        except BaseException as exc:
            self.sink.abort(exc)
            raise
        self.row_start = np.searchsorted(trace.row_forward, np.arange(trace.n_forwards + 1))
        self.lrus = LayerLrus(self.geometry.capacity)
        self.totals = RunTotals()
        self.assumed = assumed_committed_mask(trace)
        self.configuration = (f"{Path(container.root).name} workers={config.in_flight} ram={config.ram_bytes} "
                              f"coalesce={int(config.coalesce)} direct={int(config.direct)} prefetch={config.prefetch} "
                              f"page_cache_test={self.threads.reader.page_cache_test}")
        self.clock = ComputeClock()
        self.how = ""

    @property
    def direct(self) -> bool:
        """Whether weights were read with O_DIRECT."""
        return self.threads.reader.direct is not None

    def start(self, how: str) -> None:
        """Start the threads and load the compiled code, before anything is timed; ``how``: how
        the page cache was controlled (:func:`replay.physical.measure.drop_cache`)."""
        self.how = how
        self.threads.start(self.geometry.largest_read())
        warm_compiled(self.geometry.lay, self.config, self.threads.prefetcher)

    def step(self, f: int) -> None:
        """Perform forward ``f``: every MoE layer's routing, loads, waits and emulated compute,
        then its records."""
        trace = self.trace
        self.lrus.enter(int(trace.fwd_session[f]))
        counts = (max(int(trace.fwd_committed[f]), 1), int(trace.fwd_evaluated[f]))
        sid = StepId(run_id=self.run_id, request_id=trace.sessions[self.lrus.session], step=f,
                     committed_tokens=counts[0], evaluated_positions=counts[1])
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
        layer_index = self.geometry.layer_index
        self.clock.begin()                         # the runtime's step starts here: the routing above is ours
        for n_layer, layer in enumerate(layers):
            li = layer_index[layer]
            nxt = layers[n_layer + 1] if n_layer + 1 < len(layers) else None
            following = unions[nxt] if nxt is not None and layer_index[nxt] == li + 1 else None
            layer_stall, layer_compute = self._layer(sid, li, layer, unions[layer], following)
            stall_ns += layer_stall
            compute_ns += layer_compute
        prefetcher = self.threads.prefetcher
        if prefetcher:
            prefetcher.flush(self.sink, wait=False)
        wall = time.perf_counter_ns() - step_t0
        t = self.totals
        t.stall_ns += stall_ns
        t.wall_ns += wall
        t.steps += 1
        t.committed += counts[0]
        self.sink.step(sid, compute_ns=compute_ns, wall_ns=wall, stall_ns=stall_ns, assumed=bool(self.assumed[f]),
                       configuration=self.configuration)

    def _layer(self, sid: StepId, li: int, layer: int, routed: tuple, following: tuple | None) -> tuple[int, int]:
        """One MoE layer of step ``sid`` (layout layer ``li``, model layer ``layer``; ``routed``:
        its experts and their selections; ``following``: the next layer's when it is ``li + 1``).
        Returns its foreground stall and its compute (ns; routing and issuing reads are other time)."""
        geo, config, sink, clock = self.geometry, self.config, self.sink, self.clock
        prefetcher, lrus = self.threads.prefetcher, self.lrus
        comp, ebytes, capacity, lru = geo.compute, geo.expert_bytes, geo.capacity[li], lrus.lrus[li]
        union, mult = routed
        c0 = time.perf_counter_ns()
        clock(config.dense_seconds)
        t_route = time.perf_counter_ns()
        loaded = prefetcher.route(li) if prefetcher else {}     # what the prefetcher started for this layer
        ready_now = {e for e, fut in loaded.items() if fut.done()}
        for e in ready_now:                                     # completed loads enter the LRU first
            lrus.insert(li, e)
        hits, misses, inflight = [], [], {}
        for e, m in zip(union.tolist(), mult.tolist()):
            if capacity > 0 and e in lru:
                lru.move_to_end(e)
                hits.append((e, m))
            elif capacity <= 0 and e in ready_now:             # no cache: held for this layer
                hits.append((e, m))
            else:
                misses.append((e, m))
                if e in loaded and e not in ready_now:
                    inflight[e] = loaded[e]
        misses.sort(key=lambda em: geo.lay.rank[li, em[0]])            # issue order: physical order
        planned = geo.plan(li, [e for e, _ in misses], [e in inflight for e, _ in misses])
        in_flight = [fut for e, fut in loaded.items() if e not in ready_now]
        if prefetcher is not None and following is not None:
            prefetcher.start(li, union, mult, *following, lrus.lrus[li + 1], geo.load_reads)   # queued at routing
        futures = submit_layer(self.threads.pool, self.threads.job, planned, len(misses), config, in_flight)
        t_issued = time.perf_counter_ns()
        clock.begin()         # the layer's reads are issued: its compute and waits are timed from here
        futures = [((inflight[e], True),) if e in inflight else fut for (e, _), fut in zip(misses, futures)]
        clock(sum(comp[li, e] * m for e, m in hits)
              + (0.0 if geo.split is None else sum(geo.before_bytes(li, e) * m for e, m in misses)))
        layer_stall = 0
        for (e, m), fut in zip(misses, futures):
            reached = time.perf_counter_ns()
            issue, ready, io = wait_expert(fut)
            need, waited = clock.waited(reached, ready)
            layer_stall += waited
            sink.expert(sid, layer, e, required=True, nbytes=int(ebytes[li, e]), issue=issue, ready=ready, need=need,
                        tier=io.tier, priority="speculative" if e in inflight else "demand", stall=waited, io=io)
            clock(geo.after_bytes(li, e) * m)
        for e, m in hits:
            if e in ready_now:
                issue, ready, io = loaded[e].result()
                sink.expert(sid, layer, e, required=True, nbytes=int(ebytes[li, e]), issue=issue, ready=ready,
                            need=t_route, tier=io.tier, priority="speculative", io=io)
            else:
                sink.expert(sid, layer, e, required=True, nbytes=int(ebytes[li, e]), issue=t_route, ready=t_route,
                            need=t_route, tier="ram", io=IO_ZERO)
        for e, _ in misses:
            lrus.insert(li, e)
        selected = set(union.tolist())
        for e, fut in loaded.items():                           # loaded for this layer, not selected
            if e not in selected:
                prefetcher.unused(sid, layer, e, int(ebytes[li, e]), fut)
                if e not in ready_now:
                    lrus.insert(li, e)
        compute = time.perf_counter_ns() - c0 - layer_stall - (t_issued - t_route)   # routing is other time
        return layer_stall, compute

    def settle(self) -> None:
        """Wait, untimed, until no prefetch load of this run is in flight."""
        if self.threads.prefetcher:
            self.threads.prefetcher.idle()

    def finish(self) -> Path | None:
        """Wait for the prefetch loads still recorded as pending, close the record; returns its path."""
        t0 = time.perf_counter_ns()
        if self.threads.prefetcher:
            self.threads.prefetcher.flush(self.sink, wait=True)
        self.totals.wall_ns += time.perf_counter_ns() - t0
        return self.sink.close()

    def abort(self, exc: BaseException) -> None:
        """Discard the record: nothing half-written is left looking complete."""
        self.sink.abort(exc)

    def close(self) -> None:
        """Stop the threads, close the files."""
        self.threads.close()


def start_threads(pool: ThreadPoolExecutor, n: int, reader: Reader, largest: int) -> None:
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


def warm_compiled(lay, config: RuntimeConfig, prefetcher: Prefetcher | None) -> None:
    """Call the compiled read planner (and predictor) once before anything is timed: a compiled
    function loads from numba's cache on its first call in a process, about half a second that
    the first measured step counted as compute (hiding the stall of the reads under way)."""
    layer_reads(lay, 0, [0], [False], config)
    if prefetcher:
        one = np.zeros(1, dtype=np.int64)
        prefetcher.warm(one, one + 1)
