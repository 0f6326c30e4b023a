"""The rewrite's destination: a directory that is ours alone, reached without following symlinks.

A rewrite to ``DST`` works in ``DST.partial/`` and renames it to ``DST`` when every file is done.
This module makes sure that nothing else can be hit on the way:

* ``DST`` must not exist in any form (a dangling symlink counts as existing).
* ``DST.partial`` is created by us (``mkdir``), or, on a resume, must be a real directory (never
  a symlink) holding our journal or, when every file was done, our manifest; one holding nothing
  but our temp files (a crash right after ``mkdir``) is adopted. Anything else is refused.
* It is opened once with ``O_DIRECTORY | O_NOFOLLOW``; every file inside is created, opened,
  renamed and removed relative to that descriptor (``openat``-style ``dir_fd``) with
  ``O_NOFOLLOW``, so a symlink planted inside it is never followed.
* The source and the destination may not be the same directory or nested in each other
  (compared by resolved path and by ``(st_dev, st_ino)``).
* An exclusive, non-blocking ``flock`` on the directory makes a second rewrite to the same
  destination fail at once instead of mixing its files in.
* The final rename never replaces anything: ``renameat2(RENAME_NOREPLACE)`` on Linux, else a
  check immediately before ``rename``.
* A rewrite over several directories (:mod:`containers.split_destination`) stopped between its
  renames reopens a directory it already renamed with :meth:`Destination.open_published`: a real
  directory, locked, apart from the source, holding the rewrite's own mark.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
from pathlib import Path

from .atomic import DIRECTORY, NOFOLLOW, TEMP_NAME, create_exclusive, create_temp, describe_os_error, fsync_fd, make_dirs
from .errors import InputError

RENAME_NOREPLACE = 1


def lexists(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise InputError(path, describe_os_error(exc)) from None


def nested(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies inside it (resolved paths)."""
    return a == b or b in a.parents


