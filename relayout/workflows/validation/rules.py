"""The judging rules of a validation: thresholds, intervals over repetitions, and how a prediction stands.

A cell's predicted S is judged against its measured mean and family interval
(:func:`cell_agreement`); a predicted saving against its measured one (:func:`judge_saving`):
``"agrees"``, ``"unresolved"``, ``"within placement"`` or ``"disagrees"``. The family interval is
the one each of a run's judgements needs for all of them to hold together 95% of the time
(Bonferroni, :func:`replay.evaluation.stats.family_level`). The placement control (two
byte-identical copies of stock measured side by side) bounds what placement alone does to S
(:func:`placement_difference`, :func:`placement_bound`). All pure functions; S and savings in
seconds per committed token (``_s``) unless a function says otherwise.
"""

from __future__ import annotations

import numpy as np

from replay.evaluation.evidence import DEFAULT_THRESHOLD
from replay.evaluation.stats import family_level, repetition_interval

GATE_THRESHOLD = DEFAULT_THRESHOLD
"""The gate's threshold: the saving's interval low end must reach this fraction of the baseline TPOT."""
TOLERANCE = 0.20
"""The model holds when every cell's predicted/measured S is within this fraction of 1."""
PREFETCH_TOLERANCE = 0.30
"""A predicted prefetch saving agrees when within this fraction of the measured one (or inside its interval)."""
READS_AGREE = 0.10
"""The model's and the harness's demand drive reads per token agree within this fraction."""
DIAGNOSES = ("at_run_speed", "at_harness_compute", "less_page_cache_waits")
"""The diagnoses of a saving (keys of a comparison): the measured saving with each run brought to
the model's conditions, judged like the saving itself."""
HARNESS_EXCESS = 0.10
"""The harness's compute beyond the model's (a fraction of it) past which the verdict line says
whether the harness's own work explains the gap."""
FIRST_READ_SLOW = 0.75
"""A container whose first read runs below this fraction of the fastest one's rate is named in the summary."""
CLOSE_BAND = 0.10
"""The summary also counts the cells whose predicted/measured S is within this fraction of 1 (closer than the verdict's :data:`TOLERANCE`)."""
VERDICT_REPS = 4
"""Repetitions per cell a verdict needs: with fewer, unless a measurement rules the model out even
so, the verdict is ``"insufficient"`` (over 2, a 95% interval is 12.7 standard errors either side,
and the family interval 42 times that at 42 judgements)."""


def measured_vs_predicted(estimate: float, low: float, high: float, predicted: float) -> str:
    """In words: does a measured saving (estimate and 95% interval) agree with a predicted one? Same units.

    >>> measured_vs_predicted(2.0, 1.0, 3.0, 2.5)
    'measurement agrees with the prediction: the predicted saving lies inside the measured interval'
    >>> measured_vs_predicted(2.0, 1.0, 3.0, -0.5)[:39]
    'measurement CONTRADICTS the prediction:'
    """
    if low > 0 and predicted <= 0 or high < 0 and predicted >= 0 or (low <= 0 <= high and abs(predicted) > high - low):
        return ("measurement CONTRADICTS the prediction: measured saving " +
                ("is positive" if low > 0 else "is negative" if high < 0 else "is indistinguishable from zero") +
                f", predicted {predicted:+.3f}")
    if low <= predicted <= high:
        return "measurement agrees with the prediction: the predicted saving lies inside the measured interval"
    return (f"measurement and prediction agree in sign but not in size: predicted {predicted:+.3f}, measured "
            f"[{low:+.3f}, {high:+.3f}]")


def evidence_interval(ev) -> dict:
    """A predicted saving's bootstrap interval (:class:`replay.evaluation.evidence.Evidence`) as the record holds it (s/token)."""
    est, low, high = ev.interval()
    return {"estimate_s": est, "low_s": low, "high_s": high, "method": ev.method, "block_steps": ev.block_steps,
            "units": len(ev.base), "blocks": ev.n_blocks, "seed": ev.seed, "resamples": ev.resamples}


def over_repetitions(values: list[float], judgements: int | None = None) -> dict:
    """A measured figure's mean and 95% interval with each repetition one unit (s/token); with
    ``judgements``, also its ``family`` interval: at the coverage each of the run's judgements
    needs for all of them to hold together 95% of the time (:func:`replay.evaluation.stats.family_level`),
    the one a prediction must miss to be ruled out."""
    iv = repetition_interval(values)
    out = {"estimate_s": iv.estimate, "low_s": iv.low, "high_s": iv.high, "method": "repetitions (Student t)",
           "units": iv.n_units}
    if judgements is not None:
        level = family_level(judgements)
        fam = repetition_interval(values, level=level)
        out["family"] = {"level": level, "judgements": judgements, "low_s": fam.low, "high_s": fam.high}
    return out


def cell_agreement(predicted: float, mean: float, low: float, high: float, tolerance: float = TOLERANCE) -> str:
    """``"agrees"`` when predicted S is within ``tolerance`` of the measured mean; ``"disagrees"``
    when it lies outside the measured interval [``low``, ``high``] widened by ``tolerance`` (no S
    the measurement admits is within tolerance of the prediction; ``validate`` passes the cell's
    family interval, :func:`over_repetitions`); else ``"unresolved"`` (the repetitions scatter
    too widely to tell). Any one unit (s/token).

    >>> cell_agreement(1.15, 1.0, 0.99, 1.01), cell_agreement(1.3, 1.0, 0.99, 1.01), cell_agreement(1.3, 1.0, 0.5, 1.5)
    ('agrees', 'disagrees', 'unresolved')
    """
    if mean > 0 and abs(predicted / mean - 1) <= tolerance:
        return "agrees"
    if predicted > high * (1 + tolerance) or predicted < max(low, 0.0) * (1 - tolerance):
        return "disagrees"
    return "unresolved"


