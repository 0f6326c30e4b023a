"""The gate record (``gate.json``): its typed record, reading and validation.

:mod:`replay.evaluation.gate` builds a :class:`GateRecord`; a rewrite reads one to decide whether it may
run, and ``relayout gate --recheck`` recomputes its interval and verdict from the evidence it
stores (:func:`replay.evaluation.evidence.recheck`). Seconds are per committed token unless a name says otherwise;
bytes are bytes. Schema: ``manifests/schemas/gate.schema.json``. Nothing here loads the replay
model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from containers import records
from containers.errors import InputError
from containers.jsonfile import read_document

from replay.model.config import RuntimeConfig
from replay.formats.interval import Interval
from replay.model.figures import LayoutMetrics

GATE_FORMAT = "relayout.gate"
GATE_VERSION = 1
VERDICTS = ("pass", "fail", "insufficient")


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
    """What the verdict rests on (:class:`replay.evaluation.evidence.Evidence`) and whether it sufficed."""

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
    """The pin set both layouts were replayed with (:func:`replay.evaluation.gate.gate_pins`): ``plan`` (the
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
    saving_per_token_s: Interval
    """The saving in seconds per committed token, with its unit, unit count and resampling method."""
    saving_fraction_of_tpot: Interval
    decomposition: Decomposition | None
    headroom: Headroom
    baseline_metrics: LayoutMetrics
    plan_metrics: LayoutMetrics
    per_session: list[SessionResult]
    pins: PinsUsed | None = None
    """None when the record names no pin set."""

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj: dict, where: str | None) -> "GateRecord":
        g = records.from_json(cls, obj, where, "gate record")
        if g.verdict not in VERDICTS:
            raise InputError(where, f"gate record's verdict {g.verdict!r} is not one of {', '.join(VERDICTS)}")
        s = g.saving_per_token_s
        if s.unit is None or s.n_units is None or s.method is None:
            raise InputError(where, "malformed gate record: saving_per_token_s lacks its unit, n_units or method")
        if g.pins is not None and g.pins.source not in PIN_SOURCES:
            raise InputError(where, f"gate record's pin source {g.pins.source!r} is not one of {', '.join(PIN_SOURCES)}")
        return g


def load_gate(path) -> GateRecord:
    """Read and check ``gate.json``; a record without its evidence is refused (re-run replay)."""
    obj = read_document(path, GATE_FORMAT, GATE_VERSION, ("verdict", "plan", "reason"), "gate record")
    if "evidence" not in obj:
        raise InputError(path, "gate record has no evidence (made by an older relayout): run relayout replay again")
    return GateRecord.from_json(obj, str(path))
