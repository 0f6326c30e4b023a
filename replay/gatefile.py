"""The gate record (``gate.json``): its typed record, reading, validation, and the recheck.

:mod:`replay.gate` builds a :class:`GateRecord`; a rewrite reads one to decide whether it may
run, and ``relayout gate --recheck`` recomputes its interval and verdict from the evidence it
stores (:mod:`replay.evidence`). Seconds are per committed token unless a name says otherwise;
bytes are bytes. Schema: ``manifests/schemas/gate.schema.json``. Nothing here loads the replay
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from containers import records
from containers.errors import InputError
from containers.jsonfile import read_document

from .config import RuntimeConfig
from .evidence import Evidence, judge

GATE_FORMAT = "relayout.gate"
GATE_VERSION = 1
VERDICTS = ("pass", "fail", "insufficient")


@dataclass(frozen=True)
class PrefetchMetrics:
    """Seed 4.3 for a modelled prefetch source (bytes per committed token, seconds)."""

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
    """One layout's replayed figures (:func:`replay.metrics.summarize`).

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


@dataclass(frozen=True)
class PlanRef:
    path: str
    digest: str
    method: str
    source_fingerprint: str | None
    source_kind: str


@dataclass(frozen=True)
class BaselineRef:
    """``stock`` (the plan's source layout) or another plan's layout."""

    kind: str
    path: str | None = None
    digest: str | None = None


@dataclass(frozen=True)
class TraceRef:
    path: str
    fingerprint: str
    sessions_evaluated: list[str]
    sessions_excluded_as_training: list[str]
    exclusions: dict[str, str]
    held_out_by: str


@dataclass(frozen=True)
class DeviceRef:
    """The device profile replayed on: its name, digest and the profile itself (as JSON)."""

    name: str
    digest: str
    profile: dict[str, Any]


@dataclass(frozen=True)
class Threshold:
    fraction_of_tpot: float
    seconds_per_token: float
    tpot_s: float
    tpot_source: str


@dataclass(frozen=True)
class EvidenceUnits:
    baseline_stall_s: list[float]
    plan_stall_s: list[float]
    committed_tokens: list[float]
    session: list[int] | None = None


@dataclass(frozen=True)
class GateEvidence:
    """What the verdict rests on (:class:`replay.evidence.Evidence`) and whether it sufficed."""

    method: str
    seed: int
    resamples: int
    level: float
    n_sessions: int
    block_steps: int | None
    units: EvidenceUnits
    sufficient: bool
    sufficiency: str
    min_sessions: int
    p_below_threshold: float


@dataclass(frozen=True)
class Saving:
    """A saving in seconds per committed token with its 95% interval and the units behind it."""

    estimate: float
    low: float
    high: float
    unit: str
    n_units: int
    method: str


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Decomposition:
    """Saving from repacking (source order, new packing) and from ordering, each with its interval."""

    repacking: Interval
    ordering: Interval
    repacked_stall_per_token_s: float


@dataclass(frozen=True)
class Headroom:
    baseline_stall_s: float
    oracle_stall_s: float
    plan_oracle_stall_s: float
    max_saving_s: float
    max_saving_fraction_of_tpot: float


@dataclass(frozen=True)
class SessionResult:
    """One held-out session's totals (seconds, committed tokens)."""

    session: str
    committed: int
    baseline_stall_s: float
    plan_stall_s: float
    oracle_stall_s: float


PIN_SOURCES = ("plan", "heat", "none")


@dataclass(frozen=True)
class PinsUsed:
    """The pin set both layouts were replayed with (:func:`replay.gate.gate_pins`): ``plan`` (the
    plan's own, from ``relayout placement``), ``heat`` (the hottest training experts within
    ``pin_bytes``) or ``none``; how many experts and their bytes, and a sentence saying how."""

    source: str
    experts: int
    bytes: int
    how: str


@dataclass(frozen=True)
class GateRecord:
    """The replay comparison that decides whether a plan may rewrite a container."""

    format: str
    version: int
    verdict: str
    reason: str
    tool_version: str
    plan: PlanRef
    baseline: BaselineRef
    trace: TraceRef
    device: DeviceRef
    runtime: RuntimeConfig
    threshold: Threshold
    evidence: GateEvidence
    saving_per_token_s: Saving
    saving_fraction_of_tpot: Interval
    decomposition: Decomposition | None
    headroom: Headroom
    baseline_metrics: LayoutMetrics
    plan_metrics: LayoutMetrics
    per_session: list[SessionResult]
    pins: PinsUsed | None = None
    """None only in records made before the pin set was recorded."""

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj: dict, where: str | None) -> "GateRecord":
        g = records.from_json(cls, obj, where, "gate record")
        if g.verdict not in VERDICTS:
            raise InputError(where, f"gate record's verdict {g.verdict!r} is not one of {', '.join(VERDICTS)}")
        if g.pins is not None and g.pins.source not in PIN_SOURCES:
            raise InputError(where, f"gate record's pin source {g.pins.source!r} is not one of {', '.join(PIN_SOURCES)}")
        return g


def load_gate(path) -> GateRecord:
    """Read and check ``gate.json`` (a record from an older relayout is refused: re-run replay)."""
    obj = read_document(path, GATE_FORMAT, GATE_VERSION, ("verdict", "plan", "reason"), "gate record")
    if "evidence" not in obj:
        raise InputError(path, "gate record has no evidence (made by an older relayout): run relayout replay again")
    return GateRecord.from_json(obj, str(path))


def recheck_fields(gate: GateRecord, where: str) -> list[tuple[str, str]]:
    """Recompute a gate record's interval and verdict from its stored evidence: ``(field, difference)`` pairs.

    Empty when the record is consistent: same interval (the bootstrap is deterministic given the
    stored seed and resample count) and same verdict for the stored threshold. ``field`` is the
    record's field that does not recompute (``saving_per_token_s`` or ``verdict``).
    """
    ev = Evidence.from_json(records.to_json(gate.evidence), where)
    got = ev.interval()
    verdict = judge(ev, gate.threshold.seconds_per_token, gate.evidence.min_sessions).verdict
    s = gate.saving_per_token_s
    stored = (s.estimate, s.low, s.high)
    problems = []
    if not np.allclose(got, stored, rtol=1e-9, atol=1e-15):
        problems.append(("saving_per_token_s",
                         f"interval recomputed from the units is {got[0]:.6g} [{got[1]:.6g}, {got[2]:.6g}] s/token, the "
                         f"record says {stored[0]:.6g} [{stored[1]:.6g}, {stored[2]:.6g}]"))
    if verdict != gate.verdict:
        problems.append(("verdict", f"verdict recomputed is {verdict!r}, the record says {gate.verdict!r}"))
    return problems


def recheck(gate: GateRecord, where: str) -> list[str]:
    """The differences of :func:`recheck_fields`, as sentences (empty when the record is consistent)."""
    return [problem for _, problem in recheck_fields(gate, where)]
