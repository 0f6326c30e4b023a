"""The streaming, resumable, crash-safe container rewrite.

Input: an opened source container (read-only throughout), the new files as a list of
:class:`OutputFile` (tensor names at absolute offsets; built from a plan by the caller), and the
destination path. Output: a new container at ``DST`` whose every tensor is byte-identical to the
source's, plus its checksum manifest.

* Work goes into ``DST.partial/``. Each output file is written to a temp name, fsynced and
  renamed; then the journal (``relayout.journal.json``: per file, size and digests) is updated
  crash-safely. A restarted rewrite trusts the journal's files after checking their sizes and
  re-hashing the last one, and writes the rest.
* Bytes move with ``copy_file_range`` where the kernel offers it (no copy through Python), else
  with ``pread``/``pwrite``; meanwhile a second thread hashes each source tensor in place (mapped
  window by window) and checks it against the source manifest. File digests are assembled from
  the segment digests (header, padding, tensors), as :mod:`containers.hashing` defines them, so
  nothing is read twice. Memory stays bounded by one mapped window plus one copy buffer.
* Before any byte is written: the free space is checked (all remaining bytes plus a margin).
  A full disk or failed write raises one clear error; the partial directory stays resumable and
  nothing at ``DST`` looks complete. Only after every file is done, the directory is fsynced and
  atomically renamed to ``DST``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from tqdm import tqdm

from .atomic import describe_os_error, fsync_dir, fsync_fd, write_json_atomic
from .container import MANIFEST_NAME, Container
from .errors import InputError
from .hashing import Range, file_digest, gap_digest, hash_file, hash_range, segments
from .manifest import MANIFEST_FORMAT, MANIFEST_VERSION, content_fingerprint, layout_fingerprint
from .safetensors_io import DTYPE_SIZES, TensorSpec, plan_shard
from .segments import SegmentSpec
from .sources import FileRange

JOURNAL_NAME = "relayout.journal.json"
COPY_CHUNK = 64 * 1024 * 1024
SPACE_MARGIN = 64 * 1024 * 1024
READ_AHEAD_TENSORS = 4


@dataclass(frozen=True)
class Derived:
    """A tensor of the new container made from part of a source tensor (a split segment)."""

    original: str
    part: str
    spec: SegmentSpec


@dataclass(frozen=True)
class OutputFile:
    """One file of the new container: tensors (by name) at absolute offsets, in physical order.

    Names in ``derived`` are split segments of a source tensor; all others are source tensors.
    """

    name: str
    metadata: dict
    tensors: list[tuple[str, int]]
    size: int
    alignment: int
    derived: dict = field(default_factory=dict)


def _specs_for(src: Container, of: OutputFile) -> list[TensorSpec]:
    """Tensor specs whose layout reproduces ``of`` exactly (checked by the caller)."""
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


class _Journal:
    def __init__(self, path: Path, identity: dict):
        self.path = path
        self.identity = identity
        self.files: dict[str, dict] = {}

    @classmethod
    def open(cls, partial: Path, identity: dict) -> "_Journal":
        j = cls(partial / JOURNAL_NAME, identity)
        if j.path.exists():
            try:
                obj = json.loads(j.path.read_text())
            except (OSError, ValueError):
                raise InputError(j.path, "journal is unreadable; remove the partial directory to start over") from None
            if obj.get("identity") != identity:
                raise InputError(partial, "this partial rewrite is for another plan or source; remove it to start over")
            j.files = obj.get("files", {})
        return j

    def save(self) -> None:
        write_json_atomic(self.path, {"identity": self.identity, "files": self.files}, indent=None)


def rewrite_container(
    src: Container,
    files: list[OutputFile],
    dst: str | os.PathLike,
    source_manifest: dict,
    provenance: dict,
    progress: bool = True,
) -> dict:
    """Write the new container at ``dst``; returns its manifest. See the module doc."""
    dst = Path(dst)
    if dst.exists():
        what = "a finished container" if (dst / MANIFEST_NAME).exists() else "something"
        raise InputError(dst, f"already exists ({what}); choose a new destination")
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise InputError(None, "the plan names an output file twice")
    partial = dst.with_name(dst.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    for stray in partial.glob(".*.tmp-*"):
        stray.unlink()
    identity = {"source_fingerprint": source_manifest["fingerprint"], "files": names,
                "plan_digest": provenance.get("plan_digest")}
    journal = _Journal.open(partial, identity)
    _recheck_done(partial, journal, files)

    others = [p for p in src.other_files]
    todo = [f for f in files if f.name not in journal.files]
    todo_others = [p for p in others if p.name not in journal.files]
    need = sum(f.size for f in todo) + sum(p.stat().st_size for p in todo_others)
    free = shutil.disk_usage(partial).free
    if free < need + SPACE_MARGIN:
        raise InputError(partial, f"needs {(need + SPACE_MARGIN) / 1e9:.2f} GB free, {free / 1e9:.2f} GB available")

    src_tensors = source_manifest["tensors"]

    def finish(w: _Written) -> None:
        journal.files[w.of.name] = _finish_file(w, partial, src, src_tensors)
        journal.save()

    with tqdm(total=need, unit="B", unit_scale=True, desc="rewrite", disable=None if progress else True) as bar, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-hash") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-fsync") as finisher:
        # file i is fsynced, checked, renamed and journaled while file i+1 is being copied
        pending = None
        for of in todo:
            written = _copy_file(src, of, partial, pool, bar.update)
            if pending is not None:
                pending.result()
            pending = finisher.submit(finish, written)
        if pending is not None:
            pending.result()
        for p in todo_others:
            journal.files[p.name] = _copy_other(p, partial, bar.update)
            journal.save()

    manifest = _manifest(files, others, journal, source_manifest, src_tensors, provenance)
    write_json_atomic(partial / MANIFEST_NAME, manifest, indent=None)
    (partial / JOURNAL_NAME).unlink()
    fsync_dir(partial)
    os.replace(partial, dst)
    fsync_dir(dst.parent)
    return manifest


def _recheck_done(partial: Path, journal: _Journal, files: list[OutputFile]) -> None:
    """Drop journal entries whose file is gone or has the wrong size; re-hash the last one."""
    by_name = {f.name: f for f in files}
    last = None
    for name in list(journal.files):
        p = partial / name
        if not p.exists() or p.stat().st_size != journal.files[name]["size"]:
            del journal.files[name]
            continue
        last = name
    if last is not None:
        entry = journal.files[last]
        of = by_name.get(last)
        ranges = [Range(n, off, off + entry["tensor_sizes"][n]) for n, off in of.tensors] if of else []
        digest, _ = hash_file(partial / last, ranges)
        if digest != entry["xxh3_128"]:
            del journal.files[last]
    journal.save()


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, n: int, buf: bytearray, where: Path) -> None:
    use_kernel = hasattr(os, "copy_file_range")
    while n > 0:
        step = min(n, COPY_CHUNK)
        done = 0
        if use_kernel:
            try:
                done = os.copy_file_range(src_fd, dst_fd, step, src_off, dst_off)
            except OSError as exc:
                if exc.errno not in (18, 22, 38, 95):     # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: fall back
                    raise
                use_kernel = False
                continue
        else:
            view = memoryview(buf)[: min(step, len(buf))]
            got = os.preadv(src_fd, [view], src_off)
            if got <= 0:
                raise InputError(where, f"source ends before byte {src_off + n} (truncated?)")
            done = os.pwritev(dst_fd, [view[:got]], dst_off)
        if done <= 0:
            raise InputError(where, f"source ends before byte {src_off + n} (truncated?)")
        src_off += done
        dst_off += done
        n -= done


@dataclass
class _Written:
    """A file whose bytes are written (not yet durable): what the finisher needs."""

    of: OutputFile
    fd: int
    tmp: Path
    target: Path
    layout: object
    hashes: dict


def _copy_file(src: Container, of: OutputFile, partial: Path, pool, on_bytes) -> _Written:
    """Write one output file's bytes to its temp name; tensors are hashed as their copy ends."""
    specs = _specs_for(src, of)
    layout = plan_shard(specs, of.alignment, of.metadata)
    planned = dict(of.tensors)
    for spec, begin in layout.placements:
        if planned[spec.name] != begin:
            raise InputError(of.name, f"tensor {spec.name!r} lands at {begin}, the plan says {planned[spec.name]} (plan made by another tool version?)")
    if layout.file_size != of.size:
        raise InputError(of.name, f"file would be {layout.file_size} bytes, the plan says {of.size}")
    target = partial / of.name
    tmp = partial / f".{of.name}.tmp-{os.getpid()}"
    buf = bytearray(8 * 1024 * 1024)
    hashes = {}
    fd = None
    fds: dict[Path, int] = {}
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, layout.header, 0)
        os.ftruncate(fd, layout.file_size)           # padding reads back as zeros
        # copy in source order (sequential reads; the scattered writes land in the page cache and
        # reach the disk in order at fsync), asking the kernel to read ahead a few tensors
        order = sorted(layout.placements, key=lambda p: (str(p[0].source.path), p[0].source.offset))
        for i, (spec, begin) in enumerate(order):
            rng = spec.source
            for ahead, _ in order[i + 1 : i + 1 + READ_AHEAD_TENSORS]:
                _advise_willneed(fds, ahead.source)
            if isinstance(rng, FileRange):
                sfd = _source_fd(fds, rng.path)
                _copy_range(sfd, fd, rng.offset, begin, rng.nbytes, buf, rng.path)
                # the source bytes are in the page cache now: hash them there while the next copy runs
                hashes[spec.name] = pool.submit(hash_range, rng.path, rng.offset, rng.offset + rng.nbytes)
            else:
                hashes[spec.name] = _write_stream(fd, begin, rng)
            on_bytes(rng.nbytes)
        for sfd in fds.values():
            os.close(sfd)
        return _Written(of, fd, tmp, target, layout, hashes)
    except BaseException as exc:
        for sfd in fds.values():
            os.close(sfd)
        if fd is not None:
            os.close(fd)
        _discard(tmp)
        if isinstance(exc, OSError):
            raise InputError(target, describe_os_error(exc) + " (the partial rewrite is kept; run the same command again to resume)") from None
        raise


