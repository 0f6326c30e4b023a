"""Prefetch sources: which experts of the next MoE layer the runtime loads before it is routed.

colibrì can run a prefetch thread (``PILOT_REAL``; ``COUPLE`` feeds it from a cross-layer pair
table, the ``.coli_pairs`` file relayout exports): once layer L is routed, it predicts layer
L+1's experts and loads up to K of them into L+1's cache, one at a time, while L computes. The
replay model offers two sources:

* ``oracle``: the experts layer L+1 will really select (most positions first, then by id), the
  bound for any predictor with the same budget K;
* ``coupled``: experts scored by how often they followed layer L's union in the training
  sessions (``score(e') = sum over e in union(L) of count(L:e -> L+1:e')``), highest first,
  ties by id, never a zero score.

How the loads are timed (after the layer's demand reads, dropped once L+1 is routed) is in
:mod:`replay.engine`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from relayout.layout import Layout
from relayout.trace import RoutingTrace

from .jit import HELPER, LOOP
from .runtime import PREFETCH_SOURCES
from .unions import trace_instances

ORACLE, COUPLED = PREFETCH_SOURCES.index("oracle"), PREFETCH_SOURCES.index("coupled")


def coupling_table(trace: RoutingTrace, forwards: np.ndarray, layout: Layout) -> np.ndarray:
    """int32 [L, E, E]: ``[l, e, f]`` counts the forwards (of mask ``forwards``) whose union at
    layout layer ``l`` holds ``e`` and whose union at layer ``l + 1`` holds ``f``."""
    inst = trace_instances(trace, forwards, layout)
    return _count_coupling(inst.forward, inst.layer, inst.sel_start, inst.sel_e, len(layout.layers), layout.n_experts)


@njit(**LOOP)
def _count_coupling(inst_fwd, inst_li, sel_start, sel_e, n_layers, n_experts):
    table = np.zeros((n_layers, n_experts, n_experts), np.int32)
    for i in range(len(inst_fwd) - 1):
        if inst_fwd[i + 1] != inst_fwd[i] or inst_li[i + 1] != inst_li[i] + 1:
            continue
        li = inst_li[i]
        for a in range(sel_start[i], sel_start[i + 1]):
            for b in range(sel_start[i + 1], sel_start[i + 2]):
                table[li, sel_e[a], sel_e[b]] += 1
    return table


@njit(**HELPER)
def predict_next(source, i, li, sel_start, sel_e, sel_mult, table, k, score, out):
    """Fill ``out`` with up to ``k`` predicted experts of layer ``li + 1`` given instance ``i``
    (layer ``li``), best first; returns how many. ``score`` [E] is scratch."""
    for f in range(len(score)):
        score[f] = 0.0
    if source == ORACLE:
        for j in range(sel_start[i + 1], sel_start[i + 2]):
            score[sel_e[j]] = sel_mult[j]
    else:
        for a in range(sel_start[i], sel_start[i + 1]):
            row = table[li, sel_e[a]]
            for f in range(len(score)):
                score[f] += row[f]
    n = 0
    while n < k:
        best = -1
        for f in range(len(score)):
            if score[f] > 0 and (best < 0 or score[f] > score[best]):
                best = f
        if best < 0:
            break
        out[n] = best
        score[best] = 0.0
        n += 1
    return n
