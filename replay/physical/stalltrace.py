"""STALL_TRACE analysis (seed sections 4, 7.7, 9 and Appendix A): from records to S and its diagnosis.

A STALL_TRACE is JSONL (optionally zstd-compressed). *Expert records* are keyed by run, request,
step, layer and expert (and segment); *step records* (``"record": "step"``) carry the committed
and evaluated counts, compute/other/wall time and output-token hashes. Times are monotonic
nanoseconds.

Token accounting. Appendix A puts ``evaluated_positions`` and ``committed_tokens`` in every expert
record. A step's counts come from its step record when there is one, else from its expert
records; every value given for one (run, request, step), in any record, must agree (a
disagreement is an error naming the line). ``committed_tokens`` must be >= 1 (seed 3.2: a step
commits an accepted prefix of at least one token) and at most ``evaluated_positions``. A step
whose records carry no count is charged 1 committed token and reported as *assumed*
(``committed_tokens_assumed``), as is a step record marked ``"committed_assumed": true``
(``relayout measure`` marks speculative steps whose acceptance its input trace did not carry).

Foreground stall of a (run, request, step, layer) is the measure of the union of the intervals
``[need_ns, ready_ns]`` of its required records that arrived late, so overlapping waits are
never double-counted (seed 4.1). ``S = sum of stall / sum of committed tokens``: rejected
speculative positions are charged in the numerator and not counted in the denominator.

Cross-checks (reported, never silently preferred over the interval union):

* ``foreground_stall_ns`` in expert records is read as the critical-path wait attributed to
  that record, so a (step, layer)'s records sum to its stall; a step record's ``stall_ns`` is the
  step's stall. Either disagreeing with the interval union by more than
  ``max(STALL_TOLERANCE_NS, STALL_TOLERANCE_REL x union)`` (1 us or 1%: a few clock reads and
  the runtime's own rounding) is a warning in the report and counted in ``stall_checks``.
* ``barrier_enter_ns``/``barrier_exit_ns``: seed 4.1 defines the barrier approximation
  ``W ~ max(0, max ready - t_barrier)``, the time the compute path spends in the join of missing
  experts. The union of a (step, layer)'s ``[barrier_enter, barrier_exit]`` intervals is reported
  as ``barrier_stall_per_committed_token_ns`` next to S (which stays the interval-union
  measure the seed prefers) when records carry them.

Supporting metrics (seed 4.2, 4.3, 9.1) computed where the records carry what they need:
timely required-byte recall (only when something was prefetched: without speculative records
there is no prediction to be timely, and the figure is ``null``), unused speculative bytes, lead
slack, union bytes per committed token, p50-p99 step stall, TPOT and its partition ``C_tok``
(``compute_ns``), ``O_tok`` (``other_ns``) from step records, hit rate by serving tier
(``tier_served``), queue occupancy (``queue_depth``, ``worker_occupancy``), and reads by
priority, drive requests apart from page-cache hits (``drive_requests``/``page_cache_requests``
and their bytes, as ``relayout measure`` records them), and the rate the drive ran at
(``drive``: its bytes over the time at least one load reading from it was under way,
:func:`drive_busy`), and the stall on loads the page cache served whole
(``page_cache_wait_per_committed_token_ns``, :func:`page_cache_wait`).

What a STALL_TRACE cannot give: calibrated late-need probability and prediction quality per
source unless the runtime records its predictions (``prediction_score`` of records that were
never loaded); energy or power; per-phase CPU time beyond compute/other; page-cache hits of a
runtime that does not classify its reads (its ``tier_served`` is taken as given); and burst
size or queue occupancy where ``queue_depth`` is absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from containers.atomic import atomic_output, make_dirs
from containers.errors import InputError
from containers.jsonfile import iter_jsonl

from replay.evaluation.gate import TpotParts
from replay.evaluation.stats import repetition_interval
from replay.formats.interval import Interval

REQUIRED_EXPERT = ("run_id", "request_id", "step", "layer", "expert_id", "required", "bytes")
TIMED = ("issue_ns", "ready_ns", "need_ns")
REQUIRED_STEP = ("run_id", "request_id", "step", "committed_tokens", "evaluated_positions")
COUNTS = ("committed_tokens", "evaluated_positions")
IO_FIELDS = ("drive_requests", "drive_bytes", "page_cache_requests", "page_cache_bytes",
             "unclassified_requests", "unclassified_bytes")
"""Per-record read accounting ``relayout measure`` writes (see :mod:`replay.physical.measure`)."""
STALL_TOLERANCE_NS = 1000
STALL_TOLERANCE_REL = 0.01
"""A recorded stall agrees with the interval union within max(1 us, 1%)."""

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
          "bytes": MAX_BYTES, "committed_tokens": MAX_POSITIONS, "evaluated_positions": MAX_POSITIONS,
          "issue_ns": MAX_TIME_NS, "ready_ns": MAX_TIME_NS, "need_ns": MAX_TIME_NS,
          "barrier_enter_ns": MAX_TIME_NS, "barrier_exit_ns": MAX_TIME_NS,
          "compute_ns": MAX_SPAN_NS, "other_ns": MAX_SPAN_NS, "wall_ns": MAX_SPAN_NS, "stall_ns": MAX_SPAN_NS,
          "foreground_stall_ns": MAX_SPAN_NS, "queue_depth": MAX_COUNT, "worker_occupancy": MAX_COUNT,
          **{k: MAX_BYTES if k.endswith("_bytes") else MAX_COUNT for k in IO_FIELDS}}
"""The largest value of each integer field (every one is also >= 0, counts >= 1)."""


def _int(rec: dict, key: str, where: str, minimum: int = 0) -> int:
    v = rec.get(key)
    top = LIMITS[key]
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= top:
        raise InputError(where, f"{key!r} must be an integer of {minimum} to {top} (got {v!r})"[:200])
    return v


def _opt_int(rec: dict, key: str, where: str) -> int:
    """``rec[key]`` as an integer >= 0, or -1 when the record does not carry it."""
    return _int(rec, key, where) if key in rec and rec[key] is not None else -1


def _bool(rec: dict, key: str, where: str, default: bool | None = None) -> bool:
    v = rec.get(key, default)
    if not isinstance(v, bool):
        raise InputError(where, f"{key!r} must be true or false (got {v!r})"[:200])
    return v


def _span(start: int, end: int, what: str, where: str) -> None:
    if end - start > MAX_SPAN_NS:
        raise InputError(where, f"{what} spans {end - start} ns, more than a day")


def _agrees(recorded: int, union: int) -> bool:
    return abs(recorded - union) <= max(STALL_TOLERANCE_NS, STALL_TOLERANCE_REL * union)


@dataclass
class Run:
    """One run's records, as lists (one entry per expert record)."""

    run_id: str
    source: str = ""
    steps: dict = field(default_factory=dict)          # (request, step) -> step record
    declared: dict = field(default_factory=dict)       # (request, step) -> {count key: (value, where)}
    keys: list = field(default_factory=list)            # (request, step, layer) per expert record
    expert: list = field(default_factory=list)
    segment: list = field(default_factory=list)
    required: list = field(default_factory=list)
    nbytes: list = field(default_factory=list)
    issue: list = field(default_factory=list)
    ready: list = field(default_factory=list)
    need: list = field(default_factory=list)
    already: list = field(default_factory=list)         # ready before any prediction (RAM at prediction)
    speculative: list = field(default_factory=list)
    used: list = field(default_factory=list)
    tier: list = field(default_factory=list)            # tier_served (None when absent)
    fg_stall: list = field(default_factory=list)        # foreground_stall_ns, -1 when absent
    barrier: list = field(default_factory=list)         # (enter, exit), or None
    queue_depth: list = field(default_factory=list)     # -1 when absent
    workers: list = field(default_factory=list)         # worker_occupancy, -1 when absent
    io: list = field(default_factory=list)              # IO_FIELDS values, or None
    order: int = 0


