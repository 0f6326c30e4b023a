"""Stall metrics: S, TPOT = C + S + O, step-stall tails, traffic, cache, drives.

``S = total stall / committed tokens``: stall of rejected speculative positions is charged in the
numerator, only committed tokens count in the denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay.model.device import ArrayProfile
from replay.model.engine import DeviceUsage, InstanceResult
from replay.model.figures import LayoutMetrics, PrefetchMetrics, Quantiles
from replay.model.routing import RoutingTrace


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


STEP_SUMS = {"stall": "stall", "oracle_stall": "oracle_stall", "compute": "compute", "union_bytes": "union_bytes",
             "reads": "reads", "read_bytes": "read_bytes", "hits": "hits", "lookups": "union_experts"}
"""The :class:`StepTable` columns summed per step, and the per-instance output each sums."""
PREFETCH_STEP_SUMS = ("issued", "required", "timely", "timely_n", "slack", "unused", "loads", "rejected", "capped", "cancelled")
"""The prefetch outputs summed per step (:attr:`StepTable.prefetch`)."""


def step_sums(step: np.ndarray, n_steps: int, inst, prefetch) -> dict[str, np.ndarray]:
    """Per-step sums [n_steps] (float64) of the instance outputs :class:`StepTable` holds.

    ``step`` [I] is each instance's step (0..n_steps-1); ``inst`` and ``prefetch`` hold the
    outputs per instance by name (:class:`replay.model.engine.InstanceResult` or one chunk's
    :class:`replay.model.engine.InstanceOutputs`; ``prefetch`` None when no source runs). Sums run
    in instance order, so chunks of whole steps sum exactly as the whole replay does.
    """
    def per_step(x):
        return np.bincount(step, weights=x, minlength=n_steps)

    out = {col: per_step(getattr(inst, name)) for col, name in STEP_SUMS.items()}
    if prefetch is not None:
        out.update({f"prefetch.{name}": per_step(getattr(prefetch, name)) for name in PREFETCH_STEP_SUMS})
    return out


def steps_from_sums(trace: RoutingTrace, forwards: np.ndarray, sums: dict[str, np.ndarray]) -> StepTable:
    """The :class:`StepTable` of the forwards of mask ``forwards`` from their :func:`step_sums`."""
    fw = np.flatnonzero(forwards)
    pf = {name: sums[f"prefetch.{name}"] for name in PREFETCH_STEP_SUMS if f"prefetch.{name}" in sums}
    return StepTable(
        forward=fw, session=trace.fwd_session[fw].astype(np.int64),
        committed=trace.fwd_committed[fw].astype(np.float64), evaluated=trace.fwd_evaluated[fw].astype(np.float64),
        **{col: sums[col] for col in STEP_SUMS}, prefetch=pf or None)


def step_table(trace: RoutingTrace, forwards: np.ndarray, inst: InstanceResult) -> StepTable:
    """The :class:`StepTable` of a replay's per-instance results (:func:`replay.model.engine.simulate`)."""
    fw = np.flatnonzero(forwards)
    index = np.full(trace.n_forwards, -1)
    index[fw] = np.arange(len(fw))
    return steps_from_sums(trace, forwards, step_sums(index[inst.forward], len(fw), inst, inst.prefetch))


def summarize(steps: StepTable, usage: DeviceUsage, other_seconds_per_token: float) -> LayoutMetrics:
    """Every stall, traffic, cache and prefetch figure this replay can produce (seconds unless noted)."""
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


def drive_rate(usage: DeviceUsage, device: ArrayProfile) -> float | None:
    """Bytes/s the modelled array served while it had a drive read outstanding: the bytes its
    members transferred over ``usage.busy_seconds`` (what :func:`replay.physical.stalltrace.drive_busy`
    reads off a measured run). None when nothing was read from the drives."""
    busy = float(usage.busy_seconds.sum())
    return float(usage.transfer_seconds.sum()) * device.drive.bandwidth / busy if busy > 0 else None


def _prefetch_metrics(p: dict | None, committed: float) -> PrefetchMetrics | None:
    """The prefetch figures of a modelled prefetch source: timely required-byte recall, unused prefetched
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
