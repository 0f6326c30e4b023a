"""``relayout verify SRC DST``: prove a rewritten container equals its source, tensor by tensor.

Checks, each reported as one line naming what is wrong:

* DST opens cleanly (every header passes the strict reader; at most 512 files; no duplicate
  names; every expert complete) and its manifest matches its files (re-hashed now);
* DST's recorded manifest passes the manifest schema and matches DST's actual headers and bytes:
  every tensor's file, offset, dtype, shape, size and hash, every file's kind, size and hash, the
  geometry, and its fingerprints; when it records a rewrite, its source content fingerprint is SRC's;
* every non-tensor file of SRC (``config.json``, ``tokenizer.json``, ...) is in DST with the same
  xxh3-128, and DST has no other; but ``model.safetensors.index.json``, in DST exactly when in
  SRC, is checked as the regenerated index of DST's tensors (:func:`~containers.model_index.index_problems`);
* the same tensor names in SRC and DST, none missing, none extra;
* every tensor's xxh3-128 in DST equals SRC's (``full=True`` also compares the bytes); a tensor
  stored as split segments (the manifest's segment map) is reassembled from them and compared;
* colibrì's format stamps (``__metadata__["colibri.fmt"]``): every stamp of SRC is in DST for the
  same tensor with the same format, in the shard that holds the tensor (a split tensor's: the
  shard of its first segment), and DST stamps nothing SRC does not;
* the files colibrì's runtime keeps that the rewrite carried (DST manifest's ``runtime_files``):
  each in DST with the bytes recorded; that SRC's copy changed since (the runtime updates them as
  it runs) is a note in the summary, not a problem;
* the runtime's constraints: each expert's three weight tensors byte-adjacent in one file, and
  the probe experts (expert 0 of the first MoE layer and of each MTP layer) present;
* a DST split over several directories (``COLI_MODEL_DIRS``) is read as colibrì reads it: shards
  collected from the primary and each split directory (a shard name in two of them, or a tensor
  in two shards, is an error), metadata from the primary only; the checks above then hold across
  the directories.

A DST whose experts are stored as split segments is equal to SRC and consistent, but the stock
runtime cannot load it: the summary says so (``needs_split_runtime``, ``split_experts``) rather
than the problem list, since it is a property of the layout asked for, not a defect.
"""

from __future__ import annotations

import os
from pathlib import Path

from .container import MANIFEST_NAME, MAX_FILES, Container
from .errors import InputError
from .hashing import hash_file
from .manifest import build_manifest, compare_manifests, load_manifest
from .model_index import INDEX_NAME, index_problems, read_index
from .runtime_files import runtime_file_problems
from .segments import SegmentSpec, reassembled_digest
from .shard_metadata import shard_stamps, stamp_problems
from .sparse import data_map, is_zero

COMPARE_CHUNK = 16 * 1024 * 1024


def _source_manifest(src: Container, progress: bool) -> dict:
    path = src.root / MANIFEST_NAME
    fresh = build_manifest(src, progress=progress)
    if path.exists():
        recorded = load_manifest(path)
        problems = compare_manifests(recorded, fresh)
        if problems:
            raise InputError(src.root, f"source does not match its manifest: {problems[0]}")
    return fresh


