"""From a routing trace to (forward, layer) instances and their batch unions.

An *instance* is one MoE layer of one forward: the unit the runtime loads experts for. Its batch
union is the set of distinct experts its positions select (colibrì routes every position of a
forward, then loads each needed expert once).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from containers.layout import Layout

from .jit import LOOP
from .trace import RoutingTrace

Instances = namedtuple("Instances", "forward layer session sel_start sel_e sel_mult")
"""The instances of the selected forwards, in time order (forward, then layer), as the compiled
model takes them. Per instance [I], int64: ``forward`` (index into the trace's forwards),
``layer`` (layout layer index), ``session``. ``sel_start`` [I+1]: instance ``i``'s batch union
is ``sel_e[sel_start[i]:sel_start[i+1]]`` (expert ids, ascending within an instance), each
selected by ``sel_mult`` positions."""


def trace_instances(trace: RoutingTrace, forwards: np.ndarray, layout: Layout) -> Instances:
    """The instances of the forwards selected by mask ``forwards`` [F], for the layout's layers."""
    L = len(layout.layers)
    layer_idx = np.full(int(max(layout.layers)) + 2, -1, dtype=np.int64)
    layer_idx[layout.layers] = np.arange(L)
    tl = trace.row_layer.astype(np.int64)
    rows = np.flatnonzero(forwards[trace.row_forward] & (tl < len(layer_idx)) & (layer_idx[np.minimum(tl, len(layer_idx) - 1)] >= 0))
    inst_key, row_inst = np.unique(trace.row_forward[rows].astype(np.int64) * L + layer_idx[tl[rows]], return_inverse=True)
    I = len(inst_key)
    if len(row_inst) > 1 and (np.diff(row_inst) < 0).any():
        by_inst = np.argsort(row_inst, kind="stable")
        rows, row_inst = rows[by_inst], row_inst[by_inst]
    sel_start, sel_e, sel_mult = instance_unions(np.searchsorted(row_inst, np.arange(I + 1)), rows, trace.experts, layout.n_experts)
    fwd = inst_key // L
    return Instances(fwd, inst_key % L, trace.fwd_session[fwd].astype(np.int64), sel_start, sel_e, sel_mult)


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
    sel_e = np.empty(len(rows) * experts.shape[1], np.int64)
    sel_mult = np.empty(len(sel_e), np.int64)
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
