"""The STALL_TRACE importer: a measured run's required-expert records into sessions of rows.

Records are read by :class:`replay.formats.stalltrace.StallRecords` (every field's rule lives
there). Each (run_id, request_id) is one session and each step one forward; an expert record
marked ``"required": false`` (a speculative load) is not routing and is skipped. Records of the
same (step, layer, position) form one row (a request's expert read per segment, or a repeat,
counts once); a record without ``position`` is position 0, so a step that reads the union of its
positions is one row of that union, its experts ordered by ``router_probability`` (highest
first). A step's counts come from its records; a step evaluating several positions without a
committed count is recorded as committing 1 and marked assumed. Ids and layers must keep the
importer's :class:`relayout.traces.sessions.Limits`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from containers.errors import InputError
from replay.formats.stalltrace import StallRecords
from replay.model.routing import MAX_TOP_K

from .sessions import KIND, Limits, SessionRows, check_padding, session_from_rows


def read_stall_trace(path: Path, n_experts: int | None = None, limits: Limits | None = None) -> list[SessionRows]:
    """Parse a STALL_TRACE file into sessions, one per (run_id, request_id), in order of first record.

    Parameters
    ----------
    path : Path
        The STALL_TRACE file (JSONL, plain or zstd).
    n_experts, limits : int, Limits, optional
        What ids and layers may be (:class:`relayout.traces.sessions.Limits`).

    Returns
    -------
    list of SessionRows
        Named ``file:run:request`` (``file:request`` when the records name no run).
    """
    limits = limits or Limits.make(n_experts)
    groups: dict[tuple, dict] = {}
    order: list[tuple] = []
    n_sel = 0
    records = StallRecords(path)
    for where, rec, is_step, (run_id, request, step) in records:
        sess = (run_id, request)
        if sess not in groups:
            groups[sess] = {}
            order.append(sess)
        if is_step or not rec.get("required", True):
            continue
        layer, expert = rec["layer"], rec["expert_id"]
        if not limits.layer_ok(layer):
            raise InputError(where, limits.layer_problem(layer))
        if not 0 <= expert < limits.n_experts:
            raise InputError(where, limits.expert_problem(expert))
        position = rec.get("position", 0)
        gate = rec.get("router_probability")
        if gate is None:
            gate = float("nan")
        cell = groups[sess].setdefault((step, layer, position), {})
        if expert not in cell:
            if len(cell) >= MAX_TOP_K:
                raise InputError(where, f"more than {MAX_TOP_K} experts in one (step, layer, position)")
            cell[expert] = float(gate)
            n_sel += 1
    sessions = []
    for sess in order:
        cells = groups[sess]
        if not cells:
            continue
        keys = sorted(cells)
        steps = sorted({k[0] for k in keys})
        step_index = {s: i for i, s in enumerate(steps)}
        k = max(len(v) for v in cells.values())
        check_padding(path, len(keys), k, sum(len(v) for v in cells.values()))
        E = np.full((len(keys), k), -1, dtype=np.int64)
        G = np.full((len(keys), k), np.nan, dtype=np.float32)
        for i, key in enumerate(keys):
            items = sorted(cells[key].items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)
            E[i, : len(items)] = [e for e, _ in items]
            G[i, : len(items)] = [g for _, g in items]
        counts = [records.counts.get(sess + (s,), {}) for s in steps]
        forward = np.array([step_index[k[0]] for k in keys], dtype=np.int64)
        layers = np.array([k[1] for k in keys], dtype=np.int64)
        position = np.array([k[2] for k in keys], dtype=np.int64)
        evaluated = np.array([max(1, c.get("evaluated_positions", (1,))[0]) for c in counts], dtype=np.int64)
        committed = np.array([c.get("committed_tokens", (1,))[0] for c in counts], dtype=np.int64)
        assumed = np.array([evaluated[i] > 1 and "committed_tokens" not in c for i, c in enumerate(counts)], dtype=bool)
        if (committed > evaluated).any():
            i = int(np.flatnonzero(committed > evaluated)[0])
            where = next(iter(counts[i].values()))[1] if counts[i] else path
            raise InputError(where, f"step {steps[i]} of request {sess[1]} commits more tokens than it evaluated")
        kinds = np.where(evaluated > 1, KIND["verify"], KIND["decode"])
        name = f"{path.name}:{sess[0]}:{sess[1]}" if sess[0] else f"{path.name}:{sess[1]}"
        sessions.append(session_from_rows(name, forward, layers, position, E, G, committed=committed,
                                          evaluated=evaluated, kinds=kinds, assumed=assumed))
    if not sessions:
        raise InputError(path, "no expert records")
    return sessions
