"""The routing trace in memory: its arrays, their limits, and the checks every consumer relies on.

A trace is a sequence of *forwards* (one runtime step: a decode token, a prefill chunk, a
speculative verify). Each forward evaluates some positions; for each position and each routed
layer there is one *row*: the expert ids the router chose, in selection order, and their gate
scores when known. Per forward it keeps the session it belongs to, its kind, how many positions it
evaluated and how many tokens it committed. Rows are sorted by (forward, layer, position); expert
ids are padded with -1 when a row has fewer than ``top_k`` selections; gates are NaN when unknown.
A heat-only trace (``.coli_usage``) has no rows, only per-layer expert counts; anything that needs
co-activation refuses it with a message saying so. Limits (ids and layers are int16, positions and
counts int32): expert ids 0..32767, layers 0..32767, at most ``MAX_TOP_K`` selections per row, at
most ``MAX_LAYER_EXPERT_CELLS`` (layer, expert) cells; importers without a geometry also cap ids and
layers at ``DEFAULT_MAX_EXPERTS`` / ``DEFAULT_MAX_LAYER``. The file format is
:mod:`replay.formats.trace`; an array it leaves in the file is an :class:`ArrayInFile`.
"""

from __future__ import annotations

import json
from collections import namedtuple
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import xxhash

from containers.errors import InputError
from containers.hashing import digest_of

RowBlock = namedtuple("RowBlock", "row_forward row_layer experts")
"""Consecutive rows of a trace: the row arrays a replay reads (see :class:`RoutingTrace`)."""

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
MAX_GATE = float(np.finfo(np.float32).max)
"""Largest gate magnitude (gates are stored as float32: larger ones are not finite there)."""

DTYPES = {
    "row_forward": "<i4", "row_layer": "<i2", "row_position": "<i4", "experts": "<i2", "gates": "<f4",
    "fwd_session": "<i4", "fwd_kind": "|i1", "fwd_evaluated": "<i4", "fwd_committed": "<i4", "heat": "<i8",
}
"""The stored dtype of every array."""

FORWARD_KINDS = ("decode", "prefill", "verify", "unknown")
"""Kinds of forward. ``verify`` is a multi-position speculative step."""


ARRAYS = (
    "row_forward", "row_layer", "row_position", "experts", "gates",
    "fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed",
)
"""Every array of a trace with rows, in stored order (a heat-only trace adds ``heat``)."""
ROW_ARRAYS = ("row_forward", "row_layer", "row_position")
FWD_ARRAYS = ("fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed")

READ_CHUNK = 16 << 20
"""Bytes read, hashed or skipped per step when a trace's arrays are taken in chunks."""

ROWS_PER_BLOCK = 1 << 18
"""Rows per block when a trace's rows are read in blocks (:meth:`TraceSource.row_blocks`)."""


class ArrayInFile:
    """An array of a :class:`RoutingTrace` still in its file (the gates: most of a trace's bytes,
    read by no replay or plan). The file's reader supplies :meth:`read` (the array, checked
    again), :attr:`shape` and :meth:`chunks` (its bytes as stored, in chunks of at most
    :data:`READ_CHUNK`)."""

    @property
    def shape(self) -> tuple:
        raise NotImplementedError

    def read(self) -> np.ndarray:
        raise NotImplementedError

    def chunks(self) -> Iterator[bytes]:
        raise NotImplementedError


class _ReadOnUse:
    """A :class:`RoutingTrace` array that may still be in its file until first used. Assigning an
    array sets it; assigning an :class:`ArrayInFile` defers it. (As a dataclass field it has no
    default.)"""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            raise AttributeError(self.slot)
        value = obj.__dict__[self.slot]
        if isinstance(value, ArrayInFile):
            value = obj.__dict__[self.slot] = value.read()
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value


def _in_file(trace: "RoutingTrace", name: str) -> ArrayInFile | None:
    """The array ``name`` of ``trace`` when it is still in its file, else None."""
    value = trace.__dict__.get("_" + name)
    return value if isinstance(value, ArrayInFile) else None


class TraceSource:
    """What a replay, its gate and its evidence read from a trace, whether its rows are in memory
    (:class:`RoutingTrace`) or streamed from its file (:class:`replay.formats.trace.TraceFile`).

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
        h += [states.get(name, xxhash.xxh3_128()).hexdigest().encode() for name in ARRAYS]
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
        for name in ARRAYS + (("heat",) if self.heat is not None else ()):
            in_file = _in_file(self, name)
            if in_file is not None:
                yield from ((name, chunk) for chunk in in_file.chunks())
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

        if not is_int(self.n_experts) or not 1 <= self.n_experts <= MAX_EXPERTS:
            bad(f"n_experts {self.n_experts!r} is not an integer in 1..{MAX_EXPERTS}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
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
        in_file = _in_file(self, "gates")
        gates_shape = in_file.shape if in_file is not None else self.gates.shape
        if self.experts.shape != (R, self.top_k) or tuple(gates_shape) != (R, self.top_k):
            raise InputError(where, "expert/gate arrays do not match the row count")
        self._check_rows(gates=in_file is None)   # gates left in the file were checked as they were read
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


def is_int(v) -> bool:
    """``v`` is an integer (Python or numpy), not a boolean."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
