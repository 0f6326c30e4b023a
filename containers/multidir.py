"""A model split over several directories with mirrors, checked as colibrì will see it
(docs/MULTI_DRIVE.md): the shards it indexes, every tensor exactly once among them, and each mirror
file byte-identical to the shard it copies.

The engine collects ``*.safetensors`` from the primary directory, then each split directory in
order, a base name already taken from an earlier directory being skipped; a mirror file is used
when a shard of that base name is indexed and its size and header equal the shard's. Here a
shadowed duplicate, a tensor in two shards, a mirror file no shard names, or a mirror that differs
(in size, header or any byte: xxh3-128 of the whole file) are problems. Files are opened read-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError
from .hashing import hash_range
from .safetensors_io import read_header


@dataclass(frozen=True)
class SplitCheck:
    """``shards`` base name -> the path the engine indexes; ``mirrored`` per mirror directory the
    base names it serves; ``problems`` one line each (empty when the layout is sound)."""

    shards: dict[str, Path]
    mirrored: list[list[str]]
    problems: list[str]


def _safetensors(d: Path) -> list[Path]:
    if not d.is_dir():
        raise InputError(d, "no such directory")
    return sorted(p for p in d.iterdir() if p.name.endswith(".safetensors") and p.is_file())


def check_split(dirs: list[str | os.PathLike], mirrors: list[str | os.PathLike] = (), content: bool = True) -> SplitCheck:
    """Check a split (``dirs``, the primary first) with ``mirrors``; ``content=False`` compares
    sizes and headers only (what the engine itself checks), not every byte."""
    problems: list[str] = []
    shards: dict[str, Path] = {}
    for d in map(Path, dirs):
        for p in _safetensors(d):
            if p.name in shards:
                problems.append(f"{p}: shadowed by {shards[p.name]} (the engine reads the first directory's copy only)")
            else:
                shards[p.name] = p
    owner: dict[str, str] = {}
    for name, p in sorted(shards.items()):
        for t in read_header(p).tensors:
            if t in owner:
                problems.append(f"tensor {t} is in both {owner[t]} and {name}")
            else:
                owner[t] = name
    mirrored = []
    for m in map(Path, mirrors):
        ok = []
        for p in _safetensors(m):
            src = shards.get(p.name)
            if src is None:
                problems.append(f"{p}: no shard of the model has this name (the engine ignores it)")
                continue
            a, b = src.stat().st_size, p.stat().st_size
            if a != b:
                problems.append(f"{p}: {b} bytes, the shard {src} has {a}")
                continue
            ha, hb = read_header(src), read_header(p)
            if ha.data_start != hb.data_start or _head(src, ha.data_start) != _head(p, hb.data_start):
                problems.append(f"{p}: header differs from {src}'s (the engine skips it)")
                continue
            if content and hash_range(src, 0, a) != hash_range(p, 0, b):
                problems.append(f"{p}: bytes differ from {src} (same header: the engine would read them)")
                continue
            ok.append(p.name)
        if not ok:
            problems.append(f"{m}: no usable mirror file (the engine would skip the directory)")
        mirrored.append(ok)
    return SplitCheck(shards, mirrored, problems)


def _head(path: Path, n: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)
