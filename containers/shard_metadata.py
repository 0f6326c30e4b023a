"""The ``__metadata__`` of shards: colibrì's format stamps and the keys a rewrite keeps.

**Format stamps.** colibrì reads ``__metadata__["colibri.fmt"]`` of every shard: a string holding
JSON text, a flat ``{tensor name: format name}`` object (``int4-grouped``, ``int8-row``,
``fp8-e4m3-b128``, ...). The stamp is what tells two quantised formats apart when a tensor's
byte counts fit both. The runtime collects the maps of all shards into one table and refuses to
load the container (naming the shard file) when a value is not a JSON object of strings, when two
claims for one tensor name disagree, or when more than :data:`MAX_STAMPS` distinct names are
stamped across the container. A shard may stamp a tensor it does not hold; agreeing repeats
count once. :func:`container_stamps` makes the same checks, so a source the runtime would refuse
is refused here too, with the file named.

**Where a stamp goes in a rewrite** (:func:`place_stamps`): to the shard that now holds its
tensor. A tensor stored as split segments (``<name>.top``/``.bottom``, ``docs/SPLIT_SEGMENTS.md``)
keeps its stamp under its own name, in the shard holding its first segment: the stamp names the
format of the whole tensor, which is what a runtime reassembling the segments decodes (the
segments are byte ranges of that tensor, not tensors of their own). A stamp naming a tensor the
container does not hold goes to the first shard. So DST stamps exactly SRC's names with SRC's
values (never more names, so never past the runtime's limit), each in the shard that holds it.

**Other keys** (:func:`carried_metadata`): a key with the same value in every source shard (such
as ``format: pt``) describes the container, not one shard, and still holds after tensors move:
it is kept in every new shard. A key whose value differs between shards, or that some shard
lacks, described that shard's contents, which no longer exist as such: it is dropped. The
``relayout.*`` keys of a source that is itself a rewrite are replaced by the new plan's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .errors import InputError
from .records import is_text

STAMP_KEY = "colibri.fmt"
MAX_STAMPS = 4096
"""Distinct stamped tensor names the runtime accepts across a container's shards."""

OWN_PREFIX = "relayout."
"""Metadata keys the planner writes; a source's are replaced, never carried."""


class _Conflict(ValueError):
    pass


def _pairs(pairs):
    """An object whose repeated keys agree (the runtime keeps one); a disagreeing repeat is an error."""
    out = {}
    for key, value in pairs:
        if key in out and out[key] != value:
            raise _Conflict(f"stamps tensor {key!r} twice, as {out[key]!r} and {value!r}")
        out[key] = value
    return out


def shard_stamps(path: Path | str, metadata: Mapping[str, str]) -> dict[str, str]:
    """The stamp map of one shard (empty when it has none); raises :class:`InputError` naming
    ``path`` when the value is not the JSON text of a flat object of strings."""
    text = metadata.get(STAMP_KEY)
    if text is None:
        return {}
    what = f'__metadata__["{STAMP_KEY}"]'
    refused = "; the runtime refuses to load it"
    if not isinstance(text, str):
        raise InputError(path, f"{what} is not a string{refused}")
    try:
        obj = json.loads(text, object_pairs_hook=_pairs)
    except _Conflict as exc:
        raise InputError(path, f"{what} {exc}{refused}") from None
    except RecursionError:
        raise InputError(path, f"{what} is not a JSON object (nested too deeply){refused}") from None
    except ValueError as exc:
        raise InputError(path, f"{what} is not JSON text ({str(exc).splitlines()[0][:100]}){refused}") from None
    if not isinstance(obj, dict):
        raise InputError(path, f"{what} is not a JSON object{refused}")
    for name, fmt in obj.items():
        if not isinstance(fmt, str):
            raise InputError(path, f"{what} entry {name!r} is not a string{refused}")
        if not (is_text(name) and is_text(fmt)):
            raise InputError(path, f"{what} entry {name!r} is not valid UTF-8 (lone surrogate escape){refused}")
    return obj