def verify_containers(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, full: bool = False, progress: bool = True,
                      dirs: list[str | os.PathLike] | None = None) -> tuple[list[str], dict]:
    """Compare DST to SRC; returns (problems, summary). An empty list means identical.

    ``dirs``: DST is split over several directories, DST the primary and ``dirs`` the others in
    ``COLI_MODEL_DIRS`` order; its shards are taken as colibrì takes them (every tensor once
    among them). ``None``: the directories DST's manifest records for a split rewrite
    (``rewrite.split_dirs``), else none.
    """
    src = Container.open(src_dir)
    if dirs is None:
        dirs = _recorded_split_dirs(Path(dst_dir) / MANIFEST_NAME)
    dst = Container.open(dst_dir, dirs)
    problems: list[str] = []
    src_m = _source_manifest(src, progress)
    dst_m = build_manifest(dst, progress=progress)
    recorded_path = Path(dst_dir) / MANIFEST_NAME
    segments: dict = {}
    runtime, notes = [], []
    if recorded_path.exists():
        recorded = load_manifest(recorded_path)
        problems += [f"DST manifest: {p}" for p in compare_manifests(recorded, dst_m)]
        runtime = recorded.get("runtime_files", [])
        found, notes = runtime_file_problems(runtime, src.root, dst.root, lambda p: hash_file(p)[0])
        problems += found
        segments = recorded.get("segments", dst_m.get("segments", {}))
        claimed = recorded.get("rewrite", {}).get("source_content_fingerprint")
        if claimed is not None and claimed != src_m["content_fingerprint"]:
            problems.append("DST manifest: rewrite.source_content_fingerprint is not SRC's content fingerprint "
                            "(DST records a rewrite of other tensors)")
    else:
        problems.append(f"DST has no {MANIFEST_NAME}")
    problems += _compare_other_files(src_m, dst_m)
    problems += _check_index(src, dst)
    st = dict(src_m["tensors"])
    dt = dict(dst_m["tensors"])
    problems += _check_stamps(src, dst, segments)
    problems += _check_segments(src, dst, st, dt, segments)
    problems += [f"tensor {n}: missing from DST" for n in sorted(st.keys() - dt.keys())]
    problems += [f"tensor {n}: in DST but not in SRC" for n in sorted(dt.keys() - st.keys())]
    for name in sorted(st.keys() & dt.keys()):
        a, b = st[name], dt[name]
        if (a["dtype"], a["shape"], a["nbytes"]) != (b["dtype"], b["shape"], b["nbytes"]):
            problems.append(f"tensor {name}: dtype/shape differ ({a['dtype']}{a['shape']} vs {b['dtype']}{b['shape']})")
        elif a["xxh3_128"] != b["xxh3_128"]:
            problems.append(f"tensor {name} ({b['file']}): bytes differ from SRC")
    if full:
        problems += _byte_compare(src, dst, sorted(st.keys() & dt.keys()))
    problems += [f"DST: {p}" for p in dst.problems]
    if len(dst.files) > MAX_FILES:
        problems.append(f"DST has {len(dst.files)} files; the runtime loads at most {MAX_FILES}")
    off_path = [f"{e.layer}.{e.expert}" for e in dst.experts.values() if not e.fast_path]
    if off_path:
        problems.append(f"DST: {len(off_path)} experts are not one read (weights not byte-adjacent), e.g. {off_path[0]}")
    split_experts = sum(1 for e in dst.experts.values() if e.split)
    summary = {
        "src": str(src.root), "dst": str(dst.root), "split_dirs": [str(d) for d in dirs], "tensors": len(dt), "split_tensors": len(segments), "files": len(dst.files),
        "split_experts": split_experts, "needs_split_runtime": split_experts > 0, "format_stamps": len(src.stamps),
        "runtime_files": runtime, "runtime_file_notes": notes,
        "full_byte_compare": full, "src_content_fingerprint": src_m["content_fingerprint"],
        "dst_content_fingerprint": dst_m["content_fingerprint"], "problems": problems,
    }
    return problems, summary


def _recorded_split_dirs(manifest_path: Path) -> list[str]:
    """The split directories a split rewrite recorded in DST's manifest (none when it records none)."""
    if not manifest_path.is_file():
        return []
    recorded = load_manifest(manifest_path).get("rewrite", {}).get("split_dirs")
    if not isinstance(recorded, list) or not all(isinstance(d, dict) and isinstance(d.get("path"), str) for d in recorded):
        return []
    return [d["path"] for d in recorded]


def _compare_other_files(src_m: dict, dst_m: dict) -> list[str]:
    """Every non-tensor file of SRC must be in DST with the same hash, and DST has no other."""
    a = {f["name"]: f for f in src_m["files"] if f["kind"] == "other"}
    b = {f["name"]: f for f in dst_m["files"] if f["kind"] == "other"}
    out = [f"file {n}: in SRC but missing from DST" for n in sorted(a.keys() - b.keys())]
    out += [f"file {n}: in DST but not in SRC" for n in sorted(b.keys() - a.keys())]
    out += [f"file {n}: content differs from SRC's (xxh3-128)" for n in sorted(a.keys() & b.keys())
            if n != INDEX_NAME and (a[n]["size"], a[n]["xxh3_128"]) != (b[n]["size"], b[n]["xxh3_128"])]
    return out


def _check_index(src: Container, dst: Container) -> list[str]:
    """DST's index (when both have one) is SRC's regenerated for DST's tensors."""
    if not ((src.root / INDEX_NAME).is_file() and (dst.root / INDEX_NAME).is_file()):
        return []
    try:
        src_doc = read_index(src.root / INDEX_NAME)
        dst_doc = read_index(dst.root / INDEX_NAME)
    except InputError as exc:
        return [f"{exc.where}: {exc.problem}"]
    holder = {name: dst.files[ref.file].name for name, ref in dst.tensors.items()}
    total = sum(ref.nbytes for ref in dst.tensors.values())
    return index_problems(dst_doc, src_doc, holder, total)


