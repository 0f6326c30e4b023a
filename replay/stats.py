"""Paired bootstrap intervals for differences of ratio estimators, and intervals over repetitions.

Two layouts (or repetitions of two measured runs) on the same units give per-unit totals. (The
replay gate's units, and its block bootstrap, are in :mod:`replay.evidence`.) The saving ``dS = (sum W_base - sum W_new) / sum A``
is re-estimated on resampled units (with replacement, the same units for both layouts, so the
pairing is kept); the 2.5th and 97.5th percentiles give the 95% interval.

Measured runs repeated on a disk whose speed drifts between runs have a second source of
variation that no resampling of steps within runs sees: :func:`repetition_interval` takes each
repetition as one unit (Student's t over the repetitions' values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    unit: str
    n_units: int

    def to_json(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "unit": self.unit, "n_units": self.n_units}


def paired_saving(base: np.ndarray, new: np.ndarray, tokens: np.ndarray, unit: str, resamples: int = 4000,
                  seed: int = 0) -> Interval:
    """95% bootstrap interval of (sum base - sum new) / sum tokens over paired units."""
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


def repetition_interval(values, unit: str = "repetition", level: float = 0.95) -> Interval:
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
    """
    from scipy.stats import t as student_t     # scipy.stats takes a while to import: only when asked

    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("an interval needs at least one repetition")
    mean = float(x.mean())
    if n < 2:
        return Interval(mean, mean, mean, unit, n)
    half = float(student_t.ppf(1 - (1 - level) / 2, n - 1) * x.std(ddof=1) / np.sqrt(n))
    return Interval(mean, mean - half, mean + half, unit, n)
