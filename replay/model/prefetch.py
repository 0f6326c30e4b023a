"""The runtime's own prefetch sources: which experts of the next MoE layer it loads before it is routed.

colibrì's prefetch thread (``PILOT_REAL``; ``COUPLE`` feeds it from the cross-layer pair table
relayout exports as ``.coli_pairs``) predicts layer L+1's experts once layer L is routed and loads
up to K of them while L computes. :func:`predict_next` gives that list for the ``oracle`` source
(the experts layer L+1 will really select, most positions first, then by id: the bound for any
predictor with the same K) and the ``coupled`` one (experts scored by ``sum over e in union(L)
of count(L:e -> L+1:f)`` in :func:`replay.model.coupling.coupling_table`, highest first, ties by
id). How the loads are timed is :mod:`replay.model.prefetching`; docs/MODEL.md states it.
"""

from __future__ import annotations

from collections import namedtuple

from numba import njit

from replay.model.config import PREFETCH_SOURCES
from replay.model.jit import HELPER

ORACLE, COUPLED = PREFETCH_SOURCES.index("oracle"), PREFETCH_SOURCES.index("coupled")

Selections = namedtuple("Selections", "sel_start sel_e sel_mult")
"""Batch unions as :func:`predict_next` reads them (the fields of the same names of
:class:`replay.model.unions.Instances`): instance ``i``'s experts are ``sel_e[sel_start[i]:
sel_start[i + 1]]``, each selected by ``sel_mult`` positions."""

PairTable = namedtuple("PairTable", "targets counts")
"""The coupled source's pair table (:func:`replay.model.coupling.coupling_table`): ``targets``,
``counts`` [L, E, T]."""

Scratch = namedtuple("Scratch", "score touched")
""":func:`predict_next`'s scratch arrays [E]: ``score`` (zeros on entry and on return) and ``touched``."""


@njit(**HELPER)
def predict_next(source, i, li, union, pairs, k, scratch, out):
    """Fill ``out`` with up to ``k`` predicted experts of layer ``li + 1`` given instance ``i``
    (layer ``li``) of the unions ``union`` (:data:`Selections`), best first (ties: lower id
    first); returns how many. ``pairs``: the coupled source's :data:`PairTable`; ``scratch``:
    :data:`Scratch`."""
    sel_start, sel_e, sel_mult = union.sel_start, union.sel_e, union.sel_mult
    targets, counts, score, touched = pairs.targets, pairs.counts, scratch.score, scratch.touched
    n_touched = 0
    if source == ORACLE:
        for j in range(sel_start[i + 1], sel_start[i + 2]):
            score[sel_e[j]] = sel_mult[j]
            touched[n_touched] = sel_e[j]
            n_touched += 1
    else:
        for a in range(sel_start[i], sel_start[i + 1]):
            for m in range(targets.shape[2]):
                f = targets[li, sel_e[a], m]
                if f < 0:
                    break
                if score[f] == 0:
                    touched[n_touched] = f
                    n_touched += 1
                score[f] += counts[li, sel_e[a], m]
    n = 0
    for t in range(n_touched):               # keep the k best in out[:n]
        f = touched[t]
        q = n
        while q > 0 and _better(f, out[q - 1], score):
            if q < k:
                out[q] = out[q - 1]
            q -= 1
        if q < k:
            out[q] = f
            n = min(n + 1, k)
    for t in range(n_touched):
        score[touched[t]] = 0
    return n


@njit(**HELPER)
def _better(f, g, score):
    """Expert ``f`` ranks before ``g``: a higher score, or the same score and a lower id."""
    return score[f] > score[g] or (score[f] == score[g] and f < g)