def container_stamps(paths: Sequence[Path | str], metadatas: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """Every shard's stamps in one map ``{tensor name: format name}``, checked as the runtime checks
    them (see the module doc); raises :class:`InputError` naming the offending shard."""
    stamps: dict[str, str] = {}
    first: dict[str, Path | str] = {}
    for path, meta in zip(paths, metadatas):
        for name, fmt in shard_stamps(path, meta).items():
            if name in stamps:
                if stamps[name] != fmt:
                    raise InputError(path, f'__metadata__["{STAMP_KEY}"] stamps tensor {name!r} as {fmt!r}, but '
                                           f"{Path(first[name]).name} stamps it {stamps[name]!r}; the runtime refuses "
                                           "conflicting format claims")
                continue
            if len(stamps) >= MAX_STAMPS:
                raise InputError(path, f"the shards stamp more than {MAX_STAMPS} tensor names in "
                                       f'__metadata__["{STAMP_KEY}"]; the runtime refuses to load such a container')
            stamps[name] = fmt
            first[name] = path
    return stamps


def carried_metadata(metadatas: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The source keys every new shard keeps: same value in every source shard, neither the
    stamp key nor a ``relayout.*`` key (see the module doc)."""
    if not metadatas:
        return {}
    kept = {k: v for k, v in metadatas[0].items() if k != STAMP_KEY and not k.startswith(OWN_PREFIX)}
    for meta in metadatas[1:]:
        kept = {k: v for k, v in kept.items() if meta.get(k) == v}
    return dict(sorted(kept.items()))


def place_stamps(stamps: Mapping[str, str], stored: Sequence[Iterable[str]],
                 original_of: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """Each new shard's stamp map: a stamp goes to the shard storing its tensor.

    Parameters
    ----------
    stamps
        The source's stamps, ``{tensor name: format name}``.
    stored
        Per new shard, in file order, the names of the tensors (or split segments) it stores.
    original_of
        ``{segment name: name of the tensor it is a segment of}`` for split tensors.

    Returns
    -------
    list of dict
        Per new shard, its ``{tensor name: format name}`` map (sorted by name). A split tensor's
        stamp is in the first shard, in file order, that stores one of its segments; a stamp
        naming no stored tensor is in the first shard.
    """
    original_of = original_of or {}
    owner: dict[str, int] = {}
    for i, names in enumerate(stored):
        for name in names:
            owner.setdefault(original_of.get(name, name), i)
    out: list[dict[str, str]] = [{} for _ in stored]
    if not out:
        return out
    for name, fmt in stamps.items():
        out[owner.get(name, 0)][name] = fmt
    return [dict(sorted(m.items())) for m in out]


def stamp_text(stamps: Mapping[str, str]) -> str:
    """The ``colibri.fmt`` value for a stamp map: compact JSON text, names sorted."""
    return json.dumps(dict(sorted(stamps.items())), ensure_ascii=False, separators=(",", ":"))


def with_stamps(metadata: Mapping[str, str], stamps: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` with the ``colibri.fmt`` entry for ``stamps`` (none when ``stamps`` is empty)."""
    out = {k: v for k, v in metadata.items() if k != STAMP_KEY}
    if stamps:
        out[STAMP_KEY] = stamp_text(stamps)
    return out


def stamp_problems(src: Mapping[str, str], dst_by_file: Sequence[tuple[str, Mapping[str, str]]],
                   holder: Mapping[str, str]) -> list[str]:
    """Problems of DST's stamps against SRC's, one line per tensor.

    ``dst_by_file`` is ``[(shard name, its stamp map)]``; ``holder`` maps a tensor name (the
    original's name for a split tensor) to the DST shard that stores it (its first segment's).
    """
    dst: dict[str, tuple[str, str]] = {}
    for file, stamps in dst_by_file:
        for name, fmt in stamps.items():
            dst.setdefault(name, (fmt, file))
    out = []
    for name in sorted(src):
        if name not in dst:
            out.append(f"tensor {name}: format stamp {src[name]!r} of SRC is missing from DST")
        elif dst[name][0] != src[name]:
            out.append(f"tensor {name}: DST stamps format {dst[name][0]!r}, SRC {src[name]!r}")
        elif name in holder and holder[name] != dst[name][1]:
            out.append(f"tensor {name}: its format stamp is in {dst[name][1]}, the tensor in {holder[name]}")
    out += [f"tensor {name}: DST stamps format {dst[name][0]!r}, SRC has no stamp for it" for name in sorted(dst.keys() - src.keys())]
    return out


__all__ = ["MAX_STAMPS", "OWN_PREFIX", "STAMP_KEY", "carried_metadata", "container_stamps", "place_stamps",
           "shard_stamps", "stamp_problems", "stamp_text", "with_stamps"]