def _declare(run: Run, key: tuple, rec: dict, where: str, is_step: bool) -> None:
    """Record the step's counts from ``rec``; any disagreement with an earlier record is an error."""
    have = run.declared.setdefault(key, {})
    vals = {}
    for name in COUNTS:
        if name in rec:
            vals[name] = _int(rec, name, where, 1)
    if "committed_tokens" in vals and "evaluated_positions" in vals and vals["committed_tokens"] > vals["evaluated_positions"]:
        raise InputError(where, "committed_tokens exceeds evaluated_positions")
    for name, v in vals.items():
        if name in have and have[name][0] != v:
            first = have[name][1].rsplit(":", 1)[-1]
            raise InputError(where, f"{name} {v} disagrees with {have[name][0]} given at line {first} "
                                    f"for request {key[0]} step {key[1]}")
        have.setdefault(name, (v, where))
    c, e = have.get("committed_tokens"), have.get("evaluated_positions")
    if c and e and c[0] > e[0]:
        raise InputError(where, f"committed_tokens {c[0]} exceeds evaluated_positions {e[0]} of request {key[0]} step {key[1]}")


def read_stall_trace(path: str | Path) -> dict[str, Run]:
    """Parse and validate; returns runs by run_id in order of first appearance."""
    path = Path(path)
    runs: dict[str, Run] = {}
    for where, rec in iter_jsonl(path):
        is_step = rec.get("record") == "step"
        for key in REQUIRED_STEP if is_step else REQUIRED_EXPERT:
            if key not in rec:
                raise InputError(where, f"missing required field {key!r}")
        run = runs.setdefault(str(rec["run_id"]), Run(str(rec["run_id"]), str(path), order=len(runs)))
        request, step = str(rec["request_id"]), _int(rec, "step", where)
        _declare(run, (request, step), rec, where, is_step)
        if is_step:
            if (request, step) in run.steps:
                raise InputError(where, f"second step record for request {request} step {step}")
            for key in ("compute_ns", "other_ns", "wall_ns", "stall_ns"):
                if key in rec and rec[key] is not None:
                    _int(rec, key, where)
            run.steps[(request, step)] = rec
            continue
        layer, expert = _int(rec, "layer", where), _int(rec, "expert_id", where)
        nbytes = _int(rec, "bytes", where)
        served_ram = rec.get("tier_served") == "ram"
        if served_ram and not all(k in rec for k in TIMED):
            issue = ready = need = 0
        else:
            issue, ready, need = (_int(rec, k, where) for k in TIMED)
            if ready < issue:
                raise InputError(where, f"ready_ns {ready} is before issue_ns {issue}")
            _span(issue, ready, "the load from issue_ns to ready_ns", where)
            _span(need, ready, "the wait from need_ns to ready_ns", where)
        barrier = None
        if "barrier_enter_ns" in rec and "barrier_exit_ns" in rec:
            barrier = (_int(rec, "barrier_enter_ns", where), _int(rec, "barrier_exit_ns", where))
            if barrier[1] < barrier[0]:
                raise InputError(where, "barrier_exit_ns is before barrier_enter_ns")
            _span(*barrier, "the barrier", where)
        run.keys.append((request, step, layer))
        run.expert.append(expert)
        run.segment.append(_int(rec, "segment_id", where) if "segment_id" in rec else 0)
        required = _bool(rec, "required", where)
        run.required.append(required)
        run.nbytes.append(nbytes)
        run.issue.append(issue)
        run.ready.append(ready)
        run.need.append(need)
        tier = rec.get("tier_at_prediction", rec.get("tier_served"))
        run.already.append(tier == "ram")
        run.speculative.append(rec.get("priority") == "speculative")
        run.used.append(_bool(rec, "used_before_eviction", where, required))
        run.tier.append(rec.get("tier_served") if isinstance(rec.get("tier_served"), str) else None)
        run.fg_stall.append(_opt_int(rec, "foreground_stall_ns", where))
        run.barrier.append(barrier)
        run.queue_depth.append(_opt_int(rec, "queue_depth", where))
        run.workers.append(_opt_int(rec, "worker_occupancy", where))
        run.io.append(tuple(_int(rec, k, where) for k in IO_FIELDS) if all(k in rec for k in IO_FIELDS) else None)
    if not runs:
        raise InputError(path, "no records")
    return runs


