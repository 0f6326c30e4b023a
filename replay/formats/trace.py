"""The canonical routing trace: numpy arrays in memory, a versioned zstd file on disk.

A trace is a sequence of *forwards* (one runtime step: a decode token, a prefill chunk, a
speculative verify). Each forward evaluates some positions; for each position and each routed
layer there is one *row*: the expert ids the router chose, in selection order, and their gate
scores when known. Per forward we keep the session it belongs to, its kind, how many positions it
evaluated and how many tokens it committed.

Rows are stored sorted by (forward, layer, position). Expert ids are padded with -1 when a row has
fewer than ``top_k`` selections; gates are NaN when unknown.

A heat-only trace (``.coli_usage``) has no rows, only per-layer expert counts; anything that needs
co-activation refuses it with a message saying so.

File format (version 2): ``RLTRACE\0``, u32 version, u32 header length, the xxh3-128 digest (16
bytes, big-endian) of everything after it (a zstd stream of the JSON header then the raw arrays)
and of the version and length fields, then that stream. The digest is checked before anything is
decompressed, so a flipped bit anywhere is one "damaged" error. Version 1 files (no digest) are
still read, unverified. Every header value is checked (types, array names, dtypes and shapes
against each other and against the limits below) before it sizes any allocation, and
:meth:`RoutingTrace.validate` checks the content.

Limits (ids and layers are stored as int16, positions and counts as int32): expert ids
0..32767, layers 0..32767, at most ``MAX_TOP_K`` selections per row, at most
``MAX_LAYER_EXPERT_CELLS`` (layer, expert) cells; importers without a geometry also cap ids and
layers at ``DEFAULT_MAX_EXPERTS`` / ``DEFAULT_MAX_LAYER``.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections import namedtuple
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.hashing import digest_of
from containers.jsonfile import parse_json

RowBlock = namedtuple("RowBlock", "row_forward row_layer experts")
"""Consecutive rows of a trace: the row arrays a replay reads (see :class:`RoutingTrace`)."""

MAGIC = b"RLTRACE\0"
VERSION = 2
OLD_VERSIONS = (1,)
"""Versions read without verification (they carry no digest)."""

INT16_MAX = int(np.iinfo(np.int16).max)
INT32_MAX = int(np.iinfo(np.int32).max)
MAX_EXPERTS = INT16_MAX + 1
"""Experts per layer the file format can hold (ids are int16)."""
MAX_LAYER = INT16_MAX
DEFAULT_MAX_EXPERTS = 4096
"""Experts per layer accepted from a trace imported without a geometry."""
DEFAULT_MAX_LAYER = 4095
"""Highest layer number accepted from a trace imported without a geometry."""
MAX_TOP_K = 256
"""Selections per row (a STALL_TRACE verify step's row is the union over its positions)."""
MAX_POSITION = INT32_MAX - 1
"""Highest position in a forward (evaluated positions = position + 1 must fit int32)."""
MAX_LAYER_EXPERT_CELLS = 1 << 24
"""Layers x experts per layer: bounds every [L, E] array (128 MiB of int64)."""

DTYPES = {
    "row_forward": "<i4", "row_layer": "<i2", "row_position": "<i4", "experts": "<i2", "gates": "<f4",
    "fwd_session": "<i4", "fwd_kind": "|i1", "fwd_evaluated": "<i4", "fwd_committed": "<i4", "heat": "<i8",
}
"""The stored dtype of every array."""

FORWARD_KINDS = ("decode", "prefill", "verify", "unknown")
"""Kinds of forward. ``verify`` is a multi-position speculative step."""


class _ReadOnUse:
    """A :class:`RoutingTrace` array that :func:`load_trace` leaves in its file until first used
    (the gates: most of a trace's bytes, read by no replay or plan). Assigning an array sets it;
    assigning a :class:`_Deferred` defers it. (As a dataclass field it has no default.)"""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            raise AttributeError(self.slot)
        value = obj.__dict__[self.slot]
        if isinstance(value, _Deferred):
            value = obj.__dict__[self.slot] = value.read()
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value


def _deferred(trace: "RoutingTrace", name: str) -> bool:
    """The array ``name`` of ``trace`` is still in its file."""
    return isinstance(trace.__dict__.get("_" + name), _Deferred)


class TraceSource:
    """What a replay, its gate and its evidence read from a trace, whether its rows are in memory
    (:class:`RoutingTrace`) or streamed from its file (:class:`TraceFile`).

    Both hold the trace's description (``layers``, ``n_experts``, ``top_k``, ``geometry``,
    ``sessions``, ``source``, ``meta``, ``heat_only``) and its per-forward arrays (``fwd_*``, 13
    bytes a forward) in memory. Rows are read only here, block by block (:meth:`column_blocks`),
    so every computation below holds one block of rows (``rows_per_block``) whatever the trace's
    length, and gives the same result, to the bit, from memory or from the file. A subclass
    supplies the rows through ``_columns`` and ``_array_chunks``.
    """

    @property
    def n_forwards(self) -> int:
        return len(self.fwd_session)

    def require_rows(self, what: str) -> None:
        if self.heat_only:
            raise InputError(self.source or None, f"{what} needs per-token routing, but this trace holds heat only (from .coli_usage)")

    def session_forward_mask(self, sessions: list[int] | np.ndarray) -> np.ndarray:
        return np.isin(self.fwd_session, np.asarray(sessions))

    def column_blocks(self, names: tuple, whole_forwards: bool = False) -> Iterator[tuple]:
        """The row arrays ``names`` (e.g. ``("row_forward", "experts")``) in consecutive blocks of
        at most ``rows_per_block`` rows, one tuple of arrays per block, in ``names``'s order.

        ``whole_forwards``: blocks are recut so that no forward spans two (``names[0]`` must be
        ``row_forward``; :func:`whole_forward_runs`).
        """
        blocks = self._blocks_of(names)
        return whole_forward_runs(blocks) if whole_forwards else blocks

    def _blocks_of(self, names: tuple) -> Iterator[tuple]:
        R, step = self.n_rows, self.rows_per_block
        with self._columns(names) as columns:
            for r0 in range(0, R, step):
                n = min(step, R - r0)
                yield tuple(take(n) for take in columns)

    def row_blocks(self) -> Iterator[RowBlock]:
        """The rows (forward, layer, experts) in consecutive blocks of ``rows_per_block`` rows
        (:func:`replay.model.streaming.replay_steps` with ``blocks=``)."""
        for block in self._blocks_of(("row_forward", "row_layer", "experts")):
            yield RowBlock(*block)

    def expert_heat(self, forwards: np.ndarray | None = None) -> np.ndarray:
        """Selections per (layer index, expert), int64 [L, E]: of the rows of the forward mask
        ``forwards`` [F], or of every row (a heat-only trace: its heat table)."""
        if self.heat_only and forwards is None:
            return self.heat
        self.require_rows("heat of chosen forwards")
        L, E = len(self.layers), self.n_experts
        out = np.zeros(L * E, dtype=np.int64)
        for rf, rl, ex in self._blocks_of(("row_forward", "row_layer", "experts")):
            keep = ex >= 0
            if forwards is not None:
                keep &= forwards[rf][:, None]
            cell = np.searchsorted(self.layers, rl).astype(np.int64)[:, None] * E + ex
            out += np.bincount(cell[keep], minlength=L * E)
        return out.reshape(L, E)

    def fingerprint(self) -> str:
        """xxh3-128 of the routing content (arrays and sessions), independent of file compression:
        the same value from memory and from the file (each array's bytes hashed as stored)."""
        states = {}
        for name, chunk in self._array_chunks():
            states.setdefault(name, xxhash.xxh3_128()).update(chunk)
        h = [json.dumps([self.layers.tolist(), self.n_experts, self.top_k, self.sessions]).encode()]
        h += [states.get(name, xxhash.xxh3_128()).hexdigest().encode() for name in _ARRAYS]
        if "heat" in states:
            h.append(states["heat"].hexdigest().encode())
        return digest_of(b"|".join(h))

    def session_fingerprints(self) -> list[str]:
        """xxh3-128 of each session's routing content, in session order, independent of its name.

        Two sessions with the same forwards (kind, evaluated and committed counts) and the same
        rows (layer, position, selected experts, in order) have the same fingerprint, whatever
        the session is called or where it sits in the trace; gates are not included (a router's
        scores may be rounded differently by another exporter). Heat-only traces have none.
        """
        if self.heat_only:
            return []
        # a session's forwards are contiguous (validate), and rows follow their forwards: each
        # session is one range of forwards and one range of rows; the ranges are taken in trace
        # order, each array of a range hashed in turn, at most one block of it at a time
        S, F = len(self.sessions), self.n_forwards
        runs = np.flatnonzero(np.diff(self.fwd_session, prepend=-1)) if F else np.zeros(0, dtype=np.int64)
        f_ends = np.append(runs[1:], F).astype(np.int64)
        rows_per_forward = np.zeros(F, dtype=np.int64)
        for rf, in self._blocks_of(("row_forward",)):
            rows_per_forward += np.bincount(rf, minlength=F)
        r_ends = np.cumsum(rows_per_forward)[f_ends - 1] if F else f_ends
        empty = xxhash.xxh3_128().hexdigest()
        out = [empty] * S
        names = ("row_forward", "row_layer", "row_position", "experts")
        with self._columns(names) as columns:
            r0 = 0
            for f0, f1, r1 in zip(runs.tolist(), f_ends.tolist(), r_ends.tolist()):
                h = xxhash.xxh3_128()
                for arr in (self.fwd_kind[f0:f1], self.fwd_evaluated[f0:f1], self.fwd_committed[f0:f1]):
                    h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
                for name, take in zip(names, columns):
                    for n in _pieces(r1 - r0, self.rows_per_block):
                        arr = take(n).astype(np.int64)
                        h.update((arr - f0 if name == "row_forward" else arr).tobytes())
                out[int(self.fwd_session[f0])] = h.hexdigest()
                r0 = r1
        return out

    def _check_rows(self, gates: bool) -> None:
        """:meth:`RoutingTrace.validate`'s checks of every row, block by block (``gates``: the
        gates too)."""
        def bad(problem: str):
            raise InputError(self.source or None, problem)

        if self.n_rows and self.top_k < 1:
            bad("rows without selections (top_k 0)")
        names = ("row_forward", "row_layer", "experts", "row_position") + (("gates",) if gates else ())
        previous = None
        for block in self._blocks_of(names):
            check_row_block(bad, RowBlock(*block[:3]), block[3], block[4] if gates else None, self.n_experts,
                            self.n_forwards, self.layers, previous)
            previous = (int(block[0][-1]), int(block[1][-1]), int(block[3][-1]))


def _pieces(n: int, step: int) -> Iterator[int]:
    """Sizes of consecutive pieces of ``n`` items, each at most ``step``."""
    while n > 0:
        yield min(n, step)
        n -= step


def whole_forward_runs(blocks: Iterable[tuple]) -> Iterator[tuple]:
    """Blocks of rows (tuples of row arrays, the first ``row_forward``, sorted by forward) recut so
    that no forward spans two blocks: each block but the last ends at its last forward boundary,
    and the rows after it start the next. Yields plain tuples."""
    tail = None
    for b in blocks:
        if tail is not None:
            b = tuple(np.concatenate([t, x]) for t, x in zip(tail, b))
        if not len(b[0]):
            continue
        cut = int(np.searchsorted(b[0], b[0][-1]))
        if cut == 0:
            tail = b
            continue
        yield tuple(x[:cut] for x in b)
        tail = tuple(x[cut:] for x in b)
    if tail is not None and len(tail[0]):
        yield tail


class _ArrayColumn:
    """Consecutive rows of an array in memory: ``take(n)`` returns the next ``n`` (a view)."""

    def __init__(self, array: np.ndarray):
        self.array, self.at = array, 0

    def __call__(self, n: int) -> np.ndarray:
        out = self.array[self.at:self.at + n]
        self.at += n
        return out


@dataclass
class RoutingTrace(TraceSource):
    """Routing of a whole trace. Arrays are indexed by row (R) or by forward (F)."""

    layers: np.ndarray          # int16 [L] absolute layer numbers, sorted
    n_experts: int
    top_k: int
    geometry: str               # a geometry name, or "inferred"
    sessions: list[str]
    # rows
    row_forward: np.ndarray     # int32 [R]
    row_layer: np.ndarray       # int16 [R] absolute layer number
    row_position: np.ndarray    # int32 [R] position index within its forward
    experts: np.ndarray         # int16 [R, k], -1 padded
    gates: np.ndarray = _ReadOnUse()  # float32 [R, k], NaN when unknown (from a file: read on first use)
    # forwards
    fwd_session: np.ndarray     # int32 [F] index into sessions
    fwd_kind: np.ndarray        # int8 [F] index into FORWARD_KINDS
    fwd_evaluated: np.ndarray   # int32 [F] positions evaluated
    fwd_committed: np.ndarray   # int32 [F] tokens committed
    heat_only: bool = False
    heat: np.ndarray | None = None  # int64 [L, E] for heat-only traces
    source: str = ""
    meta: dict = field(default_factory=dict)

    # ------------------------------------------------------------ basics
    @property
    def n_rows(self) -> int:
        return len(self.row_forward)

    @property
    def rows_per_block(self) -> int:
        return ROWS_PER_BLOCK

    @property
    def n_selections(self) -> int:
        return sum(int(np.count_nonzero(ex >= 0)) for ex, in self._blocks_of(("experts",)))

    @contextmanager
    def _columns(self, names: tuple):
        yield [_ArrayColumn(getattr(self, name)) for name in names]

    def _array_chunks(self) -> Iterator[tuple[str, memoryview]]:
        """Each array's bytes as held (deferred gates: as stored, streamed from the file), in chunks."""
        for name in _ARRAYS + (("heat",) if self.heat is not None else ()):
            if name == "gates" and _deferred(self, "gates"):
                yield from _stream_chunks(self.__dict__["_gates"].layout, ("gates",))
                continue
            arr = getattr(self, name)
            step = max(1, READ_CHUNK // max(1, arr.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))))
            for r0 in range(0, max(len(arr), 1), step):
                yield name, memoryview(np.ascontiguousarray(arr[r0:r0 + step])).cast("B")

    def layer_index(self, layer: int) -> int:
        idx = np.searchsorted(self.layers, layer)
        if idx >= len(self.layers) or self.layers[idx] != layer:
            raise KeyError(layer)
        return int(idx)

    def layer_rows(self, layer: int, forwards: np.ndarray | None = None) -> np.ndarray:
        """Row indices of ``layer`` (optionally only in the given forward mask [F])."""
        mask = self.row_layer == layer
        if forwards is not None:
            mask &= forwards[self.row_forward]
        return np.flatnonzero(mask)

    def subset(self, sessions: list[int]) -> "RoutingTrace":
        """A trace holding only the given sessions (indices), renumbered, order kept."""
        self.require_rows("taking sessions")
        keep_f = self.session_forward_mask(sessions)
        new_f = np.cumsum(keep_f) - 1
        keep_r = keep_f[self.row_forward]
        sess = sorted(set(int(s) for s in sessions))
        remap = {old: i for i, old in enumerate(sess)}
        fs = self.fwd_session[keep_f]
        return RoutingTrace(
            layers=self.layers, n_experts=self.n_experts, top_k=self.top_k, geometry=self.geometry,
            sessions=[self.sessions[s] for s in sess],
            row_forward=new_f[self.row_forward[keep_r]].astype(np.int32),
            row_layer=self.row_layer[keep_r], row_position=self.row_position[keep_r],
            experts=self.experts[keep_r], gates=self.gates[keep_r],
            fwd_session=np.array([remap[int(s)] for s in fs], dtype=np.int32),
            fwd_kind=self.fwd_kind[keep_f], fwd_evaluated=self.fwd_evaluated[keep_f],
            fwd_committed=self.fwd_committed[keep_f], source=self.source, meta=dict(self.meta),
        )

    def validate(self) -> None:
        """Check internal consistency and the format's limits; raises InputError naming the trace.

        Statistics, planning and replay rely on what this checks: ids in 0..n_experts-1 padded
        with trailing -1 only, no expert twice in a row, finite (or NaN) gates, rows strictly
        sorted by (forward, layer, position) (so no duplicated row), every row's layer listed,
        positions, forwards, sessions and counts in range.
        """
        where = self.source or None

        def bad(problem: str):
            raise InputError(where, problem)

        if not _is_int(self.n_experts) or not 1 <= self.n_experts <= MAX_EXPERTS:
            bad(f"n_experts {self.n_experts!r} is not an integer in 1..{MAX_EXPERTS}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            bad(f"top_k {self.top_k!r} is not an integer in 0..{MAX_TOP_K}")
        if not isinstance(self.sessions, list) or not all(isinstance(s, str) for s in self.sessions):
            bad("sessions must be a list of names")
        if not isinstance(self.meta, dict):
            bad("meta must be a JSON object")
        layers = np.asarray(self.layers)
        if layers.ndim != 1 or (len(layers) and layers.dtype.kind not in "iu"):
            bad("the layer list is not a list of integers")
        if len(layers) and (int(layers.min()) < 0 or int(layers.max()) > MAX_LAYER):
            bad(f"a layer number is outside 0..{MAX_LAYER}")
        if len(layers) > 1 and (np.diff(layers.astype(np.int64)) <= 0).any():
            bad("the layer list is not sorted and unique")
        if len(layers) * self.n_experts > MAX_LAYER_EXPERT_CELLS:
            bad(f"{len(layers)} layers x {self.n_experts} experts exceeds {MAX_LAYER_EXPERT_CELLS:,} (layer, expert) cells")
        R, F = self.n_rows, self.n_forwards
        for name in ("row_forward", "row_layer", "row_position"):
            if getattr(self, name).shape != (R,):
                bad(f"{name} does not match the row count")
        for name in ("fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed"):
            if getattr(self, name).shape != (F,):
                bad(f"{name} does not match the forward count")
        if R > INT32_MAX or F > INT32_MAX:
            bad("too many rows or forwards")
        if self.heat_only:
            heat = self.heat
            if heat is None or np.shape(heat) != (len(layers), self.n_experts):
                bad("the heat table does not match the layers and experts")
            if heat.size and int(heat.min()) < 0:
                bad("a heat count is negative")
            if R or F:
                bad("a heat-only trace carries rows")
            return
        if self.heat is not None:
            bad("a trace with rows carries a heat table")
        gates_shape = self.__dict__["_gates"].layout.specs["gates"][1] if _deferred(self, "gates") else self.gates.shape
        if self.experts.shape != (R, self.top_k) or tuple(gates_shape) != (R, self.top_k):
            raise InputError(where, "expert/gate arrays do not match the row count")
        self._check_rows(gates=not _deferred(self, "gates"))   # deferred gates were checked as they were read
        if F:
            if self.fwd_session.min() < 0 or self.fwd_session.max() >= len(self.sessions):
                raise InputError(where, "a forward points at a session that does not exist")
            if self.fwd_kind.min() < 0 or self.fwd_kind.max() >= len(FORWARD_KINDS):
                bad("a forward has an unknown kind")
            if self.fwd_evaluated.min() < 1 or self.fwd_evaluated.max() > INT32_MAX:
                bad(f"a forward's evaluated positions are outside 1..{INT32_MAX}")
            if self.fwd_committed.min() < 0:
                bad("a forward commits a negative number of tokens")
        run_sessions = self.fwd_session[np.flatnonzero(np.diff(self.fwd_session, prepend=-1))]
        if len(np.unique(run_sessions)) != len(run_sessions):
            raise InputError(where, "a session's forwards are not contiguous (sessions interleave)")
        if (self.fwd_committed > self.fwd_evaluated).any():
            raise InputError(where, "a forward commits more tokens than it evaluated")


def check_row_block(bad, rows: RowBlock, positions: np.ndarray, gates: np.ndarray | None, n_experts: int, n_forwards: int,
                    layers: np.ndarray, previous: tuple | None) -> None:
    """:meth:`RoutingTrace.validate`'s checks of rows, on one block of consecutive rows.

    ``bad(problem)`` raises; ``gates`` None skips the gate check; ``previous`` is the
    ``(forward, layer, position)`` of the row before the block (None for the first block), so
    the order checks see across blocks.
    """
    ex = rows.experts
    if not len(ex):
        return
    if int(ex.min()) < -1:
        bad("an expert id is negative")
    if int(ex.max()) >= n_experts:
        bad(f"an expert id is >= n_experts ({n_experts})")
    if (ex[:, 0] < 0).any():
        bad("a row selects no expert")
    if ex.shape[1] > 1:
        if ((ex[:, 1:] >= 0) & (ex[:, :-1] < 0)).any():
            bad("a row has padding (-1) before a selection")
        if rows_with_repeats(ex).any():
            bad("an expert is selected twice in one row")
    if gates is not None and np.isinf(gates).any():
        bad("a gate is infinite")
    if rows.row_forward.min() < 0 or rows.row_forward.max() >= n_forwards:
        bad("a row points at a forward that does not exist")
    if positions.min() < 0 or positions.max() > MAX_POSITION:
        bad(f"a row's position is outside 0..{MAX_POSITION}")
    if not np.isin(rows.row_layer, layers).all():
        bad("a row names a layer not in the trace's layer list")
    cols = (rows.row_forward, rows.row_layer, positions)
    if previous is not None:
        cols = tuple(np.concatenate([[p], c]) for p, c in zip(previous, cols))
    if len(cols[0]) > 1:
        df, dl, dp = (np.diff(c.astype(np.int64)) for c in cols)
        if (df < 0).any():
            bad("rows are not in forward order")
        same = (df == 0) & (dl == 0)
        if (same & (dp == 0)).any():
            bad("a (forward, layer, position) row appears twice")
        if ((df == 0) & ((dl < 0) | (same & (dp < 0)))).any():
            bad("rows are not sorted by (forward, layer, position)")


def rows_with_repeats(experts: np.ndarray) -> np.ndarray:
    """Mask [R] of rows of ``experts`` [R, k] (-1 padded) selecting some expert twice."""
    R, k = experts.shape
    if k > 16:
        s = np.sort(experts, axis=1)
        return ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(axis=1)
    padded = R > 0 and int(experts.min()) < 0
    out = np.zeros(R, dtype=bool)
    for a in range(k):
        col = experts[:, a]
        live = col >= 0 if padded else None
        for b in range(a + 1, k):
            eq = col == experts[:, b]
            out |= eq & live if padded else eq
    return out


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


_ARRAYS = (
    "row_forward", "row_layer", "row_position", "experts", "gates",
    "fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed",
)
_ROW_ARRAYS = ("row_forward", "row_layer", "row_position")
_FWD_ARRAYS = ("fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed")
MAX_HEADER_BYTES = 1 << 30


class _HashingWriter:
    """A write-only file wrapper feeding every byte written to an xxh3-128 state."""

    def __init__(self, fh, h):
        self.fh, self.h = fh, h

    def write(self, b) -> int:
        self.h.update(b)
        return self.fh.write(b)

    def flush(self) -> None:
        self.fh.flush()


def save_trace(trace: RoutingTrace, path: str | os.PathLike, level: int = 6) -> None:
    """Write ``trace`` to ``path`` (crash-safe): magic, version, header length, digest, zstd stream."""
    trace.validate()
    header = {
        "version": VERSION,
        "geometry": {"name": str(trace.geometry), "layers": [int(x) for x in trace.layers],
                     "n_experts": int(trace.n_experts), "top_k": int(trace.top_k)},
        "sessions": list(trace.sessions),
        "heat_only": bool(trace.heat_only),
        "source": str(trace.source),
        "meta": trace.meta,
        "arrays": [],
    }
    arrays = [(name, getattr(trace, name)) for name in _ARRAYS]
    if trace.heat is not None:
        arrays.append(("heat", trace.heat))
    arrays = [(name, np.ascontiguousarray(arr, dtype=np.dtype(DTYPES[name]))) for name, arr in arrays]
    for name, arr in arrays:
        header["arrays"].append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape)})
    raw = json.dumps(header).encode()
    fields = struct.pack("<II", VERSION, len(raw))
    h = xxhash.xxh3_128()
    h.update(fields)
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    with atomic_output(path) as fh:
        fh.write(MAGIC + fields + bytes(16))
        with cctx.stream_writer(_HashingWriter(fh, h), closefd=False) as zw:
            zw.write(raw)
            for _, arr in arrays:
                zw.write(arr.reshape(-1).view(np.uint8))
        fh.seek(len(MAGIC) + len(fields))
        fh.write(h.digest())
        fh.seek(0, os.SEEK_END)


