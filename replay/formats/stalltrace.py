"""STALL_TRACE records: the one reader of the JSONL file (plain or zstd) a measured run writes, and its rules.

A record is an *expert record* (one expert's load in one step and layer) or, with ``"record":
"step"``, a *step record* (the step's counts, times and output-token hashes). Every record is keyed
by run, request and step (``run_id`` and ``request_id`` strings or integers, ``""`` and ``0`` when
absent); an expert record also names its ``layer`` and ``expert_id``. Times are monotonic
nanoseconds, sizes bytes. Each field a record carries is checked by one rule whoever reads it
(:data:`LIMITS`: integers are JSON integers, never booleans or floats, in ``0..limit``; counts
``>= 1``; ``required`` and ``used_before_eviction`` booleans; ``router_probability`` a finite
float32 or null; a load's ``ready_ns`` not before its ``issue_ns``, no load, wait or barrier longer
than a day); a step's ``committed_tokens`` and ``evaluated_positions``, wherever given, agree across
its records, with committed at most evaluated; a step has at most one step record. A reader asks
for the fields its use needs (:class:`StallRecords`); a missing one is an error naming the line.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from containers.errors import InputError
from containers.jsonfile import iter_jsonl
from replay.model.routing import MAX_GATE, MAX_POSITION

TIMED = ("issue_ns", "ready_ns", "need_ns")
COUNTS = ("committed_tokens", "evaluated_positions")
IO_FIELDS = ("drive_requests", "drive_bytes", "page_cache_requests", "page_cache_bytes",
             "unclassified_requests", "unclassified_bytes")
"""Per-record read accounting ``relayout measure`` writes (see :mod:`replay.physical.measure`)."""
STEP_TIMES = ("compute_ns", "other_ns", "wall_ns", "stall_ns")
"""A step record's times, ns (null: not recorded)."""
EXPERT_KEYS = ("step", "layer", "expert_id")
"""Fields every expert record carries."""
STEP_KEYS = ("step",)
"""Fields every step record carries."""

MAX_TIME_NS = 2**62
"""The latest monotonic timestamp a record may carry, ns (some 146 years of uptime)."""
MAX_SPAN_NS = 86_400 * 10**9
"""The longest duration a record may give or span (compute, other, wall and stall time per step;
a load from issue to ready; a wait; a barrier), ns: a day."""
MAX_BYTES = 2**40
"""The most bytes one record may count (a read, or a step's reads of one kind), a TiB."""
MAX_COUNT = 2**31 - 1
"""The largest step number, request count or queue occupancy a record may carry."""
MAX_POSITIONS = 2**20
"""The most positions one step may evaluate (and tokens it may commit)."""
MAX_LAYER = 2**16 - 1
MAX_EXPERT = 2**20 - 1
MAX_SEGMENT = 255
LIMITS = {"step": MAX_COUNT, "layer": MAX_LAYER, "expert_id": MAX_EXPERT, "segment_id": MAX_SEGMENT,
          "position": MAX_POSITION, "bytes": MAX_BYTES,
          "committed_tokens": MAX_POSITIONS, "evaluated_positions": MAX_POSITIONS,
          "issue_ns": MAX_TIME_NS, "ready_ns": MAX_TIME_NS, "need_ns": MAX_TIME_NS,
          "barrier_enter_ns": MAX_TIME_NS, "barrier_exit_ns": MAX_TIME_NS,
          "compute_ns": MAX_SPAN_NS, "other_ns": MAX_SPAN_NS, "wall_ns": MAX_SPAN_NS, "stall_ns": MAX_SPAN_NS,
          "foreground_stall_ns": MAX_SPAN_NS, "queue_depth": MAX_COUNT, "worker_occupancy": MAX_COUNT,
          **{k: MAX_BYTES if k.endswith("_bytes") else MAX_COUNT for k in IO_FIELDS}}
"""The largest value of each integer field (every one is also >= 0, counts >= 1)."""


def int_field(rec: dict, key: str, where: str, minimum: int = 0) -> int:
    """``rec[key]`` checked against :data:`LIMITS` (a missing field is refused like a bad one).

    >>> int_field({"layer": 3}, "layer", "t.jsonl:1")
    3
    """
    v = rec.get(key)
    top = LIMITS[key]
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= top:
        raise InputError(where, f"{key!r} must be an integer of {minimum} to {top} (got {v!r})"[:200])
    return v


def _bool(rec: dict, key: str, where: str) -> None:
    v = rec[key]
    if not isinstance(v, bool):
        raise InputError(where, f"{key!r} must be true or false (got {v!r})"[:200])


def _name(rec: dict, key: str, where: str, default) -> str:
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise InputError(where, f"{key!r} must be a string or an integer, not {v!r}"[:200])
    return str(v)


def _span(start: int, end: int, what: str, where: str) -> None:
    if end - start > MAX_SPAN_NS:
        raise InputError(where, f"{what} spans {end - start} ns, more than a day")


