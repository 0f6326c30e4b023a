"""Importers: the routing traces people already have, into a :class:`RoutingTrace`.

Formats (FACTS sections 3-4, seed Appendix A):

* ``route``: colibrì ``ROUTE_TRACE`` text, ``<call> <row> <layer> <expert>:<gate> ...``; a new
  forward starts where the layer index decreases. A forward of one row is a decode step; a
  multi-row forward before the session's first decode step is prefill, later ones are speculative
  verify steps (their committed count is unknown to the trace and recorded as 1, the minimum).
* ``stall``: the seed's STALL_TRACE JSONL (plain or ``.zst``): expert records keyed by request,
  step and layer; step records carry committed tokens.
* ``mblt``: mbolt's ``MBLT`` v1 binary; a torn last record is dropped with a warning.
* ``coli_usage``: colibrì's learning-cache history: per-(layer, expert) counts only.

Each input file is one session, in the order given. Malformed input raises
``InputError("file:line", problem)``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import iter_jsonl, read_bytes

from .trace import FORWARD_KINDS, RoutingTrace

KIND = {name: i for i, name in enumerate(FORWARD_KINDS)}
MBLT_MAGIC = 0x544C424D


@dataclass
class SessionRows:
    """One session's rows in file order, before assembly."""

    name: str
    forward: np.ndarray   # local forward index per row
    layer: np.ndarray
    position: np.ndarray
    experts: np.ndarray   # [R, k]
    gates: np.ndarray     # [R, k]
    fwd_kind: np.ndarray
    fwd_evaluated: np.ndarray
    fwd_committed: np.ndarray


# ------------------------------------------------------------------ sniffing


