"""Vertical split segments of expert tensors (format: ``docs/SPLIT_SEGMENTS.md``).

An original tensor becomes ``<name>.top`` and ``<name>.bottom``. A :class:`SegmentSpec` says how:

* ``rows``: the first ``split`` rows are the top, the rest the bottom;
* ``columns``: bytes ``[0, split)`` of every row are the top, the rest of every row the bottom;
* ``shared``: both halves are the whole tensor (down's per-row scales serve both halves).

This module is pure arithmetic plus byte sources; the planner decides ``split`` and the rewriter
and verifier use these functions, so all three agree by construction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import xxhash

from .geometry import ExpertFormat, projection_shape
from .sources import FileRange, StridedRange

PARTS = ("top", "bottom")


@dataclass(frozen=True)
class SegmentSpec:
    kind: str          # "rows" | "columns" | "shared"
    rows: int
    row_bytes: int
    split: int | None  # row index (rows), byte offset within a row (columns), None (shared)

    def nbytes(self, part: str) -> int:
        total = self.rows * self.row_bytes
        if self.kind == "shared":
            return total
        if self.kind == "rows":
            top = self.split * self.row_bytes
        else:
            top = self.rows * self.split
        return top if part == "top" else total - top

    def source(self, part: str, path: Path, offset: int):
        """The bytes of one segment, read from the original tensor at ``offset`` of ``path``."""
        if self.kind == "shared":
            return FileRange(path, offset, self.rows * self.row_bytes)
        if self.kind == "rows":
            top = self.split * self.row_bytes
            return FileRange(path, offset, top) if part == "top" else FileRange(path, offset + top, self.rows * self.row_bytes - top)
        if part == "top":
            return StridedRange(path, offset, self.rows, self.row_bytes, 0, self.split)
        return StridedRange(path, offset, self.rows, self.row_bytes, self.split, self.row_bytes - self.split)

    def to_json(self) -> dict:
        return asdict(self)


def expert_segment_specs(fmt: ExpertFormat, hidden: int, ffn: int, top_rows: int) -> dict[tuple[str, bool], SegmentSpec]:
    """``{(proj, is_scale): spec}`` for an expert split after ``top_rows`` FFN rows."""
    out = {}
    for proj in ("gate", "up", "down"):
        rows, cols = projection_shape(proj, hidden, ffn)
        wrow = math.ceil(cols * fmt.bits / 8)
        srow = 4 * (1 if fmt.group is None else math.ceil(cols / fmt.group))
        if proj != "down":
            out[(proj, False)] = SegmentSpec("rows", rows, wrow, top_rows)
            out[(proj, True)] = SegmentSpec("rows", rows, srow, top_rows)
        else:
            out[(proj, False)] = SegmentSpec("columns", rows, wrow, top_rows * fmt.bits // 8)
            if fmt.group is None:
                out[(proj, True)] = SegmentSpec("shared", rows, srow, None)
            else:
                out[(proj, True)] = SegmentSpec("columns", rows, srow, 4 * (top_rows // fmt.group))
    return out


def reassembled_chunks(spec: SegmentSpec, top_path: Path, top_offset: int, bottom_path: Path, bottom_offset: int,
                       block_rows: int = 4096) -> Iterator[bytes]:
    """The original tensor's bytes, rebuilt from its two segments, in bounded chunks."""
    if spec.kind in ("shared", "rows"):
        yield from FileRange(top_path, top_offset, spec.nbytes("top")).chunks()
        if spec.kind == "rows":
            yield from FileRange(bottom_path, bottom_offset, spec.nbytes("bottom")).chunks()
        return
    t = spec.split
    b = spec.row_bytes - t
    with open(top_path, "rb") as ft, open(bottom_path, "rb") as fb:
        for r0 in range(0, spec.rows, block_rows):
            n = min(block_rows, spec.rows - r0)
            ft.seek(top_offset + r0 * t)
            fb.seek(bottom_offset + r0 * b)
            top, bottom = ft.read(n * t), fb.read(n * b)
            out = bytearray(n * spec.row_bytes)
            view = memoryview(out)
            for i in range(n):
                view[i * spec.row_bytes : i * spec.row_bytes + t] = top[i * t : (i + 1) * t]
                view[i * spec.row_bytes + t : (i + 1) * spec.row_bytes] = bottom[i * b : (i + 1) * b]
            yield bytes(out)


def reassembled_digest(spec: SegmentSpec, top: tuple[Path, int], bottom: tuple[Path, int]) -> str:
    h = xxhash.xxh3_128()
    for chunk in reassembled_chunks(spec, top[0], top[1], bottom[0], bottom[1]):
        h.update(chunk)
    return h.hexdigest()
