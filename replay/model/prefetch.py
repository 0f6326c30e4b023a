"""The runtime's own prefetch sources: which experts of the next MoE layer it loads before it is routed.

colibrì's prefetch thread (``PILOT_REAL``; ``COUPLE`` feeds it from the cross-layer pair table
relayout exports as ``.coli_pairs``) predicts layer L+1's experts once layer L is routed and loads
up to K of them while L computes. :func:`predict_next` gives that list for the ``oracle`` source
(the experts layer L+1 will really select, most positions first, then by id: the bound for any
predictor with the same K), the ``coupled`` one (experts scored by ``sum over e in union(L)
of count(L:e -> L+1:f)`` in :func:`replay.model.coupling.coupling_table`, highest first, ties by
id) and the ``pilot`` one (colibrì's router pilot, drawn at its measured precision:
:func:`_pilot_draw`). How the loads are timed is :mod:`replay.model.prefetching`; docs/MODEL.md states it.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from replay.model.config import ENGINE_SOURCES
from replay.model.jit import HELPER

ORACLE, COUPLED, PILOT = (ENGINE_SOURCES.index(x) for x in ("oracle", "coupled", "pilot"))

Selections = namedtuple("Selections", "sel_start sel_e sel_mult")
"""Batch unions as :func:`predict_next` reads them (the fields of the same names of
:class:`replay.model.unions.Instances`): instance ``i``'s experts are ``sel_e[sel_start[i]:
sel_start[i + 1]]``, each selected by ``sel_mult`` positions."""

PairTable = namedtuple("PairTable", "targets counts")
"""The coupled source's pair table (:func:`replay.model.coupling.coupling_table`): ``targets``,
``counts`` [L, E, T]."""

Scratch = namedtuple("Scratch", "score touched")
""":func:`predict_next`'s scratch arrays [E]: ``score`` (zeros on entry and on return) and ``touched``."""

RouterPilot = namedtuple("RouterPilot", "precision forward positions heat")
"""What the pilot source draws from: ``precision`` (the share of the pilot's predictions the next
layer routes, 0-1), ``forward`` (the forward's index in its trace: the draws depend on it, the
layer and the expert only, so every layout gets the same predictions), ``positions`` (the
forward's positions) and ``heat`` [L, E] (the session's selections so far,
:class:`replay.model.runtime.Heat`'s ``count``). Other sources ignore it."""


@njit(**HELPER)
def predict_next(source, i, li, union, pairs, k, scratch, out, pilot):
    """Fill ``out`` with up to ``k`` predicted experts of layer ``li + 1`` given instance ``i``
    (layer ``li``) of the unions ``union`` (:data:`Selections`), best first (ties: lower id
    first); returns how many. ``pairs``: the coupled source's :data:`PairTable`; ``scratch``:
    :data:`Scratch`; ``pilot``: the pilot source's :data:`RouterPilot` (:func:`_pilot_draw`: ``k``
    per position, in draw order)."""
    sel_start, sel_e, sel_mult = union.sel_start, union.sel_e, union.sel_mult
    targets, counts, score, touched = pairs.targets, pairs.counts, scratch.score, scratch.touched
    if source == PILOT:
        return _pilot_draw(sel_e[sel_start[i + 1]:sel_start[i + 2]], sel_mult[sel_start[i + 1]:sel_start[i + 2]], li + 1,
                           k, pilot, scratch, out)
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


@njit(**HELPER)
def _pilot_draw(truth, mult, target, k, pilot, scratch, out):
    """colibrì's router pilot for layer ``target``, whose experts ``truth`` (selected by ``mult``
    positions) the trace records; the pilot's own predictions (the router run on the state
    before the previous layer's experts) it does not. Each position predicts ``min(k, top-k)``
    experts, a share ``pilot.precision`` of them right (that share of the list, rounded up or
    down by a draw; which experts of ``truth``, drawn); the rest are wrong, drawn among the
    other experts in proportion to one plus their selections so far in the session
    (``pilot.heat``: the router's favourites). The draws are hashes of the forward, the layer and
    the expert, so every layout gets the same list; it is returned in a drawn order (the
    pilot's own ranking is not known). Returns its length (at most ``len(out)``)."""
    score, touched = scratch.score, scratch.touched
    E = len(score)
    u = len(truth)
    if u == 0:
        return 0
    positions = max(pilot.positions, 1)
    top_k = max(mult.sum() // positions, 1)
    wanted = min(min(k, top_k) * positions, len(out), E)
    right = pilot.precision * wanted             # on average; a draw rounds it up or down
    n_right = int(right) + (1 if _uniform(pilot.forward, target, 0, 3) < right - int(right) else 0)
    n_right = min(n_right, u, wanted)
    for j in range(u):
        score[truth[j]] = 1
    n = 0
    while n < n_right:                           # the right ones: the truth's lowest draws
        best = -1
        for j in range(u):
            if score[truth[j]] == 1 and (best < 0 or _uniform(pilot.forward, target, truth[j], 0)
                                         < _uniform(pilot.forward, target, truth[best], 0)):
                best = j
        score[truth[best]] = 3
        touched[n] = truth[best]
        n += 1
    heat = pilot.heat[target]
    for m in range(wanted - n):
        total = 0.0
        for f in range(E):
            if score[f] == 0:
                total += 1.0 + heat[f]
        if total <= 0.0:
            break
        x = _uniform(pilot.forward, target, m, 1) * total
        pick = -1
        for f in range(E):
            if score[f] == 0:
                pick = f
                x -= 1.0 + heat[f]
                if x < 0.0:
                    break
        score[pick] = 2
        touched[n] = pick
        n += 1
    for t in range(n):                             # in drawn order
        f = touched[t]
        p = t
        while p > 0 and _uniform(pilot.forward, target, out[p - 1], 2) > _uniform(pilot.forward, target, f, 2):
            out[p] = out[p - 1]
            p -= 1
        out[p] = f
    for j in range(u):
        score[truth[j]] = 0
    for t in range(n):
        score[touched[t]] = 0
    return n


@njit(**HELPER)
def _uniform(forward, layer, x, salt):
    """A number in [0, 1) fixed by its four arguments (splitmix64 of their mix)."""
    z = (np.uint64(forward) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(layer) * np.uint64(0xBF58476D1CE4E5B9)
         + np.uint64(x) * np.uint64(0x94D049BB133111EB) + np.uint64(salt) * np.uint64(0xD6E8FEB86659FD93))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return float(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)
