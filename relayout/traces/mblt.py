"""The MBLT importer: mbolt's ``MBLT`` v1 binary routing log into one session of rows.

A header (magic, version 1, experts per layer) then records of ``(layer, k, n_tokens)`` and
``n_tokens x k`` int32 ids, little-endian. A new forward starts where the layer decreases;
multi-token forwards before the first one-token forward are prefill, later ones verify steps
(acceptance assumed). Only a truncated *last* record is a torn tail (dropped with a warning): a
record that claims more bytes than remain while a valid chain of records follows it is mid-file
damage, an error naming the record and its byte offset (``file:record N``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from containers.errors import InputError
from containers.jsonfile import read_bytes

from .sessions import Limits, SessionRows, check_padding, session_from_rows

MBLT_MAGIC = 0x544C424D
MBLT_MAX_K = 64


def _mblt_record(data: bytes, pos: int, n_expert: int, k_expected: int | None, limits: Limits):
    """The record at ``pos`` if it is complete and plausible: ``(layer, ids [n, k], end)``, else None."""
    if pos + 12 > len(data):
        return None
    layer, k, n_tok = struct.unpack_from("<III", data, pos)
    if not 1 <= k <= MBLT_MAX_K or n_tok == 0 or (k_expected is not None and k != k_expected) or not limits.layer_ok(layer):
        return None
    end = pos + 12 + 4 * k * n_tok
    if end > len(data):
        return None
    ids = np.frombuffer(data, dtype="<i4", count=k * n_tok, offset=pos + 12).reshape(n_tok, k)
    if (ids < 0).any() or (ids >= n_expert).any():
        return None
    if k > 1:
        s = np.sort(ids, axis=1)
        if (s[:, 1:] == s[:, :-1]).any():
            return None
    return layer, ids, end


def _mblt_reaches_end(data: bytes, pos: int, n_expert: int, k: int, limits: Limits, memo: dict) -> bool:
    """Whether plausible complete records run from ``pos`` to the end of ``data``, the last one
    possibly torn (a cut header, or a plausible header whose ids run past the end)."""
    visited = []
    while True:
        if pos in memo:
            ok = memo[pos]
            break
        visited.append(pos)
        if pos == len(data):
            ok = True
            break
        rec = _mblt_record(data, pos, n_expert, k, limits)
        if rec is None:
            if pos + 12 > len(data):
                ok = True
            else:
                layer, kk, n_tok = struct.unpack_from("<III", data, pos)
                ok = kk == k and n_tok > 0 and limits.layer_ok(layer) and pos + 12 + 4 * kk * n_tok > len(data)
            break
        pos = rec[2]
    for p in visited:
        memo[p] = ok
    return ok


def _mblt_damage_follows(data: bytes, pos: int, k: int, n_expert: int, limits: Limits):
    """For the record at ``pos``, which claims more bytes than remain: the byte offset of a complete
    record (of the file's ``k``) after it from which valid records run to the end of the file, so
    the record is damaged mid-file rather than torn; None when there is none."""
    words = np.frombuffer(data, dtype="<u4", count=len(data) // 4)
    first = (pos + 12) // 4
    if len(words) < first + 3:
        return None
    lay, kk, nt = words[first:-2].astype(np.int64), words[first + 1:-1], words[first + 2:]
    cand = np.flatnonzero((kk == k) & (nt > 0) & ~limits.bad_layer(lay)) + first
    memo: dict = {}
    for i in cand.tolist():
        q = 4 * i
        rec = _mblt_record(data, q, n_expert, k, limits)
        if rec is not None and _mblt_reaches_end(data, rec[2], n_expert, k, limits, memo):
            return q
    return None


def read_mblt(path: Path, warnings: list[str], limits: Limits | None = None) -> tuple[SessionRows, int]:
    """Parse mbolt's MBLT v1 file as one session.

    Parameters
    ----------
    path : Path
        The MBLT file.
    warnings : list of str
        Appended to: a torn last record, dropped.
    limits : Limits, optional
        What ids and layers may be (the header's experts per layer must fit them).

    Returns
    -------
    (SessionRows, int)
        The session and the header's experts per layer.
    """
    limits = limits or Limits.make(None)
    data = read_bytes(path)
    if len(data) < 12:
        raise InputError(path, "too short for an MBLT header")
    magic, version, n_expert = struct.unpack_from("<III", data, 0)
    if magic != MBLT_MAGIC:
        raise InputError(path, "bad MBLT magic")
    if version != 1:
        raise InputError(path, f"MBLT version {version} is not supported (expected 1)")
    if n_expert == 0:
        raise InputError(path, "MBLT header says 0 experts per layer")
    if n_expert > limits.n_experts:
        if limits.geometry:
            raise InputError(path, f"MBLT header says {n_expert} experts per layer; geometry {limits.geometry} has {limits.n_experts}")
        raise InputError(path, f"MBLT header says {n_expert} experts per layer; without --geometry at most {limits.n_experts} are accepted")
    pos, rec_no = 12, 0
    layers, blocks = [], []
    k_first = None
    prev_layer = None
    while pos < len(data):
        rec_no += 1
        where = f"{path}:record {rec_no}"
        if pos + 12 > len(data):
            warnings.append(f"{path}: record {rec_no} is torn (header cut at byte {pos}); dropped")
            break
        layer, k, n_tok = struct.unpack_from("<III", data, pos)
        if k == 0 or k > MBLT_MAX_K or n_tok == 0:
            raise InputError(where, f"implausible record (k={k}, n_tokens={n_tok}) at byte {pos}")
        if not limits.layer_ok(layer):
            raise InputError(where, f"{limits.layer_problem(layer)} (record at byte {pos})")
        need = 4 * k * n_tok
        if pos + 12 + need > len(data):
            follow = _mblt_damage_follows(data, pos, k_first, n_expert, limits) if blocks else None
            if follow is not None:
                raise InputError(where, f"record at byte {pos} claims {n_tok:,} tokens x {k} ids, more than the file holds, "
                                        f"but valid records follow at byte {follow}: the file is damaged mid-file")
            warnings.append(f"{path}: record {rec_no} is torn ({len(data) - pos - 12} of {need} id bytes); dropped")
            break
        if prev_layer is not None and layer == prev_layer:
            raise InputError(where, f"repeats layer {layer} of the same forward (record at byte {pos}); "
                                    "a new forward starts only where the layer number decreases")
        ids = np.frombuffer(data, dtype="<i4", count=k * n_tok, offset=pos + 12).reshape(n_tok, k)
        if (ids < 0).any() or (ids >= n_expert).any():
            raise InputError(where, f"expert id outside 0..{n_expert - 1} (record at byte {pos})")
        if k > 1:
            s = np.sort(ids, axis=1)
            if (s[:, 1:] == s[:, :-1]).any():
                raise InputError(where, f"an expert is selected twice in one row (record at byte {pos})")
        k_first = k_first or k
        layers.append(layer)
        blocks.append(ids)
        prev_layer = layer
        pos += 12 + need
    if not blocks:
        raise InputError(path, "no complete records")
    k = max(b.shape[1] for b in blocks)
    n_rows = np.array([b.shape[0] for b in blocks], dtype=np.int64)
    check_padding(path, int(n_rows.sum()), k, sum(b.size for b in blocks))
    rec_layer = np.array(layers, dtype=np.int64)
    rec_fwd = np.concatenate([[0], np.cumsum(np.diff(rec_layer) < 0)])
    E = np.full((int(n_rows.sum()), k), -1, dtype=np.int64)
    row = 0
    for b in blocks:
        E[row : row + b.shape[0], : b.shape[1]] = b
        row += b.shape[0]
    forward = np.repeat(rec_fwd, n_rows)
    layer = np.repeat(rec_layer, n_rows)
    position = np.concatenate([np.arange(n) for n in n_rows])
    G = np.full(E.shape, np.nan, dtype=np.float32)
    return session_from_rows(path.name, forward, layer, position, E, G), n_expert
