"""Prediction sources as probabilities (seed 5.1-5.2): how likely each expert of the next layer is needed.

When layer L of a forward is routed, a source gives every expert ``e`` of layer L+1 a probability
``p_e = Pr(e in U(L+1) | what is known then)``, where ``U(L+1)`` is the batch union layer L+1 will
select. Each source first computes a *raw score* in [0, 1] from what the runtime can know at that
moment, then maps it through a calibration learned on the training sessions (per layer, isotonic
over score bins), so the numbers it hands the controller are frequencies observed on those
sessions, not ranks:

* ``heat``: the fraction of training forwards whose layer L+1 union held ``e`` (marginal heat);
* ``persistence``: previous-token persistence, ``2^-(g - 1)`` when ``e`` was in layer L+1's union
  ``g`` forwards ago in this session (1 for the previous token), 0 when not in the last
  :data:`PERSISTENCE_FORWARDS` forwards;
* ``coupled``: cross-layer coupling, the pair table :func:`replay.model.coupling.coupling_table` learns
  on the training sessions (each expert's 16 strongest successors, as colibrì's ``.coli_pairs``):
  ``sum over a in U(L) of count(L:a -> L+1:e)`` over ``sum over a in U(L)`` of ``a``'s training
  selections, the position-weighted chance ``e`` follows U(L);
* ``session``: session history, ``(c_e + m heat_e) / (n + m)`` with ``c_e`` of the session's ``n``
  earlier forwards holding ``e`` at layer L+1 and a prior of ``m`` = :data:`SESSION_PRIOR_FORWARDS`
  forwards at the training heat;
* ``oracle``: 1 for the experts layer L+1 really selects, 0 otherwise (not calibrated: the bound).

Several sources at once (``prefetch = "coupled+persistence"``) are *fused* into one probability
per candidate (:func:`learn_fused`): ``p = sigmoid(w_0 + sum_s w_s logit(p_s))`` over the
sources' calibrated probabilities ``p_s`` (clipped to [:data:`FUSION_EPS`, 1 - FUSION_EPS]), a
logarithmic opinion pool whose weights are fitted by maximum likelihood on the training
sessions. Each source's probability takes one value per calibration bin, so the fit runs exactly
on the counts of candidates and needed ones per combination of the sources' bins (per layer),
never on the candidates one by one. Each candidate is *credited* to the source whose own
probability is highest (ties: the first listed), for the per-source caps of :mod:`replay.model.admission`.

:func:`score_source` scores a source on held-out sessions: the Brier score, the expected
calibration error over :data:`RELIABILITY_BINS` equal-width probability bins, and the
reliability-plot data (:func:`plot_reliability` draws it). The deadline-aware late-need
probability ``q`` of seed 5.2 is the controller's (:mod:`replay.model.admission`); its scores come
from a replay that observes without loading (admission ``observe``).

The compiled functions here run inside the replay's loop (:mod:`replay.model.instance`) and in the
scoring passes, so the model and the scores use one definition of every source.

References
----------
Seed sections 5.1-5.2 and experiment E1 (Brier score, expected calibration error, reliability
plots on held-out sessions). Isotonic calibration: pool-adjacent-violators (Ayer et al., 1955).
Fusion: the logarithmic opinion pool (Genest and Zidek, "Combining probability distributions: a
critique and an annotated bibliography", Statistical Science 1, 1986), its weights fitted as a
logistic regression by iteratively reweighted least squares (McCullagh and Nelder, "Generalized
Linear Models", 2nd ed., 1989, section 4.4).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
from numba import njit

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.layout import Layout

from replay.model.config import FUSED, MODEL_SOURCES, SOURCE_SEPARATOR
from replay.model.coupling import coupling_table
from replay.model.jit import HELPER, LOOP
from replay.model.routing import RoutingTrace
from replay.model.unions import chunk_instances, whole_forward_blocks

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

SCORE_CHUNK_FORWARDS = 4096
"""Forwards per compiled call of the calibration and scoring passes (memory bound)."""

FUSION_EPS = 1e-4
"""The fusion clips each source's probability to [FUSION_EPS, 1 - FUSION_EPS] before its log-odds."""