def _declare(counts: dict, key: tuple, rec: dict, where: str) -> None:
    """Record the step's counts from ``rec``; any disagreement with an earlier record is an error."""
    have = counts.setdefault(key, {})
    vals = {}
    for name in COUNTS:
        if name in rec:
            vals[name] = int_field(rec, name, where, 1)
    if "committed_tokens" in vals and "evaluated_positions" in vals and vals["committed_tokens"] > vals["evaluated_positions"]:
        raise InputError(where, "committed_tokens exceeds evaluated_positions")
    for name, v in vals.items():
        if name in have and have[name][0] != v:
            first = have[name][1].rsplit(":", 1)[-1]
            raise InputError(where, f"{name} {v} disagrees with {have[name][0]} given at line {first} "
                                    f"for request {key[1]} step {key[2]}")
        have.setdefault(name, (v, where))
    c, e = have.get("committed_tokens"), have.get("evaluated_positions")
    if c and e and c[0] > e[0]:
        raise InputError(where, f"committed_tokens {c[0]} exceeds evaluated_positions {e[0]} of request {key[1]} step {key[2]}")


def _check_step(rec: dict, where: str) -> None:
    for key in STEP_TIMES:
        if rec.get(key) is not None:
            int_field(rec, key, where)


def _check_expert(rec: dict, where: str) -> None:
    int_field(rec, "layer", where)
    int_field(rec, "expert_id", where)
    for key in ("bytes", "segment_id", "position") + TIMED:
        if key in rec:
            int_field(rec, key, where)
    if "issue_ns" in rec and "ready_ns" in rec:
        issue, ready = rec["issue_ns"], rec["ready_ns"]
        if ready < issue:
            raise InputError(where, f"ready_ns {ready} is before issue_ns {issue}")
        _span(issue, ready, "the load from issue_ns to ready_ns", where)
    if "need_ns" in rec and "ready_ns" in rec:
        _span(rec["need_ns"], rec["ready_ns"], "the wait from need_ns to ready_ns", where)
    if "barrier_enter_ns" in rec and "barrier_exit_ns" in rec:
        enter, leave = int_field(rec, "barrier_enter_ns", where), int_field(rec, "barrier_exit_ns", where)
        if leave < enter:
            raise InputError(where, "barrier_exit_ns is before barrier_enter_ns")
        _span(enter, leave, "the barrier", where)
    for key in ("required", "used_before_eviction"):
        if key in rec:
            _bool(rec, key, where)
    for key in ("foreground_stall_ns", "queue_depth", "worker_occupancy"):
        if rec.get(key) is not None:
            int_field(rec, key, where)
    if all(k in rec for k in IO_FIELDS):
        for k in IO_FIELDS:
            int_field(rec, k, where)
    gate = rec.get("router_probability")
    if gate is not None and (isinstance(gate, bool) or not isinstance(gate, (int, float)) or not abs(gate) <= MAX_GATE):
        raise InputError(where, f"'router_probability' must be a finite number, not {gate!r}"[:200])


class StallRecord(NamedTuple):
    """One checked record: where it is (``file:line``), the record, whether it is a step record,
    and its step's key ``(run_id, request_id, step)``."""

    where: str
    rec: dict
    is_step: bool
    key: tuple


class StallRecords:
    """The records of one STALL_TRACE file, each checked as it is read (one pass, bounded memory
    but for the steps' counts).

    Parameters
    ----------
    path : str or Path
        The STALL_TRACE file (JSONL, plain or zstd).
    expert_fields, step_fields : tuple of str
        Fields the reader's use needs in every expert / step record, besides
        :data:`EXPERT_KEYS` / :data:`STEP_KEYS`.

    Iterating yields :class:`StallRecord` in file order; afterwards :attr:`counts` maps each
    step's key ``(run_id, request_id, step)`` to the counts its records gave,
    ``{name: (value, "file:line" first given)}`` (empty when none did). A file without records is
    an error.
    """

    def __init__(self, path: str | Path, expert_fields: tuple = (), step_fields: tuple = ()):
        self.path = Path(path)
        self.expert_fields = tuple(dict.fromkeys(EXPERT_KEYS + tuple(expert_fields)))
        self.step_fields = tuple(dict.fromkeys(STEP_KEYS + tuple(step_fields)))
        self.counts: dict[tuple, dict] = {}

    def __iter__(self) -> Iterator[StallRecord]:
        self.counts = {}
        stepped: set[tuple] = set()
        seen = False
        for where, rec in iter_jsonl(self.path):
            seen = True
            is_step = rec.get("record") == "step"
            for field in self.step_fields if is_step else self.expert_fields:
                if field not in rec:
                    raise InputError(where, f"missing required field {field!r}")
            key = (_name(rec, "run_id", where, ""), _name(rec, "request_id", where, 0), int_field(rec, "step", where))
            _declare(self.counts, key, rec, where)
            if is_step:
                if key in stepped:
                    raise InputError(where, f"second step record for request {key[1]} step {key[2]}")
                stepped.add(key)
                _check_step(rec, where)
            else:
                _check_expert(rec, where)
            yield StallRecord(where, rec, is_step, key)
        if not seen:
            raise InputError(self.path, "no records")
