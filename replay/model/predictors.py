"""Prediction sources in the compiled model: each expert's probability of being needed by the next layer.

When layer L of a forward is routed, a source (``heat``, ``persistence``, ``coupled``,
``session``, ``oracle``; several fused into one) gives every expert of layer L+1 the probability
that layer L+1's batch union holds it: a raw score from what the runtime knows then, mapped
through a calibration learned on training sessions. This module holds the learned tables as the
compiled model takes them (:data:`PredictionSource`, :class:`SourceModel`, :class:`FusedModel`)
and the compiled functions that run inside the replay's loop and in the learning and scoring
passes (:func:`next_layer_probabilities`, :func:`fused_probabilities`, :func:`scoring_pass`,
:func:`cells_pass`), so the model and the scores use one definition of every source. Learning
and scoring them is :mod:`replay.control.sources`; docs/MODEL.md defines each source.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import FUSED, MODEL_SOURCES, SOURCE_SEPARATOR
from replay.model.jit import HELPER, LOOP

ORACLE, COUPLED = MODEL_SOURCES.index("oracle"), MODEL_SOURCES.index("coupled")
HEAT, PERSISTENCE, SESSION = (MODEL_SOURCES.index(x) for x in ("heat", "persistence", "session"))

CALIBRATION_BINS = 21
"""Raw-score bins the calibration is learned over: bin 0 holds a raw score of exactly 0, bins
1-20 split (0, 1] evenly."""

RELIABILITY_BINS = 10
"""Equal-width probability bins of the reliability data and of the expected calibration error."""

PERSISTENCE_FORWARDS = 24
"""The persistence source forgets an expert not in the union for this many forwards."""

SESSION_PRIOR_FORWARDS = 4.0
"""The session source's prior weight (in forwards) on the training heat."""

FUSION_EPS = 1e-4
"""The fusion clips each source's probability to [FUSION_EPS, 1 - FUSION_EPS] before its log-odds."""

PredictionSource = namedtuple("PredictionSource", "kind targets counts selections heat calib last_fwd last_session "
                                                  "count n_fwd session p raw touched")
"""One source as the compiled model takes it (:func:`prediction_source`).

Learned on training sessions: ``kind`` (an index into ``MODEL_SOURCES``); the coupled pair
table ``targets``, ``counts`` int32 [L, E, T] and ``selections`` [L, E] (each expert's training
selections, positions); ``heat`` [L, E] (fraction of training forwards whose union held each
expert); ``calib`` [L, CALIBRATION_BINS] (probability per raw-score bin). What the source has
seen of the replayed sessions so far, per layer: ``last_fwd`` [L, E] (the forward each expert
was last in the union, in ``last_session`` [L, E]), ``count`` [L, E] (union memberships in the
current session ``session`` [L], over ``n_fwd`` [L] forwards). Scratch [E]: ``p``
(probabilities of the layer being predicted), ``raw``; [E + 1]: ``touched`` (the experts listed,
written branch-free, so one past the last may be written)."""


@dataclass
class SourceModel:
    """A prediction source learned on training sessions (:func:`replay.control.sources.learn_source`): the tables the
    compiled source reads. Arrays as :data:`PredictionSource` describes them."""

    name: str
    targets: np.ndarray
    counts: np.ndarray
    selections: np.ndarray
    heat: np.ndarray
    calib: np.ndarray


@dataclass
class FusedModel:
    """Several sources learned on training sessions and fused into one probability
    (:func:`replay.control.sources.learn_fused`): ``sources`` (:class:`SourceModel`, in the order of the setting) and
    ``coef`` [S + 1], the intercept ``w_0`` then each source's weight ``w_s`` on its log-odds."""

    sources: list
    coef: np.ndarray

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.sources)

    @property
    def name(self) -> str:
        return SOURCE_SEPARATOR.join(self.names)


def prediction_source(model: SourceModel | None, layout: Layout, kind: str | None = None) -> PredictionSource:
    """The compiled model's :data:`PredictionSource` for ``model`` (fresh replay state); with no
    model, an empty one of source ``kind`` (``none`` or ``oracle``, which learn nothing; or
    ``fused``: the holder of several sources' fused probability, :func:`fused_probabilities`)."""
    L, E = len(layout.layers), layout.n_experts
    if model is None:
        model = SourceModel(name=kind or "none", targets=np.full((L, E, 1), -1, dtype=np.int32),
                            counts=np.zeros((L, E, 1), dtype=np.int32), selections=np.zeros((L, E)), heat=np.zeros((L, E)),
                            calib=np.tile(np.linspace(0.0, 1.0, CALIBRATION_BINS), (L, 1)))
    if model.heat.shape != (L, E):
        raise InputError(None, f"the {model.name} source was learned for {model.heat.shape} experts, "
                               f"the layout has {(L, E)}")
    return PredictionSource(
        kind=FUSED if model.name == "fused" else MODEL_SOURCES.index(model.name),
        targets=np.ascontiguousarray(model.targets, dtype=np.int32), counts=np.ascontiguousarray(model.counts, dtype=np.int32),
        selections=np.ascontiguousarray(model.selections, dtype=np.float64),
        heat=np.ascontiguousarray(model.heat, dtype=np.float64), calib=np.ascontiguousarray(model.calib, dtype=np.float64),
        last_fwd=np.full((L, E), -1, dtype=np.int64), last_session=np.full((L, E), -1, dtype=np.int64), count=np.zeros((L, E)),
        n_fwd=np.zeros(L, dtype=np.int64), session=np.full(L, -1, dtype=np.int64), p=np.zeros(E), raw=np.zeros(E),
        touched=np.zeros(E + 1, dtype=np.int64))


