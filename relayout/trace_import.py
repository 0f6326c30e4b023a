"""Importers: the routing traces people already have, into a :class:`RoutingTrace`.

Formats (FACTS sections 3-4, seed Appendix A):

* ``route``: colibrì ``ROUTE_TRACE`` text, ``<call> <row> <layer> <expert>:<gate> ...``. The
  call counter advances once per ``moe()`` invocation (colibrì's ``rt_trace_end``), so a call is
  one MoE layer of one forward: its lines are its batch rows. Calls never go back, and inside a
  call the layer never decreases (an engine that counts one call per forward keeps its lines
  layer-major). A new forward starts where the layer goes down (colibrì's ``route_pairs.py``
  rule), or repeats on a layer that is not an MTP head's, so a model with one MoE layer has one
  forward per call. An MTP (multi-token prediction) head is a layer past the main model's
  (layer ``num_hidden_layers``) that colibrì calls between forwards: after a forward, one
  *absorb* call whose rows are the drafts it accepted (after the prefill, the prompt's pairs),
  then one *draft* call of one row per draft of the next step. Those calls stay in the forward
  they follow, as in ``route_pairs.py``; where they write a row again, the last write keeps its
  position and the earlier ones are placed after the forward's positions. The head's layer is
  the geometry's, the runtime output's, or the trace's top layer when its calls show as the
  head's (see :func:`_mtp_layers`). The first forward is the prompt's prefill (commits its first
  generated token: 1); later forwards of one row are decode steps, wider ones speculative verify
  steps; evaluated positions are the main model's rows. An MTP verify step commits 1 + its
  absorbed drafts; an n-gram verify step's acceptance is in no line: it is recorded as
  committing 1 (the minimum) and the trace meta says so (``committed_assumed``), as does
  ``relayout measure`` in every such step record, unless colibrì's output of the run is given
  (:mod:`relayout.runtime_output`): its decode forwards must be the trace's and its tokens become
  the session's. A file written by a serve process holds several prompts: each prompt's prefill
  is a forward wider than a decode step (``1 + G`` rows, ``G`` drafts a step, when ``G`` is
  known), its turn's counts come from the output's served turns, and ``split`` makes each prompt
  a session (:func:`read_route_sessions`). Numbers are plain ASCII decimals (no signs,
  underscores or exponents in ids), each selection is exactly ``<id>:<gate>`` with a finite gate,
  and a (forward, layer, row) appears once outside an MTP head's layer.
* ``stall``: the seed's STALL_TRACE JSONL (plain or ``.zst``): expert records keyed by request,
  step and layer; step (and expert) records carry committed tokens, at least 1; a speculative
  step without one is recorded as committing 1 and listed in ``committed_assumed``. Integers must be JSON integers (not
  booleans or floats), ``required`` a boolean, ``router_probability`` a finite number.
* ``mblt``: mbolt's ``MBLT`` v1 binary (a new forward where the layer decreases; multi-token
  forwards before the first one-token forward are prefill, later ones verify steps, acceptance
  assumed). Only a truncated *last* record is a torn tail (dropped
  with a warning): a record that claims more bytes than remain while a valid chain of records
  follows it is mid-file damage, an error naming the record and its byte offset.
* ``coli_usage``: colibrì's learning-cache history: per-(layer, expert) counts only.

Each input file is one session, in the order given (a ROUTE_TRACE may be cut into several). Malformed input raises
``InputError("file:line", problem)`` (``file:record N`` for MBLT).

Ranges are checked on the parsed 64-bit (or Python) integers, before any narrowing to the
trace's int16/int32 arrays. With a geometry, ids must be below its experts per layer and layers
among its routed layers; without one, ids are capped at ``DEFAULT_MAX_EXPERTS - 1`` and layers at
``DEFAULT_MAX_LAYER`` (see :mod:`replay.formats.trace`). Every allocation sized by a file's values is
bounded by those limits and by the file's own size.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import ZSTD_MAGIC, iter_jsonl, read_bytes, text_blocks
from replay.model.routing import DEFAULT_MAX_EXPERTS, DEFAULT_MAX_LAYER, FORWARD_KINDS, INT32_MAX, MAX_EXPERTS, MAX_LAYER, MAX_LAYER_EXPERT_CELLS, MAX_POSITION, MAX_TOP_K, RoutingTrace, rows_with_repeats

KIND = {name: i for i, name in enumerate(FORWARD_KINDS)}
MBLT_MAGIC = 0x544C424D
MBLT_MAX_K = 64
MAX_COUNT = 1 << 36
"""Largest ``.coli_usage`` count (sums over every cell stay far inside int64)."""
INT64_MAX = (1 << 63) - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Gates are stored as float32: larger magnitudes are not finite there."""


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
    fwd_assumed: np.ndarray | None = None   # bool [F]: committed count assumed (acceptance unknown)
    counts: dict | None = None              # how the counts were found (ROUTE_TRACE: MTP layer, runtime output)


@dataclass(frozen=True)
class Limits:
    """What an imported id, layer and position may be: from a geometry, or the default caps."""

    n_experts: int                      # ids must be < n_experts
    layers: frozenset | None = None     # a geometry's routed layers (None: any up to max_layer)
    max_layer: int = DEFAULT_MAX_LAYER
    geometry: str | None = None
    mtp_layers: frozenset = frozenset()  # the geometry's MTP (multi-token prediction) head layers

    @classmethod
    def make(cls, n_experts: int | None, geometry: str = "inferred", routed_layers=None, mtp_layers=None) -> Limits:
        if n_experts is None:
            return cls(DEFAULT_MAX_EXPERTS)
        if mtp_layers is None and routed_layers is None:
            mtp_layers = _shipped_mtp_layers(geometry, n_experts)
        mtp = frozenset(int(x) for x in (mtp_layers or ()))
        if isinstance(n_experts, bool) or not isinstance(n_experts, (int, np.integer)) or not 1 <= n_experts <= MAX_EXPERTS:
            raise InputError(None, f"geometry {geometry} has {n_experts!r} experts per layer; a trace holds 1..{MAX_EXPERTS}")
        if routed_layers is None:
            routed_layers = _shipped_routed_layers(geometry, int(n_experts))
        if routed_layers is not None:
            routed_layers = frozenset(int(x) for x in routed_layers)
            if not routed_layers or min(routed_layers) < 0 or max(routed_layers) > MAX_LAYER:
                raise InputError(None, f"geometry {geometry}'s routed layers do not fit a trace (0..{MAX_LAYER})")
            return cls(int(n_experts), routed_layers, max(routed_layers), geometry, mtp & routed_layers)
        return cls(int(n_experts), None, MAX_LAYER, geometry, mtp)

    def expert_problem(self, e: int) -> str:
        if e < 0:
            return f"expert id {e} is negative"
        if self.geometry:
            return f"expert id {e} >= {self.n_experts} (the geometry's experts per layer, {self.geometry})"
        return (f"expert id {e} is above {self.n_experts - 1} (without --geometry at most "
                f"{self.n_experts} experts per layer are accepted)")

    def layer_problem(self, layer: int) -> str:
        if layer < 0:
            return f"layer {layer} is negative"
        if self.layers is not None:
            lo, hi = min(self.layers), max(self.layers)
            return f"layer {layer} is not a routed layer of geometry {self.geometry} ({lo}-{hi}): wrong geometry?"
        if self.geometry:
            return f"layer {layer} is above {self.max_layer}"
        return f"layer {layer} is above {self.max_layer} (without --geometry layers up to {self.max_layer} are accepted)"

    def bad_layer(self, layers: np.ndarray) -> np.ndarray:
        """Mask of layers outside the limits (vectorised)."""
        out = (layers < 0) | (layers > self.max_layer)
        if self.layers is not None:
            out |= ~np.isin(layers, np.fromiter(self.layers, dtype=np.int64))
        return out

    def layer_ok(self, layer: int) -> bool:
        return 0 <= layer <= self.max_layer and (self.layers is None or layer in self.layers)


