"""The confidence interval record: an estimate with the low and high ends of its interval.

Every interval relayout reports (a gate's saving, a placement arm's stall, a hypothesis's paired
difference, a repetition mean) is an :class:`Interval`, in the unit of the quantity it bounds
(seconds per committed token unless the caller says otherwise). What was resampled to get it
(``unit``, ``n_units``) and by which method (``method``) are recorded when known, and left out of
its JSON otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from containers import records


@dataclass(frozen=True)
class Interval:
    """An estimate and its two-sided interval ``[low, high]``, with what it was resampled over.

    Parameters
    ----------
    estimate, low, high : the point estimate and the interval's ends, in one unit.
    unit : what one resampled unit is (``"session"``, ``"repetition"``, ...), or None.
    n_units : how many units the interval rests on, or None.
    method : how the units were resampled (``"session"``, ``"moving-block"``), or None.

    >>> Interval(1.0, 0.5, 1.5).to_json()
    {'estimate': 1.0, 'low': 0.5, 'high': 1.5}
    >>> Interval(1.0, 0.5, 1.5, "session", 6).divided_by(2.0).to_json()
    {'estimate': 0.5, 'low': 0.25, 'high': 0.75}
    """

    estimate: float
    low: float
    high: float
    unit: str | None = records.omitted_when_none()
    n_units: int | None = records.omitted_when_none()
    method: str | None = records.omitted_when_none()

    def divided_by(self, d: float) -> "Interval":
        """The bare interval (estimate, low, high) divided by ``d`` (e.g. a saving as a share of TPOT)."""
        return Interval(self.estimate / d, self.low / d, self.high / d)

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "Interval":
        return records.from_json(cls, obj, where, "interval")


__all__ = ["Interval"]
