"""Checksum manifests: xxh3-128 of every file and every tensor, sizes and geometry.

``relayout.manifest.json`` (schema: ``manifests/schemas/manifest.schema.json``) is what ties a
plan to a container and what verification compares against. Two fingerprints are derived:

* ``fingerprint``: the exact container (file names, sizes and hashes): a plan is made for it.
* ``content_fingerprint``: the tensors alone (name, dtype, shape, hash), independent of layout:
  a faithful rewrite has the same content fingerprint as its source.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from .atomic import write_json_atomic
from .container import MANIFEST_NAME, Container
from .errors import InputError
from .hashing import Range, digest_of, hash_file
from .jsonfile import read_document

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
    with tqdm(total=total, unit="B", unit_scale=True, desc="hash", disable=None if progress else True) as bar:
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
            "expert_formats": sorted({e.format for e in container.experts.values() if e.format}),
        },
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }


def write_manifest(manifest: dict, path: str | os.PathLike) -> None:
    try:
        write_json_atomic(path, manifest, indent=None)
    except InputError as exc:
        raise InputError(path, f"cannot write the manifest ({exc.problem}); use -o to put it elsewhere") from None


def load_manifest(path: str | os.PathLike) -> dict:
    """Read a manifest and check its basic shape."""
    return read_document(path, MANIFEST_FORMAT, MANIFEST_VERSION, ("files", "tensors", "fingerprint", "content_fingerprint"),
                         "manifest", missing="no manifest here (run relayout manifest first)")


def compare_manifests(expected: dict, actual: dict) -> list[str]:
    """Every difference between a recorded manifest and a fresh one, one line each."""
    out = []
    exp_files = {f["name"]: f for f in expected["files"]}
    act_files = {f["name"]: f for f in actual["files"]}
    for name in sorted(exp_files.keys() - act_files.keys()):
        out.append(f"file {name}: missing")
    for name in sorted(act_files.keys() - exp_files.keys()):
        out.append(f"file {name}: not in the manifest")
    for name in sorted(exp_files.keys() & act_files.keys()):
        e, a = exp_files[name], act_files[name]
        if e["size"] != a["size"]:
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
        for key in ("dtype", "shape", "nbytes", "xxh3_128"):
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