FUSION_RIDGE = 1e-6
"""L2 penalty of the fusion's weights (not its intercept), per candidate of the fit: keeps the fit
finite when a source separates the training candidates perfectly."""

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
    """A prediction source learned on training sessions (:func:`learn_source`): the tables the
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
    (:func:`learn_fused`): ``sources`` (:class:`SourceModel`, in the order of the setting) and
    ``coef`` [S + 1], the intercept ``w_0`` then each source's weight ``w_s`` on its log-odds."""

    sources: list
    coef: np.ndarray

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.sources)

    @property
    def name(self) -> str:
        return SOURCE_SEPARATOR.join(self.names)


@dataclass
class Reliability:
    """Held-out scores of a probability source (seed 5.2, E1). Probabilities are per (forward,
    next-layer expert) candidate; the event is "the expert is in that layer's batch union".

    ``candidates``: scored (forward, layer, expert) triples; ``base_rate``: the fraction needed;
    ``brier``: mean squared error of the probabilities (0 is perfect); ``ece``: expected
    calibration error, the candidate-weighted mean |mean probability - frequency| over the
    :data:`RELIABILITY_BINS` bins; per bin [RELIABILITY_BINS]: ``bin_count``, ``bin_probability``
    (mean predicted probability; NaN when empty), ``bin_frequency`` (fraction needed; NaN when
    empty). ``ece`` and ``brier`` are None when nothing was scored.
    """

    source: str
    candidates: int
    base_rate: float | None
    brier: float | None
    ece: float | None
    bin_count: list
    bin_probability: list
    bin_frequency: list