def _finish_file(w: _Written, partial: Path, src: Container, src_tensors: dict) -> dict:
    """Make a written file durable and check it: fsync, verify hashes, rename, fsync the directory."""
    try:
        try:
            fsync_fd(w.fd)
        finally:
            os.close(w.fd)
        digests = {name: f.result() for name, f in w.hashes.items()}
        for name, d in digests.items():
            want = src_tensors.get(name, {}).get("xxh3_128")
            if want is not None and want != d:
                raise InputError(src.root, f"tensor {name!r} does not match the source manifest (the source changed or a read failed)")
        os.replace(w.tmp, w.target)
        fsync_dir(partial)
    except BaseException as exc:
        _discard(w.tmp)
        if isinstance(exc, OSError):
            raise InputError(w.target, describe_os_error(exc) + " (the partial rewrite is kept; run the same command again to resume)") from None
        raise
    layout = w.layout
    ranges = [Range(s.name, b, b + s.nbytes) for s, b in layout.placements]
    seg_digests = []
    for seg in segments(ranges, layout.file_size):
        if seg.name in digests:
            seg_digests.append(bytes.fromhex(digests[seg.name]))
        elif seg.begin < layout.data_start:
            seg_digests.append(gap_digest(layout.header[seg.begin:seg.end]))
        else:
            seg_digests.append(gap_digest(bytes(seg.end - seg.begin)))
    return {"size": layout.file_size, "xxh3_128": file_digest(layout.file_size, seg_digests),
            "tensor_sizes": {s.name: s.nbytes for s, _ in layout.placements}, "tensor_digests": digests}


