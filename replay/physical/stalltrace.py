"""STALL_TRACE analysis: a measured run's records (read by :class:`replay.formats.stalltrace.StallRecords`)
into S, the foreground stall per committed token, with its diagnosis, reports and paired comparisons.

Foreground stall of a (run, request, step, layer) is the measure of the union of the intervals
``[need_ns, ready_ns]`` of its required records that arrived late (ns), so overlapping waits are
never double-counted; ``S = sum of stall / sum of committed tokens``, rejected speculative
positions charged in the numerator and not counted in the denominator. The analysis needs, besides
what the reader requires, ``run_id``, ``request_id``, ``required`` and ``bytes`` in every expert
record, ``issue_ns``/``ready_ns``/``need_ns`` unless the page cache (``tier_served`` ``"ram"``)
served it, and both counts in every step record; what else a run's figures rest on, and what a
STALL_TRACE cannot give, is in :func:`run_metrics`. Figures: :mod:`replay.physical.stallplots`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from containers.errors import InputError
from replay.evaluation.gate import TpotParts
from replay.evaluation.stats import repetition_interval
from replay.formats.interval import Interval
from replay.formats.stalltrace import IO_FIELDS, TIMED, StallRecords, int_field

REQUIRED_EXPERT = ("run_id", "request_id", "layer", "expert_id", "required", "bytes")
"""Fields the analysis needs in every expert record (besides those every record carries)."""
REQUIRED_STEP = ("run_id", "request_id", "committed_tokens", "evaluated_positions")
"""Fields the analysis needs in every step record."""
STALL_TOLERANCE_NS = 1000
STALL_TOLERANCE_REL = 0.01
"""A recorded stall agrees with the interval union within max(1 us, 1%)."""


def _opt(rec: dict, key: str) -> int:
    """``rec[key]`` (checked by the reader), or -1 when the record does not carry it."""
    v = rec.get(key)
    return -1 if v is None else v


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


def read_stall_trace(path: str | Path) -> dict[str, Run]:
    """Read a STALL_TRACE (:class:`replay.formats.stalltrace.StallRecords`, with the fields the
    analysis needs); returns runs by run_id in order of first appearance.

    Parameters
    ----------
    path : str or Path
        The STALL_TRACE file.

    Returns
    -------
    dict of str to Run
        Each run's records as lists, and each step's counts and step record.
    """
    path = Path(path)
    runs: dict[str, Run] = {}
    records = StallRecords(path, REQUIRED_EXPERT, REQUIRED_STEP)
    for where, rec, is_step, (run_id, request, step) in records:
        run = runs.get(run_id)
        if run is None:
            run = runs[run_id] = Run(run_id, str(path), order=len(runs))
        if is_step:
            run.steps[(request, step)] = rec
            continue
        served_ram = rec.get("tier_served") == "ram"
        if served_ram and not all(k in rec for k in TIMED):
            issue = ready = need = 0
        else:
            issue, ready, need = (int_field(rec, k, where) for k in TIMED)
        barrier = None
        if "barrier_enter_ns" in rec and "barrier_exit_ns" in rec:
            barrier = (rec["barrier_enter_ns"], rec["barrier_exit_ns"])
        required = rec["required"]
        run.keys.append((request, step, rec["layer"]))
        run.expert.append(rec["expert_id"])
        run.segment.append(rec.get("segment_id", 0))
        run.required.append(required)
        run.nbytes.append(rec["bytes"])
        run.issue.append(issue)
        run.ready.append(ready)
        run.need.append(need)
        tier = rec.get("tier_at_prediction", rec.get("tier_served"))
        run.already.append(tier == "ram")
        run.speculative.append(rec.get("priority") == "speculative")
        run.used.append(rec.get("used_before_eviction", required))
        run.tier.append(rec.get("tier_served") if isinstance(rec.get("tier_served"), str) else None)
        run.fg_stall.append(_opt(rec, "foreground_stall_ns"))
        run.barrier.append(barrier)
        run.queue_depth.append(_opt(rec, "queue_depth"))
        run.workers.append(_opt(rec, "worker_occupancy"))
        run.io.append(tuple(rec[k] for k in IO_FIELDS) if all(k in rec for k in IO_FIELDS) else None)
    for (run_id, request, step), counts in records.counts.items():
        runs[run_id].declared[(request, step)] = counts
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
    """Every metric one run supports (ns and bytes).

    Token accounting. A step's counts come from its step record when there is one, else from its
    expert records (the reader refuses any disagreement, naming the line). ``committed_tokens`` is
    >= 1 (a step commits an accepted prefix of at least one token) and at most ``evaluated_positions``. A
    step whose records carry no count is charged 1 committed token and reported as *assumed*
    (``committed_tokens_assumed``), as is a step record marked ``"committed_assumed": true``
    (``relayout measure`` marks speculative steps whose acceptance its input trace did not carry).

    Cross-checks (reported, never silently preferred over the interval union):

    * ``foreground_stall_ns`` in expert records is read as the critical-path wait attributed to
      that record, so a (step, layer)'s records sum to its stall; a step record's ``stall_ns`` is the
      step's stall. Either disagreeing with the interval union by more than
      ``max(STALL_TOLERANCE_NS, STALL_TOLERANCE_REL x union)`` (1 us or 1%: a few clock reads and
      the runtime's own rounding) is a warning in the report and counted in ``stall_checks``.
    * ``barrier_enter_ns``/``barrier_exit_ns``: the barrier approximation
      ``W ~ max(0, max ready - t_barrier)``, the time the compute path spends in the join of missing
      experts. The union of a (step, layer)'s ``[barrier_enter, barrier_exit]`` intervals is reported
      as ``barrier_stall_per_committed_token_ns`` next to S (which stays the interval-union
      measure) when records carry them.

    Supporting metrics computed where the records carry what they need:
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
