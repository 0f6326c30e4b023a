"""Every file relayout writes goes through here: created exclusively, renamed into place, never through a link.

A file is written to a temp name in its target's directory, fsynced, renamed over the target and
the directory fsynced: a reader never sees a half-written file under its final name, only the
old state or the complete new file.

* The temp name is unpredictable (``.NAME.tmp-`` and 16 hex digits from ``os.urandom``,
  :func:`temp_name`) and created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to a descriptor
  of the directory, so nothing planted at any name is opened, followed or overwritten.
* The target is looked at without following it (``lstat``): absent or a regular file, it is
  replaced by the rename; a directory, symlink, FIFO, socket, block device or other character
  device is refused with one :class:`InputError` naming it. A *sink* (the null device, or the
  terminal the command runs on; also when reached through a symlink such as ``/dev/stdout``) is
  opened for writing and written to, never replaced.
* The directories on the way to the target are the user's own choice and are followed as given.

On macOS ``fsync`` does not flush the drive's cache, so ``F_FULLFSYNC`` is used where available.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import re
import stat
from pathlib import Path
from typing import Iterator

from .errors import InputError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TEMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]+$")
"""A temp file of ours (``.NAME.tmp-RANDOM``; older runs used the process id, also matched)."""
TEMP_RANDOM_HEX = 16


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
    fd = os.open(path, os.O_RDONLY | DIRECTORY)
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


def temp_name(name: str) -> str:
    """An unpredictable temp name for ``name`` in the same directory: ``.NAME.tmp-`` + 16 random hex digits."""
    return f".{name}.tmp-{os.urandom(TEMP_RANDOM_HEX // 2).hex()}"


def create_exclusive(dir_fd: int, name: str, mode: int = 0o644) -> int:
    """A new file ``name`` in the directory ``dir_fd``, open for writing; never an existing file or a link."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode, dir_fd=dir_fd)


def create_temp(dir_fd: int, name: str, mode: int = 0o644, made: list[str] | None = None) -> tuple[int, str]:
    """A new temp file for ``name`` in ``dir_fd`` under an unpredictable name: ``(descriptor, temp name)``.

    ``made``, when given, receives the temp name *before* the file is created, so a caller
    interrupted (Ctrl-C) between the creation and the return still knows what to remove.
    """
    for _ in range(16):
        tmp = temp_name(name)
        if made is not None:
            made.append(tmp)
        try:
            return create_exclusive(dir_fd, tmp, mode), tmp
        except FileExistsError:
            if made is not None:
                made.remove(tmp)
    raise FileExistsError(errno.EEXIST, "no free temp name", name)


def remove_temps(dir_fd: int, names: list[str]) -> None:
    """Remove the temp files ``names`` from ``dir_fd`` (those that exist)."""
    for tmp in names:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)


def _sink_devices() -> set[int]:
    """``st_rdev`` of the character devices a user plainly means as a sink: the null device and this
    process's terminal."""
    devs = set()
    for probe in (os.devnull, "/dev/tty"):
        with contextlib.suppress(OSError):
            st = os.stat(probe)
            if stat.S_ISCHR(st.st_mode):
                devs.add(st.st_rdev)
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError, ValueError):
            st = os.fstat(fd)
            if stat.S_ISCHR(st.st_mode) and os.isatty(fd):
                devs.add(st.st_rdev)
    return devs