def _write_stream(fd: int, begin: int, source) -> Future:
    """Write a gathered source (a column segment) at ``begin``, hashing it on the way."""
    h = xxhash.xxh3_128()
    pos = begin
    for chunk in source.chunks():
        view = memoryview(chunk)
        while view:
            n = os.pwrite(fd, view, pos)
            h.update(view[:n])
            view = view[n:]
            pos += n
    if pos - begin != source.nbytes:
        raise InputError(None, f"{source.describe()} gave {pos - begin} bytes, expected {source.nbytes}")
    done: Future = Future()
    done.set_result(h.hexdigest())
    return done


def _source_fd(fds: dict, path: Path) -> int:
    if path not in fds:
        fds[path] = os.open(path, os.O_RDONLY)
    return fds[path]


def _advise_willneed(fds: dict, rng) -> None:
    span = rng.nbytes if isinstance(rng, FileRange) else rng.rows * rng.row_bytes
    try:
        os.posix_fadvise(_source_fd(fds, rng.path), rng.offset, span, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):
        pass


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _copy_other(path: Path, partial: Path, on_bytes) -> dict:
    target = partial / path.name
    tmp = partial / f".{path.name}.tmp-{os.getpid()}"
    size = path.stat().st_size
    buf = bytearray(8 * 1024 * 1024)
    try:
        sfd = os.open(path, os.O_RDONLY)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _copy_range(sfd, fd, 0, 0, size, buf, path)
            fsync_fd(fd)
        finally:
            os.close(fd)
            os.close(sfd)
        os.replace(tmp, target)
        fsync_dir(partial)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise InputError(target, describe_os_error(exc) + " (the partial rewrite is kept; run the same command again to resume)") from None
    on_bytes(size)
    digest, _ = hash_file(target)
    return {"size": size, "xxh3_128": digest, "tensor_sizes": {}, "tensor_digests": {}}


