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


RECEIPT = ".relayout-mirror.json"
"""The mirror stage's receipt in the mirror directory: the shards it copied, their sizes and xxh3-128."""


def stage_mirror(dirs: list[str | os.PathLike], names: list[str], mirror: str | os.PathLike) -> dict:
    """Copy the shards ``names`` (found in ``dirs`` as the engine finds them) into ``mirror``, each
    crash-safe (a hidden partial file, fsync, its xxh3-128 checked against the source's, then
    renamed) and resumable (a present file of the right size and digest is kept), then write the
    receipt (:data:`RECEIPT`) listing them. A present file that differs is never replaced: one
    :class:`InputError` names it. Returns the receipt."""
    from .atomic import fsync_dir, make_dirs, write_json_atomic

    found = check_split(dirs, [], content=False)
    missing = [n for n in names if n not in found.shards]
    if missing:
        raise InputError(None, f"shard {missing[0]} is in none of the split directories")
    mirror = make_dirs(mirror)
    files = []
    for n in names:
        src = found.shards[n]
        size = src.stat().st_size
        digest = hash_range(src, 0, size)
        dst = mirror / n
        if dst.is_symlink() or (dst.exists() and not dst.is_file()):
            raise InputError(dst, "exists and is not a regular file; not replaced")
        if dst.exists():
            if dst.stat().st_size != size or hash_range(dst, 0, size) != digest:
                raise InputError(dst, f"exists and differs from {src}; remove it to stage the mirror")
        else:
            _copy_checked(src, dst, size, digest)
            fsync_dir(mirror)
        files.append({"name": n, "bytes": size, "xxh3_128": digest})
    receipt = {"format": "relayout.mirror", "version": 1, "files": files}
    write_json_atomic(mirror / RECEIPT, receipt)
    return receipt


def _copy_checked(src: Path, dst: Path, size: int, digest: str) -> None:
    """``src`` to ``dst`` through a hidden partial file, renamed only when its digest is ``digest``."""
    tmp = dst.with_name(f".{dst.name}.relayout-partial")
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_file()):
        raise InputError(tmp, "exists and is not a regular file; not replaced")
    tmp.unlink(missing_ok=True)
    fin = os.open(src, os.O_RDONLY)
    try:
        fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            done = 0
            while done < size:
                n = os.copy_file_range(fin, fout, size - done, done, done)
                if n == 0:
                    raise InputError(src, f"ended at byte {done} of {size} while copying")
                done += n
            os.fsync(fout)
        finally:
            os.close(fout)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fin)
    if hash_range(tmp, 0, size) != digest:
        tmp.unlink(missing_ok=True)
        raise InputError(dst, "the copy's xxh3-128 differs from the source's; nothing was renamed")
    os.replace(tmp, dst)


def mirror_receipt_problems(mirror: str | os.PathLike) -> list[str]:
    """What in ``mirror`` disagrees with its receipt (sizes and digests); empty when it all holds."""
    import json

    path = Path(mirror) / RECEIPT
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        files = rec["files"]
        entries = [(str(f["name"]), int(f["bytes"]), str(f["xxh3_128"])) for f in files]
    except OSError as exc:
        return [f"{path}: cannot be read ({exc.strerror})"]
    except (ValueError, KeyError, TypeError):
        return [f"{path}: not a mirror receipt"]
    out = []
    for name, size, digest in entries:
        p = Path(mirror) / name
        if "/" in name or not p.is_file() or p.is_symlink():
            out.append(f"{p}: missing or not a regular file")
        elif p.stat().st_size != size or hash_range(p, 0, size) != digest:
            out.append(f"{p}: differs from its receipt")
    return out