# ----------------------------------------------------------------------------- compiled source

@njit(**HELPER)
def observe_union(src, li, forward, session, sel_e, a, b):
    """Layer ``li`` of ``forward`` (of ``session``) was routed to ``sel_e[a:b]``: update what the
    persistence and session sources know (a new session forgets the last one)."""
    if src.kind != PERSISTENCE and src.kind != SESSION:
        return
    if src.session[li] != session:
        src.session[li] = session
        src.n_fwd[li] = 0
        for e in range(src.count.shape[1]):
            src.count[li, e] = 0.0
    src.n_fwd[li] += 1
    for j in range(a, b):
        e = sel_e[j]
        src.count[li, e] += 1.0
        src.last_fwd[li, e] = forward
        src.last_session[li, e] = session


@njit(**HELPER)
def next_layer_probabilities(src, i, nl, inst, calibrated=True):
    """Fill ``src.p`` [E] with each expert's probability of being in layer ``nl``'s union, given
    instance ``i`` (layer ``nl - 1`` of the same forward) was just routed. The oracle reads
    instance ``i + 1``, the true next layer. With ``calibrated`` False, ``src.p`` gets each raw
    score's calibration bin instead (the calibration pass learns from those).

    Returns, for the sparse sources (oracle, coupled), how many experts ``src.touched`` lists:
    every other expert has :func:`untouched_probability`; -1 for the others."""
    p, raw = src.p, src.raw
    E = len(p)
    kind = src.kind
    if kind == ORACLE:
        for e in range(E):
            p[e] = 0.0
        n_touched = 0
        for j in range(inst.sel_start[i + 1], inst.sel_start[i + 2]):
            p[inst.sel_e[j]] = 1.0
            src.touched[n_touched] = inst.sel_e[j]
            n_touched += 1
        return n_touched
    calib = src.calib[nl]
    if kind == COUPLED:
        n_touched = 0
        total = 0.0
        li = nl - 1
        for a in range(inst.sel_start[i], inst.sel_start[i + 1]):
            ea = inst.sel_e[a]
            total += src.selections[li, ea]
            for m in range(src.targets.shape[2]):
                f = src.targets[li, ea, m]
                if f < 0:
                    break
                src.touched[n_touched] = f       # listed when new: branch-free, the slot is kept only then
                n_touched += raw[f] == 0
                raw[f] += src.counts[li, ea, m]
        base = _mapped(calib, 0, calibrated)
        for e in range(E):
            p[e] = base
        for t in range(n_touched):
            f = src.touched[t]
            p[f] = _mapped(calib, _bin(raw[f] / total if total > 0 else 0.0), calibrated)
            raw[f] = 0.0
        return n_touched
    forward, session = inst.forward[i], inst.session[i]
    for e in range(E):
        if kind == HEAT:
            r = src.heat[nl, e]
        elif kind == PERSISTENCE:
            r = 0.0
            if src.last_session[nl, e] == session and src.last_fwd[nl, e] >= 0:
                gap = forward - src.last_fwd[nl, e]
                if 1 <= gap <= PERSISTENCE_FORWARDS:
                    r = 1.0 / (1 << (gap - 1))
        else:
            c, n = 0.0, 0.0
            if src.session[nl] == session:
                c, n = src.count[nl, e], float(src.n_fwd[nl])
            r = (c + SESSION_PRIOR_FORWARDS * src.heat[nl, e]) / (n + SESSION_PRIOR_FORWARDS)
        p[e] = _mapped(calib, _bin(r), calibrated)
    return -1


@njit(**HELPER)
def observe_sources(sources, li, forward, session, sel_e, a, b):
    """:func:`observe_union` for each source of the tuple ``sources``."""
    for s in range(len(sources)):
        observe_union(sources[s], li, forward, session, sel_e, a, b)


