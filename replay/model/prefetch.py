"""Prefetch sources: which experts of the next MoE layer the runtime loads before it is routed.

colibrì can run a prefetch thread (``PILOT_REAL``; ``COUPLE`` feeds it from a cross-layer pair
table, the ``.coli_pairs`` file relayout exports): once layer L is routed, it predicts layer
L+1's experts and loads up to K of them into L+1's cache, one at a time, while L computes. The
replay model offers two sources:

* ``oracle``: the experts layer L+1 will really select (most positions first, then by id), the
  bound for any predictor with the same budget K;
* ``coupled``: experts scored by how often they followed layer L's union at the same position in
  the training sessions (``score(f) = sum over e in union(L) of count(L:e -> L+1:f)``, each
  expert keeping its 16 strongest successors as the ``.coli_pairs`` file does), highest first,
  ties by id.

The table is :func:`replay.model.coupling.coupling_table`. How the loads are timed (after the layer's demand reads, dropped once L+1 is routed) is in
:mod:`replay.model.engine`.
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