READ_CHUNK = 16 << 20
"""Bytes read (or skipped) per step when decompressing a trace."""

ROWS_PER_BLOCK = 1 << 18
"""Rows per block when a trace's rows are read in blocks (:meth:`TraceFile.row_blocks`)."""


@dataclass(frozen=True)
class _Layout:
    """Where everything is in a trace file: the version, header, and each array's dtype, shape
    and byte offset in the decompressed stream (after the header)."""

    path: Path
    version: int
    header: dict
    specs: dict            # name -> (dtype, shape, offset)
    identity: tuple        # (size, mtime_ns, inode) when read


def _open_layout(path: Path) -> _Layout:
    """Check the magic, the version and (version 2) the digest, then the header; raises InputError."""
    with open(path, "rb") as fh:
        head = fh.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise InputError(path, "not a relayout trace (import it first: relayout trace import)")
        version, hlen = struct.unpack("<II", head[8:])
        if version == VERSION:
            _verify_digest(fh, head, path)
        elif version not in OLD_VERSIONS:
            raise InputError(path, f"trace version {version} is not supported (expected {VERSION}; "
                                   "re-import it with this relayout)")
        if hlen > MAX_HEADER_BYTES:
            raise InputError(path, f"corrupt trace (header of {hlen:,} bytes)")
        fh.seek(_stream_start(version))
        reader = zstandard.ZstdDecompressor().stream_reader(fh)
        raw = _read_exact(reader, hlen, path)
        st = os.fstat(fh.fileno())
    try:
        header = parse_json(raw)
    except ValueError as exc:
        raise InputError(path, f"corrupt trace (header: {str(exc)[:120]})") from None
    specs, offset = {}, hlen
    for name, dtype, shape in _check_header(header, version, path):
        specs[name] = (dtype, shape, offset)
        offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return _Layout(path, version, header, specs, (st.st_size, st.st_mtime_ns, st.st_ino))