class Destination:
    """``DST.partial`` opened for a rewrite, locked, with file operations relative to its descriptor.

    Use :meth:`open` (a context manager); ``own_names`` are the files whose presence proves a
    partial directory is a previous rewrite's (its journal, or its manifest once every file is
    done); the caller checks that they are for this rewrite.
    """

    def __init__(self, dst: Path, partial: Path, fd: int, resumed: bool, published: bool = False):
        self.dst = dst
        self.partial = partial
        self.fd = fd
        self.resumed = resumed
        self.published = published
        """``partial`` is ``dst`` itself, renamed there by an earlier run of this rewrite (:meth:`open_published`)."""

    @classmethod
    @contextlib.contextmanager
    def open(cls, dst: str | os.PathLike, source_root: str | os.PathLike, own_names: tuple[str, ...]):
        dst = check_new_destination(dst, source_root)
        partial = dst.with_name(dst.name + ".partial")
        make_dirs(dst.parent)
        created = False
        try:
            os.mkdir(partial, 0o755)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise InputError(partial, f"cannot be created ({describe_os_error(exc)})") from None
        try:
            fd = os.open(partial, os.O_RDONLY | DIRECTORY | NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InputError(partial, "exists and is not a directory relayout created (a symlink or a file); "
                                          "remove it or choose another destination") from None
            raise InputError(partial, describe_os_error(exc)) from None
        try:
            _lock_apart(fd, partial, source_root)
            if not created:
                names = [n for n in os.listdir(fd) if not TEMP_NAME.match(n)]
                if names and not any(n in names for n in own_names):
                    raise InputError(partial, f"exists and holds files but no {' or '.join(own_names)}: it is not a "
                                              "partial rewrite of relayout's; remove it or choose another destination")
            yield cls(dst, partial, fd, resumed=not created)
        finally:
            os.close(fd)

    @classmethod
    @contextlib.contextmanager
    def open_published(cls, dst: str | os.PathLike, source_root: str | os.PathLike, own_names: tuple[str, ...]):
        """``dst`` itself, already renamed from ``DST.partial`` by an earlier run of the same rewrite.

        For a rewrite over several directories stopped between its final renames. ``dst`` must be
        a real directory (never a link) apart from the source, holding one of ``own_names`` (the
        caller checks it is this rewrite's); it is locked as ``DST.partial`` would be, and
        :meth:`publish` leaves it where it is.
        """
        dst = Path(os.path.abspath(dst))
        _check_apart(dst, Path(source_root))
        try:
            fd = os.open(dst, os.O_RDONLY | DIRECTORY | NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InputError(dst, "already exists and is not a directory relayout created; choose a new destination") from None
            raise InputError(dst, describe_os_error(exc)) from None
        try:
            _lock_apart(fd, dst, source_root)
            if not any(n in os.listdir(fd) for n in own_names):
                raise InputError(dst, "already exists; choose a new destination")
            yield cls(dst, dst, fd, resumed=True, published=True)
        finally:
            os.close(fd)

    @property
    def created(self) -> bool:
        """``DST.partial`` was made by this run (not resumed, not published)."""
        return not self.resumed

    # ------------------------------------------------------------------ files inside DST.partial
    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_regular(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def create(self, name: str) -> int:
        """A new file (exclusive: never an existing file or a symlink), open for writing."""
        return create_exclusive(self.fd, name)

    def create_temp(self, name: str) -> tuple[int, str]:
        """A new temp file for ``name`` under an unpredictable name: ``(descriptor, temp name)``."""
        return create_temp(self.fd, name)

    def open_read(self, name: str) -> int:
        return os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=self.fd)

    def replace(self, old: str, new: str) -> None:
        os.replace(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def sync(self) -> None:
        fsync_fd(self.fd)

    def publish(self) -> None:
        """Rename ``DST.partial`` to ``DST``, never replacing anything at ``DST``; fsync the parent.

        The entry renamed must still be the directory written (a link or another directory put in
        its place is refused, not published).
        """
        self.sync()
        if self.published:
            return
        st, ours = os.lstat(self.partial), os.fstat(self.fd)
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (ours.st_dev, ours.st_ino):
            raise InputError(self.partial, "was replaced while the rewrite ran; nothing was published")
        rename_noreplace(self.partial, self.dst)
        parent = os.open(self.dst.parent, os.O_RDONLY | DIRECTORY)
        try:
            fsync_fd(parent)
        finally:
            os.close(parent)


def _lock_apart(fd: int, where: Path, source_root: str | os.PathLike) -> None:
    """Lock the opened directory ``fd`` exclusively (a second rewrite fails at once) and refuse it
    when it is the source itself."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InputError(where, "another relayout rewrite is writing this destination now; wait for it "
                                "or choose another destination") from None
    src_st = os.stat(source_root)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino):
        raise InputError(where, "is the source container itself; choose another destination")


def check_new_destination(dst: str | os.PathLike, source_root: str | os.PathLike) -> Path:
    """``dst`` as an absolute path, after checking it does not exist in any form and lies apart
    from the source; raises :class:`InputError` naming the path otherwise. Writes nothing, so a
    command can check before long work what the rewrite would refuse after it."""
    dst = Path(os.path.abspath(dst))
    if lexists(dst):
        raise InputError(dst, "already exists; choose a new destination")
    _check_apart(dst, Path(source_root))
    return dst


def _check_apart(dst: Path, source_root: Path) -> None:
    src = source_root.resolve()
    real_parent = dst.parent.resolve()
    for candidate in (real_parent / dst.name, real_parent / (dst.name + ".partial")):
        if nested(candidate, src) or nested(src, candidate):
            raise InputError(dst, f"the destination and the source {src} may not be the same or nested in each other")


def _libc_renameat2():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_renameat2()
AT_FDCWD = -100


def rename_noreplace(old: Path, new: Path) -> None:
    """Rename ``old`` to ``new``, never replacing anything at ``new`` (one :class:`InputError` when something is there)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise InputError(new, "appeared while relayout wrote it; the finished result is kept at "
                                  f"{old}: move it yourself once you have checked {new}")
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise InputError(new, describe_os_error(OSError(err, os.strerror(err))))
    if lexists(new):
        raise InputError(new, f"appeared while relayout wrote it; the finished result is kept at {old}")
    os.rename(old, new)


__all__ = ["Destination", "check_new_destination", "lexists", "nested", "rename_noreplace"]
