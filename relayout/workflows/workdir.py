"""A command's work directory and the record of exactly what the command made in it.

``demo`` and ``validate`` write into a work directory that carries a marker file (``.relayout-demo``,
``.relayout-validate``). The marker is the record: a JSON object listing every path the commands
made there, each with its device and inode numbers (and a file's modification time). Removal
removes exactly those paths (a path that no longer matches was replaced or changed by someone
else and is kept) and a directory only once it is
empty; anything else in the directory is left, and :meth:`WorkDir.remove` says what was kept and
why.

* A name is claimed (recorded) before anything is written under it (:meth:`WorkDir.claim`), and
  what lies under a claimed name is listed when the run ends (:meth:`WorkDir.seal`, also done by
  :meth:`WorkDir.remove`), so a run stopped with Ctrl-C still removes what it made. A name
  claimed by a run that was killed outright is not listed: it is kept, and the next run asks the
  user to move it away.
* The marker is written crash-safely and never through a symlink
  (:func:`containers.atomic.write_json_atomic` refuses a link at its target), and read without
  following one. A symlink or non-directory at the work directory itself is refused.
* Removal walks the directory through descriptors opened with ``O_NOFOLLOW``, so a recorded
  directory replaced by a link is not followed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path

from containers.atomic import DIRECTORY, NOFOLLOW, make_dirs, write_json_atomic
from containers.errors import InputError

RECORD_FORMAT = "relayout.workdir"
RECORD_VERSION = 1
MAX_LISTED = 5


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _identity(st: os.stat_result) -> dict:
    """What identifies a path as the one relayout made: device, inode, kind, and for a file its
    modification time (an inode number is reused at once for a new file)."""
    ident = {"dev": st.st_dev, "ino": st.st_ino, "dir": stat.S_ISDIR(st.st_mode)}
    if not stat.S_ISDIR(st.st_mode):
        ident["mtime_ns"] = st.st_mtime_ns
    return ident


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


class WorkDir:
    """A work directory ``path`` whose marker file ``marker`` records what ``command`` made in it.

    Use :meth:`open`. ``paths`` maps a path relative to the directory to its identity
    (``{"dev", "ino", "dir"}``, and ``"mtime_ns"`` for a file: listed) or to ``{"claimed": run}``
    (claimed by run ``run``, not yet listed).
    """

    def __init__(self, path: Path, marker: str, command: str, made_dir: bool, paths: dict):
        self.path = path
        self.marker = marker
        self.command = command
        self.made_dir = made_dir
        self.paths = paths
        self.run = os.urandom(8).hex()

    @classmethod
    def open(cls, path: str | os.PathLike, marker: str, command: str, made_dir: bool = False) -> "WorkDir":
        """The work directory ``path``: new, empty, or a previous run's (it holds ``marker``).

        ``made_dir``: the caller has just created ``path`` itself (an empty temporary directory).

        Raises
        ------
        InputError
            ``path`` is a symlink or not a directory, holds anything but no marker, or its marker
            is not a regular file.
        """
        path = Path(path)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise InputError(path, f"is not a directory; give a new or empty directory for relayout {command}")
        paths: dict = {}
        if path.is_dir():
            st = os.lstat(path / marker) if os.path.lexists(path / marker) else None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise InputError(path / marker, "is not a regular file (a symlink?); relayout does not write through "
                                                "links: remove it")
            if st is None and any(path.iterdir()):
                raise InputError(path, f"is not empty and is not a previous {command}'s directory (no {marker} in "
                                       "it); give a new or empty directory")
            if st is not None:
                record = cls._read(path, marker)
                made_dir = made_dir or bool(record.get("made_dir"))
                paths = record.get("paths", {})
        else:
            make_dirs(path)
            made_dir = True
        work = cls(path, marker, command, made_dir, paths)
        work._save()
        return work

    @staticmethod
    def _read(path: Path, marker: str) -> dict:
        """The record in the marker (read without following a link); empty for a marker of an older
        relayout, which recorded nothing."""
        try:
            fd = os.open(path / marker, os.O_RDONLY | NOFOLLOW)
            with os.fdopen(fd, "rb") as fh:
                obj = json.loads(fh.read(1 << 24))
        except (OSError, ValueError, RecursionError):
            return {}
        if not (isinstance(obj, dict) and obj.get("format") == RECORD_FORMAT and isinstance(obj.get("paths"), dict)):
            return {}
        paths = {k: v for k, v in obj["paths"].items()
                 if isinstance(k, str) and isinstance(v, dict) and k and not k.startswith("/") and ".." not in k.split("/")}
        return {"made_dir": obj.get("made_dir") is True, "paths": paths}

    def _save(self) -> None:
        write_json_atomic(self.path / self.marker, {
            "format": RECORD_FORMAT, "version": RECORD_VERSION, "command": self.command,
            "note": f"made by relayout {self.command}: it removes only the paths listed here",
            "made_dir": self.made_dir, "paths": self.paths})

    # ------------------------------------------------------------------ making
    def claim(self, *names: str) -> Path:
        """Paths for new outputs ``names`` (plain names in the directory), recorded before anything is
        written under them; a previous run's outputs there are removed first. Returns the first path.

        Raises
        ------
        InputError
            Something at a name was not made by relayout (nothing is removed then), or was left by a
            run that was killed before it recorded what it made.
        """
        for name in names:
            if "/" in name or name in ("", ".", "..", self.marker):
                raise ValueError(f"not a plain work-directory name: {name!r}")
        kept = []
        for name in names:
            if not os.path.lexists(self.path / name):
                continue
            entry = self.paths.get(name)
            if entry is None:
                raise InputError(self.path / name, f"was not made by relayout {self.command} (not in {self.marker}); "
                                                   "move it away")
            if "claimed" in entry and entry["claimed"] != self.run:
                raise InputError(self.path / name, "is left by a run that was stopped before it recorded what it made; "
                                                   "remove it yourself (relayout removes only what it recorded)")
            if "claimed" in entry:
                self._list(name)
            kept += self._remove_names([name])
        self._save()
        if kept:
            raise InputError(self.path, f"holds {_listed(kept)}, which relayout {self.command} did not make; move "
                                        f"{'it' if len(kept) == 1 else 'them'} away")
        for name in names:
            self.paths[name] = {"claimed": self.run}
        self._save()
        return self.path / names[0]

    def _list(self, name: str) -> None:
        """Record ``name`` and everything under it as made (no link is followed)."""
        for k in [k for k in self.paths if k == name or k.startswith(name + "/")]:
            del self.paths[k]
        top = self.path / name
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            return
        self.paths[name] = _identity(st)
        if not stat.S_ISDIR(st.st_mode):
            return
        for root, dirs, files in os.walk(top, followlinks=False):
            for n in dirs + files:
                p = Path(root) / n
                with contextlib.suppress(FileNotFoundError):
                    self.paths[str(p.relative_to(self.path))] = _identity(os.lstat(p))

    def seal(self) -> None:
        """List what lies under every name this run claimed, and record it."""
        for name in [k for k, v in self.paths.items() if v.get("claimed") == self.run]:
            self._list(name)
        self._save()

    # ------------------------------------------------------------------ removing
    def _remove_names(self, names: list[str]) -> list[str]:
        """Remove the recorded paths at and under ``names``; the relative paths kept (not made by relayout)."""
        kept: list[str] = []
        fd = os.open(self.path, os.O_RDONLY | DIRECTORY | NOFOLLOW)
        try:
            for name in names:
                self._remove_at(fd, name, name, kept)
        finally:
            os.close(fd)
        return kept

    def _remove_at(self, parent_fd: int, name: str, rel: str, kept: list[str]) -> None:
        st = _lstat_at(parent_fd, name)
        entry = self.paths.get(rel)
        if st is None:
            self.paths.pop(rel, None)
            return
        if entry is None or "ino" not in entry or _identity(st) != entry:
            self.paths.pop(rel, None)
            kept.append(rel)
            return
        if stat.S_ISDIR(st.st_mode):
            try:
                fd = os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW, dir_fd=parent_fd)
            except OSError:
                kept.append(rel)
                return
            try:
                if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (st.st_dev, st.st_ino):
                    kept.append(rel)
                    return
                for child in sorted(os.listdir(fd)):
                    self._remove_at(fd, child, f"{rel}/{child}", kept)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=parent_fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                return
        else:
            os.unlink(name, dir_fd=parent_fd)
        self.paths.pop(rel, None)

    def remove(self) -> list[str]:
        """Remove exactly what was recorded (this run's claims listed first); the directory too when
        relayout made it and nothing else is left in it. Returns sentences on what was kept and why."""
        self.seal()
        names = sorted({k.split("/")[0] for k in self.paths})
        kept = self._remove_names(names)
        others = sorted(n for n in os.listdir(self.path) if n != self.marker and n not in self.paths)
        if not others and not self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / self.marker)
            if self.made_dir:
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)
            return []
        self._save()
        unmade = sorted(set(kept) | set(others))
        return [f"kept {self.path}: it holds {_listed(unmade)}, which relayout {self.command} did not make (or which "
                "changed since it made them); everything it made and recorded was removed"]


__all__ = ["WorkDir"]
