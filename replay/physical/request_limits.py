"""The block device's request limits, read from Linux's ``/sys/dev/block/*/queue``: the largest
request the system sends (``max_sectors_kb``), its readahead (``read_ahead_kb``), the request a
buffer of scattered base pages gets (``max_segments`` pages), and which of them calibration's reads
meet with a given kind of read buffer. Bytes; ``None`` where the system does not say.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path


def system_max_request_bytes(path: str | os.PathLike) -> int | None:
    """The largest request (bytes) the system sends the block device holding ``path``: Linux
    ``queue/max_sectors_kb`` x 1024 (a partition's is its disk's). ``None`` where the system does
    not say (not Linux, no block device behind the file system, unreadable)."""
    kb = _queue_attribute(path, "max_sectors_kb")
    return kb * 1024 if kb else None


def system_read_ahead_bytes(path: str | os.PathLike) -> int | None:
    """The readahead maximum (bytes) of the block device holding ``path``: Linux
    ``queue/read_ahead_kb`` x 1024 (0 when readahead is off). ``None`` where the system does not
    say."""
    kb = _queue_value(path, "read_ahead_kb")
    return kb * 1024 if kb is not None else None


def small_page_request_limit(path: str | os.PathLike) -> dict | None:
    """The largest request (bytes) reaching the block device holding ``path`` when the reading
    buffer is made of scattered base pages: one segment per page, so Linux ``queue/max_segments``
    x the page size. It binds when below :func:`system_max_request_bytes`, as on a virtio disk
    (254 x 4 KiB, about 1 MiB, against 4 MiB): the harness reads into huge-page buffers
    (:func:`replay.physical.buffers.read_buffer`), a runtime whose buffers are not (colibrì's,
    ``posix_memalign`` without ``MADV_HUGEPAGE``) does not reach the larger size
    (:func:`buffer_request_limit`). Returns
    ``max_segments``, ``page_bytes``, ``bytes`` and the transparent huge page mode
    (``transparent_hugepage``: ``always`` backs such buffers with huge pages, ``madvise`` only
    when asked), or ``None`` where the system does not say."""
    segments = _queue_attribute(path, "max_segments")
    if not segments:
        return None
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = None
    return {"max_segments": segments, "page_bytes": mmap.PAGESIZE, "bytes": segments * mmap.PAGESIZE,
            "transparent_hugepage": mode}


def _queue_attribute(path: str | os.PathLike, name: str) -> int | None:
    """A positive integer from ``queue/NAME`` of the block device holding ``path`` (a partition's is
    its disk's), or ``None``."""
    value = _queue_value(path, name)
    return value if value else None


def _queue_value(path: str | os.PathLike, name: str) -> int | None:
    """The integer >= 0 in ``queue/NAME`` of the block device holding ``path`` (a partition's is
    its disk's), or ``None``."""
    try:
        dev = os.stat(path).st_dev
        node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        for d in (node, node.parent):
            f = d / "queue" / name
            if f.is_file():
                value = int(f.read_text().strip())
                return value if value >= 0 else None
    except (OSError, ValueError):
        return None
    return None


def buffer_request_limit(system_bytes: int | None, small_pages: dict | None, huge_pages: bool,
                         direct: bool) -> tuple[int | None, str]:
    """The largest request (bytes, None for no known limit) calibration's reads reach the drive
    in, and why.

    Parameters
    ----------
    system_bytes : the system's limit (:func:`system_max_request_bytes`), None where unknown.
    small_pages : :func:`small_page_request_limit`'s answer (None where unknown).
    huge_pages : the reads land in huge-page buffers (the harness's) rather than colibrì's kind.
    direct : the reads bypass the page cache with O_DIRECT (only then does the buffer shape a request).

    Returns
    -------
    ``(bytes, reason)``: the system's limit, or with base-page buffers read with O_DIRECT the
    smaller of it and ``max_segments`` pages, unless ``transparent_hugepage`` is ``always``
    (then such buffers are huge pages too).
    """
    system = "the system's max_sectors_kb" if system_bytes else "no limit the system gives"
    if huge_pages:
        return system_bytes, f"{system}; huge-page buffers do not lower it"
    if not direct:
        return system_bytes, f"{system}; reads through the page cache, whose pages, not the buffer's, make the requests"
    if small_pages is None:
        return system_bytes, f"{system}; max_segments unknown"
    mode = small_pages.get("transparent_hugepage")
    if mode == "always":
        return system_bytes, f"{system}; transparent_hugepage=always makes the engine's buffers huge pages too"
    pages, segments = small_pages["bytes"], small_pages["max_segments"]
    if system_bytes and system_bytes <= pages:
        return system_bytes, f"{system}, no more than {segments} base pages"
    return pages, (f"{segments} segments of {small_pages['page_bytes'] // 1024} KiB base pages with "
                   f"transparent_hugepage={mode or 'unknown'}"
                   + (f", below the system's max_sectors_kb of {system_bytes // 1024} KiB" if system_bytes
                      else "; the system gives no other limit"))


BUFFER_REASONS = {
    "engine": "as colibrì's (posix_memalign, no huge pages asked for: huge pages only where transparent_hugepage "
              "is always)",
    "huge-pages": "the relayout harness's (transparent huge pages asked for with MADV_HUGEPAGE), not colibrì's",
}
"""What each kind of read buffer (:data:`replay.physical.buffers.BUFFER_KINDS`) is, in words."""
