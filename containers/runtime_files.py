"""The files colibrì's runtime keeps in a model directory, and what a rewrite does with each.

The runtime writes state next to the shards (``<SNAP>/...``). A rewrite makes the same tensors,
byte for byte and under the same names, in new shards at new offsets; whether a file is still
true of DST depends on what it records (``docs/RUNTIME_FILES.md`` has the table):

* ``.coli_usage`` (learned expert-use history), ``stats.txt`` (one run's expert-use profile) and
  ``.coli_pairs`` (cross-layer coupling table): layer and expert ids only, carried;
* ``.coli_kv`` and ``.coli_kv.<slot>`` (a saved conversation: tokens and each layer's attention
  cache, computed from tensor values and ``config.json``, both unchanged byte for byte): carried;
* ``.coli_ssd`` (``v2 <GB/s> <device number>``, the measured read rate of the drive holding the
  model): carried when DST is on that device, dropped otherwise.

None of these files names a shard or an offset. A dropped ``.coli_ssd`` costs one measurement:
the runtime discards a measurement tagged with another device and measures again. Any other
hidden file of SRC is not the runtime's, and is left behind (listed, so the user knows).

:func:`runtime_files` decides for a source directory and a destination volume;
:func:`runtime_record` is what the rewrite records in DST's manifest (``runtime_files``), and
:func:`runtime_file_problems` is what ``verify`` checks of it.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

CARRIED = "carried"
DROPPED = "dropped"
LEFT = "left behind"

_VALID_IDS = "it names layers and experts only, which a rewrite does not change; no shard, no offset"
_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"\.coli_usage"), _VALID_IDS),
    (re.compile(r"stats\.txt"), _VALID_IDS),
    (re.compile(r"\.coli_pairs"), _VALID_IDS),
    (re.compile(r"\.coli_kv(?:\.(?:0|[1-9][0-9]{0,8}))?"),
     "a saved conversation computed from the tensor values and config.json, both unchanged byte for byte"),
]
SSD_NAME = ".coli_ssd"
_SSD_V2 = re.compile(rb"v2 ([0-9]+(?:\.[0-9]+)?) ([0-9]{1,20})\n?")
SSD_MAX_BYTES = 64
"""The runtime reads a well-formed ``.coli_ssd`` of at most this many bytes."""


@dataclass(frozen=True)
class RuntimeFile:
    """What a rewrite does with one file of SRC's directory: ``action`` is :data:`CARRIED`,
    :data:`DROPPED` or :data:`LEFT` (not the runtime's); ``reason`` says why, in words."""

    name: str
    action: str
    reason: str

    def to_json(self) -> dict:
        return {"name": self.name, "action": self.action, "reason": self.reason}


def ssd_device(data: bytes) -> int | None:
    """The device number of a ``.coli_ssd`` the runtime would trust on that device, else None.

    The grammar the runtime accepts: ``v2 <GB/s> <device>``, single spaces, at most one trailing
    newline, GB/s digits with an optional fraction strictly between 0 and 1000, the device 1 to
    20 digits below 2**64, at most :data:`SSD_MAX_BYTES` bytes.
    """
    if len(data) > SSD_MAX_BYTES:
        return None
    m = _SSD_V2.fullmatch(data)
    if not m or not 0 < float(m.group(1)) < 1000:
        return None
    dev = int(m.group(2))
    return dev if dev < 2**64 else None


def _ssd(path: Path, dst_device: int) -> RuntimeFile:
    try:
        with open(path, "rb") as fh:
            dev = ssd_device(fh.read(SSD_MAX_BYTES + 1))
    except OSError as exc:
        return RuntimeFile(path.name, DROPPED, f"unreadable ({exc.strerror or exc}); the runtime measures the drive again")
    if dev is None:
        return RuntimeFile(path.name, DROPPED, "not a measurement the runtime trusts; it measures the drive again")
    if dev != dst_device:
        return RuntimeFile(path.name, DROPPED, f"measured on device {dev}, DST is on device {dst_device}; "
                                               "the runtime measures DST's drive again")
    return RuntimeFile(path.name, CARRIED, f"measured on device {dev}, the device DST is on")


def rule_for(name: str) -> str | None:
    """Why a file the runtime keeps stays valid after a rewrite (None: not such a file, or ``.coli_ssd``)."""
    for pattern, reason in _RULES:
        if pattern.fullmatch(name):
            return reason
    return None


def runtime_files(src_root: Path, dst_device: int, ordinary: set[str]) -> list[RuntimeFile]:
    """The decision for every hidden file of ``src_root`` and for each known runtime file.

    Parameters
    ----------
    src_root
        SRC's directory (read only; links are not followed: a symbolic link is left behind).
    dst_device
        ``st_dev`` of the volume DST is written on.
    ordinary
        Names of SRC's non-tensor files the rewrite copies anyway (``stats.txt`` among them when
        present): listed as carried, not copied a second time.

    Returns
    -------
    list of RuntimeFile
        By name.
    """
    out = []
    for entry in sorted(os.scandir(src_root), key=lambda e: e.name):
        name = entry.name
        known = rule_for(name) is not None or name == SSD_NAME
        if not (known or name.startswith(".")):
            continue
        try:
            st = os.lstat(entry.path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            if known or not stat.S_ISDIR(st.st_mode):
                out.append(RuntimeFile(name, LEFT, "not a regular file (a link or device is not followed)"))
            continue
        if name == SSD_NAME:
            out.append(_ssd(Path(entry.path), dst_device))
        elif known:
            note = "; copied as one of SRC's non-tensor files" if name in ordinary else ""
            out.append(RuntimeFile(name, CARRIED, rule_for(name) + note))
        elif name in ordinary:
            continue
        else:
            out.append(RuntimeFile(name, LEFT, "not a file colibrì's runtime keeps"))
    return out


def runtime_record(decisions: list[RuntimeFile], journal: dict[str, dict]) -> list[dict]:
    """DST manifest's ``runtime_files``: each decision, with size and xxh3-128 of what was copied."""
    out = []
    for d in decisions:
        entry = d.to_json()
        if d.action == CARRIED and d.name in journal:
            entry.update(size=journal[d.name]["size"], xxh3_128=journal[d.name]["xxh3_128"])
        out.append(entry)
    return out


def runtime_file_problems(record: list, src_root: Path, dst_root: Path, digest) -> tuple[list[str], list[str]]:
    """Problems of DST's carried runtime files, and notes on SRC's changes since the rewrite.

    Parameters
    ----------
    record
        DST manifest's ``runtime_files``.
    src_root, dst_root
        The two directories.
    digest
        ``digest(path) -> xxh3-128 hex`` of a whole file (as the manifests hash files).

    Returns
    -------
    tuple of list of str
        Problems (a carried copy missing or not the bytes recorded; a malformed record) and notes
        (SRC's file changed or gone since the rewrite: the runtime updates it as it runs).
    """
    problems, notes = [], []
    if not isinstance(record, list):
        return ["DST manifest: runtime_files is not a list"], notes
    for entry in record:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry.get("action") in (CARRIED, DROPPED, LEFT)):
            problems.append("DST manifest: a runtime_files entry is malformed")
            continue
        name = entry["name"]
        if entry["action"] != CARRIED or "xxh3_128" not in entry:
            continue
        path = dst_root / name
        if not path.is_file() or path.is_symlink():
            problems.append(f"file {name}: carried by the rewrite but missing from DST")
            continue
        if path.stat().st_size != entry.get("size") or digest(path) != entry["xxh3_128"]:
            problems.append(f"file {name}: DST's copy is not the bytes the rewrite carried (xxh3-128)")
            continue
        src = src_root / name
        if not src.is_file():
            notes.append(f"{name}: no longer in SRC")
        elif digest(src) != entry["xxh3_128"]:
            notes.append(f"{name}: SRC's has changed since the rewrite (the runtime updates it as it runs)")
    return problems, notes


__all__ = ["CARRIED", "DROPPED", "LEFT", "RuntimeFile", "rule_for", "runtime_file_problems", "runtime_files",
           "runtime_record", "ssd_device"]
