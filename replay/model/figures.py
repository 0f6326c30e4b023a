"""The figures a replay reports for one layout: typed records, no compiled code, so a gate record
can be read without loading the model. Seconds are per committed token unless a name says
otherwise; bytes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefetchMetrics:
    """A modelled prefetch source's figures (bytes per committed token, seconds)."""

    prefetched_bytes_per_token: float
    timely_required_byte_recall: float | None
    unused_prefetched_bytes_per_token: float
    mean_lead_slack_s: float | None


@dataclass(frozen=True)
class Quantiles:
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True)
class LayoutMetrics:
    """One layout's replayed figures (made by :func:`replay.model.metrics.summarize`).

    ``reads_per_token`` and ``read_bytes_per_token`` count every pread the runtime issues,
    page-cache hits included; ``drive_requests_per_token`` counts what reaches each drive.
    """

    committed_tokens: int
    steps: int
    evaluated_positions: int
    stall_per_token_s: float
    compute_per_token_s: float
    other_per_token_s: float
    tpot_s: float
    oracle_stall_per_token_s: float
    step_stall_s: Quantiles
    reads_per_token: float
    read_bytes_per_token: float
    union_bytes_per_token: float
    ram_hit_rate: float
    drive_utilisation: list[float]
    drive_queue_depth: list[float]
    drive_requests_per_token: list[float]
    prefetch: PrefetchMetrics | None
