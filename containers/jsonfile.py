"""Reading the JSON documents relayout writes (manifests, plans, gate records) and JSONL traces.

Each versioned document carries ``format`` and ``version``; a file that is missing, unreadable,
of another format or version, or lacking a required key is one :class:`InputError`.
JSONL readers accept plain or zstd-compressed files and report ``file:line`` on bad records.
Input nested too deeply for the parser is invalid JSON like any other (:func:`parse_json`).

Data shipped with relayout (geometries, device profiles, atlases, schemas) lives in the regular
package ``manifests``, one folder per kind; :func:`shipped_dir` is the one way to reach it, and
works the same from a source checkout, a wheel, ``pip install .`` and ``pip install -e .``.
"""

from __future__ import annotations

import io
import json
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Iterator

import zstandard

from .errors import InputError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DATA_PACKAGE = "manifests"


def parse_json(data: str | bytes):
    """``json.loads``, with input nested too deeply to parse raised as ``ValueError`` like any invalid JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_document(path: str | os.PathLike, fmt: str, version: int, keys: tuple[str, ...], what: str,
                  missing: str = "no such file") -> dict:
    """Load a versioned JSON document and check its format, version and required keys."""
    path = Path(path)
    try:
        obj = parse_json(path.read_bytes())
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
            rec = parse_json(raw)
        except ValueError as exc:
            raise InputError(where, f"not JSON ({exc})") from None
        if not isinstance(rec, dict):
            raise InputError(where, "record is not a JSON object")
        yield where, rec


def shipped_dir(folder: str) -> Traversable:
    """The shipped data folder ``manifests/<folder>``, wherever and however relayout is installed."""
    return resources.files(DATA_PACKAGE).joinpath(folder)


def shipped_names(folder: str) -> list[str]:
    """Names of the JSON data files shipped in ``manifests/<folder>``."""
    root = shipped_dir(folder)
    if not root.is_dir():
        return []
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json") and p.is_file())


def read_shipped(folder: str, name_or_path: str | os.PathLike, what: str) -> tuple[str, str]:
    """The text of a data file and where it came from: a shipped name, else a path.

    Names are the files of ``manifests/<folder>`` less ``.json``; anything ending in ``.json``,
    holding a path separator or naming an existing file is a path. An unknown name lists the
    shipped ones.
    """
    path = Path(name_or_path)
    name = str(name_or_path)
    known = shipped_names(folder)
    if path.suffix == ".json" or os.sep in name or (name not in known and path.is_file()):
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except FileNotFoundError:
            raise InputError(path, "no such file") from None
        except (OSError, ValueError) as exc:
            raise InputError(path, f"not a readable {what} ({getattr(exc, 'strerror', None) or exc})") from None
    if name not in known:
        raise InputError(None, f"unknown {what} {name!r} (known: {', '.join(known)}, or a JSON file)")
    return shipped_dir(folder).joinpath(f"{name}.json").read_text(encoding="utf-8"), name


def load_shipped(folder: str, name_or_path: str, what: str) -> tuple[dict, str]:
    """A JSON data file: a path ending in .json, else ``manifests/<folder>/<name>.json``.

    Returns ``(object, where)``; unknown names list the shipped ones.
    """
    text, where = read_shipped(folder, name_or_path, what)
    try:
        obj = parse_json(text)
    except ValueError as exc:
        raise InputError(where, f"not a valid {what} ({exc})") from None
    if not isinstance(obj, dict):
        raise InputError(where, f"not a valid {what} (not a JSON object)")
    return obj, where