def _shipped_geometry(geometry: str, n_experts):
    """The shipped geometry of that name and expert count, else None."""
    if not geometry or geometry == "inferred":
        return None
    try:
        from containers.geometry import geometry_names, load_geometry

        if geometry not in geometry_names():
            return None
        g = load_geometry(geometry)
    except InputError:
        return None
    return g if g.n_routed_experts == n_experts else None


def _shipped_routed_layers(geometry: str, n_experts: int):
    """The routed layers of a shipped geometry of that name and expert count, else None."""
    g = _shipped_geometry(geometry, n_experts)
    return g.routed_layers if g is not None else None


def _shipped_mtp_layers(geometry: str, n_experts):
    """The MTP head layers of a shipped geometry of that name and expert count, else None."""
    g = _shipped_geometry(geometry, n_experts)
    return g.mtp_layer_ids if g is not None else None


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


# ------------------------------------------------------------------ sniffing

TRACE_FORMATS = ("route", "stall", "mblt", "coli_usage")
"""Input formats (see the module doc); :func:`sniff_format` tells them apart."""


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
    raise InputError(path, f"cannot tell the trace format; pass --format {'|'.join(TRACE_FORMATS)}")


# ------------------------------------------------------------------ ROUTE_TRACE


_POW10 = 10 ** np.arange(19, dtype=np.int64)
_ROUTE_BYTES = (32, 10, 58, 46, 13)
"""Besides digits, the bytes a regular ROUTE_TRACE holds: space, newline, ':', '.', CR."""
_INT_RE = re.compile(rb"-?[0-9]+")
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
    if not _INT_RE.fullmatch(tok):
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
            if not abs(g) <= FLOAT32_MAX:
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


def _check_padding(where, n_rows: int, k: int, n_selections: int) -> None:
    """Refuse rows so uneven that padding them to the widest would cost far more than the data."""
    if n_rows * k > 64 * n_selections + (1 << 20):
        raise InputError(where, f"one row selects {k} experts while {n_rows:,} rows hold {n_selections:,} selections: "
                                "padding every row to that width is refused")


ROUTE_BLOCK_BYTES = 2 << 20
"""Text parsed per step by :func:`read_route_trace` (whole lines; a longer line is one block)."""


def read_route_trace(path: Path, n_experts: int | None = None, limits: Limits | None = None,
                     block_bytes: int = ROUTE_BLOCK_BYTES, runtime=None) -> SessionRows:
    """Parse one ROUTE_TRACE text file as one session (:func:`read_route_sessions`)."""
    return read_route_sessions(path, n_experts, limits, block_bytes, runtime)[0]


