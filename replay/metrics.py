"""Stall metrics (seed section 4): S, TPOT = C + S + O, step-stall tails, traffic, cache, drives.

``S = total stall / committed tokens``: stall of rejected speculative positions is charged in the
numerator, only committed tokens count in the denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engine import DeviceUsage, InstanceResult
from .gatefile import LayoutMetrics, PrefetchMetrics, Quantiles
from .trace import RoutingTrace


@dataclass
class StepTable:
    """Per evaluated forward (step), arrays [N]. Seconds and bytes."""

    forward: np.ndarray
    session: np.ndarray
    stall: np.ndarray
    oracle_stall: np.ndarray
    compute: np.ndarray
    committed: np.ndarray
    evaluated: np.ndarray
    union_bytes: np.ndarray
    reads: np.ndarray
    read_bytes: np.ndarray
    hits: np.ndarray
    lookups: np.ndarray
    prefetch: dict | None = None   # per step sums of the prefetch metrics, when a source runs


def step_table(trace: RoutingTrace, forwards: np.ndarray, inst: InstanceResult) -> StepTable:
    fw = np.flatnonzero(forwards)
    index = np.full(trace.n_forwards, -1)
    index[fw] = np.arange(len(fw))
    i = index[inst.forward]

    def per_step(x):
        return np.bincount(i, weights=x, minlength=len(fw))

    return StepTable(
        forward=fw, session=trace.fwd_session[fw].astype(np.int64),
        stall=per_step(inst.stall), oracle_stall=per_step(inst.oracle_stall), compute=per_step(inst.compute),
        committed=trace.fwd_committed[fw].astype(np.float64), evaluated=trace.fwd_evaluated[fw].astype(np.float64),
        union_bytes=per_step(inst.union_bytes), reads=per_step(inst.reads), read_bytes=per_step(inst.read_bytes),
        hits=per_step(inst.hits), lookups=per_step(inst.union_experts),
        prefetch=None if inst.prefetch is None else {
            name: per_step(getattr(inst.prefetch, name)) for name in ("issued", "required", "timely", "timely_n", "slack", "unused")},
    )


def summarize(steps: StepTable, usage: DeviceUsage, other_seconds_per_token: float) -> LayoutMetrics:
    """Every seed 4.1-4.3 metric this replay can produce (seconds unless noted)."""
    A = steps.committed.sum()
    S = steps.stall.sum() / A
    C = steps.compute.sum() / A
    O = other_seconds_per_token
    per_step = steps.stall[steps.committed > 0] / steps.committed[steps.committed > 0]
    q = np.percentile(per_step, [50, 90, 95, 99]) if len(per_step) else [0.0] * 4
    elapsed = steps.stall.sum() + steps.compute.sum() + O * A
    return LayoutMetrics(
        committed_tokens=int(A),
        steps=int(len(steps.stall)),
        evaluated_positions=int(steps.evaluated.sum()),
        stall_per_token_s=float(S),
        compute_per_token_s=float(C),
        other_per_token_s=float(O),
        tpot_s=float(C + S + O),
        oracle_stall_per_token_s=float(steps.oracle_stall.sum() / A),
        step_stall_s=Quantiles(float(q[0]), float(q[1]), float(q[2]), float(q[3]), float(per_step.max()) if len(per_step) else 0.0),
        reads_per_token=float(steps.reads.sum() / A),
        read_bytes_per_token=float(steps.read_bytes.sum() / A),
        union_bytes_per_token=float(steps.union_bytes.sum() / A),
        ram_hit_rate=float(steps.hits.sum() / max(steps.lookups.sum(), 1)),
        drive_utilisation=(usage.transfer_seconds / max(elapsed, 1e-12)).round(4).tolist(),
        drive_queue_depth=(usage.residence_seconds / max(elapsed, 1e-12)).round(3).tolist(),
        drive_requests_per_token=(usage.requests / A).round(2).tolist(),
        prefetch=_prefetch_metrics(steps.prefetch, A),
    )


def _prefetch_metrics(p: dict | None, committed: float) -> PrefetchMetrics | None:
    """Seed 4.3 for a modelled prefetch source: timely required-byte recall, unused prefetched
    bytes (not selected by the layer they were loaded for) and mean lead slack."""
    if p is None:
        return None
    required, timely_n = p["required"].sum(), p["timely_n"].sum()
    return PrefetchMetrics(
        prefetched_bytes_per_token=float(p["issued"].sum() / committed),
        timely_required_byte_recall=float(p["timely"].sum() / required) if required else None,
        unused_prefetched_bytes_per_token=float(p["unused"].sum() / committed),
        mean_lead_slack_s=float(p["slack"].sum() / timely_n) if timely_n else None,
    )


def session_sums(steps: StepTable, n_sessions: int) -> dict[str, np.ndarray]:
    """Per-session totals [n_sessions] of stall, oracle stall, compute and committed tokens."""
    def s(x):
        return np.bincount(steps.session, weights=x, minlength=n_sessions)

    return {"stall": s(steps.stall), "oracle": s(steps.oracle_stall), "compute": s(steps.compute),
            "committed": s(steps.committed)}
