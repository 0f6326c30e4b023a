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
"""

from __future__ import annotations

import io
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.hashing import digest_of

MAGIC = b"RLTRACE\0"
VERSION = 1

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
        """Check internal consistency; raises InputError naming the trace."""
        where = self.source or None
        R, F = self.n_rows, self.n_forwards
        if self.heat_only:
            return
        if self.experts.shape != (R, self.top_k) or self.gates.shape != (R, self.top_k):
            raise InputError(where, "expert/gate arrays do not match the row count")
        if R and (self.row_forward.min() < 0 or self.row_forward.max() >= F):
            raise InputError(where, "a row points at a forward that does not exist")
        if (self.experts >= self.n_experts).any():
            raise InputError(where, f"an expert id is >= n_experts ({self.n_experts})")
        if F and (self.fwd_session.max() >= len(self.sessions)):
            raise InputError(where, "a forward points at a session that does not exist")
        run_sessions = self.fwd_session[np.flatnonzero(np.diff(self.fwd_session, prepend=-1))]
        if len(np.unique(run_sessions)) != len(run_sessions):
            raise InputError(where, "a session's forwards are not contiguous (sessions interleave)")
        if (self.fwd_committed > self.fwd_evaluated).any():
            raise InputError(where, "a forward commits more tokens than it evaluated")
        if R and not np.isin(self.row_layer, self.layers).all():
            raise InputError(where, "a row names a layer not in the trace's layer list")
        if R > 1 and (np.diff(self.row_forward) < 0).any():
            raise InputError(where, "rows are not in forward order")


_ARRAYS = (
    "row_forward", "row_layer", "row_position", "experts", "gates",
    "fwd_session", "fwd_kind", "fwd_evaluated", "fwd_committed",
)


def save_trace(trace: RoutingTrace, path: str | os.PathLike, level: int = 6) -> None:
    """Write ``trace`` to ``path`` (crash-safe): magic, version, JSON header, raw arrays, zstd."""
    header = {
        "version": VERSION,
        "geometry": {"name": trace.geometry, "layers": trace.layers.tolist(), "n_experts": trace.n_experts, "top_k": trace.top_k},
        "sessions": trace.sessions,
        "heat_only": trace.heat_only,
        "source": trace.source,
        "meta": trace.meta,
        "arrays": [],
    }
    arrays = [(name, getattr(trace, name)) for name in _ARRAYS]
    if trace.heat is not None:
        arrays.append(("heat", trace.heat))
    for name, arr in arrays:
        header["arrays"].append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape)})
    raw = json.dumps(header).encode()
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    with atomic_output(path) as fh:
        fh.write(MAGIC + struct.pack("<II", VERSION, len(raw)))
        with cctx.stream_writer(fh, closefd=False) as zw:
            zw.write(raw)
            for _, arr in arrays:
                zw.write(np.ascontiguousarray(arr).tobytes())


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace written by :func:`save_trace`; refuses other files with a clear error."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise InputError(path, "not a relayout trace (import it first: relayout trace import)")
            version, hlen = struct.unpack("<II", head[8:])
            if version != VERSION:
                raise InputError(path, f"trace version {version} is not supported (expected {VERSION})")
            reader = zstandard.ZstdDecompressor().stream_reader(fh)
            raw = _read_exact(reader, hlen, path)
            header = json.loads(raw)
            arrays = {}
            for spec in header["arrays"]:
                dtype = np.dtype(spec["dtype"])
                n = int(np.prod(spec["shape"], dtype=np.int64)) * dtype.itemsize
                arrays[spec["name"]] = np.frombuffer(_read_exact(reader, n, path), dtype=dtype).reshape(spec["shape"]).copy()
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    except (zstandard.ZstdError, ValueError, KeyError, TypeError) as exc:
        raise InputError(path, f"corrupt trace ({exc})") from None
    g = header["geometry"]
    trace = RoutingTrace(
        layers=np.asarray(g["layers"], dtype=np.int16), n_experts=g["n_experts"], top_k=g["top_k"],
        geometry=g["name"], sessions=header["sessions"], heat_only=header["heat_only"],
        heat=arrays.pop("heat", None), source=str(path), meta=header.get("meta", {}),
        **{name: arrays[name] for name in _ARRAYS},
    )
    trace.validate()
    return trace


def _read_exact(reader: io.RawIOBase, n: int, path: Path) -> bytes:
    chunks, left = [], n
    while left > 0:
        b = reader.read(min(left, 64 << 20))
        if not b:
            raise InputError(path, "trace file is truncated")
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)
