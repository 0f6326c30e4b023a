"""The routing trace file (``trace.rt``): its writer, its reader, and a trace read from it in blocks.

Version 2: ``RLTRACE\0``, u32 version, u32 header length, the xxh3-128 digest (16 bytes,
big-endian) of everything after it (a zstd stream of the JSON header then the raw arrays) and of
the version and length fields, then that stream. The digest is checked before anything is
decompressed, so a flipped bit anywhere is one "damaged" error. Version 1 files (no digest) are
read unverified. Every header value is checked (types, array names, dtypes and shapes against each
other and against the limits of :mod:`replay.model.routing`) before it sizes any allocation, and
:meth:`replay.model.routing.RoutingTrace.validate` checks the content. The gates stay in the file
until first used (:class:`_Deferred`); :class:`TraceFile` streams every row array in blocks.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from containers.atomic import atomic_output
from containers.errors import InputError
from containers.jsonfile import parse_json
from replay.model.routing import (
    ARRAYS,
    DTYPES,
    FWD_ARRAYS,
    INT32_MAX,
    MAX_EXPERTS,
    MAX_LAYER,
    MAX_LAYER_EXPERT_CELLS,
    MAX_TOP_K,
    READ_CHUNK,
    ROW_ARRAYS,
    ROWS_PER_BLOCK,
    ArrayInFile,
    RoutingTrace,
    TraceSource,
    is_int,
)

MAGIC = b"RLTRACE\0"
VERSION = 2
OLD_VERSIONS = (1,)
"""Versions read without verification (they carry no digest)."""
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
    arrays = [(name, getattr(trace, name)) for name in ARRAYS]
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
class _Deferred(ArrayInFile):
    """An array left in a verified trace file, read (and verified again) on first use."""

    layout: _Layout
    name: str

    @property
    def shape(self) -> tuple:
        return self.layout.specs[self.name][1]

    def chunks(self) -> Iterator[bytes]:
        for _, chunk in _stream_chunks(self.layout, (self.name,)):
            yield chunk

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
        **{name: arrays[name] for name in ARRAYS},
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
            for name in FWD_ARRAYS:
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
            **{name: getattr(self, name) for name in FWD_ARRAYS})
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
        return _stream_chunks(self._layout, ARRAYS)


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
        if not is_int(v) or not lo <= v <= hi:
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
    missing = [n for n in ARRAYS if n not in shapes]
    if missing:
        bad(f"array {missing[0]} is missing")
    if ("heat" in shapes) != header["heat_only"]:
        bad("a heat table must be present exactly when the trace is heat-only")
    R, F = shapes["row_forward"][0], shapes["fwd_session"][0]
    if any(shapes[n] != (R,) for n in ROW_ARRAYS) or shapes["experts"] != (R, k) or shapes["gates"] != (R, k):
        bad("row arrays disagree in length or with top_k")
    if any(shapes[n] != (F,) for n in FWD_ARRAYS):
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