def _manifest(files: list[OutputFile], others: list[Path], journal: _Journal, source_manifest: dict,
              src_tensors: dict, provenance: dict) -> dict:
    entries, tensors, seg_map = [], {}, {}
    for of in files:
        j = journal.files[of.name]
        entries.append({"name": of.name, "kind": "safetensors", "size": j["size"], "xxh3_128": j["xxh3_128"]})
        for name, off in of.tensors:
            d = of.derived.get(name)
            t = src_tensors[d.original if d else name]
            if d is None:
                dtype, shape, nbytes = t["dtype"], t["shape"], t["nbytes"]
            else:
                nbytes = d.spec.nbytes(d.part)
                dtype, shape = t["dtype"], [nbytes // DTYPE_SIZES[t["dtype"]]]
                seg_map.setdefault(d.original, {**d.spec.to_json()})[d.part] = name
            tensors[name] = {"file": of.name, "dtype": dtype, "shape": shape, "offset": off,
                             "nbytes": nbytes, "xxh3_128": j["tensor_digests"][name]}
    for p in others:
        j = journal.files[p.name]
        entries.append({"name": p.name, "kind": "other", "size": j["size"], "xxh3_128": j["xxh3_128"]})
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "hash": "xxh3-128",
        "fingerprint": layout_fingerprint(entries),
        "content_fingerprint": content_fingerprint(tensors),
        "geometry": source_manifest["geometry"],
        "files": entries,
        "tensors": dict(sorted(tensors.items())),
        "rewrite": {**provenance, "source_fingerprint": source_manifest["fingerprint"],
                    "source_content_fingerprint": source_manifest["content_fingerprint"]},
        **({"segments": dict(sorted(seg_map.items()))} if seg_map else {}),
    }
