"""Checksum manifests: xxh3-128 of every file and every tensor, sizes and geometry.

``relayout.manifest.json`` (schema: ``manifests/schemas/manifest.schema.json``) is what ties a
plan to a container and what verification compares against. Two fingerprints are derived:

* ``fingerprint``: the exact container (file names, sizes and hashes): a plan is made for it.
* ``content_fingerprint``: the tensors alone (name, dtype, shape, hash), independent of layout:
  a faithful rewrite has the same content fingerprint as its source.

:func:`load_manifest` checks a manifest against that schema in plain Python (jsonschema is a
test-only dependency; the tests hold the two to agreement) and refuses one that is malformed with
one line naming the key. :func:`compare_manifests` compares every field of every entry (a
tensor's file and offset included), the geometry, the segment map of a split container (derived
from its tensors by :func:`segment_map`), and each fingerprint with what its lists give.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from .progress import progress_bar

from .atomic import write_json_atomic
from .container import MANIFEST_NAME, Container, expert_tensor_name
from .errors import InputError
from .geometry import ExpertFormat
from .hashing import Range, digest_of, hash_file
from .jsonfile import read_document
from .segments import expert_segment_specs

MANIFEST_FORMAT = "relayout.manifest"
MANIFEST_VERSION = 1


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def layout_fingerprint(files: list[dict]) -> str:
    """Fingerprint of the exact files: name, size and hash of each."""
    return digest_of(_canonical(sorted([f["name"], f["size"], f["xxh3_128"]] for f in files)))


def content_fingerprint(tensors: dict[str, dict]) -> str:
    """Fingerprint of the tensor contents, whatever file or offset they live at."""
    return digest_of(_canonical(sorted([n, t["dtype"], t["shape"], t["xxh3_128"]] for n, t in tensors.items())))


def build_manifest(container: Container, progress: bool = True) -> dict:
    """Hash every file of ``container`` once and return the manifest (JSON-ready)."""
    paths = list(container.files) + list(container.other_files)
    total = sum(p.stat().st_size for p in paths)
    files, tensors = [], {}
    with progress_bar(total=total, unit="B", unit_scale=True, desc="hash", enabled=progress) as bar:
        for i, path in enumerate(paths):
            is_shard = i < len(container.files)
            entries = container.headers[i].tensors.values() if is_shard else ()
            file_hash, tensor_hashes = hash_file(path, [Range(t.name, t.begin, t.end) for t in entries], bar.update)
            files.append({
                "name": path.name,
                "kind": "safetensors" if is_shard else "other",
                "size": path.stat().st_size,
                "xxh3_128": file_hash,
            })
            for t in entries:
                tensors[t.name] = {
                    "file": path.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "offset": t.begin,
                    "nbytes": t.nbytes,
                    "xxh3_128": tensor_hashes[t.name],
                }
    cfg = container.config
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "hash": "xxh3-128",
        "fingerprint": layout_fingerprint(files),
        "content_fingerprint": content_fingerprint(tensors),
        "geometry": {
            "hidden_size": cfg.hidden_size,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "num_hidden_layers": cfg.num_hidden_layers,
            "first_moe_layer": cfg.first_moe_layer,
            "mtp_layers": cfg.mtp_layers,
            "expert_formats": sorted({e.base_format for e in container.experts.values() if e.base_format}),
        },
        "files": files,
        "tensors": dict(sorted(tensors.items())),
        **({"segments": segs} if (segs := segment_map(container)) else {}),
    }


def segment_map(container: Container) -> dict:
    """The segment map (``docs/SPLIT_SEGMENTS.md``) that a split container's segments imply.

    Derived from each split expert's format and its gate top rows, with the one implementation
    the rewriter uses (:func:`containers.segments.expert_segment_specs`), so a re-made manifest of a
    split container keeps its map, and a recorded map can be checked against the tensors.
    Experts whose segment sizes fit no split are left out (the container reports them).
    """
    cfg = container.config
    out = {}
    for e in container.experts.values():
        if not e.split or e.base_format is None:
            continue
        fmt = ExpertFormat.parse(e.base_format)
        wrow = math.ceil(cfg.hidden_size * fmt.bits / 8)
        top = e.segments[("gate", False, "top")].nbytes
        if wrow == 0 or top % wrow:
            continue
        specs = expert_segment_specs(fmt, cfg.hidden_size, cfg.moe_intermediate_size, top // wrow)
        for (proj, scale), spec in specs.items():
            name = expert_tensor_name(e.layer, e.expert, proj, scale)
            out[name] = {**spec.to_json(), "top": f"{name}.top", "bottom": f"{name}.bottom"}
    return dict(sorted(out.items()))


def write_manifest(manifest: dict, path: str | os.PathLike) -> None:
    try:
        write_json_atomic(path, manifest, indent=None)
    except InputError as exc:
        raise InputError(path, f"cannot write the manifest ({exc.problem}); use -o to put it elsewhere") from None


def load_manifest(path: str | os.PathLike) -> dict:
    """Read a manifest and check it against the manifest schema (one line naming the bad key)."""
    try:
        obj = read_document(path, MANIFEST_FORMAT, MANIFEST_VERSION, _REQUIRED,
                            "manifest", missing="no manifest here (run relayout manifest first)")
    except RecursionError:
        raise InputError(path, "not a readable manifest (JSON nested too deeply)") from None
    problem = manifest_problem(obj)
    if problem:
        raise InputError(path, f"malformed manifest: {problem}")
    return obj


_REQUIRED = ("hash", "fingerprint", "content_fingerprint", "geometry", "files", "tensors")
_HASH_RE = re.compile(r"[0-9a-f]{32}")
_FORMAT_RE = re.compile(r"int(4|8)-(row|g[0-9]+)")
_GEOMETRY_COUNTS = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                    "num_hidden_layers", "first_moe_layer", "mtp_layers")
_FILE_KEYS = {"name": "string", "kind": "kind", "size": "count", "xxh3_128": "hash"}
_TENSOR_KEYS = {"file": "string", "dtype": "string", "shape": "shape", "offset": "count", "nbytes": "count", "xxh3_128": "hash"}
_SEGMENT_KEYS = {"kind": "segment kind", "rows": "count", "row_bytes": "count", "split": "count or null",
                 "top": "string", "bottom": "string"}
_REWRITE_KEYS = {"source_fingerprint": "hash", "source_content_fingerprint": "hash", "forced": "boolean"}
_RUNTIME_KEYS = {"name": "string", "action": "runtime action", "reason": "string"}
_RUNTIME_COPY_KEYS = {"size": "count", "xxh3_128": "hash"}


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_TYPES = {
    "string": (lambda v: isinstance(v, str), "a string"),
    "count": (_is_count, "a non-negative integer"),
    "hash": (lambda v: isinstance(v, str) and _HASH_RE.fullmatch(v) is not None, "32 lowercase hex digits"),
    "kind": (lambda v: v in ("safetensors", "other"), '"safetensors" or "other"'),
    "shape": (lambda v: isinstance(v, list) and all(_is_count(d) for d in v), "a list of non-negative integers"),
    "segment kind": (lambda v: v in ("rows", "columns", "shared"), '"rows", "columns" or "shared"'),
    "count or null": (lambda v: v is None or _is_count(v), "a non-negative integer or null"),
    "boolean": (lambda v: isinstance(v, bool), "true or false"),
    "runtime action": (lambda v: v in ("carried", "dropped", "left behind"), '"carried", "dropped" or "left behind"'),
}


def _key(name: str) -> str:
    text = json.dumps(name)
    return text if len(text) <= 100 else text[:97] + '..."'


def _entry_problem(where: str, entry, keys: dict, exact: bool = True) -> str | None:
    if not isinstance(entry, dict):
        return f"{where} must be an object"
    for k, kind in keys.items():
        if k not in entry:
            if exact:
                return f"{where} lacks {k!r}"
            continue
        ok, what = _TYPES[kind]
        if not ok(entry[k]):
            return f"{where}.{k} must be {what}"
    if exact:
        extra = sorted(set(entry) - set(keys))
        if extra:
            return f"{where} has unknown key {_key(extra[0])}"
    return None


def manifest_problem(m: dict) -> str | None:
    """The first way ``m`` breaks the manifest schema (format and version already checked), or None.

    Also refused, beyond the schema: a file named twice, a tensor in a file the manifest does not
    list as safetensors, a segment whose ``split`` contradicts its kind.
    """
    if not (isinstance(m.get("version"), int) and not isinstance(m["version"], bool)):
        return "version must be the integer 1"
    if m["hash"] != "xxh3-128":
        return 'hash must be "xxh3-128"'
    for k in ("fingerprint", "content_fingerprint"):
        if not _TYPES["hash"][0](m[k]):
            return f"{k} must be 32 lowercase hex digits"
    g = m["geometry"]
    problem = _entry_problem("geometry", g, {k: "count" for k in _GEOMETRY_COUNTS}, exact=False)
    if problem:
        return problem
    for k in _GEOMETRY_COUNTS:
        if k not in g:
            return f"geometry lacks {k!r}"
    fmts = g.get("expert_formats")
    if not (isinstance(fmts, list) and all(isinstance(f, str) and _FORMAT_RE.fullmatch(f) for f in fmts)):
        return "geometry.expert_formats must be a list of format names such as \"int4-g64\"" if "expert_formats" in g \
            else "geometry lacks 'expert_formats'"
    if not isinstance(m["files"], list):
        return "files must be a list"
    shards, names = set(), set()
    for i, f in enumerate(m["files"]):
        problem = _entry_problem(f"files[{i}]", f, _FILE_KEYS)
        if problem:
            return problem
        if f["name"] in names:
            return f"files[{i}]: file {_key(f['name'])} is listed twice"
        names.add(f["name"])
        if f["kind"] == "safetensors":
            shards.add(f["name"])
    if not isinstance(m["tensors"], dict):
        return "tensors must be an object"
    for name, t in m["tensors"].items():
        where = f"tensors[{_key(name)}]"
        problem = _entry_problem(where, t, _TENSOR_KEYS)
        if problem:
            return problem
        if t["file"] not in shards:
            return f"{where}.file {_key(t['file'])} is not a safetensors file of this manifest"
    if "segments" in m:
        if not isinstance(m["segments"], dict):
            return "segments must be an object"
        for name, seg in m["segments"].items():
            where = f"segments[{_key(name)}]"
            problem = _entry_problem(where, seg, _SEGMENT_KEYS)
            if problem:
                return problem
            if (seg["split"] is None) != (seg["kind"] == "shared"):
                return f"{where}.split must be null exactly when kind is \"shared\""
    if "rewrite" in m:
        problem = _entry_problem("rewrite", m["rewrite"], _REWRITE_KEYS, exact=False)
        if problem:
            return problem
    if "runtime_files" in m:
        if not isinstance(m["runtime_files"], list):
            return "runtime_files must be a list"
        for i, entry in enumerate(m["runtime_files"]):
            where = f"runtime_files[{i}]"
            problem = _entry_problem(where, entry, _RUNTIME_KEYS, exact=False) \
                or _entry_problem(where, {k: v for k, v in entry.items() if k not in _RUNTIME_KEYS}, _RUNTIME_COPY_KEYS, exact=False)
            if problem:
                return problem
            for k in _RUNTIME_KEYS:
                if k not in entry:
                    return f"{where} lacks {k!r}"
            extra = sorted(set(entry) - set(_RUNTIME_KEYS) - set(_RUNTIME_COPY_KEYS))
            if extra:
                return f"{where} has unknown key {_key(extra[0])}"
    return None


def compare_manifests(expected: dict, actual: dict) -> list[str]:
    """Every difference between a recorded manifest and a fresh one, one line each.

    Both must have passed :func:`manifest_problem`. Compared: each fingerprint of ``expected`` with
    the one its own lists give; the geometry; the segment map; each file's kind, size and hash;
    each tensor's file, offset, dtype, shape, size and hash.
    """
    out = []
    if expected["fingerprint"] != layout_fingerprint(expected["files"]):
        out.append("fingerprint: does not match the manifest's own file list")
    if expected["content_fingerprint"] != content_fingerprint(expected["tensors"]):
        out.append("content_fingerprint: does not match the manifest's own tensor list")
    eg, ag = expected["geometry"], actual["geometry"]
    for key in sorted(set(_GEOMETRY_COUNTS) | {"expert_formats"}):
        if eg.get(key) != ag.get(key):
            out.append(f"geometry {key}: {ag.get(key)}, manifest says {eg.get(key)}")
    if expected.get("segments", {}) != actual.get("segments", {}):
        exp_s, act_s = expected.get("segments", {}), actual.get("segments", {})
        diff = sorted(n for n in exp_s.keys() | act_s.keys() if exp_s.get(n) != act_s.get(n))
        out.append(f"segments: {len(diff)} entries differ from what the split tensors give, e.g. {diff[0]}")
    exp_files = {f["name"]: f for f in expected["files"]}
    act_files = {f["name"]: f for f in actual["files"]}
    for name in sorted(exp_files.keys() - act_files.keys()):
        out.append(f"file {name}: missing")
    for name in sorted(act_files.keys() - exp_files.keys()):
        out.append(f"file {name}: not in the manifest")
    for name in sorted(exp_files.keys() & act_files.keys()):
        e, a = exp_files[name], act_files[name]
        if e["kind"] != a["kind"]:
            out.append(f"file {name}: kind {a['kind']}, manifest says {e['kind']}")
        elif e["size"] != a["size"]:
            out.append(f"file {name}: size {a['size']}, manifest says {e['size']}")
        elif e["xxh3_128"] != a["xxh3_128"]:
            out.append(f"file {name}: hash differs")
    exp_t, act_t = expected["tensors"], actual["tensors"]
    for name in sorted(exp_t.keys() - act_t.keys()):
        out.append(f"tensor {name}: missing")
    for name in sorted(act_t.keys() - exp_t.keys()):
        out.append(f"tensor {name}: not in the manifest")
    for name in sorted(exp_t.keys() & act_t.keys()):
        e, a = exp_t[name], act_t[name]
        for key in ("file", "offset", "dtype", "shape", "nbytes", "xxh3_128"):
            if e[key] != a[key]:
                what = "hash differs" if key == "xxh3_128" else f"{key} {a[key]}, manifest says {e[key]}"
                out.append(f"tensor {name} ({a['file']}): {what}")
                break
    return out


def check_container(root: str | os.PathLike, manifest_path: str | os.PathLike | None = None, progress: bool = True) -> list[str]:
    """Re-hash the container at ``root`` and list every mismatch against its manifest."""
    root = Path(root)
    expected = load_manifest(manifest_path or root / MANIFEST_NAME)
    actual = build_manifest(Container.open(root), progress=progress)
    return compare_manifests(expected, actual)
