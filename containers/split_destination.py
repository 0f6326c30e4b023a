"""A rewrite's destinations over several directories: the primary ``DST`` and the split directories.

A layout split over drives (``COLI_MODEL_DIRS``, docs/MULTI_DRIVE.md) is rewritten with each shard
written straight into the directory of its drive. The primary directory (the engine's ``SNAP``)
gets its own shards and every file that is not a shard: config, tokenizer, the regenerated index,
the runtime's files, the journal and the manifest. Every directory is a
:class:`~containers.destination.Destination` (``DIR.partial`` until the end, no link followed,
locked, apart from the source), so the rewriter's guarantees hold in each.

* Before anything is created, every directory is checked: it must not exist (a split directory
  renamed by an earlier run of this same rewrite excepted, below), and no two may be the same or
  nested in each other (nor in the source).
* Each split directory's ``.partial`` first gets a mark, :data:`SPLIT_MARK`: the primary, the
  directory's place in the split, the rewrite's identity (source, plan) and the shards it holds.
  A resumed run accepts a split ``.partial`` only with this rewrite's mark (or with nothing in it
  but temp files: a run stopped right after ``mkdir``). The mark stays in the finished directory;
  colibrì indexes ``*.safetensors`` only.
* A directory that cannot be created: the ``.partial`` directories this run made (empty but for
  a mark) are removed again, and the error names the directory.
* Publishing (:meth:`Destinations.publish`), only once every file in every directory is durable
  and checked and the manifest written: the split directories are renamed first, the primary last,
  so the model's metadata appears only when every shard is in place. A run stopped between the
  renames is finished by the same command: a split directory already renamed is accepted when the
  primary's ``.partial`` exists, the split directory's own ``.partial`` does not, and it holds
  this rewrite's mark; its files are re-hashed like every journaled file.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .atomic import TEMP_NAME, describe_os_error, write_at
from .destination import Destination, check_new_destination, lexists, nested
from .errors import InputError

SPLIT_MARK = "relayout.split.json"
"""The mark in each split directory: which rewrite and which primary it belongs to, and its shards."""
MARK_FORMAT = "relayout.split"


@dataclass(frozen=True)
class SplitDirectory:
    """A directory of the split after the primary (an entry of ``COLI_MODEL_DIRS``) and the shard
    names written into it."""

    path: Path
    shards: tuple[str, ...]

    def to_json(self) -> dict:
        return {"path": str(self.path), "files": list(self.shards)}


def split_directories(split: list[tuple[str | os.PathLike, list[str]]], names: list[str]) -> list[SplitDirectory]:
    """``split`` as :class:`SplitDirectory` records with absolute paths, after checking that each
    shard name is one of ``names`` (the rewrite's files) and in one directory at most.

    Raises :class:`InputError` naming the directory and the shard otherwise.
    """
    known, seen, out = set(names), {}, []
    for path, shards in split:
        path = Path(os.path.abspath(path))
        for s in shards:
            if s not in known:
                raise InputError(path, f"shard {s} is not a file of the layout being written")
            if s in seen:
                raise InputError(path, f"shard {s} is also placed in {seen[s]}")
            seen[s] = path
        out.append(SplitDirectory(path, tuple(shards)))
    return out


def check_new_destinations(dst: str | os.PathLike, split: list[SplitDirectory], source_root: str | os.PathLike) -> list[bool]:
    """Check every directory of a split rewrite before anything is written; per split directory,
    whether it is already published by an earlier run (to be confirmed by its mark when opened).

    Raises :class:`InputError` naming a directory that exists (and is not such a published one),
    lies in or around the source, or is the same as or nested in another of the directories.
    """
    dst = check_new_destination(dst, source_root)
    primary_partial = dst.with_name(dst.name + ".partial")
    published = []
    for d in split:
        partial = d.path.with_name(d.path.name + ".partial")
        if lexists(d.path) and lexists(primary_partial) and not lexists(partial):
            published.append(True)
        else:
            check_new_destination(d.path, source_root)
            published.append(False)
    paths = [dst] + [d.path for d in split]
    real = [p.parent.resolve() / p.name for p in paths]
    for i, a in enumerate(real):
        for b in real[:i]:
            for x in (a, a.with_name(a.name + ".partial")):
                for y in (b, b.with_name(b.name + ".partial")):
                    if nested(x, y) or nested(y, x):
                        raise InputError(paths[i], f"the directories of a split may not be the same or nested in each other ({b})")
    return published


class Destinations:
    """The primary destination and the split directories' of one rewrite, each file by name in
    the one it belongs to. Use :meth:`open` (a context manager)."""

    def __init__(self, primary: Destination, others: list[Destination], where: dict[str, int]):
        self.primary = primary
        self.others = others
        self.where = where

    @property
    def all(self) -> list[Destination]:
        return [self.primary, *self.others]

    def of(self, name: str) -> Destination:
        """The destination a file of the rewrite is written in (the primary unless a split directory lists it)."""
        return self.all[self.where.get(name, 0)]

    def publish(self) -> None:
        """Rename every ``.partial`` to its directory: the split directories first, the primary last."""
        for d in self.others:
            d.publish()
        self.primary.publish()

    @classmethod
    @contextlib.contextmanager
    def open(cls, dst: str | os.PathLike, source_root: str | os.PathLike, own_names: tuple[str, ...],
             split: list[SplitDirectory], identity: dict):
        """Open (creating or resuming) the primary ``dst`` and every split directory; see the module doc.

        ``own_names`` are the files proving the primary's ``.partial`` is a previous rewrite's;
        ``identity`` (JSON-ready) identifies the rewrite in each split directory's mark.
        """
        published = check_new_destinations(dst, split, source_root)
        primary_dst = Path(os.path.abspath(dst))
        where = {s: i for i, d in enumerate(split, 1) for s in d.shards}
        with contextlib.ExitStack() as stack:
            opened: list[Destination] = []
            try:
                opened.append(stack.enter_context(Destination.open(dst, source_root, own_names)))
                for i, (d, done) in enumerate(zip(split, published), 1):
                    mark = {"format": MARK_FORMAT, "version": 1, "primary": str(primary_dst), "directory": i,
                            "identity": identity, "files": list(d.shards)}
                    if done:
                        dest = stack.enter_context(Destination.open_published(d.path, source_root, (SPLIT_MARK,)))
                    else:
                        dest = stack.enter_context(Destination.open(d.path, source_root, (SPLIT_MARK,)))
                    opened.append(dest)
                    _claim(dest, mark)
            except BaseException:
                for dest in opened:
                    _remove_if_unused(dest)
                raise
            yield cls(opened[0], opened[1:], where)


def _claim(dest: Destination, mark: dict) -> None:
    """Write ``mark`` into a split directory's ``.partial`` made by this run, or check the one there."""
    if dest.lstat(SPLIT_MARK) is None:
        if dest.published:
            raise InputError(dest.dst, "already exists; choose a new destination")
        data = (json.dumps(mark, separators=(",", ":")) + "\n").encode()
        try:
            write_at(dest.fd, SPLIT_MARK, data, dest.partial / SPLIT_MARK)
        except OSError as exc:
            raise InputError(dest.partial / SPLIT_MARK, describe_os_error(exc)) from None
        return
    try:
        fd = dest.open_read(SPLIT_MARK)
        with os.fdopen(fd, "rb") as fh:
            found = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        found = None
    if found != mark:
        what = "already exists" if dest.published else "exists"
        raise InputError(dest.partial, f"{what} and belongs to another rewrite or directory of a split (its {SPLIT_MARK} "
                                       "differs); remove it or choose another directory")


def _remove_if_unused(dest: Destination) -> None:
    """Remove a ``.partial`` this run made while it holds nothing but its mark and temp files."""
    if not dest.created:
        return
    with contextlib.suppress(OSError):
        names = dest.names()
        if all(n == SPLIT_MARK or TEMP_NAME.match(n) for n in names):
            for n in names:
                dest.unlink(n)
            os.rmdir(dest.partial)


__all__ = ["Destinations", "SPLIT_MARK", "SplitDirectory", "check_new_destinations", "split_directories"]