def sniff_format(path: Path) -> str:
    """Guess the format of ``path`` from its first bytes."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MBLT_MAGIC:
        return "mblt"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "stall"
    text = head.lstrip()
    if text.startswith(b"{"):
        return "stall"
    if text.startswith(b"-1 ") or text.startswith(b"-2 "):
        return "coli_usage"
    lines = [ln.strip() for ln in text.split(b"\n")]
    first = next((ln for ln in lines if ln and not ln.startswith(b"#")), b"")
    if b":" in first:
        return "route"
    raise InputError(path, "cannot tell the trace format; pass --format route|stall|mblt|coli_usage")


# ------------------------------------------------------------------ ROUTE_TRACE


_POW10 = 10 ** np.arange(19, dtype=np.int64)
_CLASS = np.full(256, 255, dtype=np.uint8)
_CLASS[48:58] = 0
for _byte, _cls in ((32, 1), (10, 2), (58, 3), (46, 4), (13, 5)):
    _CLASS[_byte] = _cls


def _fast_route_parse(data: bytes):
    """Vectorised parse of a regular ROUTE_TRACE; None when the file needs the careful path.

    Regular means: only digits, spaces, ':', '.', newlines; every non-blank line has the same
    number of selections, each written ``<id>:<int>.<frac>``. Anything else goes to the careful
    line-by-line parser, which also produces the ``file:line`` errors.
    """
    u = np.frombuffer(data, dtype=np.uint8)
    if not len(u):
        return None
    cls = _CLASS[u]
    if cls.max() == 255:
        return None
    isdig = cls == 0
    edge = np.diff(isdig.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    ends = np.flatnonzero(edge == -1)
    if not len(starts):
        return None
    lengths = ends - starts
    max_len = int(lengths.max())
    if max_len > 18:
        return None
    digits = u.astype(np.int64) - 48
    values = np.zeros(len(starts), dtype=np.int64)
    for j in range(max_len):
        live = lengths > j
        idx = np.flatnonzero(live) if j else None
        if idx is None:
            values += digits[starts] * _POW10[lengths - 1]
        else:
            values[idx] += digits[starts[idx] + j] * _POW10[lengths[idx] - 1 - j]
    newlines = np.flatnonzero(cls == 2)
    bounds = np.concatenate([[0], np.searchsorted(starts, newlines), [len(starts)]])
    counts = np.diff(bounds)
    nonblank = np.flatnonzero(counts)
    n_tok = int(counts[nonblank[0]])
    if (n_tok - 3) % 3 or n_tok < 6 or (counts[nonblank] != n_tok).any():
        return None
    k = (n_tok - 3) // 3
    before = u[np.maximum(starts - 1, 0)].reshape(-1, n_tok)
    expect = np.array([32, 32] + [32, 58, 46] * k, dtype=np.uint8)
    if not (before[:, 1:] == expect).all():
        return None
    v = values.reshape(-1, n_tok)
    frac_len = lengths.reshape(-1, n_tok)[:, 5::3]
    gates = v[:, 4::3] + v[:, 5::3] / _POW10[frac_len]
    return v[:, 0], v[:, 1], v[:, 2], v[:, 3::3], gates.astype(np.float32), nonblank + 1


def _careful_route_parse(path: Path, data: bytes):
    calls, rows, layers, experts, gates, lines = [], [], [], [], [], []
    k = None
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.split()
        where = f"{path}:{lineno}"
        if len(parts) < 4:
            raise InputError(where, "expected '<call> <row> <layer> <expert>:<gate> ...'")
        try:
            c, r, l = (int(x) for x in parts[:3])
            sel = [p.split(b":") for p in parts[3:]]
            es = [int(s[0]) for s in sel]
            gs = [float(s[1]) if len(s) == 2 else float("nan") for s in sel]
        except ValueError:
            raise InputError(where, f"not a ROUTE_TRACE line: {line[:60].decode(errors='replace')!r}") from None
        if min(c, r, l, *es) < 0:
            raise InputError(where, "negative call, row, layer or expert id")
        if len(set(es)) != len(es):
            raise InputError(where, "an expert is selected twice in one row")
        if k is None:
            k = len(es)
        if len(es) > k:
            k = len(es)
        calls.append(c)
        rows.append(r)
        layers.append(l)
        experts.append(es)
        gates.append(gs)
        lines.append(lineno)
    if not calls:
        raise InputError(path, "no routing lines")
    E = np.full((len(experts), k), -1, dtype=np.int64)
    G = np.full((len(experts), k), np.nan, dtype=np.float32)
    for i, (es, gs) in enumerate(zip(experts, gates)):
        E[i, : len(es)] = es
        G[i, : len(gs)] = gs
    return np.array(calls), np.array(rows), np.array(layers), E, G, np.array(lines)


def read_route_trace(path: Path, n_experts: int | None = None) -> SessionRows:
    """Parse one ROUTE_TRACE text file (one session)."""
    data = read_bytes(path)
    parsed = _fast_route_parse(data)
    if parsed is not None:
        calls, rows, layers, experts, gates, lines = parsed
        if (np.sort(experts, axis=1)[:, 1:] == np.sort(experts, axis=1)[:, :-1]).any():
            parsed = None
    if parsed is None:
        calls, rows, layers, experts, gates, lines = _careful_route_parse(path, data)
    if n_experts is not None and experts.max() >= n_experts:
        bad = int(lines[np.flatnonzero((experts >= n_experts).any(axis=1))[0]])
        raise InputError(f"{path}:{bad}", f"expert id >= {n_experts} (the geometry's experts per layer)")
    forward = np.concatenate([[0], np.cumsum(np.diff(layers) < 0)])
    return _session_from_rows(path.name, forward, layers, rows, experts, gates)


def _session_from_rows(name, forward, layers, position, experts, gates, committed=None, evaluated=None, kinds=None) -> SessionRows:
    n_fwd = int(forward.max()) + 1 if len(forward) else 0
    if evaluated is None:
        evaluated = np.zeros(n_fwd, dtype=np.int64)
        np.maximum.at(evaluated, forward, position + 1)
    if kinds is None:
        kinds = np.where(evaluated == 1, KIND["decode"], KIND["verify"])
        first_decode = np.flatnonzero(evaluated == 1)
        cut = first_decode[0] if len(first_decode) else n_fwd
        kinds[:cut][evaluated[:cut] > 1] = KIND["prefill"]
    if committed is None:
        committed = np.where(kinds == KIND["prefill"], 0, 1)
    return SessionRows(
        name, forward.astype(np.int64), layers.astype(np.int64), position.astype(np.int64),
        experts.astype(np.int64), gates.astype(np.float32),
        np.asarray(kinds, dtype=np.int8), np.asarray(evaluated, dtype=np.int64), np.asarray(committed, dtype=np.int64),
    )


# ------------------------------------------------------------------ STALL_TRACE


def read_stall_trace(path: Path, n_experts: int | None = None) -> list[SessionRows]:
    """Parse a STALL_TRACE JSONL file; each (run_id, request_id) is one session."""
    groups: dict[tuple, dict] = {}
    step_info: dict[tuple, dict] = {}
    order: list[tuple] = []
    for where, rec in iter_jsonl(path):
        sess = (str(rec.get("run_id", "")), str(rec.get("request_id", 0)))
        if sess not in groups:
            groups[sess] = {}
            order.append(sess)
        try:
            step = int(rec["step"])
        except (KeyError, TypeError, ValueError):
            raise InputError(where, "record lacks an integer 'step'") from None
        is_step = rec.get("record") == "step" or "expert_id" not in rec
        info = step_info.setdefault(sess + (step,), {})
        for key in ("evaluated_positions", "committed_tokens"):
            if key in rec:
                try:
                    info[key] = int(rec[key])
                except (TypeError, ValueError):
                    raise InputError(where, f"{key} must be an integer") from None
        if is_step:
            continue
        if rec.get("required") is False:
            continue
        try:
            layer, expert = int(rec["layer"]), int(rec["expert_id"])
            position = int(rec.get("position", 0))
        except (KeyError, TypeError, ValueError):
            raise InputError(where, "expert record needs integer 'layer' and 'expert_id'") from None
        if expert < 0 or layer < 0 or (n_experts is not None and expert >= n_experts):
            raise InputError(where, f"expert id {expert} or layer {layer} out of range")
        gate = rec.get("router_probability")
        cell = groups[sess].setdefault((step, layer, position), {})
        cell.setdefault(expert, float(gate) if isinstance(gate, (int, float)) else float("nan"))
    sessions = []
    for sess in order:
        cells = groups[sess]
        if not cells:
            continue
        keys = sorted(cells)
        steps = sorted({k[0] for k in keys})
        step_index = {s: i for i, s in enumerate(steps)}
        k = max(len(v) for v in cells.values())
        E = np.full((len(keys), k), -1, dtype=np.int64)
        G = np.full((len(keys), k), np.nan, dtype=np.float32)
        for i, key in enumerate(keys):
            items = sorted(cells[key].items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)
            E[i, : len(items)] = [e for e, _ in items]
            G[i, : len(items)] = [g for _, g in items]
        forward = np.array([step_index[k[0]] for k in keys])
        layers = np.array([k[1] for k in keys])
        position = np.array([k[2] for k in keys])
        evaluated = np.array([max(1, step_info.get(sess + (s,), {}).get("evaluated_positions", 1)) for s in steps])
        committed = np.array([step_info.get(sess + (s,), {}).get("committed_tokens", 1) for s in steps])
        if (committed > evaluated).any():
            s = steps[int(np.flatnonzero(committed > evaluated)[0])]
            raise InputError(path, f"step {s} of request {sess[1]} commits more tokens than it evaluated")
        kinds = np.where(evaluated > 1, KIND["verify"], KIND["decode"])
        name = f"{path.name}:{sess[0]}:{sess[1]}" if sess[0] else f"{path.name}:{sess[1]}"
        sessions.append(_session_from_rows(name, forward, layers, position, E, G, committed, evaluated, kinds))
    if not sessions:
        raise InputError(path, "no expert records")
    return sessions


# ------------------------------------------------------------------ MBLT


def read_mblt(path: Path, warnings: list[str]) -> tuple[SessionRows, int]:
    """Parse mbolt's MBLT v1; returns the session and the header's n_expert."""
    data = read_bytes(path)
    if len(data) < 12:
        raise InputError(path, "too short for an MBLT header")
    magic, version, n_expert = struct.unpack_from("<III", data, 0)
    if magic != MBLT_MAGIC:
        raise InputError(path, "bad MBLT magic")
    if version != 1:
        raise InputError(path, f"MBLT version {version} is not supported (expected 1)")
    pos, rec_no = 12, 0
    layers, ks, blocks = [], [], []
    while pos < len(data):
        rec_no += 1
        if pos + 12 > len(data):
            warnings.append(f"{path}: record {rec_no} is torn (header cut at byte {pos}); dropped")
            break
        layer, k, n_tok = struct.unpack_from("<III", data, pos)
        need = 4 * k * n_tok
        if k == 0 or k > 64 or n_tok == 0:
            raise InputError(f"{path}:record {rec_no}", f"implausible record (k={k}, n_tokens={n_tok}) at byte {pos}")
        if pos + 12 + need > len(data):
            warnings.append(f"{path}: record {rec_no} is torn ({len(data) - pos - 12} of {need} id bytes); dropped")
            break
        ids = np.frombuffer(data, dtype="<i4", count=k * n_tok, offset=pos + 12).reshape(n_tok, k)
        if (ids < 0).any() or (ids >= n_expert).any():
            raise InputError(f"{path}:record {rec_no}", f"expert id outside 0..{n_expert - 1}")
        layers.append(layer)
        ks.append(k)
        blocks.append(ids)
        pos += 12 + need
    if not blocks:
        raise InputError(path, "no complete records")
    k = max(ks)
    rec_layer = np.array(layers)
    rec_fwd = np.concatenate([[0], np.cumsum(np.diff(rec_layer) < 0)])
    n_rows = np.array([b.shape[0] for b in blocks])
    E = np.full((int(n_rows.sum()), k), -1, dtype=np.int64)
    row = 0
    for b in blocks:
        E[row : row + b.shape[0], : b.shape[1]] = b
        row += b.shape[0]
    forward = np.repeat(rec_fwd, n_rows)
    layer = np.repeat(rec_layer, n_rows)
    position = np.concatenate([np.arange(n) for n in n_rows])
    G = np.full(E.shape, np.nan, dtype=np.float32)
    return _session_from_rows(path.name, forward, layer, position, E, G), n_expert


# ------------------------------------------------------------------ .coli_usage


def read_coli_usage(path: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """Parse a ``.coli_usage`` file: returns (layers, heat[L, E], n_experts)."""
    text = read_bytes(path).decode("utf-8", errors="replace")
    n_experts = None
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        where = f"{path}:{lineno}"
        try:
            nums = [int(x) for x in parts]
        except ValueError:
            raise InputError(where, "expected integers") from None
        if nums[0] == -1:
            if len(nums) != 3:
                raise InputError(where, "expected '-1 <n_layers> <n_experts>'")
            n_experts = nums[2]
        elif nums[0] == -2:
            continue
        else:
            if len(nums) != 3 or min(nums) < 0:
                raise InputError(where, "expected '<layer> <expert> <count>'")
            if n_experts is not None and nums[1] >= n_experts:
                raise InputError(where, f"expert {nums[1]} >= n_experts {n_experts}")
            entries.append(nums)
    if n_experts is None:
        raise InputError(path, "missing '-1 <n_layers> <n_experts>' header")
    if not entries:
        raise InputError(path, "no usage counts")
    arr = np.array(entries, dtype=np.int64)
    layers = np.unique(arr[:, 0])
    heat = np.zeros((len(layers), n_experts), dtype=np.int64)
    np.add.at(heat, (np.searchsorted(layers, arr[:, 0]), arr[:, 1]), arr[:, 2])
    return layers, heat, n_experts


# ------------------------------------------------------------------ assembly


def assemble(sessions: list[SessionRows], n_experts: int | None, geometry: str, source: str, meta: dict) -> RoutingTrace:
    """Concatenate sessions into one trace with rows sorted by (forward, layer, position)."""
    k = max(s.experts.shape[1] for s in sessions)
    fwd_offset = 0
    parts = {key: [] for key in ("forward", "layer", "position", "experts", "gates")}
    fwd = {key: [] for key in ("session", "kind", "evaluated", "committed")}
    names = []
    for i, s in enumerate(sessions):
        name = s.name if s.name not in names else f"{s.name}#{i}"
        names.append(name)
        pad = k - s.experts.shape[1]
        parts["forward"].append(s.forward + fwd_offset)
        parts["layer"].append(s.layer)
        parts["position"].append(s.position)
        parts["experts"].append(np.pad(s.experts, ((0, 0), (0, pad)), constant_values=-1))
        parts["gates"].append(np.pad(s.gates, ((0, 0), (0, pad)), constant_values=np.nan))
        n = len(s.fwd_kind)
        fwd["session"].append(np.full(n, i))
        fwd["kind"].append(s.fwd_kind)
        fwd["evaluated"].append(s.fwd_evaluated)
        fwd["committed"].append(s.fwd_committed)
        fwd_offset += n
    cat = {key: np.concatenate(v) for key, v in parts.items()}
    order = np.lexsort((cat["position"], cat["layer"], cat["forward"]))
    experts = cat["experts"][order]
    max_id = int(experts.max()) if experts.size else -1
    if n_experts is None:
        n_experts = max_id + 1
    trace = RoutingTrace(
        layers=np.unique(cat["layer"]).astype(np.int16),
        n_experts=int(n_experts),
        top_k=int(k),
        geometry=geometry,
        sessions=names,
        row_forward=cat["forward"][order].astype(np.int32),
        row_layer=cat["layer"][order].astype(np.int16),
        row_position=cat["position"][order].astype(np.int32),
        experts=experts.astype(np.int16),
        gates=cat["gates"][order].astype(np.float32),
        fwd_session=np.concatenate(fwd["session"]).astype(np.int32),
        fwd_kind=np.concatenate(fwd["kind"]).astype(np.int8),
        fwd_evaluated=np.concatenate(fwd["evaluated"]).astype(np.int32),
        fwd_committed=np.concatenate(fwd["committed"]).astype(np.int32),
        source=source,
        meta=meta,
    )
    trace.validate()
    return trace


def import_traces(paths: list[Path], fmt: str | None = None, n_experts: int | None = None, geometry: str = "inferred") -> tuple[RoutingTrace, list[str]]:
    """Import ``paths`` (one session each, in order). Returns the trace and warnings."""
    warnings: list[str] = []
    formats = [fmt or sniff_format(p) for p in paths]
    if len(set(formats)) > 1:
        raise InputError(None, f"inputs mix formats ({', '.join(sorted(set(formats)))}); import them separately")
    kind = formats[0]
    source = ",".join(p.name for p in paths)
    if kind == "coli_usage":
        if len(paths) != 1:
            raise InputError(None, ".coli_usage holds totals, not sessions: import one file")
        layers, heat, E = read_coli_usage(paths[0])
        warnings.append(f"{paths[0]}: .coli_usage holds heat only; co-activation, clustering and replay need per-token routing")
        empty = np.zeros(0, np.int32)
        trace = RoutingTrace(
            layers=layers.astype(np.int16), n_experts=E, top_k=0, geometry=geometry, sessions=[paths[0].name],
            row_forward=empty, row_layer=empty.astype(np.int16), row_position=empty,
            experts=np.zeros((0, 0), np.int16), gates=np.zeros((0, 0), np.float32),
            fwd_session=empty, fwd_kind=empty.astype(np.int8), fwd_evaluated=empty, fwd_committed=empty,
            heat_only=True, heat=heat, source=source, meta={"format": kind},
        )
        return trace, warnings
    sessions: list[SessionRows] = []
    for p in paths:
        if kind == "route":
            sessions.append(read_route_trace(p, n_experts))
        elif kind == "stall":
            sessions.extend(read_stall_trace(p, n_experts))
        elif kind == "mblt":
            s, header_e = read_mblt(p, warnings)
            n_experts = n_experts or header_e
            sessions.append(s)
        else:
            raise InputError(p, f"unknown format {kind!r}")
    meta = {"format": kind}
    if kind == "route":
        meta["committed_known"] = False
    return assemble(sessions, n_experts, geometry, source, meta), warnings
