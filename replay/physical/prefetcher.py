"""The harness's prefetch thread, as the runtime's: the next layer's predicted experts, loaded one at a time.

When a layer is routed, before its demand loads are submitted, the next layer's predicted
experts (not in the LRU) are queued on the thread (colibrì's ``couple_prefetch`` right after the
router), and it loads them one at a time beside the layer's demand loads, until the next layer is
routed; loads not started by then are dropped, one in flight completes and the next layer waits
for it if it needs the expert. The next layer's demand reads are issued only once that load has
completed, all of its reads, and so are the model's: colibrì's ``moe()`` waits for the pilot's
load in flight on a layer at its start (the ``PILOT_REAL`` barrier on ``g_pilot_inflight``).
Where colibrì differs: that wait holds its whole layer, resident experts' matmuls included, where
the harness holds only the demand reads. Its loads are recorded as ``speculative`` records of the
layer they were loaded for. Prediction is the replay model's own compiled predictor
(:func:`replay.model.prefetch.predict_next`); sources :data:`replay.model.config.PREFETCH_SOURCES`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from replay.model.config import PREFETCH_SOURCES, RuntimeConfig
from replay.model.prefetch import PairTable, RouterPilot, Scratch, Selections, predict_next
from replay.physical.reader import IO_ZERO
from replay.physical.stall_writer import StallTraceWriter, StepId


class Prefetcher:
    """The prefetch thread: loads predicted experts of the next layer one at a time.

    ``start`` queues the loads (best prediction first) when a layer is routed, before its demand
    loads are submitted (colibrì's ``couple_prefetch`` right after the router), so they share the
    drive with them;
    ``route`` is called when the next layer is routed: loads not started by then are dropped, and
    it returns the started ones (done or in flight) by expert. The caller issues that layer's
    demand reads once the ones in flight have completed (:class:`replay.physical.arm_run.ArmRun`).
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
        self.no_pilot = RouterPilot(precision=0.0, forward=0, positions=1, heat=np.zeros((1, 1), np.int64))

    def start(self, li, union, mult, next_union, next_mult, next_lru, reads_of) -> None:
        """Layer ``li`` is routed (``union``, ``mult``: its experts and their selections; the next
        layer's likewise): queue loads of layer ``li + 1``'s predicted experts not in ``next_lru``,
        best prediction first, each reading ``reads_of(li + 1, e)``."""
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
                            Scratch(score=self.score, touched=self.touched), self.out, self.no_pilot)

    def _load(self, reads, started, batch):
        with self.lock:
            if batch != self.batch:                # dropped: its layer was routed before it started
                return None
            started[0] = True
        t0 = time.perf_counter_ns()
        io = IO_ZERO
        for r in reads:
            io = io + (self.read(*r) or IO_ZERO)
        return t0, time.perf_counter_ns(), io

    def idle(self) -> None:
        """Return once every load queued so far has completed or been dropped (the thread runs
        them in order)."""
        self.thread.submit(lambda: None).result()

    def route(self, li: int) -> dict:
        """Layer ``li`` is routed: the loads not started by now are dropped; returns the started
        ones (done or in flight) by expert, when they were queued for ``li``."""
        with self.lock:
            self.batch += 1
            loads = self.loads if self.for_layer == li else {}
            started = {e: fut for e, (fut, flag) in loads.items() if flag[0]}
        self.loads, self.for_layer = {}, -1
        return started

    def unused(self, sid: StepId, layer: int, e: int, nbytes: int, fut) -> None:
        """Expert ``e`` (``nbytes``) was loaded for model layer ``layer`` of step ``sid``, which
        did not select it: its record is written once the load has completed (:meth:`flush`)."""
        self.pending.append((sid, layer, e, nbytes, fut))

    def flush(self, sink: StallTraceWriter, wait: bool) -> None:
        """Record the unused loads that have completed (all of them, waiting, when ``wait``)."""
        keep = []
        for entry in self.pending:
            sid, layer, e, nbytes, fut = entry
            if wait or fut.done():
                issue, ready, io = fut.result()
                sink.expert(sid, layer, e, required=False, nbytes=nbytes, issue=issue, ready=ready, need=ready,
                            tier=io.tier, priority="speculative", io=io)
            else:
                keep.append(entry)
        self.pending = keep

    def close(self) -> None:
        """Drop the loads not started and stop the thread once the one running has completed."""
        with self.lock:
            self.batch += 1
        self.thread.shutdown(wait=True)
