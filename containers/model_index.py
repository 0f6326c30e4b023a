"""``model.safetensors.index.json``: the index mapping every tensor to the shard that holds it.

A rewrite moves tensors between shards, so the source's index would name the wrong shards
(colibrì's ``coli doctor --deep`` then reports the model index invalid). An index in SRC therefore
gives a regenerated one in DST (:func:`regenerated_index`); no index in SRC gives none in DST.

The regenerated index keeps every key of the source's document and of its ``metadata`` object
(``total_parameters`` and the like describe the model, which does not change) but two:

* ``weight_map``: every tensor DST stores (split segments by their own names) to its shard;
* ``metadata.total_size``: the sum of the stored tensors' byte sizes, headers and alignment
  padding excluded, as the Hugging Face writer and colibrì's index-writing tools compute it (a
  split tensor counts its segments' bytes, which is what is stored).

It is written as the Hugging Face writer writes it: JSON with two-space indentation and sorted
keys, then a newline. :func:`index_problems` is what ``verify`` checks of DST's index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from .errors import InputError
from .jsonfile import parse_json
from .safetensors_io import MAX_HEADER_BYTES

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = MAX_HEADER_BYTES
"""A larger index is refused rather than read (it is one entry per tensor)."""
MAX_SHOWN = 3


def read_index(path: str | os.PathLike) -> dict:
    """The index document at ``path``, checked: a JSON object whose ``weight_map`` maps strings to
    strings and whose ``metadata``, when present, is an object. Raises :class:`InputError` naming
    ``path``."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise InputError(path, f"{size} bytes; an index over {MAX_INDEX_BYTES} bytes is refused")
            raw = fh.read()
    except OSError as exc:
        raise InputError(path, f"cannot read ({exc.strerror or exc})") from None
    try:
        doc = parse_json(raw.decode("utf-8"))
    except ValueError as exc:
        raise InputError(path, f"not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(doc, dict):
        raise InputError(path, "not a JSON object")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise InputError(path, "weight_map is not an object mapping tensor names to shard names")
    if not isinstance(doc.get("metadata", {}), dict):
        raise InputError(path, "metadata is not an object")
    return doc


def regenerated_index(source: Mapping, holder: Mapping[str, str], total_size: int) -> dict:
    """The index of a new container.

    Parameters
    ----------
    source
        The source's index document (as :func:`read_index` returns it).
    holder
        ``{stored tensor name: shard file name}`` of the new container.
    total_size
        Bytes of all stored tensors (headers and padding excluded).

    Returns
    -------
    dict
        The source's document with ``weight_map`` and ``metadata.total_size`` replaced.
    """
    doc = {k: v for k, v in source.items() if k not in ("metadata", "weight_map")}
    doc["metadata"] = {**source.get("metadata", {}), "total_size": total_size}
    doc["weight_map"] = dict(sorted(holder.items()))
    return doc


def index_bytes(doc: Mapping) -> bytes:
    """The file's bytes, as the Hugging Face writer lays them out."""
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _few(names: list[str]) -> str:
    return ", ".join(names[:MAX_SHOWN]) + (f" and {len(names) - MAX_SHOWN} more" if len(names) > MAX_SHOWN else "")


def index_problems(dst: Mapping, src: Mapping, holder: Mapping[str, str], total_size: int) -> list[str]:
    """Where DST's index document ``dst`` is not the regenerated index of SRC's ``src`` for DST's
    tensors (``holder``: stored tensor name to shard; ``total_size``: their bytes), one line each."""
    out = []
    wm = dst.get("weight_map") if isinstance(dst.get("weight_map"), dict) else {}
    missing = sorted(holder.keys() - wm.keys())
    unknown = sorted(wm.keys() - holder.keys())
    wrong = sorted(n for n in holder.keys() & wm.keys() if wm[n] != holder[n])
    if missing:
        out.append(f"{INDEX_NAME}: {len(missing)} tensor(s) of DST not in weight_map: {_few(missing)}")
    if unknown:
        out.append(f"{INDEX_NAME}: weight_map names {len(unknown)} tensor(s) DST does not have: {_few(unknown)}")
    if wrong:
        out.append(f"{INDEX_NAME}: weight_map names the wrong shard for {len(wrong)} tensor(s): "
                   + _few([f"{n} ({wm[n]}, held by {holder[n]})" for n in wrong]))
    meta = dst.get("metadata") if isinstance(dst.get("metadata"), dict) else {}
    if meta.get("total_size") != total_size:
        out.append(f"{INDEX_NAME}: metadata.total_size is {meta.get('total_size')!r}, DST's tensors hold {total_size} bytes")
    want = regenerated_index(src, holder, total_size)
    for key in sorted((set(want) | set(dst)) - {"weight_map", "metadata"}):
        if want.get(key) != dst.get(key):
            out.append(f"{INDEX_NAME}: key {key!r} differs from SRC's index")
    for key in sorted((set(want["metadata"]) | set(meta)) - {"total_size"}):
        if want["metadata"].get(key) != meta.get(key):
            out.append(f"{INDEX_NAME}: metadata.{key} differs from SRC's index")
    return out


__all__ = ["INDEX_NAME", "index_bytes", "index_problems", "read_index", "regenerated_index"]
