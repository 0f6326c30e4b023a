"""Learning and scoring the prediction sources on routing traces (pure Python around compiled passes).

:func:`learn_source` learns one source on the training sessions (its heat, selections, pair table
and calibration: isotonic over raw-score bins), :func:`learn_fused` several and the weights of
their logarithmic opinion pool (:func:`fit_fusion`, maximum likelihood by iteratively reweighted
least squares); :func:`score_source` scores a learned source on held-out sessions (Brier score,
expected calibration error, reliability data: :class:`Reliability`, drawn by
:func:`plot_reliability`). The sources themselves, as the compiled model runs them, are
:mod:`replay.model.predictors`; docs/MODEL.md defines them and the fusion. References:
isotonic calibration by pool-adjacent-violators (Ayer et al., 1955); the logarithmic opinion pool
(Genest and Zidek, Statistical Science 1, 1986), fitted as a logistic regression (McCullagh and
Nelder, "Generalized Linear Models", 2nd ed., 1989, section 4.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.layout import Layout

from replay.model.routing import RoutingTrace
from replay.model.config import MODEL_SOURCES
from replay.model.coupling import coupling_table
from replay.model.predictors import (
    CALIBRATION_BINS,
    FUSION_EPS,
    RELIABILITY_BINS,
    FusedModel,
    SourceModel,
    cells_pass,
    prediction_source,
    scoring_pass,
)
from replay.model.unions import chunk_instances, whole_forward_blocks

SCORE_CHUNK_FORWARDS = 4096
"""Forwards per compiled call of the calibration and scoring passes (memory bound)."""

FUSION_RIDGE = 1e-6
"""L2 penalty of the fusion's weights (not its intercept), per candidate of the fit: keeps the fit
finite when a source separates the training candidates perfectly."""


@dataclass
class Reliability:
    """Held-out scores of a probability source . Probabilities are per (forward,
    next-layer expert) candidate; the event is "the expert is in that layer's batch union".

    ``candidates``: scored (forward, layer, expert) triples; ``base_rate``: the fraction needed;
    ``brier``: mean squared error of the probabilities (0 is perfect); ``ece``: expected
    calibration error, the candidate-weighted mean |mean probability - frequency| over the
    :data:`replay.model.predictors.RELIABILITY_BINS` bins; per bin [RELIABILITY_BINS]: ``bin_count``, ``bin_probability``
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

    Examples
    --------
    >>> isotonic_bins(np.array([2, 2, 0, 2]), np.array([0, 2, 0, 1])).tolist()
    [0.0, 0.75, 0.75, 0.75]
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
            cells_pass(inst, (src,), n, y)
        model.calib = np.stack([isotonic_bins(n[li], y[li]) for li in range(L)])
    return model


def score_source(model, trace: RoutingTrace, test: np.ndarray, layout: Layout) -> Reliability:
    """Score ``model`` (a :class:`replay.model.predictors.SourceModel`, or a :class:`replay.model.predictors.FusedModel`: :func:`score_fused`) on
    the forwards of mask ``test`` (held-out sessions): every expert of every layer that has a
    previous layer in the same forward is one candidate (:class:`Reliability`)."""
    if isinstance(model, FusedModel):
        return score_fused(model, trace, test, layout)
    src = prediction_source(model, layout)
    n, sp, sy, sq = (np.zeros(RELIABILITY_BINS) for _ in range(4))
    for inst in chunk_instances(whole_forward_blocks(trace, SCORE_CHUNK_FORWARDS), test, trace.fwd_session, layout):
        scoring_pass(inst, src, n, sp, sy, sq)
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
        cells_pass(inst, srcs, n, y)
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

