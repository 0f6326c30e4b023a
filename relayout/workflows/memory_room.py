"""The memory a run's control group leaves the engine: a memory limit bounds its page cache.

colibrì sizes nothing by a control group's limit (its ``[PROF] machine`` line gives the machine's
available memory), but the kernel charges the page cache to the group that reads the pages: an
engine run in a container with a memory limit (``docker --memory``, a systemd slice, a Kubernetes
pod) keeps at most that limit, less the anonymous memory charged beside it, of the container's
pages cached. ``relayout measure --engine`` runs the engine as its child, in its own group, and
records what :func:`memory_room` says when the run starts.

Reads cgroup v1 (the ``memory`` controller's ``memory.stat``: ``hierarchical_memory_limit``, the
group's and its ancestors' smallest limit, and ``total_rss``, the anonymous memory charged to it)
and cgroup v2 (``memory.max`` of the group and each ancestor up to the mount, the smallest, and
``anon`` in the ``memory.stat`` of the group that sets it). Units: bytes.

References
----------
Linux, Documentation/admin-guide/cgroup-v1/memory.rst and cgroup-v2.rst.
"""

from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 62
"""A v1 limit at or above this is no limit (the kernel prints ``PAGE_COUNTER_MAX`` pages' bytes)."""


def memory_room(proc: str | Path = "/proc/self", cgroup_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes the memory control group of process ``proc`` lets it and its children add: the
    group's memory limit (the smallest of its own and its ancestors') less the anonymous memory
    already charged to the group that sets that limit; None when no limit applies or the
    control groups cannot be read (then the machine's memory is the bound).

    Parameters
    ----------
    proc : the process's ``/proc`` directory (its ``cgroup`` file).
    cgroup_root : where the control-group file systems are mounted.
    """
    try:
        lines = (Path(proc) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    root = Path(cgroup_root)
    if v1 is not None:
        return _room_v1(root / "memory", _group_dir(root / "memory", v1))
    if v2 is not None and (root / "cgroup.controllers").is_file():
        return _room_v2(root, _group_dir(root, v2))
    return None


def _group_dir(mount: Path, path: str) -> Path:
    """The group's directory under ``mount``; the mount itself when the path is not there (a
    process in a cgroup namespace sees its own group as the root)."""
    d = mount / path.lstrip("/")
    return d if d.is_dir() else mount


def _stat(directory: Path) -> dict[str, int]:
    """A ``memory.stat`` file's ``name value`` lines; {} when it cannot be read."""
    out = {}
    try:
        text = (directory / "memory.stat").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def _room_v1(mount: Path, group: Path) -> int | None:
    limit = _stat(group).get("hierarchical_memory_limit")
    if limit is None or limit >= UNLIMITED:
        return None
    d = group                                  # the group that sets the limit: its own, or an ancestor's
    while _limit_v1(d) != limit and d != mount and mount in d.parents:
        d = d.parent
    if _limit_v1(d) != limit:                  # no group says it: the process's own
        d = group
    return max(limit - _stat(d).get("total_rss", 0), 0)


def _limit_v1(directory: Path) -> int | None:
    try:
        text = (directory / "memory.limit_in_bytes").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _room_v2(root: Path, group: Path) -> int | None:
    best, where = None, None
    d = group
    while True:
        try:
            text = (d / "memory.max").read_text().strip()
        except OSError:
            text = "max"
        if text.isdigit() and (best is None or int(text) < best):
            best, where = int(text), d
        if d == root or root not in d.parents:
            break
        d = d.parent
    if best is None:
        return None
    return max(best - _stat(where).get("anon", 0), 0)
