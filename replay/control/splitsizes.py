"""Sizes of a vertical split's segments and resident tops chosen by replayed wait (pure numpy).

A SwiGLU expert splits exactly along its FFN dimension (``docs/SPLIT_SEGMENTS.md``): the top
segment is rows ``[0, T)`` of gate and up and columns ``[0, T)`` of down, with ``T`` rounded to
whole quantisation groups (group-G formats group the input dimension, which for down is the FFN
dimension) and to whole bytes of packed weights. No compiled code, so planning and the command
line can import it without the replay model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from containers.errors import InputError
from containers.geometry import ExpertFormat

from replay.model.config import greedy_by_value


@dataclass(frozen=True)
class SegmentSizes:
    """Bytes of the top and bottom segments of one expert (weights plus scales)."""

    top_rows: int
    top_bytes: int
    bottom_bytes: int


def segment_sizes(fmt: ExpertFormat, hidden: int, ffn: int, ratio: float) -> SegmentSizes:
    """Exact segment sizes for split ``ratio`` of an expert of ``fmt`` (rows rounded to groups).

    Parameters
    ----------
    fmt : the expert's quantisation format.
    hidden, ffn : the model's hidden size and the expert's FFN rows.
    ratio : the top segment's share of the FFN, in (0, 1).

    Returns
    -------
    :class:`SegmentSizes`: the top's FFN rows and both segments' bytes (weights plus scales).
    """
    if not 0 < ratio < 1:
        raise InputError(None, f"split ratio must be between 0 and 1 (got {ratio})")
    step = fmt.group or (8 // math.gcd(8, fmt.bits))
    rows = max(step, min(ffn - step, int(round(ratio * ffn / step)) * step))

    def part(r: int) -> int:
        gate_up = 2 * (fmt.weight_bytes(r, hidden) + 4 * fmt.scale_count(r, hidden))
        down = fmt.weight_bytes(hidden, r) + 4 * fmt.scale_count(hidden, r)
        return gate_up + down

    return SegmentSizes(rows, part(rows), part(ffn - rows))


def tops_by_wait(expert_wait: np.ndarray, top_fraction: np.ndarray, top_bytes: np.ndarray, budget: float) -> np.ndarray:
    """Resident tops by replayed wait avoided per byte, best first within ``budget`` bytes.

    Parameters
    ----------
    expert_wait : [L, E] seconds the compute thread waited right before each expert's matmul.
    top_fraction : [L] the top segment's share of the FFN.
    top_bytes : [L] one top segment's bytes.
    budget : bytes for resident tops.

    Returns
    -------
    Boolean [L, E]: True where the expert's top stays resident.

    >>> tops_by_wait(np.array([[3.0, 1.0], [2.0, 0.0]]), np.array([0.5, 0.5]), np.array([10.0, 10.0]), 20)
    array([[ True, False],
           [ True, False]])
    """
    return greedy_by_value(expert_wait * top_fraction[:, None] / np.maximum(top_bytes, 1)[:, None], top_bytes, budget)


__all__ = ["SegmentSizes", "segment_sizes", "tops_by_wait"]