def read_route_sessions(path: Path, n_experts: int | None = None, limits: Limits | None = None,
                        block_bytes: int = ROUTE_BLOCK_BYTES, runtime=None, split: str | int | None = None) -> list[SessionRows]:
    """Parse one ROUTE_TRACE text file, plain or zstd, in blocks of whole lines, into sessions:
    the file (``split`` None), one per prompt (``"prefill"``: :func:`_prompt_starts`; a serve
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
        colibrì's printed counts of the file's run (:mod:`relayout.runtime_output`).
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
        _check_padding(path, sum(len(c) for c in parts["calls"]), k, n_sel)
    if range_error is not None:
        raise range_error
    # each column joined in turn, its blocks freed as it is (memory: the rows plus one column)
    calls, rows, layers, lines = (_joined(parts.pop(key)) for key in ("calls", "rows", "layers", "lines"))
    experts = _padded(parts.pop("experts"), k, -1)
    gates = _padded(parts.pop("gates"), k, np.nan)
    c_start, c_lines, c_first, c_last = _route_calls(path, lines, calls, layers)
    del calls
    mtp = _mtp_layers(limits, runtime, c_first, c_last, c_lines)
    forward = _route_forwards(c_first, c_last, c_lines, mtp)
    is_mtp = np.isin(layers, list(mtp)) if mtp else np.zeros(len(layers), dtype=bool)
    if is_mtp.any():
        call_of_line = np.repeat(np.arange(len(c_start)), c_lines)
        _check_route_duplicates(path, lines, np.where(is_mtp, int(forward[-1]) + 1 + call_of_line, forward), layers, rows)
        del call_of_line
    else:
        _check_route_duplicates(path, lines, forward, layers, rows)
    F = int(forward[-1]) + 1
    starts = _prompt_starts(forward, rows, is_mtp, c_start, c_lines, runtime, split == "prefill")
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
        sessions.append(_route_session(path, name, forward[part] - f0, layers[part], rows[part], experts[part], gates[part],
                                       is_mtp[part], c_start[c0:c1] - l0, c_lines[c0:c1],
                                       runtime.turn(j) if turns else runtime if len(starts) == 1 else None, runtime))
    if split != "prefill" and len(sessions) > 1:
        sessions = [_joined_session(path, path.name, sessions, None if turns else runtime)]
    if isinstance(split, int):
        sessions = _split_every(sessions[0], split)
    return sessions


def _joined_session(path: Path, name: str, parts: list[SessionRows], runtime) -> SessionRows:
    """The prompts of one file, counted each on its own, as one session (made ``runtime``'s
    counts when given: a run's output that counts every prompt together)."""
    offsets = np.cumsum([0] + [len(p.fwd_kind) for p in parts[:-1]])
    cat = lambda key: np.concatenate([getattr(p, key) for p in parts])
    kinds, evaluated, committed = cat("fwd_kind"), cat("fwd_evaluated"), cat("fwd_committed")
    assumed = np.concatenate([p.fwd_assumed if p.fwd_assumed is not None else np.zeros(len(p.fwd_kind), bool) for p in parts])
    counts = {k: v for k, v in (parts[0].counts or {}).items() if k in ("mtp_layers", "drafts_per_forward")}
    counts["prompts"] = len(parts)
    if runtime is not None:
        _reconcile(path, name, kinds, evaluated, committed, assumed, runtime)
        counts.update(runtime.to_json())
    elif any(p.counts and "tokens" in p.counts for p in parts):
        counts["runtime_output"] = parts[0].counts["runtime_output"].rsplit(" (turn", 1)[0]
        counts["tokens"] = int(committed.sum())
    return SessionRows(name, np.concatenate([p.forward + o for p, o in zip(parts, offsets)]), cat("layer"), cat("position"),
                       cat("experts"), cat("gates"), kinds, evaluated, committed, assumed, counts)


def _route_session(path: Path, name: str, forward, layers, rows, experts, gates, is_mtp, c_start, c_lines, runtime,
                   structure) -> SessionRows:
    """One session's rows and counts (:func:`_route_counts`), made ``runtime``'s counts when given;
    ``structure``: a runtime output read for its draft depth only."""
    if runtime is not None:
        structure = runtime
    elif structure is not None:
        structure = replace(structure, forwards=None, tokens=None, turns=())
    evaluated, kinds, committed, assumed, drafts = _route_counts(forward, rows, is_mtp, c_start, c_lines, structure)
    counts = {}
    if is_mtp.any():
        counts["mtp_layers"] = sorted(int(x) for x in np.unique(layers[is_mtp]))
        counts["drafts_per_forward"] = drafts
    if runtime is not None:
        _reconcile(path, name, kinds, evaluated, committed, assumed, runtime)
        counts.update(runtime.to_json())
    elif structure is not None:
        counts["draft_depth_from"] = Path(structure.source).name
    position = _mtp_positions(forward, layers, rows, is_mtp, evaluated)
    session = _session_from_rows(name, forward, layers, position, experts, gates, committed, evaluated, kinds, assumed)
    session.counts = counts or None
    return session


def _prompt_starts(forward, rows, is_mtp, c_start, c_lines, runtime, split: bool) -> list[int]:
    """The forwards where a ROUTE_TRACE holding several prompts (a serve process's) starts a new
    one: forward 0 and every forward wider than the widest decode step, ``1 + G`` rows with ``G``
    drafts per forward, after one that is not (the chunks of a long prompt follow each other).
    ``G``: the runtime output's; else the MTP head's drafts after the first prefill; else, when
    ``split``, 0 (a run without drafts, as an n-gram drafting run is unless its output is given);
    else unknown, and the file is one prompt."""
    F = int(forward[-1]) + 1
    S = np.zeros(F, dtype=np.int64)
    np.maximum.at(S, forward[~is_mtp], rows[~is_mtp].astype(np.int64) + 1)
    if runtime is not None and runtime.draft is not None:
        G = max(int(runtime.draft), 0)
    elif is_mtp.any():
        head = is_mtp[c_start]
        G = int((head & (forward[c_start] == 0)).sum()) - int(S[0] >= 2)
    elif split:
        G = 0
    else:
        return [0]
    wide = S > 1 + max(G, 0)
    return [0] + [int(f) for f in np.flatnonzero(wide[1:] & ~wide[:-1]) + 1]


def _split_every(s: SessionRows, tokens: int) -> list[SessionRows]:
    """``s`` cut into sessions of about ``tokens`` committed tokens each, at forward boundaries
    (a piece ends with the forward that reaches its share)."""
    cum = np.cumsum(s.fwd_committed)
    ends = np.flatnonzero(np.diff(cum // tokens, prepend=0) > 0) + 1
    bounds = [0] + [int(e) for e in ends if 0 < e < len(cum)] + [len(cum)]
    bounds = sorted(set(bounds))
    out = []
    for j, (f0, f1) in enumerate(zip(bounds[:-1], bounds[1:])):
        r0, r1 = np.searchsorted(s.forward, [f0, f1])
        part = slice(r0, r1)
        piece = SessionRows(f"{s.name}#{j + 1}", s.forward[part] - f0, s.layer[part], s.position[part], s.experts[part],
                            s.gates[part], s.fwd_kind[f0:f1], s.fwd_evaluated[f0:f1], s.fwd_committed[f0:f1],
                            None if s.fwd_assumed is None else s.fwd_assumed[f0:f1],
                            {**(s.counts or {}), "split_from": s.name, "piece": f"{j + 1} of {len(bounds) - 1}"})
        out.append(piece)
    return out


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _padded(parts: list[np.ndarray], k: int, fill) -> np.ndarray:
    """Blocks of rows [n_i, k_i] stacked into one [sum n_i, k] array, padded with ``fill``."""
    if len(parts) == 1 and parts[0].shape[1] == k:
        return parts[0]
    out = np.full((sum(len(p) for p in parts), k), fill, dtype=parts[0].dtype)
    row = 0
    for p in parts:
        out[row:row + len(p), :p.shape[1]] = p
        row += len(p)
    return out


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


def _mtp_layers(limits: Limits, runtime, c_first: np.ndarray, c_last: np.ndarray, c_lines: np.ndarray) -> frozenset:
    """The layers of a session's MTP head: the geometry's, the runtime output's (layer ``n_layers``
    when it drafted with MTP), and the session's top layer when two calls in a row route only it,
    or a call routing only it has another number of rows than the call of a lower layer before it
    (a main-model forward routes every layer once, all its rows in each; the head's absorb and
    draft calls do neither)."""
    mtp = set(limits.mtp_layers)
    if runtime is not None and runtime.mtp and runtime.n_layers is not None:
        mtp.add(int(runtime.n_layers))
    top = int(c_last.max())
    if int(c_first.min()) < top:
        only_top = (c_first == top) & (c_last == top)
        after_lower = only_top[1:] & (c_last[:-1] < top) & (c_first[:-1] == c_last[:-1]) & (c_lines[1:] != c_lines[:-1])
        if (only_top[1:] & only_top[:-1]).any() or after_lower.any():
            mtp.add(top)
    return frozenset(mtp)


def _route_forwards(c_first: np.ndarray, c_last: np.ndarray, n_lines: np.ndarray, mtp: frozenset) -> np.ndarray:
    """Forward index per line. A call starts a forward where the layer goes down, or repeats on a
    layer that is not an MTP head's (a model routing one layer): colibrì's ``route_pairs.py`` rule,
    which keeps an MTP head's absorb and draft calls in the forward they follow."""
    new = np.zeros(len(c_first), dtype=bool)
    new[1:] = (c_first[1:] < c_last[:-1]) | ((c_first[1:] == c_last[:-1]) & ~np.isin(c_first[1:], list(mtp)))
    return np.repeat(np.cumsum(new), n_lines)


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


def _mtp_positions(forward: np.ndarray, layers: np.ndarray, rows: np.ndarray, is_mtp: np.ndarray,
                   evaluated: np.ndarray) -> np.ndarray:
    """Positions of every line: its row, except an MTP head's row that a later call of the same
    forward writes again (colibrì's ``route_pairs.py`` keeps the last write of a (forward, row,
    layer)): those follow the forward's positions (from ``max(evaluated, rows)`` on, in file
    order), so they are kept but pair with no main-model row."""
    position = rows.astype(np.int64)
    sel = np.flatnonzero(is_mtp)
    if not len(sel):
        return position
    f, la, r = forward[sel], layers[sel].astype(np.int64), position[sel]
    order = np.lexsort((sel, r, la, f))
    so = sel[order]
    rewritten = np.zeros(len(so), dtype=bool)
    rewritten[:-1] = (f[order][1:] == f[order][:-1]) & (la[order][1:] == la[order][:-1]) & (r[order][1:] == r[order][:-1])
    if not rewritten.any():
        return position
    top = evaluated.astype(np.int64).copy()
    np.maximum.at(top, f, r + 1)
    moved = np.sort(so[rewritten])
    mf, ml = forward[moved], layers[moved].astype(np.int64)
    starts = np.flatnonzero(np.concatenate([[True], (mf[1:] != mf[:-1]) | (ml[1:] != ml[:-1])]))
    ordinal = np.arange(len(moved)) - np.repeat(starts, np.diff(np.append(starts, len(moved))))
    position[moved] = top[mf] + ordinal
    return position


def _route_counts(forward: np.ndarray, rows: np.ndarray, is_mtp: np.ndarray, c_start: np.ndarray, c_lines: np.ndarray,
                  runtime):
    """Per forward of one session: evaluated positions, kind, committed tokens, whether the count
    is assumed; and the drafts per forward the MTP reading used (None without an MTP head).

    Evaluated: the main model's rows (an MTP head's are not positions of the forward). The prefill
    is the first forward, or its first forwards when colibrì prefilled in chunks
    (:func:`_prefill_forwards`); later forwards are decode (one row) or verify. Committed: 1 for
    the prefill (its first generated token; earlier chunks 0), a decode and, at least, a verify;
    an MTP verify commits 1 + the rows of the head's absorb call that follows it (the accepted
    drafts; colibrì absorbs them before drafting again, one row a draft, ``G`` drafts a forward).
    An n-gram verify's acceptance is in no line: assumed.
    """
    F = int(forward[-1]) + 1
    main = ~is_mtp
    S = np.zeros(F, dtype=np.int64)
    np.maximum.at(S, forward[main], rows[main].astype(np.int64) + 1)
    only_head = np.bincount(forward[main], minlength=F) == 0
    if only_head.any():
        S_all = np.zeros(F, dtype=np.int64)
        np.maximum.at(S_all, forward, rows.astype(np.int64) + 1)
        S[only_head] = S_all[only_head]
    kinds = np.where(S == 1, KIND["decode"], KIND["verify"]).astype(np.int8)
    n_prefill = _prefill_forwards(S, runtime)
    kinds[:n_prefill] = KIND["prefill"]
    c_fwd, c_head = forward[c_start], is_mtp[c_start]
    has_head = bool(c_head.any())
    committed = np.ones(F, dtype=np.int64)
    committed[:n_prefill - 1] = 0
    assumed = kinds == KIND["verify"]
    G = None
    if has_head:
        m = np.bincount(c_fwd[c_head], minlength=F)
        if runtime is not None and runtime.draft:
            G = int(runtime.draft)
        else:   # the widest verify step, or the drafts after the prefill's absorb (when drafting is on)
            G = max(1, int(S[n_prefill:].max()) - 1 if F > n_prefill else 1, int(m[0]) - int(S[0] >= 2))
        head_calls = np.flatnonzero(c_head)
        firsts = head_calls[np.unique(c_fwd[head_calls], return_index=True)[1]]
        r1 = np.zeros(F, dtype=np.int64)
        r1[c_fwd[firsts]] = c_lines[firsts]
        S_next = np.append(S[1:], 0)
        has_next = np.arange(F) < F - 1
        # drafts precede a verify; a one-row step after them is the last one of a run that writes its
        # final token to the KV cache (its drafts are cut to 0 as no token is left to generate)
        last_step = np.arange(F) == F - 2
        drafts = np.where(has_next & ((S_next >= 2) | (m > 1) | last_step), np.minimum(m, G), 0)
        extra = m - drafts
        k = np.where(m == 0, 0, np.where(r1 >= 2, r1, (extra == 1).astype(np.int64)))
        understood = ((m == 0) | (r1 >= 2) | (extra <= 1)) & (k <= S - 1)
        verify = kinds == KIND["verify"]
        committed[verify] = 1 + k[verify]
        assumed = verify & ~understood
        committed[assumed] = 1
    return S, kinds, committed, assumed, G


MAX_VERIFY_ROWS = 64
"""Rows of colibrì's widest verify step (1 + at most 63 drafts)."""


def _prefill_forwards(S: np.ndarray, runtime) -> int:
    """How many leading forwards of a session (rows per forward ``S``) are its prompt's prefill.

    colibrì counts decode forwards only, so with its count the rest are the prefill (when they
    have a chunked prefill's shape; otherwise the output is not this session's). Without it:
    the first forward, or, where colibrì cut a long prompt into chunks (``COLI_PREFILL_CHUNK``):
    two or more leading forwards of the first one's rows, wider than any verify step, then the
    prompt's remainder when it is wider than one row (a one-row remainder reads as a decode step).
    """
    F = len(S)
    if runtime is not None and runtime.forwards is not None and 1 <= F - runtime.forwards:
        n = F - runtime.forwards
        if n == 1 or (S[0] > 1 and (S[:n - 1] == S[0]).all() and S[n - 1] <= S[0]):
            return n                    # chunks of one width, then the remainder
    if F < 2 or S[0] <= MAX_VERIFY_ROWS or S[1] != S[0]:
        return 1
    run = int(np.argmin(np.append(S, -1) == S[0]))
    return run + 1 if run < F and S[run] > 1 else run


def _reconcile(path: Path, name: str, kinds: np.ndarray, evaluated: np.ndarray, committed: np.ndarray,
               assumed: np.ndarray, runtime) -> None:
    """Make a session's counts the runtime output's (in place), or refuse an output that does not
    belong to the trace.

    colibrì counts decode forwards (the prefill excluded) and tokens emitted. Tokens the trace
    cannot place (n-gram verify steps' accepted drafts) go to the verify forwards in proportion to
    their drafts (largest remainder; each at most its drafts), which stay marked assumed unless
    the share is forced (none accepted, or all). One token fewer than the trace's count is the
    last forward's next token, not emitted (the session stopped at its token limit or at EOS, or
    the forward only wrote the KV cache).
    """
    where = runtime.source
    decode_phase = int((kinds != KIND["prefill"]).sum())
    if runtime.forwards is not None and runtime.forwards != decode_phase:
        raise InputError(where, f"reports {runtime.forwards} decode forwards; {path} has {decode_phase} after its "
                                f"prefill: not this trace's run?")
    if runtime.tokens is None:
        return
    free = np.flatnonzero(assumed)
    room = evaluated[free] - committed[free]
    need = runtime.tokens - int(committed.sum())
    if need == -1 and committed[-1] >= 1:
        committed[-1] -= 1
        return
    if not 0 <= need <= int(room.sum()):
        lo, hi = int(committed.sum()) - 1, int(committed.sum() + room.sum())
        raise InputError(where, f"reports {runtime.tokens} tokens; {path}'s forwards commit {lo}..{hi}: not this trace's run?")
    if need and len(free):
        share = need * room / room.sum()
        add = np.floor(share).astype(np.int64)
        rest = need - int(add.sum())
        if rest:
            add[np.argsort(-(share - add), kind="stable")[:rest]] += 1
        committed[free] += add
    if need == 0 or need == int(room.sum()):
        assumed[free] = False


def _session_from_rows(name, forward, layers, position, experts, gates, committed=None, evaluated=None, kinds=None,
                       assumed=None) -> SessionRows:
    """A session from its rows. Without explicit counts: a prefill forward commits 1 token (its
    first generated one), a decode forward 1, a verify forward 1 *assumed* (acceptance unknown)."""
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
        committed = np.ones(n_fwd, dtype=np.int64)
        if assumed is None:
            assumed = np.asarray(kinds) == KIND["verify"]
    if assumed is None:
        assumed = np.zeros(n_fwd, dtype=bool)
    return SessionRows(
        name, forward.astype(np.int64, copy=False), _narrow(layers, np.int16), _narrow(position, np.int32),
        _narrow(experts, np.int16), gates.astype(np.float32, copy=False),
        np.asarray(kinds, dtype=np.int8), np.asarray(evaluated, dtype=np.int64), np.asarray(committed, dtype=np.int64),
        np.asarray(assumed, dtype=bool),
    )


def _narrow(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype``; its values were range-checked by the reader, and this checks again
    that the cast cannot wrap."""
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise ValueError(f"values outside {np.dtype(dtype).name} reached a narrowing cast")
    return a.astype(dtype, copy=False)


# ------------------------------------------------------------------ STALL_TRACE


def _json_int(rec: dict, key: str, where: str, lo: int | None = None, hi: int | None = None, default=None) -> int:
    """``rec[key]`` as an integer in ``lo..hi`` (unchecked when None): a JSON integer, never a
    boolean or a float."""
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(where, f"{key!r} must be an integer, not {v!r}"[:200])
    if lo is not None and not lo <= v <= hi:
        raise InputError(where, f"{key!r} {v} is outside {lo}..{hi}"[:200])
    return v


def _json_key(rec: dict, key: str, where: str, default) -> str:
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise InputError(where, f"{key!r} must be a string or an integer, not {v!r}"[:200])
    return str(v)


def read_stall_trace(path: Path, n_experts: int | None = None, limits: Limits | None = None) -> list[SessionRows]:
    """Parse a STALL_TRACE JSONL file; each (run_id, request_id) is one session.

    Records of the same (step, layer, position) form one row (a request's expert read per
    segment, or a repeat, counts once). A record without ``position`` is position 0, so a step
    that reads the union of its positions is one row of that union.
    """
    limits = limits or Limits.make(n_experts)
    groups: dict[tuple, dict] = {}
    step_info: dict[tuple, dict] = {}
    order: list[tuple] = []
    n_sel = 0
    for where, rec in iter_jsonl(path):
        sess = (_json_key(rec, "run_id", where, ""), _json_key(rec, "request_id", where, 0))
        if sess not in groups:
            groups[sess] = {}
            order.append(sess)
        if "step" not in rec:
            raise InputError(where, "record lacks an integer 'step'")
        step = _json_int(rec, "step", where, 0, INT64_MAX)
        is_step = rec.get("record") == "step" or "expert_id" not in rec
        info = step_info.setdefault(sess + (step,), {})
        for key, lo, hi in (("evaluated_positions", 1, INT32_MAX), ("committed_tokens", 1, INT32_MAX)):
            if key in rec:
                v = _json_int(rec, key, where, lo, hi)
                if info.get(key, v) != v:
                    raise InputError(where, f"{key} {v} contradicts {info[key]} given earlier for step {step}")
                info[key] = v
                info.setdefault("where", where)
        if is_step:
            continue
        required = rec.get("required", True)
        if not isinstance(required, bool):
            raise InputError(where, f"'required' must be true or false, not {required!r}"[:200])
        if not required:
            continue
        if "layer" not in rec:
            raise InputError(where, "expert record needs integer 'layer' and 'expert_id'")
        layer = _json_int(rec, "layer", where)
        expert = _json_int(rec, "expert_id", where)
        if not limits.layer_ok(layer):
            raise InputError(where, limits.layer_problem(layer))
        if not 0 <= expert < limits.n_experts:
            raise InputError(where, limits.expert_problem(expert))
        position = _json_int(rec, "position", where, 0, MAX_POSITION, default=0)
        gate = rec.get("router_probability")
        if gate is None:
            gate = float("nan")
        elif isinstance(gate, bool) or not isinstance(gate, (int, float)) or not abs(gate) <= FLOAT32_MAX:
            raise InputError(where, f"'router_probability' must be a finite number, not {gate!r}"[:200])
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
        _check_padding(path, len(keys), k, sum(len(v) for v in cells.values()))
        E = np.full((len(keys), k), -1, dtype=np.int64)
        G = np.full((len(keys), k), np.nan, dtype=np.float32)
        for i, key in enumerate(keys):
            items = sorted(cells[key].items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)
            E[i, : len(items)] = [e for e, _ in items]
            G[i, : len(items)] = [g for _, g in items]
        forward = np.array([step_index[k[0]] for k in keys], dtype=np.int64)
        layers = np.array([k[1] for k in keys], dtype=np.int64)
        position = np.array([k[2] for k in keys], dtype=np.int64)
        evaluated = np.array([max(1, step_info.get(sess + (s,), {}).get("evaluated_positions", 1)) for s in steps], dtype=np.int64)
        committed = np.array([step_info.get(sess + (s,), {}).get("committed_tokens", 1) for s in steps], dtype=np.int64)
        assumed = np.array([evaluated[i] > 1 and "committed_tokens" not in step_info.get(sess + (s,), {})
                            for i, s in enumerate(steps)], dtype=bool)
        if (committed > evaluated).any():
            s = steps[int(np.flatnonzero(committed > evaluated)[0])]
            info = step_info.get(sess + (s,), {})
            raise InputError(info.get("where", path), f"step {s} of request {sess[1]} commits more tokens than it evaluated")
        kinds = np.where(evaluated > 1, KIND["verify"], KIND["decode"])
        name = f"{path.name}:{sess[0]}:{sess[1]}" if sess[0] else f"{path.name}:{sess[1]}"
        sessions.append(_session_from_rows(name, forward, layers, position, E, G, committed, evaluated, kinds, assumed))
    if not sessions:
        raise InputError(path, "no expert records")
    return sessions


# ------------------------------------------------------------------ MBLT


def _mblt_record(data: bytes, pos: int, n_expert: int, k_expected: int | None, limits: Limits):
    """The record at ``pos`` if it is complete and plausible: ``(layer, ids [n, k], end)``, else None."""
    if pos + 12 > len(data):
        return None
    layer, k, n_tok = struct.unpack_from("<III", data, pos)
    if not 1 <= k <= MBLT_MAX_K or n_tok == 0 or (k_expected is not None and k != k_expected) or not limits.layer_ok(layer):
        return None
    end = pos + 12 + 4 * k * n_tok
    if end > len(data):
        return None
    ids = np.frombuffer(data, dtype="<i4", count=k * n_tok, offset=pos + 12).reshape(n_tok, k)
    if (ids < 0).any() or (ids >= n_expert).any():
        return None
    if k > 1:
        s = np.sort(ids, axis=1)
        if (s[:, 1:] == s[:, :-1]).any():
            return None
    return layer, ids, end


def _mblt_reaches_end(data: bytes, pos: int, n_expert: int, k: int, limits: Limits, memo: dict) -> bool:
    """Whether plausible complete records run from ``pos`` to the end of ``data``, the last one
    possibly torn (a cut header, or a plausible header whose ids run past the end)."""
    visited = []
    while True:
        if pos in memo:
            ok = memo[pos]
            break
        visited.append(pos)
        if pos == len(data):
            ok = True
            break
        rec = _mblt_record(data, pos, n_expert, k, limits)
        if rec is None:
            if pos + 12 > len(data):
                ok = True
            else:
                layer, kk, n_tok = struct.unpack_from("<III", data, pos)
                ok = kk == k and n_tok > 0 and limits.layer_ok(layer) and pos + 12 + 4 * kk * n_tok > len(data)
            break
        pos = rec[2]
    for p in visited:
        memo[p] = ok
    return ok


def _mblt_damage_follows(data: bytes, pos: int, k: int, n_expert: int, limits: Limits):
    """For the record at ``pos``, which claims more bytes than remain: the byte offset of a complete
    record (of the file's ``k``) after it from which valid records run to the end of the file, so
    the record is damaged mid-file rather than torn; None when there is none."""
    words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
    first = (pos + 12) // 4
    if len(words) < first + 3:
        return None
    lay, kk, nt = words[first:-2].astype(np.int64), words[first + 1:-1], words[first + 2:]
    cand = np.flatnonzero((kk == k) & (nt > 0) & ~limits.bad_layer(lay)) + first
    memo: dict = {}
    for i in cand.tolist():
        q = 4 * i
        rec = _mblt_record(data, q, n_expert, k, limits)
        if rec is not None and _mblt_reaches_end(data, rec[2], n_expert, k, limits, memo):
            return q
    return None


def read_mblt(path: Path, warnings: list[str], limits: Limits | None = None) -> tuple[SessionRows, int]:
    """Parse mbolt's MBLT v1; returns the session and the header's n_expert."""
    limits = limits or Limits.make(None)
    data = read_bytes(path)
    if len(data) < 12:
        raise InputError(path, "too short for an MBLT header")
    magic, version, n_expert = struct.unpack_from("<III", data, 0)
    if magic != MBLT_MAGIC:
        raise InputError(path, "bad MBLT magic")
    if version != 1:
        raise InputError(path, f"MBLT version {version} is not supported (expected 1)")
    if n_expert == 0:
        raise InputError(path, "MBLT header says 0 experts per layer")
    if n_expert > limits.n_experts:
        if limits.geometry:
            raise InputError(path, f"MBLT header says {n_expert} experts per layer; geometry {limits.geometry} has {limits.n_experts}")
        raise InputError(path, f"MBLT header says {n_expert} experts per layer; without --geometry at most {limits.n_experts} are accepted")
    pos, rec_no = 12, 0
    layers, blocks = [], []
    k_first = None
    prev_layer = None
    while pos < len(data):
        rec_no += 1
        where = f"{path}:record {rec_no}"
        if pos + 12 > len(data):
            warnings.append(f"{path}: record {rec_no} is torn (header cut at byte {pos}); dropped")
            break
        layer, k, n_tok = struct.unpack_from("<III", data, pos)
        if k == 0 or k > MBLT_MAX_K or n_tok == 0:
            raise InputError(where, f"implausible record (k={k}, n_tokens={n_tok}) at byte {pos}")
        if not limits.layer_ok(layer):
            raise InputError(where, f"{limits.layer_problem(layer)} (record at byte {pos})")
        need = 4 * k * n_tok
        if pos + 12 + need > len(data):
            follow = _mblt_damage_follows(data, pos, k_first, n_expert, limits) if blocks else None
            if follow is not None:
                raise InputError(where, f"record at byte {pos} claims {n_tok:,} tokens x {k} ids, more than the file holds, "
                                        f"but valid records follow at byte {follow}: the file is damaged mid-file")
            warnings.append(f"{path}: record {rec_no} is torn ({len(data) - pos - 12} of {need} id bytes); dropped")
            break
        if prev_layer is not None and layer == prev_layer:
            raise InputError(where, f"repeats layer {layer} of the same forward (record at byte {pos}); "
                                    "a new forward starts only where the layer number decreases")
        ids = np.frombuffer(data, dtype="<i4", count=k * n_tok, offset=pos + 12).reshape(n_tok, k)
        if (ids < 0).any() or (ids >= n_expert).any():
            raise InputError(where, f"expert id outside 0..{n_expert - 1} (record at byte {pos})")
        if k > 1:
            s = np.sort(ids, axis=1)
            if (s[:, 1:] == s[:, :-1]).any():
                raise InputError(where, f"an expert is selected twice in one row (record at byte {pos})")
        k_first = k_first or k
        layers.append(layer)
        blocks.append(ids)
        prev_layer = layer
        pos += 12 + need
    if not blocks:
        raise InputError(path, "no complete records")
    k = max(b.shape[1] for b in blocks)
    n_rows = np.array([b.shape[0] for b in blocks], dtype=np.int64)
    _check_padding(path, int(n_rows.sum()), k, sum(b.size for b in blocks))
    rec_layer = np.array(layers, dtype=np.int64)
    rec_fwd = np.concatenate([[0], np.cumsum(np.diff(rec_layer) < 0)])
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


def read_coli_usage(path: Path, limits: Limits | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Parse a ``.coli_usage`` file: returns (layers, heat[L, E], n_experts).

    The header's expert count must be plausible (the geometry's, or at most
    ``DEFAULT_MAX_EXPERTS``) and the heat table is sized by it and by the layers actually listed,
    so a lying header cannot make a large allocation. A (layer, expert) listed twice is an error.
    """
    limits = limits or Limits.make(None)
    text = read_bytes(path).decode("utf-8", errors="replace")
    n_experts = None
    entries, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        where = f"{path}:{lineno}"
        if not all(_INT_RE.fullmatch(x.encode()) for x in parts):
            raise InputError(where, "expected integers")
        if any(len(x.lstrip("-")) > 18 for x in parts):
            raise InputError(where, "a number is out of range (more than 18 digits)")
        nums = [int(x) for x in parts]
        if nums[0] == -1:
            if len(nums) != 3:
                raise InputError(where, "expected '-1 <n_layers> <n_experts>'")
            n_layers, e = nums[1], nums[2]
            if not 1 <= n_layers <= MAX_LAYER + 1:
                raise InputError(where, f"header says {n_layers} layers (expected 1..{MAX_LAYER + 1})")
            if limits.geometry and e != limits.n_experts:
                raise InputError(where, f"header says {e} experts per layer; geometry {limits.geometry} has {limits.n_experts}")
            if not 1 <= e <= limits.n_experts:
                raise InputError(where, f"header says {e} experts per layer (expected 1..{limits.n_experts}; "
                                        "pass --geometry for a larger model)")
            if n_experts is not None and e != n_experts:
                raise InputError(where, f"a second header says {e} experts per layer, the first said {n_experts}")
            n_experts = e
        elif nums[0] == -2:
            continue
        else:
            if len(nums) != 3 or min(nums) < 0:
                raise InputError(where, "expected '<layer> <expert> <count>'")
            layer, expert, count = nums
            if not limits.layer_ok(layer):
                raise InputError(where, limits.layer_problem(layer))
            if expert >= (n_experts or limits.n_experts):
                raise InputError(where, f"expert {expert} >= n_experts {n_experts}" if n_experts else limits.expert_problem(expert))
            if count > MAX_COUNT:
                raise InputError(where, f"count {count} is implausibly large (at most {MAX_COUNT})")
            if (layer, expert) in seen:
                raise InputError(where, f"layer {layer} expert {expert} is listed twice (first at line {seen[layer, expert]})")
            seen[layer, expert] = lineno
            entries.append(nums)
    if n_experts is None:
        raise InputError(path, "missing '-1 <n_layers> <n_experts>' header")
    if not entries:
        raise InputError(path, "no usage counts")
    arr = np.array(entries, dtype=np.int64)
    if int(arr[:, 1].max()) >= n_experts:
        bad = next(i for i, e in enumerate(entries) if e[1] >= n_experts)
        raise InputError(path, f"expert {entries[bad][1]} >= n_experts {n_experts} (listed before the header)")
    layers = np.unique(arr[:, 0])
    if len(layers) * n_experts > MAX_LAYER_EXPERT_CELLS:
        raise InputError(path, f"{len(layers)} layers x {n_experts} experts is more than {MAX_LAYER_EXPERT_CELLS:,} cells")
    heat = np.zeros((len(layers), n_experts), dtype=np.int64)
    np.add.at(heat, (np.searchsorted(layers, arr[:, 0]), arr[:, 1]), arr[:, 2])
    return layers, heat, n_experts


# ------------------------------------------------------------------ assembly


def assemble(sessions: list[SessionRows], n_experts: int | None, geometry: str, source: str, meta: dict) -> RoutingTrace:
    """Concatenate sessions into one trace with rows sorted by (forward, layer, position).

    Every value has been range-checked by its reader; the narrowing casts below cannot wrap.
    """
    k = max(s.experts.shape[1] for s in sessions)
    n_rows = sum(len(s.forward) for s in sessions)
    n_fwd = sum(len(s.fwd_kind) for s in sessions)
    _check_padding(source or None, n_rows, k, sum(int((s.experts >= 0).sum()) for s in sessions))
    if n_rows > INT32_MAX or n_fwd > INT32_MAX:
        raise InputError(source or None, f"{n_rows:,} rows in {n_fwd:,} forwards: more than the trace format holds")
    fwd_offset = 0
    parts = {key: [] for key in ("forward", "layer", "position", "experts", "gates")}
    fwd = {key: [] for key in ("session", "kind", "evaluated", "committed")}
    names = []
    for i, s in enumerate(sessions):
        name = s.name if s.name not in names else f"{s.name}#{i}"
        names.append(name)
        parts["forward"].append(s.forward + fwd_offset)
        parts["layer"].append(s.layer)
        parts["position"].append(s.position)
        parts["experts"].append(s.experts)
        parts["gates"].append(s.gates)
        n = len(s.fwd_kind)
        fwd["session"].append(np.full(n, i))
        fwd["kind"].append(s.fwd_kind)
        fwd["evaluated"].append(s.fwd_evaluated)
        fwd["committed"].append(s.fwd_committed)
        fwd_offset += n
    meta = dict(meta)
    assumed = {}
    for name, s in zip(names, sessions):
        if s.fwd_assumed is not None and s.fwd_assumed.any():
            assumed[name] = s
    meta.pop("committed_assumed", None)
    counted = {name: s.counts for name, s in zip(names, sessions) if s.counts}
    if counted:
        meta["session_counts"] = counted
    from_runtime = [name for name, c in counted.items() if "tokens" in c]
    if from_runtime:
        meta["committed_from_runtime_output"] = from_runtime
    if assumed:
        by_kind = all(np.array_equal(s.fwd_assumed, s.fwd_kind == KIND["verify"]) for s in sessions if s.fwd_assumed is not None)
        reason = ("speculative (verify) forwards whose acceptance the trace does not carry: committed = 1, "
                  "the minimum, is assumed; S and every per-token figure over them depend on it")
        if any(name in from_runtime for name in assumed):
            reason = ("speculative (verify) forwards whose acceptance the trace does not carry: their session's tokens are "
                      "the runtime output's, shared among them in proportion to their drafts"
                      + ("" if all(name in from_runtime for name in assumed) else
                         "; in sessions without runtime output committed = 1, the minimum, is assumed"))
        info = {"forwards": int(sum(int(s.fwd_assumed.sum()) for s in assumed.values())),
                "tokens": int(sum(int(s.fwd_committed[s.fwd_assumed].sum()) for s in assumed.values())),
                "reason": reason}
        if by_kind:
            info["kinds"] = ["verify"]
        else:
            info["session_forwards"] = {name: np.flatnonzero(s.fwd_assumed).tolist() for name, s in assumed.items()}
        meta["committed_assumed"] = info
    cat = {key: _joined(v) for key, v in parts.items() if key not in ("experts", "gates")}
    cat["experts"], cat["gates"] = _padded(parts.pop("experts"), k, -1), _padded(parts.pop("gates"), k, np.nan)
    del parts
    f, la, po = cat["forward"], cat["layer"], cat["position"]
    df, dl = np.diff(f), np.diff(la.astype(np.int32))
    if ((df < 0) | ((df == 0) & ((dl < 0) | ((dl == 0) & (np.diff(po) <= 0))))).any():
        order = np.lexsort((po, la, f))
        cat = {key: v[order] for key, v in cat.items()}
    del df, dl
    experts = cat["experts"]
    max_id = int(experts.max()) if experts.size else -1
    if n_experts is None:
        n_experts = max_id + 1
    trace = RoutingTrace(
        layers=np.unique(cat["layer"]).astype(np.int16),
        n_experts=int(n_experts),
        top_k=int(k),
        geometry=geometry,
        sessions=names,
        row_forward=cat.pop("forward").astype(np.int32),
        row_layer=cat.pop("layer").astype(np.int16, copy=False),
        row_position=cat.pop("position").astype(np.int32, copy=False),
        experts=cat.pop("experts").astype(np.int16, copy=False),
        gates=cat.pop("gates").astype(np.float32, copy=False),
        fwd_session=np.concatenate(fwd["session"]).astype(np.int32),
        fwd_kind=np.concatenate(fwd["kind"]).astype(np.int8),
        fwd_evaluated=np.concatenate(fwd["evaluated"]).astype(np.int32),
        fwd_committed=np.concatenate(fwd["committed"]).astype(np.int32),
        source=source,
        meta=meta,
    )
    trace.validate()
    return trace


def import_traces(paths: list[Path], fmt: str | None = None, n_experts: int | None = None, geometry: str = "inferred",
                  routed_layers=None, mtp_layers=None, runtime_outputs: list[Path] | None = None,
                  split: str | int | None = None) -> tuple[RoutingTrace, list[str]]:
    """Import ``paths`` (one session each, in order). Returns the trace and warnings.

    With ``n_experts`` (a geometry's experts per layer) ids must be below it; layers must be
    among ``routed_layers``, or, when that is not given, among the routed layers of the shipped
    geometry named ``geometry`` (if there is one with that expert count). Without a geometry the
    default caps apply (:class:`Limits`). ``mtp_layers``: the geometry's MTP head layers.

    ``runtime_outputs``: for ROUTE_TRACE inputs, colibrì's saved output of each input's run, in
    the same order (:mod:`relayout.runtime_output`); each session's counts are made its run's.
    ``split``: for ROUTE_TRACE inputs, ``"prefill"`` makes each prompt of a file a session, an
    int N a session of every N committed tokens (:func:`read_route_sessions`).
    """
    warnings: list[str] = []
    formats = [fmt or sniff_format(p) for p in paths]
    if len(set(formats)) > 1:
        raise InputError(None, f"inputs mix formats ({', '.join(sorted(set(formats)))}); import them separately")
    kind = formats[0]
    source = ",".join(p.name for p in paths)
    limits = Limits.make(n_experts, geometry, routed_layers, mtp_layers)
    runtime = [None] * len(paths)
    if split is not None and kind != "route":
        raise InputError(None, f"splitting into sessions is for ROUTE_TRACE inputs, not {kind}")
    if isinstance(split, int) and split < 1:
        raise InputError(None, f"a session of {split} tokens: give at least 1")
    if runtime_outputs:
        if kind != "route":
            raise InputError(None, f"runtime output is read for ROUTE_TRACE inputs only, not {kind}")
        if len(runtime_outputs) != len(paths):
            raise InputError(None, f"{len(runtime_outputs)} runtime outputs for {len(paths)} inputs: give one per input, in order")
        from .runtime_output import read_runtime_output

        runtime = [read_runtime_output(Path(r)) for r in runtime_outputs]
    if kind == "coli_usage":
        if len(paths) != 1:
            raise InputError(None, ".coli_usage holds totals, not sessions: import one file")
        layers, heat, E = read_coli_usage(paths[0], limits)
        warnings.append(f"{paths[0]}: .coli_usage holds heat only; co-activation, clustering and replay need per-token routing")
        empty = np.zeros(0, np.int32)
        trace = RoutingTrace(
            layers=layers.astype(np.int16), n_experts=E, top_k=0, geometry=geometry, sessions=[paths[0].name],
            row_forward=empty, row_layer=empty.astype(np.int16), row_position=empty,
            experts=np.zeros((0, 0), np.int16), gates=np.zeros((0, 0), np.float32),
            fwd_session=empty, fwd_kind=empty.astype(np.int8), fwd_evaluated=empty, fwd_committed=empty,
            heat_only=True, heat=heat, source=source, meta={"format": kind},
        )
        trace.validate()
        return trace, warnings
    sessions: list[SessionRows] = []
    mblt_experts = 0
    for p, run in zip(paths, runtime):
        if kind == "route":
            sessions.extend(read_route_sessions(p, limits=limits, runtime=run, split=split))
        elif kind == "stall":
            sessions.extend(read_stall_trace(p, limits=limits))
        elif kind == "mblt":
            s, header_e = read_mblt(p, warnings, limits)
            mblt_experts = max(mblt_experts, header_e)
            sessions.append(s)
        else:
            raise InputError(p, f"unknown format {kind!r}")
    if kind == "mblt" and n_experts is None:
        n_experts = mblt_experts
    meta = {"format": kind}
    return assemble(sessions, n_experts, geometry, source, meta), warnings
