"""Reading the JSON documents relayout writes (manifests, plans, gate records) and JSONL traces.

Each versioned document carries ``format`` and ``version``; a file that is missing, unreadable,
of another format or version, or lacking a required key is one :class:`InputError`.
JSONL readers accept plain or zstd-compressed files and report ``file:line`` on bad records.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Iterator

from importlib import resources

import zstandard

from .errors import InputError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def read_document(path: str | os.PathLike, fmt: str, version: int, keys: tuple[str, ...], what: str,
                  missing: str = "no such file") -> dict:
    """Load a versioned JSON document and check its format, version and required keys."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(path, missing) from None
    except (OSError, ValueError) as exc:
        raise InputError(path, f"not a readable {what} ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise InputError(path, f"not a relayout {what}")
    if obj.get("version") != version:
        raise InputError(path, f"{what} version {obj.get('version')!r} is not supported (expected {version})")
    for key in keys:
        if key not in obj:
            raise InputError(path, f"{what} lacks {key!r}")
    return obj


def read_bytes(path: str | os.PathLike) -> bytes:
    """A file's bytes, decompressed when it is zstd."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    if raw[:4] == ZSTD_MAGIC:
        try:
            return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
        except zstandard.ZstdError as exc:
            raise InputError(path, f"corrupt zstd data ({exc})") from None
    return raw


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ``("file:line", record)`` for every non-blank line; each must be a JSON object."""
    path = Path(path)
    for lineno, raw in enumerate(read_bytes(path).split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(raw)
        except ValueError as exc:
            raise InputError(where, f"not JSON ({exc})") from None
        if not isinstance(rec, dict):
            raise InputError(where, "record is not a JSON object")
        yield where, rec


def shipped_names(folder: str) -> list[str]:
    """Names of the JSON data files shipped in ``manifests/<folder>``."""
    root = resources.files("manifests") / folder
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_shipped(folder: str, name_or_path: str, what: str) -> tuple[dict, str]:
    """A JSON data file: a path ending in .json, else ``manifests/<folder>/<name>.json``.

    Returns ``(object, where)``; unknown names list the shipped ones.
    """
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        text, where = path.read_text(), str(path)
    else:
        res = resources.files("manifests") / folder / f"{name_or_path}.json"
        if not res.is_file():
            raise InputError(None, f"unknown {what} {name_or_path!r} (known: {', '.join(shipped_names(folder))}, or a JSON file)")
        text, where = res.read_text(), name_or_path
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise InputError(where, f"not a valid {what} ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(where, f"not a valid {what} (not a JSON object)")
    return obj, where
