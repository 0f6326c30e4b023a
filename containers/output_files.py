"""The files of a new container as the rewriter receives them, and their validation.

A plan is a file users share, so everything in it is untrusted. :func:`check_output_files`
checks the whole list against the opened source *before any byte is written* and returns every
problem at once:

* each output name is a plain file name: a ``str`` of printable characters (no path separator,
  no ``..``, no NUL or control character, no lone surrogate), not hidden (a leading ``.`` is
  reserved for temp files), at most :data:`MAX_NAME_BYTES` bytes of UTF-8, ending in
  ``.safetensors``, not a name relayout or the source's other files use, unique even when
  compared case-insensitively (macOS volumes are case-insensitive);
* at most :data:`~containers.container.MAX_FILES` files;
* every tensor of the source is placed exactly once (split tensors: each of their segments once),
  and nothing else is placed;
* metadata maps ``str`` to ``str``; alignment is an integer in ``[1, 2^30]``;
* each file's ``__metadata__`` carries colibrì's format stamps of exactly the source tensors it
  holds (:func:`~containers.shard_metadata.place_stamps`) and keeps every key the source's shards
  all share (:func:`~containers.shard_metadata.carried_metadata`): a plan made without them
  would drop them, so it is refused;
* the header each file will get puts every tensor at the offset the plan says and makes the file
  exactly the size the plan says (computed with the same :func:`plan_shard` the writer uses).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

from .container import MANIFEST_NAME, MAX_FILES, Container
from .errors import InputError
from .records import is_int, is_text
from .safetensors_io import DTYPE_SIZES, TensorSpec, plan_shard
from .segments import PARTS, SegmentSpec
from .shard_metadata import STAMP_KEY, carried_metadata, place_stamps, shard_stamps
from .sources import FileRange

SUFFIX = ".safetensors"
MAX_NAME_BYTES = 200
"""Room is left below the usual 255-byte limit for the ``.NAME.tmp-`` + 16 hex digit temp names."""
MAX_ALIGNMENT = 1 << 30
RESERVED = {MANIFEST_NAME.casefold(), "relayout.journal.json"}
MAX_LISTED = 12


@dataclass(frozen=True)
class Derived:
    """A tensor of the new container made from part of a source tensor (a split segment)."""

    original: str
    part: str
    spec: SegmentSpec


@dataclass(frozen=True)
class OutputFile:
    """One file of the new container: tensors (by name) at absolute offsets (bytes), in physical order.

    Names in ``derived`` are split segments of a source tensor; all others are source tensors.
    ``size`` and ``alignment`` are in bytes.
    """

    name: str
    metadata: dict
    tensors: list[tuple[str, int]]
    size: int
    alignment: int
    derived: dict = field(default_factory=dict)


def string_problem(s) -> str | None:
    """Why ``s`` cannot be a name or metadata string in a header (None when it can)."""
    if not isinstance(s, str):
        return f"{s!r} is not a string"
    if not is_text(s):
        return f"{s!r} is not valid UTF-8 (lone surrogate)"
    if any(unicodedata.category(ch) == "Cc" for ch in s):
        return f"{s!r} contains a control character"
    return None


def output_name_problem(name, other_names: set[str] = frozenset()) -> str | None:
    """Why ``name`` cannot be the name of an output file (None when it can).

    ``other_names`` are the names of the container's other files (compared case-insensitively).
    """
    bad = string_problem(name)
    if bad:
        return f"file name {bad}"
    if "/" in name or "\\" in name or name in (".", "..") or ".." in name.split("/"):
        return f"file name {name!r} is a path, not a plain file name"
    if name.startswith("."):
        return f"file name {name!r} is hidden (names starting with '.' are reserved for temp files)"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"file name {name[:40]!r}... is longer than {MAX_NAME_BYTES} bytes"
    if not name.endswith(SUFFIX) or name == SUFFIX:
        return f"file name {name!r} does not end in {SUFFIX}"
    if name.casefold() in RESERVED or name.casefold() in {n.casefold() for n in other_names}:
        return f"file name {name!r} is reserved"
    return None


def tensor_specs(src: Container, of: OutputFile) -> list[TensorSpec]:
    """Tensor specs whose layout reproduces ``of`` (the caller compares offsets and size)."""
    if not of.tensors:
        raise InputError(of.name, "output file has no tensors")
    data_start = min(off for _, off in of.tensors)
    specs = []
    for name, off in sorted(of.tensors, key=lambda t: t[1]):
        d = of.derived.get(name)
        ref = src.tensors.get(d.original if d else name)
        if ref is None:
            raise InputError(src.root, f"the plan places tensor {d.original if d else name!r}, which the container does not have")
        e = ref.entry
        aligned = None if (off - data_start) % of.alignment == 0 else 1
        if d is None:
            specs.append(TensorSpec(name, e.dtype, e.shape, FileRange(src.files[ref.file], e.begin, e.nbytes), aligned))
            continue
        if d.spec.rows * d.spec.row_bytes != e.nbytes:
            raise InputError(src.root, f"tensor {d.original!r} has {e.nbytes} bytes, the plan's split expects {d.spec.rows * d.spec.row_bytes}")
        n = d.spec.nbytes(d.part)
        specs.append(TensorSpec(name, e.dtype, (n // DTYPE_SIZES[e.dtype],), d.spec.source(d.part, src.files[ref.file], e.begin), aligned))
    return specs


def _segment_problem(d: Derived) -> str | None:
    s = d.spec
    if d.part not in PARTS:
        return f"segment part {d.part!r} is not one of {PARTS}"
    if s.kind not in ("rows", "columns", "shared") or not is_int(s.rows) or not is_int(s.row_bytes) or s.rows < 1 or s.row_bytes < 1:
        return f"split of {d.original!r} is malformed"
    limit = {"rows": s.rows, "columns": s.row_bytes}.get(s.kind)
    if limit is not None and not (is_int(s.split) and 0 < s.split < limit):
        return f"split of {d.original!r} at {s.split!r} is outside (0, {limit})"
    return None


def _file_problems(src: Container, of: OutputFile, placed: dict[str, str], others: set[str]) -> list[str]:
    where = of.name if isinstance(of.name, str) else repr(of.name)
    problems = []
    bad_name = output_name_problem(of.name, others)
    if bad_name:
        problems.append(bad_name)
    if not isinstance(of.metadata, dict):
        problems.append(f"{where}: metadata is not an object of strings")
    else:
        for k, v in of.metadata.items():
            bad = string_problem(k) or string_problem(v)
            if bad:
                problems.append(f"{where}: metadata {bad}")
    if not is_int(of.alignment) or not 1 <= of.alignment <= MAX_ALIGNMENT:
        problems.append(f"{where}: alignment {of.alignment!r} is not an integer in [1, {MAX_ALIGNMENT}]")
    if not is_int(of.size) or of.size < 0:
        problems.append(f"{where}: size {of.size!r} is not a byte count")
    if not isinstance(of.tensors, list) or not of.tensors:
        problems.append(f"{where}: places no tensors")
        return problems
    for item in of.tensors:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and is_int(item[1]) and item[1] >= 0):
            problems.append(f"{where}: tensor entry {item!r} is not [name, offset]")
            return problems
        name = item[0]
        d = of.derived.get(name)
        if d is not None:
            bad = _segment_problem(d)
            if bad:
                problems.append(f"{where}: {bad}")
                return problems
            if d.original not in src.tensors:
                problems.append(f"{where}: segment {name!r} is of {d.original!r}, which the container does not have")
        elif name not in src.tensors:
            problems.append(f"{where}: places tensor {name!r}, which the container does not have")
        if name in placed:
            problems.append(f"tensor {name!r} is placed twice ({placed[name]} and {where})")
        placed[name] = where
    if problems:
        return problems
    try:
        layout = plan_shard(tensor_specs(src, of), of.alignment, of.metadata)
    except InputError as exc:
        return [f"{where}: {exc.problem}"]
    planned = dict(of.tensors)
    for spec, begin in layout.placements:
        if planned[spec.name] != begin:
            return [f"{where}: tensor {spec.name!r} would land at byte {begin}, the plan says {planned[spec.name]} "
                    "(plan made by another tool version?)"]
    if layout.file_size != of.size:
        problems.append(f"{where}: file would be {layout.file_size} bytes, the plan says {of.size}")
    return problems


def check_output_files(src: Container, files: list[OutputFile]) -> list[str]:
    """Every problem with writing ``files`` from ``src`` (empty when the rewrite may start)."""
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"the plan writes {len(files)} files; the runtime loads at most {MAX_FILES}")
    others = {p.name for p in src.other_files}
    seen: dict[str, str] = {}
    placed: dict[str, str] = {}
    for of in files:
        if isinstance(of.name, str):
            key = of.name.casefold()
            if key in seen:
                problems.append(f"file name {of.name!r} is used twice (as {seen[key]!r}; names must differ ignoring case)")
            seen.setdefault(key, of.name)
        problems += _file_problems(src, of, placed, others)
    derived_of: dict[str, set[str]] = {}
    for of in files:
        for name, d in of.derived.items():
            derived_of.setdefault(d.original, set()).add(d.part)
    if all(_well_formed(of) for of in files):
        problems += metadata_problems(src, files)
    for name in src.tensors:
        if name in placed:
            if name in derived_of:
                problems.append(f"tensor {name!r} is placed both whole and as split segments")
            continue
        parts = derived_of.get(name)
        if parts is None:
            problems.append(f"tensor {name!r} of the container is not placed")
        elif parts != set(PARTS):
            problems.append(f"tensor {name!r} is split but not every segment is placed")
    return problems


def _well_formed(of: OutputFile) -> bool:
    """A name, a metadata object and a list of ``[name, offset]``: enough to check its metadata."""
    return (isinstance(of.name, str) and isinstance(of.metadata, dict) and isinstance(of.tensors, list)
            and all(isinstance(t, (list, tuple)) and len(t) == 2 and isinstance(t[0], str) for t in of.tensors))


def metadata_problems(src: Container, files: list[OutputFile]) -> list[str]:
    """Where the files' ``__metadata__`` would lose the source's format stamps or shared keys."""
    problems = []
    expected = place_stamps(src.stamps, [[n for n, _ in of.tensors] for of in files],
                            {n: d.original for of in files for n, d in of.derived.items()})
    kept = carried_metadata([h.metadata for h in src.headers])
    for of, want in zip(files, expected):
        try:
            have = shard_stamps(of.name, of.metadata)
        except InputError as exc:
            problems.append(f"{of.name}: {exc.problem}")
            continue
        if have != want:
            lost = sorted(n for n in want if have.get(n) != want[n])
            extra = sorted(n for n in have if n not in want)
            shown = (f"lacks the stamp of {lost[0]!r}" + (f" and {len(lost) - 1} more" if len(lost) > 1 else "")) if lost \
                else f"stamps {extra[0]!r}, which it does not hold"
            problems.append(f"{of.name}: __metadata__[{STAMP_KEY!r}] {shown} (plan made by another tool version? plan again)")
        for k, v in kept.items():
            if of.metadata.get(k) != v:
                problems.append(f"{of.name}: __metadata__ does not keep the source's {k!r}: {v!r} (plan made by another "
                                "tool version? plan again)")
                break
    return problems


def require_valid_output_files(src: Container, files: list[OutputFile], where: str | None) -> None:
    """Raise one :class:`InputError` listing every problem of :func:`check_output_files`."""
    problems = check_output_files(src, files)
    if problems:
        shown = "; ".join(problems[:MAX_LISTED]) + (f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else "")
        raise InputError(where, f"the plan cannot be written ({len(problems)} problem(s), nothing was written): {shown}")


__all__ = ["Derived", "OutputFile", "check_output_files", "metadata_problems", "output_name_problem", "require_valid_output_files",
           "string_problem", "tensor_specs"]