def interval_union(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length (ns) covered by the union of the intervals [start, end)."""
    order = np.argsort(starts, kind="stable")
    total, cur_s, cur_e = 0, None, None
    for a, b in zip(starts[order].tolist(), ends[order].tolist()):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _quantiles(x: np.ndarray) -> dict | None:
    if not len(x):
        return None
    q = np.percentile(x, [50, 95]).tolist()
    return {"mean": float(np.mean(x)), "p50": q[0], "p95": q[1], "max": float(np.max(x))}


@dataclass
class RunMetrics:
    """One run's figures. :meth:`to_json` is what ``relayout report --json`` publishes; the arrays
    (per step and per layer) are for figures and comparisons and are not published."""

    run_id: str
    source: str
    configuration: str | None
    published: dict                       # the JSON-ready figures (see the module doc)
    step_keys: list                       # (request, step), sorted
    step_stall: np.ndarray                # ns per step
    step_committed: np.ndarray            # committed tokens per step (>= 1)
    layer_stall: dict                     # layer -> ns
    speculative_bytes: int
    token_hashes: dict                    # "request:step" -> hashes (or None)
    warnings: list
    drive_bytes: int = 0                  # bytes the drive served (records' drive_bytes)
    drive_busy_ns: int = 0                # time at least one load reading from the drive was under way
    page_cache_wait_ns: int | None = None  # foreground stall on loads served wholly by the page cache (page_cache_wait)

    @property
    def drive_rate_Bps(self) -> float | None:
        """Bytes/s the drive served while busy (:func:`drive_busy`); None without I/O counts."""
        return self.drive_bytes / self.drive_busy_ns * 1e9 if self.drive_busy_ns > 0 else None

    @property
    def committed_tokens(self) -> int:
        return int(self.step_committed.sum())

    @property
    def total_stall_ns(self) -> int:
        return int(self.step_stall.sum())

    @property
    def stall_per_committed_token_ns(self) -> float:
        return self.total_stall_ns / max(self.committed_tokens, 1)

    def to_json(self) -> dict:
        return dict(self.published)


def _stall_check(pairs: list[tuple]) -> dict | None:
    """Recorded vs interval-union stall over (key, recorded, union) entries."""
    if not pairs:
        return None
    bad = [(k, r, u) for k, r, u in pairs if not _agrees(r, u)]
    out = {"checked": len(pairs), "disagreeing": len(bad),
           "recorded_ns": int(sum(r for _, r, _ in pairs)), "interval_union_ns": int(sum(u for _, _, u in pairs)),
           "tolerance": f"max({STALL_TOLERANCE_NS} ns, {STALL_TOLERANCE_REL:.0%} of the interval union)"}
    if bad:
        k, r, u = max(bad, key=lambda x: abs(x[1] - x[2]))
        out["worst"] = {"at": ":".join(str(x) for x in k), "recorded_ns": int(r), "interval_union_ns": int(u)}
    return out


def run_metrics(run: Run) -> RunMetrics:
    """Every seed 4.2/4.3/9.1 metric one run supports (ns and bytes)."""
    keys = run.keys
    req = np.array(run.required, dtype=bool)
    nb = np.array(run.nbytes, dtype=np.int64)
    issue, ready, need = (np.array(x, dtype=np.int64) for x in (run.issue, run.ready, run.need))
    already = np.array(run.already, dtype=bool)
    spec = np.array(run.speculative, dtype=bool)
    used = np.array(run.used, dtype=bool)
    fg = np.array(run.fg_stall, dtype=np.int64)
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    stall_by_step: dict[tuple, int] = {}
    stall_by_layer: dict[int, int] = {}
    barrier_total, barrier_groups = 0, 0
    fg_pairs = []
    union_bytes = 0
    for (request, step, layer), idx in groups.items():
        idx = np.array(idx)
        late = idx[req[idx] & (ready[idx] > need[idx])]
        w = interval_union(need[late], ready[late]) if len(late) else 0
        stall_by_step[(request, step)] = stall_by_step.get((request, step), 0) + w
        stall_by_layer[layer] = stall_by_layer.get(layer, 0) + w
        rec_fg = fg[idx][fg[idx] >= 0]
        if len(rec_fg):
            fg_pairs.append(((request, step, layer), int(rec_fg.sum()), w))
        bars = [run.barrier[i] for i in idx.tolist() if run.barrier[i] is not None]
        if bars:
            b = np.array(bars, dtype=np.int64)
            barrier_total += interval_union(b[:, 0], b[:, 1])
            barrier_groups += 1
        seen = {}
        for i in idx[req[idx]]:
            seen[(run.expert[i], run.segment[i])] = nb[i]
        union_bytes += sum(seen.values())
    steps = run.steps
    step_keys = sorted(set(steps) | set(stall_by_step) | set(run.declared))
    committed, assumed_steps, assumed_tokens = [], 0, 0
    for k in step_keys:
        c = run.declared.get(k, {}).get("committed_tokens")
        value = c[0] if c else 1
        if c is None or (k in steps and steps[k].get("committed_assumed") is True):
            assumed_steps += 1
            assumed_tokens += value
        committed.append(value)
    committed = np.array(committed, dtype=np.int64)
    evaluated = np.array([run.declared.get(k, {}).get("evaluated_positions", (1,))[0] for k in step_keys], dtype=np.int64)
    stall = np.array([stall_by_step.get(k, 0) for k in step_keys], dtype=np.int64)
    A = int(committed.sum())
    per_step = stall / committed if len(committed) else np.zeros(0)
    q = np.percentile(per_step, [50, 90, 95, 99]).tolist() if len(per_step) else [0] * 4
    not_ready = req & ~already
    timely = not_ready & (ready <= need)
    slack = (need - ready)[timely & spec]
    prefetched = bool(spec.any())
    warnings = []
    step_pairs = [(k, int(steps[k]["stall_ns"]), stall_by_step.get(k, 0)) for k in step_keys
                  if k in steps and isinstance(steps[k].get("stall_ns"), int)]
    checks = {"foreground_stall_ns": _stall_check(fg_pairs), "step_stall_ns": _stall_check(step_pairs)}
    for name, what in (("foreground_stall_ns", "(step, layer)s' foreground_stall_ns"), ("step_stall_ns", "steps' stall_ns")):
        c = checks[name]
        if c and c["disagreeing"]:
            w = c["worst"]
            warnings.append(f"run {run.run_id}: {c['disagreeing']} of {c['checked']} {what} disagree with the interval union "
                            f"beyond {c['tolerance']} (worst at request:step{':layer' if name == 'foreground_stall_ns' else ''} "
                            f"{w['at']}: recorded {w['recorded_ns']} ns, union {w['interval_union_ns']} ns)")
    if assumed_steps:
        warnings.append(f"run {run.run_id}: {assumed_tokens} of {A} committed tokens ({assumed_steps} steps) are assumed, "
                        "not recorded: S and every per-token figure depend on that assumption")
    timing = {}
    for key in ("compute_ns", "other_ns", "wall_ns"):
        vals = [steps[k].get(key) for k in step_keys if k in steps]
        ok = len(vals) == len(step_keys) and all(isinstance(v, int) and not isinstance(v, bool) for v in vals)
        timing[key] = float(sum(vals) / max(A, 1)) if ok and vals else None
    tiers: dict[str, dict] = {}
    n_req = int(req.sum())
    for i in np.flatnonzero(req).tolist():
        t = tiers.setdefault(run.tier[i] or "unknown", {"records": 0, "bytes": 0})
        t["records"] += 1
        t["bytes"] += int(nb[i])
    for t in tiers.values():
        t["share"] = t["records"] / max(n_req, 1)
    reads = None
    if any(x is not None for x in run.io):
        reads = {}
        for i, x in enumerate(run.io):
            if x is None:
                continue
            d = reads.setdefault("speculative" if spec[i] else "demand", dict.fromkeys(IO_FIELDS, 0))
            for name, v in zip(IO_FIELDS, x):
                d[name] += v
        for d in reads.values():
            d["drive_requests_per_committed_token"] = d["drive_requests"] / max(A, 1)
            d["page_cache_requests_per_committed_token"] = d["page_cache_requests"] / max(A, 1)
    qd = np.array([x for x in run.queue_depth if x >= 0], dtype=np.float64)
    wo = np.array([x for x in run.workers if x >= 0], dtype=np.float64)
    configuration = next((steps[k].get("configuration") for k in step_keys if k in steps
                          and isinstance(steps[k].get("configuration"), str)), None)
    spec_bytes = int(nb[spec].sum())
    drive_bytes, busy_ns = drive_busy(run.io, issue, ready)
    cache_wait = page_cache_wait(run.io, run.fg_stall, run.speculative)
    out = {
        "run_id": run.run_id,
        "source": run.source,
        "configuration": configuration,
        "steps": len(step_keys),
        "evaluated_positions": int(evaluated.sum()),
        "committed_tokens": A,
        "committed_tokens_assumed": assumed_tokens,
        "steps_with_assumed_committed": assumed_steps,
        "total_stall_ns": int(stall.sum()),
        "stall_per_committed_token_ns": float(stall.sum() / max(A, 1)),
        "barrier_stall_per_committed_token_ns": float(barrier_total / max(A, 1)) if barrier_groups else None,
        "step_stall_ns": {"p50": q[0], "p90": q[1], "p95": q[2], "p99": q[3], "max": float(per_step.max()) if len(per_step) else 0.0},
        "prefetch": prefetched,
        "timely_required_byte_recall": float(nb[timely].sum() / nb[not_ready].sum()) if prefetched and nb[not_ready].sum() else None,
        "unused_speculative_bytes": int(nb[spec & ~used].sum()),
        "speculative_bytes_per_token": float(spec_bytes / max(A, 1)),
        "lead_slack_ns": {"p50": float(np.median(slack)), "p90": float(np.percentile(slack, 90))} if len(slack) else None,
        "union_bytes_per_committed_token": float(union_bytes / max(A, 1)),
        "tpot_ns": timing["wall_ns"],
        "compute_per_committed_token_ns": timing["compute_ns"],
        "other_per_committed_token_ns": timing["other_ns"],
        "tiers": dict(sorted(tiers.items())),
        "reads": reads,
        "drive": {"bytes": drive_bytes, "busy_ns": busy_ns, "rate_Bps": drive_bytes / busy_ns * 1e9} if busy_ns else None,
        "page_cache_wait_per_committed_token_ns": None if cache_wait is None else float(cache_wait / max(A, 1)),
        "queue_depth": _quantiles(qd),
        "worker_occupancy": _quantiles(wo),
        "stall_checks": checks,
        "warnings": warnings,
        "records": len(keys),
    }
    hashes = {f"{k[0]}:{k[1]}": steps[k].get("token_hashes", steps[k].get("token_hash")) for k in step_keys if k in steps}
    return RunMetrics(run.run_id, run.source, configuration, out, step_keys, stall, committed,
                      dict(sorted(stall_by_layer.items())), spec_bytes, hashes, warnings, drive_bytes, busy_ns, cache_wait)


def page_cache_wait(io: list, fg_stall: list, speculative: list) -> int | None:
    """Foreground stall (ns) on demand loads whose own reads the page cache served (records'
    ``drive_requests`` and ``unclassified_requests`` 0, ``page_cache_requests`` > 0): a
    coalesced run's later experts, whose weights arrive with the run's one read (counted on its
    first expert) and whose scale reads, jobs of their own, find their pages cached. The
    runtime, in C, has such scales in microseconds; a harness in Python makes the compute
    thread wait for its reader thread's own work on them (``docs/BENCHMARKS.md``, "The
    harness's own waits"), which the replay model, charging memory time for them, does not
    predict. None when the records carry no I/O counts, or cannot tell the page cache from the
    drive (neither ``mincore`` nor ``RWF_NOWAIT`` available: only unclassified reads)."""
    if not any(x is not None for x in io):
        return None
    if not any(x is not None and x[2] > 0 for x in io) and any(x is not None and x[4] > 0 for x in io):
        return None
    return int(sum(w for x, w, spec in zip(io, fg_stall, speculative)
                   if x is not None and not spec and w > 0 and x[0] == 0 and x[4] == 0 and x[2] > 0))


def drive_busy(io: list, issue: np.ndarray, ready: np.ndarray) -> tuple[int, int]:
    """(bytes, ns) of a run's drive work: the bytes its records say the drive served, and the
    union of the [issue, ready] spans of the loads that read from the drive (``drive_requests``
    > 0), the time the drive had at least one of them under way. Their ratio is the rate the
    disk ran at during the run, as :class:`replay.model.engine.DeviceUsage`'s ``busy_seconds`` gives
    the model's. (0, 0) when the records carry no I/O counts."""
    rows = [i for i, x in enumerate(io) if x is not None and x[0] > 0]
    if not rows:
        return 0, 0
    return int(sum(io[i][1] for i in rows)), int(interval_union(issue[rows], ready[rows]))


@dataclass
class Report:
    """Metrics of every run, and S pooled per group of runs of one configuration (one input file,
    and one ``configuration`` when step records name it): control and treatment runs are never
    pooled together. :meth:`to_json` is what ``relayout report --json`` prints."""

    runs: list[RunMetrics]
    groups: list[dict]
    warnings: list[str]

    def to_json(self) -> dict:
        out = {"runs": [m.to_json() for m in self.runs], "pooled": self.groups, "warnings": self.warnings}
        if len(self.groups) == 1:
            out["stall_per_committed_token_ns"] = self.groups[0]["stall_per_committed_token_ns"]
            out["committed_tokens"] = self.groups[0]["committed_tokens"]
        return out

    def __getitem__(self, key):
        """Read-only access to the published figures (``report(...)["runs"][0]["..."]``)."""
        return self.to_json()[key]


def report(paths: list[str | Path]) -> Report:
    """Metrics of every run in ``paths``, and S pooled within each configuration."""
    runs = []
    for p in paths:
        for run in read_stall_trace(p).values():
            runs.append(run_metrics(run))
    groups: dict[tuple, list[RunMetrics]] = {}
    for m in runs:
        groups.setdefault((m.source, m.configuration), []).append(m)
    pooled = []
    for (source, configuration), ms in groups.items():
        A = sum(m.committed_tokens for m in ms)
        pooled.append({"source": source, "configuration": configuration, "runs": [m.run_id for m in ms],
                       "committed_tokens": A, "committed_tokens_assumed": sum(m.published["committed_tokens_assumed"] for m in ms),
                       "stall_per_committed_token_ns": sum(m.total_stall_ns for m in ms) / max(A, 1)})
    return Report(runs, pooled, [w for m in runs for w in m.warnings])


def public_report(r: Report) -> dict:
    """The report as JSON (kept for callers of the earlier dict interface)."""
    return r.to_json()


LABEL_CHARS = 20
"""Longest run label in a figure; longer ones keep their start and end around an ellipsis."""


def _short(text: str) -> str:
    if len(text) <= LABEL_CHARS:
        return text
    keep = (LABEL_CHARS - 1) // 2
    return text[:keep] + "\u2026" + text[-keep:]


def _labels(runs: list[RunMetrics]) -> list[str]:
    """Figure labels: run ids, qualified by file name where two runs share one, each at most
    :data:`LABEL_CHARS` characters (distinct runs keep distinct labels: a number is added where
    shortening made two equal)."""
    ids = [m.run_id for m in runs]
    full = [f"{Path(m.source).name}:{m.run_id}" if ids.count(m.run_id) > 1 else m.run_id for m in runs]
    short = [_short(x) for x in full]
    return [f"{i + 1}. {x}" if short.count(x) > 1 else x for i, x in enumerate(short)]


def _legend_outside(ax) -> None:
    """The legend to the right of the axes, never over the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


MAX_LAYER_TICKS = 16
"""At most this many labelled layer ticks, at the default font size."""


def write_plots(r: Report, out_dir: str | Path, predicted: dict | None = None) -> list[Path]:
    """PNG figures: step-stall CDF, stall per layer (one bar per run and layer, side by side), and
    predicted vs measured S (with a gate.json; one bar per measured run). Every run has its own
    legend entry.

    Needs matplotlib (``pip install 'relayout[plots]'``); text output never does.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(None, "--plots needs matplotlib: pip install 'relayout[plots]'") from None
    out = make_dirs(out_dir)
    written = []
    labels = _labels(r.runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, label in zip(r.runs, labels):
        per = np.sort(m.step_stall / m.step_committed) / 1e6
        ax.plot(per, np.arange(1, len(per) + 1) / max(len(per), 1), label=label)
    ax.set_xlabel("stall per committed token in a step (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Step stall CDF")
    _legend_outside(ax)
    written.append(_save(fig, out / "stall_cdf.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    layers = sorted({l for m in r.runs for l in m.layer_stall})
    pos = np.arange(len(layers))
    width = 0.8 / max(len(r.runs), 1)
    for i, (m, label) in enumerate(zip(r.runs, labels)):
        vals = [m.layer_stall.get(l, 0) / max(m.committed_tokens, 1) / 1e6 for l in layers]
        ax.bar(pos - 0.4 + (i + 0.5) * width, vals, width, label=label)
    every = max(1, math.ceil(len(layers) / MAX_LAYER_TICKS))
    ax.set_xticks(pos[::every], [str(l) for l in layers[::every]])
    ax.set_xlabel("layer")
    ax.set_ylabel("stall per committed token (ms)")
    ax.set_title("Stall per layer")
    _legend_outside(ax)
    written.append(_save(fig, out / "stall_per_layer.png"))
    if predicted is not None:
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * (2 + len(r.runs))), 4))
        pred = [predicted["baseline_metrics"]["stall_per_token_s"] * 1e3, predicted["plan_metrics"]["stall_per_token_s"] * 1e3]
        ax.bar([0, 1], pred, 0.8, color="tab:gray", label="predicted (gate.json)")
        colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["tab:blue"])
        for i, (m, label) in enumerate(zip(r.runs, labels)):
            ax.bar([2 + i], [m.stall_per_committed_token_ns / 1e6], 0.8, color=colors[i % len(colors)], label=f"measured {label}")
        ax.set_xticks(np.arange(2 + len(r.runs)), ["predicted baseline", "predicted plan"] + [f"measured {x}" for x in labels])
        ax.set_ylabel("S (ms per committed token)")
        ax.set_title("Predicted vs measured stall")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
        _legend_outside(ax)
        written.append(_save(fig, out / "predicted_vs_measured.png"))
    return written


