"""Is a block slower the first time it is read? Old files read twice, against a freshly written one.

Usage: python benchmarks/first_read.py [--fresh-mb 600] [--dir DIR] OLD_FILE [OLD_FILE ...]

Reads each OLD_FILE (files that have sat on the disk unread, e.g. from the machine's image) whole
twice with :func:`replay.physical.calibrate.read_once` (O_DIRECT, 4 MiB chunks, 8 at a time), then writes a
file of ``--fresh-mb`` MiB of random bytes in ``--dir`` (fsynced), drops the page cache (needs
root; said when it cannot) and reads it twice the same way; prints each pass's rate side by
side and the ratio second / first pass. On a disk whose blocks read at the same speed every time
every ratio is about 1; a lazily fetched cloud volume or a host cache below a VM shows first
passes of old files well below their second and below a fresh file's. The fresh file is removed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from common import REPO  # noqa: F401  (puts the repository on sys.path)

from replay.physical.calibrate import read_once


def passes(path: Path, n: int = 2) -> list[float]:
    """Rates (bytes/s) of ``n`` whole reads of ``path``."""
    out = []
    for _ in range(n):
        nbytes, seconds = read_once([path])
        out.append(nbytes / seconds)
    return out


def drop_page_cache() -> str:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache dropped"
    except OSError as exc:
        return f"page cache NOT dropped ({exc.strerror}); O_DIRECT reads bypass it anyway where the file system allows"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", nargs="+", type=Path)
    ap.add_argument("--fresh-mb", type=int, default=600)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    print(drop_page_cache())
    rows = [(str(p), passes(p)) for p in args.old]
    fd, name = tempfile.mkstemp(prefix="relayout-first-read-", dir=args.dir)
    fresh = Path(name)
    try:
        chunk = os.urandom(1 << 20)
        with os.fdopen(fd, "wb") as fh:
            for _ in range(args.fresh_mb):
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        print(drop_page_cache())
        rows.append((f"{fresh} (just written)", passes(fresh)))
    finally:
        fresh.unlink(missing_ok=True)
    print(f"{'file':<60}{'first pass':>12}{'second pass':>13}{'second/first':>14}")
    for name, (a, b) in rows:
        print(f"{name[-60:]:<60}{a / 1e9:>9.2f} GB/s{b / 1e9:>8.2f} GB/s{b / a:>13.2f}x")


if __name__ == "__main__":
    main()