def reliability(source: str, n: np.ndarray, sum_p: np.ndarray, sum_y: np.ndarray, sum_sq: np.ndarray) -> Reliability:
    """A :class:`Reliability` from per-bin sums [RELIABILITY_BINS]: candidates ``n``,
    probabilities ``sum_p``, events ``sum_y`` and squared errors ``sum_sq``."""
    N = float(n.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        mp = np.where(n > 0, sum_p / n, np.nan)
        fy = np.where(n > 0, sum_y / n, np.nan)
    if N == 0:
        return Reliability(source, 0, None, None, None, n.astype(int).tolist(), mp.tolist(), fy.tolist())
    ece = float(np.nansum(n * np.abs(mp - fy)) / N)
    return Reliability(source, int(N), float(sum_y.sum() / N), float(np.sum(sum_sq) / N), ece,
                       n.astype(int).tolist(), mp.tolist(), fy.tolist())


def isotonic_bins(n: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The non-decreasing per-bin frequencies closest (weighted least squares) to ``y / n``:
    pool-adjacent-violators over the non-empty bins; an empty bin takes the value of the nearest
    non-empty bin below it (above it for leading empty bins); all empty gives zeros.

    Parameters
    ----------
    n, y : arrays [B] of candidates and events per bin, in raw-score order.

    Returns
    -------
    array [B] of probabilities in [0, 1].
    """
    full = np.flatnonzero(n > 0)
    out = np.zeros(len(n))
    if not len(full):
        return out
    vals, wts, sizes = [], [], []
    for b in full:
        vals.append(y[b] / n[b])
        wts.append(float(n[b]))
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w
            s = sizes[-2] + sizes[-1]
            del vals[-1], wts[-1], sizes[-1]
            vals[-1], wts[-1], sizes[-1] = v, w, s
    fitted = np.repeat(vals, sizes)
    out[full] = fitted
    for b in range(len(n)):                    # empty bins: the nearest non-empty value below
        if n[b] == 0:
            below = full[full < b]
            out[b] = out[below[-1]] if len(below) else fitted[0]
    return np.clip(out, 0.0, 1.0)


def learn_source(name: str, trace: RoutingTrace, train: np.ndarray, layout: Layout,
                 coupling: tuple | None = None) -> SourceModel:
    """Learn source ``name`` on the forwards of mask ``train`` (training sessions).

    Builds the heat, the selections and (for ``coupled``) the pair table, then replays the
    training forwards through the source to learn its calibration: per layer, the fraction of
    candidates needed in each raw-score bin, made non-decreasing (:func:`isotonic_bins`).
    ``coupling`` may pass an already learned ``(targets, counts)`` table.
    """
    if name not in MODEL_SOURCES or name == "none":
        raise InputError(None, f"unknown prediction source {name!r} (choose {', '.join(MODEL_SOURCES[1:])})")
    if not train.any():
        raise InputError(trace.source or None, f"the {name} source needs training forwards to learn from")
    L, E = len(layout.layers), layout.n_experts
    if name == "coupled":
        targets, counts = coupling if coupling is not None else coupling_table(trace, train, layout)
    else:
        targets, counts = np.full((L, E, 1), -1), np.zeros((L, E, 1))
    heat, selections = np.zeros((L, E)), np.zeros((L, E))
    forwards_seen = np.zeros(L)
    for li, layer in enumerate(layout.layers):
        rows = trace.layer_rows(int(layer), train)
        if not len(rows):
            continue
        ex = trace.experts[rows].astype(np.int64)
        ok = (ex >= 0) & (ex < E)
        selections[li] = np.bincount(ex[ok], minlength=E)[:E]
        fwd = np.repeat(trace.row_forward[rows].astype(np.int64), ex.shape[1])[ok.ravel()]
        pairs = np.unique(fwd * E + ex[ok])            # (forward, expert) union memberships
        heat[li] = np.bincount(pairs % E, minlength=E)[:E]
        forwards_seen[li] = len(np.unique(trace.row_forward[rows]))
    heat /= np.maximum(forwards_seen, 1)[:, None]
    calib = np.tile(np.linspace(0.0, 1.0, CALIBRATION_BINS), (L, 1))     # the oracle's: p = raw
    model = SourceModel(name, np.ascontiguousarray(targets, dtype=np.int32), np.ascontiguousarray(counts, dtype=np.int32),
                        selections, heat, calib)
    if name != "oracle":
        n, y = np.zeros((L, CALIBRATION_BINS)), np.zeros((L, CALIBRATION_BINS))
        src = prediction_source(model, layout)
        for inst in chunk_instances(whole_forward_blocks(trace, SCORE_CHUNK_FORWARDS), train, trace.fwd_session, layout):
            _cells_pass(inst, (src,), n, y)
        model.calib = np.stack([isotonic_bins(n[li], y[li]) for li in range(L)])
    return model


def prediction_source(model: SourceModel | None, layout: Layout, kind: str | None = None) -> PredictionSource:
    """The compiled model's :data:`PredictionSource` for ``model`` (fresh replay state); with no
    model, an empty one of source ``kind`` (``none`` or ``oracle``, which learn nothing; or
    ``fused``: the holder of several sources' fused probability, :func:`fused_probabilities`)."""
    L, E = len(layout.layers), layout.n_experts
    if model is None:
        model = SourceModel(kind or "none", np.full((L, E, 1), -1, dtype=np.int32), np.zeros((L, E, 1), dtype=np.int32),
                            np.zeros((L, E)), np.zeros((L, E)), np.tile(np.linspace(0.0, 1.0, CALIBRATION_BINS), (L, 1)))
    if model.heat.shape != (L, E):
        raise InputError(None, f"the {model.name} source was learned for {model.heat.shape} experts, "
                               f"the layout has {(L, E)}")
    return PredictionSource(
        FUSED if model.name == "fused" else MODEL_SOURCES.index(model.name), np.ascontiguousarray(model.targets, dtype=np.int32),
        np.ascontiguousarray(model.counts, dtype=np.int32), np.ascontiguousarray(model.selections, dtype=np.float64),
        np.ascontiguousarray(model.heat, dtype=np.float64), np.ascontiguousarray(model.calib, dtype=np.float64),
        np.full((L, E), -1, dtype=np.int64), np.full((L, E), -1, dtype=np.int64), np.zeros((L, E)),
        np.zeros(L, dtype=np.int64), np.full(L, -1, dtype=np.int64), np.zeros(E), np.zeros(E), np.zeros(E + 1, dtype=np.int64))


def score_source(model, trace: RoutingTrace, test: np.ndarray, layout: Layout) -> Reliability:
    """Score ``model`` (a :class:`SourceModel`, or a :class:`FusedModel`: :func:`score_fused`) on
    the forwards of mask ``test`` (held-out sessions): every expert of every layer that has a
    previous layer in the same forward is one candidate (:class:`Reliability`)."""
    if isinstance(model, FusedModel):
        return score_fused(model, trace, test, layout)
    src = prediction_source(model, layout)
    n, sp, sy, sq = (np.zeros(RELIABILITY_BINS) for _ in range(4))
    for inst in chunk_instances(whole_forward_blocks(trace, SCORE_CHUNK_FORWARDS), test, trace.fwd_session, layout):
        _scoring_pass(inst, src, n, sp, sy, sq)
    return reliability(model.name, n, sp, sy, sq)


def fit_fusion(p: np.ndarray, n: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The fusion's weights, by maximum likelihood: ``n`` [C] candidates, ``y`` [C] of them
    needed, each with the sources' probabilities ``p`` [C, S] (one row per combination of the
    sources' calibration bins). Returns ``coef`` [S + 1] (intercept first) maximising
    ``sum y log f + (n - y) log(1 - f)``, ``f = sigmoid(coef . [1, logit(p)])``, less the
    :data:`FUSION_RIDGE` penalty; iteratively reweighted least squares (Newton's method), each
    step halved until the penalised likelihood does not fall, from the constant base-rate forecast.
    """
    keep = n > 0
    X = np.column_stack([np.ones(int(keep.sum())), _logit(p[keep])])
    n, y = n[keep].astype(np.float64), y[keep].astype(np.float64)
    S1 = X.shape[1]
    coef = np.zeros(S1)
    if not len(n):
        return coef
    coef[0] = np.log(max(y.sum(), 0.5) / max(n.sum() - y.sum(), 0.5))
    ridge = FUSION_RIDGE * n.sum() * np.eye(S1)
    ridge[0, 0] = 0.0

    def loss(c):                                 # the penalised negative log-likelihood
        z = X @ c
        return float(np.sum(n * np.logaddexp(0.0, z) - y * z) + 0.5 * c @ ridge @ c)

    current = loss(coef)
    for _ in range(100):
        f = 0.5 * (1.0 + np.tanh(0.5 * (X @ coef)))
        w = n * f * (1.0 - f)
        grad = X.T @ (y - n * f) - ridge @ coef
        hess = (X * w[:, None]).T @ X + ridge
        step = np.linalg.lstsq(hess, grad, rcond=None)[0]
        for _ in range(40):
            trial = loss(coef + step)
            if trial <= current:
                break
            step = step / 2
        else:
            break
        coef, current = coef + step, trial
        if np.max(np.abs(step)) < 1e-10:
            break
    return coef


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, FUSION_EPS, 1.0 - FUSION_EPS)
    return np.log(q / (1.0 - q))


def learn_fused(names: tuple[str, ...], trace: RoutingTrace, train: np.ndarray, layout: Layout,
                coupling: tuple | None = None) -> FusedModel:
    """Learn each source of ``names`` on the forwards of mask ``train`` (:func:`learn_source`),
    then the fusion's weights on the same forwards (:func:`fit_fusion` over the counts per
    combination of the sources' calibration bins, every layer pooled)."""
    models = [learn_source(name, trace, train, layout, coupling if name == "coupled" else None) for name in names]
    n, y = _fused_cells(models, trace, train, layout)
    return FusedModel(models, fit_fusion(_cell_probabilities(models, n.shape[1]).reshape(-1, len(models)),
                                         n.ravel(), y.ravel()))


def _fused_cells(models: list, trace: RoutingTrace, mask: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Candidates and needed ones [L, CALIBRATION_BINS ** S] per layer and combination of the
    sources' bins (``b_0 + CALIBRATION_BINS b_1 + ...``), over the forwards of ``mask``."""
    L = len(layout.layers)
    n, y = np.zeros((L, CALIBRATION_BINS ** len(models))), np.zeros((L, CALIBRATION_BINS ** len(models)))
    srcs = tuple(prediction_source(m, layout) for m in models)
    for inst in chunk_instances(whole_forward_blocks(trace, SCORE_CHUNK_FORWARDS), mask, trace.fwd_session, layout):
        _cells_pass(inst, srcs, n, y)
    return n, y


def _cell_probabilities(models: list, n_cells: int) -> np.ndarray:
    """[L, cells, S]: each source's calibrated probability in each cell of :func:`_fused_cells`."""
    S = len(models)
    cell = np.arange(n_cells)
    bins = [(cell // CALIBRATION_BINS ** s) % CALIBRATION_BINS for s in range(S)]
    return np.stack([m.calib[:, bins[s]] for s, m in enumerate(models)], axis=-1)


def fused_probability(coef: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The fused probability of candidates whose sources give ``p`` [..., S]."""
    return 0.5 * (1.0 + np.tanh(0.5 * (coef[0] + _logit(p) @ coef[1:])))


def score_fused(model: FusedModel, trace: RoutingTrace, test: np.ndarray, layout: Layout) -> Reliability:
    """Score the fused probability of ``model`` on the forwards of mask ``test`` (held-out
    sessions), with the same candidates, bins and figures as :func:`score_source`."""
    n, y = _fused_cells(model.sources, trace, test, layout)
    f = fused_probability(model.coef, _cell_probabilities(model.sources, n.shape[1]))
    return reliability_of_cells(model.name, f.ravel(), n.ravel(), y.ravel())


def reliability_of_cells(source: str, p: np.ndarray, n: np.ndarray, y: np.ndarray) -> Reliability:
    """The :class:`Reliability` of candidates grouped in cells: ``n`` [C] candidates of
    probability ``p`` [C], ``y`` [C] of them needed."""
    b = np.minimum((p * RELIABILITY_BINS).astype(np.int64), RELIABILITY_BINS - 1)
    return reliability(source, np.bincount(b, n, RELIABILITY_BINS), np.bincount(b, n * p, RELIABILITY_BINS),
                       np.bincount(b, y, RELIABILITY_BINS), np.bincount(b, n * p * p - 2 * p * y + y, RELIABILITY_BINS))


def plot_reliability(scores: list[Reliability], path) -> None:
    """Write a reliability plot of ``scores`` (one line per source) to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfectly calibrated")
    for r in scores:
        mp, fy = np.array(r.bin_probability, dtype=float), np.array(r.bin_frequency, dtype=float)
        ok = np.isfinite(mp)
        label = (f"{r.source} (Brier {r.brier:.4f}, ECE {r.ece:.4f})" if r.brier is not None else f"{r.source} (nothing scored)")
        ax.plot(mp[ok], fy[ok], marker="o", label=label)
    ax.set_xlabel("predicted probability (bin mean)")
    ax.set_ylabel("fraction of candidates needed by the next layer")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("Reliability on held-out sessions")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    with atomic_output(path) as fh:
        fig.savefig(fh, dpi=120, format="png")
    plt.close(fig)


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
    doc; ``coef`` [S + 1]) from the sources of the tuple ``sources``, and ``credit`` [E] with
    the source credited with it: the highest own probability, ties to the first listed.
    ``holder.raw`` is scratch (the sources' best probability so far)."""
    p, best = holder.p, holder.raw
    E = len(p)
    for e in range(E):
        p[e] = coef[0]
        best[e] = -1.0
    for s in range(len(sources)):
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
def _scoring_pass(inst, src, n, sum_p, sum_y, sum_sq):
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
def _cells_pass(inst, sources, n, y):
    """Accumulate, per layer and combination of the sources' raw-score bins (``b_0 +
    CALIBRATION_BINS b_1 + ...``), candidates ``n`` and needed ones ``y``: the sources of the
    tuple ``sources`` run over ``inst`` as the replay runs them (raw scores, before calibration;
    one source: the calibration pass of :func:`learn_source`)."""
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