def is_sink(st: os.stat_result) -> bool:
    """``st`` is a character device a user plainly means as a sink (the null device or a terminal)."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev in _sink_devices()


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISCHR, "a character device other than /dev/null or a terminal")):
        if test(m):
            return what
    return "not a regular file"


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def target_state(dir_fd: int, name: str, path: Path) -> str:
    """What stands at ``name`` in ``dir_fd``: ``"absent"``, ``"regular"`` or ``"sink"``; anything else is refused.

    Raises
    ------
    InputError
        The target is a directory, symlink (other than one to a sink), FIFO, socket or device.
    """
    st = _lstat_at(dir_fd, name)
    if st is None:
        return "absent"
    if stat.S_ISREG(st.st_mode):
        return "regular"
    if is_sink(st):
        return "sink"
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            if is_sink(os.stat(name, dir_fd=dir_fd)):
                return "sink"
    raise InputError(path, f"is {_kind(st)}; relayout writes only regular files (and /dev/null or a terminal): "
                           "remove it or choose another path")


def open_dir(path: str | os.PathLike, target: Path) -> int:
    """A descriptor of directory ``path`` (where ``target`` is to be written); one :class:`InputError` when it cannot be."""
    try:
        return os.open(path, os.O_RDONLY | DIRECTORY | CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(target, f"cannot be written: {path} is not a directory") from None
    except OSError as exc:
        raise InputError(target, f"cannot be written ({describe_os_error(exc)})") from None


def _open_sink(dir_fd: int, name: str) -> int:
    fd = os.open(name, os.O_WRONLY | CLOEXEC | getattr(os, "O_NOCTTY", 0), dir_fd=dir_fd)
    if not is_sink(os.fstat(fd)):
        os.close(fd)
        raise OSError(errno.EINVAL, "changed while it was opened", name)
    return fd


def rename_into_place(dir_fd: int, tmp: str, name: str, path: Path) -> None:
    """Rename ``tmp`` over ``name`` (both in ``dir_fd``) when ``name`` is absent or a regular file; fsync the directory.

    The target is looked at again just before the rename, so a link, FIFO or device put there
    while the file was written is refused, not replaced.
    """
    if target_state(dir_fd, name, path) == "sink":
        raise InputError(path, "became a device while it was written; nothing was written to it")
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    fsync_fd(dir_fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """A file object for writing ``path``: on clean exit its data is fsynced and renamed onto ``path``.

    ``mode`` is ``"wb"`` or ``"w"`` (UTF-8 text). A temp file is created exclusively under an
    unpredictable name beside ``path`` (see the module doc); on any exception it is removed and
    ``path`` is left as it was. A sink (``/dev/null``, a terminal) is written to directly.

    Raises
    ------
    InputError
        The target is a directory, symlink, FIFO, socket or other device; its directory does not
        exist; or a write fails (the message names ``path``).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_output mode must be 'wb' or 'w', not {mode!r}")
    path = Path(path)
    name = path.name
    if not name or name in (".", ".."):
        raise InputError(path, "is not a file name")
    dir_fd = open_dir(path.parent if str(path.parent) else ".", path)
    tmp = None
    made: list[str] = []
    try:
        state = target_state(dir_fd, name, path)
        try:
            if state == "sink":
                fd = _open_sink(dir_fd, name)
            else:
                fd, tmp = create_temp(dir_fd, name, made=made)
            raw = os.fdopen(fd, "wb")
        except OSError as exc:
            raise InputError(path, describe_os_error(exc)) from None
        fh = raw if mode == "wb" else io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
        try:
            with fh:
                yield fh
                fh.flush()
                if tmp is not None:
                    fsync_fd(raw.fileno())
            if tmp is not None:
                rename_into_place(dir_fd, tmp, name, path)
                made.clear()
        except OSError as exc:
            raise InputError(path, describe_os_error(exc)) from exc
    finally:
        remove_temps(dir_fd, made)
        os.close(dir_fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` crash-safely (see :func:`atomic_output`)."""
    with atomic_output(path, "wb") as fh:
        fh.write(data)


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` crash-safely (see :func:`atomic_output`)."""
    with atomic_output(path, "w") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=False)
        fh.write("\n")


def write_at(dir_fd: int, name: str, data: bytes, where: Path) -> None:
    """Write ``data`` to ``name`` inside the directory ``dir_fd`` crash-safely (temp, fsync, rename, fsync).

    ``where`` names the file in errors (:class:`OSError` is raised as is, for the caller to word).
    """
    made: list[str] = []
    try:
        fd, tmp = create_temp(dir_fd, name, made=made)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fsync_fd(fd)
        finally:
            os.close(fd)
        rename_into_place(dir_fd, tmp, name, where)
        made.clear()
    finally:
        remove_temps(dir_fd, made)


__all__ = ["TEMP_NAME", "atomic_output", "create_exclusive", "create_temp", "describe_os_error", "fsync_dir", "fsync_fd",
           "is_sink", "make_dirs", "open_dir", "remove_temps", "rename_into_place", "target_state", "temp_name", "write_at",
           "write_bytes_atomic", "write_json_atomic"]
