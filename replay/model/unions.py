"""From a routing trace to (forward, layer) instances and their batch unions.

An *instance* is one MoE layer of one forward: the unit the runtime loads experts for. Its batch
union is the set of distinct experts its positions select (colibrì routes every position of a
forward, then loads each needed expert once).

A replay streams: rows come in blocks of whole forwards (:func:`whole_forward_blocks` from a
trace in memory, :func:`realign_blocks` over blocks read from a file), each block becomes one
chunk of instances (:func:`chunk_instances`), so the instance arrays are bounded by the chunk,
not the trace.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable, Iterator

import numpy as np
from numba import njit

from containers.layout import Layout

from replay.model.jit import LOOP
from replay.model.routing import RoutingTrace, RowBlock, whole_forward_runs

Instances = namedtuple("Instances", "forward layer session positions sel_start sel_e sel_mult sel_order")
"""The instances of the selected forwards, in time order (forward, then layer), as the compiled
model takes them. Per instance [I]: ``forward`` (int32, index into the trace's forwards),
``layer`` (int32, layout layer index), ``session`` (int32), ``positions`` (int32, the forward's
positions: the instance's rows). ``sel_start`` [I+1] (int64):
instance ``i``'s batch union is ``sel_e[sel_start[i]:sel_start[i+1]]`` (int16 expert ids, the
trace format's range, ascending within an instance), each selected by ``sel_mult`` (int32)
positions (at most the rows of one instance, fewer than the format's 2**31 rows). ``sel_order``
(int64, like ``sel_e``): instance ``i``'s selections in routing order, the order the runtime
meets them (positions in order, each position's experts in the router's order, an expert at its
first selection), as indices into ``sel_e`` (:func:`routing_order`)."""

DEFAULT_CHUNK_FORWARDS = 1024
"""Forwards per chunk of a streamed replay: about 77k GLM-5.2 instances, a few MB of arrays."""


def trace_instances(trace: RoutingTrace, forwards: np.ndarray, layout: Layout) -> Instances:
    """The instances of the forwards selected by mask ``forwards`` [F], for the layout's layers."""
    return rows_instances(trace.row_forward, trace.row_layer, trace.experts, forwards, trace.fwd_session, layout)


def rows_instances(row_forward: np.ndarray, row_layer: np.ndarray, experts: np.ndarray, forwards: np.ndarray,
                   fwd_session: np.ndarray, layout: Layout) -> Instances:
    """The instances of rows [R] (sorted by forward, holding every row of each forward they
    touch) whose forward is selected by mask ``forwards`` [F], for the layout's layers.

    ``row_forward`` indexes the whole trace's forwards (``forwards``, ``fwd_session``), so a
    slice of a trace's rows gives the same instances as the whole trace gives for those forwards.
    """
    L = len(layout.layers)
    layer_idx = np.full(int(max(layout.layers)) + 2, -1, dtype=np.int64)
    layer_idx[layout.layers] = np.arange(L)
    tl = row_layer.astype(np.int64)
    rows = np.flatnonzero(forwards[row_forward] & (tl < len(layer_idx)) & (layer_idx[np.minimum(tl, len(layer_idx) - 1)] >= 0))
    inst_key, row_inst = np.unique(row_forward[rows].astype(np.int64) * L + layer_idx[tl[rows]], return_inverse=True)
    I = len(inst_key)
    if len(row_inst) > 1 and (np.diff(row_inst) < 0).any():
        by_inst = np.argsort(row_inst, kind="stable")
        rows, row_inst = rows[by_inst], row_inst[by_inst]
    row_start = np.searchsorted(row_inst, np.arange(I + 1))
    sel_start, sel_e, sel_mult = instance_unions(row_start, rows, experts, layout.n_experts)
    sel_order = routing_order(row_start, rows, experts, sel_start, sel_e, layout.n_experts)
    fwd = inst_key // L
    return Instances(fwd.astype(np.int32), (inst_key % L).astype(np.int32), fwd_session[fwd].astype(np.int32),
                     np.diff(row_start).astype(np.int32), sel_start, sel_e, sel_mult, sel_order)


def whole_forward_blocks(trace: RoutingTrace, chunk_forwards: int) -> Iterator[RowBlock]:
    """The trace's rows in blocks of ``chunk_forwards`` consecutive forwards (views, not copies)."""
    if chunk_forwards < 1:
        raise ValueError("chunk_forwards must be at least 1")
    F = trace.n_forwards
    cuts = np.searchsorted(trace.row_forward, np.arange(0, F + chunk_forwards, chunk_forwards).clip(max=F))
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        if r1 > r0:
            yield RowBlock(trace.row_forward[r0:r1], trace.row_layer[r0:r1], trace.experts[r0:r1])


def realign_blocks(blocks: Iterable[RowBlock]) -> Iterator[RowBlock]:
    """Blocks of rows (sorted by forward) recut so that no forward spans two blocks
    (:func:`replay.model.routing.whole_forward_runs`)."""
    for b in whole_forward_runs(blocks):
        yield RowBlock(*b)


def chunk_instances(blocks: Iterable[RowBlock], forwards: np.ndarray, fwd_session: np.ndarray,
                    layout: Layout) -> Iterator[Instances]:
    """The instances of ``blocks`` (each holding whole forwards, in order), one chunk per block
    with a selected instance."""
    for b in blocks:
        inst = rows_instances(b.row_forward, b.row_layer, b.experts, forwards, fwd_session, layout)
        if len(inst.forward):
            yield inst


@njit(**LOOP)
def instance_unions(row_start, rows, experts, n_experts):
    """The batch union of each instance: the distinct experts its positions select, ascending.

    Instance ``i`` has trace rows ``rows[row_start[i]:row_start[i+1]]``; ``experts`` [R, k] holds
    -1 for no expert. Returns ``sel_start`` [I+1], ``sel_e`` and ``sel_mult`` (positions selecting
    each union expert).
    """
    I = len(row_start) - 1
    count = np.zeros(n_experts, np.int64)
    sel_start = np.zeros(I + 1, np.int64)
    sel_e = np.empty(len(rows) * experts.shape[1], np.int16)
    sel_mult = np.empty(len(sel_e), np.int32)
    n = 0
    for i in range(I):
        first = n
        for r in rows[row_start[i]:row_start[i + 1]]:
            for e in experts[r]:
                if e < 0:
                    continue
                if count[e] == 0:
                    q = n                           # insert, keeping the union ascending
                    while q > first and sel_e[q - 1] > e:
                        sel_e[q] = sel_e[q - 1]
                        q -= 1
                    sel_e[q] = e
                    n += 1
                count[e] += 1
        for j in range(first, n):
            sel_mult[j] = count[sel_e[j]]
            count[sel_e[j]] = 0
        sel_start[i + 1] = n
    return sel_start, sel_e[:n].copy(), sel_mult[:n].copy()


@njit(**LOOP)
def routing_order(row_start, rows, experts, sel_start, sel_e, n_experts):
    """Each instance's union in routing order: ``sel_order[sel_start[i] + r]`` is the index into
    ``sel_e`` of the ``r``-th distinct expert instance ``i``'s rows select (rows in order, each
    row's experts in its column order, an expert counted at its first selection), as colibrì's
    ``moe()`` builds its union. Arguments as :func:`instance_unions` takes them, with its
    ``sel_start`` and ``sel_e``."""
    where = np.full(n_experts, -1, np.int64)
    sel_order = np.empty(len(sel_e), np.int64)
    for i in range(len(row_start) - 1):
        first = sel_start[i]
        for j in range(first, sel_start[i + 1]):
            where[sel_e[j]] = j
        n = first
        for r in rows[row_start[i]:row_start[i + 1]]:
            for e in experts[r]:
                if e < 0 or where[e] < 0:
                    continue
                sel_order[n] = where[e]
                where[e] = -1
                n += 1
    return sel_order