@njit(**HELPER)
def fused_probabilities(sources, holder, coef, credit, i, nl, inst):
    """Fill ``holder.p`` [E] with the fused probability of each expert of layer ``nl`` (module
    doc; ``coef`` [S + 1]) from the first S sources of the tuple ``sources``, and ``credit`` [E] with
    the source credited with it: the highest own probability, ties to the first listed.
    ``holder.raw`` is scratch (the sources' best probability so far)."""
    p, best = holder.p, holder.raw
    E = len(p)
    for e in range(E):
        p[e] = coef[0]
        best[e] = -1.0
    for s in range(len(coef) - 1):
        src = sources[s]
        next_layer_probabilities(src, i, nl, inst)
        w = coef[s + 1]
        for e in range(E):
            ps = src.p[e]
            q = min(max(ps, FUSION_EPS), 1.0 - FUSION_EPS)
            p[e] += w * np.log(q / (1.0 - q))
            if ps > best[e]:
                best[e] = ps
                credit[e] = s
    for e in range(E):
        p[e] = 0.5 * (1.0 + np.tanh(0.5 * p[e]))      # the logistic function, as fused_probability computes it
        best[e] = 0.0


@njit(**HELPER)
def untouched_probability(src, nl):
    """The probability a sparse source gives the experts of layer ``nl`` it did not list."""
    return 0.0 if src.kind == ORACLE else src.calib[nl, 0]


@njit(**HELPER)
def _mapped(calib, b, calibrated):
    """Bin ``b``'s probability, or (not ``calibrated``) the bin itself."""
    return calib[b] if calibrated else float(b)


@njit(**HELPER)
def _bin(r):
    """The calibration bin of raw score ``r`` in [0, 1]."""
    if r <= 0.0:
        return 0
    return 1 + min(int(r * (CALIBRATION_BINS - 1)), CALIBRATION_BINS - 2)


@njit(**HELPER)
def predicts_next(inst, i):
    """Instance ``i + 1`` is the next layer of instance ``i``'s forward."""
    return (i + 1 < len(inst.forward) and inst.forward[i + 1] == inst.forward[i]
            and inst.layer[i + 1] == inst.layer[i] + 1)


@njit(**LOOP)
def scoring_pass(inst, src, n, sum_p, sum_y, sum_sq):
    """Accumulate the reliability sums of the calibrated source over ``inst``."""
    I = len(inst.forward)
    E = len(src.p)
    needed = np.zeros(E, np.bool_)
    for i in range(I):
        li = inst.layer[i]
        observe_union(src, li, inst.forward[i], inst.session[i], inst.sel_e, inst.sel_start[i], inst.sel_start[i + 1])
        if not predicts_next(inst, i):
            continue
        next_layer_probabilities(src, i, li + 1, inst)
        for j in range(inst.sel_start[i + 1], inst.sel_start[i + 2]):
            needed[inst.sel_e[j]] = True
        for e in range(E):
            add_reliability(src.p[e], needed[e], n, sum_p, sum_y, sum_sq)
            needed[e] = False


@njit(**LOOP)
def cells_pass(inst, sources, n, y):
    """Accumulate, per layer and combination of the sources' raw-score bins (``b_0 +
    CALIBRATION_BINS b_1 + ...``), candidates ``n`` and needed ones ``y``: the sources of the
    tuple ``sources`` run over ``inst`` as the replay runs them (raw scores, before calibration;
    one source: the calibration pass of :func:`replay.control.sources.learn_source`)."""
    I = len(inst.forward)
    E = len(sources[0].p)
    needed = np.zeros(E, np.bool_)
    cell = np.zeros(E, np.int64)
    for i in range(I):
        li = inst.layer[i]
        observe_sources(sources, li, inst.forward[i], inst.session[i], inst.sel_e, inst.sel_start[i], inst.sel_start[i + 1])
        if not predicts_next(inst, i):
            continue
        scale = 1
        for s in range(len(sources)):
            src = sources[s]
            next_layer_probabilities(src, i, li + 1, inst, False)
            for e in range(E):
                cell[e] += int(src.p[e]) * scale
            scale *= CALIBRATION_BINS
        for j in range(inst.sel_start[i + 1], inst.sel_start[i + 2]):
            needed[inst.sel_e[j]] = True
        for e in range(E):
            n[li + 1, cell[e]] += 1.0
            if needed[e]:
                y[li + 1, cell[e]] += 1.0
                needed[e] = False
            cell[e] = 0


@njit(**HELPER)
def add_reliability(p, event, n, sum_p, sum_y, sum_sq):
    """Count one candidate of probability ``p`` whose event happened (``event``) or not, in the
    per-bin sums [RELIABILITY_BINS] of candidates, probabilities, events and squared errors."""
    b = min(int(p * RELIABILITY_BINS), RELIABILITY_BINS - 1)
    y = 1.0 if event else 0.0
    n[b] += 1.0
    sum_p[b] += p
    sum_y[b] += y
    sum_sq[b] += (p - y) * (p - y)


@njit(**HELPER)
def most_probable(p, k, out):
    """Fill ``out`` with the (up to) ``k`` experts of highest probability ``p`` > 0, best first
    (ties: lower id first); returns how many."""
    n = 0
    for e in range(len(p)):
        pe = p[e]
        if pe <= 0.0 or (n == k and p[out[n - 1]] >= pe):
            continue
        q = min(n, k - 1)
        while q > 0 and p[out[q - 1]] < pe:
            out[q] = out[q - 1]
            q -= 1
        out[q] = e
        n = min(n + 1, k)
    return n

