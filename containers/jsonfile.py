"""Reading the JSON documents relayout writes (manifests, plans, gate records) and JSONL traces.

Each versioned document carries ``format`` and ``version``; a file that is missing, unreadable,
of another format or version, or lacking a required key is one :class:`InputError`.
JSONL readers accept plain or zstd-compressed files and report ``file:line`` on bad records.
Input nested too deeply for the parser, and an object naming a key twice, are invalid JSON like
any other (:func:`parse_json`).

Text inputs are read in blocks (:func:`text_blocks`), so memory is bounded by the longest line,
at most :data:`MAX_LINE_BYTES`. A zstd file may decompress to at most :data:`MAX_EXPANSION` times
its size (and at least :data:`MIN_INFLATED_BYTES`): real traces compress some tenfold, so a small
file inflating past that is refused as soon as it does, before it is held or parsed.

Data shipped with relayout (geometries, device profiles, atlases, schemas) lives in the regular
package ``manifests``, one folder per kind; :func:`shipped_dir` is the one way to reach it, and
works the same from a source checkout, a wheel, ``pip install .`` and ``pip install -e .``.
"""

from __future__ import annotations

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
MAX_LINE_BYTES = 1 << 20
"""The longest line a text input (JSONL record, ROUTE_TRACE line) may have, bytes."""
MAX_EXPANSION = 1000
"""The most a zstd input may inflate, as a multiple of its compressed size."""
MIN_INFLATED_BYTES = 64 << 20
"""A zstd input may always decompress to this many bytes, whatever its size."""
BLOCK_BYTES = 1 << 20


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key[:80]!r} given twice in one object")
            seen.add(key)
    return obj


def parse_json(data: str | bytes):
    """``json.loads``, with input nested too deeply to parse, and an object giving a key twice,
    raised as ``ValueError`` like any invalid JSON."""
    try:
        return json.loads(data, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def inflated_limit(compressed_bytes: int) -> int:
    """The most bytes a zstd input of ``compressed_bytes`` may decompress to."""
    return max(MIN_INFLATED_BYTES, MAX_EXPANSION * compressed_bytes)


def file_chunks(path: str | os.PathLike, chunk_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """A file's bytes in chunks of at most ``chunk_bytes``, decompressed when it is zstd (every
    frame), refused once they pass :func:`inflated_limit`."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(0)
            if head != ZSTD_MAGIC:
                while chunk := fh.read(chunk_bytes):
                    yield chunk
                return
            size = os.fstat(fh.fileno()).st_size
            limit, total = inflated_limit(size), 0
            reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
            while chunk := reader.read(chunk_bytes):
                total += len(chunk)
                if total > limit:
                    raise InputError(path, f"decompresses to more than {limit:,} bytes ({MAX_EXPANSION}x its {size:,} "
                                           "compressed bytes): refused as a decompression bomb")
                yield chunk
    except OSError as exc:
        raise InputError(path, exc.strerror or str(exc)) from None
    except zstandard.ZstdError as exc:
        raise InputError(path, f"corrupt zstd data ({exc})") from None


def text_blocks(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[int, bytes]]:
    """``(first line number, bytes)`` of consecutive blocks of whole lines of a text file (zstd
    decompressed as it is read, within :func:`inflated_limit`), each about ``block_bytes`` long;
    a line longer than :data:`MAX_LINE_BYTES` is an error naming it."""
    line, carry = 1, b""
    for chunk in file_chunks(path, block_bytes):
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        block, carry = data[:cut], data[cut:]
        if block:
            yield line, block
            line += block.count(b"\n")
        if len(carry) > MAX_LINE_BYTES:
            raise InputError(f"{path}:{line}", f"line longer than {MAX_LINE_BYTES:,} bytes")
    if carry:
        yield line, carry


def iter_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` for every line of a text file that is not blank (see
    :func:`text_blocks`); blank runs are skipped a block at a time."""
    for first, block in text_blocks(path):
        if block.isspace():
            continue
        for lineno, raw in enumerate(block.split(b"\n"), first):
            if len(raw) > MAX_LINE_BYTES:
                raise InputError(f"{path}:{lineno}", f"line longer than {MAX_LINE_BYTES:,} bytes")
            if raw.strip():
                yield lineno, raw


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
    """A file's bytes, decompressed when it is zstd (within :func:`inflated_limit`)."""
    return b"".join(file_chunks(path))


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Yield ``("file:line", record)`` for every non-blank line; each must be a JSON object."""
    path = Path(path)
    for lineno, raw in iter_lines(path):
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