def _stream_start(version: int) -> int:
    return 32 if version == VERSION else 16


def _verify_digest(fh, head: bytes, path: Path) -> None:
    stored = fh.read(16)
    h = xxhash.xxh3_128()
    h.update(head[8:16])
    while chunk := fh.read(READ_CHUNK):
        h.update(chunk)
    if len(stored) < 16 or h.digest() != stored:
        raise InputError(path, "checksum mismatch: the trace file is damaged (re-import it)")


def _array_stream(layout: _Layout, name: str):
    """A decompressing reader of ``layout.path`` positioned at array ``name``'s first byte (what
    comes before it is decompressed and dropped in bounded steps); the caller closes it."""
    fh = open(layout.path, "rb")
    st = os.fstat(fh.fileno())
    if (st.st_size, st.st_mtime_ns, st.st_ino) != layout.identity:
        fh.close()
        raise InputError(layout.path, "the trace file changed since it was opened (open it again)")
    fh.seek(_stream_start(layout.version))
    reader = zstandard.ZstdDecompressor().stream_reader(fh, closefd=True)
    left = layout.specs[name][2]
    scratch = bytearray(min(left, READ_CHUNK))
    while left > 0:
        n = reader.readinto(memoryview(scratch)[:min(left, len(scratch))])
        if not n:
            reader.close()
            raise InputError(layout.path, "trace file is truncated")
        left -= n
    return reader


