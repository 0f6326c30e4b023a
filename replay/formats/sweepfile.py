"""The sweep table (``relayout replay --sweep -o sweep.json``): its typed records.

:func:`replay.evaluation.gate.sweep` builds one :class:`SweepCell` per RAM budget x workers x
coalescing; ``relayout replay --sweep`` writes them inside a :class:`SweepTable` and renders them.
Stall and TPOT are in seconds per committed token; RAM in GB (10^9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from containers import records

from replay.formats.interval import Interval

SWEEP_FORMAT = "relayout.sweep"


@dataclass(frozen=True)
class SweepCell:
    """One cell of the regime map: the gate at one RAM budget, worker count and coalescing.

    Parameters
    ----------
    ram_gb : the RAM budget, GB.
    workers, coalesce : the reader's worker count and whether adjacent reads coalesce.
    verdict : the cell's gate verdict (``pass``, ``fail``, ``insufficient``).
    baseline_stall_s, plan_stall_s, oracle_stall_s : predicted stall per committed token, s.
    saving : the stall saved per committed token, s, with its 95% interval.
    saving_fraction_of_tpot : the saving as a share of the baseline's TPOT.
    tpot_s : the baseline's TPOT, s.
    p_below_threshold : one-sided bootstrap p-value of "saving below the threshold".
    sufficient : whether the cell's evidence sufficed for a verdict.
    pins : where the pin set both layouts were replayed with came from.
    holm_significant : whether a pass holds after Holm's correction over the sufficient cells
        (None where the cell's evidence did not suffice).
    """

    ram_gb: float
    workers: int
    coalesce: bool
    verdict: str
    baseline_stall_s: float
    plan_stall_s: float
    oracle_stall_s: float
    saving: Interval
    saving_fraction_of_tpot: Interval
    tpot_s: float
    p_below_threshold: float
    sufficient: bool
    pins: str
    holm_significant: bool | None

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "SweepCell":
        return records.from_json(cls, obj, where, "sweep cell")


@dataclass(frozen=True)
class SweepTable:
    """``sweep.json``: the plan's digest, the device profile's name and every cell, in grid order."""

    format: str
    plan: str
    device: str
    cells: list[SweepCell]

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "SweepTable":
        return records.from_json(cls, obj, where, "sweep table")


__all__ = ["SWEEP_FORMAT", "SweepCell", "SweepTable"]
