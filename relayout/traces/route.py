"""The ROUTE_TRACE importer: colibrì's routing text into sessions of rows.

A line is ``<call> <row> <layer> <expert>:<gate> ...``. The call counter advances once per
``moe()`` invocation, so a call is one MoE layer of one forward: its lines are its batch rows.
Calls never go back, and inside a call the layer never decreases. Numbers are plain ASCII decimals
(no signs, underscores or exponents in ids), each selection is exactly ``<id>:<gate>`` with a
finite gate, and a (forward, layer, row) appears once outside an MTP head's layer. The file,
plain or zstd, is parsed in blocks of whole lines, vectorised where the text is regular
(:func:`_fast_route_parse`) and line by line otherwise; how calls become forwards, positions and
counts is :mod:`relayout.traces.route_steps`. Malformed input raises
``InputError("file:line", problem)``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import text_blocks
from replay.model.routing import MAX_GATE, MAX_POSITION, MAX_TOP_K, rows_with_repeats

from .route_steps import joined_session, mtp_layers, prompt_starts, route_forwards, route_session, split_every
from .sessions import INT_RE, Limits, SessionRows, check_padding, joined, padded

def _check_rows(where, limits: Limits, layers: np.ndarray, positions: np.ndarray, experts: np.ndarray) -> None:
    """Raise for the first row (in array order) whose layer, position or ids break ``limits``.

    ``where(i)`` names row ``i``; ``experts`` is -1 padded.
    """
    if not len(layers):
        return
    problems = []
    bad = np.flatnonzero(limits.bad_layer(layers))
    if len(bad):
        problems.append((int(bad[0]), limits.layer_problem(int(layers[bad[0]]))))
    bad = np.flatnonzero((positions < 0) | (positions > MAX_POSITION))
    if len(bad):
        problems.append((int(bad[0]), f"row/position {int(positions[bad[0]])} is outside 0..{MAX_POSITION}"))
    bad = np.flatnonzero(((experts >= limits.n_experts) | (experts < -1)).any(axis=1))
    if len(bad):
        row = experts[bad[0]]
        e = int(row[(row >= limits.n_experts) | (row < -1)][0])
        problems.append((int(bad[0]), limits.expert_problem(e)))
    if experts.shape[1] > 1:
        # ids are in -1..32767 unless a problem was found: compare a narrow copy (it is faster)
        bad = np.flatnonzero(rows_with_repeats(experts if problems else experts.astype(np.int16)))
        if len(bad):
            problems.append((int(bad[0]), "an expert is selected twice in one row"))
    if problems:
        i, problem = min(problems)
        raise InputError(where(i), problem)


def _check_width(where, k: int) -> None:
    if k > MAX_TOP_K:
        raise InputError(where, f"{k} selections in one row (at most {MAX_TOP_K})")


_POW10 = 10 ** np.arange(19, dtype=np.int64)
_ROUTE_BYTES = (32, 10, 58, 46, 13)
"""Besides digits, the bytes a regular ROUTE_TRACE holds: space, newline, ':', '.', CR."""
_GATE_RE = re.compile(rb"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _fast_route_parse(data: bytes):
    """Vectorised parse of a regular ROUTE_TRACE; None when the file needs the careful path.

    Regular means: only digits, spaces, ':', '.', newlines (and CR); every non-blank line has the
    same number of selections, each written ``<id>:<int>.<frac>`` with nothing between the parts,
    and the file holds no other ':' or '.'. Anything else goes to the careful line-by-line
    parser, which also produces the ``file:line`` errors. Numbers have at most 18 digits, so
    they are exact in int64.
    """
    u = np.frombuffer(data, dtype=np.uint8)
    if not len(u):
        return None
    # digit runs: the places where "is a digit" flips, alternately a run's start and its end
    isdig = np.zeros(len(u) + 2, dtype=bool)
    np.less(u - np.uint8(48), 10, out=isdig[1:-1])
    allowed = isdig[1:-1].copy()
    for byte in _ROUTE_BYTES:
        allowed |= u == byte
    if not allowed.all():
        return None
    flips = np.flatnonzero(isdig[1:] != isdig[:-1])
    starts, ends = flips[0::2], flips[1::2]
    if not len(starts):
        return None
    newlines = np.flatnonzero(u == 10)
    bounds = np.concatenate([[0], np.searchsorted(starts, newlines), [len(starts)]])
    counts = np.diff(bounds)
    nonblank = np.flatnonzero(counts)
    n_tok = int(counts[nonblank[0]])
    if (n_tok - 3) % 3 or n_tok < 6 or (counts[nonblank] != n_tok).any():
        return None
    k = (n_tok - 3) // 3
    n_rows = len(nonblank)
    # every ':' and '.' is the one inside a selection, directly between its digit runs
    if np.count_nonzero(u == 58) != n_rows * k or np.count_nonzero(u == 46) != n_rows * k:
        return None
    before = u[np.maximum(starts - 1, 0)].reshape(-1, n_tok)
    expect = np.array([32, 32] + [32, 58, 46] * k, dtype=np.uint8)
    if not (before[:, 1:] == expect).all():
        return None
    st = starts.reshape(-1, n_tok)
    en = ends.reshape(-1, n_tok)
    if not ((st[:, 4::3] == en[:, 3::3] + 1).all() and (st[:, 5::3] == en[:, 4::3] + 1).all()):
        return None
    # each column (call, row, layer, then ids, gate integer parts, gate fractions) at its own width
    cols = []
    for pick in (np.s_[:, 0], np.s_[:, 1], np.s_[:, 2], np.s_[:, 3::3], np.s_[:, 4::3], np.s_[:, 5::3]):
        a, b = st[pick], en[pick]
        width = int((b - a).max())
        if width > 18:
            return None
        cols.append(_digit_runs(u, a.ravel(), b.ravel(), width).reshape(a.shape))
    calls, rows, layers, ids, whole, frac = cols
    gates = whole + frac / _POW10[en[:, 5::3] - st[:, 5::3]]
    return calls, rows, layers, ids, gates.astype(np.float32), nonblank + 1


def _digit_runs(u: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int) -> np.ndarray:
    """The values (int64) of the digit runs ``u[starts[i]:ends[i]]``, each at most ``width`` (<= 18)
    digits: Horner's rule over the runs right-aligned, one vectorised step per digit column
    (a column left of a run's start adds 0)."""
    values = np.zeros(len(starts), dtype=np.int64)
    for j in range(width, 0, -1):
        at = ends - j
        digit = u[np.maximum(at, 0)] - np.uint8(48)
        values *= 10
        values += np.where(at >= starts, digit, np.uint8(0))
    return values


def _route_int(tok: bytes, where: str, line: bytes) -> int:
    if not INT_RE.fullmatch(tok):
        raise InputError(where, f"not a ROUTE_TRACE line: {line[:60].decode(errors='replace')!r}")
    if len(tok.lstrip(b"-")) > 18:
        raise InputError(where, f"number {tok[:24].decode()} is out of range (more than 18 digits)")
    return int(tok)


def _careful_route_parse(path: Path, data: bytes, first_line: int = 1):
    """Line-by-line parse of one block of whole lines starting at line ``first_line``; raises the
    first malformed line's error. Returns the arrays :func:`_fast_route_parse` returns (rows
    padded to the block's widest, -1 and NaN)."""
    calls, rows, layers, experts, gates, lines = [], [], [], [], [], []
    k = 0
    for lineno, raw in enumerate(data.split(b"\n"), first_line):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.split()
        where = f"{path}:{lineno}"
        if len(parts) < 4:
            raise InputError(where, "expected '<call> <row> <layer> <expert>:<gate> ...'")
        c, r, l = (_route_int(x, where, line) for x in parts[:3])
        es, gs = [], []
        for p in parts[3:]:
            sel = p.split(b":")
            if len(sel) != 2:
                raise InputError(where, f"selection {p[:30].decode(errors='replace')!r} is not '<expert>:<gate>'")
            es.append(_route_int(sel[0], where, line))
            if not _GATE_RE.fullmatch(sel[1]):
                raise InputError(where, f"gate {sel[1][:30].decode(errors='replace')!r} is not a number")
            g = float(sel[1])
            if not abs(g) <= MAX_GATE:
                raise InputError(where, f"gate {sel[1][:30].decode(errors='replace')!r} is not finite")
            gs.append(g)
        if min(c, r, l, *es) < 0:
            raise InputError(where, "negative call, row, layer or expert id")
        if len(set(es)) != len(es):
            raise InputError(where, "an expert is selected twice in one row")
        _check_width(where, len(es))
        k = max(k, len(es))
        calls.append(c)
        rows.append(r)
        layers.append(l)
        experts.append(es)
        gates.append(gs)
        lines.append(lineno)
    E = np.full((len(experts), k), -1, dtype=np.int64)
    G = np.full((len(experts), k), np.nan, dtype=np.float32)
    for i, (es, gs) in enumerate(zip(experts, gates)):
        E[i, : len(es)] = es  # at most 18 digits: exact in int64, range-checked before narrowing
        G[i, : len(gs)] = gs
    as64 = lambda xs: np.array(xs, dtype=np.int64)
    return as64(calls), as64(rows), as64(layers), E, G, np.array(lines, dtype=np.int64)


ROUTE_BLOCK_BYTES = 2 << 20
"""Text parsed per step by :func:`read_route_trace` (whole lines; a longer line is one block)."""


def read_route_trace(path: Path, n_experts: int | None = None, limits: Limits | None = None,
                     block_bytes: int = ROUTE_BLOCK_BYTES, runtime=None) -> SessionRows:
    """Parse one ROUTE_TRACE text file as one session (:func:`read_route_sessions`)."""
    return read_route_sessions(path, n_experts, limits, block_bytes, runtime)[0]


def read_route_sessions(path: Path, n_experts: int | None = None, limits: Limits | None = None,
                        block_bytes: int = ROUTE_BLOCK_BYTES, runtime=None, split: str | int | None = None) -> list[SessionRows]:
    """Parse one ROUTE_TRACE text file, plain or zstd, in blocks of whole lines, into sessions:
    the file (``split`` None), one per prompt (``"prefill"``: :func:`relayout.traces.route_steps.prompt_starts`; a serve
    process's runtime output gives each its turn's counts, a one-shot run's output, which counts
    every prompt together, the draft depth only), or
    one per ``split`` committed tokens (an int; counted on the whole file first).

    Parameters
    ----------
    path : Path
        The ROUTE_TRACE file.
    n_experts, limits : int, Limits, optional
        What ids and layers may be (:class:`Limits`; its ``mtp_layers`` name an MTP head).
    block_bytes : int
        Text parsed per step.
    runtime : RuntimeCounts, optional
        colibrì's printed counts of the file's run (:mod:`relayout.traces.runtime_output`).
    split : "prefill" or int, optional
        How to cut the file into sessions.

    Returns
    -------
    list of SessionRows
        In file order, named after the file (``name#1``, ``name#2``, ... when cut).

    Each block is parsed vectorised (:func:`_fast_route_parse`, or line by line when it is not
    regular), range-checked, and kept in the trace's narrow dtypes, so memory is the parsed rows
    plus one block's working arrays (a few times ``block_bytes``), whatever the file's size.
    Errors are the whole file's first of each kind, in the order: a malformed line, rows too
    uneven to pad, a value out of range, the call and layer order, a repeated row.
    """
    limits = limits or Limits.make(n_experts)
    parts: dict[str, list] = {key: [] for key in ("calls", "rows", "layers", "experts", "gates", "lines")}
    range_error = None
    n_sel = 0
    for first_line, block in text_blocks(path, block_bytes):
        parsed = _fast_route_parse(block)
        if parsed is None:
            parsed = _careful_route_parse(path, block, first_line)
        else:
            parsed = parsed[:5] + (parsed[5] + (first_line - 1),)
        calls, rows, layers, experts, gates, lines = parsed
        if range_error is not None or not len(calls):
            continue
        try:
            # ranges and an expert twice in a row, for either parser, naming the line
            _check_rows(lambda i: f"{path}:{int(lines[i])}", limits, layers, rows, experts)
        except InputError as exc:
            range_error = exc            # raised once every line has parsed (a malformed line comes first)
            continue
        n_sel += int(np.count_nonzero(experts >= 0))
        for key, arr, dtype in (("calls", calls, np.int64), ("rows", rows, np.int32), ("layers", layers, np.int16),
                                ("experts", experts, np.int16), ("gates", gates, np.float32), ("lines", lines, np.int64)):
            parts[key].append(arr.astype(dtype, copy=False))
    if range_error is None and not parts["calls"]:
        raise InputError(path, "no routing lines")
    if range_error is None:
        k = max(e.shape[1] for e in parts["experts"])
        check_padding(path, sum(len(c) for c in parts["calls"]), k, n_sel)
    if range_error is not None:
        raise range_error
    # each column joined in turn, its blocks freed as it is (memory: the rows plus one column)
    calls, rows, layers, lines = (joined(parts.pop(key)) for key in ("calls", "rows", "layers", "lines"))
    experts = padded(parts.pop("experts"), k, -1)
    gates = padded(parts.pop("gates"), k, np.nan)
    c_start, c_lines, c_first, c_last = _route_calls(path, lines, calls, layers)
    del calls
    mtp = mtp_layers(limits, runtime, c_first, c_last, c_lines)
    forward = route_forwards(c_first, c_last, c_lines, mtp)
    is_mtp = np.isin(layers, list(mtp)) if mtp else np.zeros(len(layers), dtype=bool)
    if is_mtp.any():
        call_of_line = np.repeat(np.arange(len(c_start)), c_lines)
        _check_route_duplicates(path, lines, np.where(is_mtp, int(forward[-1]) + 1 + call_of_line, forward), layers, rows)
        del call_of_line
    else:
        _check_route_duplicates(path, lines, forward, layers, rows)
    F = int(forward[-1]) + 1
    starts = prompt_starts(forward, rows, is_mtp, c_start, c_lines, runtime, split == "prefill")
    turns = runtime.turns if runtime is not None else ()
    if turns and len(turns) != len(starts):
        raise InputError(runtime.source, f"holds {len(turns)} served turns; {path} has {len(starts)} prompts")
    if runtime is not None and runtime.mtp is not None and runtime.mtp != bool(is_mtp.any()) and F > 1:
        raise InputError(runtime.source, ("says the MTP head drafted; " if runtime.mtp else "says no MTP head drafted; ")
                         + f"{path} has {'no' if runtime.mtp else 'an'} MTP head's calls: not this trace's run?")
    if runtime is not None and not turns and len(starts) > 1 and split != "prefill":
        raise InputError(runtime.source, f"counts one prompt; {path} has {len(starts)} (forwards wider than a "
                                         f"decode step of {runtime.draft} drafts): not this trace's run?")
    sessions = []
    for j, (f0, f1) in enumerate(zip(starts, list(starts[1:]) + [F])):
        l0, l1 = np.searchsorted(forward, [f0, f1])
        c0, c1 = np.searchsorted(c_start, [l0, l1])
        name = path.name if len(starts) == 1 else f"{path.name}#{j + 1}"
        part = slice(l0, l1)
        sessions.append(route_session(path, name, forward[part] - f0, layers[part], rows[part], experts[part], gates[part],
                                      is_mtp[part], c_start=c_start[c0:c1] - l0, c_lines=c_lines[c0:c1],
                                      runtime=runtime.turn(j) if turns else runtime if len(starts) == 1 else None,
                                      structure=runtime))
    if split != "prefill" and len(sessions) > 1:
        sessions = [joined_session(path, path.name, sessions, None if turns else runtime)]
    if isinstance(split, int):
        sessions = split_every(sessions[0], split)
    return sessions


def _route_calls(path: Path, lines: np.ndarray, calls: np.ndarray, layers: np.ndarray):
    """The calls of a ROUTE_TRACE: ``(start line index, line count, first layer, last layer)`` per
    call, in file order; errors where the call counter goes back or a call's layer decreases."""
    dc = np.diff(calls)
    back = np.flatnonzero(dc < 0)
    if len(back):
        i = int(back[0]) + 1
        raise InputError(f"{path}:{int(lines[i])}", f"call {int(calls[i])} follows call {int(calls[i - 1])}: "
                                                     "the call counter never goes back")
    down = np.flatnonzero((dc == 0) & (np.diff(layers) < 0))
    if len(down):
        i = int(down[0]) + 1
        raise InputError(f"{path}:{int(lines[i])}", f"layer {int(layers[i])} follows layer {int(layers[i - 1])} inside call "
                                                     f"{int(calls[i])}: a call's layers never decrease")
    start = np.concatenate([[0], np.flatnonzero(dc) + 1])
    n = np.diff(np.append(start, len(calls)))
    return start, n, layers[start].astype(np.int64), layers[start + n - 1].astype(np.int64)


def _check_route_duplicates(path: Path, lines: np.ndarray, group: np.ndarray, layers: np.ndarray, rows: np.ndarray) -> None:
    """A (group, layer, row) twice is an inconsistent trace: name the line that repeats it. The group
    is the forward, or the call for an MTP head's rows (its calls rewrite rows of one forward).

    A group's rows of one layer are consecutive lines (layers never decrease inside a forward),
    so the common case, rows rising inside each such run, is one linear pass.
    """
    if len(rows) < 2:
        return
    same_run = np.diff(layers) == 0
    if not (same_run & (np.diff(rows) <= 0)).any():
        return
    order = np.lexsort((lines, rows, layers, group))
    dup = (np.diff(group[order]) == 0) & (np.diff(layers[order]) == 0) & (np.diff(rows[order]) == 0)
    if not dup.any():
        return
    first, second = lines[order[:-1]][dup], lines[order[1:]][dup]
    j = int(np.argmin(second))
    raise InputError(f"{path}:{int(second[j])}",
                     f"repeats row {int(rows[order[1:]][dup][j])} of layer {int(layers[order[1:]][dup][j])} in the same forward "
                     f"(first at line {int(first[j])}); a new forward starts only where the layer goes down, or repeats "
                     "outside an MTP head's layer")
