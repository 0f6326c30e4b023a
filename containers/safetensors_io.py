"""Strict safetensors header parsing and a streaming writer that controls physical order.

File layout: ``u64`` little-endian header length N, N bytes of UTF-8 JSON
``{name: {"dtype", "shape", "data_offsets": [a, b]}, "__metadata__": {str: str}}``, then the data
section; offsets are relative to byte ``8 + N``.

The reader makes at least the checks the colibrì runtime makes (N <= 512 MiB, ``a <= b``,
``8 + N + b <= file size``, shape products that do not overflow, ``numel * itemsize == nbytes``) and
also refuses unknown dtypes, duplicate JSON keys, unknown entry fields, overlapping tensors (an
empty tensor inside another one included), strings that are not valid UTF-8 (a JSON escape of a
lone surrogate such as ``\\ud800``), a header not starting with ``{``, and dimensions of ``2**63``
or more (each one, and the product of the non-zero ones, even when another dimension is 0),
because the runtime or the safetensors library would misread or refuse such a file. Gaps between
tensors are allowed (the runtime allows them, and aligned layouts need them).

The writer never holds tensor data in memory: each tensor is streamed from a :class:`ByteSource`
(see :mod:`containers.sources`) into its place. Header keys are written sorted by name, so the
physical order of the data is independent of the header order.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .atomic import atomic_output
from .errors import InputError
from .records import is_int, is_text
from .sources import ByteSource, Stamped

MAX_HEADER_BYTES = 512 * 1024 * 1024
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}
_INT64_MAX = 2**63 - 1
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard. ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """A parsed and validated safetensors header."""

    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)

    def by_offset(self) -> list[TensorEntry]:
        """Tensors in physical order."""
        return sorted(self.tensors.values(), key=lambda t: (t.begin, t.end))


def _reject_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in header")
        out[key] = value
    return out




def _show(s: str) -> str:
    """``repr`` of a header string, cut short for a one-line message."""
    r = repr(s)
    return r if len(r) <= 120 else r[:117] + "..."


def _num(n: int) -> str:
    return str(n) if -(2**64) < n < 2**64 else ("-" if n < 0 else "") + "a number of more than 20 digits"


def _show_shape(shape: list) -> str:
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ... ({len(shape)} dims)]"


def parse_header_bytes(path: Path, raw: bytes, file_size: int) -> ShardHeader:
    """Validate header JSON bytes ``raw`` of a file of ``file_size`` bytes."""
    data_start = 8 + len(raw)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except RecursionError:
        raise InputError(path, "header is not valid JSON (nested too deeply)") from None
    except MemoryError:
        raise InputError(path, f"header of {len(raw)} bytes is too large to parse in memory") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        lines = str(exc).splitlines() or [type(exc).__name__]
        raise InputError(path, f"header is not valid JSON ({lines[0][:120]})") from None
    if not isinstance(obj, dict):
        raise InputError(path, "header is not a JSON object")
    if not raw.startswith(b"{"):
        raise InputError(path, "header does not start with '{' (the safetensors library refuses it)")
    metadata = obj.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InputError(path, "__metadata__ must map strings to strings")
    for k, v in metadata.items():
        if not (is_text(k) and is_text(v)):
            raise InputError(path, f"__metadata__ entry {_show(k)} is not valid UTF-8 (lone surrogate escape)")
    tensors: dict[str, TensorEntry] = {}
    for name, spec in obj.items():
        if not is_text(name):
            raise InputError(path, f"tensor name {_show(name)} is not valid UTF-8 (lone surrogate escape)")
        tensors[name] = _parse_entry(path, name, spec, data_start, file_size)
    _check_no_overlap(path, tensors.values())
    return ShardHeader(path, file_size, data_start, tensors, dict(metadata))


def _parse_entry(path: Path, raw_name: str, spec, data_start: int, file_size: int) -> TensorEntry:
    name = _show(raw_name)
    if not isinstance(spec, dict) or set(spec) != _ENTRY_KEYS:
        raise InputError(path, f"tensor {name}: entry must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise InputError(path, f"tensor {name}: unknown dtype {_show(dtype) if isinstance(dtype, str) else type(dtype).__name__}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise InputError(path, f"tensor {name}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
        raise InputError(path, f"tensor {name}: data_offsets must be two integers")
    a, b = offsets
    if a < 0 or a > b:
        raise InputError(path, f"tensor {name}: data_offsets [{_num(a)}, {_num(b)}] are out of order")
    if data_start + b > file_size:
        raise InputError(
            path, f"tensor {name}: data ends at byte {_num(data_start + b)} beyond file size {file_size} (truncated?)"
        )
    # every dimension, and the product of the non-zero ones, must fit in an int64 (in any order
    # of multiplication), so a zero dimension does not hide an overflowing one
    nonzero = 1
    for d in shape:
        if d > _INT64_MAX:
            raise InputError(path, f"tensor {name}: dimension {_num(d)} is 2**63 or more")
        if d:
            nonzero *= d
            if nonzero > _INT64_MAX:
                raise InputError(path, f"tensor {name}: shape product overflows")
    numel = 0 if 0 in shape else nonzero
    if numel * DTYPE_SIZES[dtype] > _INT64_MAX:
        raise InputError(path, f"tensor {name}: byte size overflows")
    if numel * DTYPE_SIZES[dtype] != b - a:
        raise InputError(
            path, f"tensor {name}: {dtype}{_show_shape(shape)} needs {numel * DTYPE_SIZES[dtype]} bytes, offsets give {b - a}"
        )
    return TensorEntry(raw_name, dtype, tuple(shape), data_start + a, data_start + b)


def _check_no_overlap(path: Path, entries: Iterable[TensorEntry]) -> None:
    """No two tensors share a byte, and no empty tensor lies strictly inside another one.

    (Empty tensors may sit at the start or end of another tensor, as the safetensors library
    allows; one inside another would also break the one-pass hashing of the file.)
    """
    prev = None
    for t in sorted(entries, key=lambda t: (t.begin, t.end)):
        if prev is not None and t.begin < prev.end:
            raise InputError(path, f"tensors {_show(prev.name)} and {_show(t.name)} overlap")
        prev = t  # sorted by begin and not overlapping, so t ends last


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Read and validate the header of the safetensors file at ``path`` (opened read-only)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            file_size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise InputError(path, f"file is {file_size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise InputError(path, f"header length {n} exceeds the 512 MiB limit")
            if 8 + n > file_size:
                raise InputError(path, f"header length {n} runs past the end of the {file_size}-byte file")
            raw = fh.read(n)
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    return parse_header_bytes(path, raw, file_size)


# ---------------------------------------------------------------- writer


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its header fields, where its bytes come from, and its alignment.

    ``alignment`` (bytes) overrides the shard default for this tensor's start; 1 packs it right
    after the previous tensor (used to keep an expert's three weight tensors byte-adjacent).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: ByteSource
    alignment: int | None = None

    @property
    def nbytes(self) -> int:
        return self.source.nbytes


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ShardLayout:
    """Where every tensor of a shard-to-be lands; computed before any byte is written."""

    header: bytes
    data_start: int
    placements: list[tuple[TensorSpec, int]]  # (spec, absolute begin offset)
    file_size: int


def plan_shard(
    specs: Iterable[TensorSpec], alignment: int = 4096, metadata: Mapping[str, str] | None = None
) -> ShardLayout:
    """Compute the header and offsets of a shard holding ``specs`` in the given physical order.

    The data section starts at a multiple of ``max(alignment, 8)``; each tensor starts at a
    multiple of its own alignment (default ``alignment``).
    """
    specs = list(specs)
    names = set()
    rel = 0
    placements_rel = []
    for s in specs:
        if s.name in names:
            raise InputError(s.name, "tensor name appears twice in one shard")
        names.add(s.name)
        if s.dtype not in DTYPE_SIZES:
            raise InputError(s.name, f"unknown dtype {s.dtype!r}")
        numel = 1
        for d in s.shape:
            numel *= d
        if numel * DTYPE_SIZES[s.dtype] != s.nbytes:
            raise InputError(s.name, f"{s.dtype}{list(s.shape)} does not match {s.nbytes} source bytes")
        rel = _align(rel, s.alignment or alignment)
        placements_rel.append((s, rel))
        rel += s.nbytes
    header_obj: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise InputError(None, "__metadata__ must map strings to strings")
        header_obj["__metadata__"] = dict(metadata)
    for s, r in sorted(placements_rel, key=lambda p: p[0].name):
        header_obj[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [r, r + s.nbytes]}
    raw = json.dumps(header_obj, separators=(",", ":")).encode("utf-8")
    data_start = _align(8 + len(raw), max(alignment, 8))
    raw = raw + b" " * (data_start - 8 - len(raw))
    header = struct.pack("<Q", len(raw)) + raw
    placements = [(s, data_start + r) for s, r in placements_rel]
    return ShardLayout(header, data_start, placements, data_start + rel)


_ZEROS = bytes(1 << 20)


def _write_zeros(fh, n: int) -> None:
    while n > 0:
        k = min(n, len(_ZEROS))
        fh.write(memoryview(_ZEROS)[:k])
        n -= k


ChunkHook = Callable[[str, memoryview], None]


def write_shard(
    path: str | os.PathLike,
    specs: Iterable[TensorSpec],
    alignment: int = 4096,
    metadata: Mapping[str, str] | None = None,
    on_chunk: ChunkHook | None = None,
    on_bytes: Callable[[int], None] | None = None,
    sparse: bool = False,
) -> ShardLayout:
    """Stream ``specs`` into a new safetensors file at ``path``, crash-safely.

    ``on_chunk(name, chunk)`` sees every data chunk of every tensor (for hashing while writing);
    ``on_bytes(n)`` reports progress in bytes (logical bytes, holes included). Memory use is one
    source chunk at a time. With ``sparse``, a :class:`~containers.sources.Stamped` source's zeros
    are not written: the writer seeks over them and the file is extended to its size, so they stay
    holes (``on_chunk`` is then refused, as it would not see them).
    """
    if sparse and on_chunk is not None:
        raise ValueError("write_shard: on_chunk cannot see the holes of a sparse shard")
    layout = plan_shard(specs, alignment, metadata)
    with atomic_output(path) as fh:
        fh.write(layout.header)
        pos = layout.data_start
        for spec, begin in layout.placements:
            if sparse and isinstance(spec.source, Stamped):
                for offset, chunk in spec.source.data():
                    fh.seek(begin + offset)
                    fh.write(chunk)
                if on_bytes is not None:
                    on_bytes(spec.nbytes)
                pos = begin + spec.nbytes
                continue
            if fh.tell() != pos:
                fh.seek(pos)
            _write_zeros(fh, begin - pos)
            written = 0
            for chunk in spec.source.chunks():
                mv = memoryview(chunk)
                fh.write(mv)
                written += len(mv)
                if on_chunk is not None:
                    on_chunk(spec.name, mv)
                if on_bytes is not None:
                    on_bytes(len(mv))
            if written != spec.nbytes:
                raise InputError(spec.source.describe(), f"gave {written} bytes for {spec.name!r}, expected {spec.nbytes}")
            pos = begin + written
        if sparse:
            fh.truncate(layout.file_size)
    return layout
