"""What the harness reads for a layer's missing experts, as jobs for its reader threads.

:func:`layer_reads` plans a layer's reads with the compiled function the replay model calls
(:func:`replay.model.readplan.plan_layer`: weights in one ``pread`` when byte-adjacent, three when
not; then three buffered scale reads; with coalescing, one read for a run of contiguous experts,
never over ``coalesce_max_bytes``, the scale reads as separate jobs). :class:`SplitReads` says what
is read from a container stored as vertical split segments. :func:`submit_layer` turns a plan into
jobs on the reader pool, in issue order, and :func:`wait_expert` waits for one expert's jobs.
Offsets and lengths in bytes; times in ``time.perf_counter_ns`` nanoseconds.
"""

from __future__ import annotations

import numpy as np

from containers.container import Container
from containers.errors import InputError
from containers.layout import WEIGHT_SLOTS, Layout

from replay.model.config import RuntimeConfig
from replay.model.engine import SplitState
from replay.model.readplan import SCALE, WEIGHT, Coalescing, LayerPlace, new_plan, plan_layer
from replay.physical.reader import IO_ZERO, IoTally


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


def submit_layer(pool, job, reads: list, k: int, config: RuntimeConfig, after: list = ()) -> list:
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


def wait_expert(futs) -> tuple[int, int, IoTally]:
    """``(issue, ready, reads)`` of a missing expert's (future, counts its reads) pairs, once all
    have completed: its first read's issue and its last read's completion (ns), and the reads it
    counts."""
    done = [(f.result(), counted) for f, counted in futs]
    io = IO_ZERO
    for t, counted in done:
        if counted:
            io = io + t[2]
    return min(t[0] for t, _ in done), max(t[1] for t, _ in done), io
