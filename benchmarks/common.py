"""Shared helpers for benchmark scripts: building big synthetic containers, cache control,
peak-memory measurement in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from containers.geometry import load_geometry  # noqa: E402
from containers.synth import synth_container  # noqa: E402


def extract(rev: str, into: Path) -> Path:
    """The tree of commit ``rev`` of this repository, written to ``into``."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def big_container(root: Path, gigabytes: float, seed: int = 0) -> Path:
    """A GLM-5.2 int4-row container with full-size 18.9 MB experts, about ``gigabytes`` GB."""
    g = load_geometry("glm-5.2-int4-row")
    experts = 32
    layers = max(1, round(gigabytes * 1e9 / (experts * g.expert_bytes(3))))
    g = g.scaled(moe_layers=layers, experts=experts, vocab=4096, shard_bytes=500_000_000)
    out = root / f"glm-{gigabytes:g}gb-s{seed}"
    if not out.exists():
        synth_container(out, g, seed=seed)
    return out


def drop_file_cache(paths) -> bool:
    """Evict ``paths`` from the page cache; True when the kernel accepted it."""
    ok = True
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def plain_read(paths, chunk: int = 16 << 20) -> int:
    """Sequentially read every file into one reused buffer; returns bytes read."""
    buf = bytearray(chunk)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                total += n
    return total


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t, out


def child_peak_rss_mb(code: str) -> float:
    """Run python ``code`` in a fresh process and return its peak RSS in MB.

    The peak is the child's own ``VmHWM`` (Linux), read just before it exits: the high-water
    mark of the child's address space after exec. (``ru_maxrss`` would include the pages of this
    possibly large parent that the child had before exec.)
    """
    probe = "; print('VmHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); {code}{probe}"],
                         check=True, capture_output=True, text=True).stdout
    kb = [line.split()[1] for line in out.splitlines() if line.startswith("VmHWM")][-1]
    return int(kb) / 1024
