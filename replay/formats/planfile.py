"""The plan file (``plan.json``): its record, reading, validation and writing.

A plan records everything replay and rewrite need, so that replay runs far from the container:
the container's fingerprints and geometry, the training sessions (held-out discipline), the
method and its parameters, the per-layer expert order, the source's physical layout (the stock
baseline, straddling experts included), the new layout (files, offsets, alignment) and an
optional vertical split plan. Schema: ``manifests/schemas/plan.schema.json``. Plans are made by
:mod:`relayout.planning.plan`; this module is what every consumer of a plan file reads it with.

A plan is a file users share: its digest (unkeyed) proves it was not damaged, not that it was
not crafted, so :func:`load_plan` checks every field a consumer reads before it is used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.atomic import write_json_atomic
from containers.errors import InputError
from containers.hashing import digest_of
from containers.jsonfile import read_document
from containers.layout import Layout, check_runtime_constraints
from containers.output_files import MAX_LISTED, output_name_problem
from containers import records
from containers.records import is_int, omitted_when_none

from replay.formats.pinfile import PinRecord, pin_record_problems

PLAN_FORMAT = "relayout.plan"
PLAN_VERSION = 1
METHODS = ("louvain", "greedy-modularity", "heat", "stock", "random")
"""The ordering methods a plan may record (:mod:`relayout.planning.ordering` implements them)."""


def plan_digest(plan: dict) -> str:
    body = {k: v for k, v in plan.items() if k != "plan_digest"}
    return digest_of(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def save_plan(plan: dict, path: str | os.PathLike) -> None:
    write_json_atomic(path, plan, indent=None)


@dataclass(frozen=True)
class PlanGeometry:
    """The model a plan is for: sizes (the FFN's ``moe_intermediate_size`` in rows), routed and MTP
    layer numbers, and per routed layer its expert format and one expert's bytes. ``name`` and
    ``synth_seed`` are recorded for a plan made against a geometry instead of a container."""

    hidden_size: int
    moe_intermediate_size: int
    n_experts: int
    top_k: int
    routed_layers: list[int]
    mtp_layers: list[int]
    expert_formats: dict[int, str]
    expert_bytes: dict[int, int]
    name: str | None = omitted_when_none()
    synth_seed: int | None = omitted_when_none()

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "PlanGeometry":
        return records.from_json(cls, obj, where, "plan geometry")


@dataclass(frozen=True)
class PlanSourceRef:
    """What a plan was made for: ``kind`` ``container`` (a real one, with its fingerprints) or
    ``geometry`` (planned without bytes), and its path or geometry name."""

    kind: str
    name: str | None = None
    fingerprint: str | None = None
    content_fingerprint: str | None = None

    def to_json(self) -> dict:
        return records.to_json(self)


@dataclass(frozen=True, kw_only=True)
class PlanTraining:
    """The sessions a plan learned from: the trace file(s) and their content fingerprints (one, or
    a list for pooled traces), the training and held-out session names, the training sessions'
    routing fingerprints (same order) and the training forwards counted."""

    trace: str | list[str] | None = None
    trace_fingerprint: str | list[str] | None = None
    sessions: list[str]
    held_out_sessions: list[str]
    session_fingerprints: list[str] | None = None
    forwards: int | None = None

    def to_json(self) -> dict:
        return records.to_json(self)


@dataclass(frozen=True)
class SplitSegment:
    """One routed layer's vertical split: FFN rows of the top segment, and the bytes of each segment."""

    top_rows: int
    top_bytes: int
    bottom_bytes: int


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """A vertical split plan: the top segment's FFN share ``ratio``, the rule that chose the
    resident tops, the RAM for them and the LRU budget they competed with (bytes), for the
    ``replay`` rule the device profile and reader workers, each routed layer's segments and
    resident expert ids, and the resident tops' bytes."""

    ratio: float
    rule: str
    ram_bytes: int
    cache_bytes: int
    device: str | None = omitted_when_none()
    workers: int | None = omitted_when_none()
    segments: dict[int, SplitSegment]
    resident: dict[int, list[int]]
    resident_bytes: int

    def to_json(self) -> dict:
        return records.to_json(self)

    @classmethod
    def from_json(cls, obj, where: str | None) -> "SplitPlan":
        return records.from_json(cls, obj, where, "split plan")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A loaded, validated plan: ``raw`` is the document as read (rewritten whole by :func:`with_pins`)."""

    path: str
    raw: dict
    stock: Layout
    layout: Layout
    orders: dict[int, np.ndarray]
    source: PlanSourceRef
    geometry: PlanGeometry
    training: PlanTraining
    split: SplitPlan | None = None
    repack: Layout | None = None
    """The source's expert order in the new packing (files, alignment), to separate what repacking
    saves from what ordering saves; None when the plan does not record it."""
    pins: PinRecord | None = None
    """A pin set chosen for this layout (``relayout placement --plan-out``), or None."""

    @property
    def digest(self) -> str:
        return self.raw["plan_digest"]

    @property
    def method(self) -> str:
        return self.raw["method"]

    @property
    def source_kind(self) -> str:
        """``container`` (a real container, with a fingerprint) or ``geometry`` (planned without bytes)."""
        return self.source.kind

    @property
    def source_fingerprint(self) -> str | None:
        return self.source.fingerprint

    @property
    def training_sessions(self) -> list[str]:
        return list(self.training.sessions)

    @property
    def training_fingerprints(self) -> list[str] | None:
        """Routing fingerprints of the training sessions (same order), or None when the plan has none."""
        fps = self.training.session_fingerprints
        return None if fps is None else list(fps)

    def split_state(self):
        """The split plan as the replay model takes it (:class:`replay.model.engine.SplitState`), or None."""
        from replay.model.engine import split_state

        return split_state(None if self.split is None else self.split.to_json(), self.layout,
                           self.geometry.moe_intermediate_size)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate ``plan.json``: complete permutations, runtime limits, consistent layouts."""
    path = Path(path)
    where = str(path)
    raw = read_document(path, PLAN_FORMAT, PLAN_VERSION,
                        ("geometry", "orders", "source_layout", "layout", "training", "source", "plan_digest"), "plan",
                        missing="no such plan file")
    if plan_digest(raw) != raw["plan_digest"]:
        raise InputError(path, "plan digest does not match its content (edited or corrupt)")
    problems = plan_field_problems(raw)
    stock = Layout.from_json(raw["source_layout"], where)
    layout = Layout.from_json(raw["layout"], where)
    problems += [p for p in (output_name_problem(n) for n in layout.files) if p]
    if problems:
        shown = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else "")
        raise InputError(path, f"plan is malformed ({len(problems)} problem(s)): {shown}")
    g = raw["geometry"]
    E = g["n_experts"]
    if stock.layers != g["routed_layers"] or layout.layers != g["routed_layers"]:
        raise InputError(path, "layouts do not cover the geometry's routed layers")
    orders = {}
    for layer in g["routed_layers"]:
        o = raw["orders"].get(str(layer))
        if not _int_list(o) or sorted(o) != list(range(E)):
            raise InputError(path, f"order of layer {layer} is not a complete permutation of 0..{E - 1}")
        orders[layer] = np.asarray(o, dtype=np.int64)
    check_runtime_constraints(layout, where)
    if not np.array_equal(stock.expert_bytes(), layout.expert_bytes()):
        raise InputError(path, "new layout's expert sizes differ from the source's")
    repack = None
    if raw.get("repack_layout") is not None:
        repack = Layout.from_json(raw["repack_layout"], where)
        if repack.layers != layout.layers or not np.array_equal(repack.expert_bytes(), layout.expert_bytes()):
            raise InputError(path, "the repacked stock layout does not match the new layout's experts")
        check_runtime_constraints(repack, where)
    pins = PinRecord.from_json(raw["pins"], where) if raw.get("pins") is not None else None
    split = SplitPlan.from_json(raw["split"], where) if raw.get("split") is not None else None
    source = records.from_json(PlanSourceRef, raw["source"], where, "plan source")
    training = records.from_json(PlanTraining, raw["training"], where, "plan training")
    return Plan(path=where, raw=raw, stock=stock, layout=layout, orders=orders, source=source,
                geometry=PlanGeometry.from_json(g, where), training=training,
                split=split, repack=repack, pins=pins)