def _check_stamps(src: Container, dst: Container, segments: dict) -> list[str]:
    """SRC's format stamps against DST's, shard by shard (:func:`~containers.shard_metadata.stamp_problems`)."""
    holder = {name: dst.files[ref.file].name for name, ref in dst.tensors.items()}
    files = {name: i for i, name in enumerate(p.name for p in dst.files)}
    for orig, spec in segments.items():
        parts = [holder[n] for n in (spec.get("top"), spec.get("bottom")) if n in holder]
        if parts:
            holder[orig] = min(parts, key=files.__getitem__)
    per_file = [(p.name, shard_stamps(p, h.metadata)) for p, h in zip(dst.files, dst.headers)]
    return stamp_problems(src.stamps, per_file, holder)


def _check_segments(src: Container, dst: Container, st: dict, dt: dict, segments: dict) -> list[str]:
    """Reassemble every split tensor from its DST segments and compare it with SRC.

    Removes the checked names from ``st`` and ``dt`` so the by-name comparison skips them.
    """
    out = []
    for orig, spec_json in sorted(segments.items()):
        spec = SegmentSpec(spec_json["kind"], spec_json["rows"], spec_json["row_bytes"], spec_json["split"])
        top, bottom = spec_json.get("top"), spec_json.get("bottom")
        src_entry = st.pop(orig, None)
        refs = [dst.tensors.get(top), dst.tensors.get(bottom)]
        dt.pop(top, None)
        dt.pop(bottom, None)
        if src_entry is None:
            out.append(f"tensor {orig}: split in DST but not in SRC")
            continue
        if None in refs:
            out.append(f"tensor {orig}: segment {top if refs[0] is None else bottom} missing from DST")
            continue
        if (spec.rows * spec.row_bytes != src_entry["nbytes"] or (spec.rows and not spec.row_bytes)
                or refs[0].nbytes != spec.nbytes("top") or refs[1].nbytes != spec.nbytes("bottom")):
            out.append(f"tensor {orig}: segment sizes do not match the segment map")
            continue
        digest = reassembled_digest(spec, (dst.files[refs[0].file], refs[0].entry.begin), (dst.files[refs[1].file], refs[1].entry.begin))
        if digest != src_entry["xxh3_128"]:
            out.append(f"tensor {orig} ({dst.files[refs[0].file].name}): segments do not reassemble to SRC's bytes")
        elif spec.kind == "shared":
            other = reassembled_digest(spec, (dst.files[refs[1].file], refs[1].entry.begin), (dst.files[refs[1].file], refs[1].entry.begin))
            if other != digest:
                out.append(f"tensor {orig}: its bottom copy differs from its top")
    return out


def _byte_compare(src: Container, dst: Container, names: list[str]) -> list[str]:
    """Compare every byte of each named tensor in SRC and DST; holes compare as zeros, unread."""
    out = []
    fds: dict = {}
    try:
        for name in names:
            a, b = src.tensors[name], dst.tensors[name]
            if a.nbytes != b.nbytes:
                continue
            fa, ma = _opened(fds, src.files[a.file])
            fb, mb = _opened(fds, dst.files[b.file])
            if not _same_bytes(fa, ma, a.entry.begin, fb, mb, b.entry.begin, a.nbytes):
                out.append(f"tensor {name}: byte comparison differs")
    finally:
        for fd, _ in fds.values():
            os.close(fd)
    return out


def _opened(fds: dict, path: Path):
    if path not in fds:
        fd = os.open(path, os.O_RDONLY)
        fds[path] = (fd, data_map(fd))
    return fds[path]


def _same_bytes(fa: int, ma, a0: int, fb: int, mb, b0: int, n: int) -> bool:
    """Bytes ``[a0, a0+n)`` of ``fa`` equal bytes ``[b0, b0+n)`` of ``fb``; a hole reads as zeros."""
    cuts = {0, n}
    cuts.update(x - a0 for x, _, _ in ma.runs(a0, a0 + n))
    cuts.update(x - b0 for x, _, _ in mb.runs(b0, b0 + n))
    edges = sorted(cuts)
    for lo, hi in zip(edges, edges[1:]):
        a_data = ma.data_bytes(a0 + lo, a0 + hi) > 0
        b_data = mb.data_bytes(b0 + lo, b0 + hi) > 0
        if not (a_data or b_data):
            continue
        for pos in range(lo, hi, COMPARE_CHUNK):
            k = min(COMPARE_CHUNK, hi - pos)
            left = os.pread(fa, k, a0 + pos) if a_data else None
            right = os.pread(fb, k, b0 + pos) if b_data else None
            if left is None:
                left, right = right, left
            if len(left) != k or (right is None and not is_zero(left)) or (right is not None and left != right):
                return False
    return True
