"""The streaming, resumable, crash-safe container rewrite.

Input: an opened source container (read-only throughout), the new files as a list of
:class:`~containers.output_files.OutputFile` (tensor names at absolute offsets; built from a plan
by the caller), and the destination path. Output: a new container at ``DST`` whose every tensor
is byte-identical to the source's, plus its checksum manifest.

* Before anything is created, the whole file list is validated against the source
  (:func:`~containers.output_files.check_output_files`: names, placement of every tensor, sizes,
  offsets, metadata); all problems are reported at once.
* Work goes into ``DST.partial/``, a directory that is ours alone
  (:class:`~containers.destination.Destination`: no symlink followed, locked against a second
  rewrite, never the source or nested in it). Each output file is written to a temp name,
  fsynced and renamed; then the journal (``relayout.journal.json``: per file, its size and file digest)
  is updated crash-safely. A restarted rewrite re-hashes every journaled file and counts it done
  only when its digest matches the journal, then writes the rest; it says what it resumes.
* Bytes move with ``copy_file_range`` where the kernel offers it (no copy through Python), else
  with ``pread``/``pwrite``; meanwhile a second thread hashes each source tensor from the page cache
  (read window by window) and checks it against the source manifest. File digests are assembled from
  the segment digests (header, padding, tensors), as :mod:`containers.hashing` defines them, so
  nothing is read twice. Memory stays bounded by one read window plus one copy buffer.
* Before any byte is written: the free space is checked (all remaining bytes plus a margin).
  A full disk or failed write raises one clear error; the partial directory stays resumable and
  nothing at ``DST`` looks complete. Only after every file is done, the directory is fsynced and
  renamed to ``DST`` (never replacing anything there).
* The files around the tensors: ``model.safetensors.index.json``, when SRC has one, is
  regenerated for the new shards (:mod:`containers.model_index`); every other non-tensor file is
  copied unchanged. The files colibrì's runtime keeps in the model directory are carried (copied
  and journaled like the others) or dropped as :mod:`containers.runtime_files` decides; the
  manifest records each decision (``runtime_files``). Each new shard's ``__metadata__``
  (colibrì's format stamps included) is the plan's, which the file-list check requires to carry
  the source's (:func:`~containers.output_files.metadata_problems`).

* Finishing is recoverable at every instant: the manifest is written into ``DST.partial``, then
  the journal removed, then the directory renamed. A run that finds ``DST.partial`` holding this
  rewrite's manifest and no journal (stopped between the last two steps) takes the manifest's
  file digests as its journal, re-hashes every file, writes again any that does not match, and
  finishes.
* A layout split over drives (``split``: shard names per directory of ``COLI_MODEL_DIRS``) is
  written with each shard straight into its directory's ``.partial``, everything else into
  ``DST.partial``; one journal (in ``DST.partial``) covers every directory, the free space is
  checked per volume, and the directories are renamed only after every file in all of them is
  done, the primary last (:mod:`containers.split_destination`).
* Temp files have unpredictable names and are created exclusively
  (:func:`~containers.atomic.create_temp`); every source file is read with ``pread`` or
  ``copy_file_range``, so a source truncated under a running rewrite is an error naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .progress import progress_bar

from .atomic import TEMP_NAME, describe_os_error, fsync_fd, write_at
from .copying import ReadAhead, Sources, WRITEBACK_BYTES, bytes_to_allocate, copy_range, start_writeback, write_stream
from .container import MANIFEST_NAME, Container
from .destination import Destination
from .split_destination import Destinations, split_directories
from .errors import InputError
from .hashing import Range, file_digest, gap_digest, hash_file, hash_range, segments
from .manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    content_fingerprint,
    layout_fingerprint,
)
from .model_index import INDEX_NAME, index_bytes, read_index, regenerated_index
from .output_files import OutputFile, require_valid_output_files, tensor_specs
from .runtime_files import CARRIED, RuntimeFile, runtime_files, runtime_record
from .safetensors_io import DTYPE_SIZES, plan_shard
from .sources import FileRange

JOURNAL_NAME = "relayout.journal.json"
SPACE_MARGIN = 64 * 1024 * 1024
RESUME_HINT = " (the partial rewrite is kept; run the same command again to resume)"


def _write_json(dest: Destination, name: str, obj) -> None:
    """Write ``obj`` to ``name`` inside the destination crash-safely (temp, fsync, rename)."""
    data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    try:
        write_at(dest.fd, name, data, dest.partial / name)
    except OSError as exc:
        raise InputError(dest.partial / name, describe_os_error(exc) + RESUME_HINT) from None


class _Journal:
    """Which output files are durable in ``DST.partial``, with their sizes and file digests.

    The journal holds one small entry per file (size, xxh3-128), so saving it after each file
    costs the same at 142 files as at 10; each file's tensor digests are kept in memory
    (``tensor_digests``) for the new manifest, and a resumed run gets them back by re-hashing
    the journaled files, which it does anyway.
    """

    def __init__(self, dest: Destination, identity: dict):
        self.dest = dest
        self.identity = identity
        self.files: dict[str, dict] = {}
        self.tensor_digests: dict[str, dict[str, str]] = {}
        self.finished = False       # taken from the manifest of a rewrite stopped before its final rename

    @classmethod
    def open(cls, dest: Destination, identity: dict) -> "_Journal":
        j = cls(dest, identity)
        if dest.lstat(JOURNAL_NAME) is None:
            if dest.lstat(MANIFEST_NAME) is not None:
                j.files = _finished_files(dest, identity)
                j.finished = True
            return j
        where = dest.partial / JOURNAL_NAME
        obj = _read_json(dest, JOURNAL_NAME, "journal is unreadable; remove the partial directory to start over")
        if not isinstance(obj, dict) or obj.get("identity") != identity:
            raise InputError(dest.partial, "this partial rewrite is for another plan or source; remove it to start over")
        files = obj.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise InputError(where, "journal is malformed; remove the partial directory to start over")
        j.files = files
        return j

    def save(self) -> None:
        _write_json(self.dest, JOURNAL_NAME, {"identity": self.identity, "files": self.files})


def _read_json(dest: Destination, name: str, problem: str):
    """The JSON object in ``name`` inside the destination (never through a link); ``problem`` on failure."""
    try:
        fd = dest.open_read(name)
        with os.fdopen(fd, "rb") as fh:
            return json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        raise InputError(dest.partial / name, problem) from None


def _finished_files(dest: Destination, identity: dict) -> dict[str, dict]:
    """The journal entries of a rewrite that wrote its manifest and was stopped before its final rename.

    The manifest proves the directory is relayout's and for this source and plan; its files'
    sizes and digests become the journal, so every file is re-hashed before the rewrite is
    finished (and a file that does not match is written again).
    """
    where = dest.partial / MANIFEST_NAME
    m = _read_json(dest, MANIFEST_NAME, "holds an unreadable manifest and no journal; remove the partial directory to start over")
    if not isinstance(m, dict):
        m = {}
    rw, files = m.get("rewrite"), m.get("files")
    if m.get("format") != MANIFEST_FORMAT or not isinstance(rw, dict) or not isinstance(files, list) \
            or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in files):
        raise InputError(where, "is not a manifest of a relayout rewrite and there is no journal; remove the partial "
                                "directory to start over")
    names = [f["name"] for f in files if f.get("kind") == "safetensors"]
    if (rw.get("source_fingerprint") != identity["source_fingerprint"] or rw.get("plan_digest") != identity["plan_digest"]
            or names != identity["files"] or rw.get("split_dirs") != identity.get("split")):
        raise InputError(dest.partial, "holds a finished rewrite of another plan or source; remove it to start over")
    return {f["name"]: {"size": f.get("size"), "xxh3_128": f.get("xxh3_128")} for f in files}


def rewrite_container(
    src: Container,
    files: list[OutputFile],
    dst: str | os.PathLike,
    source_manifest: dict,
    provenance: dict,
    progress: bool = True,
    notify: Callable[[str], None] | None = None,
    plan_path: str | None = None,
    split: list[tuple[str | os.PathLike, list[str]]] = (),
) -> dict:
    """Write the new container at ``dst``; returns its manifest. See the module doc.

    ``notify`` receives one-line messages for the user (what a resumed run resumes);
    ``plan_path`` names the plan in the error that lists the file list's problems. ``split``
    places shards in other directories, ``(directory, shard names)`` in ``COLI_MODEL_DIRS``
    order: each is written straight into its directory, the rest and every other file into
    ``dst`` (:mod:`containers.split_destination`); the manifest, in ``dst``, records them
    (``rewrite.split_dirs``).
    """
    require_valid_output_files(src, files, plan_path)
    new_index = _regenerated_index(src, files)
    names = [f.name for f in files]
    split_dirs = split_directories(list(split), names)
    identity = {"source_fingerprint": source_manifest["fingerprint"], "files": names,
                "plan_digest": provenance.get("plan_digest")}
    if split_dirs:
        identity["split"] = [d.to_json() for d in split_dirs]
        provenance = {**provenance, "split_dirs": identity["split"]}
    with Destinations.open(dst, src.root, (JOURNAL_NAME, MANIFEST_NAME), split_dirs, identity) as dests:
        dest = dests.primary
        for d in dests.all:
            for stray in d.names():
                if TEMP_NAME.match(stray):      # a dead run's (we hold the lock)
                    d.unlink(stray)
        runtime = _runtime_files(src, dest)
        carried = [src.root / r.name for r in runtime if r.action == CARRIED and (src.root / r.name) not in src.other_files]
        journal = _Journal.open(dest, identity)
        if journal.files:
            _recheck_done(src, dests, journal, files, src.other_files + carried, notify, progress)
        journal.save()

        others = list(src.other_files) + carried
        todo = [f for f in files if f.name not in journal.files]
        todo_others = [p for p in others if p.name not in journal.files]
        with Sources() as sources:
            logical = sum(f.size for f in todo) + sum(p.stat().st_size for p in todo_others)
            _check_free_space(src, dests, todo, sum(p.stat().st_size for p in todo_others), sources)

            src_tensors = source_manifest["tensors"]

            def finish(w: _Written) -> None:
                journal.files[w.of.name], journal.tensor_digests[w.of.name] = _finish_file(w, dests.of(w.of.name), src, src_tensors)
                journal.save()

            with progress_bar(total=logical, unit="B", unit_scale=True, desc="rewrite", enabled=progress) as bar, \
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-hash") as pool, \
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-fsync") as finisher, \
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayout-hints") as hints:
                # file i is fsynced, checked, renamed and journaled while file i+1 is being copied
                pending = None
                for of in todo:
                    written = _copy_file(src, of, dests.of(of.name), pool, sources, bar.update, hints)
                    if pending is not None:
                        pending.result()
                    pending = finisher.submit(finish, written)
                if pending is not None:
                    pending.result()
                for p in todo_others:
                    if p.name == INDEX_NAME:
                        journal.files[p.name] = _write_generated(dest, p.name, new_index, bar.update)
                    else:
                        journal.files[p.name] = _copy_other(p, dest, bar.update)
                    journal.save()

        manifest = _manifest(files, list(src.other_files), journal, source_manifest, src_tensors, provenance)
        manifest["runtime_files"] = runtime_record(runtime, journal.files)
        _write_json(dest, MANIFEST_NAME, manifest)
        dest.unlink(JOURNAL_NAME)
        dests.publish()
    return manifest


def _check_free_space(src: Container, dests: Destinations, todo: list[OutputFile], others_bytes: int, sources: Sources) -> None:
    """Refuse before any byte is written when a volume lacks room for what is left to write in it.

    Per volume (``st_dev``): the bytes the remaining files of every directory on it allocate
    (the primary's also the files around the tensors), plus :data:`SPACE_MARGIN`; a volume of
    split directories with nothing left to write is not asked for the margin.
    """
    need: dict[int, list] = {}
    for i, d in enumerate(dests.all):
        mine = [of for of in todo if dests.of(of.name) is d]
        entry = need.setdefault(os.fstat(d.fd).st_dev, [d, 0])
        entry[1] += bytes_to_allocate(src, mine, sources) + (others_bytes if i == 0 else 0)
    for d, n in need.values():
        if n == 0 and d is not dests.primary:
            continue
        free = shutil.disk_usage(d.partial).free
        if free < n + SPACE_MARGIN:
            raise InputError(d.partial, f"needs {(n + SPACE_MARGIN) / 1e9:.2f} GB free, {free / 1e9:.2f} GB available")


def _recheck_done(src: Container, dests: Destinations, journal: _Journal, files: list[OutputFile], others: list[Path],
                  notify: Callable[[str], None] | None, progress: bool) -> None:
    """Re-hash every journaled file in its directory; keep only those whose size and digest match the journal.

    The tensor digests of the kept files are taken from this re-hash.
    """
    by_name = {f.name: f for f in files}
    known = set(by_name) | {p.name for p in others}
    total = sum(e.get("size", 0) for e in journal.files.values() if isinstance(e.get("size"), int))
    kept = 0
    with progress_bar(total=total, unit="B", unit_scale=True, desc="re-check written files", enabled=progress) as bar:
        for name in list(journal.files):
            entry = journal.files[name]
            dest = dests.of(name)
            st = dest.lstat(name) if name in known else None
            ok = st is not None and dest.is_regular(name) and st.st_size == entry.get("size")
            if ok:
                of = by_name.get(name)
                try:
                    layout = plan_shard(tensor_specs(src, of), of.alignment, of.metadata) if of else None
                    ranges = [Range(sp.name, b, b + sp.nbytes) for sp, b in layout.placements] if of else []
                    digest, per_tensor = hash_file(dest.partial / name, ranges, on_bytes=bar.update)
                except InputError:
                    digest, per_tensor = None, {}
                ok = digest == entry.get("xxh3_128")
            if ok:
                kept += 1
                journal.tensor_digests[name] = per_tensor
            else:
                del journal.files[name]
                if name in known:
                    dest.unlink(name)
    if notify is not None:
        left = len(files) + len(others) - kept
        what = "a finished rewrite stopped before its final rename: " if journal.finished else ""
        notify(f"resuming {dests.primary.partial}: {what}{kept} file(s) already written and re-hashed intact, {left} to write")


@dataclass
class _Written:
    """A file whose bytes are written (not yet durable): what the finisher needs."""

    of: OutputFile
    fd: int
    tmp: str
    layout: object
    hashes: dict
    writeback: Future | None = None    # the last writeback started for ``fd`` (wait before closing it)


def _copy_file(src: Container, of: OutputFile, dest: Destination, pool, sources: "Sources", on_bytes,
               hints: ThreadPoolExecutor) -> _Written:
    """Write one output file's bytes to its temp name; tensors are hashed as their copy ends.

    Only the data runs of a sparse source are copied: the file is extended to its size first,
    so the source's holes (and the padding) stay holes that read as zeros. The kernel hints
    (read-ahead of the sources, writeback of this file) are given from the ``hints`` thread,
    since either call can block while the disk is busy.
    """
    layout = plan_shard(tensor_specs(src, of), of.alignment, of.metadata)   # checked before the rewrite began
    buf = bytearray(8 * 1024 * 1024)
    hashes = {}
    fd = tmp = None
    writeback = None
    try:
        fd, tmp = dest.create_temp(of.name)
        os.pwrite(fd, layout.header, 0)
        os.ftruncate(fd, layout.file_size)           # padding and holes read back as zeros
        # copy in source order (sequential reads; the scattered writes land in the page cache and
        # reach the disk in order at fsync), asking the kernel to read ahead about a span ahead
        order = sorted(layout.placements, key=lambda p: (str(p[0].source.path), p[0].source.offset))
        read_ahead = ReadAhead([spec.source for spec, _ in order], sources, hints)
        unflushed = 0
        for i, (spec, begin) in enumerate(order):
            rng = spec.source
            read_ahead.advance(i)
            if unflushed >= WRITEBACK_BYTES and (writeback is None or writeback.done()):
                writeback = hints.submit(start_writeback, fd)
                unflushed = 0
            unflushed += rng.nbytes
            if isinstance(rng, FileRange):
                sfd, dmap = sources.fd(rng.path), sources.map(rng.path)
                for a, b, is_data in dmap.runs(rng.offset, rng.offset + rng.nbytes):
                    if is_data:
                        copy_range(sfd, fd, a, begin + a - rng.offset, b - a, buf, rng.path)
                # the source bytes are in the page cache now: hash them there while the next copy runs
                hashes[spec.name] = pool.submit(hash_range, rng.path, rng.offset, rng.offset + rng.nbytes)
            else:
                hashes[spec.name] = write_stream(fd, begin, rng)
            on_bytes(rng.nbytes)
        return _Written(of, fd, tmp, layout, hashes, writeback)
    except BaseException as exc:
        if writeback is not None:
            writeback.exception()       # wait: the call must not meet a closed (or reused) descriptor
        if fd is not None:
            os.close(fd)
            dest.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(dest.partial / of.name, describe_os_error(exc) + RESUME_HINT) from None
        raise


def _finish_file(w: _Written, dest: Destination, src: Container, src_tensors: dict) -> tuple[dict, dict]:
    """Make a written file durable and check it: fsync, verify hashes, rename, fsync the directory.

    Returns the journal entry (size, file digest) and the file's tensor digests.
    """
    try:
        try:
            if w.writeback is not None:
                w.writeback.exception()     # the hint thread is done with this descriptor
            fsync_fd(w.fd)
        finally:
            os.close(w.fd)
        digests = {name: f.result() for name, f in w.hashes.items()}
        for name, d in digests.items():
            want = src_tensors.get(name, {}).get("xxh3_128")
            if want is not None and want != d:
                raise InputError(src.root, f"tensor {name!r} does not match the source manifest (the source changed or a read failed)")
        dest.replace(w.tmp, w.of.name)
        dest.sync()
    except BaseException as exc:
        dest.unlink(w.tmp)
        if isinstance(exc, OSError):
            raise InputError(dest.partial / w.of.name, describe_os_error(exc) + RESUME_HINT) from None
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
    return {"size": layout.file_size, "xxh3_128": file_digest(layout.file_size, seg_digests)}, digests


def _copy_other(path: Path, dest: Destination, on_bytes) -> dict:
    """Copy a non-tensor file of the source (config, tokenizer, ...) unchanged."""
    buf = bytearray(8 * 1024 * 1024)
    tmp = None
    try:
        sfd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(sfd).st_size
            fd, tmp = dest.create_temp(path.name)
            try:
                copy_range(sfd, fd, 0, 0, size, buf, path)
                fsync_fd(fd)
            finally:
                os.close(fd)
        finally:
            os.close(sfd)
        dest.replace(tmp, path.name)
        dest.sync()
    except BaseException as exc:
        if tmp is not None:
            dest.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(dest.partial / path.name, describe_os_error(exc) + RESUME_HINT) from None
        raise
    on_bytes(size)
    digest, _ = hash_file(dest.partial / path.name)
    return {"size": size, "xxh3_128": digest}


def _runtime_files(src: Container, dest: Destination) -> list[RuntimeFile]:
    """What happens to each file colibrì's runtime keeps in SRC (:mod:`containers.runtime_files`)."""
    return runtime_files(src.root, os.stat(dest.partial).st_dev, {p.name for p in src.other_files})


def _regenerated_index(src: Container, files: list[OutputFile]) -> bytes | None:
    """DST's ``model.safetensors.index.json`` (:mod:`containers.model_index`), or None when SRC has none.

    Raises :class:`InputError` naming SRC's index when it is malformed (before anything is written).
    """
    path = next((p for p in src.other_files if p.name == INDEX_NAME), None)
    if path is None:
        return None
    doc = read_index(path)
    holder, total = {}, 0
    for of in files:
        for name, _ in of.tensors:
            holder[name] = of.name
            d = of.derived.get(name)
            total += d.spec.nbytes(d.part) if d else src.tensors[name].nbytes
    return index_bytes(regenerated_index(doc, holder, total))


def _write_generated(dest: Destination, name: str, data: bytes, on_bytes) -> dict:
    """Write a file relayout makes for DST (not a copy of SRC's) crash-safely; its journal entry."""
    try:
        write_at(dest.fd, name, data, dest.partial / name)
    except OSError as exc:
        raise InputError(dest.partial / name, describe_os_error(exc) + RESUME_HINT) from None
    on_bytes(len(data))
    digest, _ = hash_file(dest.partial / name)
    return {"size": len(data), "xxh3_128": digest}


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
                             "nbytes": nbytes, "xxh3_128": journal.tensor_digests[of.name][name]}
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