def with_pins(raw: dict, pins: PinRecord) -> dict:
    """A copy of plan ``raw`` recording ``pins`` (a new plan: its digest is recomputed)."""
    out = {k: v for k, v in raw.items() if k != "plan_digest"}
    out["pins"] = pins.to_json()
    out["plan_digest"] = plan_digest(out)
    return out


def _int_list(x) -> bool:
    return isinstance(x, list) and all(is_int(v) and v >= 0 for v in x)


def plan_field_problems(raw: dict) -> list[str]:
    """Type and range problems of a plan's fields other than its two layouts (empty when none).

    A plan is a shared file: its digest proves it was not damaged, not that it was not crafted,
    so every field replay or rewrite reads is checked here before it is used.
    """
    problems = []
    src = raw.get("source")
    if not isinstance(src, dict):
        return ["'source' is not an object"]
    if src.get("kind") not in ("container", "geometry"):
        problems.append(f"source kind {src.get('kind')!r} is not 'container' or 'geometry'")
    for key in ("fingerprint", "content_fingerprint"):
        if src.get(key) is not None and not isinstance(src.get(key), str):
            problems.append(f"source {key} is not a string")
    if src.get("kind") == "container" and not isinstance(src.get("fingerprint"), str):
        problems.append("a container plan has no source fingerprint")
    if raw.get("method") not in METHODS:
        problems.append(f"method {raw.get('method')!r} is not one of {', '.join(METHODS)}")
    g = raw.get("geometry")
    if not isinstance(g, dict):
        return problems + ["'geometry' is not an object"]
    for key in ("hidden_size", "moe_intermediate_size", "n_experts", "top_k"):
        if not is_int(g.get(key)) or not 1 <= g[key] <= 1 << 24:
            problems.append(f"geometry {key} {g.get(key)!r} is not a positive integer")
    for key in ("routed_layers", "mtp_layers"):
        if not _int_list(g.get(key)):
            problems.append(f"geometry {key} is not a list of layer numbers")
    if not isinstance(g.get("expert_formats"), dict) or not all(isinstance(v, str) for v in g["expert_formats"].values()):
        problems.append("geometry expert_formats is not an object of strings")
    if not isinstance(g.get("expert_bytes"), dict) or not all(is_int(v) and v > 0 for v in g["expert_bytes"].values()):
        problems.append("geometry expert_bytes is not an object of byte counts")
    training = raw.get("training")
    if not isinstance(training, dict) or not all(isinstance(training.get(k), list) and all(isinstance(x, str) for x in training[k])
                                                 for k in ("sessions", "held_out_sessions")):
        problems.append("training sessions are not lists of session names")
    elif training.get("session_fingerprints") is not None:
        fps = training["session_fingerprints"]
        if not isinstance(fps, list) or len(fps) != len(training["sessions"]) or not all(isinstance(x, str) for x in fps):
            problems.append("training session_fingerprints is not one string per training session")
    if not isinstance(raw.get("orders"), dict):
        problems.append("'orders' is not an object")
    split = raw.get("split")
    if split is not None and not problems:
        problems += _split_problems(split, g)
    if not problems:
        problems += pin_record_problems(raw.get("pins"), g)
    return problems


def _split_problems(split, g: dict) -> list[str]:
    if not isinstance(split, dict):
        return ["'split' is not an object or null"]
    problems = []
    if not is_int(split.get("ram_bytes")) or split["ram_bytes"] < 0:
        problems.append("split ram_bytes is not a byte count")
    resident, segs = split.get("resident"), split.get("segments")
    if not isinstance(resident, dict) or not isinstance(segs, dict):
        return problems + ["split resident and segments are not objects"]
    for layer in g["routed_layers"]:
        r, seg = resident.get(str(layer)), segs.get(str(layer))
        if not _int_list(r) or any(e >= g["n_experts"] for e in r):
            problems.append(f"split resident experts of layer {layer} are not expert ids")
        if not isinstance(seg, dict) or not is_int(seg.get("top_rows")) or not 0 <= seg["top_rows"] <= g["moe_intermediate_size"]:
            problems.append(f"split top_rows of layer {layer} is not a row count within the FFN")
    return problems
