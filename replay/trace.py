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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.hashing import digest_of

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


@dataclass
class RoutingTrace:
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
    gates: np.ndarray           # float32 [R, k], NaN when unknown
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
    def n_forwards(self) -> int:
        return len(self.fwd_session)

    @property
    def n_selections(self) -> int:
        return int((self.experts >= 0).sum())

    def layer_index(self, layer: int) -> int:
        idx = np.searchsorted(self.layers, layer)
        if idx >= len(self.layers) or self.layers[idx] != layer:
            raise KeyError(layer)
        return int(idx)

    def require_rows(self, what: str) -> None:
        if self.heat_only:
            raise InputError(self.source or None, f"{what} needs per-token routing, but this trace holds heat only (from .coli_usage)")

    def expert_heat(self) -> np.ndarray:
        """Selections per (layer index, expert): int64 [L, E]."""
        if self.heat_only:
            return self.heat
        out = np.zeros((len(self.layers), self.n_experts), dtype=np.int64)
        li = np.searchsorted(self.layers, self.row_layer)
        valid = self.experts >= 0
        np.add.at(out, (np.repeat(li, self.top_k).reshape(-1, self.top_k)[valid], self.experts[valid].astype(np.int64)), 1)
        return out

    def layer_rows(self, layer: int, forwards: np.ndarray | None = None) -> np.ndarray:
        """Row indices of ``layer`` (optionally only in the given forward mask [F])."""
        mask = self.row_layer == layer
        if forwards is not None:
            mask &= forwards[self.row_forward]
        return np.flatnonzero(mask)

    def session_forward_mask(self, sessions: list[int] | np.ndarray) -> np.ndarray:
        return np.isin(self.fwd_session, np.asarray(sessions))

    def fingerprint(self) -> str:
        """xxh3-128 of the routing content (arrays and sessions), independent of file compression."""
        h = [json.dumps([self.layers.tolist(), self.n_experts, self.top_k, self.sessions]).encode()]
        for name in _ARRAYS:
            arr = getattr(self, name)
            h.append(digest_of(np.ascontiguousarray(arr).tobytes()).encode())
        if self.heat is not None:
            h.append(digest_of(np.ascontiguousarray(self.heat).tobytes()).encode())
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
        S, F = len(self.sessions), self.n_forwards
        f_order = np.argsort(self.fwd_session, kind="stable")
        f_counts = np.bincount(self.fwd_session, minlength=S)
        f_starts = np.concatenate([[0], np.cumsum(f_counts)])
        rel = np.empty(F, dtype=np.int64)
        rel[f_order] = np.arange(F) - np.repeat(f_starts[:-1], f_counts)
        row_session = self.fwd_session[self.row_forward]
        r_order = np.argsort(row_session, kind="stable")
        r_starts = np.concatenate([[0], np.cumsum(np.bincount(row_session, minlength=S))])
        columns = (rel[self.row_forward], self.row_layer, self.row_position)
        out = []
        for si in range(S):
            h = xxhash.xxh3_128()
            fs = f_order[f_starts[si]:f_starts[si + 1]]
            for arr in (self.fwd_kind[fs], self.fwd_evaluated[fs], self.fwd_committed[fs]):
                h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
            rs = r_order[r_starts[si]:r_starts[si + 1]]
            for arr in columns:
                h.update(np.ascontiguousarray(arr[rs], dtype=np.int64).tobytes())
            h.update(np.ascontiguousarray(self.experts[rs], dtype=np.int64).tobytes())
            out.append(h.hexdigest())
        return out

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
        if self.experts.shape != (R, self.top_k) or self.gates.shape != (R, self.top_k):
            raise InputError(where, "expert/gate arrays do not match the row count")
        if R:
            ex = self.experts
            if self.top_k < 1:
                bad("rows without selections (top_k 0)")
            if int(ex.min()) < -1:
                bad("an expert id is negative")
            if int(ex.max()) >= self.n_experts:
                bad(f"an expert id is >= n_experts ({self.n_experts})")
            if (ex[:, 0] < 0).any():
                bad("a row selects no expert")
            if self.top_k > 1:
                if ((ex[:, 1:] >= 0) & (ex[:, :-1] < 0)).any():
                    bad("a row has padding (-1) before a selection")
                if rows_with_repeats(ex).any():
                    bad("an expert is selected twice in one row")
            if np.isinf(self.gates).any():
                bad("a gate is infinite")
            if self.row_forward.min() < 0 or self.row_forward.max() >= F:
                raise InputError(where, "a row points at a forward that does not exist")
            if self.row_position.min() < 0 or self.row_position.max() > MAX_POSITION:
                bad(f"a row's position is outside 0..{MAX_POSITION}")
            if not np.isin(self.row_layer, layers).all():
                raise InputError(where, "a row names a layer not in the trace's layer list")
            if R > 1:
                df = np.diff(self.row_forward.astype(np.int64))
                dl = np.diff(self.row_layer.astype(np.int64))
                dp = np.diff(self.row_position.astype(np.int64))
                if (df < 0).any():
                    raise InputError(where, "rows are not in forward order")
                same = (df == 0) & (dl == 0)
                if (same & (dp == 0)).any():
                    bad("a (forward, layer, position) row appears twice")
                if ((df == 0) & ((dl < 0) | (same & (dp < 0)))).any():
                    bad("rows are not sorted by (forward, layer, position)")
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


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace written by :func:`save_trace`; refuses other files with one clear error.

    Version 2: the digest is checked first, then the header is checked strictly (types, names,
    dtypes, consistent shapes, limits), then the arrays are read (never more than the stream
    holds) and the trace validated.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise InputError(path, "not a relayout trace (import it first: relayout trace import)")
            version, hlen = struct.unpack("<II", head[8:])
            if version == VERSION:
                stored = fh.read(16)
                h = xxhash.xxh3_128()
                h.update(head[8:16])
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
                if len(stored) < 16 or h.digest() != stored:
                    raise InputError(path, "checksum mismatch: the trace file is damaged (re-import it)")
                fh.seek(32)
            elif version not in OLD_VERSIONS:
                raise InputError(path, f"trace version {version} is not supported (expected {VERSION}; "
                                       "re-import it with this relayout)")
            if hlen > MAX_HEADER_BYTES:
                raise InputError(path, f"corrupt trace (header of {hlen:,} bytes)")
            reader = zstandard.ZstdDecompressor().stream_reader(fh)
            raw = _read_exact(reader, hlen, path)
            try:
                header = json.loads(raw)
            except RecursionError:
                raise InputError(path, "corrupt trace (header nested too deeply)") from None
            specs = _check_header(header, version, path)
            arrays = {}
            for name, dtype, shape in specs:
                n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
                arrays[name] = np.frombuffer(_read_exact(reader, n, path), dtype=dtype).reshape(shape).copy()
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    except zstandard.ZstdError as exc:
        raise InputError(path, f"corrupt trace ({exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, MemoryError) as exc:
        raise InputError(path, f"corrupt trace ({type(exc).__name__}: {exc})"[:200]) from None
    g = header["geometry"]
    trace = RoutingTrace(
        layers=np.asarray(g["layers"], dtype=np.int16), n_experts=g["n_experts"], top_k=g["top_k"],
        geometry=g["name"], sessions=header["sessions"], heat_only=header["heat_only"],
        heat=arrays.pop("heat", None), source=str(path), meta=header.get("meta", {}),
        **{name: arrays[name] for name in _ARRAYS},
    )
    trace.validate()
    return trace


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
