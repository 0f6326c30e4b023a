"""Paired bootstrap intervals for differences of ratio estimators, and intervals over repetitions.

Two layouts (or repetitions of two measured runs) on the same units give per-unit totals. (The
replay gate's units, and its block bootstrap, are in :mod:`replay.evaluation.evidence`.) The saving ``dS = (sum W_base - sum W_new) / sum A``
is re-estimated on resampled units (with replacement, the same units for both layouts, so the
pairing is kept); the 2.5th and 97.5th percentiles give the 95% interval.

Measured runs repeated on a disk whose speed drifts between runs have a second source of
variation that no resampling of steps within runs sees: :func:`repetition_interval` takes each
repetition as one unit (Student's t over the repetitions' values).

One measurement judged by many intervals: each 95% interval misses its true value one time in
twenty, so of many judgements some miss by chance alone. :func:`family_level` widens each so
that together they miss with at most the family's error (Bonferroni), and :func:`chance_misses`
says how many 95% intervals a correct prediction may fall outside of by chance.
"""

from __future__ import annotations

import numpy as np

from replay.formats.interval import Interval

RESAMPLES = 4000
"""Bootstrap resamples of an interval, unless a caller says otherwise."""
LEVEL = 0.95
"""Two-sided coverage of an interval, unless a caller says otherwise."""


def paired_saving(base: np.ndarray, new: np.ndarray, tokens: np.ndarray, unit: str, resamples: int = RESAMPLES,
                  seed: int = 0) -> Interval:
    """95% bootstrap interval of ``(sum base - sum new) / sum tokens`` over paired units.

    Parameters
    ----------
    base, new : per-unit totals of the two layouts (e.g. seconds of stall), paired by index.
    tokens : per-unit committed tokens.
    unit : what one unit is, for the record.
    resamples, seed : the bootstrap's resample count and seed (deterministic given both).

    Returns
    -------
    :class:`~replay.formats.interval.Interval` of the saving per token, resampled over the units
    (a single unit gives a zero-width interval at the estimate).

    >>> paired_saving([2.0, 4.0], [1.0, 3.0], [1.0, 1.0], "session").estimate
    1.0
    """
    base, new, tokens = (np.asarray(x, dtype=np.float64) for x in (base, new, tokens))
    n = len(base)
    est = (base.sum() - new.sum()) / tokens.sum()
    if n < 2:
        return Interval(est, est, est, unit, n)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    d = (base[idx].sum(axis=1) - new[idx].sum(axis=1)) / np.maximum(tokens[idx].sum(axis=1), 1e-12)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return Interval(float(est), float(lo), float(hi), unit, n)


def repetition_interval(values, unit: str = "repetition", level: float = LEVEL) -> Interval:
    """Mean of per-repetition ``values`` and its ``level`` Student-t interval, each repetition one unit.

    Parameters
    ----------
    values : per-repetition figures in any one unit (e.g. S or a saving, seconds per token).
    unit : what one value is, for the record.
    level : two-sided coverage.

    Returns
    -------
    :class:`Interval` ``mean +/- t(1 - (1 - level) / 2, n - 1) * sd / sqrt(n)`` (``sd`` with
    ``n - 1`` degrees of freedom); a single value gives a zero-width interval at it.

    References
    ----------
    Student (1908), "The probable error of a mean", Biometrika 6(1).

    >>> iv = repetition_interval([1.0, 2.0, 3.0])
    >>> iv.estimate, round(iv.low, 3), round(iv.high, 3), iv.n_units
    (2.0, -0.484, 4.484, 3)
    """
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("an interval needs at least one repetition")
    mean = float(x.mean())
    if n < 2:
        return Interval(mean, mean, mean, unit, n)
    half = float(student_t_quantile(1 - (1 - level) / 2, n) * x.std(ddof=1) / np.sqrt(n))
    return Interval(mean, mean - half, mean + half, unit, n)


def family_level(judgements: int, level: float = LEVEL) -> float:
    """The coverage each of ``judgements`` intervals needs for all of them to cover their true
    values with probability at least ``level`` (Bonferroni): ``1 - (1 - level) / judgements``.

    Parameters
    ----------
    judgements : how many intervals one verdict rests on (>= 1).
    level : the family's two-sided coverage.

    Returns
    -------
    The per-interval coverage, a fraction.

    >>> round(family_level(5), 6)
    0.99

    References
    ----------
    Dunn, O. J. (1961), "Multiple comparisons among means", JASA 56(293).
    """
    if judgements < 1:
        raise ValueError("a family needs at least one judgement")
    return 1 - (1 - level) / judgements


def chance_misses(judgements: int, miss: float = 0.05, level: float = LEVEL) -> int:
    """How many of ``judgements`` intervals, each missing its true value with probability
    ``miss``, may miss by chance: the smallest ``b`` with ``P(X > b) <= 1 - level`` for ``X``
    binomial(``judgements``, ``miss``) (intervals taken as independent; those of one measurement
    sharing a baseline are not quite, so this is a guide, not an exact test).

    Parameters
    ----------
    judgements : how many intervals.
    miss : each interval's probability of missing its true value.
    level : the coverage of the bound on the count.

    Returns
    -------
    The number of misses chance alone explains.

    >>> chance_misses(24), chance_misses(12), chance_misses(1)
    (3, 2, 0)

    References
    ----------
    Feller, W. (1968), An Introduction to Probability Theory and Its Applications I, ch. VI.
    """
    from scipy.stats import binom

    b = 0
    while binom.sf(b, judgements, miss) > 1 - level:
        b += 1
    return b


def student_t_quantile(p: float, repetitions: int) -> float:
    """Student's t quantile ``p`` with ``repetitions - 1`` degrees of freedom (>= 2 repetitions):
    how many standard errors of the mean a two-sided ``2p - 1`` interval reaches either side.

    >>> round(student_t_quantile(0.975, 4), 3)
    3.182
    """
    from scipy.stats import t as student_t     # scipy.stats takes a while to import: only when asked

    return float(student_t.ppf(p, repetitions - 1))


def family_widening(level: float, repetitions: int) -> float:
    """How many times as wide a ``level`` Student-t interval over ``repetitions`` values is as the
    95% one (>= 2 repetitions): ``t(1 - (1 - level) / 2, n - 1) / t(0.975, n - 1)``.

    >>> round(family_widening(1 - 0.05 / 42, 4), 1)
    3.8
    """
    return student_t_quantile(1 - (1 - level) / 2, repetitions) / student_t_quantile(0.975, repetitions)