def resolves_tolerance(m: dict, tolerance: float) -> bool:
    """Whether a measured saving (``m``: estimate and 95% interval, s/token) is precise enough to
    judge a prediction to within ``tolerance`` of it: the interval's half-width is at most that
    fraction of the estimate's size. Where it is not, even a perfect prediction lands outside
    the tolerance of the measured estimate about as often as inside."""
    return (m["high_s"] - m["low_s"]) / 2 <= tolerance * abs(m["estimate_s"])


def judge_saving(predicted_s: float, m: dict, tolerance: float | None = None, placement_s: float | None = None) -> dict:
    """How a predicted saving (s/token) stands against a measured one (``m``: estimate, 95%
    interval and, from :func:`.record.judge_record`, the ``family`` interval, :func:`over_repetitions`).
    ``agreement``, from nearest to farthest:

    * ``"agrees"``: the prediction lies inside the measured 95% interval (or, with ``tolerance``,
      within that fraction of the measured estimate);
    * ``"unresolved"``: outside it, but inside the family interval (with ``tolerance``, widened
      so that it holds every prediction within that fraction of a saving the family interval
      admits): one 95% interval in twenty misses by chance, and a run judges many;
    * ``"within placement"`` (with ``placement_s``, for a saving between two containers: how far
      the placement control admits that where the disk put two byte-identical files moves S,
      :func:`placement_bound`): beyond that, but inside it widened by ``placement_s`` on each
      side: the measurement cannot tell the difference from placement;
    * ``"disagrees"``: beyond all of these: the measurement rules the prediction out. A
      prediction of the other sign than the measured interval is ruled out only so: a 95%
      interval clear of zero is itself one of the judgements chance may miss.
    """
    low, high = m["low_s"], m["high_s"]
    fam = m.get("family", {"low_s": low, "high_s": high, "level": 0.95, "judgements": 1})
    tol = tolerance or 0.0
    flo, fhi = fam["low_s"] - tol * abs(fam["low_s"]), fam["high_s"] + tol * abs(fam["high_s"])
    b = placement_s or 0.0
    excludes = low > 0 or high < 0
    sign = bool(np.sign(predicted_s) == np.sign(m["estimate_s"])) if excludes else None
    inside = bool(low <= predicted_s <= high)
    close = tolerance is not None and abs(predicted_s - m["estimate_s"]) <= tolerance * abs(m["estimate_s"])
    words = measured_vs_predicted(m["estimate_s"] * 1e3, low * 1e3, high * 1e3, predicted_s * 1e3)
    said = (f"measured {m['estimate_s'] * 1e3:+.3f} [{low * 1e3:+.3f}, {high * 1e3:+.3f}], predicted "
            f"{predicted_s * 1e3:+.3f}: outside the 95% interval but ")
    family = (f"the {fam['level']:.2%} one [{fam['low_s'] * 1e3:+.3f}, {fam['high_s'] * 1e3:+.3f}] that each of this "
              f"run's {fam['judgements']} judgements needs for all to hold together 95% of the time"
              + (f" (widened by the +/-{tol:.0%} tolerance)" if tol else ""))
    if inside or close:
        agreement = "agrees"
    elif flo <= predicted_s <= fhi:
        agreement = "unresolved"
        words = said + "inside " + family + ": as often as chance misses, so neither confirmed nor ruled out"
    elif b > 0 and flo - b <= predicted_s <= fhi + b:
        agreement = "within placement"
        words = (said + "also beyond " + family + f", by no more than two byte-identical copies of stock differ (the "
                 f"placement control: up to {b * 1e3:.3f}): this measurement neither confirms nor rules out the prediction")
    else:
        agreement = "disagrees"
    out = {"predicted_inside_measured": inside, "measured_excludes_zero": bool(excludes), "sign_agrees": sign,
           "agreement": agreement, "words": words + " (ms/token)"}
    if tolerance is not None:
        out["within_tolerance"] = bool(close)
    if placement_s is not None:
        out["placement_bound_s"] = placement_s
    return out



def placement_difference(ram_fraction: float, stock_s: list[float], copy_s: list[float]) -> dict:
    """The placement control of one RAM budget: S of stock and of its second copy per repetition
    (s/token, measured in the same lockstep block), and their difference ``stock - copy`` over the
    repetitions with its 95% interval. The two hold the same bytes in the same order, so the
    difference is what where the disk put a file does to S; a layout saving within it is not
    separable from placement."""
    diff = [a - b for a, b in zip(stock_s, copy_s)]
    return {"ram_fraction": ram_fraction, "stock_s": list(stock_s), "copy_s": list(copy_s),
            "difference": {**over_repetitions(diff), "repetitions": diff}}


def placement_bound(blocks: list[dict]) -> float | None:
    """How far the placement control admits that placement alone moves S (s/token): the largest
    end, in size, of the 95% intervals of its blocks' differences (:func:`placement_difference`);
    None without a block."""
    if not blocks:
        return None
    return max(max(abs(b["difference"]["low_s"]), abs(b["difference"]["high_s"])) for b in blocks)


def in_band(ratios: list[float]) -> int:
    """How many predicted/measured ratios lie within :data:`CLOSE_BAND` of 1."""
    return sum(abs(r - 1) <= CLOSE_BAND for r in ratios)

