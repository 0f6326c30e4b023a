"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader never sees a half-written file under its final name: either the old state or the
complete new file. On macOS ``fsync`` does not flush the drive's cache, so ``F_FULLFSYNC`` is used
where available.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Iterator

from .errors import InputError


def fsync_fd(fd: int) -> None:
    """Flush a file descriptor's data to stable storage (F_FULLFSYNC on macOS)."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (so a rename inside it survives a crash)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def describe_os_error(exc: OSError) -> str:
    """A short, user-facing description of an OSError (disk full gets its own words)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the destination device"
    return exc.strerror or str(exc)


def make_dirs(path: str | os.PathLike) -> Path:
    """Create directory ``path`` and its parents (existing is fine); one :class:`InputError` when it cannot be."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(path, "cannot be created: it exists and is not a directory") from None
    except OSError as exc:
        raise InputError(path, f"cannot be created ({describe_os_error(exc)})") from None
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temp file next to ``path``; on clean exit fsync it and rename it onto ``path``.

    On any exception the temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if not path.parent.is_dir():
        raise InputError(path, f"cannot be written: {path.parent} is not a directory")
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            fsync_fd(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise InputError(path, describe_os_error(exc)) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` crash-safely."""
    with atomic_output(path, "w") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=False)
        fh.write("\n")