def _save(fig, path: Path) -> Path:
    """Write a figure crash-safely (temp, fsync, rename); a full disk is one clear error."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        with atomic_output(path) as fh:
            fig.savefig(fh, dpi=110, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def paired_ratio_saving(base: np.ndarray, base_tokens: np.ndarray, new: np.ndarray, new_tokens: np.ndarray,
                        unit: str) -> Interval:
    """``sum base / sum base_tokens - sum new / sum new_tokens`` over paired units (each side divided
    by its *own* committed tokens: runs of different lengths), with a 95% Student-t interval from
    the per-pair savings' spread: ``estimate +/- t(0.975, n - 1) * sd / sqrt(n)``. Measured runs are
    few (a handful of repetitions), where a percentile bootstrap over the pairs is far too narrow
    (over two pairs it spans just the two values)."""
    base, bt, new, nt = (np.asarray(x, dtype=np.float64) for x in (base, base_tokens, new, new_tokens))
    est = float(base.sum() / bt.sum() - new.sum() / nt.sum())
    spread = repetition_interval(base / bt - new / nt, unit)
    half = (spread.high - spread.low) / 2
    return Interval(est, est - half, est + half, unit, spread.n_units)


def compare(paths: list[str | Path]) -> dict:
    """Paired comparison of configurations: each file holds one configuration's repetitions.

    Repetitions pair by order. The first file is the control. Each run's S is its stall over its
    own committed tokens (runs of different lengths compare fairly); speculative bytes per token
    are the treatment's speculative bytes over its committed tokens. Output-token hashes that
    differ between runs claiming to be lossless are a correctness failure, not noise.
    """
    if len(paths) < 2:
        raise InputError(None, "compare needs at least two STALL_TRACE files (a control and a treatment)")
    configs = [[run_metrics(r) for r in read_stall_trace(p).values()] for p in paths]
    failures = _token_mismatches(paths, configs)
    control = configs[0]
    warnings = [w for runs in configs for m in runs for w in m.warnings]
    out = {"control": str(paths[0]), "correctness_failures": failures, "warnings": warnings, "comparisons": []}
    for path, runs in zip(paths[1:], configs[1:]):
        n = min(len(control), len(runs))
        if n == 0:
            raise InputError(path, "no runs")
        base = np.array([m.total_stall_ns for m in control[:n]], dtype=float)
        new = np.array([m.total_stall_ns for m in runs[:n]], dtype=float)
        btok = np.array([m.committed_tokens for m in control[:n]], dtype=float)
        ntok = np.array([m.committed_tokens for m in runs[:n]], dtype=float)
        iv = paired_ratio_saving(base, btok, new, ntok, "repetition")
        diff = base / btok - new / ntok
        sd = float(np.std(diff, ddof=1)) if n > 1 else 0.0
        s0 = float(base.sum() / btok.sum())
        s1 = float(new.sum() / ntok.sum())
        spec = float(sum(m.speculative_bytes for m in runs[:n]) / ntok.sum())
        out["comparisons"].append({
            "treatment": str(path), "pairs": n,
            "control_runs": [m.run_id for m in control[:n]], "treatment_runs": [m.run_id for m in runs[:n]],
            "control_committed_tokens": [int(x) for x in btok], "treatment_committed_tokens": [int(x) for x in ntok],
            "control_stall_per_committed_token_ns": s0, "treatment_stall_per_committed_token_ns": s1,
            "saving_ns": iv.to_json(), "relative_saving": (s0 - s1) / s0 if s0 else None,
            "effect_size_d": float(np.mean(diff) / sd) if sd > 0 else None,
            "speculative_bytes_per_token": spec,
            "stall_conversion_efficiency_ns_per_byte": (s0 - s1) / spec if spec > 0 else None,
            "per_pair_ns": [float(x) for x in diff],
        })
    return out


def _token_mismatches(paths, configs) -> list[str]:
    reference = None
    out = []
    for path, runs in zip(paths, configs):
        for m in runs:
            hashes = {k: v for k, v in m.token_hashes.items() if v is not None}
            if not hashes:
                continue
            if reference is None:
                reference = (f"{path}:{m.run_id}", hashes)
                continue
            ref_name, ref = reference
            for key in sorted(set(ref) & set(hashes)):
                if ref[key] != hashes[key]:
                    out.append(f"run {path}:{m.run_id} emits different tokens than {ref_name} at request:step {key}")
                    break
    return out


def measured_tpot_parts(path) -> TpotParts:
    """C_tok and O_tok of a measured STALL_TRACE (its step records' ``compute_ns``/``other_ns``),
    pooled over its runs by committed tokens."""
    r = report([path])
    c = o = a = 0.0
    for m in r.runs:
        fig = m.to_json()
        if fig["compute_per_committed_token_ns"] is None or fig["other_per_committed_token_ns"] is None:
            raise InputError(path, f"run {m.run_id!r} has no step records with compute_ns and other_ns; "
                                   "TPOT's parts cannot be taken from it")
        n = m.committed_tokens
        c, o, a = c + fig["compute_per_committed_token_ns"] * n, o + fig["other_per_committed_token_ns"] * n, a + n
    return TpotParts(c / a / 1e9, o / a / 1e9, f"measured run {path}: C {c / a / 1e6:.3f} ms and O {o / a / 1e6:.3f} ms per "
                                                 f"committed token over {int(a)} tokens")