def _fill(reader, out: np.ndarray, path: Path) -> np.ndarray:
    """Fill ``out`` from ``reader`` (straight into its memory, no intermediate copy)."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        n = reader.readinto(view[done:done + READ_CHUNK])
        if not n:
            raise InputError(path, "trace file is truncated")
        done += n
    return out


def _read_array(layout: _Layout, name: str) -> np.ndarray:
    dtype, shape, _ = layout.specs[name]
    with _array_stream(layout, name) as reader:
        return _fill(reader, np.empty(shape, dtype=dtype), layout.path)


def _check_gates_in_blocks(layout: _Layout) -> None:
    """The gates' check of :meth:`RoutingTrace.validate` (none infinite), block by block."""
    dtype, shape, _ = layout.specs["gates"]
    R = shape[0]
    step = max(1, READ_CHUNK // max(1, dtype.itemsize * shape[1]))
    with _array_stream(layout, "gates") as reader:
        for r0 in range(0, R, step):
            block = _fill(reader, np.empty((min(step, R - r0), shape[1]), dtype=dtype), layout.path)
            if np.isinf(block).any():
                raise InputError(layout.path, "a gate is infinite")


@dataclass
class _Deferred:
    """An array left in a verified trace file, read (and verified again) on first use."""

    layout: _Layout
    name: str

    def read(self) -> np.ndarray:
        with _guarded(self.layout.path):
            fresh = _open_layout(self.layout.path)      # the digest again: the bytes are the ones checked
            if fresh.identity != self.layout.identity:
                raise InputError(self.layout.path, "the trace file changed since it was loaded (load it again)")
            return _read_array(fresh, self.name)


class _guarded:
    """Turns the errors reading a trace file can raise into one-line InputErrors naming it."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, InputError):
            return False
        if isinstance(exc, OSError):
            raise InputError(self.path, exc.strerror or str(exc)) from None
        if isinstance(exc, zstandard.ZstdError):
            raise InputError(self.path, f"corrupt trace ({exc})") from None
        if isinstance(exc, (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, MemoryError)):
            raise InputError(self.path, f"corrupt trace ({type(exc).__name__}: {exc})"[:200]) from None
        return False


def load_trace(path: str | os.PathLike, gates: bool = False) -> RoutingTrace:
    """Read a trace written by :func:`save_trace`; refuses other files with one clear error.

    Version 2: the digest is checked first, then the header is checked strictly (types, names,
    dtypes, consistent shapes, limits), then the arrays are read (never more than the stream
    holds, each straight into its own memory) and the trace validated. The gates, which no
    replay or plan reads, stay in the file (checked as they stream past) and are read, the
    digest verified again, when first used, unless ``gates`` asks for them now.
    """
    path = Path(path)
    with _guarded(path):
        layout = _open_layout(path)
        arrays = {name: _read_array(layout, name) for name in layout.specs if name != "gates"}
        if gates:
            arrays["gates"] = _read_array(layout, "gates")
        else:
            _check_gates_in_blocks(layout)
            arrays["gates"] = _Deferred(layout, "gates")
    header = layout.header
    g = header["geometry"]
    trace = RoutingTrace(
        layers=np.asarray(g["layers"], dtype=np.int16), n_experts=g["n_experts"], top_k=g["top_k"],
        geometry=g["name"], sessions=header["sessions"], heat_only=header["heat_only"],
        heat=arrays.pop("heat", None), source=str(path), meta=header.get("meta", {}),
        **{name: arrays[name] for name in _ARRAYS},
    )
    trace.validate()
    return trace


class TraceFile(TraceSource):
    """A trace on disk whose rows are read in blocks, never all at once: for a replay and a gate of
    a trace larger than RAM (everything :class:`TraceSource` offers, e.g. :meth:`row_blocks` for
    :func:`replay.model.streaming.replay_steps` with ``blocks=``).

    Opening verifies the digest and the header, reads the per-forward arrays (``fwd_*``, 13
    bytes a forward) and checks everything :meth:`RoutingTrace.validate` checks, the rows
    block by block. Each later pass over the rows refuses a file that changed since it was
    opened. Memory: the forward arrays and one block per row array. The two whole-trace digests
    (:meth:`fingerprint`, :meth:`session_fingerprints`) are computed once, on first use.
    """

    heat_only = False
    heat = None

    def __init__(self, path: str | os.PathLike, rows_per_block: int = ROWS_PER_BLOCK):
        self.path = Path(path)
        self.rows_per_block = int(rows_per_block)
        with _guarded(self.path):
            self._layout = _open_layout(self.path)
            for name in _FWD_ARRAYS:
                setattr(self, name, _read_array(self._layout, name))
        h = self._layout.header
        g = h["geometry"]
        self.layers = np.asarray(g["layers"], dtype=np.int16)
        self.n_experts, self.top_k, self.geometry = g["n_experts"], g["top_k"], g["name"]
        self.sessions, self.meta, self.source = h["sessions"], h.get("meta", {}), str(self.path)
        if h["heat_only"]:
            raise InputError(self.path, "replay needs per-token routing, but this trace holds heat only (from .coli_usage)")
        self._digests: dict = {}
        self._validate()

    @property
    def n_rows(self) -> int:
        return self._layout.specs["row_forward"][1][0]

    def fingerprint(self) -> str:
        if "trace" not in self._digests:
            self._digests["trace"] = super().fingerprint()
        return self._digests["trace"]

    def session_fingerprints(self) -> list[str]:
        if "sessions" not in self._digests:
            self._digests["sessions"] = super().session_fingerprints()
        return list(self._digests["sessions"])

    def _validate(self) -> None:
        forwards = RoutingTrace(
            layers=self.layers, n_experts=self.n_experts, top_k=self.top_k, geometry=self.geometry,
            sessions=self.sessions, row_forward=np.zeros(0, np.int32), row_layer=np.zeros(0, np.int16),
            row_position=np.zeros(0, np.int32), experts=np.zeros((0, self.top_k), np.int16),
            gates=np.zeros((0, self.top_k), np.float32), source=self.source, meta=self.meta,
            **{name: getattr(self, name) for name in _FWD_ARRAYS})
        forwards.validate()                                 # the trace's own checks, rows aside
        self._check_rows(gates=True)

    @contextmanager
    def _columns(self, names: tuple):
        readers = []
        try:
            with _guarded(self.path):
                for name in names:
                    readers.append(_array_stream(self._layout, name))
            yield [_StreamColumn(reader, self._layout.specs[name], self.path) for name, reader in zip(names, readers)]
        finally:
            for reader in readers:
                reader.close()

    def _array_chunks(self) -> Iterator[tuple[str, bytes]]:
        return _stream_chunks(self._layout, _ARRAYS)


class _StreamColumn:
    """Consecutive rows of an array streamed from a trace file: ``take(n)`` reads the next ``n``."""

    def __init__(self, reader, spec: tuple, path: Path):
        self.reader, self.dtype, self.row_shape, self.path = reader, spec[0], tuple(spec[1][1:]), path

    def __call__(self, n: int) -> np.ndarray:
        with _guarded(self.path):
            return _fill(self.reader, np.empty((n,) + self.row_shape, dtype=self.dtype), self.path)


def _stream_chunks(layout: _Layout, names: tuple) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of the arrays ``names`` of a trace file, in the file's order, in chunks of
    at most :data:`READ_CHUNK` bytes, from one decompressing pass starting at the first of them."""
    order = sorted((spec[2], name) for name, spec in layout.specs.items() if name in names)
    if not order:
        return
    with _guarded(layout.path):
        reader = _array_stream(layout, order[0][1])
    with reader:
        at = order[0][0]
        for offset, name in order:
            dtype, shape, _ = layout.specs[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            for _ in _chunks(reader, offset - at, layout.path):     # arrays between the named ones
                pass
            for chunk in _chunks(reader, nbytes, layout.path):
                yield name, chunk
            at = offset + nbytes


def _chunks(reader, n: int, path: Path) -> Iterator[bytes]:
    """The next ``n`` bytes of ``reader`` in chunks of at most :data:`READ_CHUNK` bytes."""
    while n > 0:
        with _guarded(path):
            chunk = reader.read(min(n, READ_CHUNK))
        if not chunk:
            raise InputError(path, "trace file is truncated")
        n -= len(chunk)
        yield chunk


def _check_header(header, version: int, path: Path) -> list[tuple[str, np.dtype, tuple]]:
    """Check a decoded header before any of its values sizes anything; returns the array specs."""
    def bad(problem: str):
        raise InputError(path, f"corrupt trace header ({problem})")

    def integer(v, lo: int, hi: int, what: str) -> int:
        if not _is_int(v) or not lo <= v <= hi:
            bad(f"{what} must be an integer in {lo}..{hi}, not {v!r}"[:160])
        return int(v)

    if not isinstance(header, dict):
        bad("not a JSON object")
    if header.get("version") != version or isinstance(header.get("version"), bool):
        bad(f"version {header.get('version')!r} differs from the file's {version}"[:160])
    g = header.get("geometry")
    if not isinstance(g, dict):
        bad("'geometry' is not an object")
    if not isinstance(g.get("name"), str):
        bad("geometry name is not a string")
    layers = g.get("layers")
    if not isinstance(layers, list) or len(layers) > MAX_LAYER + 1:
        bad("geometry layers is not a list of layer numbers")
    for x in layers:
        integer(x, 0, MAX_LAYER, "a layer")
    E = integer(g.get("n_experts"), 1, MAX_EXPERTS, "n_experts")
    k = integer(g.get("top_k"), 0, MAX_TOP_K, "top_k")
    if len(layers) * E > MAX_LAYER_EXPERT_CELLS:
        bad(f"{len(layers)} layers x {E} experts")
    sessions = header.get("sessions")
    if not isinstance(sessions, list) or not all(isinstance(s, str) for s in sessions):
        bad("'sessions' is not a list of names")
    if not isinstance(header.get("heat_only"), bool):
        bad("'heat_only' is not a boolean")
    if not isinstance(header.get("meta", {}), dict):
        bad("'meta' is not an object")
    specs = header.get("arrays")
    if not isinstance(specs, list):
        bad("'arrays' is not a list")
    out, shapes = [], {}
    for spec in specs:
        if not isinstance(spec, dict) or spec.get("name") not in DTYPES or spec["name"] in shapes:
            bad("an array entry is unknown or repeated")
        name = spec["name"]
        if spec.get("dtype") != DTYPES[name]:
            bad(f"array {name} has dtype {spec.get('dtype')!r}, expected {DTYPES[name]!r}"[:160])
        shape = spec.get("shape")
        ndim = 2 if name in ("experts", "gates", "heat") else 1
        if not isinstance(shape, list) or len(shape) != ndim:
            bad(f"array {name} has a bad shape")
        shape = tuple(integer(x, 0, INT32_MAX, f"a dimension of {name}") for x in shape)
        shapes[name] = shape
        out.append((name, np.dtype(DTYPES[name]), shape))
    missing = [n for n in _ARRAYS if n not in shapes]
    if missing:
        bad(f"array {missing[0]} is missing")
    if ("heat" in shapes) != header["heat_only"]:
        bad("a heat table must be present exactly when the trace is heat-only")
    R, F = shapes["row_forward"][0], shapes["fwd_session"][0]
    if any(shapes[n] != (R,) for n in _ROW_ARRAYS) or shapes["experts"] != (R, k) or shapes["gates"] != (R, k):
        bad("row arrays disagree in length or with top_k")
    if any(shapes[n] != (F,) for n in _FWD_ARRAYS):
        bad("forward arrays disagree in length")
    if "heat" in shapes and shapes["heat"] != (len(layers), E):
        bad("the heat table does not match the layers and experts")
    return out


def _read_exact(reader: io.RawIOBase, n: int, path: Path) -> bytes:
    """``n`` bytes from ``reader``, read in bounded chunks (a lying length costs only what is there)."""
    chunks, left = [], n
    while left > 0:
        b = reader.read(min(left, 64 << 20))
        if not b:
            raise InputError(path, "trace file is truncated")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)
